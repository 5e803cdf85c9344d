# Where the CUTLASS / CuTe C++ headers of te_jax's own sm_90a GEMMs
# (kernels/*sm90*: the dense blockwise variants and the grouped GEMM) come
# from. They are an optional build dependency: without them the module is
# built exactly as before, minus those GEMMs.
include_guard(GLOBAL)

# te_jax_find_cutlass(MODE DIR): MODE is TE_JAX_SM90_GEMMS (AUTO, ON or OFF),
# DIR is TE_JAX_CUTLASS_INCLUDE ("" = look for the nvidia-cutlass Python
# package, whose wheel ships the headers as cutlass_library/source/include:
# first in the environment being installed into, as for the jax FFI headers,
# then in the build environment). Sets in the caller:
#   TE_JAX_CUTLASS_DIR      the include folder; "" when the GEMMs are left out
#   TE_JAX_CUTLASS_VERSION  "major.minor.patch" of its cutlass/version.h
#   TE_JAX_CUTLASS_WHY      why they are left out, when TE_JAX_CUTLASS_DIR is ""
# An explicit DIR that holds no CUTLASS, or MODE ON without headers, stops
# the configure with an error: the user asked for the GEMMs.
function(te_jax_find_cutlass mode dir)
  set(TE_JAX_CUTLASS_DIR "" PARENT_SCOPE)
  set(TE_JAX_CUTLASS_VERSION "" PARENT_SCOPE)
  string(TOUPPER "${mode}" mode)
  if(NOT mode MATCHES "^(AUTO|ON|OFF)$")
    message(FATAL_ERROR "te_jax: TE_JAX_SM90_GEMMS must be AUTO, ON or OFF, got '${mode}'")
  endif()
  if(mode STREQUAL "OFF")
    set(TE_JAX_CUTLASS_WHY "TE_JAX_SM90_GEMMS=OFF" PARENT_SCOPE)
    return()
  endif()
  set(from "TE_JAX_CUTLASS_INCLUDE")
  # What stops the configure when the headers are missing or unusable.
  set(strict "")
  if(mode STREQUAL "ON")
    set(strict "TE_JAX_SM90_GEMMS=ON, but ")
  endif()
  if(NOT dir)
    # find_spec locates the package without importing it (cutlass_library
    # imports more than the headers need); stdlib only, so that this runs
    # in a build environment that lacks the package. -E first: the
    # environment being installed into (see the jax lookup in CMakeLists.txt).
    execute_process(COMMAND "${Python_EXECUTABLE}" -E -c "import importlib.util as u, os; s = u.find_spec('cutlass_library'); print(os.path.join(list(s.submodule_search_locations)[0], 'source', 'include') if s else '')"
                    OUTPUT_VARIABLE dir OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
    if(NOT dir)
      execute_process(COMMAND "${Python_EXECUTABLE}" -c "import importlib.util as u, os; s = u.find_spec('cutlass_library'); print(os.path.join(list(s.submodule_search_locations)[0], 'source', 'include') if s else '')"
                      OUTPUT_VARIABLE dir OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
    endif()
    set(from "the nvidia-cutlass package")
    if(NOT dir)
      _te_jax_cutlass_left_out("${strict}" "no CUTLASS headers (neither -DTE_JAX_CUTLASS_INCLUDE=DIR nor an installed nvidia-cutlass package)")
    endif()
  endif()
  set(version_h "${dir}/cutlass/version.h")
  if(NOT EXISTS "${version_h}" OR NOT EXISTS "${dir}/cute/tensor.hpp")
    message(FATAL_ERROR "te_jax: ${from} names ${dir}, which holds no CUTLASS headers "
                        "(cutlass/version.h, cute/tensor.hpp)")
  endif()
  file(STRINGS "${version_h}" defines REGEX "^#define CUTLASS_(MAJOR|MINOR|PATCH) ")
  set(version "")
  foreach(part MAJOR MINOR PATCH)
    string(REGEX MATCH "CUTLASS_${part} +([0-9]+)" _ "${defines}")
    list(APPEND version "${CMAKE_MATCH_1}")
  endforeach()
  string(REPLACE ";" "." version "${version}")
  # The kernels use CUTLASS 4.2's Hopper blockwise and pointer-array collectives.
  if(version VERSION_LESS "4.2")
    if(from STREQUAL "TE_JAX_CUTLASS_INCLUDE")
      set(strict "TE_JAX_CUTLASS_INCLUDE: ")   # a folder named explicitly must be usable
    endif()
    _te_jax_cutlass_left_out("${strict}" "the CUTLASS headers in ${dir} are version ${version}; the sm90 GEMMs need 4.2 or newer")
  endif()
  set(TE_JAX_CUTLASS_DIR "${dir}" PARENT_SCOPE)
  set(TE_JAX_CUTLASS_VERSION "${version}" PARENT_SCOPE)
endfunction()

# In te_jax_find_cutlass: the GEMMs are left out for `why`, or the configure
# stops with "strict why" when `strict` is not empty; sets TE_JAX_CUTLASS_WHY
# for te_jax_find_cutlass's caller and returns from te_jax_find_cutlass (a
# macro runs in the function that calls it).
macro(_te_jax_cutlass_left_out strict why)
  if(NOT "${strict}" STREQUAL "")
    message(FATAL_ERROR "te_jax: ${strict}${why}")
  endif()
  set(TE_JAX_CUTLASS_WHY "${why}" PARENT_SCOPE)
  return()
endmacro()
