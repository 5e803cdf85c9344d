// Error checks of the standalone CUDA benchmark tools (act_math.cu,
// gemm_algos.cu): print the failing call and exit.
#pragma once

#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>

#define CHECK_CUDA(x)                                                \
  do {                                                               \
    cudaError_t e_ = (x);                                            \
    if (e_ != cudaSuccess) {                                         \
      std::fprintf(stderr, "%s: %s\n", #x, cudaGetErrorString(e_));  \
      std::exit(1);                                                  \
    }                                                                \
  } while (0)
