#!/usr/bin/env bash
# One device call for te_jax's own sm_90a FP8 GEMMs (issue 46, phase 1): build
# the CUTLASS-based kernels and the two standalone harnesses, run the checks
# and timings, write logs to $OUT, print a short table last.
#
# Usage (from the repo root): bash tools/gpu_kernels.sh [fetch] [build] [blockwise] [grouped]
#   [ncu] [own] [act] (default: build blockwise grouped; ncu: Nsight Compute's budget of
#   the blockwise GEMMs, NCU_VARIANTS; own: build, check and time te_jax's own
#   blockwise GEMM, benchmarks/blockwise_gemm_own.cu, issue 46 phase 2 — it
#   needs no "build" step; act: benchmarks/act_math.cu, the activation-quantize
#   kernels, with ncu also Nsight Compute on them; own and act build before
#   BUILD_ONLY's exit, and their binaries are reused by stamp like the
#   objects). Needs the CUTLASS headers in .cutlass/include or as
#   .cutlass/cutlass-<version>-include.tar.gz (an ignored folder, made by
#   `bash tools/gpu_kernels.sh fetch` on a machine with PyPI: the
#   nvidia-cutlass 4.2.0.0 wheel's cutlass_library/source/include); carry
#   .cutlass with the call.
# Env:
#   CUTLASS_DIR   default $REPO/.cutlass (include/ inside; build/ for objects)
#   KBUILD        object/binary folder, default $CUTLASS_DIR/build. An object
#                 whose stamp (hash of its sources, the headers, the flags and
#                 nvcc's version) matches is reused, so objects built on a CPU
#                 machine and carried inside .cutlass skip the compile here.
#   CUBLAS_ROOT   folder with include/cublasLt.h and lib/libcublasLt.so* when
#                 the toolkit has none (CPU build checks); default: toolkit's.
#   JOBS          parallel compiles, default nproc
#   BLOCKWISE_ARGS  extra harness arguments (e.g. "--sweep", "--quick")
#   GROUPED_ARGS
#   OWN_ARGS      extra arguments of the own harness's timing run ("--quick", "--sweep")
#   OWN_CONFIGS   comma-separated configurations of the own harness to check and
#                 time (default: every one --list names)
#   NCU_GEMMS=0   with ncu: no GEMM profiles (e.g. "act ncu" for the act kernels only)
#   BUILD_ONLY=1  compile and link, run nothing (for machines without a GPU)
set -uo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="${OUT:-/tmp/te_jax_out}"
CUTLASS_DIR="${CUTLASS_DIR:-$REPO/.cutlass}"
KBUILD="${KBUILD:-$CUTLASS_DIR/build}"
JOBS="${JOBS:-$(nproc)}"
mkdir -p "$OUT" "$KBUILD"
STEPS=("$@")
[[ ${#STEPS[@]} -eq 0 ]] && STEPS=(build blockwise grouped)
want() { local s; for s in "${STEPS[@]}"; do [[ "$s" == "$1" ]] && return 0; done; return 1; }
t0=$(date +%s)
cd "$REPO" || exit 1
CUTLASS_VERSION=4.2.0.0

# fetch (on a CPU machine with PyPI, not on the GPU machine): the wheel's
# C++ headers into $CUTLASS_DIR/include and a tarball of them beside it.
if want fetch; then
  tmp=$(mktemp -d)
  python3 -m pip download --no-deps --dest "$tmp" "nvidia-cutlass==$CUTLASS_VERSION" > /dev/null \
    && python3 -m zipfile -e "$tmp"/nvidia_cutlass-*.whl "$tmp/whl" \
    || { echo "gpu_kernels: could not fetch nvidia-cutlass==$CUTLASS_VERSION"; exit 1; }
  rm -rf "$CUTLASS_DIR/include"
  mkdir -p "$CUTLASS_DIR"
  cp -r "$tmp/whl/cutlass_library/source/include" "$CUTLASS_DIR/include"
  echo "nvidia-cutlass $CUTLASS_VERSION (PyPI wheel), cutlass_library/source/include" \
    > "$CUTLASS_DIR/VERSION"
  tar -czf "$CUTLASS_DIR/cutlass-$CUTLASS_VERSION-include.tar.gz" -C "$CUTLASS_DIR" include
  rm -rf "$tmp"
  echo "gpu_kernels: CUTLASS $CUTLASS_VERSION headers in $CUTLASS_DIR"
  [[ ${#STEPS[@]} -eq 1 ]] && exit 0
fi

# A carried tarball of the include tree is unpacked once.
if [[ ! -f "$CUTLASS_DIR/include/cutlass/cutlass.h" ]] && ls "$CUTLASS_DIR"/cutlass-*-include.tar.gz \
    > /dev/null 2>&1; then
  tar -xzf "$(ls "$CUTLASS_DIR"/cutlass-*-include.tar.gz | head -1)" -C "$CUTLASS_DIR"
fi
[[ -f "$CUTLASS_DIR/include/cutlass/cutlass.h" ]] || {
  echo "gpu_kernels: no CUTLASS headers in $CUTLASS_DIR/include (see the header of this script)"
  exit 1
}
# Include / link flags for cuBLASLt when the toolkit has none; not part of
# the object stamps (an object built against the wheel's headers is reused).
CUBLAS_INC=()
CUBLAS_LINK=(-lcublasLt)
if [[ -n "${CUBLAS_ROOT:-}" ]]; then
  CUBLAS_INC=(-I"$CUBLAS_ROOT/include")
  CUBLAS_LINK=(-L"$CUBLAS_ROOT/lib" -Xlinker -rpath="$CUBLAS_ROOT/lib" -l:libcublasLt.so.13)
fi
FLAGS=(-std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a --expt-relaxed-constexpr -DNDEBUG
       -Icustom_calls -Ibenchmarks -I"$CUTLASS_DIR/include")

{
  date -u
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,power.draw,power.limit \
    --format=csv 2>/dev/null || echo "no nvidia-smi"
  nvcc --version | tail -1
} 2>&1 | tee "$OUT/kernels_env.log"

# deps FILE: FILE and the repository headers it includes, recursively
# ("kernels/..." under custom_calls/, the harness headers under benchmarks/).
deps() {
  local f=$1 inc
  echo "$f"
  for inc in $(sed -n 's/^#include "\(.*\)"/\1/p' "$f"); do
    if [[ -f "custom_calls/$inc" ]]; then deps "custom_calls/$inc"
    elif [[ -f "benchmarks/$inc" ]]; then deps "benchmarks/$inc"
    fi
  done
}
export -f deps

# source_stamp SOURCE TEXT...: the hash that says a build from SOURCE is
# still current: SOURCE and the repository headers it includes, TEXT (one
# line each: what else the build depends on, e.g. its flags) and nvcc's
# version.
source_stamp() {
  local src=$1; shift
  (deps "$src" | sort -u | xargs cat; printf '%s\n' "$@"; nvcc --version) \
    | sha256sum | cut -c1-16
}
export -f source_stamp

# compile SOURCE: its object in $KBUILD, unless the stamp beside the object
# (hash of the source and the repository headers it includes, the CUTLASS
# version, the flags and nvcc's version) matches.
compile() {
  local src=$1 name obj stamp s
  name=$(basename "$src" .cu)
  [[ "$src" == benchmarks/* ]] && name="bench_$name"  # the harness beside the kernels' table
  obj="$KBUILD/$name.o"
  stamp=$(source_stamp "$src" "$(cat "$CUTLASS_DIR/VERSION")" \
          "${FLAGS_STR//$CUTLASS_DIR/CUTLASS_DIR}")
  if [[ -f "$obj" && "$(cat "$KBUILD/$name.stamp" 2>/dev/null)" == "$stamp" ]]; then
    echo "$name: reused"
    return 0
  fi
  s=$(date +%s)
  # shellcheck disable=SC2086  # word lists on purpose
  if nvcc $FLAGS_STR $CUBLAS_INC_STR -Xptxas -v -c "$src" -o "$obj" > "$KBUILD/$name.log" 2>&1; then
    echo "$stamp" > "$KBUILD/$name.stamp"
    echo "$name: compiled in $(( $(date +%s) - s )) s ($(grep -o 'Used [0-9]* registers' \
      "$KBUILD/$name.log" | sort -u | tr '\n' ' '))"
  else
    echo "$name: COMPILE FAILED (see $KBUILD/$name.log)"; tail -20 "$KBUILD/$name.log"
    return 1
  fi
}
export -f compile
export KBUILD CUTLASS_DIR
export FLAGS_STR="${FLAGS[*]}" CUBLAS_INC_STR="${CUBLAS_INC[*]}"

if want build; then
  s=$(date +%s)
  # Kernels first in the list: they take longest (about a minute each).
  ls custom_calls/kernels/*sm90*.cu benchmarks/blockwise_gemm_sm90.cu benchmarks/grouped_gemm_sm90.cu \
    | xargs -P "$JOBS" -I{} bash -c 'compile "$1"' _ {} 2>&1 | tee "$OUT/kernels_build.log"
  for h in blockwise grouped; do
    nvcc "${FLAGS[@]}" "$KBUILD/bench_${h}_gemm_sm90.o" "$KBUILD/${h}_gemm_sm90"*.o \
      "${CUBLAS_LINK[@]}" -o "$KBUILD/${h}_gemm_sm90" \
      >> "$OUT/kernels_build.log" 2>&1 \
      || { echo "link of ${h}_gemm_sm90 FAILED"; tail -20 "$OUT/kernels_build.log"; exit 1; }
  done
  echo "build: $(( $(date +%s) - s )) s (objects and binaries in $KBUILD)" | tee -a "$OUT/kernels_build.log"
fi
# build_own / run_own: te_jax's own blockwise GEMM (no CUTLASS objects: one
# source, CuTe headers only for the wgmma atoms). Built here (before the
# BUILD_ONLY exit, so CPU machines can check that it compiles), then each configuration's
# checks in its own process; then the timing run of those that passed. The
# harness guards every first launch (5 s watchdog, bounded waits in the
# kernel): a configuration that hangs or faults makes it print
# "DROP <config> (...)" and exit, and the timing run is repeated without it.
# Logs: $OUT/blockwise_gemm_own_checks.log, $OUT/blockwise_gemm_own.log.
build_own() {
  local name=blockwise_gemm_own log
  log=$(compile benchmarks/blockwise_gemm_own.cu 2>&1)
  echo "$log" | tee -a "$OUT/kernels_build.log"
  if [[ "$log" == *FAILED* ]] || ! nvcc "${FLAGS[@]}" "$KBUILD/bench_$name.o" "${CUBLAS_LINK[@]}" \
      -o "$KBUILD/$name" >> "$OUT/kernels_build.log" 2>&1; then
    echo "$name: BUILD FAILED (see $OUT/kernels_build.log, $KBUILD/bench_$name.log)"
    OWN_BUILT=0; return
  fi
  OWN_BUILT=1
  # ptxas's verdicts that matter for speed: serialized wgmma (C75xx), spills.
  grep -h "C75[0-9][0-9]\|spill" "$KBUILD/bench_$name.log" 2>/dev/null \
    | grep -v " 0 bytes spill stores, 0 bytes spill loads" | sort -u | head -12
}
run_own() {
  local name=blockwise_gemm_own bin="$KBUILD/blockwise_gemm_own" v pass=() rc try dropped log
  [[ "${OWN_BUILT:-0}" == 1 ]] || { status=1; return; }
  : > "$OUT/${name}_checks.log"
  local listed
  listed=$("$bin" --list | tr '\n' ' ')
  for v in ${OWN_CONFIGS//,/ }; do  # a name the harness lacks is reported, not skipped quietly
    [[ " $listed " == *" $v "* ]] && continue
    echo "$name: OWN_CONFIGS names $v, which --list does not"
    status=1
  done
  for v in $listed; do
    [[ -n "${OWN_CONFIGS:-}" && ",$OWN_CONFIGS," != *",$v,"* ]] && continue
    timeout -k 10 120 "$bin" --checks --only "$v" >> "$OUT/${name}_checks.log" 2>&1
    rc=$?
    if [[ $rc -eq 0 ]]; then pass+=("$v"); else echo "$name: $v FAILED its checks (exit $rc)"; status=1; fi
  done
  grep -E "FAIL|DROP|LAUNCH-ERROR" "$OUT/${name}_checks.log" | head -20
  echo "$name: checks passed by ${#pass[@]} configuration(s): ${pass[*]}"
  : > "$OUT/$name.log"
  for try in 1 2 3 4; do
    [[ ${#pass[@]} -eq 0 ]] && return
    log="$OUT/$name.try$try.log"
    # shellcheck disable=SC2086  # OWN_ARGS is a word list
    timeout -k 10 300 "$bin" --timing --only "$(IFS=,; echo "${pass[*]}")" ${OWN_ARGS:-} \
      > "$log" 2>&1
    rc=$?
    cat "$log" >> "$OUT/$name.log"
    [[ $rc -eq 0 ]] && return
    dropped=$(sed -n 's/^DROP \([^ ]*\) .*/\1/p' "$log" | tail -1)
    echo "$name timing (try $try): exit $rc${dropped:+, dropped $dropped} (see $log)"
    status=1
    # Only a configuration the harness named (hang 124, fault 125) is
    # dropped and the rest rerun; any other failure ends here.
    [[ -z "$dropped" || ( $rc -ne 124 && $rc -ne 125 ) ]] && return
    local keep=()
    for v in "${pass[@]}"; do [[ "$v" != "$dropped" ]] && keep+=("$v"); done
    pass=("${keep[@]}")
  done
}
want own && build_own
# build_act: benchmarks/act_math.cu (below, "act"), built here before the
# BUILD_ONLY exit and reused when built from the same sources by the same
# nvcc: a binary built on the CPU machine and carried saves the card the
# minutes its one translation unit takes.
act_bin="$KBUILD/act_math"
build_act() {
  local stamp flags=(-O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a
                     --expt-relaxed-constexpr -prec-div=true -ftz=false -Icustom_calls
                     -Ibenchmarks)
  stamp=$(source_stamp benchmarks/act_math.cu "${flags[*]}")
  if [[ -x "$act_bin" && "$(cat "$act_bin.stamp" 2>/dev/null)" == "$stamp" ]]; then
    echo "act_math: reused" | tee "$OUT/act_math_build.log"
  elif nvcc "${flags[@]}" -Xptxas -v -o "$act_bin" benchmarks/act_math.cu \
       > "$OUT/act_math_build.log" 2>&1; then
    echo "$stamp" > "$act_bin.stamp"
    echo "act_math: built"
  else
    echo "act_math: BUILD FAILED (see $OUT/act_math_build.log)"; return
  fi
  ACT_BUILT=1
}
want act && build_act
[[ "${BUILD_ONLY:-0}" == 1 ]] && exit 0

status=0
# run_harness NAME TIMEOUT ARGS: each variant's checks in its own process (a
# variant that faults cannot take the others down), then one timing run of
# the variants that passed. Logs: $OUT/NAME_checks.log, $OUT/NAME.log.
run_harness() {
  local name=$1 limit=$2 args=$3 bin="$KBUILD/$1" v pass=() rc
  : > "$OUT/${name}_checks.log"
  for v in $("$bin" --list); do
    timeout 120 "$bin" --checks --only "$v" >> "$OUT/${name}_checks.log" 2>&1
    rc=$?
    if [[ $rc -eq 0 ]]; then pass+=("$v"); else echo "$name: $v FAILED its checks (exit $rc)"; status=1; fi
  done
  grep -E "FAIL|SKIP" "$OUT/${name}_checks.log" | head -20
  echo "$name: checks passed by ${#pass[@]} variant(s): ${pass[*]}"
  [[ ${#pass[@]} -eq 0 ]] && return
  # shellcheck disable=SC2086  # args is a word list
  timeout "$limit" "$bin" --timing --only "$(IFS=,; echo "${pass[*]}")" $args \
    > "$OUT/$name.log" 2>&1 || { echo "$name timing: exit $? (see $OUT/$name.log)"; status=1; }
}
want blockwise && run_harness blockwise_gemm_sm90 240 "${BLOCKWISE_ARGS:-}"
want grouped && run_harness grouped_gemm_sm90 200 "${GROUPED_ARGS:-}"
want own && run_own
# ncu: Nsight Compute on the blockwise harness's --quick shapes (8192^3, MLP
# fc1 fprop and wgrad), cuBLASLt's kernels and ours (NCU_VARIANTS), the GEMM
# launches only: the per-stage budget (SM, memory, tensor pipe) of issue 46.
# Clocks are left alone (--clock-control none). A second pass asks for the
# tensor pipe's metric by name, in its own file, so that a name this ncu
# does not know costs only that column. NCU_GEMMS=0 skips these GEMM profiles
# (with "act ncu": the activation kernels' profile alone).
if want ncu && [[ "${NCU_GEMMS:-1}" != 0 ]]; then
  NCU_BASE=(--clock-control none --kernel-name-base function
            --kernel-name "regex:nvjet|xmma|device_kernel|gemm|Gemm" --csv --page details)
  NCU_ARGS=("${NCU_BASE[@]}" --launch-count 150)
  bin="$KBUILD/blockwise_gemm_sm90"
  hargs=(--timing --quick --rounds 1 --only "${NCU_VARIANTS:-vecblk_coop_128x128_c2x1,vecvec_coop_128x128_c1x2}")
  timeout 300 ncu "${NCU_ARGS[@]}" --section SpeedOfLight --section ComputeWorkloadAnalysis \
    --section WarpStateStats --section Occupancy --section LaunchStats "$bin" "${hargs[@]}" \
    > "$OUT/ncu_blockwise.csv" 2> "$OUT/ncu_blockwise.err" \
    || { echo "ncu: exit $? (see $OUT/ncu_blockwise.err):"; tail -n 3 "$OUT/ncu_blockwise.err"; }
  # Two spellings of the tensor pipe's active cycles, each in its own pass
  # and file (run AO's ncu knew neither sm__pipe_tensor_op_gmma_cycles_active
  # nor gave a column for it; sm__inst_executed_pipe_tensor_op_gmma, asked
  # there too, counts wgmma instructions issued, a few percent for every
  # kernel since one wgmma is a 64xNx32 product: not the pipe's busy time).
  tensor_csvs=()
  for metric in sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active \
                sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active; do
    f="$OUT/ncu_blockwise_tensor${#tensor_csvs[@]}.csv"
    tensor_csvs+=("$f")
    timeout 200 ncu "${NCU_ARGS[@]}" --metrics "$metric" "$bin" "${hargs[@]}" \
      > "$f" 2> "${f%.csv}.err" || echo "ncu ($metric): exit $? (see ${f%.csv}.err)"
  done
  python3 tools/ncu_summary.py "$OUT/ncu_blockwise.csv" "${tensor_csvs[@]}" \
    | tee "$OUT/ncu_summary.log"
  # te_jax's own kernel (blockwise_gemm_own) beside cuBLASLt's, when built:
  # the same sections and the tensor pipe, on the quick shapes.
  own="$KBUILD/blockwise_gemm_own"
  if [[ -x "$own" ]]; then
    # The stall reasons (run AP's profile had none: cycles per issue alone
    # could not say what the math warps wait on), the L2's load, and the
    # configurations that isolate one part each (TMA scales, TMA stores,
    # cluster 2, the pipeline without promotion).
    # (about 8 launches per kernel and shape: cuBLASLt on the 4 quick
    # shapes, each fprop configuration on 3, the wgrad one on 1)
    oargs=(--timing --quick --rounds 1 --only
           "${NCU_OWN_CONFIGS:-n128_s6_dbl,n128_s6_dbl_tma,n128_s5_tma_st,n128_s6_dbl_c2,diag_nopromote_n128,diag_noload_n128_dbl,wgrad_n128_s6_dbl}")
    timeout 400 ncu "${NCU_BASE[@]}" --launch-count 250 --section SpeedOfLight --section ComputeWorkloadAnalysis \
      --section WarpStateStats --section Occupancy --section LaunchStats \
      --section MemoryWorkloadAnalysis \
      --metrics "sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active,regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio" \
      "$own" \
      "${oargs[@]}" > "$OUT/ncu_own.csv" 2> "$OUT/ncu_own.err" \
      || { echo "ncu (own): exit $? (see $OUT/ncu_own.err):"; tail -n 3 "$OUT/ncu_own.err"; }
    python3 tools/ncu_summary.py "$OUT/ncu_own.csv" | tee "$OUT/ncu_own_summary.log"
  fi
fi
# act: benchmarks/act_math.cu (the shipped activation-quantize kernels at
# the gelu and Llama SwiGLU shapes, the 1x128 backward also with an E4M3 h,
# the 1x128 backward's bytes checked against shipped kernels that keep
# float32 values, then the gelu math variants; exit 1 on a mismatch), and
# Nsight Compute on its te_jax kernels: the budget of issue 43's largest
# te_jax kernel, the 1x128 backward. ncu runs the harness with --profile,
# which launches each kernel of the two shapes once (tensor and 1x128: fwd,
# fwd writing z both ways and h's E4M3 copy (the Llama step's), the 1x128
# one also at 2 and 3 blocks per SM, bwd; 1x128 bwd with an E4M3 h; for
# gelu also both 1x128 backwards at 2 blocks per SM: 20 launches whose
# names contain ActQuantize, --launch-count's 20; with the stall reasons by
# name, which the sections' details page leaves out) and skips
# the checks and the math variants. Without it every timed kernel ran 23 times
# (3 warm-up + 20), so --launch-count 24 stopped after the first tensor
# forward and backward and never reached ActQuantizeVec128Kernel.
if want act; then
  if [[ "${ACT_BUILT:-0}" != 1 ]]; then
    echo "act_math: BUILD FAILED (see $OUT/act_math_build.log)"; status=1
  else
    timeout 240 "$act_bin" > "$OUT/act_math.log" 2>&1 || { echo "act_math: exit $?"; status=1; }
    grep -E " fwd | bwd |PASS|FAIL|differ" "$OUT/act_math.log"
    if want ncu; then
      timeout 300 ncu --clock-control none --kernel-name-base function \
        --kernel-name "regex:ActQuantize" --launch-count 20 --csv --page details \
        --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats \
        --section Occupancy --section LaunchStats --section InstructionStats \
        --section SchedulerStats --section ComputeWorkloadAnalysis \
        --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio" \
        "$act_bin" --profile \
        > "$OUT/ncu_act.csv" 2> "$OUT/ncu_act.err" \
        || { echo "ncu (act): exit $? (see $OUT/ncu_act.err)"; tail -n 3 "$OUT/ncu_act.err"; }
      python3 tools/ncu_summary.py "$OUT/ncu_act.csv" | tee "$OUT/ncu_act_summary.log"
    fi
  fi
fi
nvidia-smi --query-gpu=clocks.sm,power.draw,temperature.gpu --format=csv,noheader 2>/dev/null \
  | sed 's/^/after: /'
for log in blockwise_gemm_sm90 grouped_gemm_sm90 blockwise_gemm_own; do
  [[ -f "$OUT/$log.log" ]] && sed -n '/^SUMMARY/,$p' "$OUT/$log.log"
done
echo "gpu_kernels: $(( $(date +%s) - t0 )) s in all"
exit $status
