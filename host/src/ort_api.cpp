// Loading ONNX Runtime with dlopen and filling the API slots this host uses (see ort_api.h).
#include "ort_api.h"

#include <dlfcn.h>

#include <cstdlib>

#include "error.h"
#include "ort_table.h"

namespace sg::ort {
namespace {

void fill(const Fn* t, Api& a) {
  take(t, 1, a.GetErrorCode);
  take(t, 2, a.GetErrorMessage);
  take(t, 3, a.CreateEnv);
  take(t, 7, a.CreateSession);
  take(t, 10, a.CreateSessionOptions);
  take(t, 22, a.SetSessionLogSeverityLevel);
  take(t, 23, a.SetSessionGraphOptimizationLevel);
  take(t, 24, a.SetIntraOpNumThreads);
  take(t, 25, a.SetInterOpNumThreads);
  take(t, 30, a.SessionGetInputCount);
  take(t, 31, a.SessionGetOutputCount);
  take(t, 33, a.SessionGetInputTypeInfo);
  take(t, 34, a.SessionGetOutputTypeInfo);
  take(t, 36, a.SessionGetInputName);
  take(t, 37, a.SessionGetOutputName);
  take(t, 49, a.CreateTensorWithDataAsOrtValue);
  take(t, 51, a.GetTensorMutableData);
  take(t, 55, a.CastTypeInfoToTensorInfo);
  take(t, 60, a.GetTensorElementType);
  take(t, 61, a.GetDimensionsCount);
  take(t, 62, a.GetDimensions);
  take(t, 65, a.GetTensorTypeAndShape);
  take(t, 69, a.CreateCpuMemoryInfo);
  take(t, 76, a.AllocatorFree);
  take(t, 78, a.GetAllocatorWithDefaultOptions);
  take(t, 92, a.ReleaseEnv);
  take(t, 93, a.ReleaseStatus);
  take(t, 94, a.ReleaseMemoryInfo);
  take(t, 95, a.ReleaseSession);
  take(t, 96, a.ReleaseValue);
  take(t, 98, a.ReleaseTypeInfo);
  take(t, 99, a.ReleaseTensorTypeAndShapeInfo);
  take(t, 100, a.ReleaseSessionOptions);
  take(t, 228, a.RegisterCustomOpsLibrary_V2);
  take(t, 133, a.RunWithBinding);
  take(t, 134, a.CreateIoBinding);
  take(t, 135, a.ReleaseIoBinding);
  take(t, 136, a.BindInput);
  take(t, 137, a.BindOutput);
  take(t, 138, a.BindOutputToDevice);
  take(t, 140, a.GetBoundOutputValues);
  take(t, 141, a.ClearBoundInputs);
  take(t, 142, a.ClearBoundOutputs);
}

std::string default_path() {
  const char* env = std::getenv("SPECGRAPH_ORT_LIB");
  return env && *env ? env : "libonnxruntime.so.1";
}

}  // namespace

Library open_library(const std::string& requested) {
  Library lib;
  lib.path = requested.empty() ? default_path() : requested;
  lib.handle = dlopen(lib.path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (!lib.handle) {
    const char* why = dlerror();
    runtime_error("cannot load ONNX Runtime from " + lib.path + " (" + (why ? why : "unknown error") +
                  "); pass --ort-lib or set SPECGRAPH_ORT_LIB to libonnxruntime.so");
  }
  auto get_base = reinterpret_cast<const ApiBase* (*)()>(dlsym(lib.handle, "OrtGetApiBase"));
  const ApiBase* base = get_base ? get_base() : nullptr;
  if (!base) {
    dlclose(lib.handle);
    runtime_error(lib.path + " is not ONNX Runtime (it has no OrtGetApiBase)");
  }
  lib.version = base->GetVersionString();
  const Fn* table = base->GetApi(kApiVersion);
  if (!table) {
    dlclose(lib.handle);
    runtime_error("ONNX Runtime " + lib.version + " at " + lib.path + " does not offer C API version " +
                  std::to_string(kApiVersion) + "; this host needs ONNX Runtime 1.32 or later");
  }
  fill(table, lib.api);
  return lib;
}

void close_library(Library& lib) {
  if (lib.handle) dlclose(lib.handle);
  lib.handle = nullptr;
}

void check(const Api& api, Status* status, int code, const std::string& context) {
  if (!status) return;
  std::string message = api.GetErrorMessage(status);
  api.ReleaseStatus(status);
  throw Failure(code, context + ": " + message);
}

}  // namespace sg::ort
