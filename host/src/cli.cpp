// specgraph-host: generate from a bundle with no Python, token ids in and out. Its flags and its
// --json output follow `specgraph generate`; every error is one line on stderr and a non-zero exit.
#include <cctype>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "format.h"
#include "specgraph_host.h"

namespace {

const char* kProg = "specgraph-host";

const char* kHelp =
    "usage: specgraph-host BUNDLE --prompt-ids IDS [options]\n"
    "\n"
    "Generate from a specgraph bundle with ONNX Runtime and no Python: greedy by default, or sampled\n"
    "with --temperature (lossless, and with --seed the same tokens as `specgraph generate`).\n"
    "\n"
    "positional arguments:\n"
    "  BUNDLE                 bundle directory from `specgraph compile`\n"
    "\n"
    "options:\n"
    "  --prompt-ids IDS       prompt as comma-separated token ids, e.g. 1,2,3 (required)\n"
    "  --max-new-tokens N     tokens to generate at most (default 128)\n"
    "  --temperature T        0 (the default) is greedy; above 0 samples\n"
    "  --top-k K              sample from the k most likely tokens only (0 = off)\n"
    "  --top-p P              sample from the smallest set of tokens holding this much probability (1 = off)\n"
    "  --seed S               seed for the engine's uniforms (default: a fresh seed, reported in --json)\n"
    "  --threads N            ONNX Runtime intra-op threads (default: ONNX Runtime's choice)\n"
    "  --ignore-eos           do not stop at the end-of-sequence token\n"
    "  --no-verify            skip the bundle's sha256 checks (sizes are still checked)\n"
    "  --json                 print one JSON object (the fields of `specgraph generate --json`)\n"
    "  --ort-lib PATH         libonnxruntime.so to load (default: $SPECGRAPH_ORT_LIB, else\n"
    "                         libonnxruntime.so.1 from the loader's search path)\n"
    "  -h, --help             show this help and exit\n";

[[noreturn]] void usage(const std::string& message) {
  std::fprintf(stderr, "%s: error: %s (see `%s --help`)\n", kProg, message.c_str(), kProg);
  std::exit(SG_ERR_USAGE);
}

[[noreturn]] void fail(int code, const std::string& message) {
  std::fprintf(stderr, "%s: error: %s\n", kProg, message.c_str());
  std::exit(code);
}

// Python's repr of a string argument, for messages: 'text'.
std::string quoted(const std::string& text) { return "'" + text + "'"; }

bool parse_int(const std::string& text, long long& out) {
  if (text.empty()) return false;
  errno = 0;
  char* end = nullptr;
  out = std::strtoll(text.c_str(), &end, 10);
  return errno == 0 && end && *end == '\0' && !std::isspace(static_cast<unsigned char>(text[0]));
}

bool parse_double(const std::string& text, double& out) {
  if (text.empty() || std::isspace(static_cast<unsigned char>(text[0]))) return false;
  char* end = nullptr;
  out = std::strtod(text.c_str(), &end);
  return end && *end == '\0';
}

long long positive(const std::string& flag, const std::string& text) {
  long long v = 0;
  if (!parse_int(text, v)) usage("argument " + flag + ": expected a positive integer, got " + quoted(text));
  if (v < 1 || v > 0x7fffffff) usage("argument " + flag + ": expected a positive integer, got " + text);
  return v;
}

std::vector<int64_t> token_ids(const std::string& text) {
  std::vector<int64_t> ids;
  std::string piece;
  std::string compact;
  for (char c : text) {
    if (c != ' ') compact += c;
  }
  size_t start = 0;
  while (start <= compact.size()) {
    size_t end = compact.find(',', start);
    piece = compact.substr(start, end == std::string::npos ? std::string::npos : end - start);
    if (!piece.empty()) {
      long long v = 0;
      if (!parse_int(piece, v)) {
        usage("argument --prompt-ids: --prompt-ids takes comma-separated integers, got " + quoted(text));
      }
      ids.push_back(v);
    }
    if (end == std::string::npos) break;
    start = end + 1;
  }
  if (ids.empty()) usage("argument --prompt-ids: --prompt-ids is empty");
  return ids;
}

std::string ids_json(const int64_t* ids, size_t n) {
  std::string out = "[";
  for (size_t i = 0; i < n; ++i) out += (i ? ", " : "") + std::to_string(ids[i]);
  return out + "]";
}

}  // namespace

int main(int argc, char** argv) {
  std::string bundle, prompt_text, ort_lib;
  bool have_prompt = false, json = false, ignore_eos = false, no_verify = false;
  long long max_new = 128, threads = 0;
  sg_sampling sampling = {0.0, 0, 1.0, 0, 0};
  std::string seed_text;

  std::vector<std::string> args(argv + 1, argv + argc);
  for (size_t i = 0; i < args.size(); ++i) {
    std::string arg = args[i], value;
    bool has_value = false;
    if (arg.rfind("--", 0) == 0 && arg.find('=') != std::string::npos) {
      value = arg.substr(arg.find('=') + 1);
      arg = arg.substr(0, arg.find('='));
      has_value = true;
    }
    auto take = [&]() -> std::string {
      if (has_value) return value;
      if (i + 1 >= args.size()) usage("argument " + arg + ": expected one argument");
      return args[++i];
    };
    if (arg == "-h" || arg == "--help") {
      std::fputs(kHelp, stdout);
      return 0;
    } else if (arg == "--prompt-ids") {
      prompt_text = take();
      have_prompt = true;
    } else if (arg == "--max-new-tokens") {
      max_new = positive(arg, take());
    } else if (arg == "--threads") {
      threads = positive(arg, take());
    } else if (arg == "--temperature" || arg == "--top-p") {
      std::string text = take();
      double v = 0;
      if (!parse_double(text, v)) usage("argument " + arg + ": invalid float value: " + quoted(text));
      (arg == "--temperature" ? sampling.temperature : sampling.top_p) = v;
    } else if (arg == "--top-k") {
      std::string text = take();
      long long v = 0;
      if (!parse_int(text, v)) usage("argument --top-k: expected an integer, got " + quoted(text));
      if (v > 0x7fffffffLL) {
        usage("argument --top-k: at most 2147483647 (any k at or above the vocabulary size keeps every token), got " +
              text);
      }
      sampling.top_k = v;
    } else if (arg == "--seed") {
      seed_text = take();
      long long v = 0;
      if (!parse_int(seed_text, v)) {
        bool digits = !seed_text.empty();
        for (size_t k = seed_text[0] == '-' ? 1 : 0; k < seed_text.size(); ++k) digits = digits && std::isdigit(seed_text[k]);
        if (!digits) usage("argument --seed: invalid int value: " + quoted(seed_text));
        fail(SG_ERR_INPUT, "--seed must be an integer in [0, 2**63), got " + seed_text);
      }
      if (v < 0) fail(SG_ERR_INPUT, "--seed must be an integer in [0, 2**63), got " + seed_text);
      sampling.seed = uint64_t(v);
      sampling.has_seed = 1;
    } else if (arg == "--ort-lib") {
      ort_lib = take();
    } else if (arg == "--json" && !has_value) {
      json = true;
    } else if (arg == "--ignore-eos" && !has_value) {
      ignore_eos = true;
    } else if (arg == "--no-verify" && !has_value) {
      no_verify = true;
    } else if (!arg.empty() && arg[0] == '-' && arg != "-") {
      usage("unrecognized arguments: " + args[i]);
    } else if (bundle.empty()) {
      bundle = arg;
    } else {
      usage("unrecognized arguments: " + arg);
    }
  }
  if (bundle.empty()) usage("the following arguments are required: bundle");
  if (!have_prompt) usage("one of the arguments --prompt-ids is required");
  std::vector<int64_t> prompt = token_ids(prompt_text);

  sg_load_options options = sg_default_load_options();
  options.ort_library = ort_lib.empty() ? nullptr : ort_lib.c_str();
  options.threads = int(threads);
  options.verify = no_verify ? 0 : 1;
  char err[1024];
  int code = SG_OK;
  sg_engine* engine = sg_load_ex(bundle.c_str(), &options, &code, err, sizeof err);
  if (!engine) fail(code, err);
  sg_result r;
  code = sg_generate(engine, prompt.data(), prompt.size(), int(max_new), &sampling, ignore_eos ? 0 : 1, &r, err,
                     sizeof err);
  if (code != SG_OK) {
    sg_free(engine);
    fail(code, err);
  }
  if (json) {
    std::string seed = r.has_seed ? std::to_string(r.seed) : "null";
    std::printf(
        "{\"prompt_ids\": %s, \"output_ids\": %s, \"steps\": %lld, \"mean_accepted\": %s, \"tokens_per_s\": %s, "
        "\"prefill_s\": %s, \"decode_s\": %s, \"stop_reason\": \"%s\", \"temperature\": %s, \"top_k\": %lld, "
        "\"top_p\": %s, \"seed\": %s}\n",
        ids_json(prompt.data(), prompt.size()).c_str(), ids_json(r.output_ids, r.n_output).c_str(),
        static_cast<long long>(r.steps), sg::py_float(sg::py_round(r.mean_accepted, 4)).c_str(),
        sg::py_float(sg::py_round(r.tokens_per_s, 3)).c_str(), sg::py_float(sg::py_round(r.prefill_s, 4)).c_str(),
        sg::py_float(sg::py_round(r.decode_s, 4)).c_str(), r.stop_reason, sg::py_float(sampling.temperature).c_str(),
        static_cast<long long>(sampling.top_k), sg::py_float(sampling.top_p).c_str(), seed.c_str());
  } else {
    std::string ids;
    for (size_t i = 0; i < r.n_output; ++i) ids += (i ? "," : "") + std::to_string(r.output_ids[i]);
    std::printf("%s\n", ids.c_str());
    std::fprintf(stderr, "[%zu tokens, %.1f tokens/s, %.2f tokens/step, %lld steps, stop: %s", r.n_output,
                 r.tokens_per_s, r.mean_accepted, static_cast<long long>(r.steps), r.stop_reason);
    if (r.has_seed) std::fprintf(stderr, ", seed %llu", static_cast<unsigned long long>(r.seed));
    std::fprintf(stderr, "]\n");
  }
  sg_result_free(&r);
  sg_free(engine);
  return 0;
}
