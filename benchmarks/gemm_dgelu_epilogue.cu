// Whether cuBLASLt's DGELU epilogue could fuse the MLP's activation backward
// into its dgrad GEMM: dz (M, F) = g (M, N) @ wo (F, N)^T in FP8 (g e5m2,
// wo e4m3, te_jax's layout, see custom_calls/ffi/gemm.cc), out bf16, times
// gelu_tanh'(h) with h (M, F) bf16 read as the epilogue's aux input. The
// fusion would keep dz out of memory (512 MiB at 16384 x 16384), but the
// epilogue's kernels are what decides it. Checks a small problem of both
// epilogues against a host reference, then times every heuristic answer of
// each at the MLP block's size (16384 x 16384 x 4096), split and fast
// accumulation. The data are small multiples of 1/8 (exact in FP8, so the
// check is tight); both epilogues are timed on the same data.
//
// Build and run on the GPU machine:
//   nvcc -O2 -std=c++17 -o /tmp/gemm_dgelu benchmarks/gemm_dgelu_epilogue.cu -lcublasLt
//   /tmp/gemm_dgelu
// Run AA (2026-12-04, calls 3-4) ran it in two steps, the first timing only
// each epilogue's first answer; this file times every answer of both.
#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <vector>

#define CK(x) do { auto s = (x); if (s != 0) { std::printf("FAIL %s: %d line %d\n", #x, (int)s, __LINE__); return 1; } } while (0)

template <typename T> static void set(cublasLtMatmulDesc_t d, cublasLtMatmulDescAttributes_t a, T v) {
  cublasLtMatmulDescSetAttribute(d, a, &v, sizeof(v));
}

static float dgelu(float x) {
  const float c = 0.7978845608f, k = 0.044715f;
  float u = c * (x + k * x * x * x);
  float t = std::tanh(u);
  return 0.5f * (1.f + t) + 0.5f * x * (1.f - t * t) * c * (1.f + 3.f * k * x * x);
}

static int run(cublasLtHandle_t lt, long M, long F, long N, int epi_mode, int fast, bool check,
               int a_e5m2) {
  // epi_mode 0: default, 1: DGELU with bf16 aux
  std::vector<uint8_t> ha(M * N), hb(F * N);
  std::vector<__nv_bfloat16> hh(M * F);
  std::vector<float> fa(M * N), fb(F * N), fh(M * F);
  srand(1);
  for (long i = 0; i < M * N; ++i) {
    float v = (rand() % 17 - 8) / 4.f;
    if (a_e5m2) { __nv_fp8_e5m2 q(v); ha[i] = q.__x; fa[i] = float(q); }
    else { __nv_fp8_e4m3 q(v); ha[i] = q.__x; fa[i] = float(q); }
  }
  for (long i = 0; i < F * N; ++i) {
    float v = (rand() % 17 - 8) / 8.f; __nv_fp8_e4m3 q(v); hb[i] = q.__x; fb[i] = float(q);
  }
  for (long i = 0; i < M * F; ++i) {
    float v = (rand() % 2001 - 1000) / 300.f; hh[i] = __float2bfloat16(v); fh[i] = __bfloat162float(hh[i]);
  }
  void *da, *db, *dh, *dd, *ws, *sa, *sb;
  size_t wsz = 32 << 20;
  CK(cudaMalloc(&da, M * N)); CK(cudaMalloc(&db, F * N)); CK(cudaMalloc(&dh, M * F * 2));
  CK(cudaMalloc(&dd, M * F * 2)); CK(cudaMalloc(&ws, wsz)); CK(cudaMalloc(&sa, 4)); CK(cudaMalloc(&sb, 4));
  float one = 1.f, sav = 0.5f, sbv = 2.0f, zero = 0.f;
  CK(cudaMemcpy(da, ha.data(), M * N, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(db, hb.data(), F * N, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(dh, hh.data(), M * F * 2, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(sa, &sav, 4, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(sb, &sbv, 4, cudaMemcpyHostToDevice));
  cublasLtMatmulDesc_t d;
  CK(cublasLtMatmulDescCreate(&d, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  set(d, CUBLASLT_MATMUL_DESC_TRANSA, CUBLAS_OP_T);
  set(d, CUBLASLT_MATMUL_DESC_TRANSB, CUBLAS_OP_N);
  set(d, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, (const void*)sb);   // cuBLAS A = our b (wo)
  set(d, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, (const void*)sa);   // cuBLAS B = our a (g)
  set(d, CUBLASLT_MATMUL_DESC_FAST_ACCUM, (int8_t)fast);
  if (epi_mode == 1) {
    set(d, CUBLASLT_MATMUL_DESC_EPILOGUE, CUBLASLT_EPILOGUE_DGELU);
    set(d, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, (const void*)dh);
    set(d, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, (int64_t)F);
    set(d, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_DATA_TYPE, (int32_t)CUDA_R_16BF);
  }
  cublasLtMatrixLayout_t la, lb, lc;
  CK(cublasLtMatrixLayoutCreate(&la, CUDA_R_8F_E4M3, N, F, N));
  CK(cublasLtMatrixLayoutCreate(&lb, a_e5m2 ? CUDA_R_8F_E5M2 : CUDA_R_8F_E4M3, N, M, N));
  CK(cublasLtMatrixLayoutCreate(&lc, CUDA_R_16BF, F, M, F));
  cublasLtMatmulPreference_t pref;
  CK(cublasLtMatmulPreferenceCreate(&pref));
  cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &wsz, sizeof(wsz));
  cublasLtMatmulHeuristicResult_t res[8];
  int n = 0;
  auto st = cublasLtMatmulAlgoGetHeuristic(lt, d, la, lb, lc, lc, pref, 8, res, &n);
  std::printf("M=%ld F=%ld N=%ld epi=%s fast=%d a=%s: heuristic status %d, %d answer(s)\n", M, F, N,
              epi_mode ? "DGELU" : "default", fast, a_e5m2 ? "e5m2" : "e4m3", (int)st, n);
  if (st != 0 || n == 0) return 0;
  int pick = 0;
  auto call = [&]() {
    return cublasLtMatmul(lt, d, &one, db, la, da, lb, &zero, dd, lc, dd, lc, &res[pick].algo, ws, wsz, 0);
  };
  auto s2 = call();
  CK(cudaDeviceSynchronize());
  if (s2 != 0) { std::printf("  matmul status %d\n", (int)s2); return 0; }
  if (check) {
    std::vector<__nv_bfloat16> out(M * F);
    CK(cudaMemcpy(out.data(), dd, M * F * 2, cudaMemcpyDeviceToHost));
    double maxerr = 0, maxref = 0;
    for (long m = 0; m < M; ++m)
      for (long f = 0; f < F; ++f) {
        double acc = 0;
        for (long k = 0; k < N; ++k) acc += double(fa[m * N + k]) * fb[f * N + k];
        acc *= sav * sbv;
        if (epi_mode == 1) acc *= dgelu(fh[m * F + f]);
        double got = __bfloat162float(out[m * F + f]);
        maxerr = std::fmax(maxerr, std::fabs(got - acc));
        maxref = std::fmax(maxref, std::fabs(acc));
      }
    std::printf("  check: max |err| %.4g, max |ref| %.4g, rel %.3g\n", maxerr, maxref, maxerr / maxref);
  } else {
    cudaEvent_t e0, e1; cudaEventCreate(&e0); cudaEventCreate(&e1);
    for (pick = 0; pick < n; ++pick) {
    for (int i = 0; i < 10; ++i) call();
    std::vector<float> ts;
    for (int r = 0; r < 5; ++r) {
      cudaEventRecord(e0);
      for (int i = 0; i < 20; ++i) call();
      cudaEventRecord(e1); cudaEventSynchronize(e1);
      float ms; cudaEventElapsedTime(&ms, e0, e1); ts.push_back(ms / 20);
    }
    std::sort(ts.begin(), ts.end());
    std::printf("  answer %d median %.4f ms (%.0f TFLOP/s)\n", pick, ts[2], 2.0 * M * F * N / ts[2] / 1e9);
    }
  }
  cudaFree(da); cudaFree(db); cudaFree(dh); cudaFree(dd); cudaFree(ws); cudaFree(sa); cudaFree(sb);
  return 0;
}

int main() {
  cublasLtHandle_t lt;
  CK(cublasLtCreate(&lt));
  std::printf("cublasLt version %zu\n", cublasLtGetVersion());
  for (int a5 : {1, 0})   // the gradient operand in e5m2 (te_jax's) and in e4m3
    for (int fast : {0, 1}) {
      run(lt, 256, 384, 256, 1, fast, true, a5);
      run(lt, 256, 384, 256, 0, fast, true, a5);
    }
  for (int fast : {0, 1})
    for (int epi : {0, 1}) run(lt, 16384, 16384, 4096, epi, fast, false, 1);
  return 0;
}
