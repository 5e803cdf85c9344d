#!/usr/bin/env bash
# The open issues' GPU work as one background run on a 1-GPU machine: stages
# back to back, each under its own time limit, logs under $RUN_DIR, one line
# per stage in $RUN_DIR/stages.log. The machine goes back 30 s after a device
# call ends, so start this in the background and keep calling `... wait`:
#
#   call 1:  cp -a . /tmp/repo && (setsid bash /tmp/repo/tools/gpu_session.sh \
#              > /tmp/gpu_session.log 2>&1 < /dev/null &)      # carry .cutlass (+ bases)
#   later:   bash /tmp/repo/tools/gpu_session.sh wait 540     # prints stages.log; the logs
#                                                             # come back as $OUT/logs.tgz
#
# Stages (STAGES, space-separated; default "build ab suite kernels grouped
# moe offload"; peers on request), run in this order:
#   build     this tree (with the CUTLASS sm90 GEMMs when .cutlass/ holds the
#             headers' tarball) beside the A/B bases (AB_BASES, as
#             tools/gpu_ab.sh takes them); then in the background: the
#             standalone kernel harnesses and the nvcc-free build (NVCC_FREE)
#   ab        tools/gpu_ab.sh bench against every base (AB_CONFIGS), on an
#             otherwise idle GPU
#   suite     pytest -m gpu (tools/gpu_check.sh test, the serial files too),
#             beside model_memory.py's compile-only Llama tables: with
#             --offload_optimizer, without it with the peak's buffers and
#             XLA's remat copies (batch 4 and 8), and FP8 at batch 8 with
#             store_act_input_in_fp8
#   model     bench_model.py --preset llama, batch 8, every recipe (MODEL_RECIPES),
#             with MODEL_SET's overrides (bench_model's --set) when given
#   keep      the same with --set keep_fp8_copies=true (not in the default list)
#   kernels   tools/gpu_kernels.sh blockwise grouped own (not with KERNEL_HARNESS=0);
#             bench_ops.py --only act, then --only quantize (not with KERNEL_OPS=0)
#   memory    model_memory.py's compile-only Llama tables at batch 8 (default plan;
#             store_act_input_in_fp8; --offload_optimizer with and without it), in
#             the background beside the stages after it (on request; best beside
#             ncu, whose timings a busy CPU does not move)
#   actncu    Nsight Compute on bench_ops.py --only act's te_jax kernels (on request)
#   ncu       tools/gpu_kernels.sh ncu act: Nsight Compute on the blockwise GEMMs,
#             ours (CUTLASS's and, when built, our own) and cuBLASLt's, and on the
#             activation-quantize kernels of benchmarks/act_math.cu (on request)
#   presets   bench_model.py's other rows of issue 43: --preset llama at batch 4,
#             and --preset h200, every recipe (on request)
#   accuracy  benchmarks/act_input_accuracy.py: store_act_input_in_fp8's
#             gradient error beside the default's (on request)
#   grouped   benchmarks/bench_grouped.py (te_jax grouped GEMM vs ragged_dot)
#   peers     bench_peers.py --libs te_jax,te $PEERS_ARGS (MLP block and TransformerLayer):
#             te_jax beside TE-JAX 2.20.2, whose pieces later calls copy to
#             /tmp/te/c0..c5 (../shared/peer/README.md: each call
#             `cp -r .te/cN /tmp/te/.cN && mv /tmp/te/.cN /tmp/te/cN`); its
#             build starts in the background once all six are there
#   actfp8    ACTFP8_RECIPES (default bf16 and the three FP8 recipes) with
#             --set keep_fp8_copies=false,store_act_input_in_fp8=true (not in
#             the default list; the model stage runs the preset's plan, both on)
#   moe       bench_moe.py rows (MOE_PARTS, default layer,model; the layer at
#             each of MOE_LAYER_SIZES, default "full wide"; MOE_RECIPES;
#             MOE_TIMEOUT seconds each), each layer row with its 12 largest kernels
#   offload   bench_model.py with --set offload_optimizer=true (bf16, delayed), then
#             without it unless the model stage ran (the same-lease baseline)
#   jax012    the GPU suite on the jax wheels in $JAX_WHEELS (a venv over the
#             image's packages, te_jax built against that jax's FFI headers)
# NVCC_FREE: a tar.xz of the pip CUDA compiler packages (nvidia-cuda-nvcc,
# -crt, nvvm, -cccl as installed site-packages); when set, the build stage
# waits for it (it may arrive in pieces, with a later call), unpacks it into
# the image's site-packages, and runs tools/nvcc_free.sh for a venv over the
# image's packages (this tree's install stays untouched): the build with the
# system toolkit hidden, then GPU tests (NVCC_FREE_TESTS) in that same view,
# alongside the suite. The nvcc-free lines join stages.log when it ends.
# PREBUILT: a folder (carried) with the native module built on another
# machine for this image (tools/prebuild_module.sh); the build stage uses it
# when it imports, else builds as usual.
# Env: RUN_DIR (the logs; default /tmp/gpu_session: not the device call's $OUT,
# which a later call empties), STAGES, AB_BASES, AB_CONFIGS, MOE_TIMEOUT,
# MOE_PARTS, MOE_LAYER_SIZES, MOE_RECIPES, MOE_MODEL_RECIPES (the model rows' recipes,
# default MOE_RECIPES), MOE_MODEL_SET (bench_moe's --model-set: overrides on the moe preset), JAX_WHEELS, NVCC_FREE, NVCC_FREE_TESTS, MEMORY_TABLES (the suite
# stage's compile-only tables, default "offload live actfp8"), MODEL_RECIPES (the model
# stage's recipes, default none,delayed,blockwise,current), MODEL_ARGS (more
# bench_model arguments for the model stage, e.g. "--top 15"), MODEL_HLO=1
# (the model stage keeps each recipe's optimized step HLO, gzipped).
set -uo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
RUN_DIR="${RUN_DIR:-/tmp/gpu_session}"; mkdir -p "$RUN_DIR"
LOG="$RUN_DIR/stages.log"

if [[ "${1:-}" == wait ]]; then       # a foreground call: wait, report, hand back logs
  if [[ ! -f "$LOG" ]]; then          # a fresh machine: the lease that ran the session is gone
    echo "no $LOG here: this machine did not start a session (the last one was given back?)"
    exit 3
  fi
  deadline=$(( $(date +%s) + ${2:-540} ))
  while (( $(date +%s) < deadline )) && ! grep -q " END$" "$LOG" 2>/dev/null; do sleep 5; done
  cat "$LOG"
  if [[ -n "${OUT:-}" ]]; then        # the device call's folder: the files come back
    # One archive: a call hands back only a few files.
    cp "$LOG" "$OUT/" 2>/dev/null
    # Nsight Compute's CSVs too: the summary's source when it shows nan or -.
    (cd "$RUN_DIR" && find . \( -name '*.log' -o -name '*.err' -o -name 'ncu*.csv' \
       -o -path './hlo/*.gz' \) -size -4M \
       -print0 | tar -czf "$OUT/logs.tgz" --null -T -)
  fi
  exit 0
fi
OUT="$RUN_DIR"

cd "$REPO" || exit 1
export PYTHONUNBUFFERED=1
st() { echo "$(date -u +%T) $*" >> "$LOG"; }
# gpu_idle PATTERN: ends the processes matching PATTERN that a timed-out
# profile left on the GPU (ncu's timeout does not reach the application it
# profiles: in run AK the act profile's python held the GPU, and the quantize
# profile and batch 4's bf16 row found no device), then waits up to 60 s for
# no compute process to remain.
gpu_idle() {
  pkill -9 -f "$1" 2>/dev/null
  for _ in $(seq 1 12); do
    [[ -z "$(nvidia-smi --query-compute-apps=pid --format=csv,noheader 2>/dev/null)" ]] && return 0
    sleep 5
  done
  st "gpu_idle: compute processes still on the GPU after 60 s"
}
purelib() { "$1" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])"; }
# venv_over_image DIR: a venv that also sees the image's packages. The
# image's python is itself a venv: a --system-site-packages venv would see
# the base interpreter's packages, not the image's; a .pth puts the image's
# site-packages after the venv's own (what is installed there comes first).
venv_over_image() {
  python3 -m venv "$1" && purelib python3 > "$(purelib "$1/bin/python")/zz_image.pth"
}
want() { [[ " ${STAGES:-build ab suite kernels grouped moe offload} " == *" $1 "* ]]; }
# model_rows NAME PREFIX LIMIT ARGS...: bench_model.py --preset llama ARGS
# (LIMIT seconds in all) into $OUT/NAME.log; its rows join stages.log after PREFIX.
model_rows() {
  local name=$1 prefix=$2 limit=$3; shift 3
  (cd /tmp && timeout "$limit" python3 "$REPO/benchmarks/bench_model.py" --preset llama "$@" \
     > "$OUT/$name.log" 2>&1)
  grep -E "^\| (none|delayed|current|blockwise) " "$OUT/$name.log" | sed "s/^/$prefix/" >> "$LOG"
}
# memory_table NAME PREFIX LIMIT ARGS...: model_memory.py --preset llama ARGS at
# batch 8, every recipe (LIMIT seconds) into $OUT/NAME.log; its rows join
# stages.log after PREFIX.
memory_table() {
  local name=$1 prefix=$2 limit=$3; shift 3
  (cd /tmp && timeout "$limit" python3 "$REPO/benchmarks/model_memory.py" --preset llama \
     --batches 8 --recipes none,delayed,current,blockwise --jobs 4 "$@" > "$OUT/$name.log" 2>&1)
  grep -E "^\| 8 \| (none|delayed|current|blockwise) " "$OUT/$name.log" \
    | sed "s/^/$prefix/" >> "$LOG"
}
# use_prebuilt DIR: the native module built elsewhere (tools/prebuild_module.sh:
# this image's Python, jax and CUDA versions) copied into the source tree,
# which every stage then imports (PYTHONPATH) instead of an installed te_jax;
# the build's 136 s saved. Fails (and the stage builds) unless the module
# imports from this tree with the sm90 GEMMs.
use_prebuilt() {
  local so
  so=$(ls "$1"/_te_jax_ffi.cpython-*.so 2>/dev/null | head -1)
  [[ -n "$so" && -f "$1/_te_jax_ffi_build.txt" ]] || { echo "no module in $1" >> "$OUT/build.log"; return 1; }
  cp "$so" "$1/_te_jax_ffi_build.txt" "$REPO/te_jax/" || return 1
  export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
  export LD_LIBRARY_PATH="$(dirname "$(readlink -f "$(command -v nvcc)")")/../lib64:/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  (cd /tmp && python3 -c "
import te_jax, te_jax._te_jax_ffi as m
from te_jax.ops import grouped_gemm_cuda as g
assert te_jax.__file__.startswith('$REPO/'), te_jax.__file__
assert not g.build_reason(), g.build_reason()
print('native module:', sorted(m.registrations()))") >> "$OUT/build.log" 2>&1 && return 0
  rm -f "$REPO/te_jax/$(basename "$so")" "$REPO/te_jax/_te_jax_ffi_build.txt"
  export PYTHONPATH="${PYTHONPATH#$REPO}"; PYTHONPATH="${PYTHONPATH#:}"
  return 1
}
tarball=$(ls .cutlass/cutlass-*-include.tar.gz 2>/dev/null | head -1)
if [[ -n "$tarball" ]]; then
  tar -xzf "$tarball" -C .cutlass
  export SKBUILD_CMAKE_DEFINE="TE_JAX_CUTLASS_INCLUDE=$REPO/.cutlass/include"
fi

if want peers; then   # TE-JAX's build on the CPU while the GPU stages run
  (for _ in $(seq 1 240); do
     [[ -f /tmp/te/c5/build.sh && -d /tmp/te/c0 && -d /tmp/te/c1 && -d /tmp/te/c2 \
        && -d /tmp/te/c3 && -d /tmp/te/c4 ]] && break
     sleep 5
   done
   bash /tmp/te/c5/build.sh /tmp/te > "$OUT/te_build.log" 2>&1 && touch "$OUT/.te_ready"
   touch "$OUT/.te_done") &
fi
if want build; then
  st "build"
  # The A/B bases build beside this tree; the harnesses and the nvcc-free
  # build after it, in the background while the GPU stages run.
  if want ab; then
    (OUT=$OUT AB_SKIP_NEW=1 bash tools/gpu_ab.sh build > "$OUT/build_ab.log" 2>&1) &
    bases_built=$!
  fi
  : > "$OUT/build.log"   # both branches append to it (a prebuilt module that fails, then the build)
  if [[ -n "${PREBUILT:-}" ]] && use_prebuilt "$PREBUILT"; then
    st "build: the prebuilt module in $PREBUILT (PYTHONPATH=$REPO)"
  else
    [[ -n "${PREBUILT:-}" ]] && st "build: the prebuilt module did not import (see build.log); building"
    OUT=$OUT bash tools/gpu_check.sh build >> "$OUT/build.log" 2>&1
  fi
  grep -E "te_jax: (CUDA|sm90)|^build:|native module" "$OUT/build.log" >> "$LOG"
  if [[ -n "$tarball" ]] && { want kernels || want ncu; }; then
    (OUT=$OUT BUILD_ONLY=1 bash tools/gpu_kernels.sh build > "$OUT/build_kernels.log" 2>&1) &
    kernels_built=$!
  fi
  if [[ -n "${NVCC_FREE:-}" ]]; then
    # After the A/B: its timings run on an otherwise idle machine.
    (until [[ -f "$NVCC_FREE" && -f "$OUT/.ab_done" ]]; do sleep 5; done
     tar -xJf "$NVCC_FREE" -C "$(purelib python3)"
     venv_over_image /tmp/vnf
     mkdir -p "$OUT/nvcc_free"
     # shellcheck disable=SC2086  # the test list is a word list
     env -u SKBUILD_CMAKE_DEFINE OUT="$OUT/nvcc_free" PYTHON=/tmp/vnf/bin/python NEED_GPU=1 \
       timeout 900 bash tools/nvcc_free.sh env XLA_PYTHON_CLIENT_PREALLOCATE=false \
       /tmp/vnf/bin/python -m pytest -q -m gpu -n 2 -p no:cacheprovider \
       ${NVCC_FREE_TESTS:-$REPO/tests/test_cuda_ops.py $REPO/tests/test_gpu_dense.py $REPO/tests/test_gpu_flax.py} \
       > "$OUT/nvcc_free.log" 2>&1
     echo "$(date -u +%T) nvcc-free: exit $?; $(grep -E "build note|^build:|FAIL" "$OUT/nvcc_free.log" | tr '\n' ' ')" >> "$LOG"
     tail -n 1 "$OUT/nvcc_free.log" >> "$LOG") &
  fi
fi
if want ab; then
  st "ab"
  wait "${bases_built:-}" 2>/dev/null
  tail -n 1 "$OUT/build_ab.log" >> "$LOG"
  OUT=$OUT timeout 600 bash tools/gpu_ab.sh bench > "$OUT/ab.log" 2>&1
  grep -E "^new against|^\| (mlp|layer)/" "$OUT/ab.log" >> "$LOG"
fi
touch "$OUT/.ab_done"
if want suite; then
  st "suite + model_memory --offload_optimizer"
  (mkdir -p "$OUT/suite" && OUT=$OUT/suite timeout 600 bash tools/gpu_check.sh test \
     > "$OUT/suite.log" 2>&1) &
  s1=$!
  tables=" ${MEMORY_TABLES:-offload live actfp8} "
  # The tables keep the library's residual plan (the llama preset keeps the
  # FP8 copies and h in E4M3; the model stage measures that).
  library_plan=keep_fp8_copies=false,store_act_input_in_fp8=false
  [[ "$tables" == *" offload "* ]] && \
    memory_table memory_offload "offload: " 300 --offload_optimizer --set "$library_plan"
  # Without offload, at batch 4 and 8: the buffers live at the peak, and how
  # many copies XLA's rematerialization made to fit the device.
  # (Each table's rows join stages.log only when it ran: a log left by an
  # earlier session in $RUN_DIR would otherwise be reported again.)
  if [[ "$tables" == *" live "* ]]; then
    (cd /tmp && timeout 300 python3 "$REPO/benchmarks/model_memory.py" --preset llama \
       --batches 4,8 --recipes none,delayed --jobs 4 --dump /tmp/gpu_session_dump --top 15 \
       --set "$library_plan" \
       > "$OUT/memory_live.log" 2>&1)
    grep -E "^\| [48] \| (none|delayed) " "$OUT/memory_live.log" >> "$LOG"
  fi
  # FP8 with the MLP activation's input kept in FP8 (store_act_input_in_fp8).
  if [[ "$tables" == *" actfp8 "* ]]; then
    memory_table memory_act_fp8 "act input in FP8: " 300 \
      --set keep_fp8_copies=false,store_act_input_in_fp8=true
  fi
  wait $s1
  tail -qn 1 "$OUT"/suite/pytest_gpu*.log >> "$LOG"
fi
if want model; then
  st "model"
  # MODEL_SET: Config overrides for every row, e.g.
  # keep_fp8_copies=true,store_act_input_in_fp8=true (speed and memory together)
  # MODEL_ARGS: more bench_model arguments, e.g. "--top 15". MODEL_HLO=1:
  # each recipe's optimized step HLO, gzipped into $OUT/hlo (what
  # tools/hlo_kernels.py reads to say what a kernel of the profile computes).
  saved_xla_flags="${XLA_FLAGS-}"
  if [[ "${MODEL_HLO:-0}" == 1 ]]; then
    export XLA_FLAGS="${XLA_FLAGS:+$XLA_FLAGS }--xla_dump_to=$OUT/xla_dump --xla_dump_hlo_as_text --xla_dump_hlo_module_re=jit_train_step --xla_dump_include_timestamp"
  fi
  model_rows model "${MODEL_SET:+$MODEL_SET: }" 560 \
    --recipes "${MODEL_RECIPES:-none,delayed,blockwise,current}" --timeout 200 \
    ${MODEL_SET:+--set "$MODEL_SET"} ${MODEL_ARGS:-}
  if [[ "${MODEL_HLO:-0}" == 1 ]]; then
    mkdir -p "$OUT/hlo"
    for f in "$OUT"/xla_dump/*jit_train_step*after_optimizations.txt; do
      [[ -f "$f" ]] && gzip -c "$f" > "$OUT/hlo/$(basename "$f").gz"
    done
    rm -rf "$OUT/xla_dump"
    st "model: $(ls "$OUT/hlo" | wc -l) optimized step HLO file(s) in $OUT/hlo (in recipe order)"
    export XLA_FLAGS="$saved_xla_flags"   # the later stages dump nothing
  fi
fi
if want keep; then   # the model with the FP8 copies kept (speed against memory)
  st "keep"
  model_rows keep "keep: " 560 --recipes none,delayed,current,blockwise \
    --set keep_fp8_copies=true --timeout 150
fi
if want kernels && [[ -n "$tarball" && "${KERNEL_HARNESS:-1}" == 1 ]]; then
  st "kernels"
  wait "${kernels_built:-}" 2>/dev/null
  # te_jax's own blockwise GEMM (own) too: its checks, then its timings
  # against cuBLASLt (about 4 minutes on a first run).
  OUT=$OUT timeout 560 bash tools/gpu_kernels.sh blockwise grouped own > "$OUT/kernels.log" 2>&1
  grep -E "^checks:|^blockwise_gemm_own" "$OUT/kernels.log" >> "$LOG"
  sed -n '/^SUMMARY/,$p' "$OUT/blockwise_gemm_own.log" 2>/dev/null | head -40 >> "$LOG"
fi
if want kernels && [[ "${KERNEL_OPS:-1}" == 1 ]]; then   # the activation-quantize passes of the Llama MLP (issue 43's budget)
  st "kernels: bench_ops act"
  (cd /tmp && timeout 300 python3 "$REPO/benchmarks/bench_ops.py" --only act \
     > "$OUT/ops_act.log" 2>&1)
  grep -E "^  (act fwd|dact bwd)" "$OUT/ops_act.log" >> "$LOG"
  # ... and the plain quantize kernels, the float32 weights' among them, and
  # a stack of expert weights in one launch against the lax.map it replaced.
  (cd /tmp && timeout 200 python3 "$REPO/benchmarks/bench_ops.py" --only quantize \
     > "$OUT/ops_quantize.log" 2>&1)
  grep -E "^  (.*: ours |stack )" "$OUT/ops_quantize.log" >> "$LOG"
fi
if want memory; then   # compile-only: the CPU's work, beside the GPU stages that follow
  st "memory (background)"
  (memory_table memory_default "memory: " 400
   memory_table memory_act_fp8 "memory, act input in FP8: " 400 --set store_act_input_in_fp8=true
   memory_table memory_offload "memory, offload: " 400 --offload_optimizer
   memory_table memory_offload_act_fp8 "memory, offload + act input in FP8: " 400 \
     --offload_optimizer --set store_act_input_in_fp8=true) &
  memory_tables=$!
fi
if want actncu; then   # Nsight Compute's budget of the activation-quantize kernels
  st "actncu"
  # bench_ops' act and quantize rows with each case's kernels launched a few
  # times (BENCH_OPS_CALLS=1,1), te_jax's prologue and tile kernels only (XLA's
  # reference kernels are not profiled): every case gets its rows, where a
  # launch count over the normal timing loop spent itself on the first case.
  # Without jax's preallocation: run AJ profiled 16 launches in 240 s and run
  # AK none in 200, and a kernel replay that saves and restores the memory a
  # kernel may write would copy XLA's whole preallocated pool (60 GB) on
  # every pass (the likely cause; not confirmed).
  for only in act quantize; do
    (cd /tmp && BENCH_OPS_CALLS=1,1 XLA_PYTHON_CLIENT_PREALLOCATE=false \
       timeout -k 10 240 ncu --clock-control none \
       --kernel-name-base function \
       --kernel-name "regex:ActQuantize|TileAmax|QuantizeTile|QuantizeStack|QuantizeVec|AmaxKernel" \
       --launch-count 120 --csv --page details --section SpeedOfLight \
       --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis \
       --section WarpStateStats --section Occupancy --section LaunchStats \
       --section InstructionStats python3 "$REPO/benchmarks/bench_ops.py" --only "$only" \
       > "$OUT/ncu_$only.csv" 2> "$OUT/ncu_$only.err") \
      || echo "actncu ($only): exit $? (see ncu_$only.err)" >> "$LOG"
    gpu_idle "$REPO/benchmarks/bench_ops.py"
    python3 tools/ncu_summary.py "$OUT/ncu_$only.csv" > "$OUT/ncu_$only.log" 2>&1
    grep -E "^\| " "$OUT/ncu_$only.log" >> "$LOG"
  done
fi
if want ncu && [[ -n "$tarball" ]]; then   # Nsight Compute's budget of the blockwise GEMMs
  st "ncu"
  wait "${kernels_built:-}" 2>/dev/null
  # act: the activation kernels' harness timed and profiled too (act_math).
  OUT=$OUT timeout 560 bash tools/gpu_kernels.sh ncu act > "$OUT/ncu.log" 2>&1
  gpu_idle "blockwise_gemm_sm90|blockwise_gemm_own|act_math"
  grep -E "^\| | fwd | bwd " "$OUT/ncu.log" >> "$LOG"
fi
if want presets; then   # issue 43's batch-4 and h200-preset rows
  wait "${memory_tables:-}" 2>/dev/null   # timings on an idle CPU
  st "presets"
  # 180 s a row: delayed's row at batch 4 ran past 120 s in run AM (the
  # others took under 120).
  model_rows batch4 "batch 4: " 560 --recipes none,delayed,current,blockwise \
    --set batch=4 --timeout 180
  model_rows h200 "h200 preset: " 480 --recipes none,delayed,current,blockwise \
    --preset h200 --timeout 120
fi
if want accuracy; then   # store_act_input_in_fp8's gradients against FP8's own error
  st "accuracy"
  (cd /tmp && timeout 200 python3 "$REPO/benchmarks/act_input_accuracy.py" \
     > "$OUT/accuracy.log" 2>&1) || echo "accuracy: exit $?" >> "$LOG"
  grep -E "^\| " "$OUT/accuracy.log" >> "$LOG"
fi
if want grouped; then
  st "grouped"
  (cd /tmp && timeout 300 python3 "$REPO/benchmarks/bench_grouped.py" > "$OUT/grouped.log" 2>&1)
  grep -E "^\| (fprop|dgrad|wgrad) " "$OUT/grouped.log" >> "$LOG"
fi
if want peers; then
  st "peers"
  for _ in $(seq 1 120); do [[ -f "$OUT/.te_done" ]] && break; sleep 5; done
  if [[ -f "$OUT/.te_ready" ]]; then
    CUDNN_PATH=$(python3 -c "import nvidia.cudnn as c; print(list(c.__path__)[0])")
    (cd /tmp && CUDNN_PATH=$CUDNN_PATH CUDNN_HOME=$CUDNN_PATH \
       LD_LIBRARY_PATH=$CUDNN_PATH/lib:${LD_LIBRARY_PATH:-} timeout 500 \
       python3 "$REPO/benchmarks/bench_peers.py" --libs te_jax,te --blocks mlp,layer \
       ${PEERS_ARGS:-} > "$OUT/peers.log" 2>&1)   # (an argument list: split on spaces)
    grep -E "^\| " "$OUT/peers.log" | tail -n 30 >> "$LOG"
  else
    echo "peers: TE-JAX did not build ($(tail -n 2 "$OUT/te_build.log" 2>/dev/null | tr '\n' ' '))" >> "$LOG"
  fi
fi
if want actfp8; then   # the model with the MLP activation's input kept in FP8
  st "actfp8"
  model_rows actfp8 "act input in FP8: " 560 --recipes "${ACTFP8_RECIPES:-none,delayed,current,blockwise}" \
    --set keep_fp8_copies=false,store_act_input_in_fp8=true --timeout 180
fi
if want moe; then
  st "moe"
  parts=" ${MOE_PARTS:-layer,model} "; parts=${parts//,/ }
  if [[ "$parts" == *" layer "* ]]; then
    for size in ${MOE_LAYER_SIZES:-full wide}; do   # the preset's layer; GEMM-bound experts
      (cd /tmp && timeout 600 python3 "$REPO/benchmarks/bench_moe.py" --parts layer \
         --layer-sizes "$size" --recipes "${MOE_RECIPES:-none,delayed}" \
         --timeout "${MOE_TIMEOUT:-150}" --top-kernels 12 > "$OUT/moe_layer_$size.log" 2>&1)
      grep -E "^layer " "$OUT/moe_layer_$size.log" | sed "s/^/$size: /" >> "$LOG"
    done
  fi
  if [[ "$parts" == *" model "* ]]; then
    # A model row: init ~80 s, lower + compile up to 85 s, the trace's second
    # compile (command buffers off) about as long again, then the steps:
    # 150 s a row was too short in run AO.
    (cd /tmp && timeout 1000 python3 "$REPO/benchmarks/bench_moe.py" --parts model \
       --recipes "${MOE_MODEL_RECIPES:-${MOE_RECIPES:-none,delayed}}" \
       ${MOE_MODEL_SET:+--model-set "$MOE_MODEL_SET"} \
       --timeout "${MOE_TIMEOUT:-300}" --top-kernels 25 > "$OUT/moe_model.log" 2>&1)
    grep -E "^model " "$OUT/moe_model.log" >> "$LOG"
  fi
fi
if want offload; then
  st "offload"
  model_rows offload "" 560 --recipes none,delayed --set offload_optimizer=true --timeout 270
  if ! want model; then   # the same rows without offload: the cost, measured in this lease
    model_rows offload_baseline "no offload: " 400 --recipes none,delayed --timeout 180
  fi
fi
if want jax012 && [[ -d "${JAX_WHEELS:-}" ]]; then
  st "jax012"
  venv_over_image /tmp/vjax && /tmp/vjax/bin/python -m pip install -q --no-index --no-deps \
    "$JAX_WHEELS"/*.whl > "$OUT/jax012.log" 2>&1
  /tmp/vjax/bin/python -m pip install --no-build-isolation --no-deps -v . >> "$OUT/jax012.log" 2>&1
  mkdir -p "$OUT/jax012" && PATH=/tmp/vjax/bin:$PATH OUT=$OUT/jax012 timeout 560 \
    bash tools/gpu_check.sh test >> "$OUT/jax012.log" 2>&1
  tail -qn 1 "$OUT"/jax012/pytest_gpu*.log >> "$LOG"
fi
wait   # the nvcc-free run, when it is still going
st "END"
