"""te_jax's grouped FP8 and bf16 GEMMs against bf16 ``jax.lax.ragged_dot``, per pass.

One expert layer's three grouped GEMMs at issue 46's shape (16 groups of
1024 rows, k = 4096, n = 2048), with balanced and skewed group sizes (one
group holds half the rows):

* fprop  ``x (m, k) @ w[e] (k, n)``        -- te_jax.ops.grouped_gemm
* dgrad  ``dy (m, n) @ w[e].T (n, k)``     -- te_jax.ops.grouped_gemm
* wgrad  ``x[rows_e].T @ dy[rows_e]``      -- te_jax.ops.grouped_wgrad

te_jax runs on operands quantized beforehand, in each recipe's default
formats (per tensor: E4M3, E5M2 for the gradient, as delayed and current
scaling's HYBRID; blockwise: all E4M3, 1x128 activations, 128x128 weights,
1x128 along the rows for wgrad), so the rows time the GEMM alone. The
weights come in the layout the kernel reads (contiguous along the
contraction): fprop gets each expert's ``w.T`` quantized and viewed
transposed, dgrad ``w`` viewed transposed, so the transposes cancel under
``jit`` (a MoE layer that quantizes its weights in the other layout pays one
pass over them on top). ``ragged_dot`` runs in bf16 (wgrad: its VJP with
respect to the weights, what a bf16 MoE layer runs). "te_jax bf16" is
te_jax's own grouped GEMM on the same bf16 operands (what te_jax's FP8-off
MoE layer runs: the sm90 bf16 kernel), weights in the kernel's layout as
for FP8; its wgrad reads x and dy as stored (``grouped_wgrad_rows``).
Each te_jax row also reports its largest error against the pure-JAX
reference on the same operands, relative to the reference's largest
magnitude, so a wrong kernel cannot pass for a fast one. TFLOP/s count the
useful FLOPs (``2 * sum(group_sizes) * k * n``).

    python benchmarks/bench_grouped.py            # GPU with the sm90 GEMMs
    python benchmarks/bench_grouped.py --small --impl reference   # CPU smoke
"""

from __future__ import annotations

import argparse
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np

from te_jax.ops import grouped_gemm as gg
from te_jax.ops import quantize as q

# Run by path, this folder is sys.path[0]; the repository root is not put on
# the path, so te_jax is the installed one (with its CUDA module), not the
# source tree beside it.
if __package__:
  from .bench_ops import bench   # median seconds per call
else:
  from bench_ops import bench  # pylint: disable=import-error

E4M3, E5M2, BF16, F32 = jnp.float8_e4m3fn, jnp.float8_e5m2, jnp.bfloat16, jnp.float32
SIZES = {"full": dict(groups=16, rows=1024, k=4096, n=2048),
         "small": dict(groups=4, rows=256, k=256, n=256)}


def group_sizes(groups: int, rows: int, skewed: bool) -> np.ndarray:
  """``groups`` sizes summing to ``groups * rows``, multiples of 128:
  equal, or (skewed) the first group holds half of all rows and the others
  share the rest as evenly as 128-row blocks allow."""
  if not skewed:
    return np.full(groups, rows, np.int32)
  total, blocks = groups * rows, groups * rows // 2 // 128
  rest = [blocks // (groups - 1) + (i < blocks % (groups - 1)) for i in range(groups - 1)]
  return np.array([total // 2] + [128 * b for b in rest], np.int32)


def _normal(key, shape):
  return jax.random.normal(key, shape, F32)


def _per_tensor(x, dtype):
  return q.quantize_current_reference(x, dtype).rowwise()


def _blockwise(x, block, dtype):
  return q.quantize_blockwise_reference(x, block, dtype).rowwise()


def _grouped(w, per_tensor: bool, dtype):
  """(g, k, n) weights as a GroupedScaledTensor: one scale per expert, or 128x128 blocks."""
  ts = [(_per_tensor(m, dtype) if per_tensor else _blockwise(m, (128, 128), dtype)) for m in w]
  return gg.GroupedScaledTensor(jnp.stack([t.data for t in ts]),
                                jnp.stack([t.scale_inv for t in ts]),
                                None if per_tensor else (128, 128))


def operands(sz, seed=0):
  """Float operands of one expert layer: x (m, k), w (g, k, n), dy (m, n)."""
  kx, kw, kd = jax.random.split(jax.random.PRNGKey(seed), 3)
  m = sz["groups"] * sz["rows"]
  return (_normal(kx, (m, sz["k"])), _normal(kw, (sz["groups"], sz["k"], sz["n"])) * 0.02,
          _normal(kd, (m, sz["n"])))


def fp8_calls(x, w, dy, per_tensor: bool, fast: bool, impl: str):
  """(pass -> (fn, args, reference fn)) for te_jax on FP8 operands."""
  act = (lambda v, d: _per_tensor(v, d)) if per_tensor else (lambda v, d: _blockwise(v, (1, 128), d))
  kw = dict(fast_accum=fast, impl=impl)
  wq, wtq = _grouped(w, per_tensor, E4M3), _grouped(jnp.swapaxes(w, 1, 2), per_tensor, E4M3)
  g8 = E5M2 if per_tensor else E4M3   # the gradient's format: each recipe's default
  xq, dyq, xtq, dytq = act(x, E4M3), act(dy, g8), act(x.T, E4M3), act(dy.T, g8)
  return _te_jax_calls((xq, wtq), (dyq, wq), (xtq, dytq), **kw)


def _te_jax_calls(fprop, dgrad, wgrad, **kw):
  """(pass -> (fn, args, reference fn)) for te_jax's grouped GEMM with ``kw``
  on the operands of each pass: ``fprop`` (x, the weights as (g, n, k)),
  ``dgrad`` (dy, the weights as (g, k, n)), ``wgrad`` (x.T, dy.T).

  The weights' transpose inside the jitted function (their (g, k, n) view
  for fprop, (g, n, k) for dgrad) cancels the kernel's own transpose of
  rhs: the kernel reads them as given."""
  def t(b):
    return b.T if isinstance(b, gg.GroupedScaledTensor) else jnp.swapaxes(b, 1, 2)
  return {
      "fprop": (lambda a, b, s: gg.grouped_gemm(a, t(b), s, **kw), fprop,
                lambda a, b, s: gg.grouped_gemm_reference(a, t(b), s)),
      "dgrad": (lambda a, b, s: gg.grouped_gemm(a, t(b), s, **kw), dgrad,
                lambda a, b, s: gg.grouped_gemm_reference(a, t(b), s)),
      # bfloat16 weight gradients: what the sm90 kernels write (a float32
      # output would run the reference under "auto" and fail under "cuda").
      "wgrad": (lambda a, b, s: gg.grouped_wgrad(a, b, s, out_dtype=BF16, **kw), wgrad,
                lambda a, b, s: gg.grouped_wgrad_reference(a, b, s, BF16)),
  }


def bf16_calls(x, w, dy):
  """(pass -> (fn, args)) for bf16 ``jax.lax.ragged_dot``."""
  xb, wb, dyb = x.astype(BF16), w.astype(BF16), dy.astype(BF16)

  def wgrad(a, d, w_, s):
    # w_ only gives the primal its shape (the product is linear in it; the
    # unused forward is dropped under jit). An argument, not a closure: a
    # closed-over array would be compiled into the program as a constant.
    return jax.vjp(lambda v: jax.lax.ragged_dot(a, v, s), w_)[1](d)[0]

  return {"fprop": (lambda a, b, s: jax.lax.ragged_dot(a, b, s), (xb, wb)),
          "dgrad": (lambda a, b, s: jax.lax.ragged_dot(a, b, s), (dyb, jnp.swapaxes(wb, 1, 2))),
          "wgrad": (wgrad, (xb, dyb, wb))}


def te_jax_bf16_calls(x, w, dy, impl: str):
  """(pass -> (fn, args, reference fn)) for te_jax's grouped GEMM on bf16 operands."""
  xb, wb, dyb = x.astype(BF16), w.astype(BF16), dy.astype(BF16)
  calls = _te_jax_calls((xb, jnp.swapaxes(wb, 1, 2)), (dyb, wb), (xb, dyb), impl=impl)
  # The FP8-off layer's wgrad reads x and dy as stored (grouped_wgrad_rows).
  calls["wgrad"] = (lambda a, d, s: gg.grouped_wgrad_rows(a, d, s, out_dtype=BF16, impl=impl),
                    calls["wgrad"][1],
                    lambda a, d, s: gg.grouped_wgrad_reference(a.T, d.T, s, BF16))
  return calls


def rel_error(out, ref) -> float:
  """max |out - ref| / max |ref|, in float32."""
  out, ref = jnp.asarray(out, F32), jnp.asarray(ref, F32)
  return float(jnp.max(jnp.abs(out - ref)) / jnp.maximum(jnp.max(jnp.abs(ref)), 1e-30))


def run(sz, impl: str, k_calls: int, repeats: int):
  """Rows: dict(pass, groups, variant, ms, tflops, err) per timed call."""
  x, w, dy = operands(sz)
  rows = []
  variants = {"bf16 ragged_dot": bf16_calls(x, w, dy),
              "te_jax bf16": te_jax_bf16_calls(x, w, dy, impl)}
  for name, per_tensor, fast in (("fp8 per-tensor fast", True, True),
                                 ("fp8 per-tensor split", True, False),
                                 ("fp8 blockwise", False, False)):
    variants[name] = fp8_calls(x, w, dy, per_tensor, fast, impl)
  for skewed in (False, True):
    sizes = jnp.asarray(group_sizes(sz["groups"], sz["rows"], skewed))
    flops = 2.0 * float(sizes.sum()) * sz["k"] * sz["n"]
    for pass_ in ("fprop", "dgrad", "wgrad"):
      for name, calls in variants.items():
        fn, args, *ref = calls[pass_]
        f = jax.jit(fn)
        try:
          t = bench(f, [args + (sizes,)], k=k_calls, reps=repeats)
        except Exception as e:  # pylint: disable=broad-except  # a row fails, the table stays
          print(f"{pass_} {name}: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
          continue
        err = rel_error(f(*args, sizes), jax.jit(ref[0])(*args, sizes)) if ref else None
        rows.append(dict(pass_=pass_, groups="skewed" if skewed else "balanced", variant=name,
                         ms=t * 1e3, tflops=flops / t / 1e12, err=err))
        print(json.dumps(rows[-1]), flush=True)
  return rows


def table(rows) -> str:
  """Markdown: TFLOP/s per row, its ratio to bf16 ragged_dot, and skewed/balanced."""
  by = {(r["pass_"], r["groups"], r["variant"]): r for r in rows}
  out = ["| pass | groups | variant | ms | TFLOP/s | vs bf16 ragged_dot | skewed/balanced "
         "| rel err vs reference |", "|---|---|---|---:|---:|---:|---:|---:|"]
  for r in rows:
    base = by.get((r["pass_"], r["groups"], "bf16 ragged_dot"))
    bal = by.get((r["pass_"], "balanced", r["variant"]))
    ratio = f"{r['tflops'] / base['tflops']:.3f}" if base else "-"
    skew = f"{r['tflops'] / bal['tflops']:.3f}" if bal and r["groups"] == "skewed" else ""
    err = f"{r['err']:.2e}" if r["err"] is not None else ""
    out.append(f"| {r['pass_']} | {r['groups']} | {r['variant']} | {r['ms']:.3f} | "
               f"{r['tflops']:.0f} | {ratio} | {skew} | {err} |")
  return "\n".join(out)


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n", maxsplit=1)[0])
  p.add_argument("--small", action="store_true", help="tiny sizes (CPU smoke test)")
  p.add_argument("--impl", default="cuda", choices=("cuda", "auto", "reference"),
                 help="te_jax's grouped GEMM implementation (default: the sm90 kernel)")
  p.add_argument("--k", type=int, default=20, help="back-to-back calls per timing")
  p.add_argument("--repeats", type=int, default=5, help="timings; the median is kept")
  args = p.parse_args(argv)
  sz = SIZES["small" if args.small else "full"]
  print(f"device: {jax.devices()[0].device_kind}; jax {jax.__version__}; {sz}", flush=True)
  rows = run(sz, args.impl, args.k, args.repeats)
  print(table(rows))
  return 0 if rows else 1


if __name__ == "__main__":
  sys.exit(main())
