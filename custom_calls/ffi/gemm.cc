// XLA FFI handler of te_jax/ops/gemm.py (Python side: gemm_cuda.py):
// FP8 GEMM out = a @ b.T through cuBLASLt.
//
// Layout mapping. te_jax is row-major: a (M, K), b (N, K), out (M, N), all
// K-contiguous / N-contiguous. cuBLASLt is column-major, so we ask it for
// out^T (N x M, ld N) = b (as a K x N column-major matrix, transposed) times
// a (K x M column-major, not transposed): cuBLAS "A" = our b with TRANSA=T,
// cuBLAS "B" = our a with TRANSB=N, m = N, n = M, k = K. This is the "TN"
// layout Hopper FP8 requires. Consequently the scale of cuBLAS A is b's and
// vice versa, and the bias (one value per cuBLAS row m) is indexed by N.
//
// Scale modes (attrs a_mode / b_mode): 0 per-tensor scalar, 1 VEC128 (1x128
// tiles along K; scales (ceil(K/128), rows) with rows contiguous), 2
// BLK128x128 (scales (ceil(rows/128), roundup(ceil(K/128), 4)), K-blocks
// contiguous). quantize_blockwise writes exactly these layouts.
#include <cublasLt.h>

#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <tuple>

#include "ffi/common.h"
#include "kernels/bias.h"

namespace te_jax {
namespace {

namespace ffi = xla::ffi;

constexpr size_t kWorkspaceBytes = 32u << 20;  // what cuBLASLt's Hopper kernels may use

ffi::Error LtError(cublasStatus_t s, const char* what) {
  if (s == CUBLAS_STATUS_SUCCESS) return ffi::Error::Success();
  return ffi::Error::Internal(std::string("te_jax gemm: ") + what + " failed: " +
                              cublasLtGetStatusName(s) + " (" + cublasLtGetStatusString(s) + ")");
}

#define TE_LT(expr, what)                                         \
  do {                                                            \
    if (auto _e = LtError((expr), what); _e.failure()) return _e; \
  } while (0)

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

// Everything the heuristic's answer depends on (pointers are always XLA
// buffers, aligned to >= 64 bytes, so alignment is not part of the key).
using Key = std::tuple<int, int64_t, int64_t, int64_t, int, int, int, int64_t, int64_t, int64_t,
                       int>;  // dev, m, n, k, A type, B type, D type, modes, fast, bias type
struct Plan {
  cublasLtMatmulAlgo_t algo;
  bool fused_bias;  // false: bias (if any) added by the fallback kernel
};

// One handle per device and one plan per key, created on first use. The
// mutex guards the maps only; the plans are copied out before the matmul.
struct State {
  std::mutex mu;
  std::map<int, cublasLtHandle_t> handles;
  std::map<Key, Plan> plans;
  // 32 MiB workspace per (device, stream), allocated once: XLA's FFI scratch
  // allocator refused 32 MiB on the H200 (jax 0.11.2), and one buffer per
  // stream keeps GEMMs on different streams from sharing a workspace.
  std::map<std::pair<int, cudaStream_t>, void*> workspaces;
};
State& GetState() {
  static State* s = new State;  // leaked on purpose: no teardown-order issues
  return *s;
}

ffi::Error CudaType(ffi::DataType t, cudaDataType_t* out) {
  switch (t) {
    case ffi::F8E4M3FN: *out = CUDA_R_8F_E4M3; break;
    case ffi::F8E5M2: *out = CUDA_R_8F_E5M2; break;
    case ffi::BF16: *out = CUDA_R_16BF; break;
    case ffi::F16: *out = CUDA_R_16F; break;
    case ffi::F32: *out = CUDA_R_32F; break;
    default: return ffi::Error::InvalidArgument("te_jax gemm: unsupported dtype");
  }
  return ffi::Error::Success();
}

int BiasCode(cudaDataType_t t) { return t == CUDA_R_32F ? 0 : t == CUDA_R_16BF ? 1 : 2; }

cublasLtMatmulMatrixScale_t ScaleMode(int64_t mode) {
  return mode == 1 ? CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F
         : mode == 2 ? CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F
                     : CUBLASLT_MATMUL_MATRIX_SCALE_SCALAR_32F;
}

template <typename T>
cublasStatus_t Set(cublasLtMatmulDesc_t d, cublasLtMatmulDescAttributes_t attr, const T& v) {
  return cublasLtMatmulDescSetAttribute(d, attr, &v, sizeof(v));
}

ffi::Error GemmImpl(cudaStream_t stream, ffi::AnyBuffer a,
                    ffi::AnyBuffer b, ffi::Buffer<ffi::F32> a_sinv, ffi::Buffer<ffi::F32> b_sinv,
                    ffi::AnyBuffer bias, ffi::Result<ffi::AnyBuffer> out, int64_t a_mode,
                    int64_t b_mode, int64_t fast_accum, int64_t has_bias) {
  auto ad = a.dimensions(), bd = b.dimensions();
  if (ad.size() != 2 || bd.size() != 2 || ad[1] != bd[1])
    return ffi::Error::InvalidArgument("te_jax gemm: a (M, K) and b (N, K) must be 2-D with equal K");
  const int64_t M = ad[0], K = ad[1], N = bd[0];
  if (M == 0 || N == 0) return ffi::Error::Success();
  cudaDataType_t ta, tb, td, tbias = CUDA_R_16BF;
  if (auto e = CudaType(a.element_type(), &ta); e.failure()) return e;
  if (auto e = CudaType(b.element_type(), &tb); e.failure()) return e;
  if (auto e = CudaType(out->element_type(), &td); e.failure()) return e;
  if (has_bias && (bias.element_count() != static_cast<size_t>(N)))
    return ffi::Error::InvalidArgument("te_jax gemm: bias must have N elements");
  if (has_bias)
    if (auto e = CudaType(bias.element_type(), &tbias); e.failure()) return e;
  const bool blockwise = a_mode != 0 || b_mode != 0;
  // cuBLASLt's FP8 BIAS epilogue takes a bf16 bias for bf16/fp32 output and an
  // fp16 bias for fp16 output; any other combination uses the fallback.
  const cudaDataType_t lt_bias = td == CUDA_R_16F ? CUDA_R_16F : CUDA_R_16BF;
  const bool try_fused = has_bias && tbias == lt_bias;
  const int8_t fast = (fast_accum && !blockwise) ? 1 : 0;  // fast accum is per-tensor only

  int dev = 0;
  if (auto e = CudaError(cudaGetDevice(&dev), "gemm (cudaGetDevice)"); e.failure()) return e;

  State& st = GetState();
  cublasLtHandle_t handle;
  void* workspace = nullptr;
  {
    std::lock_guard<std::mutex> lock(st.mu);
    auto it = st.handles.find(dev);
    if (it == st.handles.end()) {
      TE_LT(cublasLtCreate(&handle), "cublasLtCreate");
      st.handles[dev] = handle;
    } else {
      handle = it->second;
    }
    void*& ws = st.workspaces[{dev, stream}];
    if (ws == nullptr) {
      if (auto e = CudaError(cudaMalloc(&ws, kWorkspaceBytes), "gemm (32 MiB workspace)");
          e.failure()) {
        ws = nullptr;
        return e;
      }
    }
    workspace = ws;
  }

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

  const Key key{dev, M, N, K, static_cast<int>(ta), static_cast<int>(tb), static_cast<int>(td),
                a_mode * 4 + b_mode, static_cast<int64_t>(fast), has_bias ? 1 : 0,
                has_bias ? static_cast<int>(tbias) : -1};
  Plan plan;
  bool cached = false;
  {
    std::lock_guard<std::mutex> lock(st.mu);
    auto it = st.plans.find(key);
    if (it != st.plans.end()) { plan = it->second; cached = true; }
  }
  if (!cached) {
    Pref pref;
    TE_LT(cublasLtMatmulPreferenceCreate(&pref.p), "PreferenceCreate");
    const uint64_t ws = kWorkspaceBytes;
    TE_LT(cublasLtMatmulPreferenceSetAttribute(pref.p, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                               &ws, sizeof(ws)),
          "set MAX_WORKSPACE_BYTES");
    int found = 0;
    cublasLtMatmulHeuristicResult_t res = {};
    for (bool fused : {true, false}) {
      if (fused && !try_fused) continue;
      Desc desc;
      if (auto e = make_desc(fused, &desc); e.failure()) return e;
      cublasStatus_t s = cublasLtMatmulAlgoGetHeuristic(handle, desc.d, la.l, lb.l, lc.l, lc.l,
                                                        pref.p, 1, &res, &found);
      if (s == CUBLAS_STATUS_SUCCESS && found > 0) {
        plan = Plan{res.algo, fused};
        break;
      }
      if (!fused) {
        return ffi::Error::Internal(
            "te_jax gemm: cuBLASLt found no algorithm for M=" + std::to_string(M) +
            " N=" + std::to_string(N) + " K=" + std::to_string(K) + " a_mode=" +
            std::to_string(a_mode) + " b_mode=" + std::to_string(b_mode) +
            " (status " + cublasLtGetStatusName(s) + ")");
      }
    }
    std::lock_guard<std::mutex> lock(st.mu);
    st.plans[key] = plan;
  }

  Desc desc;
  if (auto e = make_desc(plan.fused_bias, &desc); e.failure()) return e;
  const float alpha = 1.f, beta = 0.f;
  void* d = out->untyped_data();
  TE_LT(cublasLtMatmul(handle, desc.d, &alpha, b.untyped_data(), la.l, a.untyped_data(), lb.l,
                       &beta, d, lc.l, d, lc.l, &plan.algo, workspace, kWorkspaceBytes, stream),
        "cublasLtMatmul");
  if (has_bias && !plan.fused_bias) {
    return CudaError(LaunchAddBias(d, BiasCode(td), bias.untyped_data(), BiasCode(tbias), M, N,
                                   stream),
                     "gemm (bias fallback)");
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(TeJaxGemm, GemmImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()          // a (M, K) fp8
                                  .Arg<ffi::AnyBuffer>()          // b (N, K) fp8
                                  .Arg<ffi::Buffer<ffi::F32>>()   // a_sinv: () or native block layout
                                  .Arg<ffi::Buffer<ffi::F32>>()   // b_sinv: () or native block layout
                                  .Arg<ffi::AnyBuffer>()          // bias (N,) or (0,) placeholder
                                  .Ret<ffi::AnyBuffer>()          // out (M, N) bf16/fp16/fp32
                                  .Attr<int64_t>("a_mode")        // 0 tensor, 1 VEC128, 2 BLK128x128
                                  .Attr<int64_t>("b_mode")
                                  .Attr<int64_t>("fast_accum")    // 0/1, per-tensor only
                                  .Attr<int64_t>("has_bias"));    // 0/1

}  // namespace te_jax
