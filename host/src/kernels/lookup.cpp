#include "lookup.h"

#include <algorithm>
#include <cmath>

namespace sg::kernels {

namespace {

// `_lookup_drafts`: the first draft's slot after the latest earlier occurrence of the longest
// n-gram (n = N..1) that ends at slot `at`, and that n; (-1, 0) when none occurs.
void find_match(const int64_t* history, int64_t at, int64_t max_ngram, int64_t* start, int64_t* matched) {
  for (int64_t n = max_ngram; n >= 1; --n) {
    for (int64_t j = at - n; j >= 0; --j) {  // the n-gram at [j, j + n) ends strictly before the tail's
      bool hit = true;
      for (int64_t i = 0; i < n && hit; ++i) hit = history[j + i] == history[at - n + 1 + i];
      if (hit) {
        *start = j + n;
        *matched = n;
        return;
      }
    }
  }
  *start = -1;
  *matched = 0;
}

// `_observe`: the counts of the match length the last call drafted after, moved by what this call
// accepted (its sent drafts up to the first rejection, or its withheld first draft against the
// token committed after this call's first).
void observe(const LookupShape& s, const int64_t* tokens, int64_t bonus, int64_t committed, const int64_t* last,
             float* stats) {
  const int64_t sent = last[0], withheld = last[1], length = last[2];
  const int64_t accepted = committed - 1;
  const int64_t after = accepted > 0 ? (s.tokens > 1 ? tokens[1] : bonus) : bonus;
  const float hit = withheld == after + 1 ? 1.0f : 0.0f;
  const float good = sent > 0 ? static_cast<float>(std::min(accepted, sent)) : hit;
  const float bad = sent > 0 ? (accepted < sent ? 1.0f : 0.0f) : 1.0f - hit;
  if ((sent > 0 || withheld > 0) && length >= 1 && length <= s.max_ngram) {
    float* counts = stats + 2 * (length - 1);
    counts[0] = s.decay * counts[0] + good;  // two roundings, as the graph's Mul and Add
    counts[1] = s.decay * counts[1] + bad;
  }
}

// `_draft_count`: the k in 0..K maximising (1 + a + ... + a^k) / cost[k], the first such k, for the
// rate a after matches of length `matched` (a prior centred on the row's rate over all lengths).
int64_t draft_count(const LookupShape& s, const float* stats, const float* cost, int64_t matched) {
  float pooled_good = 0.0f, pooled_bad = 0.0f;
  for (int64_t n = 0; n < s.max_ngram; ++n) {
    pooled_good = pooled_good + stats[2 * n];
    pooled_bad = pooled_bad + stats[2 * n + 1];
  }
  const float prior = (pooled_good + 2.0f * s.first_rate) / ((pooled_good + pooled_bad) + 2.0f);  // doubling: exact
  const float* counts = stats + 2 * (std::max<int64_t>(matched, 1) - 1);
  const float rate = (counts[0] + s.prior_weight * prior) / ((counts[0] + counts[1]) + s.prior_weight);
  float best = 1.0f / cost[0], sum = 0.0f;
  int64_t count = 0;
  for (int64_t k = 1; k <= s.num_draft; ++k) {
    sum = sum + std::pow(rate, static_cast<float>(k));
    const float ratio = (1.0f + sum) / cost[k];
    if (ratio > best) {
      best = ratio;
      count = k;
    }
  }
  return count;
}

}  // namespace

int64_t lookup_round(const LookupShape& s, int64_t* history, const int64_t* tokens, int64_t cache_len, int64_t bonus,
                     int64_t cache_len_out, float* stats, int64_t* last, const float* cost, int64_t* next_tokens) {
  if (cache_len < 0 || cache_len + s.tokens > s.length || cache_len_out < 0 || cache_len_out >= s.length) return -1;
  for (int64_t i = 0; i < s.tokens; ++i) history[cache_len + i] = tokens[i];  // `_record`
  history[cache_len_out] = bonus;
  int64_t start = -1, matched = 0;
  find_match(history, cache_len_out, s.max_ngram, &start, &matched);
  next_tokens[0] = bonus;
  for (int64_t i = 0; i < s.num_draft; ++i) {  // past the history's end: its last token again
    next_tokens[1 + i] = history[start < 0 ? cache_len_out : std::min(start + i, cache_len_out)];
  }
  const int64_t real = start < 0 ? 0 : std::min(cache_len_out - start + 1, s.num_draft);
  observe(s, tokens, bonus, cache_len_out - cache_len, last, stats);
  const int64_t sent = std::min(real, draft_count(s, stats, cost, matched));
  last[0] = sent;
  last[1] = sent == 0 && real > 0 ? next_tokens[1] + 1 : 0;  // the first draft withheld: the next call checks it
  last[2] = matched;
  return sent;
}

}  // namespace sg::kernels
