"""Packed-row self attention on the GPU: time and memory per path.

Attention core only (q, k, v given), fwd+bwd, bf16, causal, B x S tokens,
heads x head_dim; the rows hold documents of 700, 500, 400, 300 and 148
tokens (scaled to S; ``bench_layer._packed_segment_ids``). Paths:

- ``plain``: cuDNN flash attention, causal, no segments (what an unpacked
  batch costs; the documents are not separated).
- ``packed_mN``: ``te_jax.layers.packed_attention.packed_self_attention``
  with ``max_segments=N`` (cuDNN's packed layout behind ``lax.cond``).
- ``packed_m1``: the same with room for 1 document per row, so the
  device-side check fails and the masked cuDNN fallback runs.
- ``xla``: XLA attention under the (B, 1, S, S) segment mask (the packed
  path before 2026-12-01, and the path off GPU).
- ``masked``: cuDNN attention under that mask as a dense bias (the packed
  path's fallback, and the path of rows with more documents than
  ``max_segments``).
- ``band_wN``: ``packed_attention.banded_self_attention`` with window N
  (``max_document_length``): the masked cuDNN attention restricted to a
  left sliding window of N keys, behind its device-side check (rows with a
  longer document take the full masked attention).

Protocol: 3 warmup calls, then k back-to-back calls, median of repeats;
"temp MiB" is XLA's compiled temporary allocation for the step
(``memory_analysis().temp_size_in_bytes``), which holds cuDNN's workspace.

  python benchmarks/bench_packed_attention.py             # H200 sizes
  python benchmarks/bench_packed_attention.py --small     # smoke test
  python benchmarks/bench_packed_attention.py --gpt-rows  # train_gpt's h200 batches

``--gpt-rows``: the rows of ``examples/train_gpt.py``'s "h200" preset
(16 x 2048 tokens of short documents, up to ~60 per row; 12 heads x 128).
``--llama-rows``: those of its "llama" preset (8 x 4096 tokens, ~34
documents of at most 370 per row; 16 query heads, 8 key/value heads of 128).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import sys
import time

_EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")


def _step(path, ids, causal=True):  # pylint: disable=too-many-return-statements
  import jax
  import jax.numpy as jnp
  from te_jax.layers import packed_attention as pa

  def attend(q, k, v):
    scale = q.shape[-1] ** -0.5
    if path == "plain":
      return jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation="cudnn")
    if path == "xla":
      same = pa.segment_attention_mask(ids, ids)
      out = jax.nn.dot_product_attention(q, k, v, mask=same, is_causal=causal,
                                         implementation="xla")
      return jnp.where((ids != 0)[:, :, None, None], out, 0)
    if path == "masked":
      out = jax.nn.dot_product_attention(q, k, v, mask=pa.segment_attention_mask(ids, ids),
                                         is_causal=causal, implementation="cudnn")
      return jnp.where((ids != 0)[:, :, None, None], out, 0)
    if path.startswith("band_w"):
      return pa.banded_self_attention(q, k, v, ids, window=int(path.removeprefix("band_w")),
                                      scale=scale, implementation="cudnn")
    m = int(path.removeprefix("packed_m"))
    return pa.packed_self_attention(q, k, v, ids, is_causal=causal, max_segments=m,
                                    scale=scale)

  def loss(q, k, v):
    return jnp.sum(jnp.square(attend(q, k, v).astype(jnp.float32)))

  return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))


def main(argv=None):
  import jax
  import jax.numpy as jnp
  # pylint: disable=import-outside-toplevel
  if __package__:  # imported as benchmarks.bench_packed_attention
    from .bench_layer import _packed_segment_ids
  else:            # run by path (this folder is sys.path[0])
    from bench_layer import _packed_segment_ids  # pylint: disable=import-error

  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--small", action="store_true")
  p.add_argument("--paths", default="plain,packed_m4,packed_m8,packed_m16,packed_m32,"
                 "packed_m1,xla")
  p.add_argument("--gpt-rows", action="store_true",
                 help="the packed batches of examples/train_gpt.py's h200 preset")
  p.add_argument("--llama-rows", action="store_true",
                 help="the packed batches of examples/train_gpt.py's llama preset")
  p.add_argument("--k", type=int, default=10)
  p.add_argument("--repeats", type=int, default=3)
  args = p.parse_args(argv)
  b, s, h, d = (2, 256, 4, 64) if args.small else (8, 2048, 32, 128)
  ids = _packed_segment_ids(b, s)
  groups = None
  if args.gpt_rows or args.llama_rows:
    # examples/ is not a package: load train_gpt.py from its file, registered in
    # sys.modules first (its dataclasses look their module up there), with
    # examples/ on the path for the modules it imports (gpt_cli, gpt_model).
    if _EXAMPLES not in sys.path:
      sys.path.insert(0, _EXAMPLES)
    spec = importlib.util.spec_from_file_location(
        "train_gpt", os.path.join(_EXAMPLES, "train_gpt.py"))
    train_gpt = sys.modules["train_gpt"] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(train_gpt)
    from te_jax import packing  # pylint: disable=import-outside-toplevel
    b, s, h, d = (8, 4096, 16, 128) if args.llama_rows else (16, 2048, 12, 128)
    groups = 8 if args.llama_rows else None
    ids = jnp.asarray(train_gpt.make_batch(train_gpt.make_corpus(20000), 0, b, s)[1])
    print(f"documents per row: max {int(packing.documents_per_row(ids).max())}, "
          f"mean {float(packing.documents_per_row(ids).mean()):.1f}")
  keys = jax.random.split(jax.random.key(0), 3)
  q = jax.random.normal(keys[0], (b, s, h, d), jnp.bfloat16)
  k, v = (jax.random.normal(kk, (b, s, groups or h, d), jnp.bfloat16) for kk in keys[1:])
  print(f"B {b}, S {s}, heads {h} (key/value {groups or h}), head_dim {d}, causal, bf16, "
        f"fwd+bwd; "
        f"{jax.devices()[0].device_kind}, jax {jax.__version__}")
  print("| path | ms | temp MiB |\n|---|---:|---:|")
  for path in [x for x in args.paths.split(",") if x]:
    step = _step(path, ids)
    try:
      compiled = step.lower(q, k, v).compile()
      temp = compiled.memory_analysis().temp_size_in_bytes / 2**20
    except Exception as e:  # pylint: disable=broad-except
      print(f"| {path} | failed: {str(e).splitlines()[0][:80]} | |")
      continue
    for _ in range(3):
      out = compiled(q, k, v)
    jax.block_until_ready(out)
    times = []
    for _ in range(args.repeats):
      t0 = time.perf_counter()
      for _ in range(args.k):
        out = compiled(q, k, v)
      jax.block_until_ready(out)
      times.append((time.perf_counter() - t0) / args.k * 1e3)
    print(f"| {path} | {statistics.median(times):.3f} | {temp:.0f} |", flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
