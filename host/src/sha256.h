// SHA-256 (FIPS 180-4), for checking a bundle's files against manifest.json.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace sg {

class Sha256 {
 public:
  Sha256();
  void update(const void* data, size_t n);
  std::string hex();  // finishes the digest: lowercase hex, 64 characters

 private:
  void block(const uint8_t* p);
  uint32_t h_[8];
  uint8_t buf_[64];
  size_t used_ = 0;
  uint64_t bytes_ = 0;
};

// Hex sha256 of exactly the first `size` bytes of `path`; "" if the file cannot be read or its
// length is not `size` (it changed while read), so that no recorded digest matches.
std::string sha256_file(const std::string& path, uint64_t size);

}  // namespace sg
