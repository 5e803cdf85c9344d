#!/usr/bin/env bash
# Issue 48 in one device call on 2, 4 or 8 GPUs of one host (run from the repo
# root): build, then benchmarks/bench_train_scaling.py twice, each with its
# 1-GPU baselines (same rows per GPU: scaling; same global batch: parity) and
# its PASS/FAIL checks (no hang, loss parity, different token counts per
# device, all-to-all buffer sizes, FP8 weight all-gathers, no gathered batch):
#   moe    --preset moe: experts over every GPU (epN) and EP x TP x SP
#          (ep<N/2>_tp2_sp; tp2_sp on 2 GPUs), every recipe and bf16; then
#          epN once more as two jax.distributed processes, one per half of
#          the GPUs;
#   llama  --preset llama under FSDP over every GPU (fsdpN), every recipe and
#          bf16.
# Both models are cut to 4 layers (MOE_LAYERS, LLAMA_LAYERS) so that compiling
# the 8 jobs fits the call; 8 / N rows per GPU make the preset's batch of 8
# rows in all, which the 1-GPU parity run must hold.
# Optional parts: tests (tests/test_sharding_mesh.py), sharded
# (benchmarks/bench_sharded.py). Logs in $OUT (7 files; the per-process logs
# as one scaling_logs.tgz).
#
# Usage: bash tools/gpu_multi.sh
#   env: PARTS (default "moe llama"; also "tests", "sharded"), STEPS (50),
#        RECIPES (none,delayed,current,blockwise), MOE_LAYERS, LLAMA_LAYERS (4
#        each), PER_DEVICE_BATCH (8 / N GPUs, at least 1), NUM_DOCS (20000),
#        MOE_MESHES, LLAMA_MESHES, TWO_PROCESS (default epN; "none" skips),
#        MOE_LIMIT (seconds, default 300), JOB_LIMIT (per job, 240),
#        SCALING_ARGS (more bench_train_scaling.py arguments), SKIP_BUILD=1,
#        DEADLINE (seconds for the whole script, default 570), and for the
#        optional parts PYTEST_K, BENCH_MESHES, SHARDED_ARGS, TEST_LIMIT.
set -uo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="${OUT:-/tmp/te_jax_out}"
LOGS=/tmp/te_jax_scaling_logs   # one folder per part, packed into $OUT at the end
rm -rf "$LOGS"
mkdir -p "$OUT" "$LOGS"
cd "$REPO" || exit 1
export PYTHONUNBUFFERED=1
t0=$(date +%s)
left() { echo $(( ${DEADLINE:-570} - ($(date +%s) - t0) )); }

nvidia-smi --query-gpu=name,memory.total --format=csv | tee "$OUT/env.log"
N=$(nvidia-smi -L | grep -c '^GPU')
if (( N < 2 )); then echo "gpu_multi.sh needs 2 or more GPUs, found $N"; exit 1; fi
if [[ "${SKIP_BUILD:-0}" != 1 ]]; then
  bash tools/gpu_check.sh build > "$OUT/build_step.log" 2>&1
  tail -n 3 "$OUT/build_step.log"
fi
PER=${PER_DEVICE_BATCH:-$(( 8 / N > 0 ? 8 / N : 1 ))}
TWO=${TWO_PROCESS:-ep$N}
# EP x TP x SP takes tp=2 from the GPUs; on 2 GPUs that leaves no expert axis.
if (( N >= 4 )); then MOE_DEFAULT="ep$N,ep$(( N / 2 ))_tp2_sp"; else MOE_DEFAULT="ep2,tp2_sp"; fi
[[ "$TWO" == none ]] && TWO=""
status=0

# scaling NAME SECONDS ARGS...: one bench_train_scaling.py run, its table and checks shown.
scaling() {
  local name=$1 limit=$2; shift 2
  echo "== $name ($limit s of $(left) s left)"
  if (( limit < 60 )); then echo "SKIPPED: too little time left"; status=1; return; fi
  # shellcheck disable=SC2086  # SCALING_ARGS is a word list on purpose
  timeout $(( limit + 30 )) python3 benchmarks/bench_train_scaling.py "$@" \
    --steps "${STEPS:-50}" --recipes "${RECIPES:-none,delayed,current,blockwise}" \
    --per_device_batch "$PER" --num_docs "${NUM_DOCS:-20000}" --timeout "${JOB_LIMIT:-240}" \
    --deadline "$limit" --log_dir "$LOGS/$name" --json-out "$OUT/$name.json" \
    ${SCALING_ARGS:-} > "$OUT/$name.log" 2>&1 || status=1
  grep -E '^(\||PASS|FAIL|INFO|job seconds|[0-9]+ checks)' "$OUT/$name.log" | cut -c1-400
}

for part in ${PARTS:-moe llama}; do
  case $part in
    moe)
      lim=$(( $(left) - 10 < ${MOE_LIMIT:-300} ? $(left) - 10 : ${MOE_LIMIT:-300} ))
      scaling moe "$lim" --preset moe --layers "${MOE_LAYERS:-4}" \
        --meshes "${MOE_MESHES:-$MOE_DEFAULT}" ${TWO:+--two_process "$TWO"} ;;
    llama)
      scaling llama "$(( $(left) - 10 ))" --preset llama --layers "${LLAMA_LAYERS:-4}" \
        --meshes "${LLAMA_MESHES:-fsdp$N}" ;;
    tests)
      echo "== sharding tests ($(left) s left)"
      (cd /tmp && timeout "${TEST_LIMIT:-150}" python3 -m pytest -q -p no:cacheprovider \
         "$REPO/tests/test_sharding_mesh.py" -k "${PYTEST_K:-not transformer_layer}" 2>&1 \
         | tee "$OUT/sharding_tests.log" | tail -n 4) ;;
    sharded)
      echo "== sharded layers ($(left) s left)"
      timeout "$(( $(left) - 5 ))" python3 benchmarks/bench_sharded.py \
        --meshes "${BENCH_MESHES:-single,mesh1,fsdp2,tp2sp}" --json-out "$OUT/sharded.json" \
        ${SHARDED_ARGS:-} > "$OUT/sharded.log" 2>&1
      grep -v '^JSON' "$OUT/sharded.log" | grep '^|' | tail -n 20 ;;
    *) echo "unknown part $part (moe, llama, tests, sharded)"; status=1 ;;
  esac
done
tar czf "$OUT/scaling_logs.tgz" -C "$LOGS" . 2>/dev/null
echo "total $(( $(date +%s) - t0 )) s; exit $status"
exit $status
