/* Two engines generating at once on two threads must give exactly the ids they give one after the
 * other (docs/host.md: no global state; separate engines may generate on separate threads).
 *   concurrency BUNDLE_A BUNDLE_B IDS MAX_NEW_TOKENS [ROUNDS]
 * BUNDLE_A and BUNDLE_B may be the same bundle (two engines over one bundle) or different ones.
 * Requests: greedy, and a seeded sample (T 0.7, top-p 0.9, seed 7). The reference is every request
 * run one after the other on the main thread; then, ROUNDS times, engine A and engine B each run
 * both requests on their own thread, started together at a barrier (thread B in the other order);
 * then each thread loads, uses and frees an engine of its own at once. Prints the reference ids
 * ("a greedy: 1,2,3") and "concurrency: OK"; exit 1 with one line per mismatch or error.
 * ONNX Runtime comes from $SPECGRAPH_ORT_LIB (or libonnxruntime.so.1 on the loader's path). */
#define _POSIX_C_SOURCE 200809L
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "specgraph_host.h"

#define MAX_PROMPT 4096
#define N_REQUESTS 2

static const char* const REQUEST_NAMES[N_REQUESTS] = {"greedy", "sampled"};
static const sg_sampling SAMPLED = {0.7, 0, 0.9, 7, 1}; /* temperature, top_k, top_p, seed, has_seed */

static int64_t prompt[MAX_PROMPT];
static size_t prompt_len;
static int max_new;

typedef struct ids {
  int64_t* v;
  size_t n;
  int ok;
} ids;

typedef struct job {
  const char* label; /* "a" or "b" */
  const char* bundle;
  sg_engine* engine;  /* NULL: load (and free) one inside the thread */
  int reversed;       /* run the requests in the other order */
  pthread_barrier_t* start;
  ids got[N_REQUESTS];
  char err[512];
} job;

static sg_engine* load(const char* bundle, char* err, size_t err_len) {
  sg_load_options o = sg_default_load_options();
  o.threads = 1;
  int code = 0;
  return sg_load_ex(bundle, &o, &code, err, err_len);
}

/* Run request r on e; the ids go to *out (owned by the caller). 0 on success. */
static int run(sg_engine* e, int r, ids* out, char* err, size_t err_len) {
  sg_result res;
  out->v = NULL, out->n = 0, out->ok = 0;
  if (sg_generate(e, prompt, prompt_len, max_new, r ? &SAMPLED : NULL, 1, &res, err, err_len) != SG_OK) return 1;
  out->v = malloc((res.n_output ? res.n_output : 1) * sizeof(int64_t));
  if (!out->v) {
    snprintf(err, err_len, "out of memory");
    sg_result_free(&res);
    return 1;
  }
  memcpy(out->v, res.output_ids, res.n_output * sizeof(int64_t));
  out->n = res.n_output;
  out->ok = 1;
  sg_result_free(&res);
  return 0;
}

static void* worker(void* arg) {
  job* j = arg;
  sg_engine* e = j->engine;
  j->err[0] = '\0';
  for (int r = 0; r < N_REQUESTS; ++r) j->got[r].v = NULL, j->got[r].n = 0, j->got[r].ok = 0;
  pthread_barrier_wait(j->start);
  if (!e && !(e = load(j->bundle, j->err, sizeof j->err))) return NULL;
  for (int k = 0; k < N_REQUESTS; ++k) {
    int r = j->reversed ? N_REQUESTS - 1 - k : k;
    if (run(e, r, &j->got[r], j->err, sizeof j->err)) break;
  }
  if (!j->engine) sg_free(e);
  return NULL;
}

static int same(const ids* a, const ids* b) {
  return a->ok && b->ok && a->n == b->n && (a->n == 0 || memcmp(a->v, b->v, a->n * sizeof(int64_t)) == 0);
}

static void print_ids(const char* prefix, const ids* x) {
  printf("%s:", prefix);
  for (size_t i = 0; i < x->n; ++i) printf("%s%lld", i ? "," : " ", (long long)x->v[i]);
  printf("\n");
}

/* Compare both jobs' ids with the reference; one line per difference. Returns the count. */
static int check(const char* phase, int round, job* jobs, ids want[2][N_REQUESTS]) {
  int bad = 0;
  for (int t = 0; t < 2; ++t) {
    if (jobs[t].err[0]) {
      fprintf(stderr, "concurrency: %s round %d, engine %s: %s\n", phase, round, jobs[t].label, jobs[t].err);
      ++bad;
      continue;
    }
    for (int r = 0; r < N_REQUESTS; ++r) {
      if (!same(&jobs[t].got[r], &want[t][r])) {
        fprintf(stderr, "concurrency: %s round %d, engine %s, %s: %zu ids differ from the sequential %zu\n", phase,
                round, jobs[t].label, REQUEST_NAMES[r], jobs[t].got[r].n, want[t][r].n);
        ++bad;
      }
    }
  }
  for (int t = 0; t < 2; ++t)
    for (int r = 0; r < N_REQUESTS; ++r) free(jobs[t].got[r].v);
  return bad;
}

/* Start both jobs together and wait for them; 0 on success. */
static int run_pair(job* jobs) {
  pthread_barrier_t start;
  pthread_t th[2];
  pthread_barrier_init(&start, NULL, 2);
  int started = 0;
  for (int t = 0; t < 2; ++t) {
    jobs[t].start = &start;
    if (pthread_create(&th[t], NULL, worker, &jobs[t]) != 0) break;
    ++started;
  }
  if (started < 2) {
    /* The barrier needs two; release a started thread by waiting on it here. */
    if (started == 1) pthread_barrier_wait(&start), pthread_join(th[0], NULL);
    pthread_barrier_destroy(&start);
    fprintf(stderr, "concurrency: cannot start a thread\n");
    return 1;
  }
  for (int t = 0; t < 2; ++t) pthread_join(th[t], NULL);
  pthread_barrier_destroy(&start);
  return 0;
}

int main(int argc, char** argv) {
  if (argc < 5) {
    fprintf(stderr, "usage: concurrency BUNDLE_A BUNDLE_B IDS MAX_NEW_TOKENS [ROUNDS]\n");
    return 2;
  }
  const char* bundles[2] = {argv[1], argv[2]};
  for (const char* p = argv[3]; *p && prompt_len < MAX_PROMPT;) {
    char* end = NULL;
    prompt[prompt_len++] = strtoll(p, &end, 10);
    if (end == p) {
      fprintf(stderr, "concurrency: IDS takes comma-separated integers\n");
      return 2;
    }
    p = *end == ',' ? end + 1 : end;
  }
  max_new = atoi(argv[4]);
  int rounds = argc > 5 ? atoi(argv[5]) : 4;
  if (max_new <= 0 || rounds <= 0) {
    fprintf(stderr, "concurrency: MAX_NEW_TOKENS and ROUNDS must be positive\n");
    return 2;
  }

  char err[512];
  sg_engine* engines[2] = {NULL, NULL};
  for (int t = 0; t < 2; ++t) {
    if (!(engines[t] = load(bundles[t], err, sizeof err))) {
      fprintf(stderr, "concurrency: load %s: %s\n", bundles[t], err);
      if (t) sg_free(engines[0]);
      return 1;
    }
  }

  /* The reference: every request, one after the other, on this thread. */
  ids want[2][N_REQUESTS];
  const char* labels[2] = {"a", "b"};
  int bad = 0;
  for (int t = 0; t < 2; ++t) {
    for (int r = 0; r < N_REQUESTS; ++r) {
      if (run(engines[t], r, &want[t][r], err, sizeof err)) {
        fprintf(stderr, "concurrency: sequential, engine %s, %s: %s\n", labels[t], REQUEST_NAMES[r], err);
        ++bad;
      }
      char prefix[64];
      snprintf(prefix, sizeof prefix, "%s %s", labels[t], REQUEST_NAMES[r]);
      print_ids(prefix, &want[t][r]);
    }
  }

  /* The two loaded engines at once, ROUNDS times. */
  for (int round = 0; !bad && round < rounds; ++round) {
    job jobs[2];
    memset(jobs, 0, sizeof jobs);
    for (int t = 0; t < 2; ++t) jobs[t].label = labels[t], jobs[t].bundle = bundles[t], jobs[t].engine = engines[t];
    jobs[1].reversed = round % 2 == 0;
    if (run_pair(jobs)) bad = 1;
    else bad += check("loaded", round, jobs, want);
  }
  for (int t = 0; t < 2; ++t) sg_free(engines[t]);

  /* Each thread loads, uses and frees an engine of its own, at once. */
  if (!bad) {
    job jobs[2];
    memset(jobs, 0, sizeof jobs);
    for (int t = 0; t < 2; ++t) jobs[t].label = labels[t], jobs[t].bundle = bundles[t];
    if (run_pair(jobs)) bad = 1;
    else bad += check("fresh", 0, jobs, want);
  }

  for (int t = 0; t < 2; ++t)
    for (int r = 0; r < N_REQUESTS; ++r) free(want[t][r].v);
  if (bad) {
    printf("concurrency: %d mismatches or errors\n", bad);
    return 1;
  }
  printf("concurrency: OK (%d rounds)\n", rounds);
  return 0;
}
