#!/usr/bin/env bash
# One device call on a 2-GPU machine: build, then side by side the GPU tests
# (GPU 1) and the layer benchmarks with kernel profiles (GPU 0, alone on its
# GPU so its timings are undisturbed). Logs under $OUT; a summary last.
#   env: BENCH_CONFIGS (default: all of bench_layer.py), TEST_LIMIT, BENCH_LIMIT
set -uo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="${OUT:-/tmp/te_jax_out}"; mkdir -p "$OUT"; cd "$REPO"
export PYTHONUNBUFFERED=1
bash tools/gpu_check.sh build > "$OUT/build_step.log" 2>&1; tail -n 3 "$OUT/build_step.log"
(
  cd /tmp
  export CUDA_VISIBLE_DEVICES=1
  timeout "${TEST_LIMIT:-330}" python3 -m pytest -q -p no:cacheprovider -m gpu "$REPO/tests" \
    > "$OUT/pytest_gpu.log" 2>&1
  timeout 150 python3 -m pytest -q -p no:cacheprovider "$REPO"/tests/test_flax_*.py \
    "$REPO/tests/test_fused_mlp.py" > "$OUT/pytest_flax_gpu.log" 2>&1
) &
tests=$!
cfg=()
[[ -n "${BENCH_CONFIGS:-}" ]] && cfg=(--configs "$BENCH_CONFIGS")
CUDA_VISIBLE_DEVICES=0 timeout "${BENCH_LIMIT:-450}" python3 benchmarks/bench_layer.py \
  "${cfg[@]}" --k 10 --repeats 5 --profile --json-out "$OUT/layer.json" \
  > "$OUT/bench_layer.log" 2> "$OUT/bench_layer.err"
wait $tests
echo "== GPU tests";  tail -n 12 "$OUT/pytest_gpu.log" | grep -E "passed|failed|FAILED|error" | tail -n 12
echo "== Flax module tests on the GPU"; tail -n 6 "$OUT/pytest_flax_gpu.log" | grep -E "passed|failed|FAILED" 
echo "== bench_layer"; grep '^|' "$OUT/bench_layer.log"; tail -n 3 "$OUT/bench_layer.err"
