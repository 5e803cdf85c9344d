#!/usr/bin/env bash
# One device call on a 2-GPU machine: build; then side by side GPU tests (GPU 1)
# and the layer benchmarks with kernel profiles (GPU 0, alone on its GPU so
# its timings are undisturbed); then, optionally, tests/test_sharding_mesh.py
# and bench_train_scaling.py on all GPUs. Logs under $OUT (at most 7 files:
# the device returns 8); a summary last.
#   env: TEST_SETS     ';'-separated pytest argument lists run one after the
#                      other on GPU 1 into one log (default: "-m gpu tests/")
#        BENCH_CONFIGS bench_layer.py --configs (default: all)
#        TEST_LIMIT, BENCH_LIMIT, SHARDING_LIMIT (seconds; SHARDING_LIMIT=0 skips)
#        SCALING_ARGS  if set: benchmarks/bench_train_scaling.py with these
#                      arguments last, on all GPUs (limit SCALING_LIMIT, 150 s)
set -uo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck source=tools/gpu_common.sh
source "$REPO/tools/gpu_common.sh"
start_device_call
(
  export CUDA_VISIBLE_DEVICES=1
  run_test_sets "${TEST_LIMIT:-330}" "${TEST_SETS:--m gpu tests/}" > "$OUT/tests.log" 2>&1
) &
tests=$!
cfg=()
[[ -n "${BENCH_CONFIGS:-}" ]] && cfg=(--configs "$BENCH_CONFIGS")
CUDA_VISIBLE_DEVICES=0 timeout "${BENCH_LIMIT:-450}" python3 benchmarks/bench_layer.py \
  "${cfg[@]}" --k 10 --repeats 5 --profile --json-out "$OUT/layer.json" \
  > "$OUT/bench_layer.log" 2>&1
wait $tests
if (( ${SHARDING_LIMIT:-150} > 0 )); then
  (cd /tmp && timeout "${SHARDING_LIMIT:-150}" python3 -m pytest -q -p no:cacheprovider \
     --tb=short -rf "$REPO/tests/test_sharding_mesh.py" > "$OUT/sharding_tests.log" 2>&1)
fi
if [[ -n "${SCALING_ARGS:-}" ]]; then
  # shellcheck disable=SC2086
  timeout "${SCALING_LIMIT:-150}" python3 benchmarks/bench_train_scaling.py $SCALING_ARGS \
    > "$OUT/train_scaling.log" 2>&1
fi
echo "== GPU tests (GPU 1)"; grep -E "^== |passed|failed|^FAILED|^ERROR" "$OUT/tests.log" | cut -c1-160
if [[ -f "$OUT/sharding_tests.log" ]]; then
  echo "== sharding tests (all GPUs)"; grep -E "passed|failed|^FAILED" "$OUT/sharding_tests.log" | cut -c1-160
fi
echo "== bench_layer (GPU 0)"; grep '^|' "$OUT/bench_layer.log"
if [[ -f "$OUT/train_scaling.log" ]]; then
  echo "== train scaling"; grep -v '^JSON' "$OUT/train_scaling.log" | grep '^|' | tail -n 12
fi
echo "total $(( $(date +%s) - t0 )) s"
