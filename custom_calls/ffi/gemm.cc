// XLA FFI handler of te_jax/ops/gemm.py (Python side: gemm_cuda.py):
// FP8 GEMM out = a @ b.T (+ bias) (+ residual) through cuBLASLt.
//
// Layout mapping. te_jax is row-major: a (M, K), b (N, K), out (M, N), all
// K-contiguous / N-contiguous. cuBLASLt is column-major, so we ask it for
// out^T (N x M, ld N) = b (as a K x N column-major matrix, transposed) times
// a (K x M column-major, not transposed): cuBLAS "A" = our b with TRANSA=T,
// cuBLAS "B" = our a with TRANSB=N, m = N, n = M, k = K. This is the "TN"
// layout Hopper FP8 requires. Consequently the scale of cuBLAS A is b's and
// vice versa, and the bias (one value per cuBLAS row m) is indexed by N.
// A residual (attr has_residual) is cuBLASLt's C with beta = 1, an (M, N)
// input of out's dtype added in float32 before the one rounding to out's
// type: a transformer block's `x + proj(h)` without a pass of its own.
//
// Scale modes (attrs a_mode / b_mode): 0 per-tensor scalar, 1 VEC128 (1x128
// tiles along K; scales (ceil(K/128), rows) with rows contiguous), 2
// BLK128x128 (scales (ceil(rows/128), roundup(ceil(K/128), 4)), K-blocks
// contiguous). quantize_blockwise writes exactly these layouts. The ids and
// layouts are the rows of the Python tiling table (te_jax/ops/tiling.py,
// TileLayout.gemm_mode); tests/test_tiling.py checks ScaleMode() below
// against it.
//
// gemm_cuda.py checks all of this at trace time; the handler checks it again
// because the target can be called directly (jax.ffi.ffi_call) and a wrong
// buffer would otherwise reach cuBLASLt as an out-of-bounds read or garbage.
//
// Algorithm selection (ffi/gemm_autotune.h). On the first use of a problem
// (the plan cache key below) the handler asks cuBLASLt's heuristic for up to
// TE_JAX_GEMM_AUTOTUNE_ALGOS answers, times them and caches the fastest for
// the process; 1 (the default, gemm_autotune.h says why) keeps the
// heuristic's first answer untimed.
// TE_JAX_GEMM_LOG=1 prints each problem's candidates and winner to stderr.
// TE_JAX_GEMM_PICK (an experiment knob) names one answer instead.
// TE_JAX_GEMM_SM90 (off by default) adds te_jax's own sm_90a blockwise
// GEMMs (kernels/gemm_sm90.cuh, in builds with the CUTLASS headers:
// TE_JAX_HAVE_SM90) to the candidates, or uses them alone ("only"), for the
// problems they take; cuBLASLt stays the fallback. A plan then names either
// a cuBLASLt algorithm or a variant; the key is the same.
//
// Command buffers. The handler is declared kCmdBufferCompatible, so XLA may
// run it under stream capture and replay the recorded CUDA graph. Hence it
// enqueues on XLA's stream only the real matmul (and the bias fallback), into
// the buffers XLA hands it: cuBLASLt's workspace is a second result (a
// temporary of XLA's buffer assignment, live only during the call, as the
// workspace of XLA's own cuBLAS GEMMs is). The one-time host work (the
// cuBLASLt handle, the heuristic, the timing) runs in relaxed capture mode,
// and the timing enqueues only on a private, never-captured stream, into
// private scratch memory (gemm_autotune.h says why that is safe): the first
// call of a problem may itself be under capture, and what gets recorded is
// the same single cublasLtMatmul call with the winning algorithm.
#include <cublasLt.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "ffi/common.h"
#include "ffi/gemm_autotune.h"
#include "kernels/bias.h"
#include "kernels/gemm_sm90.cuh"

namespace te_jax {
namespace {

namespace ffi = xla::ffi;

// cuBLASLt wants a 256-byte aligned workspace; XLA guarantees 16 bytes for
// any buffer, so the handler skips up to this many leading bytes (the Python
// side allocates 32 MiB + 256, what cuBLASLt's Hopper kernels may use).
constexpr uintptr_t kWorkspaceAlign = 256;

ffi::Error LtError(cublasStatus_t s, const char* what) {
  if (s == CUBLAS_STATUS_SUCCESS) return ffi::Error::Success();
  return ffi::Error::Internal(std::string("te_jax gemm: ") + what + " failed: " +
                              cublasLtGetStatusName(s) + " (" + cublasLtGetStatusString(s) + ")");
}

#define TE_LT(expr, what)                                         \
  do {                                                            \
    if (auto _e = LtError((expr), what); _e.failure()) return _e; \
  } while (0)
#define TE_TRY(expr)                                \
  do {                                              \
    if (auto _e = (expr); _e.failure()) return _e;  \
  } while (0)

ffi::Error Invalid(const std::string& msg) {
  return ffi::Error::InvalidArgument("te_jax gemm: " + msg);
}

std::string Dims(ffi::Span<const int64_t> d) {
  std::string s = "(";
  for (size_t i = 0; i < d.size(); ++i) s += (i ? ", " : "") + std::to_string(d[i]);
  return s + (d.size() == 1 ? ",)" : ")");
}

// Descriptor owners so that every early return frees them.
struct Desc {
  cublasLtMatmulDesc_t d = nullptr;
  ~Desc() { if (d) cublasLtMatmulDescDestroy(d); }
};
struct Layout {
  cublasLtMatrixLayout_t l = nullptr;
  ~Layout() { if (l) cublasLtMatrixLayoutDestroy(l); }
};
struct Pref {
  cublasLtMatmulPreference_t p = nullptr;
  ~Pref() { if (p) cublasLtMatmulPreferenceDestroy(p); }
};

// The device the handler runs on: XLA makes the stream's device current
// before it calls a handler. (cudaStreamGetDevice would name it exactly, but
// a capturing stream may not be queried: it fails under command buffers.)
ffi::Error CurrentDevice(int* dev) {
  return CudaError(cudaGetDevice(dev), "gemm (cudaGetDevice)");
}

// Largest power of two (<= 256, cuBLASLt's default assumption) dividing p.
// cuBLASLt cannot see pointers when it picks an algorithm, so it must be told.
uint32_t Alignment(const void* p) {
  const uintptr_t v = reinterpret_cast<uintptr_t>(p);
  const uintptr_t low = v & (~v + 1);  // lowest set bit; 0 for a null pointer
  return (low == 0 || low > 256) ? 256u : static_cast<uint32_t>(low);
}

// Everything the selected algorithm depends on: the kind of device
// (gemm_autotune::DeviceClass: devices of one model share plans), m, n, k,
// A/B/D types, modes, fast accumulation, bias type (-1 none), whether the
// fused epilogue may be tried, the A/B/D pointer alignments, the workspace
// size and the residual's pointer alignment (0 without a residual).
using Key = std::array<int64_t, 16>;
struct Plan {
  cublasLtMatmulAlgo_t algo;
  bool fused_bias;  // false: bias (if any) added by the fallback kernel
  int sm90 = -1;    // >= 0: te_jax's sm90::BlockwiseVariant instead of `algo`
  int sm90_swizzle = 1;  // its tile scheduler's swizzle (sm90::TileOrder)
};

#ifdef TE_JAX_HAVE_SM90
constexpr bool kHaveSm90 = true;
// The swizzles each sm90 variant is offered with (the autotuner times
// each): the persistent CTAs walk output tiles in bands this many tiles
// wide, so that the tiles in flight share more operand panels in L2. With
// 1 alone (a plain raster), the fprop variant read DRAM at 71% of its peak
// on the harness's quick shapes where cuBLASLt's kernel read 28% (Nsight
// Compute, run AN) for the same FLOPs.
constexpr int kSm90Swizzles[] = {1, 4, 8};

// The sm90 variants that take this blockwise problem (bias, if any, by the
// fallback kernel), as candidates numbered from `first_index`; why the
// others do not go to *rejected. They serve E4M3 x E4M3 with bfloat16 out,
// a 1x128 and b 128x128 (fprop, dgrad) or 1x128 (wgrad), and need 16-byte
// aligned operands (TMA) and a workspace within the real call's.
std::vector<gemm_autotune::Candidate> Sm90Candidates(const sm90::BlockwiseGemmArgs& args,
                                                     bool e4m3, cudaDataType_t out_type,
                                                     uint32_t min_align, size_t ws_bytes,
                                                     int sms, int first_index,
                                                     std::string* rejected) {
  std::vector<gemm_autotune::Candidate> out;
  const char* whole = !e4m3 ? "an e5m2 operand"
                      : out_type != CUDA_R_16BF ? "output not bfloat16"
                      : min_align < 16 ? "an operand below 16-byte alignment"
                                       : nullptr;
  for (int v = 0; v < static_cast<int>(sm90::BlockwiseVariant::kCount); ++v) {
    const auto variant = static_cast<sm90::BlockwiseVariant>(v);
    const char* why = whole;
    size_t need = 0;
    if (!why) why = sm90::CheckBlockwiseGemm(variant, args);
    if (!why) {
      need = sm90::BlockwiseGemmWorkspace(variant, args, sms);
      if (need > ws_bytes) why = "needs more workspace than the call has";
    }
    if (why) {
      // Variants compiled for the other pair are not worth a line.
      if (std::strcmp(why, "the variant is compiled for other scale modes") != 0)
        *rejected += std::string(rejected->empty() ? "" : "; ") + "sm90 " +
                     sm90::BlockwiseVariantName(variant) + " not offered (" + why + ")";
      continue;
    }
    for (const int swizzle : kSm90Swizzles) {
      gemm_autotune::Candidate c{};
      c.sm90 = v;
      c.sm90_swizzle = swizzle;
      c.index = first_index + static_cast<int>(out.size());
      c.heuristic.workspaceSize = need;
      c.label = std::string("sm90 ") + sm90::BlockwiseVariantName(variant) +
                " (raster heuristic, swizzle " + std::to_string(swizzle) + ")";
      out.push_back(c);
    }
  }
  return out;
}

cudaError_t LaunchSm90(int variant, const sm90::BlockwiseGemmArgs& args, void* ws,
                       size_t ws_bytes, int sms, cudaStream_t stream) {
  return sm90::LaunchBlockwiseGemm(static_cast<sm90::BlockwiseVariant>(variant), args, ws,
                                   ws_bytes, sms, stream);
}
#else
// Built without the CUTLASS headers: no variant exists (Sm90Setting warns
// when TE_JAX_GEMM_SM90 asks for them), and no sm90 symbol is referenced.
constexpr bool kHaveSm90 = false;
std::vector<gemm_autotune::Candidate> Sm90Candidates(const sm90::BlockwiseGemmArgs&, bool,
                                                     cudaDataType_t, uint32_t, size_t, int, int,
                                                     std::string*) {
  return {};
}
cudaError_t LaunchSm90(int, const sm90::BlockwiseGemmArgs&, void*, size_t, int, cudaStream_t) {
  return cudaErrorNotSupported;
}
#endif

// Relaxed stream-capture mode for this thread during the scope. Under XLA's
// (thread-local) capture, calls that may synchronize or allocate are errors
// and invalidate the capture; cublasLtCreate may allocate, and the algorithm
// timing creates a stream, allocates and synchronizes (all on its private
// stream). Relaxed mode lets them run without being recorded; nothing in the
// scope touches XLA's stream.
struct RelaxedCapture {
  cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
  RelaxedCapture() { cudaThreadExchangeStreamCaptureMode(&mode); }
  ~RelaxedCapture() { cudaThreadExchangeStreamCaptureMode(&mode); }
};

// One handle per device and one plan per key, created on first use. The
// mutex guards the maps only; a handle is thread-safe for cublasLtMatmul
// (stream and workspace are per call) and plans are copied out before use.
// Selecting a plan happens under gemm_autotune::SelectionMutex(), taken
// before (never while holding) `mu`.
struct DeviceState {
  cublasLtHandle_t handle;
  int cls;  // gemm_autotune::DeviceClass: the plans it shares
  int sms;  // multiprocessor count: the sm90 variants' persistent grid
};
struct State {
  std::mutex mu;
  std::map<int, DeviceState> devices;
  std::map<Key, Plan> plans;
};
State& GetState() {
  static State* s = new State;  // leaked on purpose: no teardown-order issues
  return *s;
}

bool FindPlan(State& st, const Key& key, Plan* plan) {
  std::lock_guard<std::mutex> lock(st.mu);
  auto it = st.plans.find(key);
  if (it == st.plans.end()) return false;
  *plan = it->second;
  return true;
}

const char* TypeName(cudaDataType_t t) {
  switch (t) {
    case CUDA_R_8F_E4M3: return "e4m3";
    case CUDA_R_8F_E5M2: return "e5m2";
    case CUDA_R_16BF: return "bf16";
    case CUDA_R_16F: return "f16";
    case CUDA_R_32F: return "f32";
    default: return "?";
  }
}
const char* ModeName(int64_t mode) {
  return mode == 1 ? "vec128" : mode == 2 ? "blk128x128" : "tensor";
}

bool IsFp8(ffi::DataType t) { return t == ffi::F8E4M3FN || t == ffi::F8E5M2; }

// Output / bias types the GEMM and the fallback bias kernel handle
// (codes of kernels/bias.h: 0 float32, 1 bfloat16, 2 float16).
bool Float(ffi::DataType t, cudaDataType_t* cuda, int* code) {
  switch (t) {
    case ffi::F32: *cuda = CUDA_R_32F; *code = 0; return true;
    case ffi::BF16: *cuda = CUDA_R_16BF; *code = 1; return true;
    case ffi::F16: *cuda = CUDA_R_16F; *code = 2; return true;
    default: return false;
  }
}

// scale_inv of an operand with `rows` rows must be float32 of the layout its
// mode implies (see the header); anything else would be read out of bounds.
ffi::Error CheckScale(const char* name, const ffi::AnyBuffer& s, int64_t mode, int64_t rows,
                      int64_t K) {
  if (s.element_type() != ffi::F32) return Invalid(std::string(name) + "_sinv must be float32");
  const int64_t kb = (K + 127) / 128;
  if (mode == 0) {
    if (s.element_count() != 1)
      return Invalid(std::string(name) + "_sinv must hold 1 float for per-tensor scaling (mode 0)" +
                     ", got shape " + Dims(s.dimensions()));
    return ffi::Error::Success();
  }
  const int64_t want0 = mode == 1 ? kb : (rows + 127) / 128;
  const int64_t want1 = mode == 1 ? rows : (kb + 3) / 4 * 4;
  auto d = s.dimensions();
  if (d.size() != 2 || d[0] != want0 || d[1] != want1)
    return Invalid(std::string(name) + "_sinv must have shape (" + std::to_string(want0) + ", " +
                   std::to_string(want1) + ") for " + (mode == 1 ? "VEC128" : "BLK128x128") +
                   " scaling with rows=" + std::to_string(rows) + " K=" + std::to_string(K) +
                   ", got " + Dims(d));
  // Conservative: cuBLASLt does not document what block-scale loads accept,
  // and XLA's buffers are >= 16-byte aligned anyway.
  if (Alignment(s.untyped_data()) < 16)
    return Invalid(std::string(name) + "_sinv must be 16-byte aligned for block scaling");
  return ffi::Error::Success();
}

cublasLtMatmulMatrixScale_t ScaleMode(int64_t mode) {
  return mode == 1 ? CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F
         : mode == 2 ? CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F
                     : CUBLASLT_MATMUL_MATRIX_SCALE_SCALAR_32F;
}

template <typename T>
cublasStatus_t Set(cublasLtMatmulDesc_t d, cublasLtMatmulDescAttributes_t attr, const T& v) {
  return cublasLtMatmulDescSetAttribute(d, attr, &v, sizeof(v));
}
cublasStatus_t SetPref(cublasLtMatmulPreference_t p, cublasLtMatmulPreferenceAttributes_t attr,
                       uint32_t v) {
  return cublasLtMatmulPreferenceSetAttribute(p, attr, &v, sizeof(v));
}

ffi::Error GemmImpl(cudaStream_t stream, ffi::AnyBuffer a, ffi::AnyBuffer b, ffi::AnyBuffer a_sinv,
                    ffi::AnyBuffer b_sinv, ffi::AnyBuffer bias, ffi::AnyBuffer residual,
                    ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::AnyBuffer> workspace_buf,
                    int64_t a_mode, int64_t b_mode, int64_t fast_accum, int64_t has_bias,
                    int64_t has_residual) {
  // ---- validation: every buffer against the (M, N, K) of a and b ----
  auto ad = a.dimensions(), bd = b.dimensions(), od = out->dimensions();
  if (ad.size() != 2 || bd.size() != 2 || ad[1] != bd[1])
    return Invalid("a (M, K) and b (N, K) must be 2-D with equal K, got a " + Dims(ad) + " and b " +
                   Dims(bd));
  const int64_t M = ad[0], K = ad[1], N = bd[0];
  if (od.size() != 2 || od[0] != M || od[1] != N)
    return Invalid("out must have shape (M, N) = (" + std::to_string(M) + ", " + std::to_string(N) +
                   "), got " + Dims(od));
  // 16-element multiples: FP8 leading dimensions must be 16-byte multiples
  // and the VEC128 scale grid is unpadded only for rows % 4 == 0.
  if (M % 16 || N % 16 || K % 16)
    return Invalid("M, N and K must be multiples of 16, got M=" + std::to_string(M) +
                   " N=" + std::to_string(N) + " K=" + std::to_string(K));
  if (!IsFp8(a.element_type()) || !IsFp8(b.element_type()))
    return Invalid("a and b must be float8_e4m3fn or float8_e5m2");
  if (a.element_type() == ffi::F8E5M2 && b.element_type() == ffi::F8E5M2)
    return Invalid("E5M2 x E5M2 is not a supported FP8 GEMM");
  const cudaDataType_t ta = a.element_type() == ffi::F8E4M3FN ? CUDA_R_8F_E4M3 : CUDA_R_8F_E5M2;
  const cudaDataType_t tb = b.element_type() == ffi::F8E4M3FN ? CUDA_R_8F_E4M3 : CUDA_R_8F_E5M2;
  cudaDataType_t td, tbias = CUDA_R_16BF;
  int out_code = 0, bias_code = 0;
  if (!Float(out->element_type(), &td, &out_code))
    return Invalid("out must be bfloat16, float16 or float32");
  if (a_mode < 0 || a_mode > 2 || b_mode < 0 || b_mode > 2 || (a_mode == 0) != (b_mode == 0) ||
      (a_mode == 2 && b_mode == 2))
    return Invalid("unsupported scale modes a_mode=" + std::to_string(a_mode) +
                   " b_mode=" + std::to_string(b_mode) +
                   " (both 0, or VEC128/BLK128x128 pairs other than BLK x BLK)");
  TE_TRY(CheckScale("a", a_sinv, a_mode, M, K));
  TE_TRY(CheckScale("b", b_sinv, b_mode, N, K));
  if ((fast_accum != 0 && fast_accum != 1) || (has_bias != 0 && has_bias != 1) ||
      (has_residual != 0 && has_residual != 1))
    return Invalid("fast_accum, has_bias and has_residual must be 0 or 1");
  if (has_bias) {
    if (bias.dimensions().size() != 1 || bias.dimensions()[0] != N)
      return Invalid("bias must have shape (" + std::to_string(N) + ",), got " +
                     Dims(bias.dimensions()));
    if (!Float(bias.element_type(), &tbias, &bias_code))
      return Invalid("bias must be bfloat16, float16 or float32");
  }
  if (has_residual) {
    auto rd = residual.dimensions();
    if (rd.size() != 2 || rd[0] != M || rd[1] != N)
      return Invalid("residual must have out's shape (" + std::to_string(M) + ", " +
                     std::to_string(N) + "), got " + Dims(rd));
    if (residual.element_type() != out->element_type())
      return Invalid("residual must have out's dtype");
  }
  if (M == 0 || N == 0) return ffi::Error::Success();
  int dev = 0;
  TE_TRY(CurrentDevice(&dev));
  void* d = out->untyped_data();
  if (K == 0) {  // empty sum: cuBLASLt does not take k = 0
    if (has_residual) {
      TE_TRY(CudaError(cudaMemcpyAsync(d, residual.untyped_data(), out->size_bytes(),
                                       cudaMemcpyDeviceToDevice, stream),
                       "gemm (K=0 residual copy)"));
    } else {
      TE_TRY(CudaError(cudaMemsetAsync(d, 0, out->size_bytes(), stream), "gemm (K=0 zero fill)"));
    }
    if (!has_bias) return ffi::Error::Success();
    return CudaError(LaunchAddBias(d, out_code, bias.untyped_data(), bias_code, M, N, stream),
                     "gemm (bias, K=0)");
  }

  const bool blockwise = a_mode != 0;
  // cuBLASLt's FP8 BIAS epilogue takes a bf16 bias for bf16/fp32 output and an
  // fp16 bias for fp16 output; any other combination uses the fallback, as
  // does a bias pointer below 16-byte alignment (the epilogue's requirement is
  // not documented; the fallback kernel reads element by element).
  const cudaDataType_t lt_bias = td == CUDA_R_16F ? CUDA_R_16F : CUDA_R_16BF;
  const bool try_fused = has_bias && tbias == lt_bias && Alignment(bias.untyped_data()) >= 16;
  const int8_t fast = (fast_accum && !blockwise) ? 1 : 0;  // fast accum is per-tensor only
  // Real pointer alignments (C is D, beta = 0, without a residual; C is the
  // residual, beta = 1, with one). cuBLASLt assumes 256 bytes by default,
  // but XLA promises only 16 for entry parameters and 128 for its own
  // buffers, and dynamic-slice fusion can pass a sub-buffer.
  const uint32_t align_a = Alignment(b.untyped_data());  // cuBLAS A is our b
  const uint32_t align_b = Alignment(a.untyped_data());
  const uint32_t align_d = Alignment(d);
  const void* c = has_residual ? residual.untyped_data() : d;
  const uint32_t align_c = Alignment(c);
  const float beta = has_residual ? 1.f : 0.f;

  // The workspace, rounded up to cuBLASLt's alignment; a buffer too small to
  // hold any is passed as none (cuBLASLt then picks workspace-free kernels).
  const uintptr_t ws_raw = reinterpret_cast<uintptr_t>(workspace_buf->untyped_data());
  const uintptr_t ws_skip = (kWorkspaceAlign - ws_raw % kWorkspaceAlign) % kWorkspaceAlign;
  const size_t ws_total = workspace_buf->size_bytes();
  const size_t ws_bytes = ws_total > ws_skip ? ws_total - ws_skip : 0;
  void* workspace = ws_bytes ? reinterpret_cast<void*>(ws_raw + ws_skip) : nullptr;

  // ---- per-device state ----
  State& st = GetState();
  cublasLtHandle_t handle;
  int dev_class, sms = 0;
  {
    std::lock_guard<std::mutex> lock(st.mu);
    auto it = st.devices.find(dev);
    if (it == st.devices.end()) {
      RelaxedCapture relaxed;
      TE_LT(cublasLtCreate(&handle), "cublasLtCreate");
      dev_class = gemm_autotune::DeviceClass(dev);
      TE_TRY(CudaError(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev),
                       "gemm (cudaDeviceGetAttribute)"));
      st.devices[dev] = DeviceState{handle, dev_class, sms};
    } else {
      handle = it->second.handle;
      dev_class = it->second.cls;
      sms = it->second.sms;
    }
  }

  // te_jax's sm90 variants, for the blockwise pairs they serve.
  sm90::BlockwiseGemmArgs sm90_args;
  sm90_args.m = M;
  sm90_args.n = N;
  sm90_args.k = K;
  sm90_args.a = a.untyped_data();
  sm90_args.b = b.untyped_data();
  sm90_args.a_sinv = static_cast<const float*>(a_sinv.untyped_data());
  sm90_args.b_sinv = static_cast<const float*>(b_sinv.untyped_data());
  sm90_args.a_mode = static_cast<sm90::ScaleMode>(a_mode);
  sm90_args.b_mode = static_cast<sm90::ScaleMode>(b_mode);
  sm90_args.out = d;
  auto launch_sm90 = [&](int variant, int swizzle, void* out_ptr, void* ws, size_t ws_size,
                         cudaStream_t s) {
    sm90::BlockwiseGemmArgs args = sm90_args;
    args.out = out_ptr;
    args.order.swizzle = swizzle;
    return LaunchSm90(variant, args, ws, ws_size, sms, s);
  };
  // The setting for blockwise problems; the sm90 variants write a @ b.T
  // alone, so a residual leaves them out.
  const gemm_autotune::Sm90Use sm90_setting =
      blockwise ? gemm_autotune::Sm90Setting(kHaveSm90) : gemm_autotune::Sm90Use::kOff;
  const gemm_autotune::Sm90Use sm90_use =
      has_residual ? gemm_autotune::Sm90Use::kOff : sm90_setting;

  // Descriptors are cheap host objects: build them per call (the pointers
  // change every call) and cache only the heuristic's algorithm choice.
  auto make_desc = [&](bool fused, Desc* desc) -> ffi::Error {
    TE_LT(cublasLtMatmulDescCreate(&desc->d, CUBLAS_COMPUTE_32F, CUDA_R_32F), "MatmulDescCreate");
    TE_LT(Set(desc->d, CUBLASLT_MATMUL_DESC_TRANSA, CUBLAS_OP_T), "set TRANSA");
    TE_LT(Set(desc->d, CUBLASLT_MATMUL_DESC_TRANSB, CUBLAS_OP_N), "set TRANSB");
    const void* sa = b_sinv.untyped_data();  // cuBLAS A is our b
    const void* sb = a_sinv.untyped_data();
    TE_LT(Set(desc->d, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, sa), "set A_SCALE_POINTER");
    TE_LT(Set(desc->d, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, sb), "set B_SCALE_POINTER");
    if (blockwise) {
      TE_LT(Set(desc->d, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, static_cast<int32_t>(ScaleMode(b_mode))),
            "set A_SCALE_MODE");
      TE_LT(Set(desc->d, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, static_cast<int32_t>(ScaleMode(a_mode))),
            "set B_SCALE_MODE");
    }
    TE_LT(Set(desc->d, CUBLASLT_MATMUL_DESC_FAST_ACCUM, fast), "set FAST_ACCUM");
    if (fused) {
      TE_LT(Set(desc->d, CUBLASLT_MATMUL_DESC_EPILOGUE, CUBLASLT_EPILOGUE_BIAS), "set EPILOGUE");
      const void* bp = bias.untyped_data();
      TE_LT(Set(desc->d, CUBLASLT_MATMUL_DESC_BIAS_POINTER, bp), "set BIAS_POINTER");
      TE_LT(Set(desc->d, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, static_cast<int32_t>(tbias)),
            "set BIAS_DATA_TYPE");
    }
    return ffi::Error::Success();
  };

  Layout la, lb, lc;
  TE_LT(cublasLtMatrixLayoutCreate(&la.l, tb, K, N, K), "layout A");  // our b
  TE_LT(cublasLtMatrixLayoutCreate(&lb.l, ta, K, M, K), "layout B");  // our a
  TE_LT(cublasLtMatrixLayoutCreate(&lc.l, td, N, M, N), "layout C/D");

  // TE_JAX_GEMM_LOG: the problem, each candidate and the winner, one block
  // per selection, written at once so that threads do not interleave lines.
  auto log_selection = [&](bool fused, const std::vector<gemm_autotune::Candidate>& cands,
                           int winner, const std::string& note) {
    // Only for the log; querying the capture state is allowed on a capturing
    // stream (it is how one asks).
    cudaStreamCaptureStatus cap = cudaStreamCaptureStatusNone;
    const bool known = cudaStreamIsCapturing(stream, &cap) == cudaSuccess;
    if (!known) cudaGetLastError();
    char h[768];
    std::snprintf(
        h, sizeof(h),
        "te_jax gemm autotune: out (%lld, %lld) %s = a (%lld, %lld) %s @ b (%lld, %lld).T %s;"
        " scales a=%s b=%s; fast_accum=%d; bias=%s%s; residual=%s; alignment a=%u b=%u out=%u;"
        " workspace=%zu; device %d (plans shared with device %d); stream capturing=%s;"
        " %zu candidate(s)",
        static_cast<long long>(M), static_cast<long long>(N), TypeName(td),
        static_cast<long long>(M), static_cast<long long>(K), TypeName(ta),
        static_cast<long long>(N), static_cast<long long>(K), TypeName(tb), ModeName(a_mode),
        ModeName(b_mode), static_cast<int>(fast), has_bias ? TypeName(tbias) : "none",
        has_bias ? (fused ? " (fused epilogue)" : " (fallback kernel)") : "",
        has_residual ? "yes (beta 1)" : "none", align_b, align_a, align_d, ws_bytes, dev, dev_class,
        !known ? "unknown" : cap == cudaStreamCaptureStatusNone ? "no" : "yes", cands.size());
    const std::string report = gemm_autotune::Report(
        h, cands, winner, 2.0 * static_cast<double>(M) * static_cast<double>(N) * static_cast<double>(K),
        note);
    std::fputs(report.c_str(), stderr);
    std::fflush(stderr);
  };

  // Choose the algorithm: the heuristic's answers, timed when there are
  // several (gemm_autotune.h), the winner cached. Host work only, except the
  // timing on the private stream; runs once per key.
  auto select = [&](Plan* plan) -> ffi::Error {
    Pref pref;
    TE_LT(cublasLtMatmulPreferenceCreate(&pref.p), "PreferenceCreate");
    const uint64_t ws = ws_bytes;
    TE_LT(cublasLtMatmulPreferenceSetAttribute(pref.p, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                               &ws, sizeof(ws)),
          "set MAX_WORKSPACE_BYTES");
    TE_LT(SetPref(pref.p, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, align_a), "set ALIGNMENT_A");
    TE_LT(SetPref(pref.p, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, align_b), "set ALIGNMENT_B");
    TE_LT(SetPref(pref.p, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, align_c), "set ALIGNMENT_C");
    TE_LT(SetPref(pref.p, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, align_d), "set ALIGNMENT_D");
    const int pick = gemm_autotune::PickFor(fast != 0);
    const int want = std::max(gemm_autotune::AlgoCount(), pick + 1);
    std::vector<cublasLtMatmulHeuristicResult_t> res(static_cast<size_t>(want));
    std::string sm90_rejected;
    const std::vector<gemm_autotune::Candidate> sm90_cands =
        sm90_use == gemm_autotune::Sm90Use::kOff
            ? std::vector<gemm_autotune::Candidate>{}
            : Sm90Candidates(sm90_args, ta == CUDA_R_8F_E4M3 && tb == CUDA_R_8F_E4M3, td,
                             std::min({align_a, align_b, align_d}), ws_bytes, sms, want,
                             &sm90_rejected);
    const bool sm90_alone = sm90_use == gemm_autotune::Sm90Use::kOnly && !sm90_cands.empty();
    cublasStatus_t s = CUBLAS_STATUS_SUCCESS;
    for (bool fused : {true, false}) {
      // The variants add a bias with the fallback kernel: unfused pass only.
      if (fused && (!try_fused || sm90_alone)) continue;
      Desc desc;
      TE_TRY(make_desc(fused, &desc));
      int found = 0;
      s = cublasLtMatmulAlgoGetHeuristic(handle, desc.d, la.l, lb.l, lc.l, lc.l, pref.p, want,
                                         res.data(), &found);
      // Usable answers, in the heuristic's order, then the sm90 variants.
      std::vector<gemm_autotune::Candidate> cands;
      for (int i = 0; !sm90_alone && s == CUBLAS_STATUS_SUCCESS && i < found; ++i) {
        const cublasLtMatmulHeuristicResult_t& r = res[static_cast<size_t>(i)];
        if (r.state != CUBLAS_STATUS_SUCCESS || r.workspaceSize > ws_bytes) continue;
        gemm_autotune::Candidate c;
        c.heuristic = r;
        c.index = i;
        cands.push_back(c);
      }
      if (!fused) cands.insert(cands.end(), sm90_cands.begin(), sm90_cands.end());
      if (cands.empty()) continue;
      int winner = 0;
      std::string note;
      if (pick >= 0) {
        winner = std::min(pick, static_cast<int>(cands.size()) - 1);
        note = "TE_JAX_GEMM_PICK: usable answer " + std::to_string(winner) + " of " +
               std::to_string(cands.size()) + ", not timed";
      } else if (cands.size() > 1) {
        const gemm_autotune::Problem problem{
            handle, desc.d, la.l, lb.l, lc.l, b.untyped_data(), a.untyped_data(),
            out->size_bytes(), align_d, ws_bytes, beta,
            [&](const gemm_autotune::Candidate& c, void* dst, void* scratch, cudaStream_t on) {
              return launch_sm90(c.sm90, c.sm90_swizzle, dst, scratch, ws_bytes, on);
            }};
        int reps = 0;
        const std::string err = gemm_autotune::Measure(dev, problem, &cands, &reps);
        const int best = err.empty() ? gemm_autotune::PickWinner(cands) : -1;
        if (best >= 0) {
          winner = best;
          note = std::to_string(gemm_autotune::kRounds) + " rounds of " + std::to_string(reps) +
                 " call(s), median";
        } else if (err.empty() && fused) {
          winner = -1;  // cuBLASLt ran none with the epilogue: try the fallback kernel
          note = "no candidate ran: trying without the fused bias epilogue";
        } else {
          // Today's choice without timing; a real failure shows in the real call.
          note = (err.empty() ? "no candidate ran in the timing" : "timing failed: " + err) +
                 "; using the first candidate";
          std::fprintf(stderr, "te_jax gemm (M=%lld N=%lld K=%lld): %s\n",
                       static_cast<long long>(M), static_cast<long long>(N),
                       static_cast<long long>(K), note.c_str());
        }
      } else {
        note = want > 1 || sm90_use != gemm_autotune::Sm90Use::kOff
                   ? "one usable answer: not timed"
                   : "TE_JAX_GEMM_AUTOTUNE_ALGOS=1 (the default): not timed";
      }
      if (sm90_use == gemm_autotune::Sm90Use::kOnly && sm90_cands.empty())
        note += "; TE_JAX_GEMM_SM90=only, but no sm90 variant takes the problem: cuBLASLt";
      if (has_residual && sm90_setting != gemm_autotune::Sm90Use::kOff)
        note += "; the sm90 variants add no residual: cuBLASLt alone";
      if (!sm90_rejected.empty()) note += "; " + sm90_rejected;
      if (gemm_autotune::LogEnabled()) log_selection(fused, cands, winner, note);
      if (winner < 0) continue;
      const gemm_autotune::Candidate& w = cands[static_cast<size_t>(winner)];
      *plan = Plan{w.heuristic.algo, fused, w.sm90, w.sm90_swizzle};
      return ffi::Error::Success();
    }
    return ffi::Error::Internal(
        "te_jax gemm: cuBLASLt found no algorithm for M=" + std::to_string(M) +
        " N=" + std::to_string(N) + " K=" + std::to_string(K) + " a_mode=" +
        std::to_string(a_mode) + " b_mode=" + std::to_string(b_mode) + " pointer alignment a=" +
        std::to_string(align_b) + " b=" + std::to_string(align_a) + " out=" +
        std::to_string(align_d) + (has_residual ? " with a residual" : "") + " (status " +
        cublasLtGetStatusName(s) + ")");
  };

  const Key key{dev_class, M, N, K, ta, tb, td, a_mode * 4 + b_mode, fast,
                has_bias ? static_cast<int64_t>(tbias) : -1, try_fused, align_a, align_b, align_d,
                static_cast<int64_t>(ws_bytes), has_residual ? static_cast<int64_t>(align_c) : 0};
  Plan plan;
  if (!FindPlan(st, key, &plan)) {
    RelaxedCapture relaxed;
    // One selection at a time: a thread that missed the cache for the same
    // key meanwhile waits here, then finds the plan.
    std::lock_guard<std::mutex> selecting(gemm_autotune::SelectionMutex());
    if (!FindPlan(st, key, &plan)) {
      TE_TRY(select(&plan));
      std::lock_guard<std::mutex> lock(st.mu);
      st.plans[key] = plan;
    }
  }

  if (plan.sm90 >= 0) {
    TE_TRY(CudaError(launch_sm90(plan.sm90, plan.sm90_swizzle, d, workspace, ws_bytes, stream),
                     "gemm (sm90)"));
  } else {
    Desc desc;
    TE_TRY(make_desc(plan.fused_bias, &desc));
    const float alpha = 1.f;
    TE_LT(cublasLtMatmul(handle, desc.d, &alpha, b.untyped_data(), la.l, a.untyped_data(), lb.l,
                         &beta, c, lc.l, d, lc.l, &plan.algo, workspace, ws_bytes, stream),
          "cublasLtMatmul");
  }
  if (has_bias && !plan.fused_bias) {
    return CudaError(LaunchAddBias(d, out_code, bias.untyped_data(), bias_code, M, N, stream),
                     "gemm (bias fallback)");
  }
  return ffi::Error::Success();
}

}  // namespace

// Command-buffer compatible: see the top of the file.
XLA_FFI_DEFINE_HANDLER_SYMBOL(TeJaxGemm, GemmImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()          // a (M, K) fp8
                                  .Arg<ffi::AnyBuffer>()          // b (N, K) fp8
                                  .Arg<ffi::AnyBuffer>()          // a_sinv f32: () or block layout
                                  .Arg<ffi::AnyBuffer>()          // b_sinv f32: () or block layout
                                  .Arg<ffi::AnyBuffer>()          // bias (N,) or (0,) placeholder
                                  .Arg<ffi::AnyBuffer>()          // residual (M, N) or (0, 0)
                                  .Ret<ffi::AnyBuffer>()          // out (M, N) bf16/fp16/fp32
                                  .Ret<ffi::AnyBuffer>()          // workspace (bytes,) uint8 scratch
                                  .Attr<int64_t>("a_mode")        // 0 tensor, 1 VEC128, 2 BLK128x128
                                  .Attr<int64_t>("b_mode")
                                  .Attr<int64_t>("fast_accum")    // 0/1, per-tensor only
                                  .Attr<int64_t>("has_bias")      // 0/1
                                  .Attr<int64_t>("has_residual"), // 0/1: out += residual
                              {ffi::Traits::kCmdBufferCompatible});

}  // namespace te_jax
