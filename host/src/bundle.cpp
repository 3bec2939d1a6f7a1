// The bundle reader (see bundle.h); messages follow exporters/manifest.py's words.
#include "bundle.h"

#include <sys/stat.h>

#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <fstream>
#include <set>
#include <sstream>

#include "error.h"
#include "json.h"
#include "sha256.h"

namespace sg {
namespace {

using json::Value;

const char* kManifest = "manifest.json";
constexpr int64_t kMaxManifestBytes = 16 << 20;
constexpr int64_t kMaxContext = 131072;
constexpr int64_t kMaxVocab = 1 << 21;
constexpr int64_t kMaxKvWidth = 1 << 16;
constexpr size_t kMaxFiles = 4096;
const char* kDataSuffixes[] = {".onnx", ".data", ".json", ".txt", ".model", ".jinja"};

// --- schema -------------------------------------------------------------------------------------

class Schema {
 public:
  explicit Schema(const std::string& bundle) : bundle_(bundle) {}

  [[noreturn]] void bad(const std::string& key, const std::string& expected, const Value* got) const {
    bundle_error(bundle_ + ": manifest key " + key + ": expected " + expected + ", got " +
                 (got ? json::show(*got) : "nothing (the key is missing)"));
  }

  const Value& get(const Value& obj, const std::string& name, const std::string& key) const {
    const Value* v = obj.find(name);
    if (!v) bad(key, "a value", nullptr);
    return *v;
  }

  int64_t integer(const Value& v, const std::string& key, int64_t lo, int64_t hi) const {
    if (v.kind != Value::kNumber || !v.is_int || v.integer < lo || v.integer > hi) {
      bad(key, "an integer in [" + std::to_string(lo) + ", " + std::to_string(hi) + "]", &v);
    }
    return v.integer;
  }

  const std::string& string(const Value& v, const std::string& key) const {
    if (v.kind != Value::kString || v.string.empty() || v.string.size() > 4096) bad(key, "a non-empty string", &v);
    return v.string;
  }

  const Value& object(const Value& v, const std::string& key) const {
    if (v.kind != Value::kObject) bad(key, "an object", &v);
    return v;
  }

  const Value& list(const Value& v, const std::string& key, size_t max_len) const {
    if (v.kind != Value::kArray || v.items.size() > max_len) {
      bad(key, "a list of at most " + std::to_string(max_len) + " items", &v);
    }
    return v;
  }

  const Value& map(const Value& v, const std::string& key, size_t max_len) const {
    if (v.kind != Value::kObject || v.members.size() > max_len) {
      bad(key, "an object of at most " + std::to_string(max_len) + " entries", &v);
    }
    return v;
  }

  // A path inside the bundle: relative, '/'-separated, no '.', '..' or empty parts.
  const std::string& path(const Value& v, const std::string& key) const {
    bool ok = v.kind == Value::kString && !v.string.empty() && v.string.size() <= 1024;
    if (ok) {
      const std::string& s = v.string;
      ok = s.find('\\') == std::string::npos && s.find('\0') == std::string::npos &&
           !(s.size() >= 2 && std::isalpha(static_cast<unsigned char>(s[0])) && s[1] == ':');
      size_t start = 0;
      while (ok) {
        size_t end = s.find('/', start);
        std::string part = s.substr(start, end == std::string::npos ? std::string::npos : end - start);
        ok = !part.empty() && part != "." && part != "..";
        if (end == std::string::npos) break;
        start = end + 1;
      }
    }
    if (!ok) bad(key, "a relative path inside the bundle", &v);
    return v.string;
  }

 private:
  std::string bundle_;
};

std::string key_of(const std::string& name) {
  bool ident = !name.empty() && !std::isdigit(static_cast<unsigned char>(name[0]));
  for (char c : name) ident = ident && (std::isalnum(static_cast<unsigned char>(c)) || c == '_');
  return ident ? name : "'" + name + "'";
}

std::vector<TensorSpec> values(const Schema& s, const Value& v, const std::string& key) {
  std::vector<TensorSpec> out;
  for (size_t i = 0; i < s.list(v, key, 4096).items.size(); ++i) {
    const Value& item = s.object(v.items[i], key + "[" + std::to_string(i) + "]");
    std::string at = key + "[" + std::to_string(i) + "]";
    TensorSpec spec;
    spec.name = s.string(s.get(item, "name", at + ".name"), at + ".name");
    spec.dtype = s.string(s.get(item, "dtype", at + ".dtype"), at + ".dtype");
    const Value& shape = s.list(s.get(item, "shape", at + ".shape"), at + ".shape", 8);
    for (size_t d = 0; d < shape.items.size(); ++d) {
      const Value& dim = shape.items[d];
      std::string dkey = at + ".shape[" + std::to_string(d) + "]";
      if (dim.kind == Value::kString) {
        s.string(dim, dkey);
        spec.dims.push_back(-1);
      } else {
        spec.dims.push_back(s.integer(dim, dkey, 0, int64_t(1) << 31));
      }
    }
    out.push_back(std::move(spec));
  }
  return out;
}

size_t dtype_size(const std::string& dtype) {
  if (dtype == "float32") return 4;
  if (dtype == "int64") return 8;
  if (dtype == "bool") return 1;
  return 0;
}

Constant constant(const Schema& s, const std::string& name, const Value& v, const std::string& key) {
  s.object(v, key);
  Constant c;
  c.name = name;
  c.dtype = s.string(s.get(v, "dtype", key + ".dtype"), key + ".dtype");
  size_t width = dtype_size(c.dtype);
  if (!width) s.bad(key + ".dtype", "one of bool, int64, float32", v.find("dtype"));
  const Value& shape = s.list(s.get(v, "shape", key + ".shape"), key + ".shape", 8);
  int64_t count = 1;
  for (size_t d = 0; d < shape.items.size(); ++d) {
    c.shape.push_back(s.integer(shape.items[d], key + ".shape[" + std::to_string(d) + "]", 0, 1 << 20));
    count *= c.shape.back();
    if (count > (1 << 20)) s.bad(key + ".shape", "at most 1048576 values", &shape);
  }
  const Value& data = s.list(s.get(v, "data", key + ".data"), key + ".data", size_t(count));
  if (int64_t(data.items.size()) != count) {
    s.bad(key + ".data", std::to_string(count) + " values (the product of its shape)", &data);
  }
  c.bytes.resize(size_t(count) * width);
  for (int64_t i = 0; i < count; ++i) {
    const Value& x = data.items[size_t(i)];
    std::string at = key + ".data[" + std::to_string(i) + "]";
    if (c.dtype == "bool") {
      if (x.kind != Value::kBool) s.bad(at, "true or false", &x);
      c.bytes[size_t(i)] = x.boolean ? 1 : 0;
    } else if (c.dtype == "int64") {
      if (x.kind != Value::kNumber || !x.is_int) s.bad(at, "an integer", &x);
      std::memcpy(&c.bytes[size_t(i) * 8], &x.integer, 8);
    } else {
      if (x.kind != Value::kNumber) s.bad(at, "a number", &x);
      float f = float(x.number);
      std::memcpy(&c.bytes[size_t(i) * 4], &f, 4);
    }
  }
  return c;
}

std::vector<std::string> names(const Schema& s, const Value& v, const std::string& key) {
  std::vector<std::string> out;
  const Value& l = s.list(v, key, 4096);
  for (size_t i = 0; i < l.items.size(); ++i) out.push_back(s.string(l.items[i], key + "[" + std::to_string(i) + "]"));
  return out;
}

std::vector<std::pair<std::string, std::string>> pairs(const Schema& s, const Value& v, const std::string& key,
                                                       size_t max_len) {
  std::vector<std::pair<std::string, std::string>> out;
  for (const auto& m : s.map(v, key, max_len).members) {
    Value name;
    name.kind = Value::kString;
    name.string = m.first;
    s.string(name, key + " entry " + json::show(name));
    out.emplace_back(m.first, s.string(m.second, key + "." + key_of(m.first)));
  }
  return out;
}

// --- files --------------------------------------------------------------------------------------

bool has_data_suffix(const std::string& rel) {
  size_t slash = rel.rfind('/');
  std::string leaf = slash == std::string::npos ? rel : rel.substr(slash + 1);
  size_t dot = leaf.rfind('.');
  if (dot == std::string::npos || dot == 0) return false;  // PurePosixPath: ".data" has no suffix
  std::string suffix = leaf.substr(dot);
  for (const char* ok : kDataSuffixes) {
    if (suffix == ok) return true;
  }
  return false;
}

// lstat of bundle/rel, refusing a symbolic link at any level below the bundle.
struct stat lstat_inside(const std::string& bundle, const std::string& rel) {
  std::string path = bundle;
  struct stat info {};
  size_t start = 0;
  for (;;) {
    size_t end = rel.find('/', start);
    path += "/" + rel.substr(start, end == std::string::npos ? std::string::npos : end - start);
    if (lstat(path.c_str(), &info) != 0) {
      if (errno == ENOENT || errno == ENOTDIR) bundle_error(bundle + ": " + rel + " listed in the manifest is missing");
      bundle_error(bundle + ": cannot read " + rel + ": " + std::strerror(errno));
    }
    if (S_ISLNK(info.st_mode)) {
      bundle_error(bundle + ": " + rel + " goes through a symbolic link; a bundle's files must lie inside it");
    }
    if (end == std::string::npos) return info;
    start = end + 1;
  }
}

std::string with_commas(int64_t n) {
  std::string digits = std::to_string(n), out;
  for (size_t i = 0; i < digits.size(); ++i) {
    if (i && (digits.size() - i) % 3 == 0) out += ',';
    out += digits[i];
  }
  return out;
}

// --- the ONNX file's external-data references (protobuf wire format) ----------------------------
// ONNX Runtime opens every file a tensor's external_data "location" names, so each must be a
// relative path inside the bundle and a listed (hence verified) file. Field numbers are onnx.proto's.

class ProtoWalk {
 public:
  ProtoWalk(const std::string& bundle, const std::string& graph_file, const std::set<std::string>& listed)
      : bundle_(bundle), graph_file_(graph_file), listed_(listed) {
    size_t slash = graph_file.rfind('/');
    base_ = slash == std::string::npos ? "" : graph_file.substr(0, slash + 1);
  }

  void model(const uint8_t* p, const uint8_t* end) {
    each(p, end, 0, [&](int field, const uint8_t* q, const uint8_t* qend, int depth) {
      if (field == 7) graph(q, qend, depth);
      if (field == 25) each(q, qend, depth, [&](int f, const uint8_t* a, const uint8_t* b, int d) {
        if (f == 7) node(a, b, d);  // FunctionProto.node
      });
    });
  }

 private:
  std::string bundle_, graph_file_, base_;
  const std::set<std::string>& listed_;

  [[noreturn]] void broken(const std::string& what) const {
    bundle_error(bundle_ + ": " + graph_file_ + " is not a readable ONNX model: " + what);
  }

  static bool varint(const uint8_t*& p, const uint8_t* end, uint64_t& out) {
    out = 0;
    for (int shift = 0; shift < 64; shift += 7) {
      if (p >= end) return false;
      uint8_t b = *p++;
      out |= uint64_t(b & 0x7F) << shift;
      if (!(b & 0x80)) return true;
    }
    return false;
  }

  // Call fn(field, start, end, depth + 1) for every length-delimited field of one message.
  template <typename Fn>
  void each(const uint8_t* p, const uint8_t* end, int depth, Fn fn) {
    if (depth > 64) broken("messages nested too deeply");
    while (p < end) {
      uint64_t tag, n;
      if (!varint(p, end, tag)) broken("truncated field tag");
      int field = int(tag >> 3), wire = int(tag & 7);
      if (wire == 0) {
        if (!varint(p, end, n)) broken("truncated varint");
      } else if (wire == 1 || wire == 5) {
        size_t width = wire == 1 ? 8 : 4;
        if (size_t(end - p) < width) broken("truncated fixed field");
        p += width;
      } else if (wire == 2) {
        if (!varint(p, end, n) || n > uint64_t(end - p)) broken("truncated length-delimited field");
        fn(field, p, p + n, depth + 1);
        p += n;
      } else {
        broken("unsupported wire type " + std::to_string(wire));
      }
    }
  }

  void graph(const uint8_t* p, const uint8_t* end, int depth) {
    each(p, end, depth, [&](int f, const uint8_t* a, const uint8_t* b, int d) {
      if (f == 1) node(a, b, d);
      if (f == 5) tensor(a, b, d);
      if (f == 15) sparse(a, b, d);
    });
  }

  void node(const uint8_t* p, const uint8_t* end, int depth) {
    each(p, end, depth, [&](int f, const uint8_t* a, const uint8_t* b, int d) {
      if (f == 5) attribute(a, b, d);
    });
  }

  void attribute(const uint8_t* p, const uint8_t* end, int depth) {
    each(p, end, depth, [&](int f, const uint8_t* a, const uint8_t* b, int d) {
      if (f == 5 || f == 10) tensor(a, b, d);
      if (f == 6 || f == 11) graph(a, b, d);
      if (f == 22 || f == 23) sparse(a, b, d);
    });
  }

  void sparse(const uint8_t* p, const uint8_t* end, int depth) {
    each(p, end, depth, [&](int f, const uint8_t* a, const uint8_t* b, int d) {
      if (f == 1 || f == 2) tensor(a, b, d);
    });
  }

  void tensor(const uint8_t* p, const uint8_t* end, int depth) {
    bool external = false;
    std::string name, location;
    const uint8_t* q = p;
    while (q < end) {  // data_location (14) is a varint, so this loop reads every wire type itself
      uint64_t tag, n;
      if (!varint(q, end, tag)) broken("truncated field tag");
      int field = int(tag >> 3), wire = int(tag & 7);
      if (wire == 0) {
        if (!varint(q, end, n)) broken("truncated varint");
        if (field == 14) external = n == 1;
      } else if (wire == 1 || wire == 5) {
        size_t width = wire == 1 ? 8 : 4;
        if (size_t(end - q) < width) broken("truncated fixed field");
        q += width;
      } else if (wire == 2) {
        if (!varint(q, end, n) || n > uint64_t(end - q)) broken("truncated length-delimited field");
        if (field == 8) name.assign(reinterpret_cast<const char*>(q), size_t(n));
        if (field == 13) entry(q, q + n, depth + 1, location);
        q += n;
      } else {
        broken("unsupported wire type " + std::to_string(wire));
      }
    }
    if (!external) return;
    Value v;
    v.kind = Value::kString;
    v.string = location;
    Schema(bundle_).path(v, graph_file_ + " external data of '" + name + "'");
    std::string rel = base_ + location;
    if (!listed_.count(rel)) {
      bundle_error(bundle_ + ": " + graph_file_ + " reads external data from " + rel +
                   ", which the manifest does not list");
    }
  }

  // StringStringEntryProto {key = 1, value = 2}: keep the value of "location".
  void entry(const uint8_t* p, const uint8_t* end, int depth, std::string& location) {
    std::string key, value;
    each(p, end, depth, [&](int f, const uint8_t* a, const uint8_t* b, int) {
      if (f == 1) key.assign(reinterpret_cast<const char*>(a), size_t(b - a));
      if (f == 2) value.assign(reinterpret_cast<const char*>(a), size_t(b - a));
    });
    if (key == "location") location = value;
  }
};

std::string read_file(const std::string& path, int64_t size) {
  std::ifstream f(path, std::ios::binary);
  std::string data(size_t(size), '\0');
  if (!f.read(&data[0], size)) return std::string();
  return data;
}

}  // namespace

const TensorSpec* Manifest::input(const std::string& name) const {
  for (const auto& v : inputs) {
    if (v.name == name) return &v;
  }
  return nullptr;
}

const TensorSpec* Manifest::output(const std::string& name) const {
  for (const auto& v : outputs) {
    if (v.name == name) return &v;
  }
  return nullptr;
}

const std::string* Manifest::bound_input(const std::string& out) const {
  for (const auto& b : bindings) {
    if (b.first == out) return &b.second;
  }
  return nullptr;
}

bool Manifest::is_in_place(const std::string& out) const {
  for (const auto& name : in_place) {
    if (name == out) return true;
  }
  return false;
}

Manifest read_bundle(const std::string& bundle, bool verify) {
  // The manifest itself: a regular file of bounded size, valid JSON, this host's format.
  std::string path = bundle + "/" + kManifest;
  struct stat info {};
  if (lstat(path.c_str(), &info) != 0) {
    bundle_error(bundle + " is not a specgraph bundle (no " + kManifest + "); create one with `specgraph compile`");
  }
  if (!S_ISREG(info.st_mode)) bundle_error(path + " is not a regular file (a symbolic link or a folder)");
  if (info.st_size > kMaxManifestBytes) {
    bundle_error(path + " is " + with_commas(info.st_size) + " bytes; a manifest is at most " +
                 with_commas(kMaxManifestBytes));
  }
  Value doc;
  try {
    doc = json::parse(read_file(path, info.st_size));
  } catch (const std::invalid_argument& e) {
    bundle_error(path + " is not valid JSON: " + e.what());
  }
  const Value* version = doc.find("format_version");
  if (!version || version->kind != Value::kNumber || !version->is_int || version->integer != kFormatVersion) {
    bundle_error(bundle + " has bundle format " + (version ? json::show(*version, 40) : "None") +
                 "; this host reads " + std::to_string(kFormatVersion) + ": recompile it");
  }

  // The schema of every key the host reads.
  Schema s(bundle);
  Manifest m;
  m.bundle = bundle;
  s.object(doc, "(top level)");
  m.max_context = s.integer(s.get(doc, "max_context", "max_context"), "max_context", 16, kMaxContext);
  m.vocab_size = s.integer(s.get(doc, "vocab_size", "vocab_size"), "vocab_size", 1, kMaxVocab);
  const Value& eos = s.list(s.get(doc, "eos_token_ids", "eos_token_ids"), "eos_token_ids", 64);
  for (size_t i = 0; i < eos.items.size(); ++i) {
    std::string key = "eos_token_ids[" + std::to_string(i) + "]";
    int64_t id = s.integer(eos.items[i], key, 0, kMaxVocab - 1);
    if (id >= m.vocab_size) s.bad(key, "an id below vocab_size " + std::to_string(m.vocab_size), &eos.items[i]);
    m.eos_token_ids.push_back(id);
  }
  const Value* sampling = doc.find("sampling");
  if (sampling && !sampling->is_null()) {
    s.object(*sampling, "sampling");
    m.sampling = true;
  }
  if (const Value* w = doc.find("weights"); w && w->kind == Value::kObject) {
    const Value* kernels = w->find("kernels");
    m.native_kernels = kernels && kernels->kind == Value::kString && kernels->string == "native";
  }
  const Value& graph = s.object(s.get(doc, "graph", "graph"), "graph");
  m.graph_file = s.path(s.get(graph, "file", "graph.file"), "graph.file");
  std::string weights;
  if (const Value* w = graph.find("weights"); w && !w->is_null()) weights = s.path(*w, "graph.weights");
  m.inputs = values(s, s.get(graph, "inputs", "graph.inputs"), "graph.inputs");
  m.outputs = values(s, s.get(graph, "outputs", "graph.outputs"), "graph.outputs");
  m.bindings = pairs(s, s.get(graph, "bindings", "graph.bindings"), "graph.bindings", 4096);
  m.trims = pairs(s, s.get(graph, "trims", "graph.trims"), "graph.trims", 64);
  m.state = names(s, s.get(graph, "state", "graph.state"), "graph.state");
  m.in_place = names(s, s.get(graph, "in_place", "graph.in_place"), "graph.in_place");
  for (const auto& c : s.map(s.get(graph, "constants", "graph.constants"), "graph.constants", 64).members) {
    m.constants.push_back(constant(s, c.first, c.second, "graph.constants." + key_of(c.first)));
  }
  m.extra_slots = s.integer(s.get(graph, "extra_slots", "graph.extra_slots"), "graph.extra_slots", 0, 4096);

  // Cross-key rules: bindings, trims, in-place outputs, state and constants name real values.
  for (const auto& b : m.bindings) {
    if (!m.output(b.first) || !m.input(b.second)) {
      Value v;
      v.kind = Value::kString;
      v.string = b.second;
      s.bad("graph.bindings." + key_of(b.first), "an output name bound to an input name", &v);
    }
  }
  for (const auto& t : m.trims) {
    if (!m.bound_input(t.first) || !m.output(t.second)) {
      Value v;
      v.kind = Value::kString;
      v.string = t.second;
      s.bad("graph.trims." + key_of(t.first), "a bound output trimmed by an output count", &v);
    }
  }
  for (const auto& name : m.in_place) {
    const std::string* in = m.bound_input(name);
    bool state = false;
    for (const auto& st : m.state) state = state || (in && st == *in);
    if (!state) {
      Value v;
      v.kind = Value::kString;
      v.string = name;
      s.bad("graph.in_place", "outputs bound to state inputs", &v);
    }
  }
  for (const auto& name : m.state) {
    const TensorSpec* in = m.input(name);
    bool fixed = in && !in->dims.empty() && dtype_size(in->dtype);
    int64_t width = 1;
    for (size_t d = 1; fixed && d < in->dims.size(); ++d) {
      fixed = in->dims[d] >= 1;
      width *= fixed ? in->dims[d] : 1;
      fixed = fixed && width <= m.max_context * kMaxKvWidth;
    }
    if (!fixed) {
      Value v;
      v.kind = Value::kString;
      v.string = name;
      s.bad("graph.state", "inputs of fixed dimensions after the batch, that fit max_context", &v);
    }
  }
  for (const auto& c : m.constants) {
    if (!m.input(c.name)) {
      Value v;
      v.kind = Value::kString;
      v.string = c.name;
      s.bad("graph.constants", "input names", &v);
    }
  }

  // Files: confined, data only, regular, of the recorded size (all checked before any is hashed).
  const Value& files = s.map(s.get(doc, "files", "files"), "files", kMaxFiles);
  if (files.members.empty()) s.bad("files", "at least one file (the manifest lists what it verifies)", &files);
  std::set<std::string> listed;
  std::vector<std::pair<std::string, int64_t>> sizes;
  std::vector<std::string> digests;
  for (const auto& f : files.members) {
    Value key;
    key.kind = Value::kString;
    key.string = f.first;
    s.path(key, "files entry " + json::show(key));
    std::string at = "files." + key_of(f.first);
    s.object(f.second, at);
    int64_t size = s.integer(s.get(f.second, "size", at + ".size"), at + ".size", 0, int64_t(1) << 50);
    const Value& digest = s.get(f.second, "sha256", at + ".sha256");
    bool hex = digest.kind == Value::kString && digest.string.size() == 64;
    for (char c : hex ? digest.string : std::string()) hex = hex && ((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'));
    if (!hex) s.bad(at + ".sha256", "a sha256 in lowercase hex", &digest);
    listed.insert(f.first);
    sizes.emplace_back(f.first, size);
    digests.push_back(digest.string);
  }
  for (const auto& [rel, size] : sizes) {
    if (!has_data_suffix(rel)) {
      bundle_error(bundle + ": the manifest lists " + rel + ", which is not a data file; a bundle never carries code");
    }
    if (rel == kManifest) bundle_error(bundle + ": the manifest lists itself");
    struct stat st = lstat_inside(bundle, rel);
    if (!S_ISREG(st.st_mode)) bundle_error(bundle + ": " + rel + " is not a regular file");
    if (st.st_size != size) {
      bundle_error(bundle + ": " + rel + " has " + with_commas(st.st_size) + " bytes, the manifest says " +
                   with_commas(size) + "; recompile the bundle");
    }
  }
  for (const auto& [key, rel] : {std::make_pair(std::string("graph.file"), m.graph_file),
                                 std::make_pair(std::string("graph.weights"), weights)}) {
    if (!rel.empty() && !listed.count(rel)) {
      bundle_error(bundle + ": " + key + " " + rel + " is not listed in the manifest's files, so it cannot be verified");
    }
  }
  int64_t graph_size = 0;
  for (const auto& [rel, size] : sizes) graph_size = rel == m.graph_file ? size : graph_size;
  std::string model = read_file(bundle + "/" + m.graph_file, graph_size);
  if (int64_t(model.size()) != graph_size) bundle_error(bundle + ": cannot read " + m.graph_file);
  const auto* bytes = reinterpret_cast<const uint8_t*>(model.data());
  ProtoWalk(bundle, m.graph_file, listed).model(bytes, bytes + model.size());
  if (verify) {
    for (size_t i = 0; i < sizes.size(); ++i) {
      if (sha256_file(bundle + "/" + sizes[i].first, uint64_t(sizes[i].second)) != digests[i]) {
        bundle_error(bundle + ": " + sizes[i].first + " fails its sha256 checksum (corrupted or edited); recompile the bundle");
      }
    }
  }
  return m;
}

}  // namespace sg
