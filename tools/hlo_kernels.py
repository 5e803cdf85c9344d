"""What a profile's XLA kernels compute: each kernel name looked up in the
optimized HLO of the step that ran it.

A GPU trace names an XLA kernel after its fusion instruction, with '.'
written '_' (``loop_add_fusion.49`` runs as ``loop_add_fusion_49``), and
instructions that reuse one kernel carry that name as ``deduplicated_name``.
For each kernel this prints how many instructions run it, the first one's
output shape and operands, and its JAX op name (``jit(train_step)/...``),
which says whether it is, say, a residual add, an optimizer update or an
attention mask: the lookup run AS made by hand for ``bench_model.py``'s
"other" kernels.

  python3 tools/hlo_kernels.py STEP.gpu_after_optimizations.txt[.gz] NAME [NAME ...]

The HLO file: ``XLA_FLAGS="--xla_dump_to=DIR --xla_dump_hlo_as_text
--xla_dump_hlo_module_re=jit_train_step"`` on the run (``gpu_session.sh``'s
model stage with ``MODEL_HLO=1`` keeps it, gzipped); NAME: kernel names as
``bench_model.py --top N`` prints them.
"""

from __future__ import annotations

import dataclasses
import gzip
import re
import sys
from typing import List, Optional


@dataclasses.dataclass
class KernelHlo:
  """The HLO behind one kernel name: ``count`` instructions run it; the first
  one's ``shape`` (its result), ``operands`` and JAX ``op_name`` ("" when the
  instruction has none); ``body``: its fused computation's lines."""
  name: str
  count: int
  shape: str = ""
  operands: str = ""
  op_name: str = ""
  body: List[str] = dataclasses.field(default_factory=list)


_INSTR = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = (\S+(?: \S+)*?) (?:fusion|custom-call)\((.*?)\)"
                    r"(.*)$")


def read_hlo(path: str) -> str:
  """The text of an HLO dump, gzipped or not."""
  opener = gzip.open if path.endswith(".gz") else open
  with opener(path, "rt") as fh:
    return fh.read()


def lookup(text: str, name: str) -> KernelHlo:
  """The instructions of HLO ``text`` that a kernel called ``name`` runs."""
  dotted = re.sub(r"_(\d+)$", r".\1", name)
  hits = []
  for line in text.splitlines():
    m = _INSTR.match(line)
    if not m:
      continue
    instr, rest = m.group(1), m.group(4)
    if instr in (name, dotted) or f'deduplicated_name="{name}"' in rest:
      hits.append(m)
  if not hits:
    return KernelHlo(name, 0)
  first = hits[0]
  op = re.search(r'op_name="([^"]*)"', first.group(4))
  called = re.search(r"calls=%?([\w.\-]+)", first.group(4))
  return KernelHlo(name, len(hits), first.group(2), first.group(3),
                   op.group(1) if op else "", _body(text, called.group(1)) if called else [])


def _body(text: str, computation: str) -> List[str]:
  m = re.search(r"^%?" + re.escape(computation) + r" .*?\{\n(.*?)^\}", text, re.M | re.S)
  return [l.strip() for l in m.group(1).splitlines()] if m else []


def main(argv: Optional[List[str]] = None) -> int:
  argv = sys.argv[1:] if argv is None else argv
  if len(argv) < 2:
    print("usage: hlo_kernels.py STEP.gpu_after_optimizations.txt[.gz] NAME [NAME ...]",
          file=sys.stderr)
    return 2
  text = read_hlo(argv[0])
  for name in argv[1:]:
    k = lookup(text, name)
    if not k.count:
      print(f"{name}: no instruction")
      continue
    print(f"{name}: {k.count} instruction(s), {k.shape} <- ({k.operands[:160]})")
    print(f"  op: {k.op_name or '-'}")
    for line in k.body[:12]:
      print(f"    {line[:160]}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
