// ONNX Runtime's API table as the host and the kernel library read it (see ort_api.h): OrtGetApiBase
// returns two functions, GetApi(version) gives an append-only array of function pointers, and a
// slot is taken by its index and cast to the signature the documentation gives it.
#pragma once

#include <cstddef>
#include <cstdint>

namespace sg::ort {

using Fn = void (*)();

// OrtApiBase: the two functions OrtGetApiBase returns.
struct ApiBase {
  const Fn* (*GetApi)(uint32_t version);
  const char* (*GetVersionString)();
};

template <typename F>
void take(const Fn* table, size_t index, F& slot) {
  slot = reinterpret_cast<F>(table[index]);
}

}  // namespace sg::ort
