#!/usr/bin/env bash
# Multi-GPU checks on a machine with 2+ GPUs (run from the repo root):
# build, the sharded test file on the real GPUs, the train_gpt scaling runs
# and the sharded layer benchmark. Each step has a time limit so the whole
# script ends inside one device call; logs go to $OUT.
#
# Usage: bash tools/gpu_multi.sh            env: MESHES (default fsdp2,tp2),
#        BENCH_MESHES (single,mesh1,fsdp2,tp2sp), SCALING_ARGS, SHARDED_ARGS,
#        PYTEST_K (pytest -k expression for tests/test_sharding_mesh.py)
set -uo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="${OUT:-/tmp/te_jax_out}"
mkdir -p "$OUT"
cd "$REPO"
export PYTHONUNBUFFERED=1
t0=$(date +%s)
left() { echo $(( ${DEADLINE:-570} - ($(date +%s) - t0) )); }

nvidia-smi --query-gpu=name,memory.total --format=csv | tee "$OUT/env.log"
if [[ "${SKIP_BUILD:-0}" != 1 ]]; then
  bash tools/gpu_check.sh build > "$OUT/build_step.log" 2>&1
  tail -n 3 "$OUT/build_step.log"
fi

echo "== sharding tests ($(left) s left)"
(cd /tmp && timeout "${TEST_LIMIT:-150}" python3 -m pytest -q -p no:cacheprovider \
   "$REPO/tests/test_sharding_mesh.py" -k "${PYTEST_K:-not transformer_layer}" 2>&1 \
   | tee "$OUT/sharding_tests.log" | tail -n 4)

echo "== train scaling ($(left) s left)"
timeout "${SCALING_LIMIT:-220}" python3 benchmarks/bench_train_scaling.py \
  --meshes "${MESHES:-fsdp2,tp2}" --json-out "$OUT/train_scaling.json" ${SCALING_ARGS:-} \
  > "$OUT/train_scaling.log" 2>&1
grep -v '^JSON' "$OUT/train_scaling.log" | tail -n 16

lim=$(( $(left) - 5 ))
echo "== sharded layers ($lim s left)"
if (( lim > 30 )); then
  timeout "$lim" python3 benchmarks/bench_sharded.py --meshes "${BENCH_MESHES:-single,mesh1,fsdp2,tp2sp}" \
    --json-out "$OUT/sharded.json" ${SHARDED_ARGS:-} > "$OUT/sharded.log" 2>&1
  grep -v '^JSON' "$OUT/sharded.log" | grep '^|' | tail -n 20
fi
echo "total $(( $(date +%s) - t0 )) s"
