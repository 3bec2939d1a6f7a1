// Prompt lookup's whole round as one operator (`specgraph.LookupRound`): what
// specgraph/methods/lookup.py's adaptive `draft` computes in about 200 ONNX nodes, each costing
// ONNX Runtime's per-node overhead (8% of a one-token call at the default model's stored weights),
// here in one pass over the row's history. The same integers and the same float32 operations in
// the same order as that graph (the Python code is the reference; tests compare the two).
//
// Per row: the call's tokens and then its bonus are written into the token history; the drafts
// are the up to K tokens that followed the latest earlier occurrence of the longest n-gram (n =
// N..1) ending at the bonus; the decayed acceptance counts of the match length the previous call
// drafted after are updated from what this call accepted; and the count sent is the k in 0..K
// that maximises (1 + a + ... + a^k) / cost[k] (lookup.py, `_draft_count`).
#pragma once

#include <cstdint>

namespace sg::kernels {

struct LookupShape {
  int64_t batch = 0, tokens = 0;  // B, T of the call
  int64_t length = 0;             // L: the history's slots (max_context + 1)
  int64_t num_draft = 0;          // K
  int64_t max_ngram = 0;          // N
  // lookup.py's ADAPT_DECAY, PRIOR_WEIGHT and FIRST_RATE, from the node's attributes
  float decay = 0.0f, prior_weight = 0.0f, first_rate = 0.0f;
};

// One row of the round. history [L] is the row's history with this call's writes still to do
// (updated in place); tokens [T]; stats [N, 2] and last [3] the row's adaptive state (read, then
// written in place); cost [K + 1]. Writes next_tokens [1 + K] and returns the drafts sent, or -1
// if the row's tokens do not fit the history.
int64_t lookup_round(const LookupShape& s, int64_t* history, const int64_t* tokens, int64_t cache_len, int64_t bonus,
                     int64_t cache_len_out, float* stats, int64_t* last, const float* cost, int64_t* next_tokens);

}  // namespace sg::kernels
