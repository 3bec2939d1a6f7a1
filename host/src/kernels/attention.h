// A chain engine's cached attention for one layer, in float32: rotary positions on the new
// queries and keys, the new keys and values written into the cache, and each query attending
// causally over the cache slots before it. What ONNX Runtime's GroupQueryAttention (with two
// RotaryEmbedding nodes before it) computes for the calls it takes, for every call: it also takes
// several rows of several tokens over non-empty caches (a batched verify), which that kernel
// refuses, so a layer needs no `If` and no second, generic branch.
//
// Each (row, token, head) is computed by the same code whatever the call's size, so a verify
// call's token equals the same token computed by a one-token step, bit for bit.
#pragma once

#include <cstdint>

namespace sg::kernels {

struct AttentionShape {
  int64_t batch = 0, tokens = 0;       // B, T of the call
  int64_t heads = 0, kv_heads = 0;     // H query heads share each of Hkv key/value heads
  int64_t head_dim = 0, slots = 0;     // D (even), S: the cache's capacity
  float scale = 0.0f;                  // of the scores, usually 1 / sqrt(D)
  // floats from one token's queries (keys, values) to the next's: H*D (Hkv*D) when q, k and v are
  // tensors of their own, (H + 2 Hkv) D when they are the three parts of one packed projection
  int64_t q_stride = 0, kv_stride = 0;
};

// q [B, T, H*D] (before rotary; token rows q_stride apart); cos and sin [B, T, D/2] (the non-interleaved rotation:
// x1 * cos - x2 * sin, x2 * cos + x1 * sin over the two halves); keys and values [B, Hkv, S, D],
// the cache with this call's tokens already written (write_cache); out [B, T, H*D]. Token t of
// row b attends over slots [0, write_pos[b] + t]. Computes the (row, head) pairs [h_begin, h_end)
// of the flattened index b * H + h, so callers can split the work.
void cached_attention(const AttentionShape& s, const float* q, const float* cos, const float* sin,
                      const int64_t* write_pos, const float* keys, const float* values, float* out, int64_t h_begin,
                      int64_t h_end);

// Write k and v [B, T, Hkv*D] (token rows kv_stride apart; keys rotated) into the cache at slots
// write_pos[b] + t.
void write_cache(const AttentionShape& s, const float* k, const float* v, const float* cos, const float* sin,
                 const int64_t* write_pos, float* keys, float* values);

}  // namespace sg::kernels
