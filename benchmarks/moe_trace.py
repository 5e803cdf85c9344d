"""Which part of an MoE layer each GPU kernel of a profiler trace belongs to.

The parts are the named scopes of ``te_jax.moe.SCOPES`` (router, dispatch,
experts, combine, shared), read from the op_name metadata of the compiled
program's instructions; a kernel is matched to its instruction by the
trace's ``hlo_op`` argument or, under a command buffer, by its own (fusion)
name. ``benchmarks/bench_moe.py`` reports kernel time by part with these.
"""

from __future__ import annotations

import collections
import re

PARTS = ("router", "dispatch", "experts", "combine", "shared")
KINDS = PARTS + ("other",)


def part_of(op_name: str) -> str:
  """The MoE part (``KINDS``) of an op from its name stack: the innermost
  ``te_jax.moe.SCOPES`` scope it names, else "other"."""
  from te_jax.moe import SCOPES  # pylint: disable=import-outside-toplevel
  best, where = "other", -1
  for part, scope in SCOPES.items():
    i = op_name.rfind(scope)
    if i > where:
      best, where = part, i
  return best


_COMPUTATION = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) .*\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = ")
_CALLS = re.compile(r"calls=%?([\w.\-]+)")


def hlo_op_names(hlo_text: str) -> dict:
  """{HLO instruction name: op_name} of a compiled module. An instruction
  without op_name metadata of its own (a fusion often has none) takes the
  most frequent op_name of the computation it calls; every name is also
  listed with its dots as underscores, as the GPU trace spells kernels."""
  from model_memory import op_names  # pylint: disable=import-error,import-outside-toplevel
  own = op_names(hlo_text)
  members, calls, comp = collections.defaultdict(list), {}, None
  for line in hlo_text.splitlines():
    m = _COMPUTATION.match(line)
    if m:
      comp = m.group(1)
      continue
    m = _INSTRUCTION.match(line)
    if not m:
      continue
    name = m.group(1)
    members[comp].append(name)
    c = _CALLS.search(line)
    if c:
      calls[name] = c.group(1)
  out = dict(own)
  for name, callee in calls.items():
    if name not in own:
      found = collections.Counter(own[i] for i in members.get(callee, ()) if i in own)
      if found:
        out[name] = found.most_common(1)[0][0]
  out.update({k.replace(".", "_"): v for k, v in list(out.items())})
  return out


def hlo_parts(hlo_text: str) -> dict:
  """{HLO instruction name: MoE part} of a compiled module (from the op_name
  metadata: :func:`hlo_op_names`)."""
  return {name: part_of(op) for name, op in hlo_op_names(hlo_text).items()}


def _event_op(event, known=()) -> str:
  """The HLO instruction a GPU kernel event of a trace ran for ('' if none):
  its ``hlo_op`` argument, or -- where that names a command buffer, which
  runs many instructions, or nothing in ``known`` -- the kernel's own name
  when ``known`` has it (XLA names a fusion's kernel after the fusion)."""
  args = event.get("args", {}) or {}
  op = str(args.get("hlo_op") or args.get("name") or "")
  kernel = str(event.get("name", ""))
  if (not op or op not in known) and kernel in known:
    return kernel
  return op


def _event_part(event, parts: dict) -> str:
  """The part of one GPU kernel event of a trace: a scope named in its
  arguments (XLA's annotation of the op), else its HLO op's in ``parts``."""
  args = event.get("args", {}) or {}
  text = " ".join(str(v) for v in args.values())
  part = part_of(text)
  if part != "other":
    return part
  op = _event_op(event, parts)
  return parts.get(op, "other") if op else "other"


def kernel_time_by_part(run_steps, steps: int, hlo_text: str, top: int = 0):
  """GPU kernel ms per step by MoE part from a ``jax.profiler`` trace of
  ``run_steps(steps)`` (``hlo_text``: the compiled module's); None where the
  trace has no GPU kernels (a CPU). With ``top``, also the ``top`` kernels by
  time as ``(ms per step, part, "kernel name <- HLO op: op_name")`` under the
  key ``"top"``: what each part's time is made of, and where it comes from;
  and under ``"by_name"`` each part's ``top`` kernel names summed over all
  their launches (``{part: [(ms per step, launches per step, name)]}``): a
  part's budget by kind of kernel (the grouped GEMMs, te_jax's quantize
  kernels, XLA's fusions), which the per-op list spreads over many rows."""
  from bench_layer import gpu_kernel_events  # pylint: disable=import-error,import-outside-toplevel
  names = hlo_op_names(hlo_text)
  parts = {name: part_of(op) for name, op in names.items()}
  ms = {kind: 0.0 for kind in KINDS}
  by_kernel = collections.Counter()
  by_name, launches = collections.Counter(), collections.Counter()
  for e in gpu_kernel_events(run_steps, steps):
    part, op = _event_part(e, parts), _event_op(e, names)
    t = e.get("dur", 0) / 1e3 / steps
    ms[part] += t
    what = f"{str(e.get('name', '?'))[:60]} <- {op}: {names.get(op, '?')[-110:]}"
    by_kernel[(part, what)] += t
    by_name[(part, str(e.get("name", "?"))[:80])] += t
    launches[(part, str(e.get("name", "?"))[:80])] += 1
  if not any(ms.values()):
    return None
  if top:
    ms["top"] = [(round(t, 4), part, what) for (part, what), t in by_kernel.most_common(top)]
    ms["by_name"] = {
        kind: [(round(t, 4), launches[(p, name)] / steps, name)
               for (p, name), t in by_name.most_common() if p == kind][:top]
        for kind in KINDS}
  return ms


def count_parts(hlo_text: str) -> dict:
  """How many instructions of the compiled module each part has."""
  counts = {kind: 0 for kind in KINDS}
  for part in hlo_parts(hlo_text).values():
    counts[part] += 1
  return counts
