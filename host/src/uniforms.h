// The engine's uniforms: numpy.random.Generator(numpy.random.PCG64(seed)).random(n, dtype=float32),
// bit for bit, so that a seeded run here emits the tokens a seeded run of the Python host emits.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace sg {

// numpy's SeedSequence(entropy=seed) -> PCG64 (128-bit LCG, XSL-RR output) -> next_uint32 (the
// low half of each 64-bit output first, then the buffered high half) -> (u32 >> 8) * 2**-24.
class Pcg64 {
 public:
  explicit Pcg64(uint64_t seed);
  uint64_t next64();
  uint32_t next32();
  float next_float();

 private:
  unsigned __int128 state_ = 0;
  unsigned __int128 inc_ = 0;
  bool has_uint32_ = false;
  uint32_t uinteger_ = 0;
};

std::vector<float> uniform_stream(uint64_t seed, size_t n);

}  // namespace sg
