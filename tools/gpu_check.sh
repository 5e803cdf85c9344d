#!/usr/bin/env bash
# The one script run on the GPU machine: build + install te_jax with its CUDA
# custom calls, run the GPU tests, run the benchmarks. Logs go to $OUT.
#
# Usage: bash tools/gpu_check.sh [STEP...]
#   steps: build test bench   (default: all three, in that order)
#          nvcc-free          instead of build + test: build with the pip CUDA
#                             packages while the system toolkit is hidden
#                             (tools/nvcc_free.sh), then the test step in that
#                             same hidden view
#   env:   PYTEST_ARGS  extra pytest arguments (e.g. "-k gemm -x")
#          GPU_TEST_FILES  only these test files (names under tests/, space-separated)
#          BENCH_ARGS   extra bench_ops.py arguments (e.g. "--quick")
#          BENCHES      more benchmark scripts (paths relative to the repo) to run
#                       after bench_ops.py, space-separated
#          CUDA_WHEELS  (nvcc-free) folders of nvidia-* wheels to install first
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="${OUT:-/tmp/te_jax_out}"
mkdir -p "$OUT"
STEPS=("$@")
[[ ${#STEPS[@]} -eq 0 ]] && STEPS=(build test bench)
want() { local s; for s in "${STEPS[@]}"; do [[ "$s" == "$1" ]] && return 0; done; return 1; }

cd "$REPO"
{
  date -u
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv || true
  nvcc --version | tail -2 || true
  python3 -c "import jax; print('jax', jax.__version__, jax.devices())" || true
} 2>&1 | tee "$OUT/env.log"

if want nvcc-free; then
  # No registry here: the pip CUDA packages the image lacks come as wheels
  # (CUDA_WHEELS). The test step runs as nvcc_free.sh's command, so the
  # GPU tests see no system toolkit either.
  NEED_GPU=1 PYTHON=python3 OUT="$OUT" bash "$REPO/tools/nvcc_free.sh" \
    env OUT="$OUT" PYTEST_ARGS="${PYTEST_ARGS:-}" bash "$REPO/tools/gpu_check.sh" test
fi

if want build; then
  # pyproject.toml names README.md as the readme; scikit-build-core refuses to
  # build without it. Only a placeholder in this throwaway copy of the tree.
  [[ -f README.md ]] || { echo "# te_jax" > README.md; echo "NOTE: README.md missing, placeholder created"; }
  # No registry on the GPU machine: build with what is installed.
  start=$(date +%s)
  python3 -m pip install --no-build-isolation --no-deps -v . 2>&1 | tee "$OUT/build.log" \
    | grep -E "te_jax:|error|warning: .*spill|Successfully|ERROR" || true
  echo "build: $(( $(date +%s) - start )) s" | tee -a "$OUT/build.log"
  # Fail here, not in the tests, when the module did not get built.
  (cd /tmp && python3 -c "import te_jax._te_jax_ffi as m; print('native module:', sorted(m.registrations()))") \
    2>&1 | tee -a "$OUT/build.log"
fi

if want test; then
  # From another directory so the installed package (with the .so) is
  # imported instead of the source tree. With pytest-xdist (no registry on
  # the GPU machine: carry its wheel and execnet's, pip install --no-deps),
  # 4 processes share the GPU (the serial suite takes over 540 s, 4 at a
  # time 231 s on 2026-12-02); the two files that time kernels or check
  # command buffers run alone afterwards.
  serial=("$REPO/tests/test_gpu_gemm_autotune.py" "$REPO/tests/test_gpu_command_buffers.py")
  if [[ -n "${GPU_TEST_FILES:-}" ]]; then   # a subset: these files, 4 processes, no serial files
    files=(); for f in $GPU_TEST_FILES; do files+=("$REPO/tests/$f"); done
    (cd /tmp && XLA_PYTHON_CLIENT_PREALLOCATE=false python3 -m pytest -v -m gpu -n 4 \
      --dist loadfile "${files[@]}" -p no:cacheprovider > "$OUT/pytest_gpu.log" 2>&1; \
      tail -3 "$OUT/pytest_gpu.log") || echo "pytest failed (see $OUT/pytest_gpu.log)"
  elif python3 -c "import xdist" 2>/dev/null && [[ -z "${PYTEST_ARGS:-}" ]]; then
    (cd /tmp && XLA_PYTHON_CLIENT_PREALLOCATE=false python3 -m pytest -v -m gpu -n 4 \
      --dist loadfile "$REPO/tests" -p no:cacheprovider --ignore="${serial[0]}" \
      --ignore="${serial[1]}" > "$OUT/pytest_gpu.log" 2>&1; tail -3 "$OUT/pytest_gpu.log") \
      || echo "pytest failed (see $OUT/pytest_gpu.log)"
    (cd /tmp && python3 -m pytest -v -m gpu "${serial[@]}" -p no:cacheprovider \
      > "$OUT/pytest_gpu_serial.log" 2>&1; tail -3 "$OUT/pytest_gpu_serial.log") \
      || echo "pytest failed (see $OUT/pytest_gpu_serial.log)"
  else
    (cd /tmp && python3 -m pytest -v -m gpu "$REPO/tests" -p no:cacheprovider ${PYTEST_ARGS:-} \
      > "$OUT/pytest_gpu.log" 2>&1; tail -3 "$OUT/pytest_gpu.log") \
      || echo "pytest failed (see $OUT/pytest_gpu.log)"
  fi
fi

if want bench; then
  (cd /tmp && python3 "$REPO/benchmarks/bench_ops.py" ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench_ops.log") \
    || echo "bench_ops failed (see $OUT/bench_ops.log)"
  for b in ${BENCHES:-}; do
    name=$(basename "$b" .py)
    (cd /tmp && python3 "$REPO/$b" 2>&1 | tee "$OUT/$name.log") || echo "$b failed"
  done
fi
