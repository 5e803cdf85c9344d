// Error checks of the standalone CUDA benchmark tools (act_math.cu,
// gemm_algos.cu): print the failing call and exit.
#pragma once

#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>

// CHECK_STATUS(call, ok, name): exit(1) with the call's text and name(status)
// when the call's status is not `ok`; one shape for every status type.
#define CHECK_STATUS(x, ok, name)                                   \
  do {                                                              \
    const auto s_ = (x);                                            \
    if (s_ != (ok)) {                                               \
      std::fprintf(stderr, "%s: %s\n", #x, name(s_));               \
      std::exit(1);                                                 \
    }                                                               \
  } while (0)

#define CHECK_CUDA(x) CHECK_STATUS(x, cudaSuccess, cudaGetErrorString)
