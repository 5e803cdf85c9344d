"""Sharded FP8 fwd+bwd of LayerNormMLP / TransformerLayer on a device mesh.

The same code path as ``tests/test_sharding_mesh.py`` (packed documents of
random lengths, padded with ``te_jax.packing.pad_batch``; parameters sharded
by the logical axis rules; ``fp8_autocast(..., mesh_resource=...)``), at
benchmark sizes, on whatever devices exist. For each (mesh, kind, recipe):

* step time (``jit(value_and_grad)`` w.r.t. params and input; k back-to-back
  steps after 3 warmup steps, median of ``--repeats``; the delayed-scaling
  state carried from step to step as in training, see ``_fp8_carry.py``);
* parity: loss and gradients against the same step run unsharded on one
  device (max |diff| / max |ref| over every gradient leaf), compared at the
  last timed step, which both runs reach in the same number of steps;
* what moved between devices: every collective of the partitioned HLO,
  counted and summed in bytes per device (``te_jax.hlo_inspect``).

Meshes (``--meshes``, comma-separated): ``single`` (no mesh: the baseline),
``mesh1`` (a dp x fsdp x tp = 1 x 1 x 1 mesh with a MeshResource: the
sharded training code on one device; size-1 axes are unused, so the GEMMs
are the unsharded ones), ``fsdp2``, ``tp2``, ``tp2sp`` (TP + sequence
parallelism), ``fsdp8``, ``fsdp4_tp2``, ``dp2_fsdp2_tp2``, ``fsdp4``.

Usage::

  python benchmarks/bench_sharded.py --meshes single,fsdp2,tp2sp --kinds mlp
  python benchmarks/bench_sharded.py --small --meshes single,mesh1   # CPU smoke test
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import flax.linen as nn
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import te_jax
from te_jax import hlo_inspect, packing, recipe as recipe_lib, sharding
from te_jax import flax as tfx

if __package__:  # imported as benchmarks.bench_sharded
  from ._fp8_carry import carry_fp8_state
else:            # run by path (this folder is sys.path[0]) or imported as bench_sharded
  from _fp8_carry import carry_fp8_state  # pylint: disable=import-error

# name -> (axes, shape, MeshResource kwargs)
MESHES = {
    "mesh1": (("dp", "fsdp", "tp"), (1, 1, 1),
              dict(dp_resource="dp", fsdp_resource="fsdp", tp_resource="tp")),
    "fsdp2": (("fsdp",), (2,), dict(fsdp_resource="fsdp")),
    "tp2": (("tp",), (2,), dict(tp_resource="tp")),
    "tp2sp": (("tp",), (2,), dict(tp_resource="tp", sequence_parallel=True)),
    "fsdp4": (("fsdp",), (4,), dict(fsdp_resource="fsdp")),
    "fsdp8": (("fsdp",), (8,), dict(fsdp_resource="fsdp")),
    "fsdp4_tp2": (("fsdp", "tp"), (4, 2), dict(fsdp_resource="fsdp", tp_resource="tp")),
    "dp2_fsdp2_tp2": (("dp", "fsdp", "tp"), (2, 2, 2),
                      dict(dp_resource="dp", fsdp_resource="fsdp", tp_resource="tp")),
}
RECIPES = {"none": None, "delayed": recipe_lib.DelayedScaling(),
           "current": recipe_lib.Float8CurrentScaling(),
           "block": recipe_lib.Float8BlockScaling()}
VOCAB = 1000


def sizes(small):
  if small:
    return dict(rows=4, seq=256, hidden=256, mlp=1024, heads=4)
  return dict(rows=8, seq=2048, hidden=4096, mlp=16384, heads=32)


def make_inputs(sz, num_shards, seed=0):
  """Packed random-length documents per batch shard, padded to 128 per shard."""
  rng = np.random.default_rng(seed)
  per = sz["rows"] // num_shards
  toks, segs = [], []
  for _ in range(num_shards):
    target = int(per * sz["seq"] * rng.uniform(0.8, 0.9))   # not block-aligned
    lens, total = [], 0
    while total < target:   # documents up to seq/4 long: first-fit always fits 90%
      n = int(min(rng.integers(20, sz["seq"] // 4), target - total))
      lens.append(max(n, 1))
      total += lens[-1]
    docs = [rng.integers(1, VOCAB, size=n) for n in lens]
    t, s, _ = packing.pack_sequences(docs, sz["seq"], num_rows=per)
    toks.append(t)
    segs.append(s)
  t, s = np.concatenate(toks), np.concatenate(segs)
  t, s, _ = packing.pad_batch(t, s, np.zeros_like(s), block=128, num_shards=num_shards)
  table = np.random.default_rng(1).standard_normal((VOCAB, sz["hidden"])).astype(np.float32)
  x = jnp.asarray(table[t], jnp.bfloat16)
  w_out = jnp.asarray(np.random.default_rng(2).standard_normal(sz["hidden"]), jnp.float32)
  return x, jnp.asarray(s), w_out


def make_model(kind, sz):
  # Unfused MLP on every mesh: the fused core (the default) only runs
  # unsharded, so leaving it on would time different code on 1 and 2 devices.
  bf16 = jnp.bfloat16
  if kind == "mlp":
    return tfx.LayerNormMLP(intermediate_dim=sz["mlp"], dtype=bf16, param_dtype=bf16,
                            fuse_activation_quantize=False)
  return tfx.TransformerLayer(hidden_size=sz["hidden"], mlp_hidden_size=sz["mlp"],
                              num_attention_heads=sz["heads"], layer_type="decoder",
                              dtype=bf16, param_dtype=bf16, fuse_activation_quantize=False)


def loss_fn(model, kind):
  def loss(variables, x, seg, w_out):
    y = model.apply(variables, x) if kind == "mlp" else model.apply(
        variables, x, segment_ids=seg)
    return packing.masked_mean(jnp.sum(y.astype(jnp.float32) * w_out, axis=-1), seg)
  return loss


def _time(f, args, k, repeats):
  """Median ms/step of k back-to-back steps, the FP8 state carried between steps."""
  def steps(args, n):
    out = None
    for _ in range(n):
      out = f(*args)
      args = (carry_fp8_state(args[0], out[1][0]),) + tuple(args[1:])
    return args, out

  args, out = steps(args, 3)
  jax.block_until_ready(out)
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    args, out = steps(args, k)
    jax.block_until_ready(out)
    times.append((time.perf_counter() - t0) / k * 1e3)
  return statistics.median(times), out


def _max_rel(a, b):
  a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
  return float(np.abs(a - b).max() / max(np.abs(a).max(), 1e-6))


def run(kind, rname, mesh_name, sz, k, repeats, num_shards, reference=None):
  rec = RECIPES[rname]
  model = make_model(kind, sz)
  x, seg, w_out = make_inputs(sz, num_shards)
  with te_jax.fp8_autocast(rec is not None, rec):
    variables = nn.meta.unbox(jax.jit(model.init)(jax.random.PRNGKey(0), x[:1]))
  step = jax.jit(jax.value_and_grad(loss_fn(model, kind), argnums=(0, 1)))
  res = {"kind": kind, "recipe": rname, "mesh": mesh_name}
  if mesh_name == "single":
    with te_jax.fp8_autocast(rec is not None, rec):
      res["ms"], out = _time(step, (variables, x, seg, w_out), k, repeats)
    return res, out
  axes, shape, mr_kw = MESHES[mesh_name]
  n = int(np.prod(shape))
  if n > len(jax.devices()):
    raise ValueError(f"mesh {mesh_name} needs {n} devices, {len(jax.devices())} present")
  mesh = Mesh(np.array(jax.devices()[:n]).reshape(shape), axes)
  mr = sharding.MeshResource(**mr_kw)
  rules = sharding.logical_axis_rules(mr)
  with te_jax.fp8_autocast(rec is not None, rec):
    abstract = jax.eval_shape(lambda: model.init(jax.random.PRNGKey(0), x[:1]))
  v_sh = nn.logical_to_mesh_sharding(nn.get_partition_spec(abstract), mesh, rules)
  act = sharding.activation_spec(mr, mesh, 3)
  args = (jax.device_put(variables, v_sh), jax.device_put(x, NamedSharding(mesh, act)),
          jax.device_put(seg, NamedSharding(mesh, P(*act[:2]))), w_out)
  with jax.set_mesh(mesh), nn.logical_axis_rules(rules), \
       te_jax.fp8_autocast(rec is not None, rec, mesh_resource=mr):
    if n > 1:
      text, compiled = hlo_inspect.partitioned_hlo(step.lower(*args))
      res["collectives"] = hlo_inspect.summarize(hlo_inspect.collectives(text))
      f = compiled
    else:
      f = step
    res["ms"], out = _time(f, args, k, repeats)
  if reference is not None:
    (l0, g0), (l1, g1) = reference, out
    res["loss_rel_diff"] = abs(float(l1) - float(l0)) / max(abs(float(l0)), 1e-6)
    errs = [_max_rel(a, b) for a, b in zip(jax.tree.leaves(g0), jax.tree.leaves(g1))]
    res["grad_max_rel_err"] = max(errs)
  return res, out


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--meshes", default="single,mesh1")
  p.add_argument("--kinds", default="mlp,layer")
  p.add_argument("--recipes", default="none,delayed,current,block")
  p.add_argument("--small", action="store_true")
  p.add_argument("--k", type=int, default=10)
  p.add_argument("--repeats", type=int, default=3)
  p.add_argument("--json-out")
  args = p.parse_args(argv)
  sz = sizes(args.small)
  meshes = [m for m in args.meshes.split(",") if m]
  for m in meshes:
    if m != "single" and m not in MESHES:
      p.error(f"unknown mesh {m}; known: single, {', '.join(MESHES)}")
  # One data layout for every mesh: padded for the largest number of batch shards.
  num_shards = max([1] + [int(np.prod(MESHES[m][1])) for m in meshes if m != "single"])
  results = []
  for kind in args.kinds.split(","):
    for rname in args.recipes.split(","):
      ref = None
      for mesh_name in meshes:
        try:
          res, out = run(kind, rname, mesh_name, sz, args.k, args.repeats, num_shards,
                         reference=ref)
          if mesh_name == "single":
            ref = jax.device_get(out)
        except Exception as e:  # pylint: disable=broad-except
          res = {"kind": kind, "recipe": rname, "mesh": mesh_name,
                 "error": f"{type(e).__name__}: {str(e)[:300]}"}
        results.append(res)
        print("JSON " + json.dumps(res), flush=True)
        jax.clear_caches()
  dev = jax.devices()[0]
  env = {"date": datetime.date.today().isoformat(), "device": dev.device_kind,
         "n_devices": len(jax.devices()), "jax": jax.__version__, "sizes": sz}
  base = {(r["kind"], r["recipe"]): r["ms"] for r in results
          if r["mesh"] == "single" and "ms" in r}
  print(f"\n{env}\n")
  print("| kind | recipe | mesh | ms/step | vs single | loss rel diff | grad max rel err |")
  print("|---|---|---|---:|---:|---:|---:|")
  for r in results:
    if "ms" not in r:
      print(f"| {r['kind']} | {r['recipe']} | {r['mesh']} | FAILED {r['error'][:60]} | | | |")
      continue
    b = base.get((r["kind"], r["recipe"]))
    print(f"| {r['kind']} | {r['recipe']} | {r['mesh']} | {r['ms']:.2f} | "
          f"{(b / r['ms']) if b else float('nan'):.2f}x | {r.get('loss_rel_diff', 0):.2e} | "
          f"{r.get('grad_max_rel_err', 0):.3f} |")
  for r in results:
    if r.get("collectives"):
      print(f"collectives {r['kind']}/{r['recipe']}/{r['mesh']}: {r['collectives']}")
  if args.json_out:
    with open(args.json_out, "w") as f:
      json.dump({"env": env, "results": results}, f, indent=1)
  return 0 if all("ms" in r for r in results) else 1


if __name__ == "__main__":
  sys.exit(main())
