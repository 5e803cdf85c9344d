"""Benchmarks of te_jax's CUDA quantize kernels and cuBLASLt FP8 GEMMs.

Protocol (docs/design.md): each function is jitted; one measurement is k=20
back-to-back calls with one block at the end, rotating over 4 input sets (so
inputs are not L2-resident); the median of 5 measurements is reported.
Baselines are timed in the same run: XLA's reference quantize path
(impl="reference" under jit), bf16 ``jnp.dot``, and XLA's own FP8 GEMM
(``lax.dot_general`` on float8 inputs; precision DEFAULT lets XLA use fast
accumulation, HIGHEST asks for split accumulation).

Bytes for quantize are the minimal traffic (read x once, write every output),
so a kernel that reads x twice (current scaling) is charged once.

Usage: python3 benchmarks/bench_ops.py [--quick] [--only quantize|act|norm|gemm|accuracy]
Prints a table and, last, a markdown section for BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import subprocess
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from te_jax.ops import act_quantize as act_ops
from te_jax.ops import cuda_available
from te_jax.ops import gemm as gemm_ops
from te_jax.ops import normalization as norm_ops
from te_jax.ops import normalization_cuda
from te_jax.ops import quantize as q

E4M3, E5M2, BF16, F32 = jnp.float8_e4m3fn, jnp.float8_e5m2, jnp.bfloat16, jnp.float32
K_CALLS, REPEATS, SETS = 20, 5, 4
# Under a profiler (tools/gpu_session.sh's actncu stage) each case's kernels
# should launch a few times, not 105: BENCH_OPS_CALLS="k,repeats" (e.g. "1,1")
# also skips the warm-up round over the rotating input sets.
_CALLS = os.environ.get("BENCH_OPS_CALLS")
if _CALLS:
  K_CALLS, REPEATS = (int(v) for v in _CALLS.split(","))
TN = (((1,), (1,)), ((), ()))


def bench(fn, arg_sets, k=K_CALLS, reps=REPEATS):
  """Median seconds per call of jitted `fn` over rotating `arg_sets`."""
  jax.block_until_ready(fn(*arg_sets[0]))  # compile + warm up
  if not _CALLS:
    jax.block_until_ready([fn(*a) for a in arg_sets])
  times = []
  for _ in range(reps):
    t0 = time.perf_counter()
    out = None
    for i in range(k):
      out = fn(*arg_sets[i % len(arg_sets)])
    jax.block_until_ready(out)
    times.append((time.perf_counter() - t0) / k)
  return statistics.median(times)


def _rand(key, shape, dtype):
  return jax.random.normal(key, shape, F32).astype(dtype)


# ------------------------------------------------------------ quantize ---

def quantize_rows(m=8192, k=8192):
  keys = jax.random.split(jax.random.PRNGKey(0), SETS)
  xs = [(_rand(kk, (m, k), BF16),) for kk in keys]
  scale = jnp.float32(2.0)
  n = m * k
  cases = [
      # name, fn(impl), bytes moved
      ("tensorwise+T+amax", lambda impl: jax.jit(
          lambda x: q.quantize_tensorwise(x, scale, E4M3, columnwise=True, impl=impl)),
       2 * n + 2 * n + 4),
      ("tensorwise+amax (rowwise)", lambda impl: jax.jit(
          lambda x: q.quantize_tensorwise(x, scale, E4M3, impl=impl)), 2 * n + n + 4),
      ("current scaling +T", lambda impl: jax.jit(
          lambda x: q.quantize_current(x, E4M3, columnwise=True, impl=impl)), 2 * n + 2 * n + 8),
      ("blockwise 1x128 row+col", lambda impl: jax.jit(
          lambda x: q.quantize_blockwise(x, (1, 128), E4M3, True, columnwise=True, impl=impl)),
       2 * n + 2 * n + 2 * 4 * n // 128),
      ("blockwise 1x128 rowwise", lambda impl: jax.jit(
          lambda x: q.quantize_blockwise(x, (1, 128), E4M3, True, impl=impl)),
       2 * n + n + 4 * n // 128),
      ("blockwise 128x128 row+col", lambda impl: jax.jit(
          lambda x: q.quantize_blockwise(x, (128, 128), E4M3, True, columnwise=True, impl=impl)),
       2 * n + 2 * n),
  ]
  # float32 master weights, quantized once a step with both copies: each
  # input byte counts twice as much as a bf16 activation's.
  xs32 = [(x.astype(F32),) for (x,) in xs]
  weight_cases = [
      ("tensorwise+T (weights)", lambda impl: jax.jit(
          lambda x: q.quantize_tensorwise(x, scale, E4M3, columnwise=True, impl=impl)),
       4 * n + 2 * n + 4),
      ("blockwise 128x128 row+col (weights)", lambda impl: jax.jit(
          lambda x: q.quantize_blockwise(x, (128, 128), E4M3, True, columnwise=True, impl=impl)),
       4 * n + 2 * n),
  ]
  rows = []
  for name, make, nbytes, inputs, dtype in ([c + (xs, "bf16") for c in cases]
                                            + [c + (xs32, "float32") for c in weight_cases]):
    t_ref = bench(make("reference"), inputs)
    t_cuda = bench(make("cuda"), inputs)
    rows.append(dict(kind="quantize", name=f"{name} {m}x{k} {dtype}", ours_us=t_cuda * 1e6,
                     ref_us=t_ref * 1e6, ours=nbytes / t_cuda / 1e12, ref=nbytes / t_ref / 1e12,
                     unit="TB/s"))
    print(f"  {rows[-1]['name']}: ours {rows[-1]['ours']:.2f} TB/s, XLA {rows[-1]['ref']:.2f} TB/s",
          flush=True)
  return rows


def stack_rows(e=64, m=1024, k=1024, impls=("cuda", "cuda")):
  """A stack of E float32 expert weights (E, M, K), both copies: one launch
  over the stack (ops/quantize_stack) against the path it replaced, a
  ``lax.map`` of the 2-D op (E launches in an XLA loop). ``impls``: the
  (stack, loop) implementations (tests pass the references)."""
  from te_jax.ops import quantize_stack as qs  # pylint: disable=import-outside-toplevel
  keys = jax.random.split(jax.random.PRNGKey(1), SETS)
  xs = [(_rand(kk, (e, m, k), BF16).astype(F32),) for kk in keys]
  scale = jnp.full((e,), 2.0, F32)
  nbytes = e * m * k * (4 + 2)
  cases = [
      ("per tensor", lambda impl: jax.jit(lambda x: qs.quantize_stack_tensorwise(
          x, scale, E4M3, columnwise=True, impl=impl)),
       lambda impl: jax.jit(lambda x: lax.map(lambda a: q.quantize_tensorwise(
           a[0], a[1], E4M3, columnwise=True, impl=impl), (x, scale)))),
      ("128x128", lambda impl: jax.jit(lambda x: qs.quantize_stack_blockwise(
          x, (128, 128), E4M3, True, columnwise=True, impl=impl)),
       lambda impl: jax.jit(lambda x: lax.map(lambda a: q.quantize_blockwise(
           a, (128, 128), E4M3, True, columnwise=True, impl=impl), x))),
  ]
  rows = []
  for name, stack, loop in cases:
    t_stack, t_loop = bench(stack(impls[0]), xs), bench(loop(impls[1]), xs)
    rows.append(dict(kind="stack", name=f"{name}, {e} x {m}x{k} float32", ours_us=t_stack * 1e6,
                     ours=nbytes / t_stack / 1e12, loop=nbytes / t_loop / 1e12,
                     unit="TB/s"))
    print(f"  stack {rows[-1]['name']}: one launch {rows[-1]['ours']:.2f} TB/s "
          f"({t_stack * 1e3:.3f} ms), lax.map {rows[-1]['loop']:.2f} TB/s "
          f"({t_loop * 1e3:.3f} ms)", flush=True)
  return rows


# ------------------------------------------------ activation quantize ---

def act_rows(m=32768, f=5632, acts=("silu", "linear"), impls=("reference", "cuda")):
  """The fused MLP's activation passes at the Llama preset's shape (batch 8
  x 4096 tokens, SwiGLU mlp 5632) as its step runs them: the forward's
  act(h) quantized rowwise, alone and with h's E4M3 copy
  (``store_act_input_in_fp8``: written by the same pass, ``h_copy=True``,
  beside the two calls it replaces, act_quantize then quantize_blockwise of
  h), and the backward's dh = dz * act'(h) quantized both ways with act(h)'s
  columnwise copy (``save_original_input``); per tensor (delayed scaling: a
  given scale; current scaling: an amax pass over the inputs first) and
  blockwise. Bytes: what each case reads and writes (h and dz once, twice
  under current scaling; h once more for the separate quantize_blockwise;
  every output once). ``impls``: (baseline, ours)."""
  keys = jax.random.split(jax.random.PRNGKey(1), SETS)
  n_act = len(acts)
  sets = [(_rand(jax.random.fold_in(kk, 0), (m, n_act * f), BF16),
           _rand(jax.random.fold_in(kk, 1), (m, f), BF16)) for kk in keys]
  scale = jnp.float32(2.0)
  h_bytes, z_elems, dh_elems = 2 * m * n_act * f, m * f, m * n_act * f
  h_copy_bytes = dh_elems * (1 + 4 / 128)   # h's E4M3 copy and a float32 scale per 128
  # (mode, options, scale bytes per element, passes over the inputs)
  modes = (("tensorwise", dict(scale=scale), 0, 1), ("current", {}, 0, 2),
           ("blockwise", dict(power_2_scale=True), 4 / 128, 1))
  cases = []
  for mode, kw, per, reads in modes:
    def fwd(impl, mode=mode, kw=kw, **extra):   # (h, dz) -> ..., dz unused
      return lambda h, dz: act_ops.act_quantize(h, acts, mode=mode, dtype=E4M3, impl=impl,
                                                columnwise=False, **kw, **extra)

    def two_calls(impl, fwd=fwd):   # store_act_input_in_fp8's forward without h_copy
      return lambda h, dz: (fwd(impl)(h, dz), q.quantize_blockwise(
          h, act_ops.H_COPY_BLOCK, act_ops.H_COPY_DTYPE,
          power_2_scale=act_ops.H_COPY_POWER_2_SCALE, impl=impl).rowwise())
    z_bytes = reads * h_bytes + z_elems * (1 + per)
    cases += [
        (f"act fwd, {mode}, rowwise z", lambda impl, fwd=fwd: fwd(impl), z_bytes),
        (f"act fwd, {mode}, rowwise z + h E4M3", lambda impl, fwd=fwd: fwd(impl, h_copy=True),
         z_bytes + h_copy_bytes),
        (f"act fwd, {mode}, rowwise z + h E4M3, 2 calls", two_calls,
         z_bytes + h_bytes + h_copy_bytes)]
    # z's columnwise copy as the forward quantized it (its amax: any finite one)
    cols = act_ops.act_columnwise_like(
        amax=None if mode == "blockwise" else jnp.float32(4.0), mode=mode, dtype=E4M3, **kw)
    cases.append((f"dact bwd, {mode}, dh both ways + z.T", lambda impl, mode=mode, kw=kw,
                  cols=cols: lambda h, dz: act_ops.dact_quantize(
                      dz, h, acts, mode=mode, dtype=E5M2, impl=impl, act_columnwise=cols, **kw),
                  reads * (h_bytes + 2 * m * f) + (2 * dh_elems + z_elems) * (1 + per)))
  rows = []
  for name, make, nbytes in cases:
    t_ref = bench(jax.jit(make(impls[0])), sets)
    t_cuda = bench(jax.jit(make(impls[1])), sets)
    rows.append(dict(kind="act", name=f"{name} {m}x{n_act}x{f} bf16", ours_us=t_cuda * 1e6,
                     ref_us=t_ref * 1e6, ours=nbytes / t_cuda / 1e12, ref=nbytes / t_ref / 1e12,
                     unit="TB/s"))
    print(f"  {rows[-1]['name']}: ours {rows[-1]['ours']:.2f} TB/s ({t_cuda * 1e3:.3f} ms), "
          f"XLA {rows[-1]['ref']:.2f} TB/s", flush=True)
  return rows


# ------------------------------------------------------- norm backward ---

def norm_backward_rows(shapes=((32768, 1536), (32768, 2048), (16384, 4096), (16384, 8192))):
  """NormBwdKernel (RMSNorm, bf16) with backward_blocks' grid and with the old fixed 264
  blocks, against XLA's backward of the reference norm; bytes = read x, dy, write dx."""
  if not cuda_available():
    raise SystemExit("--only norm times the CUDA norm kernel: needs a GPU and the built module")
  rows = []
  for m, h in shapes:
    keys = jax.random.split(jax.random.PRNGKey(m + h), 2 * SETS)
    gamma = 1.0 + 0.1 * _rand(keys[0], (h,), F32)
    sets = []
    for i in range(SETS):
      x = _rand(keys[2 * i], (m, h), BF16)
      _, rstd = norm_ops.norm_stats(x, norm_type="rmsnorm", epsilon=1e-6, impl="reference")
      sets.append((_rand(keys[2 * i + 1], (m, h), BF16), x, rstd))
    nbytes = 3 * m * h * 2

    def kernel(blocks):
      return jax.jit(lambda dy, x, rstd: normalization_cuda.norm_backward(
          dy, x, gamma, None, rstd, False, blocks=blocks))

    xla = jax.jit(lambda dy, x, rstd: norm_ops.norm_backward(
        dy, x, gamma, None, rstd, norm_type="rmsnorm", zero_centered_gamma=False,
        impl="reference"))
    grid = normalization_cuda.backward_blocks(m, h)
    t_new, t_old, t_xla = bench(kernel(None), sets), bench(kernel(264), sets), bench(xla, sets)
    name = f"norm bwd rmsnorm {m}x{h} bf16, {grid} vs 264 blocks"
    rows.append(dict(kind="norm", name=name, ours=nbytes / t_new / 1e12,
                     old=nbytes / t_old / 1e12, ref=nbytes / t_xla / 1e12))
    print(f"  {name}: {rows[-1]['ours']:.2f} TB/s ({grid} blocks), {rows[-1]['old']:.2f} "
          f"(264), XLA {rows[-1]['ref']:.2f}", flush=True)
  return rows


# ---------------------------------------------------------------- gemm ---

def _pt(key, shape, dtype):
  x = _rand(key, shape, F32)
  return q.quantize_current_reference(x, dtype).rowwise()


def _bw(key, shape, block):
  x = _rand(key, shape, F32)
  return q.quantize_blockwise_reference(x, block, E4M3, True).rowwise()


def gemm_rows(shapes):
  rows = []
  for (m, n, k) in shapes:
    flops = 2.0 * m * n * k
    keys = jax.random.split(jax.random.PRNGKey(m + n + k), 2 * SETS)
    res = {}
    # bf16 baseline
    sets = [(_rand(keys[2 * i], (m, k), BF16), _rand(keys[2 * i + 1], (n, k), BF16))
            for i in range(SETS)]
    res["bf16 jnp.dot"] = bench(jax.jit(lambda a, b: jnp.dot(a, b.T)), sets)
    del sets
    # per-tensor FP8 operands
    sets = [(_pt(keys[2 * i], (m, k), E4M3), _pt(keys[2 * i + 1], (n, k), E4M3))
            for i in range(SETS)]
    for prec, tag in ((lax.Precision.DEFAULT, "fast"), (lax.Precision.HIGHEST, "split")):
      res[f"XLA fp8 ({tag})"] = bench(jax.jit(
          lambda a, b, prec=prec: (lax.dot_general(
              a.data, b.data, TN, precision=prec, preferred_element_type=F32) *
              (a.scale_inv * b.scale_inv)).astype(BF16)), sets)
    for fast in (True, False):
      res[f"te_jax fp8 ({'fast' if fast else 'split'})"] = bench(jax.jit(
          lambda a, b, fast=fast: gemm_ops.gemm(a, b, out_dtype=BF16, fast_accum=fast,
                                                impl="cuda")), sets)
    del sets
    sets = [(_bw(keys[2 * i], (m, k), (1, 128)), _bw(keys[2 * i + 1], (n, k), (128, 128)))
            for i in range(SETS)]
    res["te_jax blockwise 1x128/128x128"] = bench(jax.jit(
        lambda a, b: gemm_ops.gemm(a, b, out_dtype=BF16, impl="cuda")), sets)
    del sets
    base = res["bf16 jnp.dot"]
    for name, t in res.items():
      rows.append(dict(kind="gemm", name=f"{name} {m}x{n}x{k}", ours_us=t * 1e6,
                       ours=flops / t / 1e12, ratio=base / t, unit="TFLOP/s"))
      print(f"  {rows[-1]['name']}: {rows[-1]['ours']:.0f} TFLOP/s, {base / t:.2f}x bf16",
            flush=True)
  return rows


def accuracy_rows(m=1024, n=1024, k=16384):
  """Fast vs split accumulation error vs the fp32 reference at long K."""
  ka, kb = jax.random.split(jax.random.PRNGKey(7))
  a, b = _pt(ka, (m, k), E4M3), _pt(kb, (n, k), E4M3)
  want = np.asarray(gemm_ops.gemm_reference(a, b, F32), np.float64)
  rows = []
  def err(out):
    return float(np.linalg.norm(np.asarray(out, np.float64) - want) / np.linalg.norm(want))
  for fast in (False, True):
    out = jax.jit(lambda a, b, fast=fast: gemm_ops.gemm(a, b, out_dtype=F32, fast_accum=fast,
                                                        impl="cuda"))(a, b)
    rows.append(dict(kind="accuracy", name=f"te_jax {'fast' if fast else 'split'} accum, "
                     f"K={k}", err=err(out)))
  for prec, tag in ((lax.Precision.DEFAULT, "DEFAULT"), (lax.Precision.HIGHEST, "HIGHEST")):
    out = jax.jit(lambda a, b, prec=prec: lax.dot_general(
        a.data, b.data, TN, precision=prec, preferred_element_type=F32) *
        (a.scale_inv * b.scale_inv))(a, b)
    rows.append(dict(kind="accuracy", name=f"XLA fp8 precision={tag}, K={k}", err=err(out)))
  for r in rows:
    print(f"  {r['name']}: rel. Frobenius error {r['err']:.2e}", flush=True)
  return rows


# -------------------------------------------------------------- report ---

def _cuda_version():
  try:
    out = subprocess.run(["nvidia-smi"], capture_output=True, text=True, timeout=20).stdout
    for line in out.splitlines():
      if "CUDA Version" in line:
        return line.split("CUDA Version:")[1].strip(" |")
  except Exception:  # pylint: disable=broad-except
    pass
  return "unknown"


def report(rows):
  dev = jax.devices()[0]
  print("\n" + "=" * 100)
  print(f"{'benchmark':<58} {'ours':>12} {'baseline':>12} {'ratio':>8}")
  for r in rows:
    if r["kind"] in ("quantize", "act"):
      print(f"{r['name']:<58} {r['ours']:>8.2f} TB/s {r['ref']:>7.2f} TB/s "
            f"{r['ours'] / r['ref']:>7.2f}x")
    elif r["kind"] == "norm":
      print(f"{r['name']:<58} {r['ours']:>8.2f} TB/s {r['old']:>7.2f} TB/s "
            f"{r['ours'] / r['old']:>7.2f}x (XLA {r['ref']:.2f} TB/s)")
    elif r["kind"] == "gemm":
      print(f"{r['name']:<58} {r['ours']:>6.0f} TFLOP/s {'(bf16=1)':>12} {r['ratio']:>7.2f}x")
    elif r["kind"] == "stack":
      print(f"{'stack ' + r['name']:<58} {r['ours']:>8.2f} TB/s {r['loop']:>7.2f} TB/s "
            f"{r['ours'] / r['loop']:>7.2f}x (lax.map)")
    else:
      print(f"{r['name']:<58} rel.err {r['err']:.2e}")
  md = [f"## te_jax ops ({datetime.date.today().isoformat()})", "",
        f"GPU {dev.device_kind}, jax {jax.__version__}, CUDA (driver) {_cuda_version()}; "
        f"jit, {K_CALLS} back-to-back calls, median of {REPEATS}, {SETS} rotating input sets.", "",
        "| quantize (8192x8192 bf16 -> e4m3) | te_jax TB/s | XLA reference TB/s | ratio |",
        "|---|---|---|---|"]
  for r in rows:
    if r["kind"] == "quantize":
      md.append(f"| {r['name']} | {r['ours']:.2f} | {r['ref']:.2f} | {r['ours'] / r['ref']:.2f}x |")
  acts = [r for r in rows if r["kind"] == "act"]
  if acts:
    md += ["", "| activation quantize (Llama MLP shape) | te_jax TB/s (ms) | XLA reference TB/s |",
           "|---|---|---|"]
    md += [f"| {r['name']} | {r['ours']:.2f} ({r['ours_us'] / 1e3:.3f}) | {r['ref']:.2f} |"
           for r in acts]
  stacks = [r for r in rows if r["kind"] == "stack"]
  if stacks:
    md += ["", "| quantize a stack of expert weights, both copies | one launch TB/s | "
           "lax.map of 2-D launches TB/s | ratio |", "|---|---|---|---|"]
    md += [f"| {r['name']} | {r['ours']:.2f} | {r['loop']:.2f} | {r['ours'] / r['loop']:.2f}x |"
           for r in stacks]
  norms = [r for r in rows if r["kind"] == "norm"]
  if norms:
    md += ["", "| norm backward (RMSNorm, bf16) | te_jax TB/s | 264 blocks TB/s | XLA TB/s |",
           "|---|---|---|---|"]
    md += [f"| {r['name']} | {r['ours']:.2f} | {r['old']:.2f} | {r['ref']:.2f} |" for r in norms]
  md += ["", "| GEMM (MxNxK), bf16 output | TFLOP/s | vs bf16 jnp.dot |", "|---|---|---|"]
  for r in rows:
    if r["kind"] == "gemm":
      md.append(f"| {r['name']} | {r['ours']:.0f} | {r['ratio']:.2f}x |")
  acc = [r for r in rows if r["kind"] == "accuracy"]
  if acc:
    md += ["", "| accumulation (fp32 out, e4m3 per-tensor) | rel. Frobenius error vs fp32 |",
           "|---|---|"]
    md += [f"| {r['name']} | {r['err']:.2e} |" for r in acc]
  print("\n" + "\n".join(md))


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--quick", action="store_true", help="small GEMM shapes only")
  p.add_argument("--only", choices=["quantize", "act", "norm", "gemm", "accuracy"],
                 default=None)
  args = p.parse_args()
  shapes = [(4096, 4096, 4096)] if args.quick else [
      (4096, 4096, 4096), (8192, 8192, 8192), (16384, 8192, 8192), (4096, 7168, 16384)]
  rows = []
  if args.only in (None, "quantize"):
    rows += quantize_rows()
    rows += stack_rows()
  if args.only in (None, "act"):
    rows += act_rows()
  if args.only in (None, "norm"):
    rows += norm_backward_rows()
  if args.only in (None, "gemm"):
    rows += gemm_rows(shapes)
  if args.only in (None, "accuracy"):
    rows += accuracy_rows()
  report(rows)


if __name__ == "__main__":
  main()
