// How much the FP8 GEMMs of te_jax leave on the table by taking cuBLASLt's
// first heuristic answer: times every algorithm the heuristic returns (up to
// 16) for one problem, in te_jax's layout (out (M, N) = a (M, K) @ b (N, K)^T,
// bf16 out, cuBLAS A = our b with TRANSA=T, see custom_calls/ffi/gemm.cc),
// on N(0, 1) data (zeros run faster and would mislead).
//
// Build and run on the GPU machine:
//   nvcc -O2 -std=c++17 -o /tmp/gemm_algos benchmarks/gemm_algos.cu -lcublasLt
//   /tmp/gemm_algos M N K A_MODE B_MODE [E5M2] [FAST_ACCUM] [RESIDUAL]
// modes: 0 per-tensor, 1 VEC128 (1x128), 2 BLK128x128; E5M2 = 1 makes a
// E5M2, 2 makes b E5M2 (the gradient operand of dgrad / wgrad), 0 neither.
// RESIDUAL = 1: out = a @ b^T + c with c a bf16 (M, N) input of its own
// (cuBLASLt's C, beta = 1; the residual add of a transformer block in the
// GEMM's epilogue), to see which algorithms take it and what it costs.
// Prints one line per algorithm (heuristic rank, ms, TFLOP/s,
// tile/stages/cluster ids) and a last SUMMARY line.
#include <cublasLt.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

#include "check_cuda.h"

#define CHECK_LT(x) CHECK_STATUS(x, CUBLAS_STATUS_SUCCESS, cublasLtGetStatusName)

namespace {

// FP8 bytes of N(0, 1) samples: 1M random values tiled over the buffer.
template <typename Fp8>
void* RandomFp8(size_t n, unsigned seed) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> dist;
  std::vector<Fp8> host(std::min<size_t>(n, 1u << 20));
  for (auto& v : host) v = Fp8(dist(gen));
  void* dev;
  CHECK_CUDA(cudaMalloc(&dev, n));
  for (size_t off = 0; off < n; off += host.size())
    CHECK_CUDA(cudaMemcpy(static_cast<char*>(dev) + off, host.data(),
                          std::min(host.size(), n - off), cudaMemcpyHostToDevice));
  return dev;
}

// Scales of 1.0 in the layout a mode implies (gemm.cc's CheckScale).
float* Ones(int mode, long rows, long K) {
  const long kb = (K + 127) / 128;
  const long n = mode == 0 ? 1 : mode == 1 ? kb * rows : (rows + 127) / 128 * ((kb + 3) / 4 * 4);
  std::vector<float> host(n, 1.f);
  float* dev;
  CHECK_CUDA(cudaMalloc(&dev, n * sizeof(float)));
  CHECK_CUDA(cudaMemcpy(dev, host.data(), n * sizeof(float), cudaMemcpyHostToDevice));
  return dev;
}

cublasLtMatmulMatrixScale_t ScaleMode(int mode) {
  return mode == 1 ? CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F
                   : CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F;
}

int ConfigAttr(const cublasLtMatmulAlgo_t& algo, cublasLtMatmulAlgoConfigAttributes_t attr) {
  uint32_t v = 0;
  size_t written = 0;
  if (cublasLtMatmulAlgoConfigGetAttribute(&algo, attr, &v, sizeof(v), &written) !=
      CUBLAS_STATUS_SUCCESS)
    return -1;
  return static_cast<int>(v);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 6) {
    std::fprintf(stderr, "usage: %s M N K A_MODE B_MODE [E5M2] [FAST_ACCUM] [RESIDUAL]\n",
                 argv[0]);
    return 2;
  }
  const long M = std::atol(argv[1]), N = std::atol(argv[2]), K = std::atol(argv[3]);
  const int a_mode = std::atoi(argv[4]), b_mode = std::atoi(argv[5]);
  const int e5m2 = argc > 6 ? std::atoi(argv[6]) : 0;
  const bool a_e5m2 = e5m2 == 1, b_e5m2 = e5m2 == 2;
  const int8_t fast = argc > 7 ? static_cast<int8_t>(std::atoi(argv[7])) : 0;
  const bool residual = argc > 8 && std::atoi(argv[8]) != 0;
  const size_t ws_bytes = 32u << 20;

  void* a = a_e5m2 ? RandomFp8<__nv_fp8_e5m2>(M * K, 1) : RandomFp8<__nv_fp8_e4m3>(M * K, 1);
  void* b = b_e5m2 ? RandomFp8<__nv_fp8_e5m2>(N * K, 2) : RandomFp8<__nv_fp8_e4m3>(N * K, 2);
  float* sa = Ones(a_mode, M, K);
  float* sb = Ones(b_mode, N, K);
  void *d, *ws, *c = nullptr;
  CHECK_CUDA(cudaMalloc(&d, M * N * 2));
  if (residual) {  // finite bf16 values: every one 0x3F3F (about 0.75)
    CHECK_CUDA(cudaMalloc(&c, M * N * 2));
    CHECK_CUDA(cudaMemset(c, 0x3F, M * N * 2));
  }
  CHECK_CUDA(cudaMalloc(&ws, ws_bytes));

  cublasLtHandle_t handle;
  CHECK_LT(cublasLtCreate(&handle));
  cublasLtMatmulDesc_t desc;
  CHECK_LT(cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  const cublasOperation_t opT = CUBLAS_OP_T, opN = CUBLAS_OP_N;
  CHECK_LT(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSA, &opT, sizeof(opT)));
  CHECK_LT(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSB, &opN, sizeof(opN)));
  CHECK_LT(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &sb,
                                          sizeof(sb)));  // cuBLAS A is our b
  CHECK_LT(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &sa,
                                          sizeof(sa)));
  if (a_mode != 0) {
    const int32_t ma = ScaleMode(b_mode), mb = ScaleMode(a_mode);
    CHECK_LT(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &ma,
                                            sizeof(ma)));
    CHECK_LT(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &mb,
                                            sizeof(mb)));
  }
  CHECK_LT(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_FAST_ACCUM, &fast,
                                          sizeof(fast)));
  cublasLtMatrixLayout_t la, lb, lc;
  CHECK_LT(cublasLtMatrixLayoutCreate(&la, b_e5m2 ? CUDA_R_8F_E5M2 : CUDA_R_8F_E4M3, K, N, K));
  CHECK_LT(cublasLtMatrixLayoutCreate(&lb, a_e5m2 ? CUDA_R_8F_E5M2 : CUDA_R_8F_E4M3, K, M, K));
  CHECK_LT(cublasLtMatrixLayoutCreate(&lc, CUDA_R_16BF, N, M, N));
  cublasLtMatmulPreference_t pref;
  CHECK_LT(cublasLtMatmulPreferenceCreate(&pref));
  const uint64_t ws64 = ws_bytes;
  CHECK_LT(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                                &ws64, sizeof(ws64)));
  cublasLtMatmulHeuristicResult_t res[16];
  int found = 0;
  CHECK_LT(cublasLtMatmulAlgoGetHeuristic(handle, desc, la, lb, lc, lc, pref, 16, res, &found));

  cudaStream_t stream;
  CHECK_CUDA(cudaStreamCreate(&stream));
  cudaEvent_t e0, e1;
  CHECK_CUDA(cudaEventCreate(&e0));
  CHECK_CUDA(cudaEventCreate(&e1));
  const float alpha = 1.f, beta = residual ? 1.f : 0.f;
  const double flop = 2.0 * M * N * K;
  const int reps = 20;
  float first = 0.f, best = 1e30f;
  int best_rank = -1;
  for (int i = 0; i < found; ++i) {
    auto run = [&] {
      return cublasLtMatmul(handle, desc, &alpha, b, la, a, lb, &beta, residual ? c : d, lc, d,
                            lc, &res[i].algo, ws, ws_bytes, stream);
    };
    bool ok = true;
    for (int w = 0; w < 3 && ok; ++w) ok = run() == CUBLAS_STATUS_SUCCESS;
    if (!ok) {
      std::printf("rank %2d  failed to run\n", i);
      continue;
    }
    CHECK_CUDA(cudaEventRecord(e0, stream));
    for (int r = 0; r < reps; ++r) run();
    CHECK_CUDA(cudaEventRecord(e1, stream));
    CHECK_CUDA(cudaEventSynchronize(e1));
    float ms = 0.f;
    CHECK_CUDA(cudaEventElapsedTime(&ms, e0, e1));
    ms /= reps;
    if (i == 0) first = ms;
    if (ms < best) { best = ms; best_rank = i; }
    std::printf("rank %2d  %7.3f ms  %6.0f TFLOP/s  tile %3d stages %3d cluster %2d splitK %d ws %zu\n",
                i, ms, flop / ms * 1e-9, ConfigAttr(res[i].algo, CUBLASLT_ALGO_CONFIG_TILE_ID),
                ConfigAttr(res[i].algo, CUBLASLT_ALGO_CONFIG_STAGES_ID),
                ConfigAttr(res[i].algo, CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID),
                ConfigAttr(res[i].algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM), res[i].workspaceSize);
  }
  std::printf("SUMMARY M=%ld N=%ld K=%ld modes=%d/%d e5m2=%d fast=%d residual=%d: %d algos, "
              "heuristic first %.3f ms, best %.3f ms (rank %d), gain %.1f%%\n",
              M, N, K, a_mode, b_mode, e5m2, fast, residual, found, first, best, best_rank,
              100.0 * (first - best) / first);
  return 0;
}
