/* libcuda.so.1 stand-in for a machine with no NVIDIA driver (used by
 * tools/deviceless_memory.py, which builds it with gcc when the real
 * libcuda.so.1 cannot be loaded).
 *
 * Why: XLA's deviceless cuDNN compilation (the fused-attention graphs) runs
 * cuDNN's engine selection, which opens libcuda.so.1 and looks up the driver
 * entry points below; if the library or any of them is missing, it reports
 * no supported engine ("Cannot load CUDA driver library") and the compile
 * fails. The names cover what cuDNN 9.23 looks up. Nothing is ever launched
 * on this machine, so every entry point reports failure:
 * CUDA_ERROR_STUB_LIBRARY (34), the code of the CUDA toolkit's own link
 * stubs. Only the version and error-string queries succeed, so callers can
 * log a readable reason. */

typedef int CUresult;

enum { CUDA_SUCCESS = 0, CUDA_ERROR_STUB_LIBRARY = 34 };

#define FAILING(name) \
  CUresult name(void) { return CUDA_ERROR_STUB_LIBRARY; }

CUresult cuDriverGetVersion(int *version) {
  if (version) *version = 13000; /* a CUDA 13 driver, as jax[cuda13] expects */
  return CUDA_SUCCESS;
}

CUresult cuGetErrorName(CUresult error, const char **name) {
  (void)error;
  if (name) *name = "CUDA_ERROR_STUB_LIBRARY";
  return CUDA_SUCCESS;
}

CUresult cuGetErrorString(CUresult error, const char **text) {
  (void)error;
  if (text) *text = "libcuda stub: no NVIDIA driver on this machine";
  return CUDA_SUCCESS;
}

CUresult cuDeviceGetCount(int *count) {
  if (count) *count = 0;
  return CUDA_ERROR_STUB_LIBRARY;
}

/* Arguments are ignored, so one signature serves every failing entry point. */
FAILING(cuInit)
FAILING(cuDeviceGet)
FAILING(cuCtxGetCurrent)
FAILING(cuCtxGetLimit)
FAILING(cuCtxPushCurrent)
FAILING(cuCtxPopCurrent)
FAILING(cuStreamGetCtx)
FAILING(cuModuleLoadData)
FAILING(cuModuleGetFunction)
FAILING(cuModuleUnload)
FAILING(cuLibraryLoadData)
FAILING(cuLibraryLoadFromFile)
FAILING(cuLibraryGetKernel)
FAILING(cuLibraryUnload)
FAILING(cuKernelGetAttribute)
FAILING(cuKernelSetAttribute)
FAILING(cuLinkCreate)
FAILING(cuLinkAddData)
FAILING(cuLinkComplete)
FAILING(cuLinkDestroy)
FAILING(cuLaunchKernel)
FAILING(cuLaunchKernelEx)
FAILING(cuLaunchCooperativeKernel)
FAILING(cuOccupancyMaxPotentialClusterSize)
FAILING(cuTensorMapEncodeTiled)
FAILING(cuTensorMapEncodeIm2col)
