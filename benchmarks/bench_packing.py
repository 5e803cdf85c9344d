"""Host-side throughput of te_jax.packing.pack_sequences (CPU only).

Packs N documents of uniform random length 1..seq_len into rows of seq_len
with both strategies, from numpy int32 arrays and from Python lists, and
prints tokens/s (median of repeats), rows used and fill ratio.

  python benchmarks/bench_packing.py --docs 100000 --seq-len 2048
"""

import argparse
import statistics
import time

import numpy as np

from te_jax import packing


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--docs", type=int, default=100_000)
  ap.add_argument("--seq-len", type=int, default=2048)
  ap.add_argument("--repeats", type=int, default=3)
  args = ap.parse_args()

  rng = np.random.default_rng(0)
  lens = rng.integers(1, args.seq_len + 1, args.docs)
  arrays = [rng.integers(0, 50_000, n, dtype=np.int32) for n in lens]
  total = int(lens.sum())
  lower = -(-total // args.seq_len)
  inputs = {"np.int32": arrays}
  if args.docs <= 20_000:  # lists of Python ints are slow to build and convert
    inputs["list[int]"] = [a.tolist() for a in arrays]
  print(f"{args.docs} docs, {total / 1e6:.1f}M tokens, seq_len {args.seq_len}, "
        f"lower bound {lower} rows")
  print(f"{'input':>10} {'strategy':>10} {'Mtok/s':>8} {'s':>7} {'rows':>7} {'fill':>7}")
  for name, docs in inputs.items():
    for strategy in ("first_fit", "best_fit"):
      times = []
      for _ in range(args.repeats):
        out = None  # free the previous batch before timing the next
        t0 = time.perf_counter()
        out = packing.pack_sequences(docs, args.seq_len, strategy=strategy)
        times.append(time.perf_counter() - t0)
      dt = statistics.median(times)
      rows = out[0].shape[0]
      print(f"{name:>10} {strategy:>10} {total / dt / 1e6:8.1f} {dt:7.2f} "
            f"{rows:7d} {total / out[0].size:7.4f}")
      out = None


if __name__ == "__main__":
  main()
