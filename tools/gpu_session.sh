#!/usr/bin/env bash
# The open issues' GPU work as one background run on a 1-GPU machine: stages
# back to back, each under its own time limit, logs under $OUT, one line per
# stage in $OUT/stages.log. The machine goes back 30 s after a device call
# ends, so start this in the background and keep calling `... wait`:
#
#   call 1:  cp -a . /tmp/repo && (setsid bash /tmp/repo/tools/gpu_session.sh \
#              > /tmp/gpu_session.log 2>&1 < /dev/null &)      # carry .cutlass, .ab_base
#   later:   bash /tmp/repo/tools/gpu_session.sh wait 540     # prints stages.log and copies
#                                                             # the logs to the call's $OUT
#
# Stages (STAGES, space-separated, in this order by default):
#   build     this tree (with the CUTLASS sm90 GEMMs when .cutlass/ holds the
#             headers' tarball) and the A/B base (.ab_base) side by side, and the
#             standalone kernel harnesses (tools/gpu_kernels.sh build)
#   ab        tools/gpu_ab.sh bench (AB_CONFIGS: the MLP and layer rows per recipe)
#   suite     pytest -m gpu (tools/gpu_check.sh test), beside model_memory.py's
#             compile-only Llama tables (with and without --offload_optimizer)
#   model     bench_model.py --preset llama, batch 8, every recipe
#   kernels   tools/gpu_kernels.sh blockwise grouped
#   moe       bench_moe.py (layer rows; MOE_TIMEOUT seconds each)
#   offload   bench_model.py with --set offload_optimizer=true
#   jax012    the GPU suite on the jax wheels in $JAX_WHEELS (a venv over the
#             image's packages, te_jax built against that jax's FFI headers)
# Env: RUN_DIR (the logs; default /tmp/gpu_session: not the device call's $OUT,
# which a later call empties), STAGES, AB_CONFIGS, MOE_TIMEOUT, JAX_WHEELS.
set -uo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
RUN_DIR="${RUN_DIR:-/tmp/gpu_session}"; mkdir -p "$RUN_DIR"
LOG="$RUN_DIR/stages.log"

if [[ "${1:-}" == wait ]]; then       # a foreground call: wait, report, hand back logs
  deadline=$(( $(date +%s) + ${2:-540} ))
  while (( $(date +%s) < deadline )) && ! grep -q " END$" "$LOG" 2>/dev/null; do sleep 5; done
  cat "$LOG"
  if [[ -n "${OUT:-}" ]]; then        # the device call's folder: the files come back
    (cd "$RUN_DIR" && find . -name '*.log' -size -4M -exec cp --parents {} "$OUT/" \;)
  fi
  exit 0
fi
OUT="$RUN_DIR"

cd "$REPO" || exit 1
export PYTHONUNBUFFERED=1
st() { echo "$(date -u +%T) $*" >> "$LOG"; }
want() { [[ " ${STAGES:-build ab suite model kernels moe offload jax012} " == *" $1 "* ]]; }
tarball=$(ls .cutlass/cutlass-*-include.tar.gz 2>/dev/null | head -1)
if [[ -n "$tarball" ]]; then
  tar -xzf "$tarball" -C .cutlass
  export SKBUILD_CMAKE_DEFINE="TE_JAX_CUTLASS_INCLUDE=$REPO/.cutlass/include"
fi

if want build; then
  st "build"
  OUT=$OUT bash tools/gpu_ab.sh build > "$OUT/build_ab.log" 2>&1 &
  b1=$!
  [[ -n "$tarball" ]] && OUT=$OUT BUILD_ONLY=1 bash tools/gpu_kernels.sh build \
    > "$OUT/build_kernels.log" 2>&1
  wait $b1
  grep -E "te_jax: (CUDA|sm90)|^build:" "$OUT/build.log" >> "$LOG"
fi
if want ab; then
  st "ab"
  OUT=$OUT timeout 600 bash tools/gpu_ab.sh bench > "$OUT/ab.log" 2>&1
  grep -E "^\| (mlp|layer)/" "$OUT/ab.log" >> "$LOG"
fi
if want suite; then
  st "suite + model_memory"
  (mkdir -p "$OUT/suite" && OUT=$OUT/suite timeout 600 bash tools/gpu_check.sh test \
     > "$OUT/suite.log" 2>&1) &
  s1=$!
  (cd /tmp && timeout 420 python3 "$REPO/benchmarks/model_memory.py" --preset llama \
     --batches 4,8 --recipes none,delayed,current,blockwise --jobs 4 > "$OUT/memory.log" 2>&1
   cd /tmp && timeout 240 python3 "$REPO/benchmarks/model_memory.py" --preset llama \
     --batches 8 --recipes none,delayed,current,blockwise --jobs 4 --offload_optimizer \
     > "$OUT/memory_offload.log" 2>&1)
  wait $s1
  tail -qn 1 "$OUT"/suite/pytest_gpu*.log >> "$LOG"
fi
if want model; then
  st "model"
  (cd /tmp && timeout 560 python3 "$REPO/benchmarks/bench_model.py" --preset llama \
     --recipes none,delayed,blockwise,current --timeout 200 > "$OUT/model.log" 2>&1)
  grep -E "^\| (none|delayed|current|blockwise) " "$OUT/model.log" >> "$LOG"
fi
if want kernels && [[ -n "$tarball" ]]; then
  st "kernels"
  OUT=$OUT timeout 200 bash tools/gpu_kernels.sh blockwise grouped > "$OUT/kernels.log" 2>&1
  grep -E "^checks:" "$OUT/kernels.log" >> "$LOG"
fi
if want moe; then
  st "moe"
  (cd /tmp && timeout 600 python3 "$REPO/benchmarks/bench_moe.py" --parts layer \
     --timeout "${MOE_TIMEOUT:-180}" > "$OUT/moe.log" 2>&1)
  grep -E "^layer " "$OUT/moe.log" >> "$LOG"
fi
if want offload; then
  st "offload"
  (cd /tmp && timeout 400 python3 "$REPO/benchmarks/bench_model.py" --preset llama \
     --recipes none,delayed --set offload_optimizer=true --timeout 180 > "$OUT/offload.log" 2>&1)
  grep -E "^\| (none|delayed) " "$OUT/offload.log" >> "$LOG"
fi
if want jax012 && [[ -d "${JAX_WHEELS:-}" ]]; then
  st "jax012"
  # The image's python is itself a venv: a --system-site-packages venv would
  # see the base interpreter's packages, not the image's; a .pth puts the
  # image's site-packages after the new jax.
  site=$(python3 -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
  python3 -m venv /tmp/vjax && /tmp/vjax/bin/python -m pip install -q --no-index --no-deps \
    "$JAX_WHEELS"/*.whl > "$OUT/jax012.log" 2>&1
  echo "$site" > "$(/tmp/vjax/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")/zz_image.pth"
  /tmp/vjax/bin/python -m pip install --no-build-isolation --no-deps -v . >> "$OUT/jax012.log" 2>&1
  mkdir -p "$OUT/jax012" && PATH=/tmp/vjax/bin:$PATH OUT=$OUT/jax012 timeout 560 \
    bash tools/gpu_check.sh test >> "$OUT/jax012.log" 2>&1
  tail -qn 1 "$OUT"/jax012/pytest_gpu*.log >> "$LOG"
fi
st "END"
