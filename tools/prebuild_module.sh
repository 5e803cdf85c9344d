#!/usr/bin/env bash
# Builds te_jax's native module on this (CPU) machine for the GPU machine's
# image, so that a device session carries it (carry: build/prebuilt) and its
# build stage imports it instead of compiling for 136 s
# (tools/gpu_session.sh, PREBUILT=build/prebuilt).
#
#   bash tools/prebuild_module.sh            # -> build/prebuilt/
#
# What must match the image (its env.log: Python 3.12, jax 0.11.2, nvcc
# 13.0.88, glibc/libstdc++ of Ubuntu 24.04): the Python ABI of the
# nanobind module, the XLA FFI headers (jax 0.11.2's API 0.4; a newer jax's
# 0.5 handlers are refused by an older runtime), and the CUDA 13.0
# compiler (pip packages nvidia-cuda-nvcc 13.0.*; sm_90a, CUTLASS 4.2.0 from
# .cutlass/cutlass-*-include.tar.gz). The module links libcudart.so.13 and
# libcublasLt.so.13 by name; the session puts the image's CUDA lib64 on
# LD_LIBRARY_PATH. Incremental: a second run recompiles what changed.
#
# Env: PYTHON (a python3.12; default python3.12 or pyenv's), PREBUILD_DIR
# (venv, CUTLASS headers, CMake build; default ~/.cache/te_jax_prebuild),
# JAX_VERSION (0.11.2), JOBS (nproc).
set -euo pipefail
REPO="$(cd "$(dirname "$0")/.." && pwd)"
DIR="${PREBUILD_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/te_jax_prebuild}"
JAX_VERSION="${JAX_VERSION:-0.11.2}"
OUT="$REPO/build/prebuilt"
mkdir -p "$DIR" "$OUT"

py=""
for cand in "${PYTHON:-}" python3.12 "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.12*/bin/python3.12; do
  if [[ -n "$cand" ]] && "$cand" -c "import sys; assert sys.version_info[:2] == (3, 12)" 2>/dev/null; then
    py=$cand; break
  fi
done
[[ -n "$py" ]] || { echo "prebuild_module: needs a python3.12 (set PYTHON)" >&2; exit 2; }

if [[ ! -x "$DIR/venv/bin/python" ]]; then
  "$py" -m venv "$DIR/venv"
fi
"$DIR/venv/bin/pip" install -q "jax==$JAX_VERSION" "jaxlib==$JAX_VERSION" nanobind==3.1.0 \
  cmake ninja numpy "nvidia-cuda-nvcc==13.0.*" "nvidia-cuda-crt==13.0.*" "nvidia-nvvm==13.0.*" \
  "nvidia-cuda-cccl==13.0.*" "nvidia-cuda-runtime==13.0.*" "nvidia-cublas==13.0.*"

tarball=$(ls "$REPO"/.cutlass/cutlass-*-include.tar.gz 2>/dev/null | head -1)
[[ -n "$tarball" ]] || { echo "prebuild_module: no .cutlass/cutlass-*-include.tar.gz" >&2; exit 2; }
mkdir -p "$DIR/cutlass" && tar -xzf "$tarball" -C "$DIR/cutlass"

export PATH="$DIR/venv/bin:$PATH"
cmake -S "$REPO/custom_calls" -B "$DIR/build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DPython_EXECUTABLE="$DIR/venv/bin/python" -DTE_JAX_CUDA_TOOLKIT=pip \
  -DTE_JAX_CUTLASS_INCLUDE="$DIR/cutlass/include" -DTE_JAX_SM90_GEMMS=ON > "$DIR/configure.log"
ninja -C "$DIR/build" -j "${JOBS:-$(nproc)}"
cp "$DIR"/build/_te_jax_ffi.cpython-312-*.so "$DIR/build/_te_jax_ffi_build.txt" "$OUT/"
ls -l "$OUT"
cat "$OUT/_te_jax_ffi_build.txt"
