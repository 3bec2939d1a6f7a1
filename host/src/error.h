// One error type for the whole host: a status code (specgraph_host.h's SG_ERR_*) and one line of text.
#pragma once

#include <stdexcept>
#include <string>

#include "specgraph_host.h"

namespace sg {

class Failure : public std::runtime_error {
 public:
  Failure(int code, const std::string& message) : std::runtime_error(one_line(message)), code_(code) {}
  int code() const { return code_; }

  // Messages quote file names, JSON keys and ONNX Runtime's own errors, which may hold line breaks.
  static std::string one_line(const std::string& text) {
    std::string out;
    out.reserve(text.size());
    for (char c : text) out += (c == '\n' || c == '\r') ? ' ' : c;
    while (!out.empty() && out.back() == ' ') out.pop_back();
    return out;
  }

 private:
  int code_;
};

[[noreturn]] inline void bundle_error(const std::string& message) { throw Failure(SG_ERR_BUNDLE, message); }
[[noreturn]] inline void input_error(const std::string& message) { throw Failure(SG_ERR_INPUT, message); }
[[noreturn]] inline void runtime_error(const std::string& message) { throw Failure(SG_ERR_RUNTIME, message); }

}  // namespace sg
