// Shared pieces of the sm_90 GEMM harnesses (blockwise_gemm_sm90.cu,
// grouped_gemm_sm90.cu): random device data, poisoned outputs, error norms,
// cuBLASLt baselines in te_jax's layout, and interleaved event timing.
//
// Data is never zero: FP8 operands are N(0, 1) samples, scales positive
// powers of two times (1 + u/2) with u in [0, 1). Outputs are filled with
// bfloat16 NaN (0xFFFF) before every checked run, so an element the kernel
// never wrote shows as NaN in the error count.
#pragma once

#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <string>
#include <vector>

#include "check_cuda.h"
#include "kernels/gemm_sm90.cuh"

#define CHECK_LT(x) CHECK_STATUS(x, CUBLAS_STATUS_SUCCESS, cublasLtGetStatusName)

namespace bench {

// ------------------------------------------------------------ random data --

__host__ __device__ inline uint64_t Mix(uint64_t x) {  // splitmix64 finalizer
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}
__host__ __device__ inline float Uniform(uint64_t seed, uint64_t i) {  // [0, 1)
  return static_cast<float>(Mix(seed * 0x100000001B3ull ^ Mix(i)) >> 40) * (1.0f / 16777216.0f);
}
__device__ inline float Normal(uint64_t seed, uint64_t i) {  // Box-Muller
  const float u1 = fmaxf(Uniform(seed, 2 * i), 1e-7f), u2 = Uniform(seed, 2 * i + 1);
  return sqrtf(-2.0f * logf(u1)) * cospif(2.0f * u2);
}

template <typename Fp8>
__global__ void FillFp8Kernel(Fp8* p, size_t n, uint64_t seed) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n;
       i += size_t(gridDim.x) * blockDim.x)
    p[i] = Fp8(Normal(seed, i));
}
__global__ void FillBf16Kernel(__nv_bfloat16* p, size_t n, uint64_t seed, float scale) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n;
       i += size_t(gridDim.x) * blockDim.x)
    p[i] = __float2bfloat16(scale * Normal(seed, i));
}
// Scales 2^e * (1 + u/2), e in [-3, 3]; `valid(i)` false (layout padding)
// gets NaN, so a kernel that reads padding for a real element fails.
__global__ void FillScaleKernel(float* p, int rows_outer, int ld, int valid_inner,
                                uint64_t seed) {
  const size_t n = size_t(rows_outer) * ld;
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n;
       i += size_t(gridDim.x) * blockDim.x) {
    const int inner = static_cast<int>(i % ld);
    const float u = Uniform(seed, i), v = Uniform(seed + 1, i);
    p[i] = inner < valid_inner ? ldexpf(1.0f + 0.5f * u, static_cast<int>(v * 7.0f) - 3)
                               : __int_as_float(0x7fc00000);
  }
}
__global__ void PoisonKernel(uint16_t* p, size_t n) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n;
       i += size_t(gridDim.x) * blockDim.x)
    p[i] = 0xFFFF;
}

inline int Blocks(size_t n) { return static_cast<int>(std::min<size_t>((n + 255) / 256, 4096)); }

template <typename Fp8>
void FillFp8(void* p, size_t n, uint64_t seed) {
  if (!n) return;
  FillFp8Kernel<Fp8><<<Blocks(n), 256>>>(static_cast<Fp8*>(p), n, seed);
  CHECK_CUDA(cudaGetLastError());
}
inline void FillBf16(void* p, size_t n, uint64_t seed, float scale = 1.0f) {
  if (!n) return;
  FillBf16Kernel<<<Blocks(n), 256>>>(static_cast<__nv_bfloat16*>(p), n, seed, scale);
  CHECK_CUDA(cudaGetLastError());
}
// A scale grid of rows_outer x ld floats whose first valid_inner columns are
// real scales and the rest NaN padding.
inline void FillScales(float* p, int rows_outer, int ld, int valid_inner, uint64_t seed) {
  const size_t n = size_t(rows_outer) * ld;
  if (!n) return;
  FillScaleKernel<<<Blocks(n), 256>>>(p, rows_outer, ld, valid_inner, seed);
  CHECK_CUDA(cudaGetLastError());
}
inline void Poison(void* p, size_t n_bf16) {
  if (!n_bf16) return;
  PoisonKernel<<<Blocks(n_bf16), 256>>>(static_cast<uint16_t*>(p), n_bf16);
  CHECK_CUDA(cudaGetLastError());
}

template <typename T>
T* DeviceAlloc(size_t n) {
  void* p = nullptr;
  CHECK_CUDA(cudaMalloc(&p, std::max<size_t>(n, 1) * sizeof(T)));
  return static_cast<T*>(p);
}
template <typename T>
std::vector<T> ToHost(const void* p, size_t n) {
  std::vector<T> h(n);
  if (n) CHECK_CUDA(cudaMemcpy(h.data(), p, n * sizeof(T), cudaMemcpyDeviceToHost));
  return h;
}

// ----------------------------------------------------------- scale grids --

inline int RoundUp(int x, int m) { return (x + m - 1) / m * m; }
inline int KBlocks(long k) { return static_cast<int>((k + 127) / 128); }

// te_jax's native scale grid of one operand: outer x ld floats, `valid`
// real columns (custom_calls/README.md "Scale layouts").
struct ScaleGrid {
  int outer, ld, valid;
  size_t count() const { return size_t(outer) * ld; }
};
inline ScaleGrid Grid(te_jax::sm90::ScaleMode mode, long rows, long k) {
  const int kb = KBlocks(k);
  if (mode == te_jax::sm90::ScaleMode::kVec128)
    return {kb, RoundUp(static_cast<int>(rows), 4), static_cast<int>(rows)};
  return {static_cast<int>((rows + 127) / 128), RoundUp(kb, 4), kb};
}
// Scale of element (r, kk) (row r, contraction index kk) in a native grid.
inline float ScaleAt(const std::vector<float>& s, const ScaleGrid& g,
                     te_jax::sm90::ScaleMode mode, long r, long kk) {
  return mode == te_jax::sm90::ScaleMode::kVec128 ? s[size_t(kk / 128) * g.ld + r]
                                                  : s[size_t(r / 128) * g.ld + kk / 128];
}

// --------------------------------------------------------------- checking --

// ||got - want|| / ||want|| over bfloat16 outputs, and the count of elements
// of `got` that are not finite (unwritten poison or a real NaN/Inf).
struct ErrorNorm {
  double rel = 0;
  long long bad = 0;
};
__global__ void DiffKernel(const __nv_bfloat16* got, const __nv_bfloat16* want, size_t n,
                           double* sums, unsigned long long* bad) {
  double d2 = 0, w2 = 0;
  unsigned long long nb = 0;
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n;
       i += size_t(gridDim.x) * blockDim.x) {
    const double g = __bfloat162float(got[i]), w = __bfloat162float(want[i]);
    if (!isfinite(g)) { ++nb; continue; }
    d2 += (g - w) * (g - w);
    w2 += w * w;
  }
  atomicAdd(&sums[0], d2);
  atomicAdd(&sums[1], w2);
  atomicAdd(bad, nb);
}
inline ErrorNorm DeviceDiff(const void* got, const void* want, size_t n) {
  double* sums = DeviceAlloc<double>(2);
  unsigned long long* bad = DeviceAlloc<unsigned long long>(1);
  CHECK_CUDA(cudaMemset(sums, 0, 2 * sizeof(double)));
  CHECK_CUDA(cudaMemset(bad, 0, sizeof(*bad)));
  DiffKernel<<<Blocks(n), 256>>>(static_cast<const __nv_bfloat16*>(got),
                                 static_cast<const __nv_bfloat16*>(want), n, sums, bad);
  CHECK_CUDA(cudaGetLastError());
  auto h = ToHost<double>(sums, 2);
  auto b = ToHost<unsigned long long>(bad, 1);
  CHECK_CUDA(cudaFree(sums));
  CHECK_CUDA(cudaFree(bad));
  return {h[1] > 0 ? std::sqrt(h[0] / h[1]) : (h[0] > 0 ? INFINITY : 0.0),
          static_cast<long long>(b[0])};
}
// The same against a host float64 reference.
inline ErrorNorm HostDiff(const std::vector<__nv_bfloat16>& got, const std::vector<double>& want) {
  double d2 = 0, w2 = 0;
  long long bad = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    const double g = __bfloat162float(got[i]);
    if (!std::isfinite(g)) { ++bad; continue; }
    d2 += (g - want[i]) * (g - want[i]);
    w2 += want[i] * want[i];
  }
  return {w2 > 0 ? std::sqrt(d2 / w2) : (d2 > 0 ? INFINITY : 0.0), bad};
}

// sum over the 128-blocks [b0, b0 + 128) of [lo, hi) of (a . b over the
// block) * scale(b0), in float64: the reference of a GEMM whose partial sums
// are scaled once per 128 of the contraction. a, b: one row each, indexed
// by the contraction.
template <class Scale>
double BlockDot(const float* a, const float* b, long lo, long hi, Scale scale) {
  double acc = 0;
  for (long b0 = lo; b0 < hi; b0 += 128) {
    double part = 0;
    for (long t = b0; t < std::min(hi, b0 + 128); ++t) part += double(a[t]) * b[t];
    acc += part * scale(b0);
  }
  return acc;
}

// fp8 bytes to float on the host.
inline std::vector<float> Fp8ToFloat(const std::vector<uint8_t>& bytes, bool e5m2) {
  std::vector<float> f(bytes.size());
  for (size_t i = 0; i < bytes.size(); ++i) {
    if (e5m2) {
      __nv_fp8_e5m2 v;
      v.__x = bytes[i];
      f[i] = static_cast<float>(v);
    } else {
      __nv_fp8_e4m3 v;
      v.__x = bytes[i];
      f[i] = static_cast<float>(v);
    }
  }
  return f;
}

// One blockwise problem's FP8 operands on the device (one input set): a (m, k)
// and b (n, k) e4m3, row-major, with their scales in te_jax's native grids
// (a_mode / b_mode), filled from `seed`.
struct BlockwiseOperands {
  long m, n, k;
  te_jax::sm90::ScaleMode a_mode, b_mode;
  ScaleGrid ga, gb;
  uint8_t* a = nullptr;
  uint8_t* b = nullptr;
  float* sa = nullptr;
  float* sb = nullptr;
  BlockwiseOperands(long m_, long n_, long k_, te_jax::sm90::ScaleMode am,
                    te_jax::sm90::ScaleMode bm, uint64_t seed)
      : m(m_), n(n_), k(k_), a_mode(am), b_mode(bm), ga(Grid(am, m_, k_)), gb(Grid(bm, n_, k_)) {
    a = DeviceAlloc<uint8_t>(m * k);
    b = DeviceAlloc<uint8_t>(n * k);
    sa = DeviceAlloc<float>(ga.count());
    sb = DeviceAlloc<float>(gb.count());
    FillFp8<__nv_fp8_e4m3>(a, m * k, seed);
    FillFp8<__nv_fp8_e4m3>(b, n * k, seed + 1);
    FillScales(sa, ga.outer, ga.ld, ga.valid, seed + 2);
    FillScales(sb, gb.outer, gb.ld, gb.valid, seed + 3);
  }
  ~BlockwiseOperands() {
    cudaFree(a);
    cudaFree(b);
    cudaFree(sa);
    cudaFree(sb);
  }
  BlockwiseOperands(const BlockwiseOperands&) = delete;
  BlockwiseOperands& operator=(const BlockwiseOperands&) = delete;
};

// float64 host reference of out (m, n) = sum over K blocks of (sa * sb) * (a . b).
inline std::vector<double> BlockwiseHostReference(const BlockwiseOperands& op) {
  const auto a = Fp8ToFloat(ToHost<uint8_t>(op.a, op.m * op.k), false);
  const auto b = Fp8ToFloat(ToHost<uint8_t>(op.b, op.n * op.k), false);
  const auto sa = ToHost<float>(op.sa, op.ga.count());
  const auto sb = ToHost<float>(op.sb, op.gb.count());
  std::vector<double> out(size_t(op.m) * op.n);
  for (long i = 0; i < op.m; ++i) {
    for (long j = 0; j < op.n; ++j) {
      out[size_t(i) * op.n + j] = BlockDot(&a[i * op.k], &b[j * op.k], 0, op.k, [&](long k0) {
        return double(ScaleAt(sa, op.ga, op.a_mode, i, k0)) * ScaleAt(sb, op.gb, op.b_mode, j, k0);
      });
    }
  }
  return out;
}

// ---------------------------------------------------------------- cuBLASLt --

// te_jax's cuBLASLt FP8 GEMM (custom_calls/ffi/gemm.cc): out (M, N) bf16 =
// a (M, K) @ b (N, K)^T as cuBLAS "TN" with A = b, B = a; scale modes 0
// per-tensor, 1 VEC128, 2 BLK128x128 on te_jax's native layouts; the
// heuristic's first answer (te_jax's default); 32 MiB workspace.
class LtGemm {
 public:
  // lda / ldb: row strides of a and b in elements (0: K).
  LtGemm(cublasLtHandle_t h, long M, long N, long K, cudaDataType_t ta, cudaDataType_t tb,
         cudaDataType_t td, int a_mode, int b_mode, bool fast_accum, const void* ws,
         size_t ws_bytes, long lda = 0, long ldb = 0)
      : h_(h), ws_(const_cast<void*>(ws)), ws_bytes_(ws_bytes) {
    CHECK_LT(cublasLtMatmulDescCreate(&desc_, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    const cublasOperation_t opT = CUBLAS_OP_T, opN = CUBLAS_OP_N;
    Set(CUBLASLT_MATMUL_DESC_TRANSA, opT);
    Set(CUBLASLT_MATMUL_DESC_TRANSB, opN);
    fp8_ = ta != CUDA_R_16BF;
    if (fp8_) {
      if (a_mode != 0) {
        const int32_t ma = Mode(b_mode), mb = Mode(a_mode);  // cuBLAS A is our b
        Set(CUBLASLT_MATMUL_DESC_A_SCALE_MODE, ma);
        Set(CUBLASLT_MATMUL_DESC_B_SCALE_MODE, mb);
      }
      const int8_t fast = fast_accum ? 1 : 0;
      Set(CUBLASLT_MATMUL_DESC_FAST_ACCUM, fast);
    }
    CHECK_LT(cublasLtMatrixLayoutCreate(&la_, tb, K, N, ldb ? ldb : K));
    CHECK_LT(cublasLtMatrixLayoutCreate(&lb_, ta, K, M, lda ? lda : K));
    CHECK_LT(cublasLtMatrixLayoutCreate(&lc_, td, N, M, N));
    cublasLtMatmulPreference_t pref;
    CHECK_LT(cublasLtMatmulPreferenceCreate(&pref));
    const uint64_t ws64 = ws_bytes;
    CHECK_LT(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                                  &ws64, sizeof(ws64)));
    // Scale pointers must be set for the heuristic to see an FP8 problem;
    // any non-null value does (the real ones are set per call).
    if (fp8_) SetScales(ws, ws);
    cublasLtMatmulHeuristicResult_t res;
    int found = 0;
    CHECK_LT(cublasLtMatmulAlgoGetHeuristic(h_, desc_, la_, lb_, lc_, lc_, pref, 1, &res, &found));
    CHECK_LT(cublasLtMatmulPreferenceDestroy(pref));
    if (found < 1) {
      std::fprintf(stderr, "cuBLASLt: no algorithm for M=%ld N=%ld K=%ld\n", M, N, K);
      std::exit(1);
    }
    algo_ = res.algo;
  }
  ~LtGemm() {
    cublasLtMatrixLayoutDestroy(la_);
    cublasLtMatrixLayoutDestroy(lb_);
    cublasLtMatrixLayoutDestroy(lc_);
    cublasLtMatmulDescDestroy(desc_);
  }
  LtGemm(const LtGemm&) = delete;
  LtGemm& operator=(const LtGemm&) = delete;

  // Enqueues out = a @ b^T; returns the cuBLAS status.
  cublasStatus_t Run(const void* a, const void* b, const float* a_sinv, const float* b_sinv,
                     void* out, cudaStream_t stream) {
    if (fp8_) SetScales(a_sinv, b_sinv);
    const float alpha = 1.f, beta = 0.f;
    return cublasLtMatmul(h_, desc_, &alpha, b, la_, a, lb_, &beta, out, lc_, out, lc_, &algo_,
                          ws_, ws_bytes_, stream);
  }

 private:
  static int32_t Mode(int m) {
    return m == 1 ? CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F
                  : CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F;
  }
  template <typename T>
  void Set(cublasLtMatmulDescAttributes_t attr, const T& v) {
    CHECK_LT(cublasLtMatmulDescSetAttribute(desc_, attr, &v, sizeof(v)));
  }
  void SetScales(const void* a_sinv, const void* b_sinv) {
    Set(CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, b_sinv);
    Set(CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, a_sinv);
  }

  cublasLtHandle_t h_;
  void* ws_;
  size_t ws_bytes_;
  bool fp8_ = true;
  cublasLtMatmulDesc_t desc_ = nullptr;
  cublasLtMatrixLayout_t la_ = nullptr, lb_ = nullptr, lc_ = nullptr;
  cublasLtMatmulAlgo_t algo_{};
};

// ----------------------------------------------------------------- timing --

// Times candidates in interleaved rounds (each round times every candidate
// once, so clock and power drift spread over all); a sample is `reps` calls
// between two events, reps sized so that a sample lasts >= min_sample_ms.
// Returns each candidate's median ms per call; NaN for one whose call fails.
struct Candidate {
  std::string name;
  std::function<bool(int rep)> run;  // enqueue one call (rep selects the input set)
};
inline std::vector<double> TimeInterleaved(std::vector<Candidate>& cands, int rounds,
                                           double min_sample_ms = 2.0) {
  cudaEvent_t e0, e1;
  CHECK_CUDA(cudaEventCreate(&e0));
  CHECK_CUDA(cudaEventCreate(&e1));
  std::vector<int> reps(cands.size(), 1);
  std::vector<bool> ok(cands.size(), true);
  for (size_t c = 0; c < cands.size(); ++c) {  // warm up, then size the samples
    for (int w = 0; w < 3 && ok[c]; ++w) ok[c] = cands[c].run(w);
    if (!ok[c] || cudaDeviceSynchronize() != cudaSuccess) {
      ok[c] = false;
      cudaGetLastError();
      continue;
    }
    CHECK_CUDA(cudaEventRecord(e0));
    for (int r = 0; r < 3; ++r) cands[c].run(r);
    CHECK_CUDA(cudaEventRecord(e1));
    CHECK_CUDA(cudaEventSynchronize(e1));
    float ms = 0;
    CHECK_CUDA(cudaEventElapsedTime(&ms, e0, e1));
    reps[c] = std::max(1, std::min(200, static_cast<int>(std::ceil(min_sample_ms / (ms / 3)))));
  }
  std::vector<std::vector<double>> samples(cands.size());
  for (int round = 0; round < rounds; ++round) {
    for (size_t c = 0; c < cands.size(); ++c) {
      if (!ok[c]) continue;
      CHECK_CUDA(cudaEventRecord(e0));
      for (int r = 0; r < reps[c]; ++r) cands[c].run(r);
      CHECK_CUDA(cudaEventRecord(e1));
      CHECK_CUDA(cudaEventSynchronize(e1));
      float ms = 0;
      CHECK_CUDA(cudaEventElapsedTime(&ms, e0, e1));
      samples[c].push_back(ms / reps[c]);
    }
  }
  CHECK_CUDA(cudaEventDestroy(e0));
  CHECK_CUDA(cudaEventDestroy(e1));
  std::vector<double> med(cands.size(), NAN);
  for (size_t c = 0; c < cands.size(); ++c) {
    if (!ok[c] || samples[c].empty()) continue;
    auto s = samples[c];
    std::nth_element(s.begin(), s.begin() + s.size() / 2, s.end());
    med[c] = s[s.size() / 2];
  }
  return med;
}

// Input sets to rotate through so that repeated calls do not find their
// operands in the 50 MB L2: at least 2, enough for >= 256 MB, at most 8.
inline int RotatingSets(size_t bytes_per_set) {
  const size_t want = (size_t(256) << 20) / std::max<size_t>(bytes_per_set, 1) + 1;
  return static_cast<int>(std::max<size_t>(2, std::min<size_t>(8, want)));
}

// The blockwise GEMM shapes both blockwise harnesses time (M, N, K): 8192^3
// and the layer shapes of BENCHMARKS.md (MLP 8 x 2048 tokens, 4096 -> 16384
// -> 4096; its backward), the Llama preset of examples/gpt_model.py (8 x 4096
// tokens, hidden 2048, SwiGLU mlp 5632: fused gate+up N = 11264), DeepGEMM's
// published M = 4096 table.
struct BlockwiseShape {
  const char* label;
  long m, n, k;
  bool wgrad;  // 1x128 x 1x128 (else 1x128 x 128x128)
};
inline const std::vector<BlockwiseShape>& BlockwiseShapes() {
  static const std::vector<BlockwiseShape> shapes = {
      {"square4k", 4096, 4096, 4096, false},
      {"square8k", 8192, 8192, 8192, false},
      {"layer16k8k8k", 16384, 8192, 8192, false},
      {"mlp_fc1_fprop", 16384, 16384, 4096, false},
      {"mlp_fc1_dgrad", 16384, 4096, 16384, false},
      {"mlp_fc1_wgrad", 4096, 16384, 16384, true},
      {"mlp_fc2_wgrad", 16384, 4096, 16384, true},
      {"llama_qkv", 32768, 4096, 2048, false},
      {"llama_out", 32768, 2048, 2048, false},
      {"llama_up", 32768, 11264, 2048, false},
      {"llama_down", 32768, 2048, 5632, false},
      {"llama_up_dgrad", 32768, 2048, 11264, false},
      {"llama_down_dgrad", 32768, 5632, 2048, false},
      {"llama_up_wgrad", 2048, 11264, 32768, true},
      {"dg_4096x2112x7168", 4096, 2112, 7168, false},
      {"dg_4096x24576x1536", 4096, 24576, 1536, false},
      {"dg_4096x32768x512", 4096, 32768, 512, false},
      {"dg_4096x7168x16384", 4096, 7168, 16384, false},
      {"dg_4096x4096x7168", 4096, 4096, 7168, false},
      {"dg_4096x7168x2048", 4096, 7168, 2048, false},
  };
  return shapes;
}

// Command-line options shared by the harnesses: "--list" prints the variant
// names; "--checks" / "--timing" run one part only (default both); "--only a,b" keeps the named variants
// (tools/gpu_kernels.sh checks each variant in its own process, so a variant
// that faults cannot take the others down, then times those that passed).
struct Options {
  bool checks = true, timing = true, quick = false, sweep = false, list = false;
  int rounds = 7;
  std::vector<std::string> only;
  bool Keeps(const char* name) const {
    return only.empty() || std::find(only.begin(), only.end(), name) != only.end();
  }
};
inline Options ParseOptions(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--checks") o.timing = false;
    else if (a == "--list") o.list = true;
    else if (a == "--timing") o.checks = false;
    else if (a == "--quick") o.quick = true;
    else if (a == "--sweep") o.sweep = true;
    else if (a == "--rounds" && i + 1 < argc) o.rounds = std::atoi(argv[++i]);
    else if (a == "--only" && i + 1 < argc) {
      std::string list = argv[++i];
      for (size_t at = 0; at <= list.size();) {
        const size_t comma = std::min(list.find(',', at), list.size());
        if (comma > at) o.only.push_back(list.substr(at, comma - at));
        at = comma + 1;
      }
    } else {
      std::fprintf(stderr,
                   "usage: %s [--list | --checks | --timing] [--only v1,v2] [--quick] "
                   "[--sweep] [--rounds N]\n", argv[0]);
      std::exit(2);
    }
  }
  return o;
}

// Prints the variant names (--list) and returns true, or does nothing.
template <class V>
bool ListVariants(const Options& o, const std::vector<V>& variants) {
  if (!o.list) return false;
  for (const V& v : variants) std::printf("%s\n", v.name);
  return true;
}

inline int SmCount() {
  int dev = 0, sms = 0;
  CHECK_CUDA(cudaGetDevice(&dev));
  CHECK_CUDA(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  return sms;
}

}  // namespace bench
