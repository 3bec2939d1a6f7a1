// specgraph's ONNX Runtime operator library: `specgraph.BlockMatMul`, the block product of
// block_matmul.h as one node, `specgraph.CachedAttention`, attention.h's cached attention,
// `specgraph.CopySlots`, a drafter's cache fill, and `specgraph.LookupRound`, adaptive prompt
// lookup's round (lookup.h). ONNX Runtime loads it with
// RegisterCustomOpsLibrary (Python: SessionOptions.register_custom_ops_library), which calls
// RegisterCustomOps below.
//
//   BlockMatMul(x [..., K], high uint8 [N, K/block, block/2], d [ceil(N/16), K/block, 16],
//               m (d's shape, optional), low uint8 [N, K/block, block/2] (optional),
//               norm float [K] (optional), addend (y's shape, optional),
//               one_row uint8 [ceil(N/8), K, 4] (optional))
//     -> y [..., N]           attributes: K, N, block_size, activation_bits, glu, norm_epsilon
// With norm, x is RMS-normalised first (x / sqrt(mean(x^2) + norm_epsilon) * norm); with glu = 1,
// x is [..., 2K] and the product takes silu(x[..., :K]) * x[..., K:]; with addend, y = x' @ W^T +
// addend, the Add it replaces, to the bit. exporters/native_fusion.py fuses the graph's nodes so.
// (high may instead be lanes, uint8 [ceil(N/8), K, 4]: 8 outputs' codes a 32-bit lane, no low digit;
// with lane_bits = 8, wide lanes [ceil(N/4), K, 4] of 8-bit codes, 4 outputs a lane; or, one digit in
// blocks of 32 at activation_bits 8 or 24 only, quads [ceil(N/16), K/32, 256]; or, 8-bit codes in
// blocks of 32 at activation_bits 24 only, byte quads [ceil(N/16), K/32, 512], block_matmul.h)
// one_row: high's one-digit codes again, in lanes, which a call of one row reads instead (lanes are
// faster for one row, pairs for several on AVX2, and both round alike, to the bit: a speculative
// engine's one-token rounds then cost what a `none` engine's steps do; float32 activations only).
// With AVX-512 lanes are faster at every row count, and every call reads them (lanes_are_faster).
// activation_bits: 32 (the default) multiplies x as it is; 8 quantises x to int8 per block of 32
// first (block_size 32, pairs or quads); 24 writes x as four int8 digits per block of 32, float32's
// precision, and multiplies them in integers (block_size 32, quads only; block_matmul.h, digits).
//
// d and m are both float32 or both float16 (block_matmul.h).
//
//   CachedAttention(q [B, T, H*D], k [B, T, Hkv*D], v (k's shape), past_key [B, Hkv, S, D],
//                   past_value (its shape), seqlens int32 [B], cos [B, T, D/2], sin (cos's shape))
//     -> out [B, T, H*D], present_key, present_value    attributes: num_heads, kv_num_heads, scale
// k and v may both be left out: q is then [B, T, (H + 2 Hkv) D], each token's queries, keys and
// values one after the other (the fused Q/K/V projection's output, read without a Split).
//
// GroupQueryAttention's inputs (seqlens[b] = the row's write position + T - 1), with the rotary
// caches of the two RotaryEmbedding nodes it replaces. present_* are past_* with this call's keys
// and values written: in place when the host binds them onto past_* (it does), else a copy of the
// slots before each row's write position (the slots after the call's are then undefined).
// present_key and present_value may both be left out: the call's keys and values are then written
// into past_key and past_value themselves, which the graph must allow (exporters/attention.py does
// it only for a drafter's later runs, whose writes are scratch past what anything else reads).
//
//   CopySlots(cache_len int64 [B], tokens int64 [B, T], source_1, cache_1, ..., source_N, cache_N)
//     -> cache_1', ..., cache_N'        (each source and its cache float [B, Hkv, S, D] alike)
// cache_i with the T slots from each row's cache_len copied from source_i: the fill of a skipped
// drafter's caches from the target's (exporters/gate.py), one node where ONNX takes two a cache;
// in place when the host binds cache_i' onto cache_i (it does), else a copy of cache_i first.
//
//   LookupRound(history int64 [B, L], tokens int64 [B, T], cache_len int64 [B], bonus int64 [B, 1],
//               cache_len_out int64 [B], lookup_stats float [B, N, 2], lookup_last int64 [B, 3],
//               lookup_cost float [K + 1])
//     -> next_tokens [B, 1 + K], history', lookup_stats', lookup_last', n_draft [B]
//                        attributes: num_draft (K), max_ngram (N), decay, prior_weight, first_rate
// Adaptive prompt lookup's round (lookup.h): the drafts and the state for the next call, one node
// where the graph of specgraph/methods/lookup.py takes about 200. The state outputs are written in
// place when the host binds them onto the inputs (it does), else copies first.
//
// As host/src/ort_api.h does, the C API is declared here from its documented ABI (the table's
// indices and OrtCustomOp's fields), so no ONNX Runtime header is needed to build it.
#include <climits>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "../ort_table.h"
#include "attention.h"
#include "block_matmul.h"
#include "lookup.h"

namespace {

struct OrtStatus;
struct OrtValue;
struct OrtKernelInfo;
struct OrtKernelContext;
struct OrtSessionOptions;
struct OrtCustomOpDomain;
struct OrtShapeInfo;  // OrtTensorTypeAndShapeInfo
using sg::ort::ApiBase;
using sg::ort::Fn;
using sg::ort::take;

constexpr int kAny = 0, kFloat = 1, kUint8 = 2, kInt32 = 6, kInt64 = 7, kHalf = 10;  // ONNXTensorElementDataType
constexpr int kRequired = 0, kOptional = 1, kVariadic = 2;  // OrtCustomOpInputOutputCharacteristic
constexpr int kInvalidArgument = 2, kFail = 1;         // OrtErrorCode
constexpr uint32_t kApiVersion = 17;                   // ONNX Runtime 1.17: the first with slot 274

// The slots of ONNX Runtime's API table this library calls (index: signature).
struct Api {
  OrtStatus* (*CreateStatus)(int code, const char* message);                                      // 0
  OrtStatus* (*CreateCustomOpDomain)(const char* domain, OrtCustomOpDomain** out);                // 26
  OrtStatus* (*CustomOpDomain_Add)(OrtCustomOpDomain*, const void* op);                           // 27
  OrtStatus* (*AddCustomOpDomain)(OrtSessionOptions*, OrtCustomOpDomain*);                        // 28
  OrtStatus* (*GetTensorMutableData)(OrtValue*, void** out);                                      // 51
  OrtStatus* (*GetTensorElementType)(const OrtShapeInfo*, int* out);                              // 60
  OrtStatus* (*GetDimensionsCount)(const OrtShapeInfo*, size_t* out);                             // 61
  OrtStatus* (*GetDimensions)(const OrtShapeInfo*, int64_t* out, size_t n);                       // 62
  OrtStatus* (*GetTensorTypeAndShape)(const OrtValue*, OrtShapeInfo** out);                       // 65
  OrtStatus* (*KernelInfoGetAttribute_float)(const OrtKernelInfo*, const char* name, float* out);  // 85
  OrtStatus* (*KernelInfoGetAttribute_int64)(const OrtKernelInfo*, const char* name, int64_t* out);  // 86
  OrtStatus* (*KernelContext_GetInputCount)(const OrtKernelContext*, size_t* out);               // 88
  OrtStatus* (*KernelContext_GetOutputCount)(const OrtKernelContext*, size_t* out);              // 89
  OrtStatus* (*KernelContext_GetInput)(const OrtKernelContext*, size_t i, const OrtValue** out);  // 90
  OrtStatus* (*KernelContext_GetOutput)(OrtKernelContext*, size_t i, const int64_t* dims, size_t n,
                                        OrtValue** out);                                          // 91
  void (*ReleaseStatus)(OrtStatus*);                                                              // 93
  void (*ReleaseShapeInfo)(OrtShapeInfo*);                                                        // 99
  OrtStatus* (*KernelContext_ParallelFor)(const OrtKernelContext*, void (*fn)(void*, size_t), size_t total,
                                          size_t num_batch, void* data);                          // 274
};

Api g_api{};

// OrtCustomOp, field for field; ONNX Runtime reads the fields that `version` has.
struct CustomOp {
  uint32_t version;
  void* (*CreateKernel)(const CustomOp*, const void* api, const OrtKernelInfo*);
  const char* (*GetName)(const CustomOp*);
  const char* (*GetExecutionProviderType)(const CustomOp*);
  int (*GetInputType)(const CustomOp*, size_t);
  size_t (*GetInputTypeCount)(const CustomOp*);
  int (*GetOutputType)(const CustomOp*, size_t);
  size_t (*GetOutputTypeCount)(const CustomOp*);
  void (*KernelCompute)(void*, OrtKernelContext*);
  void (*KernelDestroy)(void*);
  int (*GetInputCharacteristic)(const CustomOp*, size_t);
  int (*GetOutputCharacteristic)(const CustomOp*, size_t);
  int (*GetInputMemoryType)(const CustomOp*, size_t);
  int (*GetVariadicInputMinArity)(const CustomOp*);
  int (*GetVariadicInputHomogeneity)(const CustomOp*);
  int (*GetVariadicOutputMinArity)(const CustomOp*);
  int (*GetVariadicOutputHomogeneity)(const CustomOp*);
  OrtStatus* (*CreateKernelV2)(const CustomOp*, const void* api, const OrtKernelInfo*, void** kernel);
  OrtStatus* (*KernelComputeV2)(void*, OrtKernelContext*);
  OrtStatus* (*InferOutputShapeFn)(const CustomOp*, void*);
  int (*GetStartVersion)(const CustomOp*);
  int (*GetEndVersion)(const CustomOp*);
  size_t (*GetMayInplace)(int**, int**);
  void (*ReleaseMayInplace)(int*, int*);
  size_t (*GetAliasMap)(int**, int**);
  void (*ReleaseAliasMap)(int*, int*);
};

// An error status from ONNX Runtime's own call, passed on; or nullptr.
#define SG_TRY(call)                  \
  do {                                \
    OrtStatus* status_ = (call);      \
    if (status_) return status_;      \
  } while (0)

OrtStatus* fail(const std::string& message, const char* op = "BlockMatMul") {
  return g_api.CreateStatus(kInvalidArgument, ("specgraph." + std::string(op) + ": " + message).c_str());
}

OrtStatus* shape_of(const OrtValue* value, std::vector<int64_t>& dims, int* type = nullptr) {
  OrtShapeInfo* info = nullptr;
  SG_TRY(g_api.GetTensorTypeAndShape(value, &info));
  size_t n = 0;
  OrtStatus* status = type ? g_api.GetTensorElementType(info, type) : nullptr;
  if (!status) status = g_api.GetDimensionsCount(info, &n);
  if (!status) {
    dims.assign(n, 0);
    status = g_api.GetDimensions(info, dims.data(), n);
  }
  g_api.ReleaseShapeInfo(info);
  return status;
}

template <typename T>
OrtStatus* data_of(const OrtValue* value, const T** out) {
  void* p = nullptr;
  SG_TRY(g_api.GetTensorMutableData(const_cast<OrtValue*>(value), &p));
  *out = static_cast<const T*>(p);
  return nullptr;
}

// A kernel's creation: hand it to ONNX Runtime, or delete it and pass the error on.
template <typename K>
OrtStatus* created(K* kernel, OrtStatus* status, void** out) {
  if (status) {
    delete kernel;
    return status;
  }
  *out = kernel;
  return nullptr;
}

struct Kernel {
  int64_t k = 0, n = 0, block = 0;
  bool int8 = false;  // activation_bits 8
  bool digits = false;  // activation_bits 24
  bool glu = false;   // x holds a SwiGLU's gate and up halves
  bool wide = false;  // lane_bits 8: the codes are wide lanes
  float epsilon = 0.0f;  // the RMS norm's, when a norm input is given
};

// One parallel call: outputs split into tiles that ONNX Runtime's intra-op threads share.
struct Job {
  const sg::kernels::BlockWeights* weights;
  const sg::kernels::PreparedInput* input;
  float* y;
  int64_t tile;
  const float* addend;  // y's shape, or nullptr
};

void run_tile(void* data, size_t index) {
  const Job& job = *static_cast<const Job*>(data);
  const int64_t n = job.weights->n;
  const int64_t begin = static_cast<int64_t>(index) * job.tile;
  const int64_t end = begin + job.tile < n ? begin + job.tile : n;
  sg::kernels::block_matmul(*job.weights, *job.input, job.y, begin, end);
  if (job.addend) {
    for (int64_t r = 0; r < job.input->rows; ++r)
      for (int64_t i = r * n + begin; i < r * n + end; ++i) job.y[i] = job.addend[i] + job.y[i];
  }
}

OrtStatus* compute(void* kernel_ptr, OrtKernelContext* context) {
  const Kernel& kernel = *static_cast<const Kernel*>(kernel_ptr);
  const OrtValue* in[8] = {};
  for (size_t i = 0; i < 8; ++i) SG_TRY(g_api.KernelContext_GetInput(context, i, &in[i]));
  std::vector<int64_t> x_dims, high_dims, scale_dims, offset_dims, norm_dims, addend_dims, one_row_dims;
  int scale_type = 0, offset_type = 0;
  SG_TRY(shape_of(in[0], x_dims));
  SG_TRY(shape_of(in[1], high_dims));
  SG_TRY(shape_of(in[2], scale_dims, &scale_type));
  if (in[3]) SG_TRY(shape_of(in[3], offset_dims, &offset_type));
  const int64_t nb = kernel.k / kernel.block, half = kernel.block / 2;
  if (x_dims.empty() || x_dims.back() != (kernel.glu ? 2 * kernel.k : kernel.k)) {
    return fail(kernel.glu ? "input's last dimension is not 2K (glu)" : "input's last dimension is not K");
  }
  if (in[5]) {
    SG_TRY(shape_of(in[5], norm_dims));
    if (kernel.glu || norm_dims != std::vector<int64_t>{kernel.k}) return fail("norm is not [K], or comes with glu");
  }
  const int64_t per_lane = kernel.wide ? sg::kernels::kLaneOutputs / 2 : sg::kernels::kLaneOutputs;
  const int64_t lane_tiles = (kernel.n + per_lane - 1) / per_lane;
  const bool lanes = high_dims == std::vector<int64_t>{lane_tiles, kernel.k, 4};
  const int64_t tile = sg::kernels::kScaleTile;
  const bool quads = !lanes && high_dims == std::vector<int64_t>{(kernel.n + tile - 1) / tile, nb, sg::kernels::kQuadBytes};
  const bool byte_quads =
      !lanes && high_dims == std::vector<int64_t>{(kernel.n + tile - 1) / tile, nb, sg::kernels::kByteQuadBytes};
  if (byte_quads && (!kernel.digits || kernel.block != sg::kernels::kInt8Block || in[4] || in[7])) {
    return fail("byte quads hold 8-bit codes in blocks of 32 at activation_bits 24");
  }
  if (quads && (!(kernel.int8 || kernel.digits) || kernel.block != sg::kernels::kInt8Block || in[4] || in[7])) {
    return fail("quads hold one digit in blocks of 32 at activation_bits 8 or 24");
  }
  if (kernel.digits && !quads && !byte_quads) {
    return fail("activation_bits 24 reads quads [ceil(N/16), K/32, 256] or byte quads [ceil(N/16), K/32, 512]");
  }
  if (kernel.wide && !lanes) return fail("lane_bits 8: the codes are not wide lanes [ceil(N/4), K, 4]");
  if (!lanes && !quads && !byte_quads && (high_dims.size() != 3 || high_dims[0] != kernel.n || high_dims[1] != nb || high_dims[2] != half)) {
    return fail("packed codes are neither [N, K/block, block/2], lanes [ceil(N/8), K, 4] nor quads [ceil(N/16), K/32, 256]");
  }
  if (lanes && in[4]) return fail("lanes hold one digit: a low digit cannot go with them");
  if (lanes && kernel.int8) return fail("int8 activations take the pairs layout, not lanes");
  if (in[7]) {  // the same one-digit codes again in lanes, for calls of one row (a speculative engine's)
    SG_TRY(shape_of(in[7], one_row_dims));
    if (lanes || in[4] || kernel.int8 || kernel.wide ||
        one_row_dims != std::vector<int64_t>{(kernel.n + sg::kernels::kLaneOutputs - 1) / sg::kernels::kLaneOutputs,
                                             kernel.k, 4}) {
      return fail("one-row lanes go with one digit in pairs at float32 activations, as [ceil(N/8), K, 4]");
    }
  }
  const std::vector<int64_t> scales_shape{(kernel.n + tile - 1) / tile, nb, tile};
  if (scale_dims != scales_shape || (in[3] && offset_dims != scales_shape)) {
    return fail("d or m is not [ceil(N/16), K/block, 16]");
  }
  if ((scale_type != kFloat && scale_type != kHalf) || (in[3] && offset_type != scale_type)) {
    return fail("d and m must both be float32 or both float16");
  }
  int64_t rows = 1;
  for (size_t i = 0; i + 1 < x_dims.size(); ++i) rows *= x_dims[i];
  // lanes round as pairs do, to the bit: any call agrees
  const bool one_row = in[7] && sg::kernels::lanes_are_faster(rows);

  sg::kernels::BlockWeights w;
  w.n = kernel.n;
  w.k = kernel.k;
  w.block = kernel.block;
  const float* x = nullptr;
  SG_TRY(data_of(in[0], &x));
  SG_TRY(data_of(in[one_row ? 7 : 1], &w.high));
  SG_TRY(data_of(in[2], &w.scale));
  if (in[3]) SG_TRY(data_of(in[3], &w.offset));
  w.half = scale_type == kHalf;
  w.lanes = lanes || one_row;
  w.quads = quads || byte_quads;
  w.wide = kernel.wide || byte_quads;
  if (in[4]) SG_TRY(data_of(in[4], &w.low));

  std::vector<int64_t> y_dims(x_dims);
  y_dims.back() = kernel.n;
  const float* addend = nullptr;
  if (in[6]) {
    SG_TRY(shape_of(in[6], addend_dims));
    if (addend_dims != y_dims) return fail("addend does not have the output's shape");
    SG_TRY(data_of(in[6], &addend));
  }
  OrtValue* out = nullptr;
  SG_TRY(g_api.KernelContext_GetOutput(context, 0, y_dims.data(), y_dims.size(), &out));
  float* y = nullptr;
  void* p = nullptr;
  SG_TRY(g_api.GetTensorMutableData(out, &p));
  y = static_cast<float*>(p);
  if (rows == 0) return nullptr;

  thread_local std::vector<float> before, paired, sums, steps;  // a session may run on several threads at once
  if (in[5] || kernel.glu) {  // the fused norm or SwiGLU: x' [rows, K]
    before.resize(static_cast<size_t>(rows * kernel.k));
    if (kernel.glu) {
      sg::kernels::gated_silu(x, rows, kernel.k, before.data());
    } else {
      const float* scale = nullptr;
      SG_TRY(data_of(in[5], &scale));
      sg::kernels::rms_norm(x, rows, kernel.k, scale, kernel.epsilon, before.data());
    }
    x = before.data();
  }
  thread_local std::vector<int8_t> codes;
  thread_local std::vector<int32_t> centred;
  thread_local std::vector<int64_t> whole;
  sums.resize(static_cast<size_t>(rows * nb));
  sg::kernels::PreparedInput prepared{rows, nullptr, sums.data()};
  int64_t outputs = 16;  // a parallel task's
  if (kernel.digits) {
    codes.resize(static_cast<size_t>(rows * nb * sg::kernels::kDigits * sg::kernels::kInt8Block));
    steps.resize(static_cast<size_t>(rows * nb));
    whole.resize(static_cast<size_t>(rows * nb));
    sg::kernels::digit_input(x, rows, kernel.k, codes.data(), steps.data(), sums.data(), whole.data());
    prepared.digits = codes.data();
    prepared.whole = whole.data();
    prepared.steps = steps.data();
    outputs = 64;  // AMX's tile configuration is checked once a task
  } else if (kernel.int8) {
    const size_t pairs = static_cast<size_t>(rows * ((nb + 1) / 2));
    codes.resize(pairs * 64);
    steps.resize(pairs * 8);
    centred.resize(pairs * 8);
    sg::kernels::quantise_input(x, rows, kernel.k, in[4] ? 136 : 8, codes.data(), steps.data(), centred.data(),
                                sums.data());
    prepared.codes = codes.data();
    prepared.steps = steps.data();
    prepared.centred = centred.data();
  } else {
    paired.resize(static_cast<size_t>(rows * kernel.k));
    sg::kernels::prepare_input(x, rows, kernel.k, kernel.block, paired.data(), sums.data());
    prepared.paired = paired.data();
  }
  Job job{&w, &prepared, y, outputs, addend};
  const size_t tiles = static_cast<size_t>((kernel.n + job.tile - 1) / job.tile);
  return g_api.KernelContext_ParallelFor(context, run_tile, tiles, tiles < 8 ? tiles : 8, &job);
}

OrtStatus* create(const CustomOp*, const void*, const OrtKernelInfo* info, void** out) {
  auto* kernel = new Kernel();
  OrtStatus* status = g_api.KernelInfoGetAttribute_int64(info, "K", &kernel->k);
  if (!status) status = g_api.KernelInfoGetAttribute_int64(info, "N", &kernel->n);
  if (!status) status = g_api.KernelInfoGetAttribute_int64(info, "block_size", &kernel->block);
  if (!status && (kernel->block <= 0 || kernel->block % 16 || kernel->k % kernel->block || kernel->n <= 0)) {
    status = fail("block_size must be a positive multiple of 16 that divides K");
  }
  int64_t bits = 32;
  if (!status) {
    OrtStatus* absent = g_api.KernelInfoGetAttribute_int64(info, "activation_bits", &bits);
    if (absent) {  // not given: float32 activations
      g_api.ReleaseStatus(absent);
      bits = 32;
    }
    kernel->int8 = bits == 8;
    kernel->digits = bits == 24;
    if (bits != 8 && bits != 24 && bits != 32) status = fail("activation_bits must be 32, 24 or 8");
    int64_t lane_bits = 4;
    if (OrtStatus* absent = g_api.KernelInfoGetAttribute_int64(info, "lane_bits", &lane_bits)) g_api.ReleaseStatus(absent);
    kernel->wide = lane_bits == 8;
    if (lane_bits != 4 && lane_bits != 8) status = fail("lane_bits must be 4 or 8");
    int64_t glu = 0;
    if (OrtStatus* absent = g_api.KernelInfoGetAttribute_int64(info, "glu", &glu)) g_api.ReleaseStatus(absent);
    kernel->glu = glu == 1;
    if (glu != 0 && glu != 1) status = fail("glu must be 0 or 1");
    if (OrtStatus* absent = g_api.KernelInfoGetAttribute_float(info, "norm_epsilon", &kernel->epsilon)) {
      g_api.ReleaseStatus(absent);
      kernel->epsilon = 0.0f;
    }
    if ((kernel->int8 || kernel->digits) && kernel->block != sg::kernels::kInt8Block) {
      status = fail("activation_bits 8 and 24 take block_size 32");
    }
  }
  return created(kernel, status, out);
}

const char* name(const CustomOp*) { return "BlockMatMul"; }
const char* provider(const CustomOp*) { return "CPUExecutionProvider"; }
int input_type(const CustomOp*, size_t i) {
  return i == 1 || i == 4 || i == 7 ? kUint8 : i == 0 || i >= 5 ? kFloat : kAny;
}
size_t input_count(const CustomOp*) { return 8; }
int output_type(const CustomOp*, size_t) { return kFloat; }
size_t output_count(const CustomOp*) { return 1; }
int input_kind(const CustomOp*, size_t i) { return i >= 3 ? kOptional : kRequired; }
int output_kind(const CustomOp*, size_t) { return kRequired; }
int memory_type(const CustomOp*, size_t) { return 0; }  // OrtMemTypeDefault
int one(const CustomOp*) { return 1; }
int zero(const CustomOp*) { return 0; }
int last_version(const CustomOp*) { return INT_MAX; }
size_t no_pairs(int** a, int** b) {
  *a = nullptr;
  *b = nullptr;
  return 0;
}
void release_pairs(int*, int*) {}
void destroy(void* kernel) { delete static_cast<Kernel*>(kernel); }

CustomOp make_op() {
  CustomOp op{};
  op.version = kApiVersion;
  op.GetName = name;
  op.GetExecutionProviderType = provider;
  op.GetInputType = input_type;
  op.GetInputTypeCount = input_count;
  op.GetOutputType = output_type;
  op.GetOutputTypeCount = output_count;
  op.KernelDestroy = destroy;
  op.GetInputCharacteristic = input_kind;
  op.GetOutputCharacteristic = output_kind;
  op.GetInputMemoryType = memory_type;
  op.GetVariadicInputMinArity = one;
  op.GetVariadicInputHomogeneity = zero;
  op.GetVariadicOutputMinArity = one;
  op.GetVariadicOutputHomogeneity = zero;
  op.CreateKernelV2 = create;
  op.KernelComputeV2 = compute;
  op.GetStartVersion = one;
  op.GetEndVersion = last_version;
  op.GetMayInplace = no_pairs;
  op.ReleaseMayInplace = release_pairs;
  op.GetAliasMap = no_pairs;
  op.ReleaseAliasMap = release_pairs;
  return op;
}

const CustomOp g_op = make_op();

// ---- CachedAttention ----

struct AttentionKernel {
  int64_t heads = 0, kv_heads = 0;
  float scale = 0.0f;
};

struct AttentionJob {
  const sg::kernels::AttentionShape* shape;
  const float *q, *cos, *sin, *keys, *values;
  const int64_t* write_pos;
  float* out;
};

void run_heads(void* data, size_t index) {
  const AttentionJob& j = *static_cast<const AttentionJob*>(data);
  const int64_t h = static_cast<int64_t>(index);
  sg::kernels::cached_attention(*j.shape, j.q, j.cos, j.sin, j.write_pos, j.keys, j.values, j.out, h, h + 1);
}

OrtStatus* attention_fail(const std::string& message) { return fail(message, "CachedAttention"); }

OrtStatus* attention_compute(void* kernel_ptr, OrtKernelContext* context) {
  const AttentionKernel& kernel = *static_cast<const AttentionKernel*>(kernel_ptr);
  const OrtValue* in[8] = {};
  std::vector<int64_t> dims[8];
  for (size_t i = 0; i < 8; ++i) {
    SG_TRY(g_api.KernelContext_GetInput(context, i, &in[i]));
    if (in[i]) SG_TRY(shape_of(in[i], dims[i]));
  }
  const bool packed = !in[1] && !in[2];  // q holds [q | k | v] of each token: one projection's output
  if ((!in[1] || !in[2]) && !packed) return attention_fail("k and v are both given or both left out (packed in q)");
  for (size_t i = 3; i < 8; ++i) {
    if (!in[i]) return attention_fail("only k and v may be left out");
  }
  if (dims[3].size() != 4 || dims[0].size() != 3) return attention_fail("past_key is not [B, Hkv, S, D] or q not [B, T, H*D]");
  sg::kernels::AttentionShape s;
  s.batch = dims[0][0];
  s.tokens = dims[0][1];
  s.heads = kernel.heads;
  s.kv_heads = kernel.kv_heads;
  s.slots = dims[3][2];
  s.head_dim = dims[3][3];
  s.scale = kernel.scale;
  const int64_t d = s.head_dim, half = d / 2;
  const std::vector<int64_t> q_shape{s.batch, s.tokens, s.heads * d}, kv_shape{s.batch, s.tokens, s.kv_heads * d};
  const std::vector<int64_t> cache{s.batch, s.kv_heads, s.slots, d}, rot{s.batch, s.tokens, half};
  const std::vector<int64_t> packed_shape{s.batch, s.tokens, (s.heads + 2 * s.kv_heads) * d};
  const bool qkv_ok = packed ? dims[0] == packed_shape : dims[0] == q_shape && dims[1] == kv_shape && dims[2] == kv_shape;
  if (d % 2 || !qkv_ok || dims[3] != cache || dims[4] != cache || dims[5] != std::vector<int64_t>{s.batch} ||
      dims[6] != rot || dims[7] != rot) {
    return attention_fail("inputs do not have the shapes [B, T, H*D], [B, T, Hkv*D] x2 (or one [B, T, (H + 2 Hkv) D]), "
                          "[B, Hkv, S, D] x2, [B], [B, T, D/2] x2");
  }
  s.q_stride = packed ? packed_shape[2] : s.heads * d;
  s.kv_stride = packed ? packed_shape[2] : s.kv_heads * d;
  const float *q = nullptr, *k = nullptr, *v = nullptr, *past_k = nullptr, *past_v = nullptr, *cos = nullptr,
              *sin = nullptr;
  const int32_t* seqlens = nullptr;
  SG_TRY(data_of(in[0], &q));
  if (packed) {
    k = q + s.heads * d;
    v = k + s.kv_heads * d;
  } else {
    SG_TRY(data_of(in[1], &k));
    SG_TRY(data_of(in[2], &v));
  }
  SG_TRY(data_of(in[3], &past_k));
  SG_TRY(data_of(in[4], &past_v));
  SG_TRY(data_of(in[5], &seqlens));
  SG_TRY(data_of(in[6], &cos));
  SG_TRY(data_of(in[7], &sin));
  std::vector<int64_t> write_pos(static_cast<size_t>(s.batch));
  for (int64_t b = 0; b < s.batch; ++b) {
    write_pos[b] = static_cast<int64_t>(seqlens[b]) + 1 - s.tokens;
    if (write_pos[b] < 0 || write_pos[b] + s.tokens > s.slots) return attention_fail("a row's tokens do not fit the cache");
  }
  size_t outputs = 0;
  SG_TRY(g_api.KernelContext_GetOutputCount(context, &outputs));
  if (outputs != 1 && outputs != 3) return attention_fail("present_key and present_value are both given or both left out");
  OrtValue* outs[3] = {};
  SG_TRY(g_api.KernelContext_GetOutput(context, 0, q_shape.data(), q_shape.size(), &outs[0]));
  float* ptr[3] = {nullptr, const_cast<float*>(past_k), const_cast<float*>(past_v)};  // left out: write the pasts
  for (size_t i = 0; i < outputs; ++i) {
    if (i) SG_TRY(g_api.KernelContext_GetOutput(context, i, cache.data(), cache.size(), &outs[i]));
    void* p = nullptr;
    SG_TRY(g_api.GetTensorMutableData(outs[i], &p));
    ptr[i] = static_cast<float*>(p);
  }
  // Not bound in place (a draft model's run feeding the next one): copy the slots before each
  // row's write position, all that this call or a later one reads, as GroupQueryAttention does.
  for (int64_t b = 0; b < s.batch; ++b) {
    for (int64_t g = 0; g < s.kv_heads; ++g) {
      const size_t at = static_cast<size_t>((b * s.kv_heads + g) * s.slots * d);
      const size_t floats = static_cast<size_t>(write_pos[b] * d);
      if (ptr[1] != past_k) std::memcpy(ptr[1] + at, past_k + at, floats * sizeof(float));
      if (ptr[2] != past_v) std::memcpy(ptr[2] + at, past_v + at, floats * sizeof(float));
    }
  }
  sg::kernels::write_cache(s, k, v, cos, sin, write_pos.data(), ptr[1], ptr[2]);
  AttentionJob job{&s, q, cos, sin, ptr[1], ptr[2], write_pos.data(), ptr[0]};
  const size_t units = static_cast<size_t>(s.batch * s.heads);
  int64_t longest = 0;
  for (int64_t b = 0; b < s.batch; ++b) longest = write_pos[b] > longest ? write_pos[b] : longest;
  if (s.batch * s.tokens * (longest + s.tokens) < 384) {  // a short step: waking a thread costs more
    sg::kernels::cached_attention(s, q, cos, sin, write_pos.data(), ptr[1], ptr[2], ptr[0], 0, s.batch * s.heads);
    return nullptr;
  }
  return g_api.KernelContext_ParallelFor(context, run_heads, units, units, &job);
}

OrtStatus* attention_create(const CustomOp*, const void*, const OrtKernelInfo* info, void** out) {
  auto* kernel = new AttentionKernel();
  OrtStatus* status = g_api.KernelInfoGetAttribute_int64(info, "num_heads", &kernel->heads);
  if (!status) status = g_api.KernelInfoGetAttribute_int64(info, "kv_num_heads", &kernel->kv_heads);
  if (!status) status = g_api.KernelInfoGetAttribute_float(info, "scale", &kernel->scale);
  if (!status && (kernel->heads <= 0 || kernel->kv_heads <= 0 || kernel->heads % kernel->kv_heads)) {
    status = attention_fail("num_heads must be a positive multiple of kv_num_heads");
  }
  return created(kernel, status, out);
}

const char* attention_name(const CustomOp*) { return "CachedAttention"; }
int attention_input_type(const CustomOp*, size_t i) { return i == 5 ? kInt32 : kFloat; }
size_t attention_input_count(const CustomOp*) { return 8; }
size_t attention_output_count(const CustomOp*) { return 3; }
int attention_input_kind(const CustomOp*, size_t i) { return i == 1 || i == 2 ? kOptional : kRequired; }
int attention_output_kind(const CustomOp*, size_t i) { return i ? kOptional : kRequired; }
void attention_destroy(void* kernel) { delete static_cast<AttentionKernel*>(kernel); }

CustomOp make_attention_op() {
  CustomOp op = make_op();
  op.GetName = attention_name;
  op.GetInputType = attention_input_type;
  op.GetInputTypeCount = attention_input_count;
  op.GetOutputTypeCount = attention_output_count;
  op.GetInputCharacteristic = attention_input_kind;
  op.GetOutputCharacteristic = attention_output_kind;
  op.KernelDestroy = attention_destroy;
  op.CreateKernelV2 = attention_create;
  op.KernelComputeV2 = attention_compute;
  return op;
}

const CustomOp g_attention_op = make_attention_op();

// ---- CopySlots ----

OrtStatus* slots_fail(const std::string& message) { return fail(message, "CopySlots"); }

OrtStatus* slots_compute(void*, OrtKernelContext* context) {
  const OrtValue *at = nullptr, *tokens = nullptr;
  SG_TRY(g_api.KernelContext_GetInput(context, 0, &at));
  SG_TRY(g_api.KernelContext_GetInput(context, 1, &tokens));
  std::vector<int64_t> at_dims, token_dims;
  SG_TRY(shape_of(at, at_dims));
  SG_TRY(shape_of(tokens, token_dims));
  size_t inputs = 0, outputs = 0;
  SG_TRY(g_api.KernelContext_GetInputCount(context, &inputs));
  SG_TRY(g_api.KernelContext_GetOutputCount(context, &outputs));
  if (token_dims.size() != 2 || at_dims != std::vector<int64_t>{token_dims[0]})
    return slots_fail("cache_len is not [B] or tokens not [B, T]");
  if (inputs != 2 + 2 * outputs) return slots_fail("it takes a (source, cache) pair of inputs for each output");
  const int64_t batch = token_dims[0], count = token_dims[1];
  const int64_t* starts = nullptr;
  SG_TRY(data_of(at, &starts));
  for (size_t i = 0; i < outputs; ++i) {
    const OrtValue *source = nullptr, *cache = nullptr;
    SG_TRY(g_api.KernelContext_GetInput(context, 2 + 2 * i, &source));
    SG_TRY(g_api.KernelContext_GetInput(context, 3 + 2 * i, &cache));
    std::vector<int64_t> dims, cache_dims;
    SG_TRY(shape_of(source, dims));
    SG_TRY(shape_of(cache, cache_dims));
    if (dims.size() != 4 || dims != cache_dims || dims[0] != batch)
      return slots_fail("a source and its cache are not both [B, Hkv, S, D] alike");
    OrtValue* out = nullptr;
    SG_TRY(g_api.KernelContext_GetOutput(context, i, dims.data(), dims.size(), &out));
    void* raw = nullptr;
    SG_TRY(g_api.GetTensorMutableData(out, &raw));
    float* to = static_cast<float*>(raw);
    const float *from = nullptr, *past = nullptr;
    SG_TRY(data_of(source, &from));
    SG_TRY(data_of(cache, &past));
    const int64_t heads = dims[1], slots = dims[2], d = dims[3];
    if (to != past) std::memcpy(to, past, static_cast<size_t>(batch * heads * slots * d) * sizeof(float));
    for (int64_t b = 0; b < batch; ++b) {
      const int64_t begin = starts[b];
      if (begin < 0 || begin + count > slots) return slots_fail("a row's slots do not fit the cache");
      for (int64_t h = 0; h < heads; ++h) {
        const size_t offset = static_cast<size_t>(((b * heads + h) * slots + begin) * d);
        std::memcpy(to + offset, from + offset, static_cast<size_t>(count * d) * sizeof(float));
      }
    }
  }
  return nullptr;
}

OrtStatus* slots_create(const CustomOp*, const void*, const OrtKernelInfo*, void** out) {
  *out = nullptr;  // no attributes, no state
  return nullptr;
}

const char* slots_name(const CustomOp*) { return "CopySlots"; }
int slots_input_type(const CustomOp*, size_t i) { return i < 2 ? kInt64 : kFloat; }
size_t slots_input_count(const CustomOp*) { return 3; }
size_t slots_output_count(const CustomOp*) { return 1; }
int slots_input_kind(const CustomOp*, size_t i) { return i < 2 ? kRequired : kVariadic; }
int slots_output_kind(const CustomOp*, size_t) { return kVariadic; }
int slots_homogeneous(const CustomOp*) { return 1; }
int two(const CustomOp*) { return 2; }
void slots_destroy(void*) {}

CustomOp make_slots_op() {
  CustomOp op = make_op();
  op.GetName = slots_name;
  op.GetInputType = slots_input_type;
  op.GetInputTypeCount = slots_input_count;
  op.GetOutputTypeCount = slots_output_count;
  op.GetInputCharacteristic = slots_input_kind;
  op.GetOutputCharacteristic = slots_output_kind;
  op.GetVariadicInputMinArity = two;
  op.GetVariadicInputHomogeneity = slots_homogeneous;
  op.GetVariadicOutputHomogeneity = slots_homogeneous;
  op.KernelDestroy = slots_destroy;
  op.CreateKernelV2 = slots_create;
  op.KernelComputeV2 = slots_compute;
  return op;
}

const CustomOp g_slots_op = make_slots_op();

// ---- LookupRound ----

OrtStatus* lookup_fail(const std::string& message) { return fail(message, "LookupRound"); }

struct LookupKernel {
  int64_t num_draft = 0, max_ngram = 0;
  float decay = 0.0f, prior_weight = 0.0f, first_rate = 0.0f;
};

OrtStatus* lookup_compute(void* kernel_ptr, OrtKernelContext* context) {
  const LookupKernel& kernel = *static_cast<const LookupKernel*>(kernel_ptr);
  const OrtValue* in[8] = {};
  std::vector<int64_t> dims[8];
  for (size_t i = 0; i < 8; ++i) {
    SG_TRY(g_api.KernelContext_GetInput(context, i, &in[i]));
    SG_TRY(shape_of(in[i], dims[i]));
  }
  sg::kernels::LookupShape s;
  s.num_draft = kernel.num_draft;
  s.max_ngram = kernel.max_ngram;
  s.decay = kernel.decay;
  s.prior_weight = kernel.prior_weight;
  s.first_rate = kernel.first_rate;
  if (dims[0].size() != 2 || dims[1].size() != 2) return lookup_fail("history is not [B, L] or tokens not [B, T]");
  s.batch = dims[0][0];
  s.length = dims[0][1];
  s.tokens = dims[1][1];
  const std::vector<int64_t> rows{s.batch}, stats{s.batch, s.max_ngram, 2}, last{s.batch, 3};
  if (dims[1][0] != s.batch || dims[2] != rows || dims[3] != std::vector<int64_t>{s.batch, 1} || dims[4] != rows ||
      dims[5] != stats || dims[6] != last || dims[7] != std::vector<int64_t>{s.num_draft + 1}) {
    return lookup_fail("inputs do not have the shapes [B, L], [B, T], [B], [B, 1], [B], [B, N, 2], [B, 3], [K + 1]");
  }
  const int64_t *history = nullptr, *tokens = nullptr, *cache_len = nullptr, *bonus = nullptr, *cache_len_out = nullptr,
                *last_in = nullptr;
  const float *stats_in = nullptr, *cost = nullptr;
  SG_TRY(data_of(in[0], &history));
  SG_TRY(data_of(in[1], &tokens));
  SG_TRY(data_of(in[2], &cache_len));
  SG_TRY(data_of(in[3], &bonus));
  SG_TRY(data_of(in[4], &cache_len_out));
  SG_TRY(data_of(in[5], &stats_in));
  SG_TRY(data_of(in[6], &last_in));
  SG_TRY(data_of(in[7], &cost));
  const std::vector<int64_t> next{s.batch, s.num_draft + 1};
  const std::vector<int64_t>* shapes[5] = {&next, &dims[0], &stats, &last, &rows};
  void* out[5] = {};
  for (size_t i = 0; i < 5; ++i) {
    OrtValue* value = nullptr;
    SG_TRY(g_api.KernelContext_GetOutput(context, i, shapes[i]->data(), shapes[i]->size(), &value));
    SG_TRY(g_api.GetTensorMutableData(value, &out[i]));
  }
  // the state outputs start as their inputs (no copy when the host binds them onto those buffers)
  auto* history_out = static_cast<int64_t*>(out[1]);
  auto* stats_out = static_cast<float*>(out[2]);
  auto* last_out = static_cast<int64_t*>(out[3]);
  if (history_out != history) std::memcpy(history_out, history, static_cast<size_t>(s.batch * s.length) * sizeof(int64_t));
  if (stats_out != stats_in) std::memcpy(stats_out, stats_in, static_cast<size_t>(s.batch * s.max_ngram * 2) * sizeof(float));
  if (last_out != last_in) std::memcpy(last_out, last_in, static_cast<size_t>(s.batch * 3) * sizeof(int64_t));
  for (int64_t b = 0; b < s.batch; ++b) {
    const int64_t sent = sg::kernels::lookup_round(
        s, history_out + b * s.length, tokens + b * s.tokens, cache_len[b], bonus[b], cache_len_out[b],
        stats_out + b * s.max_ngram * 2, last_out + b * 3, cost, static_cast<int64_t*>(out[0]) + b * (s.num_draft + 1));
    if (sent < 0) return lookup_fail("a row's tokens do not fit its history");
    static_cast<int64_t*>(out[4])[b] = sent;
  }
  return nullptr;
}

OrtStatus* lookup_create(const CustomOp*, const void*, const OrtKernelInfo* info, void** out) {
  auto* kernel = new LookupKernel();
  OrtStatus* status = g_api.KernelInfoGetAttribute_int64(info, "num_draft", &kernel->num_draft);
  if (!status) status = g_api.KernelInfoGetAttribute_int64(info, "max_ngram", &kernel->max_ngram);
  if (!status) status = g_api.KernelInfoGetAttribute_float(info, "decay", &kernel->decay);
  if (!status) status = g_api.KernelInfoGetAttribute_float(info, "prior_weight", &kernel->prior_weight);
  if (!status) status = g_api.KernelInfoGetAttribute_float(info, "first_rate", &kernel->first_rate);
  if (!status && (kernel->num_draft < 1 || kernel->max_ngram < 1)) {
    status = lookup_fail("num_draft and max_ngram must be positive");
  }
  return created(kernel, status, out);
}

const char* lookup_name(const CustomOp*) { return "LookupRound"; }
int lookup_input_type(const CustomOp*, size_t i) { return i == 5 || i == 7 ? kFloat : kInt64; }
int lookup_output_type(const CustomOp*, size_t i) { return i == 2 ? kFloat : kInt64; }
size_t lookup_input_count(const CustomOp*) { return 8; }
size_t lookup_output_count(const CustomOp*) { return 5; }
void lookup_destroy(void* kernel) { delete static_cast<LookupKernel*>(kernel); }

int all_required(const CustomOp*, size_t) { return kRequired; }

CustomOp make_lookup_op() {
  CustomOp op = make_op();
  op.GetName = lookup_name;
  op.GetInputType = lookup_input_type;
  op.GetInputTypeCount = lookup_input_count;
  op.GetOutputType = lookup_output_type;
  op.GetOutputTypeCount = lookup_output_count;
  op.GetInputCharacteristic = all_required;
  op.KernelDestroy = lookup_destroy;
  op.CreateKernelV2 = lookup_create;
  op.KernelComputeV2 = lookup_compute;
  return op;
}

const CustomOp g_lookup_op = make_lookup_op();

}  // namespace

extern "C" __attribute__((visibility("default"))) OrtStatus* RegisterCustomOps(OrtSessionOptions* options,
                                                                               const ApiBase* base) {
  const Fn* t = base->GetApi(kApiVersion);
  if (!t) return nullptr;  // too old an ONNX Runtime: it cannot run the op, and says so at load
  take(t, 0, g_api.CreateStatus);
  take(t, 26, g_api.CreateCustomOpDomain);
  take(t, 27, g_api.CustomOpDomain_Add);
  take(t, 28, g_api.AddCustomOpDomain);
  take(t, 51, g_api.GetTensorMutableData);
  take(t, 60, g_api.GetTensorElementType);
  take(t, 61, g_api.GetDimensionsCount);
  take(t, 62, g_api.GetDimensions);
  take(t, 65, g_api.GetTensorTypeAndShape);
  take(t, 85, g_api.KernelInfoGetAttribute_float);
  take(t, 86, g_api.KernelInfoGetAttribute_int64);
  take(t, 88, g_api.KernelContext_GetInputCount);
  take(t, 89, g_api.KernelContext_GetOutputCount);
  take(t, 90, g_api.KernelContext_GetInput);
  take(t, 91, g_api.KernelContext_GetOutput);
  take(t, 93, g_api.ReleaseStatus);
  take(t, 99, g_api.ReleaseShapeInfo);
  take(t, 274, g_api.KernelContext_ParallelFor);
  OrtCustomOpDomain* domain = nullptr;
  SG_TRY(g_api.CreateCustomOpDomain("specgraph", &domain));
  if (g_api.CustomOpDomain_Add(domain, &g_op) || g_api.CustomOpDomain_Add(domain, &g_attention_op) ||
      g_api.CustomOpDomain_Add(domain, &g_slots_op) || g_api.CustomOpDomain_Add(domain, &g_lookup_op)) {
    return g_api.CreateStatus(kFail, "cannot add specgraph's operators");
  }
  return g_api.AddCustomOpDomain(options, domain);
}

// For tests and tools: which code path the block product takes on this CPU.
extern "C" __attribute__((visibility("default"))) const char* specgraph_kernels_path() {
  return sg::kernels::block_matmul_path();
}

// For compiles: whether exact one-digit products should be stored as digits (AMX runs them here).
extern "C" __attribute__((visibility("default"))) int specgraph_kernels_exact_digits() {
  return sg::kernels::exact_digits_fast() ? 1 : 0;
}
