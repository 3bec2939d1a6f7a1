// The block product (block_matmul.h): a portable loop, and AVX2 and AVX-512 ones chosen at run time.
//
// Per output n and input row r: y = sum_b d_b * T_b + sum_b c'_b * S_b (block_matmul.h), the
// dequantised weight's product `sum_b sum_k x_k * (d_b * code_k + m_b)`, grouped by block.
#include "block_matmul.h"

// GCC 12's AVX-512 headers start some casts from an undefined register: a false -Wuninitialized.
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <vector>

#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace sg::kernels {
namespace {

bool has_avx2();
bool has_avx512();
bool has_vnni();
bool has_amx();

// The environment variable `name` is set and not empty.
bool env_flag(const char* name) {
  const char* value = std::getenv(name);
  return value != nullptr && value[0] != '\0';
}

constexpr int kRowTile = 4;  // input rows that share one unpacking of a weight block
constexpr int64_t kChunk = kScaleTile;  // outputs whose d and c' are unpacked together

// The centre the codes are taken from (block_matmul.h): 136 for two digits; for one digit 8 with
// int8 activations and 0 with float32 ones, where subtracting it would cost one instruction in four.
float centre(const BlockWeights& w, bool int8) { return w.low || w.wide ? 136.0f : int8 ? 8.0f : 0.0f; }

// Outputs a 32-bit lane holds: 8 of 4-bit codes, 4 of 8-bit ones.
int64_t lane_outputs(const BlockWeights& w) { return w.wide ? kLaneOutputs / 2 : kLaneOutputs; }

// 16^-o (256^-o for 8-bit codes): output o of a lane takes its centred code times 16^o (256^o),
// the top one, taken by a shift, times 1.
constexpr float kLaneUnit[kLaneOutputs] = {1.0f, 0x1p-4f, 0x1p-8f, 0x1p-12f, 0x1p-16f, 0x1p-20f, 0x1p-24f, 1.0f};
constexpr float kWideLaneUnit[kLaneOutputs / 2] = {1.0f, 0x1p-8f, 0x1p-16f, 1.0f};

// float16 -> float32, exactly (subnormals, infinities and NaNs included).
float from_half(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16;
  uint32_t exponent = (h >> 10) & 0x1F, mantissa = h & 0x3FF, bits;
  if (exponent == 0x1F) {
    bits = sign | 0x7F800000 | (mantissa << 13);
  } else if (exponent) {
    bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
  } else if (!mantissa) {
    bits = sign;
  } else {  // subnormal: normalise
    exponent = 113;
    while (!(mantissa & 0x400)) {
      mantissa <<= 1;
      --exponent;
    }
    bits = sign | (exponent << 23) | ((mantissa & 0x3FF) << 13);
  }
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// Where d and m hold block b of output n.
int64_t scale_at(const BlockWeights& w, int64_t b, int64_t n) {
  return ((n / kScaleTile) * (w.k / w.block) + b) * kScaleTile + n % kScaleTile;
}

// Element i of d or m.
float value(const BlockWeights& w, const void* p, int64_t i) {
  return w.half ? from_half(static_cast<const uint16_t*>(p)[i]) : static_cast<const float*>(p)[i];
}

// c' = m + centre * d of element i, rounded once.
float shift(const BlockWeights& w, int64_t i, bool int8) {
  return std::fma(centre(w, int8), value(w, w.scale, i), w.offset ? value(w, w.offset, i) : 0.0f);
}

// The offset part of y[r, n]: sum_b c'_b * S_b.
float offset_term(const BlockWeights& w, const float* sums, int64_t n, bool int8) {
  float total = 0.0f;
  for (int64_t b = 0; b < w.k / w.block; ++b) total = std::fma(shift(w, scale_at(w, b, n), int8), sums[b], total);
  return total;
}

// The stored code of output n, input i (0-15 for one digit, 0-255 for two), in any layout.
int code_at(const BlockWeights& w, int64_t n, int64_t i) {
  const int64_t half = w.block / 2, nb = w.k / w.block;
  const int64_t b = i / w.block, j = (i % w.block) / 2;
  if (w.quads && w.wide) {  // tile n / 16, block b, row 2 ((i % 32) / 8) + i % 2: byte 4 (n % 16) + (i % 8) / 2
    return w.high[(n / kScaleTile * nb + b) * kByteQuadBytes + (2 * ((i % 32) / 8) + i % 2) * 64 + n % kScaleTile * 4 +
                  (i % 8) / 2];
  }
  if (w.quads) {  // tile n / 16, block b, group (i % 32) / 8: byte 4 (n % 16) + (i % 8) / 2, nibble i % 2
    const uint8_t* byte = w.high + (n / kScaleTile * nb + b) * kQuadBytes + (i % 32) / 8 * 64 + n % kScaleTile * 4 +
                          (i % 8) / 2;
    return (*byte >> (4 * (i % 2))) & 0x0F;
  }
  if (w.lanes) {  // lane [n / 8, paired position of i], nibble n % 8 (8-bit: [n / 4, ...], byte n % 4)
    const int64_t per = lane_outputs(w);
    const uint8_t* lane = w.high + ((n / per) * w.k + b * w.block + (i % 2) * half + j) * 4;
    const int o = static_cast<int>(n % per);
    return w.wide ? lane[o] : (lane[o / 2] >> (4 * (o % 2))) & 0x0F;
  }
  const int64_t at = (n * nb + b) * half + j;
  const int shift = (i % 2) ? 4 : 0;
  const int high = (w.high[at] >> shift) & 0x0F;
  return w.low ? 16 * high + ((w.low[at] >> shift) & 0x0F) : high;
}

float centred_code(const BlockWeights& w, int64_t n, int64_t i) {
  return static_cast<float>(code_at(w, n, i)) - centre(w, false);
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
        total += value(w, w.scale, scale_at(w, b, n)) * t;
      }
      y[r * w.n + n] = total + offset_term(w, in.sums + r * nb, n, false);
    }
  }
}

// The int8 product's (row, output) chain as the AVX2 path computes it (int8_tile): 8 lanes, lane l
// of a pair holding the integer sum over 4 even and 4 odd inputs of block 2p + l / 4, scaled and
// added per pair, then summed as hsum does; integer sums are exact in any order.
float int8_chain(const BlockWeights& w, const PreparedInput& in, int64_t r, int64_t n) {
  const int64_t nb = w.k / kInt8Block, pairs = (nb + 1) / 2, half = kInt8Block / 2;
  float acc[8] = {};
  for (int64_t p = 0; p < pairs; ++p) {
    const int8_t* q = in.codes + (r * pairs + p) * 64;
    const float* steps = in.steps + (r * pairs + p) * 8;
    const int32_t* centred = in.centred + (r * pairs + p) * 8;
    for (int lane = 0; lane < 8; ++lane) {
      const int64_t h = lane / 4, b = 2 * p + h;
      int32_t sum = 0;
      if (b < nb) {
        for (int64_t j = 4 * (lane % 4); j < 4 * (lane % 4) + 4; ++j) {  // a byte: inputs 2j and 2j + 1
          sum += code_at(w, n, b * kInt8Block + 2 * j) * q[h * half + j] +
                 code_at(w, n, b * kInt8Block + 2 * j + 1) * q[32 + h * half + j];
        }
      }
      const float d = b < nb ? value(w, w.scale, scale_at(w, b, n)) : 0.0f;
      acc[lane] = std::fma(static_cast<float>(sum - centred[lane]), steps[lane] * d, acc[lane]);
    }
  }
  return ((acc[0] + acc[4]) + (acc[2] + acc[6])) + ((acc[1] + acc[5]) + (acc[3] + acc[7]));
}

void portable_int8(const BlockWeights& w, const PreparedInput& in, float* y, int64_t n_begin, int64_t n_end) {
  const int64_t nb = w.k / kInt8Block;
  for (int64_t n = n_begin; n < n_end; ++n)
    for (int64_t r = 0; r < in.rows; ++r) y[r * w.n + n] = int8_chain(w, in, r, n) + offset_term(w, in.sums + r * nb, n, true);
}

__attribute__((target("avx2,fma,f16c"))) inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
  return _mm_cvtss_f32(s);
}

// One pass over a lane tile (lanes layout, block_matmul.h): rows [0, R) and the tile's outputs
// [O, O + P). Each 8 lanes (8 inputs of the paired order, 8 or, for B = 8-bit codes, 4 outputs)
// are loaded once; output o's codes times 16^o (256^o) are one AND (the top output's one shift),
// less the centre for 8-bit codes, converted once and multiplied into every row. The inputs go in
// tile_avx2's order (a block's 8 even inputs from j, then its 8 odd ones, for j = 0, 8, ...), one
// chain a (row, output), and the chain's value is 16^o (256^o) times tile_avx2's, exactly, so once
// scaled back a product rounds as the pairs layout's does, bit for bit, for every R and P.
// `d`: the tile's scales, [K/block] x kChunk. H: block / 2 when fixed at compile time (16: the
// loop unrolls), 0 to read it from w.
template <int B, int R, int P, int O, int H>
__attribute__((target("avx2,fma,f16c"))) void lane_pass(const BlockWeights& w, const uint32_t* lanes,
                                                        const float* const* x, const float* d,
                                                        float (*out)[kLaneOutputs]) {
  constexpr int kTop = 32 / B - 1;
  constexpr int kMask = (1 << B) - 1, kCentre = B == 4 ? 0 : 136;  // centre(w, false)
  const int64_t half = H ? H : w.block / 2, block = 2 * half, nb = w.k / block;
  __m256 acc[R][P];
  for (int r = 0; r < R; ++r)
    for (int o = 0; o < P; ++o) acc[r][o] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    __m256 t[R][P];
    for (int r = 0; r < R; ++r)
      for (int o = 0; o < P; ++o) t[r][o] = _mm256_setzero_ps();
    for (int64_t j = 0; j < half; j += 8) {
      for (int64_t at_input : {b * block + j, b * block + half + j}) {  // 8 even inputs, then 8 odd
        // the next tile's lanes, from memory while this one computes (its first pass only): 8-10%
        // off a one-row product that streams from memory (prefetches never fault past the end)
        if (O == 0) _mm_prefetch(reinterpret_cast<const char*>(lanes + at_input + w.k), _MM_HINT_T0);
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(lanes + at_input));
        __m256 xs[R];
        for (int r = 0; r < R; ++r) xs[r] = _mm256_loadu_ps(x[r] + at_input);
        for (int o = 0; o < P; ++o) {
          const int at = O + o;
          const __m256i code = at == kTop ? _mm256_srli_epi32(v, 32 - B)
                                          : _mm256_and_si256(v, _mm256_set1_epi32(kMask << (B * at)));
          const int centre_at = at == kTop ? kCentre : kCentre << (B * at);
          const __m256 q = _mm256_cvtepi32_ps(kCentre ? _mm256_sub_epi32(code, _mm256_set1_epi32(centre_at)) : code);
          for (int r = 0; r < R; ++r) t[r][o] = _mm256_fmadd_ps(xs[r], q, t[r][o]);
        }
      }
    }
    for (int o = 0; o < P; ++o) {
      const __m256 s = _mm256_broadcast_ss(d + b * kChunk + O + o);
      for (int r = 0; r < R; ++r) acc[r][o] = _mm256_fmadd_ps(t[r][o], s, acc[r][o]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int o = 0; o < P; ++o) {
      const float unit = B == 4 ? kLaneUnit[O + o] : kWideLaneUnit[O + o];
      out[r][O + o] = hsum(_mm256_mul_ps(acc[r][o], _mm256_set1_ps(unit)));
    }
}

// AVX-512 (Intel's server cores here): two outputs a register, output a's chain in the low 8 lanes
// and output a + 1's in the high 8. Each lane does exactly the AVX2 loop's arithmetic in its order,
// so every product rounds as the AVX2 one does, to the bit, with half the instructions.
#define SG_AVX512 "avx512f,avx512bw,avx512dq,avx512vl,avx2,fma,f16c"

// lo in the low 8 lanes, hi in the high 8.
__attribute__((target(SG_AVX512))) inline __m512i halves(int32_t lo, int32_t hi) {
  return _mm512_inserti64x4(_mm512_set1_epi32(lo), _mm256_set1_epi32(hi), 1);
}
__attribute__((target(SG_AVX512))) inline __m512 halves(float lo, float hi) {
  return _mm512_insertf32x8(_mm512_set1_ps(lo), _mm256_set1_ps(hi), 1);
}

// The two chains' totals, each as hsum gives it.
__attribute__((target(SG_AVX512))) inline void hsum_halves(__m512 v, float lo_unit, float hi_unit, float* lo, float* hi) {
  *lo = hsum(_mm256_mul_ps(_mm512_castps512_ps256(v), _mm256_set1_ps(lo_unit)));
  *hi = hsum(_mm256_mul_ps(_mm512_extractf32x8_ps(v, 1), _mm256_set1_ps(hi_unit)));
}

// lane_pass for the output pairs (O + 2i, O + 2i + 1), i < Q: a pair's codes come from one
// register holding the 8 lanes twice, by one AND (with a shift first for the top output's half).
template <int B, int R, int Q, int O, int H>
__attribute__((target(SG_AVX512))) void lane_pass512(const BlockWeights& w, const uint32_t* lanes,
                                                    const float* const* x, const float* d,
                                                    float (*out)[kLaneOutputs]) {
  constexpr int kTop = 32 / B - 1;
  constexpr int kMask = (1 << B) - 1, kCentre = B == 4 ? 0 : 136;
  const int64_t half = H ? H : w.block / 2, block = 2 * half, nb = w.k / block;
  __m512i mask[Q], shift[Q], centre_at[Q];
  for (int i = 0; i < Q; ++i) {
    const int a = O + 2 * i, top = a + 1 == kTop;  // a is even and the top output odd
    mask[i] = halves(kMask << (B * a), top ? kMask : kMask << (B * (a + 1)));
    shift[i] = halves(0, top ? 32 - B : 0);
    centre_at[i] = halves(kCentre << (B * a), top ? kCentre : kCentre << (B * (a + 1)));
  }
  __m512 acc[R][Q];
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < Q; ++i) acc[r][i] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    __m512 t[R][Q];
    for (int r = 0; r < R; ++r)
      for (int i = 0; i < Q; ++i) t[r][i] = _mm512_setzero_ps();
    for (int64_t j = 0; j < half; j += 8) {
      for (int64_t at_input : {b * block + j, b * block + half + j}) {
        if (O == 0) _mm_prefetch(reinterpret_cast<const char*>(lanes + at_input + w.k), _MM_HINT_T0);
        const __m512i v = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(lanes + at_input)));
        __m512 xs[R];
        for (int r = 0; r < R; ++r) xs[r] = _mm512_broadcast_f32x8(_mm256_loadu_ps(x[r] + at_input));
        for (int i = 0; i < Q; ++i) {
          __m512i code = O + 2 * i + 1 == kTop ? _mm512_srlv_epi32(v, shift[i]) : v;
          code = _mm512_and_si512(code, mask[i]);
          if (kCentre) code = _mm512_sub_epi32(code, centre_at[i]);
          const __m512 q = _mm512_cvtepi32_ps(code);
          for (int r = 0; r < R; ++r) t[r][i] = _mm512_fmadd_ps(xs[r], q, t[r][i]);
        }
      }
    }
    for (int i = 0; i < Q; ++i) {
      const __m512 s = halves(d[b * kChunk + O + 2 * i], d[b * kChunk + O + 2 * i + 1]);
      for (int r = 0; r < R; ++r) acc[r][i] = _mm512_fmadd_ps(t[r][i], s, acc[r][i]);
    }
  }
  const float* unit = B == 4 ? kLaneUnit : kWideLaneUnit;
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < Q; ++i) {
      const int a = O + 2 * i;
      hsum_halves(acc[r][i], unit[a], unit[a + 1], &out[r][a], &out[r][a + 1]);
    }
}

template <int B, int R, int Q, int O = 0>
void lane_tile512(const BlockWeights& w, const uint32_t* lanes, const float* const* x, const float* d,
                  float (*out)[kLaneOutputs]) {
  if (w.block == 32) {
    lane_pass512<B, R, Q, O, 16>(w, lanes, x, d, out);
  } else {
    lane_pass512<B, R, Q, O, 0>(w, lanes, x, d, out);
  }
  if constexpr (O + 2 * Q < 32 / B) lane_tile512<B, R, Q, O + 2 * Q>(w, lanes, x, d, out);
}

template <int B>
void lane_rows512(const BlockWeights& w, int64_t rows, const uint32_t* lanes, const float* const* x, const float* d,
                  float (*out)[kLaneOutputs]) {
  constexpr int kPairs = 16 / B;  // every output of a lane: 4 pairs of 4-bit codes, 2 of 8-bit ones
  switch (rows) {
    case 1: lane_tile512<B, 1, kPairs>(w, lanes, x, d, out); break;
    case 2: lane_tile512<B, 2, kPairs>(w, lanes, x, d, out); break;
    case 3: lane_tile512<B, 3, kPairs / 2>(w, lanes, x, d, out); break;
    default: lane_tile512<B, 4, kPairs / 2>(w, lanes, x, d, out); break;
  }
}

// All outputs of a lane tile (8, or 4 for 8-bit codes) for rows [0, R), P at a time.
template <int B, int R, int P, int O = 0>
void lane_tile(const BlockWeights& w, const uint32_t* lanes, const float* const* x, const float* d,
               float (*out)[kLaneOutputs]) {
  if (w.block == 32) {
    lane_pass<B, R, P, O, 16>(w, lanes, x, d, out);
  } else {
    lane_pass<B, R, P, O, 0>(w, lanes, x, d, out);
  }
  if constexpr (O + P < 32 / B) lane_tile<B, R, P, O + P>(w, lanes, x, d, out);
}

template <int B>
void lane_rows(const BlockWeights& w, int64_t rows, const uint32_t* lanes, const float* const* x, const float* d,
               float (*out)[kLaneOutputs]) {
  switch (rows) {
    case 1: lane_tile<B, 1, 32 / B>(w, lanes, x, d, out); break;
    case 2: lane_tile<B, 2, 2>(w, lanes, x, d, out); break;
    case 3: lane_tile<B, 3, 1>(w, lanes, x, d, out); break;
    default: lane_tile<B, 4, 1>(w, lanes, x, d, out); break;
  }
}

// The chunk's outputs [n0, n0 + count) for every row, lanes layout: 4 rows a pass over a tile,
// one output at a time; 2 rows two outputs; one row all 8 (4) in one pass: its 8 block sums fit the
// registers, and the block totals go to the stack once a block (measured 4% faster than two passes).
void lanes_avx2(const BlockWeights& w, const PreparedInput& in, float* y, int64_t n0, int64_t count, const float* d) {
  const int64_t per = lane_outputs(w);
  const bool avx512 = has_avx512();
  float out[kRowTile][kLaneOutputs];
  for (int64_t first = 0; first < count; first += per) {
    const uint32_t* lanes = reinterpret_cast<const uint32_t*>(w.high) + ((n0 + first) / per) * w.k;
    const int64_t outputs = count - first < per ? count - first : per;
    for (int64_t r0 = 0; r0 < in.rows; r0 += kRowTile) {
      const float* x[kRowTile];
      const int64_t rows = in.rows - r0 < kRowTile ? in.rows - r0 : kRowTile;
      for (int64_t r = 0; r < rows; ++r) x[r] = in.paired + (r0 + r) * w.k;
      if (avx512) {
        w.wide ? lane_rows512<8>(w, rows, lanes, x, d + first, out) : lane_rows512<4>(w, rows, lanes, x, d + first, out);
      } else if (w.wide) {
        lane_rows<8>(w, rows, lanes, x, d + first, out);
      } else {
        lane_rows<4>(w, rows, lanes, x, d + first, out);
      }
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t o = 0; o < outputs; ++o) y[(r0 + r) * w.n + n0 + first + o] = out[r][o];
    }
  }
}

// Rows [r0, r0 + R) of y for the C outputs [n0, n0 + C): each 8 packed bytes of a block are
// unpacked once into 8 even and 8 odd centred codes, then multiplied into every row of the tile.
// Each (row, output) pair keeps its own chain of multiply-adds, in the same order whatever R and C
// are, so a row of a many-row call equals the same row computed alone, bit for bit (a verify call
// rounds as a step does); the R * C chains are independent, which hides the multiply-add latency.
// Two: two digits (w.low set); H: block / 2 when fixed at compile time (the common 32-weight
// blocks, so the byte loop unrolls), 0 to read it from w. d: the chunk's scales as float32,
// [K/block, kChunk] from output n0's column.
template <int R, int C, bool Two, int H>
__attribute__((target("avx2,fma,f16c"))) void tile_avx2(const BlockWeights& w, const PreparedInput& in, float* y,
                                                        int64_t n_first, int64_t count, int64_t r0, const float* d_first) {
  const int64_t nb = w.k / w.block, half = H ? H : w.block / 2, block = 2 * half;
  const __m256i nibble = _mm256_set1_epi32(0x0F);
  const __m256i top = _mm256_set1_epi32(0xF0);
  const __m256i centre_codes = _mm256_set1_epi32(static_cast<int>(centre(w, false)));
  for (int64_t first = 0; first + C <= count; first += C) {
    const int64_t n0 = n_first + first;
    const float* d = d_first + first;
    // running pointers (a block's inputs, each output's packed digits), advanced a block at a time
    const float* x[R];
    const uint8_t* hp[C];
    const uint8_t* lp[C];
    for (int r = 0; r < R; ++r) x[r] = in.paired + (r0 + r) * w.k;
    for (int c = 0; c < C; ++c) {
      hp[c] = w.high + (n0 + c) * nb * half;
      lp[c] = Two ? w.low + (n0 + c) * nb * half : nullptr;
    }
    __m256 acc[R][C];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c) acc[r][c] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
      __m256 t[R][C];  // T_b of each row and output, in 8 lanes
      for (int r = 0; r < R; ++r)
        for (int c = 0; c < C; ++c) t[r][c] = _mm256_setzero_ps();
      for (int64_t j = 0; j < half; j += 8) {
        __m256 xe[R], xo[R];
        for (int r = 0; r < R; ++r) {
          xe[r] = _mm256_loadu_ps(x[r] + j);
          xo[r] = _mm256_loadu_ps(x[r] + half + j);
        }
        for (int c = 0; c < C; ++c) {
          // 8 packed bytes widened to 8 lanes, then split into nibbles within each lane
          const __m256i h = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(hp[c] + j)));
          __m256i even, odd;
          if (Two) {  // code = 16 * high + low
            const __m256i l = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(lp[c] + j)));
            even = _mm256_or_si256(_mm256_slli_epi32(_mm256_and_si256(h, nibble), 4), _mm256_and_si256(l, nibble));
            odd = _mm256_or_si256(_mm256_and_si256(h, top), _mm256_srli_epi32(l, 4));
          } else {
            even = _mm256_and_si256(h, nibble);
            odd = _mm256_srli_epi32(h, 4);
          }
          if (Two) {  // one digit has centre 0
            even = _mm256_sub_epi32(even, centre_codes);
            odd = _mm256_sub_epi32(odd, centre_codes);
          }
          const __m256 qe = _mm256_cvtepi32_ps(even);  // centred codes of inputs 2j
          const __m256 qo = _mm256_cvtepi32_ps(odd);   // and of inputs 2j + 1
          for (int r = 0; r < R; ++r) {
            t[r][c] = _mm256_fmadd_ps(xe[r], qe, t[r][c]);
            t[r][c] = _mm256_fmadd_ps(xo[r], qo, t[r][c]);
          }
        }
      }
      for (int c = 0; c < C; ++c) {
        const __m256 s = _mm256_broadcast_ss(d + b * kChunk + c);
        for (int r = 0; r < R; ++r) acc[r][c] = _mm256_fmadd_ps(t[r][c], s, acc[r][c]);  // d_b * T_b
      }
      for (int r = 0; r < R; ++r) x[r] += block;
      for (int c = 0; c < C; ++c) {
        hp[c] += half;
        if (Two) lp[c] += half;
      }
    }
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c) y[(r0 + r) * w.n + n0 + c] = hsum(acc[r][c]);
  }
}

// 8 packed bytes of one output, then 8 of the next, widened to the low and the high 8 lanes.
__attribute__((target(SG_AVX512))) inline __m512i widened_pair(const uint8_t* a, const uint8_t* b) {
  return _mm512_cvtepu8_epi32(_mm_unpacklo_epi64(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(a)),
                                                 _mm_loadl_epi64(reinterpret_cast<const __m128i*>(b))));
}

// tile_avx2 on AVX-512: outputs n0 + 2i and n0 + 2i + 1 (i < Q) in one register's halves, each
// lane's chain tile_avx2's, so the sums are its own to the bit.
template <int R, int Q, bool Two, int H>
__attribute__((target(SG_AVX512))) void tile512(const BlockWeights& w, const PreparedInput& in, float* y,
                                               int64_t n_first, int64_t count, int64_t r0, const float* d_first) {
  const int64_t nb = w.k / w.block, half = H ? H : w.block / 2, block = 2 * half;
  const __m512i nibble = _mm512_set1_epi32(0x0F);
  const __m512i top = _mm512_set1_epi32(0xF0);
  const __m512i centre_codes = _mm512_set1_epi32(static_cast<int>(centre(w, false)));
  for (int64_t first = 0; first + 2 * Q <= count; first += 2 * Q) {
    const int64_t n0 = n_first + first;
    const float* d = d_first + first;
    const float* x[R];
    const uint8_t* hp[2 * Q];
    const uint8_t* lp[2 * Q];
    for (int r = 0; r < R; ++r) x[r] = in.paired + (r0 + r) * w.k;
    for (int c = 0; c < 2 * Q; ++c) {
      hp[c] = w.high + (n0 + c) * nb * half;
      lp[c] = Two ? w.low + (n0 + c) * nb * half : nullptr;
    }
    __m512 acc[R][Q];
    for (int r = 0; r < R; ++r)
      for (int i = 0; i < Q; ++i) acc[r][i] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
      __m512 t[R][Q];
      for (int r = 0; r < R; ++r)
        for (int i = 0; i < Q; ++i) t[r][i] = _mm512_setzero_ps();
      for (int64_t j = 0; j < half; j += 8) {
        __m512 xe[R], xo[R];
        for (int r = 0; r < R; ++r) {
          xe[r] = _mm512_broadcast_f32x8(_mm256_loadu_ps(x[r] + j));
          xo[r] = _mm512_broadcast_f32x8(_mm256_loadu_ps(x[r] + half + j));
        }
        for (int i = 0; i < Q; ++i) {
          const __m512i h = widened_pair(hp[2 * i] + j, hp[2 * i + 1] + j);
          __m512i even, odd;
          if (Two) {
            const __m512i l = widened_pair(lp[2 * i] + j, lp[2 * i + 1] + j);
            even = _mm512_or_si512(_mm512_slli_epi32(_mm512_and_si512(h, nibble), 4), _mm512_and_si512(l, nibble));
            odd = _mm512_or_si512(_mm512_and_si512(h, top), _mm512_srli_epi32(l, 4));
            even = _mm512_sub_epi32(even, centre_codes);
            odd = _mm512_sub_epi32(odd, centre_codes);
          } else {
            even = _mm512_and_si512(h, nibble);
            odd = _mm512_srli_epi32(h, 4);
          }
          const __m512 qe = _mm512_cvtepi32_ps(even);
          const __m512 qo = _mm512_cvtepi32_ps(odd);
          for (int r = 0; r < R; ++r) {
            t[r][i] = _mm512_fmadd_ps(xe[r], qe, t[r][i]);
            t[r][i] = _mm512_fmadd_ps(xo[r], qo, t[r][i]);
          }
        }
      }
      for (int i = 0; i < Q; ++i) {
        const __m512 s = halves(d[b * kChunk + 2 * i], d[b * kChunk + 2 * i + 1]);
        for (int r = 0; r < R; ++r) acc[r][i] = _mm512_fmadd_ps(t[r][i], s, acc[r][i]);
      }
      for (int r = 0; r < R; ++r) x[r] += block;
      for (int c = 0; c < 2 * Q; ++c) {
        hp[c] += half;
        if (Two) lp[c] += half;
      }
    }
    for (int r = 0; r < R; ++r)
      for (int i = 0; i < Q; ++i)
        hsum_halves(acc[r][i], 1.0f, 1.0f, &y[(r0 + r) * w.n + n0 + 2 * i], &y[(r0 + r) * w.n + n0 + 2 * i + 1]);
  }
}

// Rows [r0, r0 + R) for the chunk's outputs [n0, n0 + count): C outputs at a time, then one at a time.
// On AVX-512 2Q outputs at a time (Q = C / 2, at least 1), and a last odd one by tile_avx2 (which
// rounds alike).
template <int R, int C, bool Two, int H>
void columns_avx2(const BlockWeights& w, const PreparedInput& in, float* y, int64_t n0, int64_t count, int64_t r0,
                  const float* d) {
  int64_t whole = count / C * C;
  if (has_avx512()) {
    constexpr int Q = C > 1 ? C / 2 : 1;
    whole = count / (2 * Q) * (2 * Q);
    tile512<R, Q, Two, H>(w, in, y, n0, whole, r0, d);
  } else {
    tile_avx2<R, C, Two, H>(w, in, y, n0, whole, r0, d);
  }
  if (whole < count) tile_avx2<R, 1, Two, H>(w, in, y, n0 + whole, count - whole, r0, d + whole);
}

// The 4-bit digits of 2 blocks of one output (32 bytes; 16 of one last block, zeros after) times
// rows' int8 codes: per 32-bit lane the integer sum over 4 even and 4 odd inputs (int8_chain).
__attribute__((target("avx2,fma,f16c"))) inline __m256i digit_sums(__m256i packed, __m256i even_q, __m256i odd_q) {
  const __m256i nibble = _mm256_set1_epi8(0x0F);
  const __m256i even = _mm256_and_si256(packed, nibble);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi16(packed, 4), nibble);
  // codes < 16 and |q| <= 127: a 16-bit sum of four products stays below 7,620
  const __m256i sums = _mm256_add_epi16(_mm256_maddubs_epi16(even, even_q), _mm256_maddubs_epi16(odd, odd_q));
  return _mm256_madd_epi16(sums, _mm256_set1_epi16(1));
}

__attribute__((target("avx2,fma,f16c"))) inline __m256i packed_pair(const uint8_t* p, bool single) {
  if (single) return _mm256_set_m128i(_mm_setzero_si128(), _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
}

// Output n0 + c's part of pair p of blocks for int8_tile: its scales (the first block's in lanes
// 0-3, the second's in 4-7, zero past the last block) and its packed digits (`low` zero for one
// digit). The same blocks of the output `ahead` on are prefetched from memory while these compute
// (9% off an int8 `none` step: the hardware prefetcher does not run far enough ahead).
template <bool Two>
__attribute__((target("avx2,fma,f16c"))) inline void int8_output(const BlockWeights& w, const float* d, int64_t n0,
                                                                 int64_t c, int64_t p, int64_t ahead, __m256* dv,
                                                                 __m256i* high, __m256i* low) {
  const int64_t nb = w.k / kInt8Block, half = kInt8Block / 2;
  const bool single = 2 * p + 1 == nb;
  const __m128 d_first_block = _mm_broadcast_ss(d + 2 * p * kChunk + c);
  const __m128 d_second = single ? _mm_setzero_ps() : _mm_broadcast_ss(d + (2 * p + 1) * kChunk + c);
  *dv = _mm256_set_m128(d_second, d_first_block);
  const int64_t at = (n0 + c) * nb * half + 2 * p * half;
  _mm_prefetch(reinterpret_cast<const char*>(w.high + at + ahead * nb * half), _MM_HINT_T0);
  if (Two) _mm_prefetch(reinterpret_cast<const char*>(w.low + at + ahead * nb * half), _MM_HINT_T0);
  *high = packed_pair(w.high + at, single);
  *low = Two ? packed_pair(w.low + at, single) : _mm256_setzero_si256();
}

// Rows [r0, r0 + R) of y for C outputs at a time of [n_first, n_first + count), int8 activations
// (block_matmul.h): a pair of blocks' digits are unpacked once and multiplied into every row;
// each (row, output) keeps its own chain, in int8_chain's order whatever R and C are.
template <int R, int C, bool Two>
__attribute__((target("avx2,fma,f16c"))) void int8_tile(const BlockWeights& w, const PreparedInput& in, float* y,
                                                        int64_t n_first, int64_t count, int64_t r0, const float* d_first) {
  const int64_t nb = w.k / kInt8Block, pairs = (nb + 1) / 2;
  for (int64_t first = 0; first + C <= count; first += C) {
    const int64_t n0 = n_first + first;
    const float* d = d_first + first;
    __m256 acc[R][C];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c) acc[r][c] = _mm256_setzero_ps();
    for (int64_t p = 0; p < pairs; ++p) {
      __m256i even_q[R], odd_q[R];
      __m256 steps[R];
      __m256i centred[R];
      for (int r = 0; r < R; ++r) {
        const int64_t at = (r0 + r) * pairs + p;
        even_q[r] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(in.codes + at * 64));
        odd_q[r] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(in.codes + at * 64 + 32));
        steps[r] = _mm256_loadu_ps(in.steps + at * 8);
        centred[r] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(in.centred + at * 8));
      }
      for (int c = 0; c < C; ++c) {
        __m256 dv;
        __m256i high, low;
        int8_output<Two>(w, d, n0, c, p, C, &dv, &high, &low);
        for (int r = 0; r < R; ++r) {
          __m256i sum = digit_sums(high, even_q[r], odd_q[r]);
          if (Two) sum = _mm256_add_epi32(_mm256_slli_epi32(sum, 4), digit_sums(low, even_q[r], odd_q[r]));
          const __m256 t = _mm256_cvtepi32_ps(_mm256_sub_epi32(sum, centred[r]));
          acc[r][c] = _mm256_fmadd_ps(t, _mm256_mul_ps(steps[r], dv), acc[r][c]);
        }
      }
    }
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c) y[(r0 + r) * w.n + n0 + c] = hsum(acc[r][c]);
  }
}

// digit_sums for two outputs' pairs of blocks at once, by VNNI's four-byte dot products: the same
// integer per lane (no step saturates: 4 products of codes < 16 and |q| <= 127).
__attribute__((target(SG_AVX512 ",avx512vnni"))) inline __m512i digit_sums512(__m512i packed, __m512i even_q, __m512i odd_q) {
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  const __m512i even = _mm512_and_si512(packed, nibble);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi16(packed, 4), nibble);
  return _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), even, even_q), odd, odd_q);
}

// int8_tile on AVX-512 with VNNI: outputs n0 + 2i and n0 + 2i + 1 (i < Q) in one register's halves.
template <int R, int Q, bool Two>
__attribute__((target(SG_AVX512 ",avx512vnni"))) void int8_tile512(const BlockWeights& w, const PreparedInput& in, float* y,
                                                                  int64_t n_first, int64_t count, int64_t r0,
                                                                  const float* d_first) {
  const int64_t nb = w.k / kInt8Block, pairs = (nb + 1) / 2;
  for (int64_t first = 0; first + 2 * Q <= count; first += 2 * Q) {
    const int64_t n0 = n_first + first;
    const float* d = d_first + first;
    __m512 acc[R][Q];
    for (int r = 0; r < R; ++r)
      for (int i = 0; i < Q; ++i) acc[r][i] = _mm512_setzero_ps();
    for (int64_t p = 0; p < pairs; ++p) {
      __m512i even_q[R], odd_q[R], centred[R];
      __m512 steps[R];
      for (int r = 0; r < R; ++r) {
        const int64_t at = (r0 + r) * pairs + p;
        even_q[r] = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(in.codes + at * 64)));
        odd_q[r] = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(in.codes + at * 64 + 32)));
        steps[r] = _mm512_broadcast_f32x8(_mm256_loadu_ps(in.steps + at * 8));
        centred[r] = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(in.centred + at * 8)));
      }
      for (int i = 0; i < Q; ++i) {
        __m256 dv[2];
        __m256i high[2], low[2];
        for (int e = 0; e < 2; ++e) int8_output<Two>(w, d, n0, 2 * i + e, p, 2 * Q, &dv[e], &high[e], &low[e]);
        const __m512 scales = _mm512_insertf32x8(_mm512_castps256_ps512(dv[0]), dv[1], 1);
        const __m512i codes_high = _mm512_inserti64x4(_mm512_castsi256_si512(high[0]), high[1], 1);
        const __m512i codes_low = _mm512_inserti64x4(_mm512_castsi256_si512(low[0]), low[1], 1);
        for (int r = 0; r < R; ++r) {
          __m512i sum = digit_sums512(codes_high, even_q[r], odd_q[r]);
          if (Two) sum = _mm512_add_epi32(_mm512_slli_epi32(sum, 4), digit_sums512(codes_low, even_q[r], odd_q[r]));
          const __m512 t = _mm512_cvtepi32_ps(_mm512_sub_epi32(sum, centred[r]));
          acc[r][i] = _mm512_fmadd_ps(t, _mm512_mul_ps(steps[r], scales), acc[r][i]);
        }
      }
    }
    for (int r = 0; r < R; ++r)
      for (int i = 0; i < Q; ++i)
        hsum_halves(acc[r][i], 1.0f, 1.0f, &y[(r0 + r) * w.n + n0 + 2 * i], &y[(r0 + r) * w.n + n0 + 2 * i + 1]);
  }
}

template <int R, int C, bool Two>
void int8_columns(const BlockWeights& w, const PreparedInput& in, float* y, int64_t n0, int64_t count, int64_t r0,
                  const float* d) {
  int64_t whole = count / C * C;
  if (has_vnni()) {  // as columns_avx2
    constexpr int Q = C > 1 ? C / 2 : 1;
    whole = count / (2 * Q) * (2 * Q);
    int8_tile512<R, Q, Two>(w, in, y, n0, whole, r0, d);
  } else {
    int8_tile<R, C, Two>(w, in, y, n0, whole, r0, d);
  }
  if (whole < count) int8_tile<R, 1, Two>(w, in, y, n0 + whole, count - whole, r0, d + whole);
}

template <bool Two>
void int8_rows(const BlockWeights& w, const PreparedInput& in, float* y, int64_t n0, int64_t count, const float* d) {
  int64_t r = 0;
  for (; r + kRowTile <= in.rows; r += kRowTile) int8_columns<kRowTile, 1, Two>(w, in, y, n0, count, r, d);
  switch (in.rows - r) {
    case 3: int8_columns<3, 1, Two>(w, in, y, n0, count, r, d); break;
    case 2: int8_columns<2, 2, Two>(w, in, y, n0, count, r, d); break;
    case 1: int8_columns<1, 4, Two>(w, in, y, n0, count, r, d); break;
    default: break;
  }
}

// Eight consecutive elements of d or m, from element i.
__attribute__((target("avx2,fma,f16c"))) inline __m256 eight(const BlockWeights& w, const void* p, int64_t i) {
  if (w.half) return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(p) + i)));
  return _mm256_loadu_ps(static_cast<const float*>(p) + i);
}

__attribute__((target(SG_AVX512))) inline __m512 sixteen(const BlockWeights& w, const void* p, int64_t i) {
  if (w.half) return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(p) + i)));
  return _mm512_loadu_ps(static_cast<const float*>(p) + i);
}

// d and c' = m + centre * d of the outputs [n0, n0 + count) as float32, [K/block, kChunk] each,
// zero past count.
__attribute__((target("avx2,fma,f16c"))) void unpack_chunk(const BlockWeights& w, int64_t n0, int64_t count,
                                                           float* d, float* shifts, bool int8) {
  const int64_t nb = w.k / w.block;
  const __m256 centre8 = _mm256_set1_ps(centre(w, int8));
  for (int64_t b = 0; b < nb; ++b) {
    float* db = d + b * kChunk;
    float* sb = shifts + b * kChunk;
    if (count == kChunk && n0 % kChunk == 0) {  // one contiguous run of the stored layout
      for (int64_t c = 0; c < kChunk; c += 8) {
        const int64_t at = scale_at(w, b, n0 + c);
        const __m256 scale = eight(w, w.scale, at);
        const __m256 m = w.offset ? eight(w, w.offset, at) : _mm256_setzero_ps();
        _mm256_storeu_ps(db + c, scale);
        _mm256_storeu_ps(sb + c, _mm256_fmadd_ps(centre8, scale, m));
      }
    } else {
      for (int64_t c = 0; c < kChunk; ++c) {
        db[c] = c < count ? value(w, w.scale, scale_at(w, b, n0 + c)) : 0.0f;
        sb[c] = c < count ? shift(w, scale_at(w, b, n0 + c), int8) : 0.0f;
      }
    }
  }
}

// y[r, n] += sum_b c'[b, n] * S[r, b] for every row and the chunk's outputs.
__attribute__((target("avx2,fma,f16c"))) void offsets_avx2(const BlockWeights& w, const PreparedInput& in, float* y,
                                                           int64_t n0, int64_t count, const float* shifts) {
  const int64_t nb = w.k / w.block;
  for (int64_t r = 0; r < in.rows; ++r) {
    const float* sums = in.sums + r * nb;
    __m256 lo = _mm256_setzero_ps(), hi = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
      const __m256 s = _mm256_broadcast_ss(sums + b);
      lo = _mm256_fmadd_ps(_mm256_loadu_ps(shifts + b * kChunk), s, lo);
      hi = _mm256_fmadd_ps(_mm256_loadu_ps(shifts + b * kChunk + 8), s, hi);
    }
    alignas(32) float total[kChunk];
    _mm256_store_ps(total, lo);
    _mm256_store_ps(total + 8, hi);
    for (int64_t c = 0; c < count; ++c) y[r * w.n + n0 + c] += total[c];
  }
}

template <bool Two, int H>
void rows_avx2(const BlockWeights& w, const PreparedInput& in, float* y, int64_t n0, int64_t count, const float* d) {
  int64_t r = 0;
  for (; r + kRowTile <= in.rows; r += kRowTile) columns_avx2<kRowTile, 1, Two, H>(w, in, y, n0, count, r, d);
  switch (in.rows - r) {
    case 3: columns_avx2<3, 1, Two, H>(w, in, y, n0, count, r, d); break;
    case 2: columns_avx2<2, 1, Two, H>(w, in, y, n0, count, r, d); break;
    case 1: columns_avx2<1, 4, Two, H>(w, in, y, n0, count, r, d); break;
    default: break;
  }
}

// Outputs [n_begin, n_end) in chunks of kChunk: each chunk's scales unpacked once, for every row.
void avx2(const BlockWeights& w, const PreparedInput& in, float* y, int64_t n_begin, int64_t n_end) {
  const bool two = w.low != nullptr, fixed = w.block == 32;
  const int64_t nb = w.k / w.block;
  thread_local std::vector<float> scratch;  // ONNX Runtime's pool threads each run chunks
  scratch.resize(static_cast<size_t>(2 * nb * kChunk));
  float* d = scratch.data();
  float* shifts = d + nb * kChunk;
  for (int64_t n0 = n_begin; n0 < n_end; n0 += kChunk) {
    const int64_t count = n_end - n0 < kChunk ? n_end - n0 : kChunk;
    unpack_chunk(w, n0, count, d, shifts, in.codes != nullptr);
    if (in.codes) {
      two ? int8_rows<true>(w, in, y, n0, count, d) : int8_rows<false>(w, in, y, n0, count, d);
    } else if (w.lanes) {
      lanes_avx2(w, in, y, n0, count, d);
    } else if (two && fixed) {
      rows_avx2<true, 16>(w, in, y, n0, count, d);
    } else if (two) {
      rows_avx2<true, 0>(w, in, y, n0, count, d);
    } else if (fixed) {
      rows_avx2<false, 16>(w, in, y, n0, count, d);
    } else {
      rows_avx2<false, 0>(w, in, y, n0, count, d);
    }
    offsets_avx2(w, in, y, n0, count, shifts);
  }
}

// $SPECGRAPH_KERNELS_PORTABLE set and not empty: the portable loops even where AVX2 exists (tests).
bool has_avx2() {
  static const bool yes = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                          __builtin_cpu_supports("f16c") && !forced_portable();
  return yes;
}

// AVX-512 F, BW, DQ and VL besides AVX2, unless $SPECGRAPH_KERNELS_AVX2 is set and not empty (tests
// compare the two paths on one machine).
bool has_avx512() {
  static const bool yes = has_avx2() && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl") &&
                          !env_flag("SPECGRAPH_KERNELS_AVX2");
  return yes;
}

// and VNNI (the int8 products' four-byte dot products)
bool has_vnni() {
  static const bool yes = has_avx512() && __builtin_cpu_supports("avx512vnni");
  return yes;
}

// and AMX's tiles and int8 products, which Linux lends a process once it asks for the tile state
// (arch_prctl ARCH_REQ_XCOMP_PERM); $SPECGRAPH_KERNELS_NO_AMX set and not empty: VNNI's loop instead
// (tests compare the two on one machine).
bool has_amx() {
  static const bool yes = [] {
    if (!has_vnni() || env_flag("SPECGRAPH_KERNELS_NO_AMX")) return false;
#if defined(__linux__) && defined(__x86_64__)
    unsigned eax = 7, ebx = 0, ecx = 0, edx = 0;
    __asm__("cpuid" : "+a"(eax), "=b"(ebx), "+c"(ecx), "=d"(edx));
    const bool tiles = (edx >> 24) & 1, int8 = (edx >> 25) & 1;
    constexpr long kRequestPermission = 0x1023, kTileData = 18;  // ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA
    return tiles && int8 && syscall(SYS_arch_prctl, kRequestPermission, kTileData) == 0;
#else
    return false;
#endif
  }();
  return yes;
}

// e^x to about 1 ulp (Cephes' expf: x = n ln 2 + r, |r| <= ln 2 / 2, a degree-5 polynomial for
// e^r, then 2^n from the exponent bits), x clamped to where e^x is a normal float32.
__attribute__((target("avx2,fma,f16c"))) inline __m256 exp8(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.7f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  for (const float c : {1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f})
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c));
  const __m256 y = _mm256_add_ps(_mm256_fmadd_ps(_mm256_mul_ps(p, r), r, r), _mm256_set1_ps(1.0f));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(bits));
}

__attribute__((target("avx2,fma,f16c"))) void gated_silu_avx2(const float* x, int64_t rows, int64_t k, float* out) {
  const __m256 one = _mm256_set1_ps(1.0f);
  for (int64_t r = 0; r < rows; ++r) {
    const float* g = x + r * 2 * k;
    const float* u = g + k;
    float* o = out + r * k;
    int64_t i = 0;
    for (; i + 8 <= k; i += 8) {
      const __m256 gate = _mm256_loadu_ps(g + i);
      const __m256 sigmoid = _mm256_div_ps(one, _mm256_add_ps(one, exp8(_mm256_sub_ps(_mm256_setzero_ps(), gate))));
      _mm256_storeu_ps(o + i, _mm256_mul_ps(_mm256_mul_ps(gate, sigmoid), _mm256_loadu_ps(u + i)));
    }
    for (; i < k; ++i) o[i] = g[i] * (1.0f / (1.0f + std::exp(-g[i]))) * u[i];
  }
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

void rms_norm(const float* x, int64_t rows, int64_t k, const float* scale, float epsilon, float* out) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* row = x + r * k;
    double squares = 0.0;
    for (int64_t i = 0; i < k; ++i) squares += static_cast<double>(row[i]) * row[i];
    const float inverse = 1.0f / std::sqrt(static_cast<float>(squares / static_cast<double>(k)) + epsilon);
    for (int64_t i = 0; i < k; ++i) out[r * k + i] = row[i] * inverse * scale[i];
  }
}

void gated_silu(const float* x, int64_t rows, int64_t k, float* out) {
  if (has_avx2()) {
    gated_silu_avx2(x, rows, k, out);
    return;
  }
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t i = 0; i < k; ++i) {
      const float g = x[r * 2 * k + i];
      out[r * k + i] = g * (1.0f / (1.0f + std::exp(-g))) * x[r * 2 * k + k + i];
    }
}

void quantise_input(const float* x, int64_t rows, int64_t k, int centre, int8_t* codes, float* steps,
                    int32_t* centred, float* sums) {
  const int64_t nb = k / kInt8Block, pairs = (nb + 1) / 2, half = kInt8Block / 2;
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t p = 0; p < pairs; ++p) {
      int8_t* q = codes + (r * pairs + p) * 64;
      float* e = steps + (r * pairs + p) * 8;
      int32_t* c = centred + (r * pairs + p) * 8;
      std::memset(q, 0, 64);
      for (int lane = 0; lane < 8; ++lane) {
        e[lane] = 0.0f;
        c[lane] = 0;
      }
      for (int64_t h = 0; h < 2 && 2 * p + h < nb; ++h) {
        const int64_t b = 2 * p + h;
        const float* src = x + r * k + b * kInt8Block;
        float most = 0.0f;
        for (int64_t i = 0; i < kInt8Block; ++i) most = std::fmax(most, std::fabs(src[i]));
        const float step = most / 127.0f, inverse = most > 0.0f ? 127.0f / most : 0.0f;
        int32_t sum = 0;
        for (int64_t j = 0; j < half; ++j) {
          const auto even = static_cast<int8_t>(std::lrint(src[2 * j] * inverse));
          const auto odd = static_cast<int8_t>(std::lrint(src[2 * j + 1] * inverse));
          q[h * half + j] = even;
          q[32 + h * half + j] = odd;
          sum += even + odd;
        }
        for (int lane = 0; lane < 4; ++lane) e[4 * h + lane] = step;
        c[4 * h] = centre * sum;
        sums[r * nb + b] = step * static_cast<float>(sum);
      }
    }
  }
}

// Quads (block_matmul.h): tiles [n_begin / 16, ceil(n_end / 16)), every row, 8 outputs a register.
// For each (row, output) lane l of int8_chain is accumulator l here, fed in the same order.
__attribute__((target("avx2,fma,f16c"))) void quads_avx2(const BlockWeights& w, const PreparedInput& in, float* y,
                                                         int64_t n_begin, int64_t n_end) {
  const int64_t nb = w.k / kInt8Block, pairs = (nb + 1) / 2;
  const __m256i nibble = _mm256_set1_epi8(0x0F);
  const __m256i ones = _mm256_set1_epi16(1);
  const __m256 centre8 = _mm256_set1_ps(8.0f);
  for (int64_t n0 = n_begin; n0 < n_end; n0 += 8) {
    const int64_t t = n0 / kScaleTile, o = n0 % kScaleTile;
    const uint8_t* codes = w.high + t * nb * kQuadBytes + o * 4;
    for (int64_t r = 0; r < in.rows; ++r) {
      __m256 acc[8], offsets = _mm256_setzero_ps();
      for (auto& a : acc) a = _mm256_setzero_ps();
      for (int64_t b = 0; b < nb; ++b) {
        const int64_t p = r * pairs + b / 2, h = b % 2, at = scale_at(w, b, n0);
        const int8_t* q = in.codes + p * 64 + h * 16;
        const __m256 d = eight(w, w.scale, at);
        const __m256 step = _mm256_mul_ps(_mm256_set1_ps(in.steps[p * 8 + 4 * h]), d);
        for (int g = 0; g < 4; ++g) {
          const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + b * kQuadBytes + g * 64));
          int32_t even, odd;
          std::memcpy(&even, q + 4 * g, 4);
          std::memcpy(&odd, q + 32 + 4 * g, 4);
          const __m256i low = _mm256_maddubs_epi16(_mm256_and_si256(v, nibble), _mm256_set1_epi32(even));
          const __m256i high = _mm256_maddubs_epi16(_mm256_and_si256(_mm256_srli_epi16(v, 4), nibble), _mm256_set1_epi32(odd));
          __m256i sum = _mm256_add_epi32(_mm256_madd_epi16(low, ones), _mm256_madd_epi16(high, ones));
          if (g == 0) sum = _mm256_sub_epi32(sum, _mm256_set1_epi32(in.centred[p * 8 + 4 * h]));
          acc[4 * h + g] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), step, acc[4 * h + g]);
        }
        const __m256 m = w.offset ? eight(w, w.offset, at) : _mm256_setzero_ps();
        offsets = _mm256_fmadd_ps(_mm256_fmadd_ps(centre8, d, m), _mm256_set1_ps(in.sums[r * nb + b]), offsets);
      }
      const __m256 chain = _mm256_add_ps(_mm256_add_ps(_mm256_add_ps(acc[0], acc[4]), _mm256_add_ps(acc[2], acc[6])),
                                         _mm256_add_ps(_mm256_add_ps(acc[1], acc[5]), _mm256_add_ps(acc[3], acc[7])));
      alignas(32) float out[8];
      _mm256_store_ps(out, _mm256_add_ps(chain, offsets));
      for (int64_t c = 0; c < 8 && n0 + c < n_end; ++c) y[r * w.n + n0 + c] = out[c];
    }
  }
}

// quads_avx2 with VNNI, 16 outputs a register: every line of the codes is prefetched 16 blocks
// (4 KB) ahead, which the hardware prefetcher does not do (without it the loop ran 1.2x faster
// than pairs from memory instead of 1.7-1.9x, scripts/int8_quads_bench.cpp builds other distances).
#ifndef SG_QUADS_AHEAD
#define SG_QUADS_AHEAD 16
#endif

// Rows [r0, r0 + R) of one tile: the codes' nibbles and the tile's scales are taken once for all
// R rows (a verify call's second row cost 35% of its first when each row took its own), and each
// row's float steps are the one-row loop's, so a row's result does not depend on R.
template <int R>
__attribute__((target(SG_AVX512 ",avx512vnni"))) void quads_tile512(const BlockWeights& w, const PreparedInput& in,
                                                                   float* y, int64_t t, int64_t r0, int64_t n_end) {
  const int64_t nb = w.k / kInt8Block, pairs = (nb + 1) / 2;
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  const __m512 centre8 = _mm512_set1_ps(8.0f);
  const uint8_t* codes = w.high + t * nb * kQuadBytes;
  __m512 acc[R][8], offsets[R];
  for (int r = 0; r < R; ++r) {
    offsets[r] = _mm512_setzero_ps();
    for (auto& a : acc[r]) a = _mm512_setzero_ps();
  }
  for (int64_t b = 0; b < nb; ++b) {
    const int64_t h = b % 2, at = scale_at(w, b, t * kScaleTile);
    const __m512 d = sixteen(w, w.scale, at);
    __m512 step[R];
    const int8_t* q[R];
    for (int r = 0; r < R; ++r) {
      const int64_t p = (r0 + r) * pairs + b / 2;
      q[r] = in.codes + p * 64 + h * 16;
      step[r] = _mm512_mul_ps(_mm512_set1_ps(in.steps[p * 8 + 4 * h]), d);
    }
    for (int g = 0; g < 4; ++g) {
      if (r0 == 0) _mm_prefetch(reinterpret_cast<const char*>(codes + (b + SG_QUADS_AHEAD) * kQuadBytes + g * 64), _MM_HINT_T0);
      const __m512i v = _mm512_loadu_si512(codes + b * kQuadBytes + g * 64);
      const __m512i low = _mm512_and_si512(v, nibble), high = _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble);
      for (int r = 0; r < R; ++r) {
        int32_t even, odd;
        std::memcpy(&even, q[r] + 4 * g, 4);
        std::memcpy(&odd, q[r] + 32 + 4 * g, 4);
        __m512i sum = _mm512_dpbusd_epi32(_mm512_setzero_si512(), low, _mm512_set1_epi32(even));
        sum = _mm512_dpbusd_epi32(sum, high, _mm512_set1_epi32(odd));
        if (g == 0) sum = _mm512_sub_epi32(sum, _mm512_set1_epi32(in.centred[((r0 + r) * pairs + b / 2) * 8 + 4 * h]));
        acc[r][4 * h + g] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), step[r], acc[r][4 * h + g]);
      }
    }
    const __m512 m = w.offset ? sixteen(w, w.offset, at) : _mm512_setzero_ps();
    const __m512 shifted = _mm512_fmadd_ps(centre8, d, m);
    for (int r = 0; r < R; ++r)
      offsets[r] = _mm512_fmadd_ps(shifted, _mm512_set1_ps(in.sums[(r0 + r) * nb + b]), offsets[r]);
  }
  for (int r = 0; r < R; ++r) {
    const __m512* a = acc[r];
    const __m512 chain = _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(a[0], a[4]), _mm512_add_ps(a[2], a[6])),
                                       _mm512_add_ps(_mm512_add_ps(a[1], a[5]), _mm512_add_ps(a[3], a[7])));
    alignas(64) float out[16];
    _mm512_store_ps(out, _mm512_add_ps(chain, offsets[r]));
    for (int64_t c = 0; c < kScaleTile && t * kScaleTile + c < n_end; ++c) y[(r0 + r) * w.n + t * kScaleTile + c] = out[c];
  }
}

// Rows [r_begin, rows) one at a time, every tile: the one-token step's loop (and a call's last
// row when its count is odd after the groups of quads512).
__attribute__((target(SG_AVX512 ",avx512vnni"))) void quads_one512(const BlockWeights& w, const PreparedInput& in, float* y,
                                                                  int64_t n_begin, int64_t n_end, int64_t r_begin) {
  const int64_t nb = w.k / kInt8Block, pairs = (nb + 1) / 2;
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  const __m512 centre8 = _mm512_set1_ps(8.0f);
  for (int64_t t = n_begin / kScaleTile; t * kScaleTile < n_end; ++t) {
    const uint8_t* codes = w.high + t * nb * kQuadBytes;
    for (int64_t r = r_begin; r < in.rows; ++r) {
      __m512 acc[8], offsets = _mm512_setzero_ps();
      for (auto& a : acc) a = _mm512_setzero_ps();
      for (int64_t b = 0; b < nb; ++b) {
        const int64_t p = r * pairs + b / 2, h = b % 2, at = scale_at(w, b, t * kScaleTile);
        const int8_t* q = in.codes + p * 64 + h * 16;
        const __m512 d = sixteen(w, w.scale, at);
        const __m512 step = _mm512_mul_ps(_mm512_set1_ps(in.steps[p * 8 + 4 * h]), d);
        for (int g = 0; g < 4; ++g) {
          if (r == 0) _mm_prefetch(reinterpret_cast<const char*>(codes + (b + SG_QUADS_AHEAD) * kQuadBytes + g * 64), _MM_HINT_T0);
          const __m512i v = _mm512_loadu_si512(codes + b * kQuadBytes + g * 64);
          int32_t even, odd;
          std::memcpy(&even, q + 4 * g, 4);
          std::memcpy(&odd, q + 32 + 4 * g, 4);
          __m512i sum = _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_and_si512(v, nibble), _mm512_set1_epi32(even));
          sum = _mm512_dpbusd_epi32(sum, _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble), _mm512_set1_epi32(odd));
          if (g == 0) sum = _mm512_sub_epi32(sum, _mm512_set1_epi32(in.centred[p * 8 + 4 * h]));
          acc[4 * h + g] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), step, acc[4 * h + g]);
        }
        const __m512 m = w.offset ? sixteen(w, w.offset, at) : _mm512_setzero_ps();
        offsets = _mm512_fmadd_ps(_mm512_fmadd_ps(centre8, d, m), _mm512_set1_ps(in.sums[r * nb + b]), offsets);
      }
      const __m512 chain = _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(acc[0], acc[4]), _mm512_add_ps(acc[2], acc[6])),
                                         _mm512_add_ps(_mm512_add_ps(acc[1], acc[5]), _mm512_add_ps(acc[3], acc[7])));
      alignas(64) float out[16];
      _mm512_store_ps(out, _mm512_add_ps(chain, offsets));
      for (int64_t c = 0; c < kScaleTile && t * kScaleTile + c < n_end; ++c) y[r * w.n + t * kScaleTile + c] = out[c];
    }
  }
}

void quads512(const BlockWeights& w, const PreparedInput& in, float* y, int64_t n_begin, int64_t n_end) {
  int64_t r = 0;
  if (in.rows > 1)
    for (int64_t t = n_begin / kScaleTile; t * kScaleTile < n_end; ++t)
      for (r = 0; in.rows - r > 1;) {
        const int64_t left = in.rows - r;
        if (left >= 4) {
          quads_tile512<4>(w, in, y, t, r, n_end);
          r += 4;
        } else if (left == 3) {
          quads_tile512<3>(w, in, y, t, r, n_end);
          r += 3;
        } else {
          quads_tile512<2>(w, in, y, t, r, n_end);
          r += 2;
        }
      }
  if (r < in.rows) quads_one512(w, in, y, n_begin, n_end, r);
}

namespace {

// digit_input's arithmetic 16 inputs a register: the block's inputs are first put in digit_column
// order (the same permutation for both halves), then each lane computes what the portable loop does.
__attribute__((target(SG_AVX512))) void digit_input512(const float* x, int64_t rows, int64_t k, int8_t* digits,
                                                      float* steps, float* sums, int64_t* whole) {
  const int64_t nb = k / kInt8Block;
  alignas(64) int32_t order[16];
  for (int64_t i = 0; i < 16; ++i) order[digit_column(i)] = static_cast<int32_t>(i);
  const __m512i permute = _mm512_load_si512(order), byte = _mm512_set1_epi32(255), half = _mm512_set1_epi32(128);
  const __m512i top = _mm512_set1_epi32(kDigitsTop), bottom = _mm512_set1_epi32(-kDigitsTop);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t b = 0; b < nb; ++b) {
      const float* src = x + r * k + b * kInt8Block;
      const __m512 lo = _mm512_permutexvar_ps(permute, _mm512_loadu_ps(src));
      const __m512 hi = _mm512_permutexvar_ps(permute, _mm512_loadu_ps(src + 16));
      const float most = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
      const float inverse = most > 0.0f ? static_cast<float>(kDigitsTop) / most : 0.0f;
      int8_t* a = digits + (b * rows + r) * kDigits * kInt8Block;
      int64_t sum = 0;
      for (int h = 0; h < 2; ++h) {
        __m512i v = _mm512_cvtps_epi32(_mm512_mul_ps(h ? hi : lo, _mm512_set1_ps(inverse)));
        v = _mm512_max_epi32(_mm512_min_epi32(v, top), bottom);
        sum += _mm512_reduce_add_epi64(_mm512_cvtepi32_epi64(_mm512_castsi512_si256(v))) +
               _mm512_reduce_add_epi64(_mm512_cvtepi32_epi64(_mm512_extracti64x4_epi64(v, 1)));
        for (int j = kDigits - 1; j >= 0; --j) {  // the low digit first, stored last
          const __m512i digit = j ? _mm512_sub_epi32(_mm512_and_si512(_mm512_add_epi32(v, half), byte), half) : v;
          _mm_storeu_si128(reinterpret_cast<__m128i*>(a + j * kInt8Block + 16 * h), _mm512_cvtepi32_epi8(digit));
          v = _mm512_srai_epi32(_mm512_sub_epi32(v, digit), 8);
        }
      }
      const float step = most / static_cast<float>(kDigitsTop);
      steps[r * nb + b] = step;
      sums[r * nb + b] = step * static_cast<float>(sum);
      whole[r * nb + b] = sum;
    }
}

}  // namespace

void digit_input(const float* x, int64_t rows, int64_t k, int8_t* digits, float* steps, float* sums, int64_t* whole) {
  if (has_avx512()) {
    digit_input512(x, rows, k, digits, steps, sums, whole);
    return;
  }
  const int64_t nb = k / kInt8Block;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t b = 0; b < nb; ++b) {
      const float* src = x + r * k + b * kInt8Block;
      float most = 0.0f;
      for (int64_t i = 0; i < kInt8Block; ++i) most = std::fmax(most, std::fabs(src[i]));
      const float inverse = most > 0.0f ? static_cast<float>(kDigitsTop) / most : 0.0f;
      int8_t* a = digits + (b * rows + r) * kDigits * kInt8Block;
      int64_t sum = 0;
      for (int64_t i = 0; i < kInt8Block; ++i) {
        const float scaled = src[i] * inverse;  // within kDigitsTop's float, 2^31 - 2^7: below 2^31
        int32_t v = static_cast<int32_t>(std::lrint(scaled));
        v = v > kDigitsTop ? kDigitsTop : v < -kDigitsTop ? -kDigitsTop : v;  // x * inverse may round past it
        sum += v;
        for (int j = kDigits - 1; j >= 0; --j) {
          const int32_t digit = j ? ((v + 128) & 255) - 128 : v;
          a[j * kInt8Block + digit_column(i)] = static_cast<int8_t>(digit);
          v = (v - digit) / 256;
        }
      }
      const float step = most / static_cast<float>(kDigitsTop);
      steps[r * nb + b] = step;
      sums[r * nb + b] = step * static_cast<float>(sum);
      whole[r * nb + b] = sum;
    }
}

namespace {

// Digits (block_matmul.h): the four digit sums of 16 outputs over one block, D3 (the top digit's)
// to D0, give v = (256 * D3 + D2) * 65536 + (256 * D1 + D0) (each bracket exact in int32 and in
// float32, one rounding in the multiply-add), then acc += v * (e * d) and off += m * (e * sum); y =
// acc + off. Every loop below computes the same integers and then exactly these float steps, block
// by block, so each gives the portable loop's bits for any row count.
inline float digit_value(const int32_t* sum) {
  return std::fma(static_cast<float>(sum[0] * 256 + sum[1]), 65536.0f, static_cast<float>(sum[2] * 256 + sum[3]));
}

// For 8-bit codes (byte quads) the sums reach 32 * 128 * 255, so v is formed in int64, centred on
// 136 as two-digit products are (block_matmul.h): sum v * (code - 136), exact, in one rounding.
inline float byte_value(const int32_t* sum, int64_t whole) {
  const int64_t v = (static_cast<int64_t>(sum[0] * 256 + sum[1]) << 16) + (sum[2] * 256 + sum[3]) - kByteCentre * whole;
  return static_cast<float>(v);
}

void digits_portable(const BlockWeights& w, const PreparedInput& in, float* y, int64_t n_begin, int64_t n_end) {
  const int64_t nb = w.k / kInt8Block;
  for (int64_t n = n_begin; n < n_end; ++n) {
    const int64_t t = n / kScaleTile, o = n % kScaleTile;
    for (int64_t r = 0; r < in.rows; ++r) {
      float acc = 0.0f, off = 0.0f;
      for (int64_t b = 0; b < nb; ++b) {
        const int8_t* a = in.digits + (b * in.rows + r) * kDigits * kInt8Block;
        int32_t sum[kDigits] = {};
        for (int64_t at = 0; at < kInt8Block; ++at) {  // group at / 8, half at / 4 % 2, byte at % 4
          const int32_t code = code_at(w, n, b * kInt8Block + 8 * (at / 8) + 2 * (at % 4) + (at / 4) % 2);
          for (int j = 0; j < kDigits; ++j) sum[j] += code * a[j * kInt8Block + at];
        }
        const int64_t s = scale_at(w, b, n);
        const float e = in.steps[r * nb + b], d = value(w, w.scale, s);
        const float m = w.offset ? value(w, w.offset, s) : 0.0f;
        if (w.wide) {
          acc = std::fma(byte_value(sum, in.whole[r * nb + b]), e * d, acc);
          off = std::fma(std::fma(static_cast<float>(kByteCentre), d, m), in.sums[r * nb + b], off);
        } else {
          acc = std::fma(digit_value(sum), e * d, acc);
          if (w.offset) off = std::fma(m, in.sums[r * nb + b], off);
        }
      }
      y[r * w.n + n] = acc + off;
    }
  }
}

// 256 * D_j + D_{j+1} of 16 outputs, from their sums s[0..15] and s[16..31]: exact in int32, and
// (for 4-bit codes) in float32.
__attribute__((target(SG_AVX512))) inline __m512i pair32(const int32_t* s) {
  return _mm512_add_epi32(_mm512_slli_epi32(_mm512_loadu_si512(s), 8), _mm512_loadu_si512(s + kScaleTile));
}
__attribute__((target(SG_AVX512))) inline __m512 digit_pair(const int32_t* s) { return _mm512_cvtepi32_ps(pair32(s)); }

// One tile's digit sums [rows][4][16] of block b into the rows' float chains, 16 outputs a register.
__attribute__((target(SG_AVX512))) inline void digits_step512(const BlockWeights& w, const PreparedInput& in,
                                                            const int32_t* sums, int64_t t, int64_t b, int64_t r0,
                                                            int rows, __m512* acc, __m512* off) {
  const int64_t nb = w.k / kInt8Block, at = scale_at(w, b, t * kScaleTile);
  const __m512 d = sixteen(w, w.scale, at);
  const __m512 m = w.offset ? sixteen(w, w.offset, at) : _mm512_setzero_ps();
  const __m512 shifted =  // 8-bit codes' c' (m + 136 d); 4-bit ones take m as it is
      w.wide ? _mm512_fmadd_ps(_mm512_set1_ps(static_cast<float>(kByteCentre)), d, m) : m;
  for (int r = 0; r < rows; ++r) {
    const int32_t* s = sums + r * kDigits * kScaleTile;
    const int64_t i = (r0 + r) * nb + b;
    if (w.wide) {  // byte_value, 8 outputs an int64 register
      const __m512i high = pair32(s), low = pair32(s + 2 * kScaleTile);
      const __m512i centre = _mm512_set1_epi64(kByteCentre * in.whole[i]);
      const __m512i h0 = _mm512_cvtepi32_epi64(_mm512_castsi512_si256(high));
      const __m512i h1 = _mm512_cvtepi32_epi64(_mm512_extracti64x4_epi64(high, 1));
      const __m512i l0 = _mm512_cvtepi32_epi64(_mm512_castsi512_si256(low));
      const __m512i l1 = _mm512_cvtepi32_epi64(_mm512_extracti64x4_epi64(low, 1));
      const __m256 v0 = _mm512_cvtepi64_ps(_mm512_sub_epi64(_mm512_add_epi64(_mm512_slli_epi64(h0, 16), l0), centre));
      const __m256 v1 = _mm512_cvtepi64_ps(_mm512_sub_epi64(_mm512_add_epi64(_mm512_slli_epi64(h1, 16), l1), centre));
      const __m512 v = _mm512_insertf32x8(_mm512_castps256_ps512(v0), v1, 1);
      acc[r] = _mm512_fmadd_ps(v, _mm512_mul_ps(_mm512_set1_ps(in.steps[i]), d), acc[r]);
      off[r] = _mm512_fmadd_ps(shifted, _mm512_set1_ps(in.sums[i]), off[r]);
      continue;
    }
    const __m512 v = _mm512_fmadd_ps(digit_pair(s), _mm512_set1_ps(65536.0f), digit_pair(s + 2 * kScaleTile));
    acc[r] = _mm512_fmadd_ps(v, _mm512_mul_ps(_mm512_set1_ps(in.steps[i]), d), acc[r]);
    if (w.offset) off[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(in.sums[i]), off[r]);
  }
}

__attribute__((target(SG_AVX512))) inline void digits_store512(const BlockWeights& w, float* y, int64_t t,
                                                             int64_t r0, int rows, const __m512* acc,
                                                             const __m512* off) {
  for (int r = 0; r < rows; ++r) {
    alignas(64) float out[kScaleTile];
    _mm512_store_ps(out, _mm512_add_ps(acc[r], w.offset ? off[r] : _mm512_setzero_ps()));
    for (int64_t c = 0; c < kScaleTile && t * kScaleTile + c < w.n; ++c) y[(r0 + r) * w.n + t * kScaleTile + c] = out[c];
  }
}

// Without AMX (and for one row, where it is as fast): VNNI's four-byte products, one row at a time
// (the codes are u8, the digits s8: the integers AMX's tdpbsud gives).
__attribute__((target(SG_AVX512 ",avx512vnni"))) void digits_vnni(const BlockWeights& w, const PreparedInput& in,
                                                                 float* y, int64_t n_begin, int64_t n_end) {
  const int64_t nb = w.k / kInt8Block;
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  alignas(64) int32_t sums[kDigits * kScaleTile];
  for (int64_t t = n_begin / kScaleTile; t * kScaleTile < n_end; ++t) {
    const uint8_t* codes = w.high + t * nb * (w.wide ? kByteQuadBytes : kQuadBytes);
    for (int64_t r = 0; r < in.rows; ++r) {
      __m512 acc = _mm512_setzero_ps(), off = _mm512_setzero_ps();
      for (int64_t b = 0; b < nb; ++b) {
        const int8_t* a = in.digits + (b * in.rows + r) * kDigits * kInt8Block;
        __m512i sum[kDigits];
        for (auto& v : sum) v = _mm512_setzero_si512();
        for (int g = 0; g < 4; ++g) {
          __m512i low, high;
          if (w.wide) {  // rows 2g and 2g + 1 of the block's byte quads
            const uint8_t* line = codes + b * kByteQuadBytes + 2 * g * 64;
            if (r == 0) _mm_prefetch(reinterpret_cast<const char*>(line + SG_QUADS_AHEAD * kByteQuadBytes), _MM_HINT_T0);
            if (r == 0) _mm_prefetch(reinterpret_cast<const char*>(line + SG_QUADS_AHEAD * kByteQuadBytes + 64), _MM_HINT_T0);
            low = _mm512_loadu_si512(line);
            high = _mm512_loadu_si512(line + 64);
          } else {
            if (r == 0) _mm_prefetch(reinterpret_cast<const char*>(codes + (b + SG_QUADS_AHEAD) * kQuadBytes + g * 64), _MM_HINT_T0);
            const __m512i v = _mm512_loadu_si512(codes + b * kQuadBytes + g * 64);
            low = _mm512_and_si512(v, nibble);
            high = _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble);
          }
          for (int j = 0; j < kDigits; ++j) {
            int32_t even, odd;
            std::memcpy(&even, a + j * kInt8Block + 8 * g, 4);
            std::memcpy(&odd, a + j * kInt8Block + 8 * g + 4, 4);
            sum[j] = _mm512_dpbusd_epi32(sum[j], low, _mm512_set1_epi32(even));
            sum[j] = _mm512_dpbusd_epi32(sum[j], high, _mm512_set1_epi32(odd));
          }
        }
        for (int j = 0; j < kDigits; ++j) _mm512_store_si512(sums + j * kScaleTile, sum[j]);
        digits_step512(w, in, sums, t, b, r, 1, &acc, &off);
      }
      digits_store512(w, y, t, r, 1, &acc, &off);
    }
  }
}

// AMX: for each block, tile A holds the digits of up to 4 rows (4 tile rows each, 32 bytes), tile B
// the block's codes of 16 outputs unpacked to bytes (8 rows of 4 inputs x 16 outputs), and one
// tdpbsud gives C, every row's four digit sums of the 16 outputs. Two blocks are in flight at once.
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t bytes[16] = {};
  uint8_t rows[16] = {};
};

__attribute__((target("amx-tile"))) void configure_tiles(int rows) {
  TileConfig want;
  for (int set = 0; set < 2; ++set) {
    want.rows[3 * set] = static_cast<uint8_t>(kDigits * rows);  // C: int32 sums [4 rows a row, 16]
    want.bytes[3 * set] = 64;
    want.rows[3 * set + 1] = static_cast<uint8_t>(kDigits * rows);  // A: digits [4 rows a row, 32]
    want.bytes[3 * set + 1] = 32;
    want.rows[3 * set + 2] = 8;  // B: codes [8, 16 outputs x 4 inputs]
    want.bytes[3 * set + 2] = 64;
  }
  TileConfig have;
  _tile_storeconfig(&have);  // a thread keeps its configuration between calls; another user may change it
  if (std::memcmp(&have, &want, sizeof want) != 0) _tile_loadconfig(&want);
}

__attribute__((target(SG_AVX512))) void unpack_block(const uint8_t* codes, uint8_t* bytes) {
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  for (int g = 0; g < 4; ++g) {
    _mm_prefetch(reinterpret_cast<const char*>(codes + SG_QUADS_AHEAD * kQuadBytes + g * 64), _MM_HINT_T0);
    const __m512i v = _mm512_loadu_si512(codes + g * 64);
    _mm512_store_si512(bytes + 2 * g * 64, _mm512_and_si512(v, nibble));
    _mm512_store_si512(bytes + (2 * g + 1) * 64, _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble));
  }
}

template <int R>
__attribute__((target(SG_AVX512 ",amx-tile,amx-int8"))) void digits_tile_amx(const BlockWeights& w,
                                                                            const PreparedInput& in, float* y,
                                                                            int64_t t, int64_t r0) {
  // A software pipeline over pairs of blocks: while the tiles take pair p, the codes of pair p + 1
  // are unpacked and the sums of pair p - 1 are read back (a tile's store, or the unpacked codes'
  // stores, read at once stalled the loop: the unpacking and the read-back each cost about as much
  // as the products, measured). The float steps still run block by block in order.
  const int64_t nb = w.k / kInt8Block, stride = kDigits * kInt8Block, pairs = (nb + 1) / 2;
  const int64_t per = w.wide ? kByteQuadBytes : kQuadBytes;
  const uint8_t* codes = w.high + t * nb * per;
  alignas(64) uint8_t bytes[2][2][8 * 64];
  alignas(64) int32_t sums[2][2][kDigits * R * kScaleTile];
  __m512 acc[R], off[R];
  for (int r = 0; r < R; ++r) acc[r] = off[r] = _mm512_setzero_ps();
  const auto tile_b = [&](int64_t b, int slot, int half) -> const uint8_t* {  // 8-bit codes: B as stored
    return w.wide ? codes + b * per : bytes[slot][half];
  };
  const auto unpack_pair = [&](int64_t p, int slot) {
    for (int64_t h = 0; h < 2 && 2 * p + h < nb; ++h) {
      const uint8_t* block = codes + (2 * p + h) * per;
      if (w.wide) {
        for (int line = 0; line < 8; ++line)
          _mm_prefetch(reinterpret_cast<const char*>(block + SG_QUADS_AHEAD * per + 64 * line), _MM_HINT_T0);
      } else {
        unpack_block(block, bytes[slot][h]);
      }
    }
  };
  unpack_pair(0, 0);
  for (int64_t p = 0; p < pairs; ++p) {
    const int slot = static_cast<int>(p % 2);
    const int64_t b = 2 * p;
    if (p + 1 < pairs) unpack_pair(p + 1, 1 - slot);
    _tile_loadd(1, in.digits + (b * in.rows + r0) * stride, kInt8Block);
    _tile_loadd(2, tile_b(b, slot, 0), 64);
    _tile_zero(0);
    _tile_dpbsud(0, 1, 2);
    if (b + 1 < nb) {
      _tile_loadd(4, in.digits + ((b + 1) * in.rows + r0) * stride, kInt8Block);
      _tile_loadd(5, tile_b(b + 1, slot, 1), 64);
      _tile_zero(3);
      _tile_dpbsud(3, 4, 5);
    }
    _tile_stored(0, sums[slot][0], 64);
    if (b + 1 < nb) _tile_stored(3, sums[slot][1], 64);
    if (p > 0) {
      digits_step512(w, in, sums[1 - slot][0], t, b - 2, r0, R, acc, off);
      digits_step512(w, in, sums[1 - slot][1], t, b - 1, r0, R, acc, off);
    }
  }
  const int64_t last = 2 * (pairs - 1);
  const int slot = static_cast<int>((pairs - 1) % 2);
  digits_step512(w, in, sums[slot][0], t, last, r0, R, acc, off);
  if (last + 1 < nb) digits_step512(w, in, sums[slot][1], t, last + 1, r0, R, acc, off);
  digits_store512(w, y, t, r0, R, acc, off);
}

template <int R>
void digits_tiles_amx(const BlockWeights& w, const PreparedInput& in, float* y, int64_t n_begin, int64_t n_end,
                      int64_t r0) {
  configure_tiles(R);
  for (int64_t t = n_begin / kScaleTile; t * kScaleTile < n_end; ++t) digits_tile_amx<R>(w, in, y, t, r0);
}

// Rows in as few groups of at most kDigitRows as there can be, of sizes as even as they can be
// (5 rows as 3 + 2: each group unpacks every block again), each group over every tile of the range
// (its codes stay in the core's caches between groups).
void digits_amx(const BlockWeights& w, const PreparedInput& in, float* y, int64_t n_begin, int64_t n_end) {
  const int64_t groups = (in.rows + kDigitRows - 1) / kDigitRows;
  for (int64_t g = 0, r0 = 0; g < groups; ++g) {
    const int64_t size = (in.rows - r0) / (groups - g);  // the later groups take the remainder
    switch (size) {
      case 1: digits_tiles_amx<1>(w, in, y, n_begin, n_end, r0); break;
      case 2: digits_tiles_amx<2>(w, in, y, n_begin, n_end, r0); break;
      case 3: digits_tiles_amx<3>(w, in, y, n_begin, n_end, r0); break;
      default: digits_tiles_amx<4>(w, in, y, n_begin, n_end, r0); break;
    }
    r0 += size;
  }
}

}  // namespace

void block_matmul(const BlockWeights& w, const PreparedInput& in, float* y, int64_t n_begin, int64_t n_end) {
  if (w.quads && in.digits) {
    if (has_amx() && in.rows > 1) {  // for one row VNNI's loop is as fast (measured), with the same bits
      digits_amx(w, in, y, n_begin, n_end);
    } else if (has_vnni()) {
      digits_vnni(w, in, y, n_begin, n_end);
    } else {
      digits_portable(w, in, y, n_begin, n_end);
    }
  } else if (w.quads && has_vnni()) {
    quads512(w, in, y, n_begin, n_end);
  } else if (w.quads && has_avx2()) {
    quads_avx2(w, in, y, n_begin, n_end);
  } else if (in.codes && !has_avx2()) {
    portable_int8(w, in, y, n_begin, n_end);
  } else if (has_avx2()) {
    avx2(w, in, y, n_begin, n_end);
  } else {
    portable(w, in, y, n_begin, n_end);
  }
}

bool lanes_are_faster(int64_t rows) { return rows == 1 || has_avx512(); }

bool exact_digits_fast() { return has_amx(); }

const char* block_matmul_path() {
  return has_vnni() ? "avx512-vnni" : has_avx512() ? "avx512" : has_avx2() ? "avx2" : "portable";
}

bool forced_portable() { return env_flag("SPECGRAPH_KERNELS_PORTABLE"); }

}  // namespace sg::kernels
