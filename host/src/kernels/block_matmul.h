// y = x @ W^T with W held as the integer blocks specgraph's bundles store (exporters/nbits.py),
// multiplied in float32: the exact product of the dequantised weight, to float rounding.
//
// W's block b of row n is `scale[n, b] * (codes - centre) + c'[b, n]`, the layout of the
// MatMulNBits rewrite: codes are one 4-bit digit (centre 8), or two (`16 * high + low`, centre
// 136, scale the low digit's). Digits are packed two a byte, weight 2j in the low nibble and
// 2j + 1 in the high one, [N, K / block, block / 2].
#pragma once

#include <cstddef>
#include <cstdint>

namespace sg::kernels {

struct BlockWeights {
  int64_t n = 0;                   // output features (rows of W)
  int64_t k = 0;                   // input features
  int64_t block = 0;               // weights per block: a multiple of 16
  const uint8_t* high = nullptr;   // the only digit, or the high one
  const uint8_t* low = nullptr;    // the low digit, or nullptr for one digit
  const float* scale = nullptr;    // [N, K / block]
  const float* offset = nullptr;   // c'^T [K / block, N], or nullptr when every c' is zero
};

// x rearranged once per call: each block's even inputs, then its odd ones, and each block's sum.
struct PreparedInput {
  int64_t rows = 0;
  const float* paired = nullptr;   // [rows, K]
  const float* sums = nullptr;     // [rows, K / block]
};

// Fill `paired` [rows, K] and `sums` [rows, K / block] from x [rows, K].
void prepare_input(const float* x, int64_t rows, int64_t k, int64_t block, float* paired, float* sums);

// y[r, n] for n in [n_begin, n_end), every row r. y is [rows, N].
void block_matmul(const BlockWeights& w, const PreparedInput& in, float* y, int64_t n_begin, int64_t n_end);

// Which code path block_matmul takes on this CPU: "avx2" or "portable".
const char* block_matmul_path();

}  // namespace sg::kernels
