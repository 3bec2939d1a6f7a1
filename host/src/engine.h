// A bundle loaded into ONNX Runtime, and the generation loop: prefill, then one engine call per
// speculation round, everything driven by the manifest (specgraph/runtime.py is the reference).
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "bundle.h"
#include "ort_api.h"
#include "specgraph_host.h"

namespace sg {

struct Sampling {
  double temperature = 0;
  int64_t top_k = 0;
  double top_p = 1;
  bool has_seed = false;
  uint64_t seed = 0;
  bool greedy() const { return temperature == 0; }
};

struct Generation {
  std::vector<int64_t> output_ids;
  std::vector<int64_t> accepted_per_step;  // tokens each call after prefill emitted
  double prefill_s = 0, decode_s = 0;
  double run_s = 0;  // inside ONNX Runtime's RunWithBinding, all calls together
  std::string stop_reason;
  Sampling sampling;  // as used: with the seed drawn when sampling without one
  int64_t steps() const { return int64_t(accepted_per_step.size()); }
  double mean_accepted() const;
  double tokens_per_s() const;
};

// A host tensor: our buffer, wrapped in an OrtValue that ONNX Runtime reads (and, for the caches,
// writes in place).
class HostTensor {
 public:
  HostTensor(const ort::Library& lib, const ort::MemoryInfo* cpu, int type, std::vector<int64_t> shape,
             const void* data = nullptr);
  ~HostTensor();
  HostTensor(const HostTensor&) = delete;
  HostTensor& operator=(const HostTensor&) = delete;
  ort::Value* value() const { return value_; }
  void* data() { return buffer_.get(); }

 private:
  const ort::Library& lib_;
  std::unique_ptr<uint8_t[]> buffer_;
  ort::Value* value_ = nullptr;
};

class Engine {
 public:
  Engine(const std::string& bundle, const sg_load_options& options);
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  Generation generate(const std::vector<int64_t>& prompt, int64_t max_new_tokens, Sampling sampling,
                      bool stop_at_eos);
  const Manifest& manifest() const { return manifest_; }
  const std::string& ort_version() const { return lib_.version; }

 private:
  struct Outputs;
  void check_graph();
  std::unique_ptr<Outputs> call(ort::IoBinding* io, const std::vector<std::pair<std::string, ort::Value*>>& feeds,
                                const std::vector<std::unique_ptr<HostTensor>>& in_place_targets);
  int element_type(const std::string& dtype) const;

  Manifest manifest_;
  ort::Library lib_;
  ort::Env* env_ = nullptr;
  ort::Session* session_ = nullptr;
  ort::MemoryInfo* cpu_ = nullptr;
  ort::Allocator* allocator_ = nullptr;
  double run_s_ = 0;  // this generation's time inside RunWithBinding (guarded by mutex_)
  std::vector<std::string> input_names_, output_names_;  // in the session's order
  std::vector<std::unique_ptr<HostTensor>> constants_;   // built once, bound on every call
  std::mutex mutex_;                                     // one generation at a time per engine
};

}  // namespace sg
