// y = x @ W^T with W held as the integer blocks specgraph's bundles store (exporters/nbits.py),
// multiplied in float32: the exact product of the dequantised weight, to float rounding.
//
// W's block b of row n is `d[b, n] * code + m[b, n]` (the stored format's own scale and offset,
// e.g. a GGUF block's), with codes one 4-bit digit, or two (`16 * high + low`, d the low digit's
// scale). Digits are packed two a byte, weight 2j in the low nibble and 2j + 1 in the high one,
// [N, K / block, block / 2]. d and m are float32 or float16 (GGUF's own scales are float16, so
// storing them so is exact and reads the bytes llama.cpp reads), laid out [ceil(N / 16), K / block,
// 16]: for each tile of 16 outputs, block by block, the tile's 16 values (zero past N), so that a
// tile's scales are one contiguous run.
//
// The product is computed on centred codes: y = sum_b d_b * T_b + c'_b * S_b with T_b =
// sum_k x_k * (code_k - centre) over block b, S_b the block's input sum and c'_b = m_b + centre *
// d_b. For two digits the centre is 136, which keeps both terms small when m_b is near -centre *
// d_b, as in symmetric formats (Q8_0). For one digit it is 0 at float32 activations (the codes'
// 0-15 are at most twice the centred ones' magnitude, and the subtraction would be one instruction
// in four of the lanes loop: 20% of a one-row product) and 8 at int8 activations (exact integers).
//
// Lanes (one 4-bit digit only): the codes of 8 consecutive outputs share one 32-bit lane per input,
// output 8t + o in bits [4o, 4o + 4) of lane [t, p], [ceil(N / 8), K] lanes (zero past N), p the
// input's position in the paired order above (a block's even inputs, then its odd ones). A product
// then takes 8 inputs' codes of one output with an AND (the top output's with a shift), with no
// widening or shuffling: 3 instructions for 8 weights (AND, convert, multiply-add) where pairs take
// about 4. Output o's codes come out times 16^o and its sum is scaled back by 16^-o, a power of
// two, so a lanes product rounds exactly as the pairs layout's does (to the bit, barring
// subnormals): a `none` engine in lanes emits what a speculative one in pairs verifies.
// Wide lanes do the same for 8-bit codes (two digits, 16 * high + low): 4 outputs a lane, output o
// in bits [8o, 8o + 8), centred on 136 (one subtraction more) and scaled by 256^o.
//
// Int8 activations (`--activations int8`; blocks of 32, pairs layout): x is first quantised per
// block of 32 inputs, q = round(x * 127 / max|x|) with step e = max|x| / 127 (Q8_0's rule, the
// one llama.cpp applies to its activations), and the product is the dequantised weight's with
// x' = e * q: T_b = sum code * q - centre * sum q in integers (AVX2 `maddubs` on the 4-bit
// digits, so an 8-bit code is two such products), then y = sum_b d_b * e_b * T_b + c'_b * e_b *
// sum q. Each (row, output) is one chain in an order no row count changes, so a row of a verify
// call equals that row computed alone, bit for bit, as in float32.
//
// Quads (one 4-bit digit, int8 activations, blocks of 32): for each tile of 16 outputs, block by
// block, each group g < 4 of 8 inputs as 64 bytes, byte 4o + i the pairs layout's byte 4g + i of
// the tile's output o (input 8g + 2i in its low nibble, 8g + 2i + 1 in its high one). One VNNI
// four-byte product of the low nibbles with 4 even activation codes and one of the high nibbles
// with 4 odd ones give 16 outputs' integer sums over the group at once, where pairs take two
// outputs a register with their scales gathered one by one; the float steps follow the pairs
// loop's lane order, so quads give its bits (scripts/int8_quads_bench.cpp priced it first).
//
// Digits (activation_bits 24, one 4-bit digit in quads, blocks of 32): float32 activations in
// integers, to float32's own precision. Each block of x is scaled to integers of at most kDigitsTop
// = 127 * (2^24 + 2^16 + 2^8 + 1) (just under 2^31) in magnitude, v = round(x * kDigitsTop /
// max|x|), and the step e = max|x| / kDigitsTop. An input within 2^7 of the block's largest scales
// to at least 2^24, where float32's product x * (kDigitsTop / max|x|) is already an integer: v is
// that float32 product, and x' = e * v is x to float32's rounding; a smaller input is kept to 2^-31
// of the largest. v is written as four signed digits, v = 2^24 a3 + 2^16 a2 + 2^8 a1 + a0, each in
// [-128, 127]. The codes times each digit are exact integer sums (AMX's int8 tile product, or
// VNNI's four-byte products), combined per block as ((256 D3 + D2) * 65536 + 256 D1 + D0) * e *
// d_b, plus m_b * e * sum v. The sums are integers, so every loop (AMX, VNNI, portable) and every
// row count give the same bits. AMX takes the digits of up to 4 rows (16 tile rows) in one
// product, so a verify call's rows cost little more than one (docs/benchmarks.md).
// Byte quads (digits only) hold 8-bit codes (two digits, 16 * high + low, Q8_0's) the same way, a
// byte each: block by block, row j = 2g + h of 64 bytes holds byte 4o + i = output o's code of input
// 8g + 2i + h, which is AMX's B tile as stored (no unpacking) and VNNI's operand as loaded. Their
// digit sums reach 32 * 128 * 255, so v = sum x_int * (code - 136) is formed in int64 (exact) and
// rounded once; y = sum_b e_b d_b v_b + (m_b + 136 d_b) e_b sum x_int.
#pragma once

#include <cstddef>
#include <cstdint>

namespace sg::kernels {

constexpr int64_t kScaleTile = 16;  // outputs whose d and m are stored together

struct BlockWeights {
  int64_t n = 0;                   // output features (rows of W)
  int64_t k = 0;                   // input features
  int64_t block = 0;               // weights per block: a multiple of 16
  const uint8_t* high = nullptr;   // the only digit, or the high one
  const uint8_t* low = nullptr;    // the low digit, or nullptr for one digit
  const void* scale = nullptr;     // d [ceil(N / 16), K / block, 16]
  const void* offset = nullptr;    // m, the same layout, or nullptr when every m is zero
  bool half = false;               // d and m are float16 (else float32)
  bool lanes = false;              // `high` holds lanes [ceil(N / 8), K] of 8 outputs' codes (one digit)
  bool wide = false;               // with lanes: 8-bit codes (two digits' worth), [ceil(N / 4), K], 4 a lane;
                                   // with quads (digits only): byte quads [ceil(N / 16), K / 32, 512]
  bool quads = false;              // `high` holds quads [ceil(N / 16), K / 32, 256] (one digit, int8 activations or digits)
};

constexpr int64_t kLaneOutputs = 8;  // outputs whose codes share a 32-bit lane

constexpr int64_t kInt8Block = 32;  // inputs that share one int8 step
constexpr int64_t kQuadBytes = 256;  // a quads tile's bytes per block: 16 outputs x 32 inputs
constexpr int64_t kByteQuadBytes = 512;  // a byte quads tile's bytes per block: 16 outputs x 32 8-bit codes
constexpr int64_t kByteCentre = 136;  // the centre of 8-bit codes (two digits), as for the other layouts
constexpr int kDigits = 4;  // int8 digits an input is written in (digits, above)
constexpr int32_t kDigitsTop = 127 * ((1 << 24) + (1 << 16) + (1 << 8) + 1);  // the largest |v| they hold
constexpr int64_t kDigitRows = 4;  // rows one AMX product takes (4 digits each, a tile's 16 rows)

// Input i of a block in the digits layout: group g = i / 8 of 8 inputs, its even inputs (the quads'
// low nibbles) at 8g..8g+3 and its odd ones at 8g+4..8g+7.
constexpr int64_t digit_column(int64_t i) { return 8 * (i / 8) + 4 * (i % 2) + (i % 8) / 2; }

// x rearranged once per call: each block's even inputs, then its odd ones, and each block's sum.
// With int8 activations (`codes` set) instead: x quantised, per pair of blocks (a last odd block
// pairs with zeros) the even inputs' codes of both blocks, then the odd inputs' ones, as `paired`
// without its floats, and `sums` is each block's e * sum q.
struct PreparedInput {
  int64_t rows = 0;
  const float* paired = nullptr;   // [rows, K]
  const float* sums = nullptr;     // [rows, K / block]
  const int8_t* codes = nullptr;   // [rows, ceil(K / 64), 64]
  const float* steps = nullptr;    // [rows, ceil(K / 64), 8]: e of a pair's first block in lanes 0-3, second 4-7
  const int32_t* centred = nullptr;  // [rows, ceil(K / 64), 8]: centre * sum q of each block in lanes 0 and 4
  // With digits (`digits` set): [K / 32, rows, 4, 32] int8, block by block each row's digits from
  // the top one down, in digit_column order; `steps` [rows, K / 32] each block's e, `sums` e * sum v,
  // `whole` sum v itself (int64).
  const int8_t* digits = nullptr;
  const int64_t* whole = nullptr;
};

// Fill `paired` [rows, K] and `sums` [rows, K / block] from x [rows, K].
void prepare_input(const float* x, int64_t rows, int64_t k, int64_t block, float* paired, float* sums);

// Fill the int8 fields of a PreparedInput (codes, steps, centred, sums as above) from x [rows, K],
// K a multiple of 32; `centre`: 8 for one digit, 136 for two.
void quantise_input(const float* x, int64_t rows, int64_t k, int centre, int8_t* codes, float* steps,
                    int32_t* centred, float* sums);

// Fill `digits`, `steps` [rows, K / 32] and `sums` (the same shape) of a PreparedInput from x [rows, K],
// K a multiple of 32 (digits, above).
void digit_input(const float* x, int64_t rows, int64_t k, int8_t* digits, float* steps, float* sums, int64_t* whole);

// Whether this CPU runs the digits product on AMX (else VNNI's loop, or the portable one, compute the
// same bits more slowly): a compile stores exact one-digit products as digits only where it does.
bool exact_digits_fast();

// What a product may compute on its input first, in place of the graph's own nodes
// (exporters/native_fusion.py): x' [rows, K] = x / sqrt(mean(x^2) + epsilon) * scale per row (an
// RMS norm, x [rows, K]), or x' = silu(g) * u with g, u the halves of x [rows, 2K] (a SwiGLU).
void rms_norm(const float* x, int64_t rows, int64_t k, const float* scale, float epsilon, float* out);
void gated_silu(const float* x, int64_t rows, int64_t k, float* out);

// y[r, n] for n in [n_begin, n_end), every row r. y is [rows, N]. With lanes, n_begin is a multiple of 8.
void block_matmul(const BlockWeights& w, const PreparedInput& in, float* y, int64_t n_begin, int64_t n_end);

// Whether a product of `rows` input rows is faster from one-digit codes in lanes than in pairs:
// for one row everywhere; for every row count with AVX-512, whose lanes loop takes all 8 outputs of
// a lane for 1-2 rows and 4 for 3-4 (measured on a 2-core Xeon: c(2) 0.91x, c(4) 0.94x, c(16) and
// c(64) 0.94x of pairs; on AVX2 lanes cost a verify call more, docs/benchmarks.md).
bool lanes_are_faster(int64_t rows);

// Which code path block_matmul takes on this CPU: "avx512-vnni", "avx512", "avx2" or "portable".
// The AVX-512 loops hold two outputs' AVX2 chains in one register, lane for lane, so they give the
// AVX2 loops' bits (VNNI's four-byte dot products give the int8 loop's integers); only the portable
// float32 loops sum in another order. $SPECGRAPH_KERNELS_AVX2 set and not empty: AVX2 even where
// AVX-512 exists (tests).
const char* block_matmul_path();

// $SPECGRAPH_KERNELS_PORTABLE is set and not empty: take the portable loops even where AVX2 exists
// (so the tests can check them against the AVX2 ones on the same machine).
bool forced_portable();

}  // namespace sg::kernels
