#!/usr/bin/env bash
# Device call: build; GPU 0: layer benchmarks then compare_recipes (none,
# delayed); GPU 1: re-run of the GPU tests that failed last time with
# tracebacks, then compare_recipes (blockwise, current); then one summary.
set -uo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="${OUT:-/tmp/te_jax_out}"; mkdir -p "$OUT"; cd "$REPO"
export PYTHONUNBUFFERED=1
STEPS="${STEPS:-400}"
bash tools/gpu_check.sh build > /tmp/build_step.log 2>&1; tail -n 2 /tmp/build_step.log
CR="--preset h200 --steps $STEPS --out_dir /tmp/cr --no_progress --log_every 100"
(
  export CUDA_VISIBLE_DEVICES=0
  timeout 230 python3 benchmarks/bench_layer.py --configs "${BENCH_CONFIGS}" --k 10 --repeats 5 \
    --json-out "$OUT/layer.json" > "$OUT/bench_layer.log" 2>&1
  timeout 330 python3 examples/compare_recipes.py --recipes none,delayed $CR > "$OUT/cr_gpu0.log" 2>&1
) &
g0=$!
(
  export CUDA_VISIBLE_DEVICES=1
  (cd /tmp && timeout 150 python3 -m pytest -q -p no:cacheprovider --tb=short -rf \
     "$REPO/tests/test_act_quantize.py" -k "${TEST_K}" "$REPO/tests/test_fused_mlp.py" \
     "$REPO/tests/test_flax_attention.py" > "$OUT/tests.log" 2>&1)
  timeout 330 python3 examples/compare_recipes.py --recipes blockwise,current $CR > "$OUT/cr_gpu1.log" 2>&1
) &
g1=$!
wait $g0 $g1
CUDA_VISIBLE_DEVICES=0 python3 examples/compare_recipes.py --recipes "" --merge $CR > /tmp/merge.log 2>&1
cp /tmp/cr/summary.json /tmp/cr/loss_curves.png "$OUT/" 2>/dev/null
tail -n 8 /tmp/merge.log
echo "== tests"; grep -E "passed|failed" "$OUT/tests.log" | tail -n 3
echo "== bench_layer"; grep '^|' "$OUT/bench_layer.log"
