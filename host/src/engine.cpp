// The engine: one ONNX Runtime session over the bundle's step engine, and the loop of
// specgraph/runtime.py's Engine.generate_batch for one row.
#include "engine.h"

#include <dlfcn.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <random>
#include <set>

#include "error.h"
#include "format.h"
#include "uniforms.h"

namespace sg {
namespace {

const char* kSamplingInputs[] = {"temperature", "top_k", "top_p", "uniforms"};
const char* kRead[] = {"accepted", "n_accepted", "next_tokens", "cache_len_out"};

// specgraph's operator library: $SPECGRAPH_KERNELS_LIB, else libspecgraph_kernels.so beside the
// binary that holds this code (host/build/, where the same CMake build puts both).
std::string kernels_library() {
  const char* env = std::getenv("SPECGRAPH_KERNELS_LIB");
  if (env && *env) return env;
  Dl_info info{};
  std::string dir = ".";
  if (dladdr(reinterpret_cast<void*>(&kernels_library), &info) && info.dli_fname) {
    std::string self = info.dli_fname;
    size_t slash = self.rfind('/');
    if (slash != std::string::npos) dir = self.substr(0, slash);
  }
  return dir + "/libspecgraph_kernels.so";
}

size_t element_size(int type) { return type == ort::kFloat ? 4 : type == ort::kInt64 ? 8 : 1; }

int64_t product(const std::vector<int64_t>& dims) {
  int64_t n = 1;
  for (int64_t d : dims) n *= d;
  return n;
}

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

// A fresh seed when sampling without one (Python's secrets.randbits(63)).
uint64_t fresh_seed() {
  std::random_device device;
  uint64_t high = device(), low = device();
  return ((high << 32) | low) & ((uint64_t(1) << 63) - 1);
}

}  // namespace

double Generation::mean_accepted() const {
  double made = double(std::max<int64_t>(int64_t(output_ids.size()) - 1, 0));
  return steps() ? made / double(steps()) : double(!output_ids.empty());
}

double Generation::tokens_per_s() const {
  double made = double(std::max<int64_t>(int64_t(output_ids.size()) - 1, 0));
  return decode_s > 0 ? made / decode_s : 0.0;
}

// --- tensors ------------------------------------------------------------------------------------

HostTensor::HostTensor(const ort::Library& lib, const ort::MemoryInfo* cpu, int type, std::vector<int64_t> shape,
                       const void* data)
    : lib_(lib) {
  size_t bytes = size_t(product(shape)) * element_size(type);
  buffer_.reset(new uint8_t[std::max<size_t>(bytes, 1)]);
  if (data) {
    std::memcpy(buffer_.get(), data, bytes);
  } else {
    std::memset(buffer_.get(), 0, bytes);
  }
  ort::check(lib.api,
             lib.api.CreateTensorWithDataAsOrtValue(cpu, buffer_.get(), bytes, shape.data(), shape.size(), type, &value_),
             SG_ERR_RUNTIME, "cannot create a tensor");
}

HostTensor::~HostTensor() {
  if (value_) lib_.api.ReleaseValue(value_);
}

// What one call returned: every output by name, owned here.
struct Engine::Outputs {
  const ort::Api& api;
  std::map<std::string, ort::Value*> values;
  explicit Outputs(const ort::Api& a) : api(a) {}
  ~Outputs() {
    for (auto& kv : values) api.ReleaseValue(kv.second);
  }
  ort::Value* at(const std::string& name) const { return values.at(name); }

  std::vector<int64_t> dims(const std::string& name) const {
    ort::TensorInfo* info = nullptr;
    ort::check(api, api.GetTensorTypeAndShape(values.at(name), &info), SG_ERR_BUNDLE, "output " + name);
    size_t rank = 0;
    api.GetDimensionsCount(info, &rank);
    std::vector<int64_t> out(rank);
    api.GetDimensions(info, out.data(), rank);
    api.ReleaseTensorTypeAndShapeInfo(info);
    return out;
  }

  const int64_t* ints(const std::string& name) const {
    void* p = nullptr;
    ort::check(api, api.GetTensorMutableData(values.at(name), &p), SG_ERR_BUNDLE, "output " + name);
    return static_cast<const int64_t*>(p);
  }
};

// --- loading ------------------------------------------------------------------------------------

Engine::Engine(const std::string& bundle, const sg_load_options& options) {
  long cores = sysconf(_SC_NPROCESSORS_ONLN);
  if (options.threads < 0 || options.threads > std::max(cores, 1L)) {
    input_error("threads must be an integer from 1 to " + std::to_string(std::max(cores, 1L)) +
                " (the cores of this machine), got " + std::to_string(options.threads));
  }
  const char* from_model = std::getenv("ORT_LOAD_CONFIG_FROM_MODEL");
  if (from_model && std::string(from_model) == "1") {
    input_error("ORT_LOAD_CONFIG_FROM_MODEL=1 would let the bundle choose ONNX Runtime's session options; unset it");
  }
  manifest_ = read_bundle(bundle, options.verify != 0);
  lib_ = ort::open_library(options.ort_library ? options.ort_library : "");
  const ort::Api& api = lib_.api;
  try {
    ort::check(api, api.CreateEnv(ort::kError, "specgraph-host", &env_), SG_ERR_RUNTIME, "ONNX Runtime");
    ort::SessionOptions* so = nullptr;
    ort::check(api, api.CreateSessionOptions(&so), SG_ERR_RUNTIME, "ONNX Runtime session options");
    std::unique_ptr<ort::SessionOptions, void (*)(ort::SessionOptions*)> hold(so, api.ReleaseSessionOptions);
    // TensorScatter logs each cache update it cannot do in place as a warning: errors only.
    ort::check(api, api.SetSessionLogSeverityLevel(so, ort::kError), SG_ERR_RUNTIME, "session options");
    ort::check(api, api.SetSessionGraphOptimizationLevel(so, ort::kEnableAll), SG_ERR_RUNTIME, "session options");
    if (options.threads > 0) {
      ort::check(api, api.SetIntraOpNumThreads(so, options.threads), SG_ERR_RUNTIME, "session options");
    }
    ort::check(api, api.SetInterOpNumThreads(so, 1), SG_ERR_RUNTIME, "session options");
    if (manifest_.native_kernels) {  // the operators come from this host's own build, never from the bundle
      std::string lib = kernels_library();
      ort::check(api, api.RegisterCustomOpsLibrary_V2(so, lib.c_str()), SG_ERR_RUNTIME,
                 bundle + " runs specgraph's native kernels: cannot load " + lib +
                     " (build it with sh scripts/install.sh, or set SPECGRAPH_KERNELS_LIB)");
    }
    std::string graph = bundle + "/" + manifest_.graph_file;
    ort::check(api, api.CreateSession(env_, graph.c_str(), so, &session_), SG_ERR_BUNDLE,
               bundle + ": ONNX Runtime cannot load " + manifest_.graph_file);
    ort::check(api, api.CreateCpuMemoryInfo(ort::kArenaAllocator, ort::kMemTypeDefault, &cpu_), SG_ERR_RUNTIME,
               "ONNX Runtime memory info");
    ort::check(api, api.GetAllocatorWithDefaultOptions(&allocator_), SG_ERR_RUNTIME, "ONNX Runtime allocator");
    check_graph();
    for (const auto& c : manifest_.constants) {
      constants_.push_back(std::make_unique<HostTensor>(lib_, cpu_, element_type(c.dtype), c.shape, c.bytes.data()));
    }
  } catch (...) {
    constants_.clear();
    if (session_) api.ReleaseSession(session_);
    if (cpu_) api.ReleaseMemoryInfo(cpu_);
    if (env_) api.ReleaseEnv(env_);
    throw;
  }
}

Engine::~Engine() {
  const ort::Api& api = lib_.api;
  constants_.clear();
  api.ReleaseSession(session_);
  api.ReleaseMemoryInfo(cpu_);
  api.ReleaseEnv(env_);
  // ONNX Runtime stays loaded: unloading it under live thread pools or static objects is unsafe.
}

int Engine::element_type(const std::string& dtype) const {
  return dtype == "float32" ? ort::kFloat : dtype == "int64" ? ort::kInt64 : dtype == "bool" ? ort::kBool : -1;
}

// The graph ONNX Runtime loaded has the inputs and outputs the manifest declares, and the host can
// feed every input and read every output it needs (runtime.py's _check_graph, from the manifest).
void Engine::check_graph() {
  const ort::Api& api = lib_.api;
  struct Found {
    int type = 0;
    std::vector<int64_t> dims;
  };
  auto describe = [&](bool input, size_t i, std::string& name) {
    char* text = nullptr;
    ort::check(api, (input ? api.SessionGetInputName : api.SessionGetOutputName)(session_, i, allocator_, &text),
               SG_ERR_BUNDLE, "graph value name");
    name = text;
    api.AllocatorFree(allocator_, text);
    ort::TypeInfo* type = nullptr;
    ort::check(api, (input ? api.SessionGetInputTypeInfo : api.SessionGetOutputTypeInfo)(session_, i, &type),
               SG_ERR_BUNDLE, "graph value " + name);
    Found found;
    const ort::TensorInfo* info = nullptr;
    ort::Status* status = api.CastTypeInfoToTensorInfo(type, &info);
    if (!status && info) {
      api.GetTensorElementType(info, &found.type);
      size_t rank = 0;
      api.GetDimensionsCount(info, &rank);
      found.dims.resize(rank);
      api.GetDimensions(info, found.dims.data(), rank);
    } else if (status) {
      api.ReleaseStatus(status);
    }
    api.ReleaseTypeInfo(type);
    return found;
  };
  size_t n_in = 0, n_out = 0;
  ort::check(api, api.SessionGetInputCount(session_, &n_in), SG_ERR_BUNDLE, "graph inputs");
  ort::check(api, api.SessionGetOutputCount(session_, &n_out), SG_ERR_BUNDLE, "graph outputs");
  std::map<std::string, Found> inputs, outputs;
  for (size_t i = 0; i < n_in; ++i) {
    std::string name;
    Found f = describe(true, i, name);
    input_names_.push_back(name);
    inputs[name] = f;
  }
  for (size_t i = 0; i < n_out; ++i) {
    std::string name;
    Found f = describe(false, i, name);
    output_names_.push_back(name);
    outputs[name] = f;
  }

  // What the host feeds: the contract's three inputs, the state, the constants, the sampling inputs.
  std::map<std::string, int> fed = {{"tokens", ort::kInt64}, {"n_fixed", ort::kInt64}, {"cache_len", ort::kInt64}};
  for (const auto& name : manifest_.state) fed[name] = element_type(manifest_.input(name)->dtype);
  for (const auto& c : manifest_.constants) fed[c.name] = element_type(c.dtype);
  if (manifest_.sampling) {
    for (const char* name : kSamplingInputs) fed[name] = std::string(name) == "top_k" ? ort::kInt64 : ort::kFloat;
  }
  std::set<std::string> declared;
  for (const auto& v : manifest_.inputs) declared.insert(v.name);
  std::vector<std::string> odd;
  for (const auto& kv : fed) {
    if (!inputs.count(kv.first) || !declared.count(kv.first)) odd.push_back(kv.first);
  }
  for (const auto& kv : inputs) {
    if (!fed.count(kv.first)) odd.push_back(kv.first);
  }
  for (const auto& name : declared) {
    if (!fed.count(name) && !inputs.count(name)) odd.push_back(name);
  }
  std::string problem;
  if (!odd.empty()) {
    std::sort(odd.begin(), odd.end());
    odd.erase(std::unique(odd.begin(), odd.end()), odd.end());
    std::string list;
    for (size_t i = 0; i < odd.size() && i < 3; ++i) list += (i ? ", " : "") + odd[i];
    problem = "the graph's inputs do not match what its manifest describes (" + list + ")";
  }
  for (const char* name : kRead) {
    if (problem.empty() && (!outputs.count(name) || outputs[name].type != ort::kInt64)) {
      problem = std::string("the graph lacks an int64 output the host reads (") + name + ")";
    }
  }
  for (const auto& kv : fed) {
    if (!problem.empty() || !inputs.count(kv.first)) continue;
    if (inputs[kv.first].type != kv.second) problem = "graph input " + kv.first + " has another type than the host feeds";
  }
  for (const auto& name : manifest_.state) {
    const auto& have = inputs[name].dims;
    const auto& want = manifest_.input(name)->dims;
    bool same = have.size() == want.size();
    for (size_t d = 1; same && d < want.size(); ++d) same = have[d] < 0 || have[d] == want[d];
    if (problem.empty() && !same) problem = "graph input " + name + " has another shape than the manifest says";
  }
  if (manifest_.sampling && problem.empty()) {
    // [batch, R * (max_context + 1)]: R draws per position (1, or 3 for a drafter that samples its drafts)
    const TensorSpec* u = manifest_.input("uniforms");
    if (u->dims.size() != 2 || u->dims[1] <= 0 || u->dims[1] % (manifest_.max_context + 1) != 0) {
      problem = "input uniforms is not [batch, R * (max_context + 1)]";
    }
  }
  for (const auto& b : manifest_.bindings) {
    if (problem.empty() && !outputs.count(b.first)) problem = "the manifest binds " + b.first + ", which the graph lacks";
  }
  for (const auto& t : manifest_.trims) {  // the host cuts int64 [1, N] tokens by an int64 count
    if (problem.empty() && (outputs[t.first].type != ort::kInt64 || outputs[t.second].type != ort::kInt64)) {
      problem = "the manifest trims " + t.first + " by " + t.second + ", which are not both int64";
    }
  }
  for (const auto& name : manifest_.in_place) {
    const std::string& target = *manifest_.bound_input(name);
    if (problem.empty() && outputs[name].type != inputs[target].type) {
      problem = "graph output " + name + " cannot be written into " + target + " (another type)";
    }
  }
  if (!problem.empty()) bundle_error(manifest_.bundle + ": " + problem + "; recompile the bundle");
}

// --- one call -----------------------------------------------------------------------------------

std::unique_ptr<Engine::Outputs> Engine::call(ort::IoBinding* io,
                                              const std::vector<std::pair<std::string, ort::Value*>>& feeds,
                                              const std::vector<std::unique_ptr<HostTensor>>& state) {
  const ort::Api& api = lib_.api;
  api.ClearBoundInputs(io);
  api.ClearBoundOutputs(io);
  for (const auto& [name, value] : feeds) {
    ort::check(api, api.BindInput(io, name.c_str(), value), SG_ERR_BUNDLE, manifest_.bundle + ": binding " + name);
  }
  for (const auto& name : output_names_) {
    if (manifest_.is_in_place(name)) {
      // The cache output is written into the very buffer of the state input it is bound to.
      const std::string& target = *manifest_.bound_input(name);
      size_t k = size_t(std::find(manifest_.state.begin(), manifest_.state.end(), target) - manifest_.state.begin());
      ort::check(api, api.BindOutput(io, name.c_str(), state[k]->value()), SG_ERR_BUNDLE,
                 manifest_.bundle + ": binding " + name);
    } else {
      ort::check(api, api.BindOutputToDevice(io, name.c_str(), cpu_), SG_ERR_BUNDLE,
                 manifest_.bundle + ": binding " + name);
    }
  }
  auto run_start = std::chrono::steady_clock::now();
  ort::Status* status = api.RunWithBinding(session_, nullptr, io);
  run_s_ += seconds_since(run_start);
  ort::check(api, status, SG_ERR_BUNDLE, manifest_.bundle + ": the engine failed");
  ort::Value** values = nullptr;
  size_t count = 0;
  ort::check(api, api.GetBoundOutputValues(io, allocator_, &values, &count), SG_ERR_BUNDLE,
             manifest_.bundle + ": reading the engine's outputs");
  auto out = std::make_unique<Outputs>(api);
  for (size_t i = 0; i < count; ++i) {
    if (i < output_names_.size()) {
      out->values[output_names_[i]] = values[i];
    } else {
      api.ReleaseValue(values[i]);
    }
  }
  if (values) api.AllocatorFree(allocator_, values);
  if (count != output_names_.size()) bundle_error(manifest_.bundle + ": the engine returned too few outputs");
  for (const char* name : kRead) {
    std::vector<int64_t> dims = out->dims(name);
    bool vector = std::string(name) == "n_accepted" || std::string(name) == "cache_len_out";
    if (dims.size() != (vector ? 1u : 2u) || dims[0] != 1) {
      bundle_error(manifest_.bundle + ": the engine returned " + name + " of another shape; recompile the bundle");
    }
  }
  return out;
}

// --- the loop -----------------------------------------------------------------------------------

Generation Engine::generate(const std::vector<int64_t>& prompt, int64_t max_new_tokens, Sampling sampling,
                            bool stop_at_eos) {
  std::lock_guard<std::mutex> lock(mutex_);
  const auto entered = std::chrono::steady_clock::now();
  run_s_ = 0;
  const Manifest& m = manifest_;
  if (max_new_tokens < 1) input_error("max_new_tokens must be a positive integer, got " + std::to_string(max_new_tokens));
  if (prompt.empty()) input_error("the prompt is empty");
  for (size_t i = 0; i < prompt.size(); ++i) {
    if (prompt[i] < 0 || prompt[i] >= m.vocab_size) {
      input_error("token ids must lie in [0, " + std::to_string(m.vocab_size) + ") for this model; position " +
                  std::to_string(i) + " holds " + std::to_string(prompt[i]));
    }
  }
  if (!(std::isfinite(sampling.temperature) && sampling.temperature >= 0)) {
    input_error("--temperature must be a number >= 0 (0 = greedy), got " + py_float(sampling.temperature));
  }
  if (sampling.top_k < 0) input_error("--top-k must be an integer >= 0 (0 = off), got " + std::to_string(sampling.top_k));
  if (!(sampling.top_p > 0 && sampling.top_p <= 1)) {
    input_error("--top-p must be in (0, 1] (1 = off), got " + py_float(sampling.top_p));
  }
  if (sampling.has_seed && sampling.seed >= (uint64_t(1) << 63)) {
    input_error("--seed must be an integer in [0, 2**63), got " + std::to_string(sampling.seed));
  }
  if (!sampling.greedy() && !m.sampling) {
    input_error(m.bundle + " was compiled without sampling inputs (a greedy-only engine): recompile it with "
                           "sampling to sample");
  }
  if (!sampling.greedy() && !sampling.has_seed) {
    sampling.seed = fresh_seed();
    sampling.has_seed = true;
  }
  int64_t length = int64_t(prompt.size());
  if (length + m.extra_slots >= m.max_context) {
    input_error("prompt has " + std::to_string(length) + " tokens but the engine's maximum context is " +
                std::to_string(m.max_context) + "; recompile with a larger --max-context or shorten the prompt");
  }

  // State (zeroed, batch 1), sampling inputs, then the prefill call's own inputs.
  const ort::Api& api = lib_.api;
  std::vector<std::unique_ptr<HostTensor>> state;
  for (const auto& name : m.state) {
    std::vector<int64_t> shape = m.input(name)->dims;
    shape[0] = 1;
    state.push_back(std::make_unique<HostTensor>(lib_, cpu_, element_type(m.input(name)->dtype), shape));
  }
  std::vector<std::unique_ptr<HostTensor>> fixed;  // sampling inputs, the same on every call
  std::vector<std::pair<std::string, ort::Value*>> base;
  for (size_t i = 0; i < m.constants.size(); ++i) base.emplace_back(m.constants[i].name, constants_[i]->value());
  if (m.sampling) {
    float temperature = float(sampling.temperature), top_p = float(sampling.top_p);
    int64_t top_k = sampling.top_k;
    // uniforms[0, R*i + r] is draw r of the token at absolute position i, R = the declared width
    // / (max_context + 1), checked at load; zeros when nothing is drawn.
    const int64_t width = m.input("uniforms")->dims[1];
    std::vector<float> uniforms = sampling.has_seed ? uniform_stream(sampling.seed, size_t(width))
                                                    : std::vector<float>(size_t(width), 0.0f);
    fixed.push_back(std::make_unique<HostTensor>(lib_, cpu_, ort::kFloat, std::vector<int64_t>{1}, &temperature));
    fixed.push_back(std::make_unique<HostTensor>(lib_, cpu_, ort::kInt64, std::vector<int64_t>{1}, &top_k));
    fixed.push_back(std::make_unique<HostTensor>(lib_, cpu_, ort::kFloat, std::vector<int64_t>{1}, &top_p));
    fixed.push_back(
        std::make_unique<HostTensor>(lib_, cpu_, ort::kFloat, std::vector<int64_t>{1, width}, uniforms.data()));
    for (size_t i = 0; i < 4; ++i) base.emplace_back(kSamplingInputs[i], fixed[i]->value());
  }
  int64_t zero = 0, one = 1;
  HostTensor tokens(lib_, cpu_, ort::kInt64, {1, length}, prompt.data());
  HostTensor n_fixed(lib_, cpu_, ort::kInt64, {1}, &length);
  HostTensor cache_len(lib_, cpu_, ort::kInt64, {1}, &zero);
  HostTensor n_fixed_one(lib_, cpu_, ort::kInt64, {1}, &one);

  ort::IoBinding* io_raw = nullptr;
  ort::check(api, api.CreateIoBinding(session_, &io_raw), SG_ERR_RUNTIME, "ONNX Runtime I/O binding");
  std::unique_ptr<ort::IoBinding, void (*)(ort::IoBinding*)> io(io_raw, api.ReleaseIoBinding);

  Generation g;
  g.sampling = sampling;
  std::string stop;
  // Append accepted[0, :n_accepted[0]], cut at EOS or the token budget (runtime.py's _emit).
  auto emit = [&](const Outputs& out) {
    int64_t n = out.ints("n_accepted")[0];
    int64_t width = out.dims("accepted")[1];
    if (n < 0 || n > width) bundle_error(m.bundle + ": the engine returned n_accepted outside its accepted tokens");
    const int64_t* accepted = out.ints("accepted");
    std::vector<int64_t> add(accepted, accepted + n);
    for (int64_t t : add) {
      if (t < 0 || t >= m.vocab_size) bundle_error(m.bundle + ": the engine emitted a token outside its vocabulary");
    }
    std::string reason;
    if (stop_at_eos) {
      for (size_t i = 0; i < add.size(); ++i) {
        if (std::find(m.eos_token_ids.begin(), m.eos_token_ids.end(), add[i]) != m.eos_token_ids.end()) {
          add.resize(i + 1);
          reason = "eos";
          break;
        }
      }
    }
    size_t room = size_t(max_new_tokens) - g.output_ids.size();
    if (add.size() >= room) {
      reason = add.size() == room && !reason.empty() ? reason : "max_new_tokens";
      add.resize(room);
    }
    g.output_ids.insert(g.output_ids.end(), add.begin(), add.end());
    return reason;
  };

  // Prefill: the prompt, n_fixed = P, cache_len = 0, state zeroed.
  std::vector<std::pair<std::string, ort::Value*>> feeds = base;
  feeds.emplace_back("tokens", tokens.value());
  feeds.emplace_back("n_fixed", n_fixed.value());
  feeds.emplace_back("cache_len", cache_len.value());
  for (size_t i = 0; i < m.state.size(); ++i) feeds.emplace_back(m.state[i], state[i]->value());
  auto start = std::chrono::steady_clock::now();
  std::unique_ptr<Outputs> out = call(io.get(), feeds, state);
  g.prefill_s = seconds_since(start);
  stop = emit(*out);

  start = std::chrono::steady_clock::now();
  while (stop.empty()) {
    if (g.steps() > m.max_context) {  // every call fills at least one cache slot
      bundle_error(m.bundle + ": the engine makes no progress (its cache does not advance)");
    }
    // Stop before a round that would not fit the cache (runtime.py: the next tokens' full width).
    const int64_t* cache_len_out = out->ints("cache_len_out");
    int64_t width = out->dims("next_tokens")[1] + m.extra_slots;
    if (cache_len_out[0] + width > m.max_context) {
      stop = "max_context";
      break;
    }
    // Each output feeds the input the manifest binds it to; in-place caches are already there.
    std::map<std::string, ort::Value*> next;
    for (const auto& [o, i] : m.bindings) {
      if (!m.is_in_place(o)) next[i] = out->at(o);
    }
    std::vector<std::unique_ptr<HostTensor>> trimmed;
    for (const auto& [name, count] : m.trims) {  // send only the columns some row really uses
      std::vector<int64_t> dims = out->dims(name);
      int64_t keep = 1 + out->ints(count)[0];
      if (dims.size() == 2 && keep >= 1 && keep < dims[1]) {
        trimmed.push_back(std::make_unique<HostTensor>(lib_, cpu_, ort::kInt64, std::vector<int64_t>{1, keep},
                                                       out->ints(name)));
        next[*m.bound_input(name)] = trimmed.back()->value();
      }
    }
    feeds = base;
    feeds.emplace_back("n_fixed", n_fixed_one.value());
    for (size_t i = 0; i < m.state.size(); ++i) {
      if (!next.count(m.state[i])) feeds.emplace_back(m.state[i], state[i]->value());
    }
    for (const auto& kv : next) feeds.push_back(kv);
    std::unique_ptr<Outputs> now = call(io.get(), feeds, state);
    size_t before = g.output_ids.size();
    out = std::move(now);
    stop = emit(*out);
    g.accepted_per_step.push_back(int64_t(g.output_ids.size() - before));
  }
  g.decode_s = seconds_since(start);
  g.stop_reason = stop;
  g.run_s = run_s_;
  // SPECGRAPH_HOST_TIMING=1: one line on stderr to measure the host's own cost per engine call
  // (scripts/bench_host.py): calls (prefill included), seconds in Run, seconds in generate.
  const char* timing = std::getenv("SPECGRAPH_HOST_TIMING");
  if (timing && *timing && std::string(timing) != "0") {
    std::fprintf(stderr, "specgraph-host: timing: calls=%lld run_s=%.6f generate_s=%.6f\n",
                 static_cast<long long>(g.steps() + 1), g.run_s, seconds_since(entered));
  }
  return g;
}

}  // namespace sg
