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
# needs root) an empty tmpfs covers each /usr/local/cuda* and /opt/cuda*
# folder but its compat/ (the forward-compatibility driver, libcuda.so, that
# images put on the loader path: the GPU stays usable, and no build reads it),
# and a non-executable empty file covers every other nvcc on PATH; CUDA_HOME,
# CUDA_PATH, CUDACXX, CUDAToolkit_ROOT are unset. Without unshare, PATH
# entries holding nvcc are dropped instead (the toolkit folders stay visible:
# the script says so). The log names what was hidden and where libcuda.so.1
# loads from. Exit status: 0 only when te_jax._te_jax_ffi imports and its
# build note names the pip packages.
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

# Covers toolkit folder $1 with an empty tmpfs, then mounts its compat/ back.
hide_toolkit_dir() {
  local dir="$1" keep="" had_compat=""
  if [[ -d "$dir/compat" ]]; then
    had_compat=1; keep="$(mktemp -d)"
    mount --bind "$dir/compat" "$keep" || keep=""
  fi
  mount -t tmpfs none "$dir" || { echo "FAIL: cannot cover $dir"; return 1; }
  if [[ -n "$keep" ]] && mkdir "$dir/compat" && mount --bind "$keep" "$dir/compat"; then
    umount "$keep" && rmdir "$keep"
    echo "system toolkit hidden: $dir (empty tmpfs; compat/ kept: $(ls "$dir/compat" | tr '\n' ' '))"
  elif [[ -n "$had_compat" ]]; then
    echo "WARNING: system toolkit hidden: $dir (empty tmpfs), its compat/ too: it could not be mounted back"
  else
    echo "system toolkit hidden: $dir (empty tmpfs)"
  fi
}

# Where the CUDA driver library loads from, as jax would load it.
report_driver() {
  "$PYTHON" - <<'PY' || true
import ctypes
try:
  ctypes.CDLL("libcuda.so.1")
except OSError as e:
  print(f"driver: libcuda.so.1 does not load ({e}): jax will see no GPU")
else:
  maps = open("/proc/self/maps").read().split()
  print("driver: libcuda.so.1 loads from", sorted({w for w in maps if "libcuda.so" in w}))
PY
}

hide_system_toolkit() {
  unset CUDA_HOME CUDA_PATH CUDACXX CUDAToolkit_ROOT CUDA_ROOT
  if [[ -n "${TE_JAX_NVCC_FREE_NS:-}" ]]; then
    local d blank n=0
    local -A covered=()   # /usr/local/cuda and cuda-13.0 are often one folder
    for d in /usr/local/cuda* /opt/cuda*; do
      [[ -d "$d" ]] || continue
      d="$(realpath "$d")"
      [[ -n "${covered[$d]:-}" ]] && continue
      covered[$d]=1
      hide_toolkit_dir "$d" || return 1
    done
    blank="$(mktemp)"; chmod a-x "$blank"
    while d="$(nvcc_on_path)" && (( n++ < 20 )); do
      mount --bind "$blank" "$(realpath "$d")"
      echo "system nvcc hidden: $d"
    done
  else
    local p keep=()
    IFS=: read -ra p <<< "$PATH"
    for d in "${p[@]}"; do [[ -f "$d/nvcc" && -x "$d/nvcc" ]] || keep+=("$d"); done
    PATH="$(IFS=:; echo "${keep[*]}")"
    echo "WARNING: no mount namespace (unshare -m failed): only PATH is cleaned;" \
         "/usr/local/cuda stays visible to CMake's searches"
  fi
  if nvcc_on_path; then echo "FAIL: an nvcc is still on PATH"; exit 1; fi
  echo "nvcc on PATH: none; /usr/local/cuda holds: $(ls /usr/local/cuda 2>/dev/null | tr '\n' ' ')"
  report_driver
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
for tag in ("NEEDED", "RUNPATH", "RPATH"):
  print(f"{tag}:", [l.split("[", 1)[1].rstrip("]") for l in dyn.splitlines() if f"({tag})" in l])
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
