# Which CUDA toolkit builds the te_jax kernels: a system one (the nvcc that
# CMake finds: CMAKE_CUDA_COMPILER, CUDACXX or PATH) or the pip packages that
# `pip install "jax[cuda13]"` brings (nvidia-cuda-nvcc, nvidia-nvvm,
# nvidia-cuda-crt, nvidia-cuda-runtime, nvidia-cuda-cccl, nvidia-cublas, all
# in one site-packages/nvidia/cu13/ tree; pip_cuda_toolkit.py finds it).
include_guard(GLOBAL)
include(CheckLanguage)

# te_jax_choose_cuda_compiler(MODE): picks the CUDA compiler before
# enable_language(CUDA). MODE is TE_JAX_CUDA_TOOLKIT's value: "auto" (a system
# compiler if CMake finds one, else the pip packages), "system" or "pip".
# Sets in the caller:
#   TE_JAX_TOOLKIT_KIND  "system" or "pip"; "" when there is no usable one
#   TE_JAX_TOOLKIT_WHY   why not, when TE_JAX_TOOLKIT_KIND is ""
# For "pip" it also sets CMAKE_CUDA_COMPILER (cache), CUDAToolkit_ROOT, the
# cudart cache entries FindCUDAToolkit would search for by their unversioned
# names (the wheels ship only libcudart.so.13), TE_JAX_PIP_CUDA_VERSION, and
# TE_JAX_CUBLASLT_ROOT when the caller left it empty.
function(te_jax_choose_cuda_compiler mode)
  set(TE_JAX_TOOLKIT_KIND "" PARENT_SCOPE)
  if(NOT mode MATCHES "^(auto|system|pip)$")
    message(FATAL_ERROR "te_jax: TE_JAX_CUDA_TOOLKIT must be auto, system or pip, got '${mode}'")
  endif()
  if(NOT mode STREQUAL "pip")
    check_language(CUDA)
    if(CMAKE_CUDA_COMPILER)
      set(TE_JAX_TOOLKIT_KIND "system" PARENT_SCOPE)
      return()
    endif()
    set(why "no CUDA compiler (nvcc on PATH, CUDACXX or CMAKE_CUDA_COMPILER)")
    if(mode STREQUAL "system")
      set(TE_JAX_TOOLKIT_WHY "${why}" PARENT_SCOPE)
      return()
    endif()
  endif()

  execute_process(
    COMMAND "${Python_EXECUTABLE}" "${CMAKE_CURRENT_FUNCTION_LIST_DIR}/pip_cuda_toolkit.py"
    OUTPUT_VARIABLE found RESULT_VARIABLE rc ERROR_VARIABLE err)
  _te_jax_field(root "${found}")
  _te_jax_field(cublaslt_root "${found}")
  _te_jax_field(version "${found}")
  _te_jax_field(missing "${found}")
  if(NOT rc EQUAL 0)
    set(pip_why "pip_cuda_toolkit.py failed: ${err}")
  elseif(NOT root)
    set(pip_why "no pip CUDA packages (site-packages/nvidia/cuNN/bin/nvcc, from nvidia-cuda-nvcc)")
  elseif(missing)
    set(pip_why "the pip CUDA packages at ${root} lack ${missing}")
  endif()
  if(NOT pip_why)
    # check_language() runs a small CUDA project with this compiler (CUDACXX
    # is what its sub-project reads); a toolkit that cannot compile is
    # reported here instead of failing the whole install in enable_language.
    unset(CMAKE_CUDA_COMPILER)         # the first check_language's result
    unset(CMAKE_CUDA_COMPILER CACHE)
    set(ENV{CUDACXX} "${root}/bin/nvcc")
    check_language(CUDA)
    if(NOT CMAKE_CUDA_COMPILER)
      set(pip_why "the pip CUDA compiler ${root}/bin/nvcc failed CMake's test compile")
    endif()
  endif()
  if(pip_why)
    if(mode STREQUAL "pip")
      message(FATAL_ERROR "te_jax: TE_JAX_CUDA_TOOLKIT=pip, but ${pip_why}")
    endif()
    set(TE_JAX_TOOLKIT_WHY "${why}, and ${pip_why}" PARENT_SCOPE)
    return()
  endif()
  file(GLOB cudart "${root}/lib/libcudart.so*")
  list(SORT cudart)
  list(GET cudart 0 cudart)
  set(CUDA_CUDART "${cudart}" CACHE FILEPATH "libcudart of the pip CUDA packages")
  set(CUDA_cudart_LIBRARY "${cudart}" CACHE FILEPATH "libcudart of the pip CUDA packages")
  set(CUDAToolkit_ROOT "${root}" PARENT_SCOPE)
  set(TE_JAX_PIP_CUDA_VERSION "${version}" PARENT_SCOPE)
  if(NOT TE_JAX_CUBLASLT_ROOT)
    set(TE_JAX_CUBLASLT_ROOT "${cublaslt_root}" PARENT_SCOPE)
  endif()
  set(TE_JAX_TOOLKIT_KIND "pip" PARENT_SCOPE)
endfunction()

# _te_jax_field(KEY TEXT): ${KEY} in the caller = the value of the line
# "KEY=value" of TEXT (pip_cuda_toolkit.py's output), "" if absent.
function(_te_jax_field key text)
  if(text MATCHES "(^|\n)${key}=([^\n]*)")
    set(${key} "${CMAKE_MATCH_2}" PARENT_SCOPE)
  else()
    set(${key} "" PARENT_SCOPE)
  endif()
endfunction()

# te_jax_build_note(TEXT): one line, "built ..." or "not built: ...",
# written to te_jax/_te_jax_ffi_build.txt beside the module so that te_jax
# can say at run time how (or why not) its kernels were built.
function(te_jax_build_note text)
  file(WRITE "${CMAKE_CURRENT_BINARY_DIR}/_te_jax_ffi_build.txt" "${text}\n")
  install(FILES "${CMAKE_CURRENT_BINARY_DIR}/_te_jax_ffi_build.txt" DESTINATION te_jax)
endfunction()
