# Sourced by the device-call scripts (gpu_floor.sh, gpu_layers.sh), after
# they set REPO.
#
# start_device_call: $OUT made, cd to $REPO, unbuffered Python, t0 = now,
# te_jax built and installed (tools/gpu_check.sh build; its last lines shown).
start_device_call() {
  OUT="${OUT:-/tmp/te_jax_out}"; mkdir -p "$OUT"; cd "$REPO" || exit 1
  export PYTHONUNBUFFERED=1
  t0=$(date +%s)
  bash tools/gpu_check.sh build > /tmp/build_step.log 2>&1; tail -n 2 /tmp/build_step.log
}
#
# run_test_sets SECONDS SETS: runs each ';'-separated pytest argument list in
# SETS, one after the other, until SECONDS have passed (a set that would start
# with 10 s or less left is listed as skipped). Test paths in a set are
# relative to the repo ($REPO); pytest runs from /tmp so that the installed
# te_jax (with its .so) is imported, not the source tree.
run_test_sets() {
  local end=$(( $(date +%s) + $1 )) left s sets
  IFS=';' read -ra sets <<< "$2"
  for s in "${sets[@]}"; do
    left=$(( end - $(date +%s) ))
    (( left > 10 )) || { echo "== SKIPPED (time): $s"; continue; }
    echo "== pytest $s"
    # shellcheck disable=SC2086  # each set is a word list on purpose
    (cd /tmp && timeout "$left" python3 -m pytest -q -p no:cacheprovider --tb=short -rf \
      ${s//tests\//$REPO/tests/} 2>&1 | sed "s#$REPO/##g")
  done
}
