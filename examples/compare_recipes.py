"""Train the same GPT with each FP8 recipe and compare the loss curves with BF16.

Every run uses the same model, initialization, data order and optimizer as
``train_gpt.py``; only the recipe changes (``none`` = FP8 off, the module
dtype). Writes to ``--out_dir``:

* ``loss_curves.png``: smoothed training loss of every recipe on one figure;
* ``summary.json`` and ``summary.md``: final loss (mean of the last 10%
  of steps), its ratio to the ``none`` run, held-out loss, step time and
  tokens/s of every recipe.

  python3 examples/compare_recipes.py --steps 150                   # CPU, a few minutes
  python3 examples/compare_recipes.py --preset h200 --steps 2000     # H200
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os

import numpy as np

import train_gpt  # beside this file: run by path, examples/ is sys.path[0]


def final_loss(losses, frac: float = 0.1) -> float:
  """Mean of the last ``frac`` of the losses (at least one)."""
  n = max(1, int(round(len(losses) * frac)))
  return float(np.mean(losses[-n:]))


def plot_runs(runs: dict, path: str, title: str, ref_name: str = "none") -> bool:
  """Loss curves (left) and their ratio to the FP8-off run (right); False without matplotlib."""
  try:
    import matplotlib  # pylint: disable=import-outside-toplevel
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  except ImportError:
    print(f"matplotlib is not installed: skipping {path} (python3 -m pip install matplotlib)")
    return False
  n = len(next(iter(runs.values()))["losses"])
  window = max(1, n // 30)
  fig, (ax, axr) = plt.subplots(1, 2, figsize=(12, 4.2))
  ref = runs.get("none")
  for name, r in runs.items():
    label = ref_name if name == "none" else name
    sm = train_gpt.smooth(r["losses"], window)
    ax.plot(r["steps"], sm, label=label, linewidth=1.2)
    if ref is not None:
      m = min(len(sm), len(ref["losses"]))
      ratio = sm[:m] / train_gpt.smooth(ref["losses"], window)[:m]
      axr.plot(r["steps"][:m], ratio, label=label, linewidth=1.2)
  ax.set(xlabel="step", ylabel="training loss (nats/char)", yscale="log",
         title=f"{title}, {window}-step mean")
  axr.set(xlabel="step", ylabel="loss / loss of FP8 off", title="ratio to FP8 off")
  axr.axhspan(0.98, 1.02, color="grey", alpha=0.15, label="+-2%")
  axr.set_ylim(0.8, 1.2)
  for a in (ax, axr):
    a.grid(alpha=0.3)
    a.legend()
  fig.tight_layout()
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return True


def compare(recipes, base: train_gpt.Config, out_dir: str, tolerance: float = 0.02,
            merge: bool = False) -> dict:
  """Runs ``train_gpt.train`` once per recipe; writes the figure and summaries."""
  runs = {}
  os.makedirs(out_dir, exist_ok=True)
  for name in recipes:
    print(f"\n=== recipe {name} ===", flush=True)
    cfg = train_gpt.Config(**{**base.__dict__, "recipe": name, "out_dir": None,
                              "ckpt_dir": None, "resume": False})
    res = train_gpt.train(cfg)
    res.pop("state", None)
    runs[name] = res
    with open(os.path.join(out_dir, f"run_{name}.json"), "w") as fh:   # saved as it finishes
      json.dump(res, fh)
  if merge:
    # Earlier runs of other recipes in out_dir (same config) join the summary;
    # with no recipes to run this only summarizes (e.g. after runs made side
    # by side on several GPUs).
    def same(a, b):
      skip = ("recipe", "progress", "log_every")
      a, b = {"lr_horizon": None, **a}, {"lr_horizon": None, **b}   # runs from before it
      return {k: v for k, v in a.items() if k not in skip} == {
          k: v for k, v in b.items() if k not in skip}
    want = dataclasses.asdict(train_gpt.Config(**{
        **base.__dict__, "out_dir": None, "ckpt_dir": None, "resume": False}).resolved())
    for name in train_gpt.RECIPES:
      path = os.path.join(out_dir, f"run_{name}.json")
      if name not in runs and os.path.exists(path):
        with open(path) as fh:
          old = json.load(fh)
        if same(old["config"], want):
          runs[name] = old
          print(f"merged the earlier {name} run from {path}")
  if not runs:
    raise ValueError(f"no runs to summarize in {out_dir} (pass --recipes, or --merge "
                     "with run_<recipe>.json files of the same config there).")
  runs = {n: runs[n] for n in train_gpt.RECIPES if n in runs}

  ref = runs.get("none")
  rows = []
  for name, r in runs.items():
    fl = final_loss(r["losses"])
    row = {"recipe": name, "steps": len(r["losses"]), "final_loss": fl,
           "eval_loss": r.get("eval_loss"), "step_time_ms": 1e3 * r["step_time_s"],
           "tokens_per_s": r["tokens_per_s"]}
    if ref is not None:
      ref_fl = final_loss(ref["losses"])
      row["ratio_vs_bf16"] = fl / ref_fl
      row["within_tolerance"] = bool(abs(fl / ref_fl - 1) <= tolerance)
      if r.get("eval_loss") is not None and ref.get("eval_loss") is not None:
        row["eval_ratio_vs_bf16"] = r["eval_loss"] / ref["eval_loss"]
    rows.append(row)

  cfg0 = train_gpt.Config(**base.__dict__).resolved()
  ref_name = f"none ({cfg0.dtype}, FP8 off)"
  summary = {"config": {k: v for k, v in cfg0.__dict__.items()
                        if k not in ("recipe", "ckpt_dir", "resume", "out_dir")},
             "backend": runs[next(iter(runs))]["backend"], "tolerance": tolerance,
             "reference": ref_name, "results": rows,
             "curves": {n: r["losses"] for n, r in runs.items()}}
  os.makedirs(out_dir, exist_ok=True)
  with open(os.path.join(out_dir, "summary.json"), "w") as fh:
    json.dump(summary, fh, indent=1)
  md = [f"Recipes compared on `{summary['backend']}`: preset {cfg0.preset}, "
        f"{cfg0.layers} layers, hidden {cfg0.hidden}, {cfg0.dtype}, batch "
        f"{cfg0.batch}x{cfg0.seq_len}, {cfg0.steps} steps. Final loss = mean of the "
        "last 10% of steps; ratio vs the FP8-off run.", "",
        "| recipe | final loss | ratio vs none | eval loss | ms/step | tokens/s |",
        "|---|---|---|---|---|---|"]
  for row in rows:
    ratio = f"{row['ratio_vs_bf16']:.4f}" if "ratio_vs_bf16" in row else "-"
    ev = f"{row['eval_loss']:.4f}" if row.get("eval_loss") is not None else "-"
    md.append(f"| {row['recipe']} | {row['final_loss']:.4f} | {ratio} | {ev} | "
              f"{row['step_time_ms']:.1f} | {row['tokens_per_s']:,.0f} |")
  with open(os.path.join(out_dir, "summary.md"), "w") as fh:
    fh.write("\n".join(md) + "\n")
  print("\n" + "\n".join(md))

  png = os.path.join(out_dir, "loss_curves.png")
  if plot_runs(runs, png, f"te_jax recipes vs FP8 off ({cfg0.preset} preset)", ref_name):
    print(f"wrote {png}")
  return summary


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                   formatter_class=train_gpt.HelpFormatter)
  parser.add_argument("--recipes", default=",".join(train_gpt.RECIPES),
                      help="comma-separated subset of " + ",".join(train_gpt.RECIPES))
  train_gpt.add_model_flags(parser)
  parser.add_argument("--out_dir", default="runs/compare_recipes",
                      help="where loss_curves.png, summary.json and summary.md go")
  parser.add_argument("--tolerance", type=float, default=0.02,
                      help="relative final-loss tolerance vs the FP8-off run")
  parser.add_argument("--eval_batches", type=int, default=2,
                      help="held-out batches to evaluate after each run (0: none)")
  parser.add_argument("--merge", action="store_true",
                      help="also summarize earlier runs (run_<recipe>.json) of other recipes "
                           "with the same config in --out_dir")
  args = parser.parse_args(argv)
  recipes = [r.strip() for r in args.recipes.split(",") if r.strip()]
  if not recipes and not args.merge:
    parser.error("--recipes is empty; pass recipes, or --merge to only summarize")
  for r in recipes:
    if r not in train_gpt.RECIPES:
      parser.error(f"unknown recipe {r!r}; choose from {train_gpt.RECIPES}")
  problem = train_gpt.device_problem(args.preset)
  if problem and not args.force and recipes:
    parser.error(problem)
  base = train_gpt.Config(
      preset=args.preset, hidden=args.hidden, layers=args.layers, heads=args.heads,
      mlp=args.mlp, seq_len=args.seq_len, batch=args.batch, steps=args.steps, lr=args.lr,
      warmup=args.warmup, num_docs=args.num_docs, dtype=args.dtype, fsdp=args.fsdp, tp=args.tp, dp=args.dp,
      amax_history_len=args.amax_history_len, seed=args.seed, remat=args.remat,
      sample_chars=0, eval_batches=args.eval_batches, progress=not args.no_progress, log_every=args.log_every)
  return compare(recipes, base, args.out_dir, args.tolerance, args.merge)


if __name__ == "__main__":
  main()
