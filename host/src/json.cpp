// Recursive-descent JSON reader (see json.h).
#include "json.h"

#include <charconv>
#include <cmath>
#include <limits>
#include <stdexcept>

namespace sg::json {
namespace {

class Reader {
 public:
  Reader(const std::string& text, int max_depth) : s_(text), max_depth_(max_depth) {}

  Value document() {
    check_utf8();
    Value v = value(0);
    space();
    if (pos_ != s_.size()) fail("extra data after the JSON value");
    return v;
  }

 private:
  const std::string& s_;
  size_t pos_ = 0;
  int max_depth_;

  [[noreturn]] void fail(const std::string& what) const {
    size_t line = 1, column = 1;
    for (size_t i = 0; i < pos_ && i < s_.size(); ++i) {
      if (s_[i] == '\n') {
        ++line;
        column = 1;
      } else {
        ++column;
      }
    }
    throw std::invalid_argument("line " + std::to_string(line) + " column " + std::to_string(column) + ": " + what);
  }

  // The whole document must be UTF-8 (Python decodes the bytes before parsing).
  void check_utf8() {
    const auto* p = reinterpret_cast<const unsigned char*>(s_.data());
    size_t n = s_.size();
    for (size_t i = 0; i < n;) {
      unsigned c = p[i];
      size_t len = c < 0x80 ? 1 : (c >> 5) == 0x6 ? 2 : (c >> 4) == 0xE ? 3 : (c >> 3) == 0x1E ? 4 : 0;
      if (len == 0 || i + len > n) {
        pos_ = i;
        fail("invalid UTF-8");
      }
      uint32_t cp = len == 1 ? c : c & (0x7F >> len);
      for (size_t k = 1; k < len; ++k) {
        if ((p[i + k] & 0xC0) != 0x80) {
          pos_ = i;
          fail("invalid UTF-8");
        }
        cp = (cp << 6) | (p[i + k] & 0x3F);
      }
      static const uint32_t kMin[5] = {0, 0, 0x80, 0x800, 0x10000};
      if (cp < kMin[len] || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) {
        pos_ = i;
        fail("invalid UTF-8");
      }
      i += len;
    }
  }

  void space() {
    while (pos_ < s_.size() && (s_[pos_] == ' ' || s_[pos_] == '\t' || s_[pos_] == '\n' || s_[pos_] == '\r')) ++pos_;
  }

  bool literal(const char* word) {
    size_t n = std::char_traits<char>::length(word);
    if (s_.compare(pos_, n, word) == 0) {
      pos_ += n;
      return true;
    }
    return false;
  }

  Value value(int depth) {
    if (depth > max_depth_) fail("nested deeper than " + std::to_string(max_depth_) + " levels");
    space();
    if (pos_ >= s_.size()) fail("unexpected end of data");
    Value v;
    char c = s_[pos_];
    if (c == '{') {
      object(v, depth);
    } else if (c == '[') {
      array(v, depth);
    } else if (c == '"') {
      v.kind = Value::kString;
      v.string = string();
    } else if (literal("true")) {
      v.kind = Value::kBool;
      v.boolean = true;
    } else if (literal("false")) {
      v.kind = Value::kBool;
    } else if (literal("null")) {
      v.kind = Value::kNull;
    } else if (literal("NaN")) {
      v.kind = Value::kNumber;
      v.number = std::numeric_limits<double>::quiet_NaN();
    } else if (literal("Infinity")) {
      v.kind = Value::kNumber;
      v.number = std::numeric_limits<double>::infinity();
    } else if (literal("-Infinity")) {
      v.kind = Value::kNumber;
      v.number = -std::numeric_limits<double>::infinity();
    } else {
      number(v);
    }
    return v;
  }

  void object(Value& v, int depth) {
    v.kind = Value::kObject;
    ++pos_;
    space();
    if (pos_ < s_.size() && s_[pos_] == '}') {
      ++pos_;
      return;
    }
    for (;;) {
      space();
      if (pos_ >= s_.size() || s_[pos_] != '"') fail("expected a string key");
      std::string key = string();
      space();
      if (pos_ >= s_.size() || s_[pos_] != ':') fail("expected ':'");
      ++pos_;
      Value item = value(depth + 1);
      bool replaced = false;
      for (auto& member : v.members) {
        if (member.first == key) {
          member.second = std::move(item);
          replaced = true;
          break;
        }
      }
      if (!replaced) v.members.emplace_back(std::move(key), std::move(item));
      space();
      if (pos_ < s_.size() && s_[pos_] == ',') {
        ++pos_;
        continue;
      }
      if (pos_ < s_.size() && s_[pos_] == '}') {
        ++pos_;
        return;
      }
      fail("expected ',' or '}'");
    }
  }

  void array(Value& v, int depth) {
    v.kind = Value::kArray;
    ++pos_;
    space();
    if (pos_ < s_.size() && s_[pos_] == ']') {
      ++pos_;
      return;
    }
    for (;;) {
      v.items.push_back(value(depth + 1));
      space();
      if (pos_ < s_.size() && s_[pos_] == ',') {
        ++pos_;
        continue;
      }
      if (pos_ < s_.size() && s_[pos_] == ']') {
        ++pos_;
        return;
      }
      fail("expected ',' or ']'");
    }
  }

  unsigned hex4() {
    if (pos_ + 4 > s_.size()) fail("truncated \\u escape");
    unsigned cp = 0;
    for (int i = 0; i < 4; ++i) {
      char c = s_[pos_++];
      cp <<= 4;
      if (c >= '0' && c <= '9') cp |= c - '0';
      else if (c >= 'a' && c <= 'f') cp |= c - 'a' + 10;
      else if (c >= 'A' && c <= 'F') cp |= c - 'A' + 10;
      else fail("bad \\u escape");
    }
    return cp;
  }

  static void put_utf8(std::string& out, uint32_t cp) {
    if (cp < 0x80) {
      out += static_cast<char>(cp);
    } else if (cp < 0x800) {
      out += static_cast<char>(0xC0 | (cp >> 6));
      out += static_cast<char>(0x80 | (cp & 0x3F));
    } else if (cp < 0x10000) {
      out += static_cast<char>(0xE0 | (cp >> 12));
      out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
      out += static_cast<char>(0x80 | (cp & 0x3F));
    } else {
      out += static_cast<char>(0xF0 | (cp >> 18));
      out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
      out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
      out += static_cast<char>(0x80 | (cp & 0x3F));
    }
  }

  std::string string() {
    ++pos_;  // the opening quote
    std::string out;
    for (;;) {
      if (pos_ >= s_.size()) fail("unterminated string");
      char c = s_[pos_++];
      if (c == '"') return out;
      if (static_cast<unsigned char>(c) < 0x20) fail("control character in a string");
      if (c != '\\') {
        out += c;
        continue;
      }
      if (pos_ >= s_.size()) fail("unterminated string");
      char e = s_[pos_++];
      switch (e) {
        case '"': out += '"'; break;
        case '\\': out += '\\'; break;
        case '/': out += '/'; break;
        case 'b': out += '\b'; break;
        case 'f': out += '\f'; break;
        case 'n': out += '\n'; break;
        case 'r': out += '\r'; break;
        case 't': out += '\t'; break;
        case 'u': {
          uint32_t cp = hex4();
          if (cp >= 0xD800 && cp < 0xDC00 && s_.compare(pos_, 2, "\\u") == 0) {
            size_t keep = pos_;
            pos_ += 2;
            uint32_t low = hex4();
            if (low >= 0xDC00 && low < 0xE000) {
              cp = 0x10000 + ((cp - 0xD800) << 10) + (low - 0xDC00);
            } else {
              pos_ = keep;  // a lone high surrogate; the next escape stands alone
            }
          }
          put_utf8(out, cp);
          break;
        }
        default: fail("bad escape in a string");
      }
    }
  }

  void number(Value& v) {
    size_t start = pos_;
    if (pos_ < s_.size() && s_[pos_] == '-') ++pos_;
    if (pos_ >= s_.size() || !isdigit(s_[pos_])) fail("expected a value");
    if (s_[pos_] == '0') {
      ++pos_;
    } else {
      while (pos_ < s_.size() && isdigit(s_[pos_])) ++pos_;
    }
    bool integral = true;
    if (pos_ < s_.size() && s_[pos_] == '.') {
      integral = false;
      ++pos_;
      if (pos_ >= s_.size() || !isdigit(s_[pos_])) fail("expected digits after '.'");
      while (pos_ < s_.size() && isdigit(s_[pos_])) ++pos_;
    }
    if (pos_ < s_.size() && (s_[pos_] == 'e' || s_[pos_] == 'E')) {
      integral = false;
      ++pos_;
      if (pos_ < s_.size() && (s_[pos_] == '+' || s_[pos_] == '-')) ++pos_;
      if (pos_ >= s_.size() || !isdigit(s_[pos_])) fail("expected digits in an exponent");
      while (pos_ < s_.size() && isdigit(s_[pos_])) ++pos_;
    }
    const char* first = s_.data() + start;
    const char* last = s_.data() + pos_;
    v.kind = Value::kNumber;
    if (integral) {
      auto r = std::from_chars(first, last, v.integer);
      v.is_int = r.ec == std::errc() && r.ptr == last;
    }
    auto r = std::from_chars(first, last, v.number);
    if (r.ec == std::errc::result_out_of_range) {
      v.number = (*first == '-' ? -1 : 1) * std::numeric_limits<double>::infinity();
    } else if (r.ec != std::errc()) {
      fail("bad number");
    }
  }

  static bool isdigit(char c) { return c >= '0' && c <= '9'; }
};

void render(const Value& v, std::string& out, size_t limit) {
  if (out.size() > limit) return;
  switch (v.kind) {
    case Value::kNull: out += "None"; break;
    case Value::kBool: out += v.boolean ? "True" : "False"; break;
    case Value::kNumber: {
      if (v.is_int) {
        out += std::to_string(v.integer);
      } else {
        char buf[32];
        auto r = std::to_chars(buf, buf + sizeof buf, v.number);
        out.append(buf, r.ptr);
      }
      break;
    }
    case Value::kString: out += "'" + v.string + "'"; break;
    case Value::kArray:
      out += "[";
      for (size_t i = 0; i < v.items.size() && out.size() <= limit; ++i) {
        if (i) out += ", ";
        render(v.items[i], out, limit);
      }
      out += "]";
      break;
    case Value::kObject:
      out += "{";
      for (size_t i = 0; i < v.members.size() && out.size() <= limit; ++i) {
        if (i) out += ", ";
        out += "'" + v.members[i].first + "': ";
        render(v.members[i].second, out, limit);
      }
      out += "}";
      break;
  }
}

}  // namespace

const Value* Value::find(const std::string& key) const {
  if (kind != kObject) return nullptr;
  for (const auto& member : members) {
    if (member.first == key) return &member.second;
  }
  return nullptr;
}

Value parse(const std::string& text, int max_depth) { return Reader(text, max_depth).document(); }

std::string show(const Value& value, size_t limit) {
  std::string out;
  render(value, out, limit);
  for (char& c : out) {
    if (c == '\n' || c == '\r') c = ' ';
  }
  return out.size() <= limit ? out : out.substr(0, limit - 3) + "...";
}

}  // namespace sg::json
