// Reading a bundle as hostile input, as exporters/manifest.py read_manifest does: the manifest's
// schema (every key this host reads), that every listed path is relative and inside the bundle
// through no symbolic link, that each listed file is a regular data file of its recorded size,
// that the graph, its weights and every external-data file the graph names are listed, and last
// (when verifying) each file's sha256.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace sg {

constexpr int64_t kFormatVersion = 3;  // the manifest format this host reads

struct TensorSpec {
  std::string name;
  std::string dtype;          // "float32", "int64", "bool"
  std::vector<int64_t> dims;  // -1 where the manifest names a symbolic dimension
};

struct Constant {
  std::string name;
  std::string dtype;
  std::vector<int64_t> shape;
  std::vector<uint8_t> bytes;  // the data, row-major, in dtype's machine layout
};

struct Manifest {
  std::string bundle;  // the folder, as given
  int64_t max_context = 0;
  int64_t vocab_size = 0;
  std::vector<int64_t> eos_token_ids;
  bool sampling = false;  // the engine takes temperature, top_k, top_p and uniforms
  std::string graph_file;
  std::vector<TensorSpec> inputs, outputs;
  std::vector<std::pair<std::string, std::string>> bindings;  // output -> the input it feeds next call
  std::vector<std::pair<std::string, std::string>> trims;     // output -> the count output trimming it
  std::vector<std::string> state;                             // inputs zero-filled before prefill
  std::vector<std::string> in_place;                          // outputs written into their bound input
  std::vector<Constant> constants;                            // inputs fed from the manifest's data
  int64_t extra_slots = 0;                                    // cache slots a call writes beyond its tokens
  bool native_kernels = false;  // weights.kernels == "native": needs libspecgraph_kernels.so (docs/host.md)

  const TensorSpec* input(const std::string& name) const;
  const TensorSpec* output(const std::string& name) const;
  const std::string* bound_input(const std::string& output) const;
  bool is_in_place(const std::string& output) const;
};

// Check and read `bundle`/manifest.json; throws sg::Failure(SG_ERR_BUNDLE) with one line naming the
// first problem. `verify` = false skips only the sha256 checks.
Manifest read_bundle(const std::string& bundle, bool verify);

}  // namespace sg
