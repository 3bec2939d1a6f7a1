// The one-digit block product alone, on SmolLM2's one-digit matrix shapes with random Q4_1 blocks
// (docs/benchmarks.md, issue 9's first section): median ms of 30 passes over 30 layers' worth of
// products, `distinct` of them different (1: one layer's matrices, hot in cache; 30: streamed).
// It includes the kernel's source, so a variant is an edit of block_matmul.cpp rebuilt with it.
//
//   g++ -O3 -mavx2 -mfma -mf16c -std=c++17 -Ihost/src/kernels \
//       -DKFILE='"block_matmul.cpp"' scripts/kernel_bench.cpp -o /tmp/kernel_bench -lpthread
//   /tmp/kernel_bench 1 1            # one thread, hot; ROWS=2 for two rows; PAIRS=1 for the pairs layout
#include KFILE
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <random>
#include <thread>
#include <vector>

using namespace sg::kernels;

struct Matrix {
  std::vector<uint8_t> codes;
  std::vector<uint16_t> d, m;  // float16 scales and offsets, [ceil(N / 16), K / 32, 16]
  BlockWeights w;
};

static double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

int main(int argc, char** argv) {
  const int threads = argc > 1 ? atoi(argv[1]) : 1;
  const int distinct = argc > 2 ? atoi(argv[2]) : 30;
  const int rows = getenv("ROWS") ? atoi(getenv("ROWS")) : 1;
  const bool lanes = !getenv("PAIRS");
  std::mt19937 rng(1);
  const int64_t shapes[4][2] = {{960, 576}, {576, 576}, {3072, 576}, {576, 1536}};  // q/k/v, o, gate/up, down
  std::vector<Matrix> mats;
  for (int l = 0; l < distinct; ++l)
    for (const auto& s : shapes) {
      Matrix mat;
      const int64_t n = s[0], k = s[1], nb = k / 32;
      mat.codes.resize(lanes ? (n + 7) / 8 * k * 4 : n * k / 2);
      for (auto& b : mat.codes) b = static_cast<uint8_t>(rng());
      mat.d.resize((n + 15) / 16 * nb * 16);
      mat.m.resize(mat.d.size());
      for (auto& v : mat.d) v = static_cast<uint16_t>(0x2000 + (rng() & 0x3ff));  // small positive
      for (auto& v : mat.m) v = static_cast<uint16_t>(0xa000 + (rng() & 0x3ff));  // small negative
      mat.w = BlockWeights{n, k, 32, mat.codes.data(), nullptr, mat.d.data(), mat.m.data(), true, lanes, false};
      mats.push_back(std::move(mat));
    }
  std::vector<float> x(1536 * 8), paired(1536 * 8), sums(48 * 8), y(3072 * 8);
  for (auto& v : x) v = static_cast<float>(rng() % 1000) / 1000.0f - 0.5f;
  prepare_input(x.data(), rows, 576, 32, paired.data(), sums.data());
  auto work = [&](int t) {
    const PreparedInput in{rows, paired.data(), sums.data()};
    thread_local std::vector<float> out(3072 * 8);
    for (int rep = 0; rep < 30 / distinct; ++rep)
      for (auto& mat : mats) {
        const int64_t tiles = (mat.w.n + 15) / 16;
        const int64_t begin = t * tiles / threads * 16, end = std::min(mat.w.n, (t + 1) * tiles / threads * 16);
        block_matmul(mat.w, in, out.data(), begin, end);
      }
  };
  std::vector<double> times;
  for (int pass = 0; pass < 30; ++pass) {
    const double start = now();
    std::vector<std::thread> others;
    for (int t = 1; t < threads; ++t) others.emplace_back(work, t);
    work(0);
    for (auto& th : others) th.join();
    times.push_back(now() - start);
  }
  std::sort(times.begin(), times.end());
  printf("%d thread(s), %d distinct layer(s), %d row(s), %s: %.2f ms median\n", threads, distinct, rows,
         lanes ? "lanes" : "pairs", times[15] * 1e3);
}
