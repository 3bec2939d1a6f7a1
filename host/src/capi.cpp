// The C API (specgraph_host.h): C++ errors become status codes and one line of text, never a throw.
#include <cstdlib>
#include <cstring>
#include <new>

#include "engine.h"
#include "error.h"
#include "specgraph_host.h"

struct sg_engine {
  std::unique_ptr<sg::Engine> engine;
};

namespace {

void put(char* err, size_t err_len, const std::string& text) {
  if (!err || err_len == 0) return;
  size_t n = std::min(text.size(), err_len - 1);
  std::memcpy(err, text.data(), n);
  err[n] = '\0';
}

// Run fn; map what it throws to a status code and message.
template <typename Fn>
int guarded(char* err, size_t err_len, Fn fn) {
  put(err, err_len, "");
  try {
    fn();
    return SG_OK;
  } catch (const sg::Failure& e) {
    put(err, err_len, e.what());
    return e.code();
  } catch (const std::bad_alloc&) {
    put(err, err_len, "out of memory");
    return SG_ERR_RUNTIME;
  } catch (const std::exception& e) {
    put(err, err_len, sg::Failure::one_line(std::string("internal error: ") + e.what()));
    return SG_ERR_RUNTIME;
  } catch (...) {
    put(err, err_len, "internal error");
    return SG_ERR_RUNTIME;
  }
}

}  // namespace

extern "C" {

sg_load_options sg_default_load_options(void) {
  sg_load_options o;
  o.ort_library = nullptr;
  o.threads = 0;
  o.verify = 1;
  return o;
}

sg_engine* sg_load(const char* bundle, int threads, char* err, size_t err_len) {
  sg_load_options o = sg_default_load_options();
  o.threads = threads;
  return sg_load_ex(bundle, &o, nullptr, err, err_len);
}

sg_engine* sg_load_ex(const char* bundle, const sg_load_options* options, int* code, char* err, size_t err_len) {
  sg_engine* out = nullptr;
  int status = guarded(err, err_len, [&] {
    if (!bundle || !*bundle) sg::input_error("no bundle folder given");
    sg_load_options o = options ? *options : sg_default_load_options();
    auto engine = std::make_unique<sg::Engine>(bundle, o);
    out = new sg_engine{std::move(engine)};
  });
  if (code) *code = status;
  return out;
}

int sg_generate(sg_engine* engine, const int64_t* prompt, size_t n, int max_new_tokens, const sg_sampling* s,
                int stop_at_eos, sg_result* out, char* err, size_t err_len) {
  if (out) std::memset(out, 0, sizeof *out);
  return guarded(err, err_len, [&] {
    if (!engine || !out) sg::input_error("sg_generate needs an engine and a result to fill");
    if (!prompt && n > 0) sg::input_error("the prompt pointer is NULL");
    sg::Sampling sampling;
    if (s) {
      sampling.temperature = s->temperature;
      sampling.top_k = s->top_k;
      sampling.top_p = s->top_p;
      sampling.has_seed = s->has_seed != 0;
      sampling.seed = s->seed;
    }
    std::vector<int64_t> ids(prompt, prompt + n);
    sg::Generation g = engine->engine->generate(ids, max_new_tokens, sampling, stop_at_eos != 0);
    auto* ids_out = static_cast<int64_t*>(std::malloc(std::max<size_t>(g.output_ids.size(), 1) * sizeof(int64_t)));
    if (!ids_out) throw std::bad_alloc();
    std::copy(g.output_ids.begin(), g.output_ids.end(), ids_out);
    out->output_ids = ids_out;
    out->n_output = g.output_ids.size();
    out->steps = g.steps();
    out->mean_accepted = g.mean_accepted();
    out->tokens_per_s = g.tokens_per_s();
    out->prefill_s = g.prefill_s;
    out->decode_s = g.decode_s;
    std::strncpy(out->stop_reason, g.stop_reason.c_str(), sizeof out->stop_reason - 1);
    out->seed = g.sampling.seed;
    out->has_seed = g.sampling.has_seed;
  });
}

void sg_result_free(sg_result* result) {
  if (!result) return;
  std::free(result->output_ids);
  result->output_ids = nullptr;
  result->n_output = 0;
}

void sg_free(sg_engine* engine) {
  try {
    delete engine;
  } catch (...) {
  }
}

int64_t sg_vocab_size(const sg_engine* engine) { return engine ? engine->engine->manifest().vocab_size : 0; }
int64_t sg_max_context(const sg_engine* engine) { return engine ? engine->engine->manifest().max_context : 0; }
const char* sg_ort_version(const sg_engine* engine) { return engine ? engine->engine->ort_version().c_str() : ""; }

}  // extern "C"
