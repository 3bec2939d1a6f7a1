/* specgraph_host.h: run a specgraph bundle (one ONNX step engine plus manifest.json) from C or C++,
 * with no Python in the process.
 *
 * An engine is loaded once (the manifest and every file's size and sha256 are checked first) and
 * then generates for one prompt per call: prefill, then one engine call per speculation round, the
 * loop driven by the manifest alone. Greedy and seeded output are token-identical to the Python
 * host (specgraph/runtime.py). ONNX Runtime is loaded at run time with dlopen (see docs/host.md).
 *
 * Every function reports failure through its return value and an error text; none aborts or
 * throws. There is no global state: separate engines may generate on separate threads at once;
 * calls on one engine from several threads are serialised.
 */
#ifndef SPECGRAPH_HOST_H
#define SPECGRAPH_HOST_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#if defined(SG_BUILDING_LIBRARY) && defined(__GNUC__)
#define SG_API __attribute__((visibility("default")))
#else
#define SG_API
#endif

/* Status codes; the command-line host exits with the same numbers (as `specgraph` does). */
#define SG_OK 0
#define SG_ERR_USAGE 2   /* bad command-line flags (the command only) */
#define SG_ERR_BUNDLE 5  /* the bundle is missing, malformed, edited, or its engine failed */
#define SG_ERR_INPUT 6   /* a request the engine cannot serve: bad prompt ids, sampling, lengths */
#define SG_ERR_RUNTIME 7 /* ONNX Runtime cannot be loaded, or memory ran out */

typedef struct sg_engine sg_engine;

typedef struct sg_load_options {
  /* Path of libonnxruntime.so; NULL: $SPECGRAPH_ORT_LIB, else "libonnxruntime.so.1" from the
   * dynamic loader's search path. */
  const char* ort_library;
  int threads; /* ONNX Runtime intra-op threads: 0 = ONNX Runtime's choice, else 1..cores */
  int verify;  /* 1: check every file's sha256 (sizes are always checked); 0: skip the hashes */
} sg_load_options;

typedef struct sg_sampling {
  double temperature; /* 0 = greedy */
  int64_t top_k;      /* 0 = off */
  double top_p;       /* 1 = off */
  uint64_t seed;      /* the uniforms' seed, below 2**63; used when has_seed */
  int has_seed;       /* 0: greedy draws nothing; sampling draws a fresh seed, reported in sg_result */
} sg_sampling;

typedef struct sg_result {
  int64_t* output_ids; /* n_output generated ids (the prompt excluded); free with sg_result_free */
  size_t n_output;
  int64_t steps;         /* engine calls after prefill */
  double mean_accepted;  /* tokens per engine call after prefill (plain decoding: 1.0) */
  double tokens_per_s;   /* tokens after the first over decode_s */
  double prefill_s;
  double decode_s;
  char stop_reason[16];  /* "eos", "max_new_tokens" or "max_context" */
  uint64_t seed;         /* the seed the uniforms came from, when has_seed */
  int has_seed;
} sg_result;

/* The defaults: no library path (see above), ONNX Runtime's threads, sha256 verified. */
SG_API sg_load_options sg_default_load_options(void);

/* Load a bundle with the default options and `threads` intra-op threads. NULL on failure, with
 * one line in err (always NUL-terminated when err_len > 0). */
SG_API sg_engine* sg_load(const char* bundle, int threads, char* err, size_t err_len);

/* Load with explicit options; *code (if not NULL) receives SG_OK or an SG_ERR_* code. */
SG_API sg_engine* sg_load_ex(const char* bundle, const sg_load_options* options, int* code, char* err, size_t err_len);

/* Generate for one prompt of n ids. s = NULL is greedy. stop_at_eos: stop after an id of the
 * manifest's eos_token_ids. Returns SG_OK and fills *out (release it with sg_result_free), or an
 * SG_ERR_* code with one line in err and *out zeroed. */
SG_API int sg_generate(sg_engine* engine, const int64_t* prompt, size_t n, int max_new_tokens, const sg_sampling* s,
                int stop_at_eos, sg_result* out, char* err, size_t err_len);

SG_API void sg_result_free(sg_result* result);
SG_API void sg_free(sg_engine* engine);

/* What the manifest says (0 for a NULL engine), and the version string of the loaded ONNX Runtime. */
SG_API int64_t sg_vocab_size(const sg_engine* engine);
SG_API int64_t sg_max_context(const sg_engine* engine);
SG_API const char* sg_ort_version(const sg_engine* engine);

#ifdef __cplusplus
}
#endif

#endif /* SPECGRAPH_HOST_H */
