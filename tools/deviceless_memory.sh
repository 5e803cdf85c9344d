#!/usr/bin/env bash
# benchmarks/model_memory.py's compile-only memory tables for an H100 on a
# CPU machine with no GPU (tools/deviceless_memory.py says how). Compile-only
# figures (memory_analysis() of the compiled step), not a GPU run.
#
#   bash tools/deviceless_memory.sh [OUT_DIR]      (default /tmp/te_jax_out/deviceless)
#
# 1. Set-up, each step skipped when already done: a python3.12 venv;
#    jax[cuda13]==0.12.1 (the CUDA plugin's compiler does the work) with
#    flax, optax and te_jax's build tools; cuDNN 9.23.2.1 over the one pip
#    picks; te_jax built from a copy of this repository with the pip CUDA
#    toolkit (rebuilt when te_jax/, custom_calls/ or pyproject.toml change).
# 2. The four llama tables, 4 recipes at batch 8 (~3 min each on 2 cores):
#    t1_default (the library's residual plan: keep_fp8_copies and
#    store_act_input_in_fp8 off, which the llama preset turns on), t2_act_fp8
#    (store_act_input_in_fp8 on), t3_offload (--offload_optimizer) and
#    t4_offload_act_fp8 (both): OUT_DIR/<name>.md (the table), .json (per
#    run, with the compiled HLO's custom calls), .err.
#
# Env: DEVICELESS_CACHE (venv, te_jax copy and build, target config, libcuda
# stub; default ~/.cache/te_jax_deviceless), PYTHON (a python3.12), JOBS (2),
# RECIPES (none,delayed,current,blockwise), BATCHES (8), PRESET (llama),
# TABLES (which of the four, e.g. "t1_default t3_offload"; "" = set-up only),
# EXTRA_ARGS (more flags for every table, e.g. --raw-memory-base),
# SKIP_SETUP=1 (use the venv as it is), FORCE_BUILD=1 (rebuild te_jax).
set -euo pipefail
REPO="$(cd "$(dirname "$0")/.." && pwd)"
OUT="$(mkdir -p "${1:-/tmp/te_jax_out/deviceless}" && cd "${1:-/tmp/te_jax_out/deviceless}" && pwd)"
export DEVICELESS_CACHE="${DEVICELESS_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/te_jax_deviceless}"
VENV="$DEVICELESS_CACHE/venv"
PY="$VENV/bin/python"
JAX_VERSION=0.12.1
# cuDNN 9.28 (what jax[cuda13] 0.12.1 pulls) rejects the device-properties
# JSON that XLA's deviceless cuDNN compilation hands it (a key missing), so no
# attention graph compiles; 9.23.2.1 accepts it. --no-deps: pip only warns.
CUDNN_VERSION=9.23.2.1
log() { echo "== $(date +%T) $*" >&2; }

find_python312() {
  local py
  for py in "${PYTHON:-}" python3.12 "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.12*/bin/python3.12; do
    [[ -n "$py" ]] && "$py" -c "import sys; assert sys.version_info[:2] == (3, 12)" 2>/dev/null \
      && { echo "$py"; return; }
  done
  echo "no python3.12 (set PYTHON)" >&2; return 1
}

# The te_jax sources that the installed package is built from, as one hash.
source_stamp() {
  (cd "$1" && find te_jax custom_calls pyproject.toml -type f ! -path '*__pycache__*' -print0 \
     | sort -z | xargs -0 sha256sum | sha256sum | cut -d' ' -f1)
}

setup() {
  mkdir -p "$DEVICELESS_CACHE"
  if [[ ! -x "$PY" ]]; then
    log "venv: $VENV"
    "$(find_python312)" -m venv "$VENV"
  fi
  if ! "$PY" -c "import jax, jax_plugins.xla_cuda13, flax, optax, nanobind, tqdm
assert jax.__version__ == '$JAX_VERSION'" 2>/dev/null; then
    log "pip: jax[cuda13]==$JAX_VERSION, flax, optax, build tools"
    "$PY" -m pip install -q "jax[cuda13]==$JAX_VERSION" "flax>=0.12.8" "optax>=0.2.6" numpy \
      scikit-build-core nanobind cmake ninja tqdm
  fi
  if [[ "$("$PY" -m pip show nvidia-cudnn-cu13 2>/dev/null | sed -n 's/^Version: //p')" \
        != "$CUDNN_VERSION" ]]; then
    log "pip: nvidia-cudnn-cu13==$CUDNN_VERSION"
    "$PY" -m pip install -q --no-deps "nvidia-cudnn-cu13==$CUDNN_VERSION"
  fi
  # A copy of the working tree (committed or not; no .git, no ignored files),
  # so the build never writes into the repository.
  local src="$DEVICELESS_CACHE/src" stamp_file="$DEVICELESS_CACHE/te_jax_build.stamp"
  rm -rf "$src" && mkdir -p "$src"
  (cd "$REPO" && git ls-files -z --cached --others --exclude-standard \
     | tar -c --null --ignore-failed-read -T - -f - 2>/dev/null) | tar -x -C "$src"
  local stamp; stamp="$(source_stamp "$src")"
  if [[ "${FORCE_BUILD:-0}" == 1 || "$(cat "$stamp_file" 2>/dev/null)" != "$stamp" ]] \
     || ! (cd /tmp && "$PY" -c "from te_jax import _te_jax_ffi") 2>/dev/null; then
    log "build te_jax (pip CUDA toolkit; log: $DEVICELESS_CACHE/build.log)"
    "$PY" -m pip install --no-build-isolation --no-deps -v "$src" \
      -C cmake.define.TE_JAX_CUDA_TOOLKIT=pip -C cmake.define.TE_JAX_SM90_GEMMS=OFF \
      -C build-dir="$DEVICELESS_CACHE/build" > "$DEVICELESS_CACHE/build.log" 2>&1 \
      || { tail -30 "$DEVICELESS_CACHE/build.log" >&2; return 1; }
    (cd /tmp && "$PY" -c "from te_jax import _te_jax_ffi") \
      || { echo "te_jax built without its CUDA module: see build.log" >&2; return 1; }
    echo "$stamp" > "$stamp_file"
  fi
}

# table NAME [model_memory.py flags...]
table() {
  local name="$1"; shift
  log "$name -> $OUT/$name.md"
  # shellcheck disable=SC2086  # EXTRA_ARGS: several flags
  "$PY" "$REPO/tools/deviceless_memory.py" ${EXTRA_ARGS:-} compile \
    --preset "${PRESET:-llama}" --batches "${BATCHES:-8}" \
    --recipes "${RECIPES:-none,delayed,current,blockwise}" --jobs "${JOBS:-2}" --timeout 3600 \
    --json-out "$OUT/$name.json" "$@" > "$OUT/$name.md" 2> "$OUT/$name.err" \
    || { log "$name FAILED (see $OUT/$name.err)"; status=1; }
  cat "$OUT/$name.md"; echo
}

[[ "${SKIP_SETUP:-0}" == 1 ]] || setup
LIBRARY_PLAN=keep_fp8_copies=false,store_act_input_in_fp8=false
ACT_FP8_PLAN=keep_fp8_copies=false,store_act_input_in_fp8=true
status=0
for name in ${TABLES-t1_default t2_act_fp8 t3_offload t4_offload_act_fp8}; do
  case "$name" in
    t1_default) table "$name" --set "$LIBRARY_PLAN" ;;
    t2_act_fp8) table "$name" --set "$ACT_FP8_PLAN" ;;
    t3_offload) table "$name" --offload_optimizer --set "$LIBRARY_PLAN" ;;
    t4_offload_act_fp8) table "$name" --offload_optimizer --set "$ACT_FP8_PLAN" ;;
    *) echo "unknown table $name" >&2; status=1 ;;
  esac
done
exit $status
