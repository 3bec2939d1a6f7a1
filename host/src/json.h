// A small JSON reader for manifest.json (RFC 8259, plus NaN and Infinity as Python's json writes
// them). Integers that fit int64 stay exact; objects keep their order, a repeated key keeps the
// last value (as Python's json.loads does).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace sg::json {

struct Value {
  enum Kind { kNull, kBool, kNumber, kString, kArray, kObject };
  Kind kind = kNull;
  bool boolean = false;
  bool is_int = false;  // a number written without fraction or exponent that fits int64
  int64_t integer = 0;
  double number = 0;
  std::string string;
  std::vector<Value> items;                            // kArray
  std::vector<std::pair<std::string, Value>> members;  // kObject, in file order, keys unique

  const Value* find(const std::string& key) const;  // nullptr if absent or not an object
  bool is_null() const { return kind == kNull; }
};

// Parse `text`; throws std::invalid_argument with "line L column C: what" on malformed input.
Value parse(const std::string& text, int max_depth = 64);

// A short one-line rendering of a value, for error messages (like Python's repr, cut at `limit`).
std::string show(const Value& value, size_t limit = 60);

}  // namespace sg::json
