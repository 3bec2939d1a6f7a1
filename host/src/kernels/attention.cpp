// The cached attention of attention.h: a portable loop, and AVX2 dot products chosen at run time.
#include "attention.h"

#include "block_matmul.h"

#include <immintrin.h>

#include <cmath>
#include <vector>

namespace sg::kernels {
namespace {

// $SPECGRAPH_KERNELS_PORTABLE set and not empty: the portable loops even where AVX2 exists (tests).
bool has_avx2() {
  static const bool yes = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && !forced_portable();
  return yes;
}

// x1 * cos - x2 * sin and x2 * cos + x1 * sin over the halves of x [D], into out [D].
void rotate(const float* x, const float* cos, const float* sin, int64_t d, float* out) {
  const int64_t half = d / 2;
  for (int64_t j = 0; j < half; ++j) {
    const float a = x[j] * cos[j], b = x[half + j] * sin[j];
    const float c = x[half + j] * cos[j], e = x[j] * sin[j];
    out[j] = a - b;
    out[half + j] = c + e;
  }
}

float dot_portable(const float* a, const float* b, int64_t n) {
  float lanes[8] = {};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    for (int l = 0; l < 8; ++l) lanes[l] = std::fma(a[i + l], b[i + l], lanes[l]);
  float total = ((lanes[0] + lanes[4]) + (lanes[1] + lanes[5])) + ((lanes[2] + lanes[6]) + (lanes[3] + lanes[7]));
  for (; i < n; ++i) total = std::fma(a[i], b[i], total);
  return total;
}

// The lanes of acc summed: (l0 + l4) + (l1 + l5) and (l2 + l6) + (l3 + l7), then the two.
__attribute__((target("avx2,fma"))) inline float lanes_sum(__m256 acc) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
  float pair[4];
  _mm_storeu_ps(pair, s);
  return (pair[0] + pair[1]) + (pair[2] + pair[3]);
}

// The same sum as dot_portable: 8 lanes of multiply-adds, then the lanes paired in the same order.
__attribute__((target("avx2,fma"))) float dot_avx2(const float* a, const float* b, int64_t n) {
  __m256 acc = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
  float total = lanes_sum(acc);
  for (; i < n; ++i) total = std::fma(a[i], b[i], total);
  return total;
}

// scores[j] = scale * dot(query, rows[j]) for j < n, rows D apart: eight slots at a time, so
// eight chains of multiply-adds run at once (the last few alone); each slot's sum is dot_avx2's.
__attribute__((target("avx2,fma"))) void scores_avx2(const float* query, const float* rows, int64_t n, int64_t d,
                                                     float scale, float* scores) {
  int64_t j = 0;
  if (d % 8 == 0) {
    for (; j + 8 <= n; j += 8) {  // eight chains; each slot's lanes summed as lanes_sum does
      const float* r = rows + j * d;
      __m256 a[8];
      for (int l = 0; l < 8; ++l) a[l] = _mm256_setzero_ps();
      for (int64_t i = 0; i < d; i += 8) {
        const __m256 qv = _mm256_loadu_ps(query + i);
        for (int l = 0; l < 8; ++l) a[l] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(r + l * d + i), a[l]);
      }
      for (int l = 0; l < 8; ++l) scores[j + l] = lanes_sum(a[l]) * scale;
    }
  }
  for (; j < n; ++j) scores[j] = dot_avx2(query, rows + j * d, d) * scale;
}

// out[D] = sum_j p[j] * rows[j] (rows D apart), 64 or 32 outputs at a time held in registers;
// each output is one chain of multiply-adds over j from 0, from zero.
__attribute__((target("avx2,fma"))) void weighted_sum_avx2(const float* p, const float* rows, int64_t n, int64_t d,
                                                           float* out) {
  int64_t c = 0;
  for (; c + 64 <= d; c += 64) {  // 8 chains: the multiply-add latency hidden
    __m256 a[8];
    for (int l = 0; l < 8; ++l) a[l] = _mm256_setzero_ps();
    const float* r = rows + c;
    for (int64_t j = 0; j < n; ++j, r += d) {
      const __m256 w = _mm256_set1_ps(p[j]);
      for (int l = 0; l < 8; ++l) a[l] = _mm256_fmadd_ps(w, _mm256_loadu_ps(r + 8 * l), a[l]);
    }
    for (int l = 0; l < 8; ++l) _mm256_storeu_ps(out + c + 8 * l, a[l]);
  }
  for (; c + 32 <= d; c += 32) {
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();
    const float* r = rows + c;
    for (int64_t j = 0; j < n; ++j, r += d) {
      const __m256 w = _mm256_set1_ps(p[j]);
      a0 = _mm256_fmadd_ps(w, _mm256_loadu_ps(r), a0);
      a1 = _mm256_fmadd_ps(w, _mm256_loadu_ps(r + 8), a1);
      a2 = _mm256_fmadd_ps(w, _mm256_loadu_ps(r + 16), a2);
      a3 = _mm256_fmadd_ps(w, _mm256_loadu_ps(r + 24), a3);
    }
    _mm256_storeu_ps(out + c, a0);
    _mm256_storeu_ps(out + c + 8, a1);
    _mm256_storeu_ps(out + c + 16, a2);
    _mm256_storeu_ps(out + c + 24, a3);
  }
  for (; c < d; ++c) {
    float total = 0.0f;
    for (int64_t j = 0; j < n; ++j) total = std::fma(p[j], rows[j * d + c], total);
    out[c] = total;
  }
}

void axpy_portable(float p, const float* row, float* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = std::fma(p, row[i], out[i]);
}

// e^x for x <= 0 (scores less their maximum), 8 lanes: x = n ln2 + r with |r| <= ln2 / 2, e^r
// by Cephes' degree-7 polynomial for expf (about 1 ulp), 2^n put into the exponent bits.
__attribute__((target("avx2,fma"))) __m256 exp_avx2(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));  // below, e^x is under float's normal range: weight ~0
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(_mm256_mul_ps(p, r), r, _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}

// scores[j] = e^(scores[j] - top) for j < n; returns their sum (8 lanes, then the lanes in a fixed order).
__attribute__((target("avx2,fma"))) float softmax_avx2(float* scores, int64_t n, float top) {
  const __m256 t = _mm256_set1_ps(top);
  __m256 sum = _mm256_setzero_ps();
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    const __m256 e = exp_avx2(_mm256_sub_ps(_mm256_loadu_ps(scores + j), t));
    _mm256_storeu_ps(scores + j, e);
    sum = _mm256_add_ps(sum, e);
  }
  if (j < n) {  // the tail through the same lanes, padded with -inf's weight (0)
    alignas(32) float tail[8];
    for (int l = 0; l < 8; ++l) tail[l] = j + l < n ? scores[j + l] - top : -87.0f;
    __m256 e = exp_avx2(_mm256_load_ps(tail));
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256 keep = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n - j)), lane));
    e = _mm256_and_ps(e, keep);
    _mm256_store_ps(tail, e);
    for (int l = 0; j + l < n; ++l) scores[j + l] = tail[l];
    sum = _mm256_add_ps(sum, e);
  }
  float lanes[8];
  _mm256_storeu_ps(lanes, sum);
  return ((lanes[0] + lanes[4]) + (lanes[1] + lanes[5])) + ((lanes[2] + lanes[6]) + (lanes[3] + lanes[7]));
}

float softmax_portable(float* scores, int64_t n, float top) {
  float total = 0.0f;
  for (int64_t j = 0; j < n; ++j) {
    scores[j] = std::exp(scores[j] - top);
    total += scores[j];
  }
  return total;
}

}  // namespace

void write_cache(const AttentionShape& s, const float* k, const float* v, const float* cos, const float* sin,
                 const int64_t* write_pos, float* keys, float* values) {
  const int64_t d = s.head_dim, half = d / 2;
  for (int64_t b = 0; b < s.batch; ++b) {
    for (int64_t t = 0; t < s.tokens; ++t) {
      const int64_t slot = write_pos[b] + t;
      const float* c = cos + (b * s.tokens + t) * half;
      const float* n = sin + (b * s.tokens + t) * half;
      for (int64_t g = 0; g < s.kv_heads; ++g) {
        const int64_t src = (b * s.tokens + t) * (s.kv_stride ? s.kv_stride : s.kv_heads * d) + g * d;
        const int64_t dst = ((b * s.kv_heads + g) * s.slots + slot) * d;
        rotate(k + src, c, n, d, keys + dst);
        for (int64_t j = 0; j < d; ++j) values[dst + j] = v[src + j];
      }
    }
  }
}

void cached_attention(const AttentionShape& s, const float* q, const float* cos, const float* sin,
                      const int64_t* write_pos, const float* keys, const float* values, float* out, int64_t h_begin,
                      int64_t h_end) {
  const bool avx2 = has_avx2();
  const int64_t d = s.head_dim, half = d / 2, group = s.heads / s.kv_heads;
  thread_local std::vector<float> scores, query;
  query.resize(static_cast<size_t>(d));
  for (int64_t index = h_begin; index < h_end; ++index) {
    const int64_t b = index / s.heads, h = index % s.heads, g = h / group;
    const float* key_rows = keys + (b * s.kv_heads + g) * s.slots * d;
    const float* value_rows = values + (b * s.kv_heads + g) * s.slots * d;
    for (int64_t t = 0; t < s.tokens; ++t) {
      const int64_t bt = b * s.tokens + t, visible = write_pos[b] + t + 1;
      rotate(q + bt * (s.q_stride ? s.q_stride : s.heads * d) + h * d, cos + bt * half, sin + bt * half, d, query.data());
      scores.resize(static_cast<size_t>(visible));
      if (avx2) {
        scores_avx2(query.data(), key_rows, visible, d, s.scale, scores.data());
      } else {
        for (int64_t j = 0; j < visible; ++j) scores[j] = dot_portable(query.data(), key_rows + j * d, d) * s.scale;
      }
      float top = -INFINITY;
      for (int64_t j = 0; j < visible; ++j) top = scores[j] > top ? scores[j] : top;
      const float total = avx2 ? softmax_avx2(scores.data(), visible, top) : softmax_portable(scores.data(), visible, top);
      float* o = out + (bt * s.heads + h) * d;
      const float inverse = 1.0f / total;
      for (int64_t j = 0; j < visible; ++j) scores[j] *= inverse;
      if (avx2) {
        weighted_sum_avx2(scores.data(), value_rows, visible, d, o);
      } else {
        for (int64_t j = 0; j < d; ++j) o[j] = 0.0f;
        for (int64_t j = 0; j < visible; ++j) axpy_portable(scores[j], value_rows + j * d, o, d);
      }
    }
  }
}

}  // namespace sg::kernels
