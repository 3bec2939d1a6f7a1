// The part of ONNX Runtime's C API this host calls, declared here from the documented ABI.
//
// ONNX Runtime exports one symbol, OrtGetApiBase. It returns two functions: GetApi(version), a
// pointer to the API table, and GetVersionString. The table is an append-only array of function
// pointers: a function keeps its index in every release, so a host that knows the index and the
// signature of each function it uses needs no header. The indices below were counted in the
// order of ONNX Runtime's public C API documentation (the OrtApi struct); tests/test_host.py
// proves each one by calling it (docs/host.md lists how).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace sg::ort {

// Opaque ONNX Runtime objects.
struct Status;
struct Env;
struct Session;
struct SessionOptions;
struct Value;
struct MemoryInfo;
struct IoBinding;
struct TypeInfo;
struct TensorInfo;  // OrtTensorTypeAndShapeInfo
struct RunOptions;

// OrtAllocator is a public struct: a version, then Alloc, Free and Info function pointers.
struct Allocator {
  uint32_t version;
  void* (*Alloc)(Allocator*, size_t);
  void (*Free)(Allocator*, void*);
  const MemoryInfo* (*Info)(const Allocator*);
};

// ONNX element types (the numbering of onnx.TensorProto.DataType).
enum ElementType : int { kFloat = 1, kInt64 = 7, kBool = 9 };
enum LoggingLevel : int { kVerbose = 0, kInfo = 1, kWarning = 2, kError = 3, kFatal = 4 };
enum ErrorCode : int { kOk = 0, kFail = 1, kInvalidArgument = 2, kNoSuchFile = 3 };
constexpr int kEnableAll = 99;         // GraphOptimizationLevel ORT_ENABLE_ALL
constexpr int kArenaAllocator = 1;     // OrtAllocatorType
constexpr int kMemTypeDefault = 0;     // OrtMemType
constexpr uint32_t kApiVersion = 32;   // ONNX Runtime 1.32's ORT_API_VERSION
constexpr const char* kExpectedVersion = "1.32.0";

// Each slot: its index in the table and the signature the documentation gives it.
struct Api {
  ErrorCode (*GetErrorCode)(const Status*);                                               // 1
  const char* (*GetErrorMessage)(const Status*);                                          // 2
  Status* (*CreateEnv)(LoggingLevel, const char* logid, Env** out);                       // 3
  Status* (*CreateSession)(const Env*, const char* path, const SessionOptions*, Session** out);  // 7
  Status* (*CreateSessionOptions)(SessionOptions** out);                                  // 10
  Status* (*SetSessionLogSeverityLevel)(SessionOptions*, int level);                      // 22
  Status* (*SetSessionGraphOptimizationLevel)(SessionOptions*, int level);                // 23
  Status* (*SetIntraOpNumThreads)(SessionOptions*, int threads);                          // 24
  Status* (*SetInterOpNumThreads)(SessionOptions*, int threads);                          // 25
  Status* (*SessionGetInputCount)(const Session*, size_t* out);                           // 30
  Status* (*SessionGetOutputCount)(const Session*, size_t* out);                          // 31
  Status* (*SessionGetInputTypeInfo)(const Session*, size_t index, TypeInfo** out);      // 33
  Status* (*SessionGetOutputTypeInfo)(const Session*, size_t index, TypeInfo** out);     // 34
  Status* (*SessionGetInputName)(const Session*, size_t index, Allocator*, char** out);  // 36
  Status* (*SessionGetOutputName)(const Session*, size_t index, Allocator*, char** out); // 37
  Status* (*CreateTensorWithDataAsOrtValue)(const MemoryInfo*, void* data, size_t bytes, const int64_t* shape,
                                            size_t rank, int type, Value** out);         // 49
  Status* (*GetTensorMutableData)(Value*, void** out);                                    // 51
  Status* (*CastTypeInfoToTensorInfo)(const TypeInfo*, const TensorInfo** out);          // 55
  Status* (*GetTensorElementType)(const TensorInfo*, int* out);                           // 60
  Status* (*GetDimensionsCount)(const TensorInfo*, size_t* out);                          // 61
  Status* (*GetDimensions)(const TensorInfo*, int64_t* out, size_t n);                    // 62
  Status* (*GetTensorTypeAndShape)(const Value*, TensorInfo** out);                       // 65
  Status* (*CreateCpuMemoryInfo)(int allocator_type, int mem_type, MemoryInfo** out);     // 69
  Status* (*AllocatorFree)(Allocator*, void* p);                                          // 76
  Status* (*GetAllocatorWithDefaultOptions)(Allocator** out);                             // 78
  void (*ReleaseEnv)(Env*);                                                               // 92
  void (*ReleaseStatus)(Status*);                                                         // 93
  void (*ReleaseMemoryInfo)(MemoryInfo*);                                                 // 94
  void (*ReleaseSession)(Session*);                                                       // 95
  void (*ReleaseValue)(Value*);                                                           // 96
  void (*ReleaseTypeInfo)(TypeInfo*);                                                     // 98
  void (*ReleaseTensorTypeAndShapeInfo)(TensorInfo*);                                     // 99
  void (*ReleaseSessionOptions)(SessionOptions*);                                         // 100
  Status* (*RegisterCustomOpsLibrary_V2)(SessionOptions*, const char* path);              // 228
  Status* (*RunWithBinding)(Session*, const RunOptions*, const IoBinding*);               // 133
  Status* (*CreateIoBinding)(Session*, IoBinding** out);                                  // 134
  void (*ReleaseIoBinding)(IoBinding*);                                                   // 135
  Status* (*BindInput)(IoBinding*, const char* name, const Value*);                       // 136
  Status* (*BindOutput)(IoBinding*, const char* name, const Value*);                      // 137
  Status* (*BindOutputToDevice)(IoBinding*, const char* name, const MemoryInfo*);         // 138
  Status* (*GetBoundOutputValues)(const IoBinding*, Allocator*, Value*** out, size_t* n); // 140
  void (*ClearBoundInputs)(IoBinding*);                                                   // 141
  void (*ClearBoundOutputs)(IoBinding*);                                                  // 142
};

// A loaded ONNX Runtime: the dlopen handle, its version string and the typed slots.
struct Library {
  void* handle = nullptr;
  std::string path;
  std::string version;
  Api api{};
};

// dlopen `path` (empty: $SPECGRAPH_ORT_LIB, else libonnxruntime.so.1), check its version and fill
// the slots. Throws sg::Failure(SG_ERR_RUNTIME) naming what is wrong.
Library open_library(const std::string& path);
void close_library(Library& lib);

// Throw sg::Failure(code, context + ": " + ONNX Runtime's message) if `status` is an error.
void check(const Api& api, Status* status, int code, const std::string& context);

}  // namespace sg::ort
