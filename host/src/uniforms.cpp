// numpy's seeding and float32 stream, implemented from its documented algorithms:
// SeedSequence (numpy/random/bit_generator.pyx, after M. O'Neill's seed_seq proposal), PCG64
// (pcg64.h: XSL-RR 128/64 on a 128-bit LCG) and Generator.random's float32 conversion.
#include "uniforms.h"

namespace sg {
namespace {

// SeedSequence's hashing constants.
constexpr uint32_t kInitA = 0x43b0d7e5, kMultA = 0x931e8875;
constexpr uint32_t kInitB = 0x8b51f9dd, kMultB = 0x58f38ded;
constexpr uint32_t kMixMultL = 0xca01f9dd, kMixMultR = 0x4973f715;
constexpr int kXShift = 16;
constexpr size_t kPoolSize = 4;

uint32_t hashmix(uint32_t value, uint32_t& hash_const) {
  value ^= hash_const;
  hash_const *= kMultA;
  value *= hash_const;
  value ^= value >> kXShift;
  return value;
}

uint32_t mix(uint32_t x, uint32_t y) {
  uint32_t result = kMixMultL * x - kMixMultR * y;
  return result ^ (result >> kXShift);
}

// SeedSequence(seed).generate_state(4, uint64): the pool mixed from the seed's 32-bit words
// (least significant first; 0 is one word), then 8 words drawn and read as 4 little-endian uint64.
void seed_words(uint64_t seed, uint64_t out[4]) {
  uint32_t entropy[2];
  size_t n = 0;
  do {
    entropy[n++] = uint32_t(seed);
    seed >>= 32;
  } while (seed != 0);
  uint32_t pool[kPoolSize];
  uint32_t hash_const = kInitA;
  for (size_t i = 0; i < kPoolSize; ++i) pool[i] = hashmix(i < n ? entropy[i] : 0, hash_const);
  for (size_t src = 0; src < kPoolSize; ++src) {
    for (size_t dst = 0; dst < kPoolSize; ++dst) {
      if (src != dst) pool[dst] = mix(pool[dst], hashmix(pool[src], hash_const));
    }
  }
  // Entropy words beyond the pool size (never, for a seed below 2**64 and a pool of 4).
  for (size_t src = kPoolSize; src < n; ++src) {
    for (size_t dst = 0; dst < kPoolSize; ++dst) pool[dst] = mix(pool[dst], hashmix(entropy[src], hash_const));
  }
  uint32_t words[8];
  uint32_t hash_b = kInitB;
  for (size_t i = 0; i < 8; ++i) {
    uint32_t v = pool[i % kPoolSize];
    v ^= hash_b;
    hash_b *= kMultB;
    v *= hash_b;
    v ^= v >> kXShift;
    words[i] = v;
  }
  for (size_t i = 0; i < 4; ++i) out[i] = uint64_t(words[2 * i]) | uint64_t(words[2 * i + 1]) << 32;
}

// PCG's default 128-bit multiplier, 2549297995355413924 * 2**64 + 4865540595714422341.
const unsigned __int128 kMultiplier =
    (static_cast<unsigned __int128>(2549297995355413924ULL) << 64) | 4865540595714422341ULL;

}  // namespace

Pcg64::Pcg64(uint64_t seed) {
  uint64_t w[4];
  seed_words(seed, w);
  // numpy's pcg64_set_seed: state = w[0]:w[1], sequence = w[2]:w[3] (high:low), then
  // pcg_setseq_128_srandom_r: inc = (sequence << 1) | 1; step; state += initstate; step.
  unsigned __int128 initstate = (static_cast<unsigned __int128>(w[0]) << 64) | w[1];
  unsigned __int128 initseq = (static_cast<unsigned __int128>(w[2]) << 64) | w[3];
  state_ = 0;
  inc_ = (initseq << 1) | 1;
  state_ = state_ * kMultiplier + inc_;
  state_ += initstate;
  state_ = state_ * kMultiplier + inc_;
}

uint64_t Pcg64::next64() {
  // Step the LCG, then XSL-RR: xor the halves, rotate right by the top 6 bits.
  state_ = state_ * kMultiplier + inc_;
  uint64_t x = uint64_t(state_ >> 64) ^ uint64_t(state_);
  unsigned rot = unsigned(state_ >> 122);
  return (x >> rot) | (x << ((64 - rot) & 63));
}

uint32_t Pcg64::next32() {
  if (has_uint32_) {
    has_uint32_ = false;
    return uinteger_;
  }
  uint64_t next = next64();
  has_uint32_ = true;
  uinteger_ = uint32_t(next >> 32);
  return uint32_t(next & 0xffffffffu);
}

float Pcg64::next_float() { return float(next32() >> 8) * (1.0f / 16777216.0f); }

std::vector<float> uniform_stream(uint64_t seed, size_t n) {
  Pcg64 rng(seed);
  std::vector<float> out(n);
  for (auto& u : out) u = rng.next_float();
  return out;
}

}  // namespace sg
