// The block product (block_matmul.h): a portable loop, and an AVX2 one chosen at run time.
//
// Per output n and input row r: y = sum_b s_b * T_b + sum_b c'_b * S_b, where T_b = sum_k x_k *
// (code_k - centre) over block b (float32 multiply-adds on the centred codes converted to floats)
// and S_b the block's input sum. This is `sum_b sum_k x_k * (s_b * (code_k - centre) + c'_b)`,
// the dequantised weight's product, grouped by block.
#include "block_matmul.h"

#include <immintrin.h>

namespace sg::kernels {
namespace {

constexpr int kRowTile = 4;  // input rows that share one unpacking of a weight block

float centre(const BlockWeights& w) { return w.low ? 136.0f : 8.0f; }

// The offset part of y[r, n]: sum_b c'_b * S_b.
float offset_term(const BlockWeights& w, const float* sums, int64_t n) {
  if (!w.offset) return 0.0f;
  float total = 0.0f;
  for (int64_t b = 0; b < w.k / w.block; ++b) total += w.offset[b * w.n + n] * sums[b];
  return total;
}

float centred_code(const BlockWeights& w, int64_t n, int64_t i) {
  const int64_t half = w.block / 2, nb = w.k / w.block;
  const int64_t b = i / w.block, j = (i % w.block) / 2;
  const int64_t at = (n * nb + b) * half + j;
  const int shift = (i % 2) ? 4 : 0;
  const int high = (w.high[at] >> shift) & 0x0F;
  const int code = w.low ? 16 * high + ((w.low[at] >> shift) & 0x0F) : high;
  return static_cast<float>(code) - centre(w);
}

void portable(const BlockWeights& w, const PreparedInput& in, float* y, int64_t n_begin, int64_t n_end) {
  const int64_t nb = w.k / w.block, half = w.block / 2;
  for (int64_t n = n_begin; n < n_end; ++n) {
    for (int64_t r = 0; r < in.rows; ++r) {
      const float* x = in.paired + r * w.k;
      float total = 0.0f;
      for (int64_t b = 0; b < nb; ++b) {
        float t = 0.0f;
        for (int64_t j = 0; j < half; ++j) {
          t += x[b * w.block + j] * centred_code(w, n, b * w.block + 2 * j);
          t += x[b * w.block + half + j] * centred_code(w, n, b * w.block + 2 * j + 1);
        }
        total += w.scale[n * nb + b] * t;
      }
      y[r * w.n + n] = total + offset_term(w, in.sums + r * nb, n);
    }
  }
}

__attribute__((target("avx2,fma"))) inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
  return _mm_cvtss_f32(s);
}

// Rows [r0, r0 + R) of y for outputs [n_begin, n_end): each 8 packed bytes of a block are
// unpacked once into 8 even and 8 odd centred codes, then multiplied into every row of the tile.
// Every row takes the same operations in the same order whatever R is, so a row of a many-row
// call equals the same row computed alone, bit for bit (a verify call rounds as a step does).
// Two: two digits (w.low set); H: block / 2 when fixed at compile time (the common 32-weight
// blocks, so the byte loop unrolls), 0 to read it from w.
template <int R, bool Two, int H>
__attribute__((target("avx2,fma"))) void tile_avx2(const BlockWeights& w, const PreparedInput& in, float* y,
                                                   int64_t n_begin, int64_t n_end, int64_t r0) {
  const int64_t nb = w.k / w.block, half = H ? H : w.block / 2;
  const __m256i nibble = _mm256_set1_epi32(0x0F);
  const __m256i top = _mm256_set1_epi32(0xF0);
  const __m256i centre_codes = _mm256_set1_epi32(static_cast<int>(centre(w)));
  for (int64_t n = n_begin; n < n_end; ++n) {
    __m256 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
    const uint8_t* hp = w.high + n * nb * half;
    const uint8_t* lp = Two ? w.low + n * nb * half : nullptr;
    const float* sp = w.scale + n * nb;
    for (int64_t b = 0; b < nb; ++b) {
      __m256 t[R];  // T_b of each row, in 8 lanes
      for (int r = 0; r < R; ++r) t[r] = _mm256_setzero_ps();
      for (int64_t j = 0; j < half; j += 8) {
        // 8 packed bytes widened to 8 lanes, then split into nibbles within each lane
        const __m256i h = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(hp + b * half + j)));
        __m256i even, odd;
        if (Two) {  // code = 16 * high + low
          const __m256i l = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(lp + b * half + j)));
          even = _mm256_or_si256(_mm256_slli_epi32(_mm256_and_si256(h, nibble), 4), _mm256_and_si256(l, nibble));
          odd = _mm256_or_si256(_mm256_and_si256(h, top), _mm256_srli_epi32(l, 4));
        } else {
          even = _mm256_and_si256(h, nibble);
          odd = _mm256_srli_epi32(h, 4);
        }
        const __m256 qe = _mm256_cvtepi32_ps(_mm256_sub_epi32(even, centre_codes));  // centred codes of inputs 2j
        const __m256 qo = _mm256_cvtepi32_ps(_mm256_sub_epi32(odd, centre_codes));   // and of inputs 2j + 1
        for (int r = 0; r < R; ++r) {
          const float* x = in.paired + (r0 + r) * w.k + b * w.block;
          t[r] = _mm256_fmadd_ps(_mm256_loadu_ps(x + j), qe, t[r]);
          t[r] = _mm256_fmadd_ps(_mm256_loadu_ps(x + half + j), qo, t[r]);
        }
      }
      const __m256 s = _mm256_set1_ps(sp[b]);
      for (int r = 0; r < R; ++r) acc[r] = _mm256_fmadd_ps(t[r], s, acc[r]);  // s_b * T_b
    }
    for (int r = 0; r < R; ++r) y[(r0 + r) * w.n + n] = hsum(acc[r]);
  }
}

// y[r, n] += sum_b c'[b, n] * S[r, b] for every row, eight outputs at a time (c' is [K/block, N]).
__attribute__((target("avx2,fma"))) void offsets_avx2(const BlockWeights& w, const PreparedInput& in, float* y,
                                                      int64_t n_begin, int64_t n_end) {
  if (!w.offset) return;
  const int64_t nb = w.k / w.block;
  for (int64_t r = 0; r < in.rows; ++r) {
    const float* sums = in.sums + r * nb;
    float* yr = y + r * w.n;
    int64_t n = n_begin;
    for (; n + 8 <= n_end; n += 8) {
      __m256 acc = _mm256_loadu_ps(yr + n);
      for (int64_t b = 0; b < nb; ++b) acc = _mm256_fmadd_ps(_mm256_loadu_ps(w.offset + b * w.n + n), _mm256_set1_ps(sums[b]), acc);
      _mm256_storeu_ps(yr + n, acc);
    }
    for (; n < n_end; ++n) yr[n] += offset_term(w, sums, n);
  }
}

template <bool Two, int H>
void rows_avx2(const BlockWeights& w, const PreparedInput& in, float* y, int64_t n_begin, int64_t n_end) {
  int64_t r = 0;
  for (; r + kRowTile <= in.rows; r += kRowTile) tile_avx2<kRowTile, Two, H>(w, in, y, n_begin, n_end, r);
  switch (in.rows - r) {
    case 3: tile_avx2<3, Two, H>(w, in, y, n_begin, n_end, r); break;
    case 2: tile_avx2<2, Two, H>(w, in, y, n_begin, n_end, r); break;
    case 1: tile_avx2<1, Two, H>(w, in, y, n_begin, n_end, r); break;
    default: break;
  }
}

void avx2(const BlockWeights& w, const PreparedInput& in, float* y, int64_t n_begin, int64_t n_end) {
  const bool two = w.low != nullptr, fixed = w.block == 32;
  if (two && fixed) rows_avx2<true, 16>(w, in, y, n_begin, n_end);
  if (two && !fixed) rows_avx2<true, 0>(w, in, y, n_begin, n_end);
  if (!two && fixed) rows_avx2<false, 16>(w, in, y, n_begin, n_end);
  if (!two && !fixed) rows_avx2<false, 0>(w, in, y, n_begin, n_end);
  offsets_avx2(w, in, y, n_begin, n_end);
}

bool has_avx2() {
  static const bool yes = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return yes;
}

}  // namespace

void prepare_input(const float* x, int64_t rows, int64_t k, int64_t block, float* paired, float* sums) {
  const int64_t nb = k / block, half = block / 2;
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t b = 0; b < nb; ++b) {
      const float* src = x + r * k + b * block;
      float* dst = paired + r * k + b * block;
      float sum = 0.0f;
      for (int64_t j = 0; j < half; ++j) {
        dst[j] = src[2 * j];
        dst[half + j] = src[2 * j + 1];
        sum += src[2 * j] + src[2 * j + 1];
      }
      sums[r * nb + b] = sum;
    }
  }
}

void block_matmul(const BlockWeights& w, const PreparedInput& in, float* y, int64_t n_begin, int64_t n_end) {
  if (has_avx2()) {
    avx2(w, in, y, n_begin, n_end);
  } else {
    portable(w, in, y, n_begin, n_end);
  }
}

const char* block_matmul_path() { return has_avx2() ? "avx2" : "portable"; }

}  // namespace sg::kernels
