"""bench_peers.py's te_jax rows, their step's temp memory compiled for an H100
on a machine with no GPU (deviceless, as tools/deviceless_memory.py does for
the Llama step; that tool's header says how).

Each row is the module and autocast that ``bench_peers.te_jax_rows`` builds
(so ``--backward-chunks`` and ``--act-input-fp8`` mean what they mean
there), its training step ``jit(value_and_grad(mean(y**2), (params, x)))``
lowered on abstract arguments placed on the compile-only H100 and
compiled; printed: ``compiled.memory_analysis().temp_size_in_bytes`` in MiB,
the figure bench_peers prints as "temp MiB" on the GPU. Compile-only: no
time, no TE-JAX rows (TE-JAX needs its GPU build).

  ~/.cache/te_jax_deviceless/venv/bin/python tools/deviceless_peers_memory.py \\
      --blocks layer --backward-chunks 4 --act-input-fp8 [--recipes 'delayed,...']

Run with tools/deviceless_memory.sh's venv (jax[cuda13] 0.12.1 and te_jax
built in it); te_jax is the installed package.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.join(REPO, "tools"), os.path.join(REPO, "benchmarks")]


def row_temp_mib(module, ctx, sz, device) -> float:
  """Temp MiB of one row's compiled step (``bench_peers.train_step``) on
  abstract arguments placed on ``device``."""
  import jax
  import jax.numpy as jnp
  import flax.linen as nn
  from jax.sharding import SingleDeviceSharding
  import bench_peers

  on_device = SingleDeviceSharding(device)
  place = lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=on_device)
  x = place(jax.ShapeDtypeStruct((sz["batch"], sz["seq"], sz["hidden"]), jnp.bfloat16))
  with ctx():
    init = lambda x: nn.unbox(module.init({"params": jax.random.key(0),
                                           "dropout": jax.random.key(1)}, x))
    variables = jax.tree.map(place, jax.eval_shape(init, x))
    compiled = bench_peers.train_step(module).lower(variables, x).compile()
  return compiled.memory_analysis().temp_size_in_bytes / 2**20


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--blocks", default="mlp,layer", help="subset of mlp,layer")
  p.add_argument("--backward-chunks", type=int, default=1, help="as bench_peers.py")
  p.add_argument("--act-input-fp8", action="store_true", help="as bench_peers.py")
  p.add_argument("--recipes", help="only these rows, by recipe name (as bench_peers.py)")
  p.add_argument("--small", action="store_true", help="bench_peers' tiny sizes")
  args = p.parse_args(argv)

  import deviceless_memory as dm
  devices = dm.compile_only_devices(dm.write_target_config(raw_memory_base=False))
  import bench_peers

  sz = bench_peers.sizes(args.small)
  for block in args.blocks.split(","):
    rows = bench_peers.te_jax_rows(block, sz, backward_chunks=args.backward_chunks,
                                   act_input_fp8=args.act_input_fp8)
    if args.recipes:
      rows = bench_peers.keep_rows(rows, args.recipes.split(","))
    for label, module, ctx in rows:
      temp = row_temp_mib(module, ctx, sz, devices[0])
      print(json.dumps({"block": block, "row": label, "temp_mib": round(temp, 1),
                        "device": str(devices[0])}), flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
