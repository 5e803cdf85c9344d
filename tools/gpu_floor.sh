#!/usr/bin/env bash
# One device call on a 1-GPU machine: build; the layer benchmarks (the issue's
# rows); the GEMM floor of the same steps (bench_floor.py, with the budget
# table against those rows) while nvidia-smi samples power and clocks; then
# GPU tests with what time is left. Logs under $OUT; a summary last.
#   env: BENCH_CONFIGS bench_layer.py --configs (default: the issue's rows)
#        LAYER_ARGS    more bench_layer.py arguments (e.g. "--profile --profile-steps 20")
#        FLOOR_ARGS    more bench_floor.py arguments (e.g. "--groups mlp")
#        TEST_SETS     ';'-separated pytest argument lists (default: none)
#        BENCH_LIMIT, FLOOR_LIMIT, TEST_LIMIT (seconds)
set -uo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck source=tools/gpu_common.sh
source "$REPO/tools/gpu_common.sh"
start_device_call
echo "build done at $(( $(date +%s) - t0 )) s"
# Power and clocks every 200 ms, one file per phase (joined into $OUT/power.csv).
sample() { nvidia-smi --query-gpu=timestamp,power.draw,clocks.sm,clocks_event_reasons.sw_power_cap \
  --format=csv,noheader -lms 200 > "/tmp/power_$1.csv" 2>&1 & }
sample layer; smi=$!
configs="${BENCH_CONFIGS:-mlp/te_off,mlp/te_delayed,mlp/te_current,mlp/te_block,layer/te_off,layer/te_delayed,layer/te_current,layer/te_block}"
(cd /tmp && timeout "${BENCH_LIMIT:-300}" python3 "$REPO/benchmarks/bench_layer.py" \
  --configs "$configs" --k 10 --repeats 5 ${LAYER_ARGS:-} --json-out "$OUT/layer.json" \
  > "$OUT/bench_layer.log" 2>&1)
kill $smi 2>/dev/null
echo "bench_layer done at $(( $(date +%s) - t0 )) s"
sample floor; smi=$!
layer_json=()
[[ -f "$OUT/layer.json" ]] && layer_json=(--layer-json "$OUT/layer.json")
(cd /tmp && timeout "${FLOOR_LIMIT:-150}" python3 "$REPO/benchmarks/bench_floor.py" \
  --k 10 --repeats 5 ${FLOOR_ARGS:-} "${layer_json[@]}" --json-out "$OUT/floor.json" \
  > "$OUT/bench_floor.log" 2>&1)
kill $smi 2>/dev/null
for ph in layer floor; do sed "s/^/$ph, /" "/tmp/power_$ph.csv"; done > "$OUT/power.csv"
echo "bench_floor done at $(( $(date +%s) - t0 )) s"
if [[ -n "${TEST_SETS:-}" ]]; then
  run_test_sets "${TEST_LIMIT:-150}" "$TEST_SETS" > "$OUT/tests.log" 2>&1
  echo "== GPU tests"; grep -E "^== |passed|failed|^FAILED|^ERROR" "$OUT/tests.log" | cut -c1-160
fi
echo "== power samples over 400 W per phase: count, mean W, mean SM MHz, share at the power cap"
awk -F', ' '$3+0 > 400 {n[$1]++; w[$1] += $3; mhz[$1] += $4; if ($5 ~ /Active/) cap[$1]++}
  END {for (p in n) printf "%s: %d samples, %.0f W, %.0f MHz, %.0f%% capped\n", p, n[p],
       w[p] / n[p], mhz[p] / n[p], 100 * cap[p] / n[p]}' "$OUT/power.csv"
echo "== bench_layer"; grep -E '^\||^kernels of' "$OUT/bench_layer.log"
echo "== bench_floor"; grep -v '^JSON' "$OUT/bench_floor.log" | grep -E '^\||ms$' | head -40
echo "total $(( $(date +%s) - t0 )) s"
