#!/usr/bin/env bash
# Builds te_jax against the CUDA toolkit of the pip packages (the ones
# `pip install "jax[cuda13]"` brings) while every system CUDA toolkit is
# hidden, then checks that the kernels were built with them: what a user
# without a CUDA toolkit gets from `pip install .`.
#
# Usage: bash tools/nvcc_free.sh [COMMAND...]
#   COMMAND (optional) runs afterwards in the same hidden view, from /tmp
#   (e.g. python3 -m pytest -m gpu ...).
# Env:  PYTHON       interpreter whose environment gets te_jax (default python3)
#       CUDA_WHEELS  folders (space-separated) of nvidia-* wheels to install
#                    first, offline (pip --no-index --no-deps), for machines
#                    without a registry
#       NEED_GPU=1   COMMAND runs only if jax sees a GPU in the hidden view
#       BUILD_ARGS   pip arguments of the build (default
#                    "--no-build-isolation --no-deps"; "--no-deps" builds with
#                    build isolation, which needs a package index)
#       OUT          logs (default /tmp/te_jax_out)
# How the system toolkit is hidden: in a private mount namespace (unshare -m,
# needs root) an empty tmpfs covers /usr/local/cuda* and /opt/cuda*, and a
# non-executable empty file covers every other nvcc on PATH; CUDA_HOME,
# CUDA_PATH, CUDACXX, CUDAToolkit_ROOT are unset. Without unshare, PATH
# entries holding nvcc are dropped instead (the toolkit folders stay visible:
# the script says so). Exit status: 0 only when te_jax._te_jax_ffi imports and
# its build note names the pip packages.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="${OUT:-/tmp/te_jax_out}"; mkdir -p "$OUT"
PYTHON="${PYTHON:-python3}"
LOG="$OUT/nvcc_free.log"

if [[ -z "${TE_JAX_NVCC_FREE_NS:-}" ]] && unshare -m --propagation private true 2>/dev/null; then
  exec unshare -m --propagation private env TE_JAX_NVCC_FREE_NS=1 bash "$0" "$@"
fi

# The first executable nvcc on PATH (bash's `command -v` also names a
# non-executable file when nothing else matches).
nvcc_on_path() {
  local d p
  IFS=: read -ra p <<< "$PATH"
  for d in "${p[@]}"; do [[ -f "$d/nvcc" && -x "$d/nvcc" ]] && { echo "$d/nvcc"; return 0; }; done
  return 1
}

hide_system_toolkit() {
  unset CUDA_HOME CUDA_PATH CUDACXX CUDAToolkit_ROOT CUDA_ROOT
  if [[ -n "${TE_JAX_NVCC_FREE_NS:-}" ]]; then
    local d blank n=0
    for d in /usr/local/cuda* /opt/cuda*; do
      [[ -d "$d" ]] && mount -t tmpfs none "$(realpath "$d")" 2>/dev/null || true
    done
    blank="$(mktemp)"; chmod a-x "$blank"
    while d="$(nvcc_on_path)" && (( n++ < 20 )); do
      mount --bind "$blank" "$(realpath "$d")"
    done
    echo "system toolkit hidden: mount namespace (tmpfs over /usr/local/cuda*, /opt/cuda*)"
  else
    local p keep=()
    IFS=: read -ra p <<< "$PATH"
    for d in "${p[@]}"; do [[ -f "$d/nvcc" && -x "$d/nvcc" ]] || keep+=("$d"); done
    PATH="$(IFS=:; echo "${keep[*]}")"
    echo "WARNING: no mount namespace (unshare -m failed): only PATH is cleaned;" \
         "/usr/local/cuda stays visible to CMake's searches"
  fi
  if nvcc_on_path; then echo "FAIL: an nvcc is still on PATH"; exit 1; fi
  echo "nvcc on PATH: none; /usr/local/cuda: $(ls /usr/local/cuda 2>/dev/null | wc -l) entries"
}

cd "$REPO"
hide_system_toolkit > "$LOG" 2>&1 || { cat "$LOG"; exit 1; }
{
  for d in ${CUDA_WHEELS:-}; do
    "$PYTHON" -m pip install -q --no-index --no-deps "$d"/*.whl
  done
  "$PYTHON" -m pip list 2>/dev/null | grep -iE "^(nvidia-(cuda-(nvcc|runtime|cccl|crt)|nvvm|cublas)|jax|jaxlib) " || true
  echo "pip_cuda_toolkit.py says:"; "$PYTHON" custom_calls/cmake/pip_cuda_toolkit.py
} >> "$LOG" 2>&1
cat "$LOG"

[[ -f README.md ]] || echo "# te_jax" > README.md   # scikit-build-core needs the readme
build_dir="$(mktemp -d)"
start=$(date +%s)
# shellcheck disable=SC2086  # BUILD_ARGS is a word list on purpose
"$PYTHON" -m pip install -v ${BUILD_ARGS:---no-build-isolation --no-deps} \
  -C build-dir="$build_dir" . > "$OUT/nvcc_free_build.log" 2>&1 || {
  tail -30 "$OUT/nvcc_free_build.log"; echo "FAIL: the build failed"; exit 1; }
{
  grep -E "te_jax:" "$OUT/nvcc_free_build.log" | sed 's/^ *//'
  echo "build: $(( $(date +%s) - start )) s"
  leaks="$(grep -l -r --include=CMakeCache.txt --include='*.ninja' --include='*.make' \
    -E "/usr/local/cuda|/opt/cuda" "$build_dir" || true)"
  [[ -z "$leaks" ]] || { echo "FAIL: the build used a system toolkit: $leaks"; exit 1; }
  echo "no system toolkit path in the build files"
  cd /tmp
  "$PYTHON" - <<'EOF'
import pathlib, subprocess, sys
import te_jax._te_jax_ffi as m
so = pathlib.Path(m.__file__)
note = (so.parent / "_te_jax_ffi_build.txt").read_text().strip()
print("native module:", so, sorted(m.registrations())[:3], "...")
print("build note:", note)
dyn = subprocess.run(["readelf", "-d", str(so)], capture_output=True, text=True).stdout
print("RUNPATH:", [l.split("[", 1)[1].rstrip("]") for l in dyn.splitlines() if "RUNPATH" in l or "RPATH" in l])
sys.exit(0 if "pip packages" in note else "FAIL: the build note does not name the pip packages")
EOF
} 2>&1 | tee -a "$LOG"
rm -rf "$build_dir"

if (( $# )); then
  if [[ "${NEED_GPU:-}" == 1 ]] && ! (cd /tmp && "$PYTHON" -c \
      "import jax, sys; print('jax', jax.__version__, jax.devices()); sys.exit(jax.default_backend() != 'gpu')"); then
    echo "FAIL: jax sees no GPU with the system toolkit hidden; not running: $*"; exit 1
  fi
  (cd /tmp && "$@") 2>&1 | tee "$OUT/nvcc_free_command.log"
fi
