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
# names (the wheels ship only libcudart.so.13), TE_JAX_PIP_CUDA_VERSION,
# TE_JAX_CUBLASLT_ROOT when the caller left it empty, and CMAKE_CUDA_FLAGS
# (a normal variable over the cache entry, so not stored; the user's flags
# kept) plus TE_JAX_PIP_LINK_NOTE, a few words on what was added for the pip
# compiler (_te_jax_pip_nvcc_flags says why).
function(te_jax_choose_cuda_compiler mode)
  set(TE_JAX_TOOLKIT_KIND "" PARENT_SCOPE)
  if(NOT mode MATCHES "^(auto|system|pip)$")
    message(FATAL_ERROR "te_jax: TE_JAX_CUDA_TOOLKIT must be auto, system or pip, got '${mode}'")
  endif()
  if(NOT mode STREQUAL "pip")
    check_language(CUDA)
    # A reconfigure finds the pip nvcc that the first configure cached: that
    # is still the pip toolkit (checked below), which still needs its flags.
    if(mode STREQUAL "auto" AND CMAKE_CUDA_COMPILER MATCHES "/nvidia/cu[0-9]+/bin/nvcc$")
      set(cached_pip_nvcc "${CMAKE_CUDA_COMPILER}")
    elseif(CMAKE_CUDA_COMPILER)
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
  _te_jax_field(devrt "${found}")
  if(cached_pip_nvcc AND NOT cached_pip_nvcc STREQUAL "${root}/bin/nvcc")
    set(TE_JAX_TOOLKIT_KIND "system" PARENT_SCOPE)   # named by the user, not ours
    return()
  endif()
  if(NOT rc EQUAL 0)
    set(pip_why "pip_cuda_toolkit.py failed: ${err}")
  elseif(NOT root)
    set(pip_why "no pip CUDA packages (site-packages/nvidia/cuNN/bin/nvcc, from nvidia-cuda-nvcc)")
  elseif(missing)
    set(pip_why "the pip CUDA packages at ${root} lack ${missing}")
  elseif(root MATCHES " ")
    set(pip_why "the pip CUDA packages lie at ${root}, whose space CMAKE_CUDA_FLAGS cannot carry")
  endif()
  if(NOT pip_why)
    _te_jax_pip_nvcc_flags(pip_flags link_note "${root}" "${devrt}")
    # The user's flags, as enable_language would take them, then ours.
    if(DEFINED CMAKE_CUDA_FLAGS)
      set(flags "${CMAKE_CUDA_FLAGS}")
    else()
      set(flags "$ENV{CUDAFLAGS}")
    endif()
    string(STRIP "${flags} ${pip_flags}" flags)
    # check_language() runs a small CUDA project with this compiler (CUDACXX
    # and CUDAFLAGS are what its sub-project reads); a toolkit that cannot
    # compile is reported here instead of failing the whole install in
    # enable_language.
    unset(CMAKE_CUDA_COMPILER)         # the first check_language's result
    unset(CMAKE_CUDA_COMPILER CACHE)
    set(ENV{CUDACXX} "${root}/bin/nvcc")
    set(user_env "$ENV{CUDAFLAGS}")
    set(ENV{CUDAFLAGS} "${flags}")
    check_language(CUDA)
    set(ENV{CUDAFLAGS} "${user_env}")  # so that the cache entry keeps the user's flags only
    if(NOT CMAKE_CUDA_COMPILER)
      set(pip_why "the pip CUDA compiler ${root}/bin/nvcc (flags: ${pip_flags}) failed CMake's test compile")
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
  # enable_language(CUDA)'s compiler identification, its test compile and
  # every CUDA compile line read this variable.
  set(CMAKE_CUDA_FLAGS "${flags}" PARENT_SCOPE)
  set(TE_JAX_PIP_LINK_NOTE "${link_note}" PARENT_SCOPE)
  set(TE_JAX_PIP_CUDA_VERSION "${version}" PARENT_SCOPE)
  if(NOT TE_JAX_CUBLASLT_ROOT)
    set(TE_JAX_CUBLASLT_ROOT "${cublaslt_root}" PARENT_SCOPE)
  endif()
  set(TE_JAX_TOOLKIT_KIND "pip" PARENT_SCOPE)
endfunction()

# _te_jax_pip_nvcc_flags(OUT NOTE ROOT DEVRT): ${OUT} in the caller = the nvcc
# flags the pip toolkit at ROOT needs to link, ${NOTE} = what they do, in a
# few words for the configure's toolkit line. The nvcc.profile of the 13.0
# nvidia-cuda-nvcc package points the linker at lib64/, the layout of a system
# toolkit, but the packages put their libraries in lib/ (libcudart_static.a,
# which nvcc and CMake link by default; the shared cudart cannot take its
# place: the packages ship no unversioned libcudart.so).
# DEVRT is pip_cuda_toolkit.py's devrt. Some installs of nvidia-cuda-runtime
# lack lib/libcudadevrt.a, the device runtime that only relocatable device
# code calls; te_jax compiles none (no CUDA_SEPARABLE_COMPILATION), so nvcc
# is told to leave it out (-cudadevrt none). CMake links CUDA executables
# with the host compiler and names -lcudadevrt itself, whatever the flags
# (CMAKE_CUDA_RUNTIME_LIBRARY_LINK_OPTIONS_STATIC), so an empty archive in the
# build folder stands in for it: nothing te_jax builds takes a symbol from it.
function(_te_jax_pip_nvcc_flags out note root devrt)
  set(flags "-L${root}/lib")
  set(words "libraries from lib/")
  if(NOT devrt)
    set(stand_in "${CMAKE_BINARY_DIR}/te_jax_pip_cuda")
    file(WRITE "${stand_in}/libcudadevrt.a" "!<arch>\n")   # an ar archive without members
    string(APPEND flags " -L${stand_in} -cudadevrt none")
    string(APPEND words ", no libcudadevrt.a: -cudadevrt none, an empty one for CMake's -lcudadevrt")
  endif()
  set(${out} "${flags}" PARENT_SCOPE)
  set(${note} "${words}" PARENT_SCOPE)
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
