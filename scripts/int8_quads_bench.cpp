// The library's int8-activation product of one-digit codes in its two layouts, the same data, one
// binary (docs/benchmarks.md, issue 9): "quads", 16 outputs' codes for 8 inputs in one 64-byte
// load, so that VNNI's four-byte dot products take 16 outputs at once, against the digits
// ("pairs") layout (one output's blocks in a run; two outputs a register, their scales gathered
// one by one). A prototype of this loop priced quads before the library had them (commit f0a8e97
// holds it, with its prefetch variants).
//
// Quads: for each tile of 16 outputs, block by block, group g of 8 inputs (g < 4): 64 bytes, byte
// 4o + i the pairs layout's byte 4g + i of output o (inputs 8g + 2i in the low nibble, 8g + 2i + 1
// in the high one). One VNNI product of the low nibbles with 4 even activation codes, one of the
// high nibbles with 4 odd ones, give lane (block parity, g) of int8_chain's sum for all 16 outputs,
// and the float steps follow int8_chain's order, so the result is the pairs loop's to the bit
// (checked below for every output of SmolLM2's four one-digit matrix shapes).
//
// It includes the kernel's source:
//
//   g++ -O3 -mavx2 -mfma -mf16c -std=c++17 -Ihost/src/kernels \
//       -DKFILE='"block_matmul.cpp"' scripts/int8_quads_bench.cpp -o /tmp/int8_quads_bench -lpthread
//   /tmp/int8_quads_bench 2 30     # threads, distinct layers (1: hot in cache; 30: streamed)
//   ROWS=4 /tmp/int8_quads_bench 2 30   # a verify call's rows (default 1)
//
// -DSG_QUADS_AHEAD=N builds the quads loop with its codes prefetched N blocks ahead (the library: 16).
#include KFILE
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <random>
#include <thread>
#include <vector>

using namespace sg::kernels;

struct Matrix {
  std::vector<uint8_t> pairs, quads;
  std::vector<uint16_t> d, m;  // float16, [ceil(N / 16), K / 32, 16]
  BlockWeights w, wq;  // the same weights in pairs and in quads
};

static double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// pairs [N, K / 32, 16] -> quads [N / 16, K / 32, 4, 16, 4]
static std::vector<uint8_t> to_quads(const std::vector<uint8_t>& pairs, int64_t n, int64_t k) {
  const int64_t nb = k / 32;
  std::vector<uint8_t> q(pairs.size());
  for (int64_t o = 0; o < n; ++o)
    for (int64_t b = 0; b < nb; ++b)
      for (int64_t j = 0; j < 16; ++j)
        q[((((o / 16) * nb + b) * 4 + j / 4) * 16 + o % 16) * 4 + j % 4] = pairs[(o * nb + b) * 16 + j];
  return q;
}

int main(int argc, char** argv) {
  const int threads = argc > 1 ? atoi(argv[1]) : 1;
  const int distinct = argc > 2 ? atoi(argv[2]) : 30;
  if (!has_vnni()) {
    printf("this CPU has no AVX-512 VNNI\n");
    return 1;
  }
  std::mt19937 rng(1);
  const int64_t shapes[4][2] = {{960, 576}, {576, 576}, {3072, 576}, {576, 1536}};  // q/k/v, o, gate/up, down
  std::vector<Matrix> mats;
  for (int l = 0; l < distinct; ++l)
    for (const auto& s : shapes) {
      Matrix mat;
      const int64_t n = s[0], k = s[1], nb = k / 32;
      mat.pairs.resize(n * k / 2);
      for (auto& b : mat.pairs) b = static_cast<uint8_t>(rng());
      mat.quads = to_quads(mat.pairs, n, k);
      mat.d.resize((n + 15) / 16 * nb * 16);
      mat.m.resize(mat.d.size());
      for (auto& v : mat.d) v = static_cast<uint16_t>(0x2000 + (rng() & 0x3ff));  // small positive
      for (auto& v : mat.m) v = static_cast<uint16_t>(0xa000 + (rng() & 0x3ff));  // small negative
      mat.w = BlockWeights{n, k, 32, mat.pairs.data(), nullptr, mat.d.data(), mat.m.data(), true, false, false};
      mat.wq = mat.w;
      mat.wq.high = mat.quads.data();
      mat.wq.quads = true;
      mats.push_back(std::move(mat));
    }
  // `rows` rows of int8 activations per input width, as quantise_input prepares them
  const int64_t nrows = getenv("ROWS") ? atoi(getenv("ROWS")) : 1;
  struct Row {
    std::vector<int8_t> codes;
    std::vector<float> steps, sums;
    std::vector<int32_t> centred;
    PreparedInput in;
  } rows[2];
  for (int i = 0; i < 2; ++i) {
    const int64_t k = i ? 1536 : 576, pairs = (k / 32 + 1) / 2;
    std::vector<float> x(nrows * k);
    for (auto& v : x) v = static_cast<float>(rng() % 1000) / 1000.0f - 0.5f;
    rows[i].codes.resize(nrows * pairs * 64);
    rows[i].steps.resize(nrows * pairs * 8);
    rows[i].centred.resize(nrows * pairs * 8);
    rows[i].sums.resize(nrows * k / 32);
    quantise_input(x.data(), nrows, k, 8, rows[i].codes.data(), rows[i].steps.data(), rows[i].centred.data(),
                   rows[i].sums.data());
    rows[i].in = PreparedInput{nrows, nullptr, rows[i].sums.data(), rows[i].codes.data(), rows[i].steps.data(),
                               rows[i].centred.data()};
  }
  auto input = [&](const Matrix& mat) -> const PreparedInput& { return rows[mat.w.k == 1536].in; };
  // the same bits in both layouts, every output of every shape
  int64_t differ = 0;
  std::vector<float> a(3072 * nrows), b(3072 * nrows);
  for (int s = 0; s < 4; ++s) {
    const Matrix& mat = mats[s];
    block_matmul(mat.w, input(mat), a.data(), 0, mat.w.n);
    block_matmul(mat.wq, input(mat), b.data(), 0, mat.w.n);
    for (int64_t o = 0; o < nrows * mat.w.n; ++o) differ += std::memcmp(&a[o], &b[o], 4) != 0;
  }
  printf("outputs of quads that differ from pairs in any bit: %lld\n", static_cast<long long>(differ));
  auto time = [&](bool quads) {
    auto work = [&](int t) {
      thread_local std::vector<float> out(3072 * nrows);
      for (int rep = 0; rep < 30 / distinct; ++rep)
        for (auto& mat : mats) {
          const int64_t tiles = (mat.w.n + 15) / 16, t0 = t * tiles / threads, t1 = (t + 1) * tiles / threads;
          block_matmul(quads ? mat.wq : mat.w, input(mat), out.data(), t0 * 16, std::min(mat.w.n, t1 * 16));
        }
    };
    const double start = now();
    std::vector<std::thread> others;
    for (int t = 1; t < threads; ++t) others.emplace_back(work, t);
    work(0);
    for (auto& th : others) th.join();
    return now() - start;
  };
  std::vector<double> pairs_ms, quads_ms;
  for (int pass = 0; pass < 30; ++pass) {  // alternated, so a slow moment hits both
    pairs_ms.push_back(time(false) * 1e3);
    quads_ms.push_back(time(true) * 1e3);
  }
  std::sort(pairs_ms.begin(), pairs_ms.end());
  std::sort(quads_ms.begin(), quads_ms.end());
  printf("%d thread(s), %d distinct layer(s), %lld row(s), int8 activations: pairs %.2f ms, quads %.2f ms median\n",
         threads, distinct, static_cast<long long>(nrows), pairs_ms[15], quads_ms[15]);
}
