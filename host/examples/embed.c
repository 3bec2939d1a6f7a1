/* Embedding specgraph's host through its C API: load a bundle, generate greedily and with a
 * seeded sample, print the ids. Build: see host/CMakeLists.txt (target `embed`).
 *   embed BUNDLE 1,2,3 [MAX_NEW_TOKENS]
 * ONNX Runtime comes from $SPECGRAPH_ORT_LIB (or libonnxruntime.so.1 on the loader's path). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "specgraph_host.h"

static size_t parse_ids(const char* text, int64_t* ids, size_t cap) {
  size_t n = 0;
  const char* p = text;
  while (*p && n < cap) {
    char* end = NULL;
    ids[n++] = strtoll(p, &end, 10);
    if (end == p) return 0;
    p = *end == ',' ? end + 1 : end;
  }
  return n;
}

static void print_result(const char* label, const sg_result* r) {
  printf("%s:", label);
  for (size_t i = 0; i < r->n_output; ++i) printf("%s%lld", i ? "," : " ", (long long)r->output_ids[i]);
  printf(" (steps %lld, stop %s)\n", (long long)r->steps, r->stop_reason);
}

int main(int argc, char** argv) {
  if (argc < 3) {
    fprintf(stderr, "usage: embed BUNDLE IDS [MAX_NEW_TOKENS]\n");
    return 2;
  }
  int64_t prompt[4096];
  size_t n = parse_ids(argv[2], prompt, 4096);
  int max_new = argc > 3 ? atoi(argv[3]) : 16;
  char err[512];

  sg_engine* engine = sg_load(argv[1], 1, err, sizeof err);
  if (!engine) {
    fprintf(stderr, "embed: %s\n", err);
    return 1;
  }
  printf("ONNX Runtime %s, vocabulary %lld, context %lld\n", sg_ort_version(engine),
         (long long)sg_vocab_size(engine), (long long)sg_max_context(engine));

  sg_result r;
  int code = sg_generate(engine, prompt, n, max_new, NULL, 1, &r, err, sizeof err);
  if (code != SG_OK) {
    fprintf(stderr, "embed: %s\n", err);
    sg_free(engine);
    return code;
  }
  print_result("greedy", &r);
  sg_result_free(&r);

  sg_sampling s = {0.7, 0, 0.9, 7, 1}; /* temperature, top_k, top_p, seed, has_seed */
  code = sg_generate(engine, prompt, n, max_new, &s, 1, &r, err, sizeof err);
  if (code != SG_OK) {
    fprintf(stderr, "embed: %s\n", err);
    sg_free(engine);
    return code;
  }
  print_result("sampled", &r);
  sg_result_free(&r);

  /* A bad request is an error code and a message, never an abort. */
  int64_t bad = -1;
  code = sg_generate(engine, &bad, 1, max_new, NULL, 1, &r, err, sizeof err);
  printf("bad prompt: code %d: %s\n", code, err);
  sg_free(engine);
  return 0;
}
