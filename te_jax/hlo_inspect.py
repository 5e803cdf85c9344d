"""What a sharded program sends between devices: collectives and their bytes.

Used by the sharding tests and benchmarks to check that FP8 weights are
all-gathered in FP8 (half the bytes of bf16) and that no full activation or
bf16 weight is gathered.

Example: for a program sharded over a mesh of 2 or more devices,
``text, compiled = hlo_inspect.partitioned_hlo(jax.jit(step).lower(state, batch))``
gives its per-device HLO (``tests/test_sharding_mesh.py`` does this on fake
CPU devices); here, two lines of such HLO:

  >>> from te_jax import hlo_inspect
  >>> text = '''
  ... %ag = f8e4m3fn[256,128]{1,0} all-gather(f8e4m3fn[128,128]{1,0} %w), dimensions={0}
  ... %rs = bf16[64,128]{1,0} reduce-scatter(bf16[128,128]{1,0} %g), dimensions={0}
  ... '''
  >>> hlo_inspect.collectives(text)[0]
  Collective(kind='all-gather', dtype='f8e4m3fn', shape=(256, 128), bytes=32768)
  >>> hlo_inspect.summarize(hlo_inspect.collectives(text))
  {'all-gather f8e4m3fn': {'count': 1, 'bytes': 32768},
   'reduce-scatter bf16': {'count': 1, 'bytes': 16384}}
"""

from __future__ import annotations

import collections
import os
import re
import tempfile
from typing import List, NamedTuple, Tuple

import numpy as np

__all__ = ["Collective", "partitioned_hlo", "collectives", "summarize"]


class Collective(NamedTuple):
  """One result array of a collective op in the per-device HLO."""
  kind: str          # "all-gather", "reduce-scatter", "all-reduce", ...
  dtype: str         # HLO element type, e.g. "f8e4m3fn", "bf16"
  shape: Tuple[int, ...]
  bytes: int         # bytes of this result on one device


def partitioned_hlo(lowered, compiler_options=None):
  """Compiles ``lowered`` and returns (HLO text after SPMD partitioning, compiled).

  The HLO right after partitioning has every collective in the dtype the
  program asked for; later backend passes may change that (XLA:CPU upcasts
  FP8/bf16 collectives to f32, which GPUs do not), so this is the view that
  says what the program moves.

  Args:
    lowered: a ``jax.stages.Lowered`` (``jax.jit(f).lower(*args)``).
    compiler_options: extra XLA options merged into the dump options.

  Returns:
    (hlo_text, compiled)
  """
  with tempfile.TemporaryDirectory() as d:
    opts = {"xla_dump_to": d, "xla_dump_hlo_pass_re": "spmd-partitioning"}
    opts.update(compiler_options or {})
    compiled = lowered.compile(compiler_options=opts)
    names = [n for n in os.listdir(d) if "after_spmd-partitioning" in n]
    if not names:
      raise RuntimeError(f"XLA wrote no after_spmd-partitioning dump in {os.listdir(d)}; "
                         "is the program sharded over a mesh?")
    with open(os.path.join(d, sorted(names)[-1])) as fh:
      return fh.read(), compiled


_COLL = re.compile(r"=\s*(\(?[^=]*?\)?)\s+(all-gather|reduce-scatter|all-reduce|"
                   r"collective-permute|all-to-all)(?:-start)?\(")
_ARR = re.compile(r"(f8e4m3fn|f8e5m2|bf16|f16|f32|f64|s32|u32|s8|u8|pred)\[([0-9,]*)\]")
_BYTES = {"f8e4m3fn": 1, "f8e5m2": 1, "bf16": 2, "f16": 2, "f32": 4, "f64": 8,
          "s32": 4, "u32": 4, "s8": 1, "u8": 1, "pred": 1}


def collectives(hlo_text: str) -> List[Collective]:
  """Every collective's result arrays in ``hlo_text`` (one entry per array)."""
  out = []
  for line in hlo_text.splitlines():
    m = _COLL.search(line)
    if not m:
      continue
    for dt, dims in _ARR.findall(m.group(1)):
      shape = tuple(int(d) for d in dims.split(",") if d)
      out.append(Collective(m.group(2), dt, shape, _BYTES[dt] * int(np.prod(shape))))
  return out


def summarize(colls: List[Collective]) -> dict:
  """{"kind dtype": {"count": n, "bytes": total result bytes per device}}."""
  out = collections.defaultdict(lambda: {"count": 0, "bytes": 0})
  for c in colls:
    e = out[f"{c.kind} {c.dtype}"]
    e["count"] += 1
    e["bytes"] += c.bytes
  return dict(sorted(out.items()))
