// specgraph-host-check: the host's parts, one at a time, for tests/test_host.py.
//   uniforms SEED N        the first N uniforms of SEED, as float32 bit patterns (one per line)
//   sha256 FILE            the file's sha256
//   ort-slots LIB BUNDLE   call every ONNX Runtime slot the host uses and check what each returns
//                          ("ok SLOT NAME: evidence" per check, "FAIL ..." and exit 1 otherwise)
#include <dirent.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "bundle.h"
#include "error.h"
#include "ort_api.h"
#include "sha256.h"
#include "uniforms.h"

namespace {

using namespace sg;

int failures = 0;

void report(bool ok, int slot, const char* name, const std::string& evidence) {
  std::printf("%s %d %s: %s\n", ok ? "ok" : "FAIL", slot, name, evidence.c_str());
  failures += ok ? 0 : 1;
}

int threads_now() {
  int n = 0;
  if (DIR* d = opendir("/proc/self/task")) {
    while (dirent* e = readdir(d)) n += e->d_name[0] != '.';
    closedir(d);
  }
  return n;
}

// Run fn with stderr sent to a temporary file; return how many bytes it wrote there.
template <typename Fn>
long stderr_bytes(Fn fn) {
  std::fflush(stderr);
  char path[] = "/tmp/sg-check-XXXXXX";
  int fd = mkstemp(path);
  int saved = dup(2);
  dup2(fd, 2);
  fn();
  std::fflush(stderr);
  dup2(saved, 2);
  close(saved);
  struct stat st {};
  fstat(fd, &st);
  close(fd);
  unlink(path);
  return long(st.st_size);
}

int dtype_of(const std::string& dtype) {
  return dtype == "float32" ? ort::kFloat : dtype == "int64" ? ort::kInt64 : dtype == "bool" ? ort::kBool : -1;
}

int ort_slots(const std::string& lib_path, const std::string& bundle) {
  ort::Library lib = ort::open_library(lib_path);
  const ort::Api& a = lib.api;
  Manifest m = read_bundle(bundle, false);
  std::printf("version %s\n", lib.version.c_str());

  ort::Env* env = nullptr;
  ort::Status* st = a.CreateEnv(ort::kWarning, "check", &env);
  report(!st && env, 3, "CreateEnv", "status OK and an env");

  // Errors: a missing model file gives a status whose code and message say so.
  ort::SessionOptions* so = nullptr;
  st = a.CreateSessionOptions(&so);
  report(!st && so, 10, "CreateSessionOptions", "status OK and options");
  ort::Session* session = nullptr;
  st = a.CreateSession(env, "/nonexistent/specgraph-check.onnx", so, &session);
  report(st != nullptr && !session, 7, "CreateSession", "a missing file is an error");
  if (st) {
    ort::ErrorCode code = a.GetErrorCode(st);
    std::string message = a.GetErrorMessage(st);
    report(code == ort::kNoSuchFile || code == ort::kFail, 1, "GetErrorCode", "code " + std::to_string(code));
    report(message.find("specgraph-check.onnx") != std::string::npos, 2, "GetErrorMessage", "names the file");
    a.ReleaseStatus(st);
    report(true, 93, "ReleaseStatus", "released");
  }

  // Session options: an invalid optimisation level is refused, valid settings are accepted.
  st = a.SetSessionGraphOptimizationLevel(so, 42);
  report(st != nullptr, 23, "SetSessionGraphOptimizationLevel", "level 42 refused");
  if (st) a.ReleaseStatus(st);
  st = a.SetSessionGraphOptimizationLevel(so, ort::kEnableAll);
  report(!st, 23, "SetSessionGraphOptimizationLevel", "ORT_ENABLE_ALL accepted");
  report(!a.SetInterOpNumThreads(so, 1), 25, "SetInterOpNumThreads", "1 accepted");
  report(!a.SetIntraOpNumThreads(so, 4), 24, "SetIntraOpNumThreads", "4 accepted");

  // Session log severity: verbose logs while a session loads, errors only prints nothing.
  std::string graph = bundle + "/" + m.graph_file;
  long loud = stderr_bytes([&] {
    report(!a.SetSessionLogSeverityLevel(so, ort::kVerbose), 22, "SetSessionLogSeverityLevel", "verbose accepted");
    ort::Session* s = nullptr;
    ort::Status* e = a.CreateSession(env, graph.c_str(), so, &s);
    if (e) a.ReleaseStatus(e);
    if (s) a.ReleaseSession(s);
  });
  report(!a.SetSessionLogSeverityLevel(so, ort::kError), 22, "SetSessionLogSeverityLevel", "error accepted");
  int before = threads_now();
  long quiet = stderr_bytes([&] { st = a.CreateSession(env, graph.c_str(), so, &session); });
  int added = threads_now() - before;
  report(loud > 0 && quiet == 0, 22, "SetSessionLogSeverityLevel",
         "verbose wrote " + std::to_string(loud) + " bytes, errors-only " + std::to_string(quiet));
  report(!st && session, 7, "CreateSession", "the bundle's graph loads");
  report(added == 3, 24, "SetIntraOpNumThreads", "4 intra-op threads started " + std::to_string(added) +
                                                   " pool threads (the caller is the fourth)");
  if (!session) return 1;

  // The session's inputs and outputs are the manifest's, in order, with their types and shapes.
  ort::Allocator* alloc = nullptr;
  st = a.GetAllocatorWithDefaultOptions(&alloc);
  report(!st && alloc && alloc->Info && alloc->Info(alloc), 78, "GetAllocatorWithDefaultOptions",
         "an allocator that describes its memory");
  for (int side = 0; side < 2; ++side) {
    bool input = side == 0;
    const std::vector<TensorSpec>& want = input ? m.inputs : m.outputs;
    size_t n = 0;
    st = (input ? a.SessionGetInputCount : a.SessionGetOutputCount)(session, &n);
    report(!st && n == want.size(), input ? 30 : 31, input ? "SessionGetInputCount" : "SessionGetOutputCount",
           std::to_string(n) + " values, the manifest lists " + std::to_string(want.size()));
    bool names = true, types = true;
    for (size_t i = 0; i < n && i < want.size(); ++i) {
      char* name = nullptr;
      st = (input ? a.SessionGetInputName : a.SessionGetOutputName)(session, i, alloc, &name);
      names = names && !st && name && want[i].name == name;
      if (name) a.AllocatorFree(alloc, name);
      ort::TypeInfo* type = nullptr;
      st = (input ? a.SessionGetInputTypeInfo : a.SessionGetOutputTypeInfo)(session, i, &type);
      const ort::TensorInfo* info = nullptr;
      if (!st && type && !a.CastTypeInfoToTensorInfo(type, &info) && info) {
        int element = 0;
        size_t rank = 0;
        a.GetTensorElementType(info, &element);
        a.GetDimensionsCount(info, &rank);
        std::vector<int64_t> dims(rank);
        a.GetDimensions(info, dims.data(), rank);
        types = types && element == dtype_of(want[i].dtype) && dims == want[i].dims;
      } else {
        types = false;
      }
      if (type) a.ReleaseTypeInfo(type);
    }
    report(names, input ? 36 : 37, input ? "SessionGetInputName" : "SessionGetOutputName",
           "every name as the manifest lists it (freed with AllocatorFree, slot 76)");
    report(types, input ? 33 : 34, input ? "SessionGetInputTypeInfo" : "SessionGetOutputTypeInfo",
           "element types and dimensions as the manifest lists them (slots 55, 60, 61, 62, 98)");
  }

  // Tensors over our buffers: the data pointer, type and shape come back as given.
  ort::MemoryInfo* cpu = nullptr;
  st = a.CreateCpuMemoryInfo(ort::kArenaAllocator, ort::kMemTypeDefault, &cpu);
  report(!st && cpu, 69, "CreateCpuMemoryInfo", "CPU memory info");
  int64_t buffer[6] = {1, 2, 3, 4, 5, 6};
  int64_t shape[2] = {2, 3};
  ort::Value* value = nullptr;
  st = a.CreateTensorWithDataAsOrtValue(cpu, buffer, sizeof buffer, shape, 2, ort::kInt64, &value);
  report(!st && value, 49, "CreateTensorWithDataAsOrtValue", "a [2, 3] int64 tensor");
  void* data = nullptr;
  st = a.GetTensorMutableData(value, &data);
  report(!st && data == buffer, 51, "GetTensorMutableData", "the very buffer given");
  ort::TensorInfo* info = nullptr;
  st = a.GetTensorTypeAndShape(value, &info);
  int element = 0;
  size_t rank = 0;
  int64_t dims[2] = {0, 0};
  if (!st) {
    a.GetTensorElementType(info, &element);
    a.GetDimensionsCount(info, &rank);
    a.GetDimensions(info, dims, 2);
    a.ReleaseTensorTypeAndShapeInfo(info);
  }
  report(element == ort::kInt64 && rank == 2 && dims[0] == 2 && dims[1] == 3, 65, "GetTensorTypeAndShape",
         "int64 [2, 3] (released with slot 99)");
  a.ReleaseValue(value);

  // I/O binding: a prefill whose caches are written into our zeroed buffers.
  ort::IoBinding* io = nullptr;
  st = a.CreateIoBinding(session, &io);
  report(!st && io, 134, "CreateIoBinding", "a binding");
  std::vector<std::vector<uint8_t>> buffers;
  std::vector<ort::Value*> values;
  auto tensor = [&](int type, std::vector<int64_t> dims, const void* init) {
    size_t count = 1;
    for (int64_t d : dims) count *= size_t(d);
    size_t bytes = count * (type == ort::kFloat ? 4 : type == ort::kInt64 ? 8 : 1);
    buffers.emplace_back(bytes, 0);
    if (init) std::memcpy(buffers.back().data(), init, bytes);
    ort::Value* v = nullptr;
    ort::Status* s = a.CreateTensorWithDataAsOrtValue(cpu, buffers.back().data(), bytes, dims.data(), dims.size(),
                                                      type, &v);
    if (s) a.ReleaseStatus(s);
    values.push_back(v);
    return v;
  };
  buffers.reserve(256);
  int64_t prompt[3] = {1, 2, 3}, three = 3, zero = 0;
  float uniforms_zero = 0;
  bool bound = !a.BindInput(io, "tokens", tensor(ort::kInt64, {1, 3}, prompt));
  bound = bound && !a.BindInput(io, "n_fixed", tensor(ort::kInt64, {1}, &three));
  bound = bound && !a.BindInput(io, "cache_len", tensor(ort::kInt64, {1}, &zero));
  std::string cache_input, cache_output;
  ort::Value* cache = nullptr;
  size_t cache_index = 0;
  for (const auto& name : m.state) {
    std::vector<int64_t> d = m.input(name)->dims;
    d[0] = 1;
    ort::Value* v = tensor(dtype_of(m.input(name)->dtype), d, nullptr);
    bound = bound && !a.BindInput(io, name.c_str(), v);
    if (!cache && m.input(name)->dtype == "float32" && name.rfind("past_", 0) == 0) {  // a KV cache
      cache = v;
      cache_input = name;
      cache_index = buffers.size() - 1;
    }
  }
  for (const auto& c : m.constants) {
    bound = bound && !a.BindInput(io, c.name.c_str(), tensor(dtype_of(c.dtype), c.shape, c.bytes.data()));
  }
  if (m.sampling) {
    float t = 0, p = 1;
    const int64_t width = m.input("uniforms")->dims[1];  // R * (max_context + 1)
    std::vector<float> u(size_t(width), uniforms_zero);
    bound = bound && !a.BindInput(io, "temperature", tensor(ort::kFloat, {1}, &t));
    bound = bound && !a.BindInput(io, "top_k", tensor(ort::kInt64, {1}, &zero));
    bound = bound && !a.BindInput(io, "top_p", tensor(ort::kFloat, {1}, &p));
    bound = bound && !a.BindInput(io, "uniforms", tensor(ort::kFloat, {1, width}, u.data()));
  }
  report(bound, 136, "BindInput", "every input bound");
  bool outs = true;
  for (const auto& o : m.outputs) {
    const std::string* target = m.bound_input(o.name);
    if (m.is_in_place(o.name) && target && *target == cache_input) {
      cache_output = o.name;
      outs = outs && !a.BindOutput(io, o.name.c_str(), cache);
    } else {
      outs = outs && !a.BindOutputToDevice(io, o.name.c_str(), cpu);
    }
  }
  report(outs && !cache_output.empty(), 137, "BindOutput", cache_output + " bound onto " + cache_input);
  report(outs, 138, "BindOutputToDevice", "the other outputs bound to CPU memory");
  st = a.RunWithBinding(session, nullptr, io);
  std::string why = st ? a.GetErrorMessage(st) : "";
  if (st) a.ReleaseStatus(st);
  report(!st, 133, "RunWithBinding", why.empty() ? "prefill ran" : why);
  bool written = false;
  for (uint8_t b : buffers[cache_index]) written = written || b != 0;
  report(written, 137, "BindOutput", cache_output + " was written into " + cache_input + "'s own buffer");
  ort::Value** outputs = nullptr;
  size_t count = 0;
  st = a.GetBoundOutputValues(io, alloc, &outputs, &count);
  bool first_token = false;
  if (!st && count == m.outputs.size()) {
    for (size_t i = 0; i < count; ++i) {
      if (m.outputs[i].name == "n_accepted") {
        void* p = nullptr;
        a.GetTensorMutableData(outputs[i], &p);
        first_token = p && *static_cast<int64_t*>(p) == 1;  // prefill emits one token
      }
    }
  }
  for (size_t i = 0; i < count; ++i) a.ReleaseValue(outputs[i]);
  if (outputs) a.AllocatorFree(alloc, outputs);
  report(!st && count == m.outputs.size() && first_token, 140, "GetBoundOutputValues",
         std::to_string(count) + " outputs in bound order, n_accepted = 1 (array freed with slot 76)");
  a.ClearBoundOutputs(io);
  st = a.GetBoundOutputValues(io, alloc, &outputs, &count);
  report(!st && count == 0, 142, "ClearBoundOutputs", "no outputs bound afterwards");
  if (st) a.ReleaseStatus(st);
  a.ClearBoundInputs(io);
  for (const auto& o : m.outputs) a.BindOutputToDevice(io, o.name.c_str(), cpu);
  stderr_bytes([&] { st = a.RunWithBinding(session, nullptr, io); });  // ONNX Runtime logs the failure
  report(st != nullptr, 141, "ClearBoundInputs", "a run without inputs fails");
  if (st) a.ReleaseStatus(st);

  // Releases: each takes its object (a wrong slot would crash or leak here).
  a.ReleaseIoBinding(io);
  for (ort::Value* v : values) a.ReleaseValue(v);
  a.ReleaseMemoryInfo(cpu);
  a.ReleaseSession(session);
  a.ReleaseSessionOptions(so);
  a.ReleaseEnv(env);
  report(true, 135, "ReleaseIoBinding", "with slots 94, 95, 96, 100, 92: every object released");
  std::printf("%s\n", failures ? "FAILED" : "ALL OK");
  return failures ? 1 : 0;
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<std::string> args(argv + 1, argv + argc);
  try {
    if (args.size() == 3 && args[0] == "uniforms") {
      std::vector<float> u = uniform_stream(std::strtoull(args[1].c_str(), nullptr, 10), std::strtoul(args[2].c_str(), nullptr, 10));
      for (float f : u) {
        uint32_t bits;
        std::memcpy(&bits, &f, 4);
        std::printf("%u\n", bits);
      }
      return 0;
    }
    if (args.size() == 2 && args[0] == "sha256") {
      struct stat st {};
      if (stat(args[1].c_str(), &st) != 0) return 2;
      std::printf("%s\n", sha256_file(args[1], uint64_t(st.st_size)).c_str());
      return 0;
    }
    if (args.size() == 3 && args[0] == "ort-slots") return ort_slots(args[1], args[2]);
  } catch (const Failure& e) {
    std::fprintf(stderr, "specgraph-host-check: error: %s\n", e.what());
    return e.code();
  }
  std::fprintf(stderr, "usage: specgraph-host-check uniforms SEED N | sha256 FILE | ort-slots LIB BUNDLE\n");
  return 2;
}
