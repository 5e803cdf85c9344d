#!/usr/bin/env bash
# A/B of the layer benchmark between this tree and older te_jax trees, in
# one device call on one GPU: all are built (this tree installed as usual,
# each old one with `pip install --target` into $AB_PREFIX/<name>), then every
# configuration runs with this tree's benchmarks/bench_layer.py against each
# install in turn (new first, then the bases; the order reversed for the next
# configuration), so drift in clocks and temperature falls on every side.
#
# Usage: bash tools/gpu_ab.sh [build] [bench]   (default: both)
#   env: AB_BASES    space-separated name=source-tree pairs of the old versions
#                    (default "old=$AB_BASE"); several bases split a change
#                    between the commits where it happened
#        AB_BASE     source tree of the one old version (default .ab_base; make
#                    it with `git archive <commit> | tar -x -C .ab_base`, list
#                    it in .git/info/exclude and carry it to the device)
#        AB_PREFIX   where the old versions are installed (default /tmp/te_jax_ab)
#        AB_SKIP_NEW=1  build only the bases (this tree is already installed)
#        AB_CONFIGS  comma-separated bench_layer.py configurations (default:
#                    the MLP block and the TransformerLayer, FP8 off and the
#                    three recipes)
#        AB_ARGS     more bench_layer.py arguments (default "--k 10 --repeats 5")
# Logs and JSON lines under $OUT; a table (new ms, old ms, new/old) last.
set -uo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="${OUT:-/tmp/te_jax_out}"; mkdir -p "$OUT"; cd "$REPO" || exit 1
export PYTHONUNBUFFERED=1
read -ra BASES <<< "${AB_BASES:-old=${AB_BASE:-.ab_base}}"
PREFIX="${AB_PREFIX:-/tmp/te_jax_ab}"
NAMES=(); for b in "${BASES[@]}"; do NAMES+=("${b%%=*}"); done
STEPS=("$@"); [[ ${#STEPS[@]} -eq 0 ]] && STEPS=(build bench)
want() { local s; for s in "${STEPS[@]}"; do [[ "$s" == "$1" ]] && return 0; done; return 1; }
t0=$(date +%s)

if want build; then
  pids=()
  if [[ -z "${AB_SKIP_NEW:-}" ]]; then
    bash tools/gpu_check.sh build > "$OUT/build_new.log" 2>&1 &
    pids+=($!)
  fi
  for b in "${BASES[@]}"; do
    name=${b%%=*}; src="$(cd "${b#*=}" && pwd)"
    # The bases are built without the optional CUTLASS GEMMs: what the
    # benchmark runs does not use them, and they double the build time.
    (cd "$src" && { [[ -f README.md ]] || echo "# te_jax" > README.md; }
     rm -rf "${PREFIX:?}/$name" && env -u SKBUILD_CMAKE_DEFINE python3 -m pip install \
       --no-build-isolation --no-deps --target "$PREFIX/$name" "$src" > "$OUT/build_$name.log" 2>&1
     # From /tmp: in the source tree (no .so) the sources would shadow the install.
     cd /tmp && PYTHONPATH="$PREFIX/$name" python3 -c "import te_jax._te_jax_ffi, te_jax; print('$name:', te_jax.__file__)" \
       >> "$OUT/build_$name.log" 2>&1) &
    pids+=($!)
  done
  for p in "${pids[@]}"; do wait "$p"; done
  [[ -z "${AB_SKIP_NEW:-}" ]] && tail -n 2 "$OUT/build_new.log"
  for n in "${NAMES[@]}"; do tail -n 1 "$OUT/build_$n.log"; done
  echo "build: $(( $(date +%s) - t0 )) s"
fi

if want bench; then
  CONFIGS="${AB_CONFIGS:-mlp/te_off,mlp/te_delayed,mlp/te_current,mlp/te_block,layer/te_off,layer/te_delayed,layer/te_current,layer/te_block}"
  IFS=',' read -ra cfgs <<< "$CONFIGS"
  : > "$OUT/ab.jsonl"
  i=0
  for c in "${cfgs[@]}"; do
    order=(new "${NAMES[@]}")
    if (( i % 2 )); then order=(); for n in new "${NAMES[@]}"; do order=("$n" "${order[@]}"); done; fi
    i=$((i + 1))
    for side in "${order[@]}"; do
      pp=""; [[ $side != new ]] && pp="$PREFIX/$side"
      # shellcheck disable=SC2086  # AB_ARGS is a word list on purpose
      line=$(cd /tmp && PYTHONPATH="$pp" timeout 300 python3 "$REPO/benchmarks/bench_layer.py" \
        --config "$c" ${AB_ARGS:---k 10 --repeats 5} 2>>"$OUT/ab_stderr.log" | tail -n 1)
      line=${line#JSON }
      echo "{\"side\": \"$side\", \"result\": ${line:-null}}" >> "$OUT/ab.jsonl"
      echo "$side $c: ${line:0:200}"
    done
  done
  python3 - "$OUT/ab.jsonl" "${NAMES[@]}" <<'EOF'
import json, sys
rows = {}
for ln in open(sys.argv[1]):
  d = json.loads(ln)
  if d["result"]:
    rows.setdefault(d["result"]["config"], {})[d["side"]] = d["result"]
for base in sys.argv[2:]:
  print(f"\nnew against {base}:")
  print("| config | new ms | old ms | new/old | new max|dx| | old max|dx| | impl new/old |")
  print("|---|---|---|---|---|---|---|")
  for c, s in rows.items():
    n, o = s.get("new"), s.get(base)
    if n and o:
      print(f"| {c} | {n['ms']:.3f} | {o['ms']:.3f} | {n['ms'] / o['ms']:.4f} | "
            f"{n.get('dx_abs_max') or float('nan'):.3g} | {o.get('dx_abs_max') or float('nan'):.3g} | "
            f"{n.get('impl')}/{o.get('impl')} |")
EOF
fi
echo "total $(( $(date +%s) - t0 )) s"
