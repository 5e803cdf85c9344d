"""Run bookkeeping of ``train_gpt.py``: checkpoints, resuming, progress, loss plots.

Every checkpoint step directory holds ``train_gpt_run.json`` (``RUN_FIELDS``,
``--steps`` and the LR horizon), which ``resume_point`` checks a run against
(see ``train_gpt.py``'s docstring, "Resuming"), and ``train_gpt_history.json``
(the loss of every step of the run so far), from which a resumed run's
metrics.json and loss plot cover the whole run.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from typing import Optional

import jax
import numpy as np

import te_jax


def lr_horizon(cfg) -> int:
  """The LR schedule's length in steps: ``cfg.lr_horizon``, else ``cfg.steps``."""
  return cfg.lr_horizon if cfg.lr_horizon is not None else cfg.steps


def save_checkpoint(ckpt_dir: str, step: int, state, keep: int = 3) -> str:
  """Saves ``state`` as ``<ckpt_dir>/<step>`` (``te_jax.checkpoint``'s layout); returns the path.

  One process: ``te_jax.checkpoint.save``. Several processes: every process
  calls orbax's multi-process save, which writes each array's shards from
  the process that holds them and lets process 0 commit the directory (then
  all wait for it), so ``ckpt_dir`` must be on a file system every process
  sees. ``te_jax.checkpoint.save`` cannot be used there: its write-aside
  and rename would run in every process at once. Restoring needs nothing
  special: ``te_jax.checkpoint.restore`` into a state of global arrays has
  each process read its own shards.
  """
  from te_jax import checkpoint  # pylint: disable=import-outside-toplevel
  if jax.process_count() == 1:
    return checkpoint.save(ckpt_dir, step, state, keep=keep)
  import orbax.checkpoint as ocp  # pylint: disable=import-outside-toplevel
  path = os.path.join(os.path.abspath(ckpt_dir), str(step))
  ckptr = ocp.StandardCheckpointer()
  try:
    ckptr.save(path, state, force=True)   # force: process 0 replaces an old one
    ckptr.wait_until_finished()
  finally:
    ckptr.close()
  if jax.process_index() == 0:
    import shutil  # pylint: disable=import-outside-toplevel
    for old in checkpoint.available_steps(ckpt_dir)[:-keep]:
      shutil.rmtree(os.path.join(os.path.abspath(ckpt_dir), str(old)), ignore_errors=True)
  return path


def progress_bar(total, initial, enabled):
  """A tqdm bar for ``total`` steps from ``initial``; None when disabled, when
  stdout is not a terminal (a log file or a pipe would get every redraw), or
  without tqdm. None means plain log lines every ``--log_every`` steps."""
  if not enabled:
    return None
  if not sys.stdout.isatty():
    print("(output is not a terminal: a log line every --log_every steps instead of a "
          "progress bar)")
    return None
  try:
    from tqdm.auto import tqdm  # pylint: disable=import-outside-toplevel
  except ImportError:
    print("(tqdm not installed: printing every --log_every steps instead)")
    return None
  return tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True,
              file=sys.stdout)


def save_loss_plot(path: str, curves: dict, title: str) -> bool:
  """Plots {label: (steps, losses)} to ``path``; False if matplotlib is missing."""
  try:
    import matplotlib  # pylint: disable=import-outside-toplevel
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  except ImportError:
    print(f"matplotlib is not installed: skipping {path} "
          "(python3 -m pip install matplotlib)")
    return False
  fig, ax = plt.subplots(figsize=(7, 4.2))
  for label, (xs, ys) in curves.items():
    ax.plot(xs, ys, label=label, linewidth=1.2)
  ax.set_xlabel("step")
  ax.set_ylabel("training loss (nats/char)")
  ax.set_title(title)
  ax.grid(alpha=0.3)
  ax.legend()
  fig.tight_layout()
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return True


def final_loss_window(n: int) -> int:
  """How many of the last of ``n`` step losses the reported final loss
  averages: 10, or a quarter of a shorter run (at least 1), so that a short
  run's figure is not the mean of its first, untrained steps."""
  return max(1, min(10, n // 4))


def describe_sample(prompt: str, text: str, steps: int) -> str:
  """The greedy sample ``text`` (``prompt`` + continuation) as printed after
  training, saying so when the continuation holds nothing but blanks (what a
  model of few steps predicts: the most frequent character)."""
  rest = text[len(prompt):] if text.startswith(prompt) else text
  if rest.strip():
    return repr(text)
  return (f"{prompt!r} + {len(rest)} blank characters: after {steps} steps the model "
          "predicts the most frequent character only (--preset cpu's 200 steps learn words)")


def lr_schedule_note(cfg, start: int) -> str:
  """What the LR schedule (warmup, cosine decay to lr/10 at the horizon, then
  lr/10) does for steps ``start`` .. ``cfg.steps - 1``: said when a run resumes."""
  horizon, end, floor = lr_horizon(cfg), cfg.steps, cfg.lr * 0.1
  span = f"steps {start}-{end - 1}"
  if end <= horizon:
    return (f"LR schedule: {span} continue its decay (horizon {horizon} steps, lr/10 = "
            f"{floor:g} at step {horizon}).")
  extra = (f"run at its final lr/10 = {floor:g}: to decay over them instead, give "
           f"--lr_horizon {end} (the run then differs from one uninterrupted run).")
  if start >= horizon:
    return (f"LR schedule: {span} are past its horizon ({horizon} steps, the first "
            f"invocation's --steps or --lr_horizon) and " + extra)
  return (f"LR schedule: steps {start}-{horizon - 1} finish its decay (horizon {horizon} "
          f"steps); steps {horizon}-{end - 1} " + extra)


def smooth(values, window: int = 10):
  """Trailing moving average (same length)."""
  v = np.asarray(values, np.float64)
  if v.size == 0 or window <= 1:
    return v
  c = np.cumsum(np.insert(v, 0, 0.0))
  idx = np.arange(1, v.size + 1)
  lo = np.maximum(0, idx - window)
  return (c[idx] - c[lo]) / (idx - lo)


# --------------------------------------------------------------- resume ----

# The Config fields that define a run: a resumed run must have the values its
# checkpoint was written with (train_gpt_run.json in each step directory).
RUN_FIELDS = ("preset", "recipe", "hidden", "layers", "heads", "mlp", "dtype",
              "amax_history_len", "seq_len", "batch", "num_docs", "seed", "lr", "warmup",
              "weight_decay", "kv_groups", "arch", "experts", "experts_per_token",
              "shared_mlp", "capacity_factor")
RUN_CONFIG_FILE = "train_gpt_run.json"
HISTORY_FILE = "train_gpt_history.json"
# Config fields without a command-line flag (named as such in errors).
_NO_FLAG = ("weight_decay",)


class ResumeError(ValueError):
  """A checkpoint that cannot continue this run (the message names the reason)."""


def _flag(field: str) -> str:
  return field if field in _NO_FLAG else f"--{field}"


def run_config(cfg) -> dict:
  """What ``train_gpt_run.json`` stores: the run-defining fields, --steps, the LR horizon."""
  out = {k: getattr(cfg, k) for k in RUN_FIELDS}
  out.update(steps=cfg.steps, lr_horizon=lr_horizon(cfg), te_jax=te_jax.__version__)
  return out


def read_run_config(ckpt_dir: str, step: int) -> Optional[dict]:
  """The run config saved with checkpoint ``step``; None for checkpoints without one."""
  path = os.path.join(ckpt_dir, str(step), RUN_CONFIG_FILE)
  if not os.path.exists(path):
    return None
  with open(path) as fh:
    return json.load(fh)


def write_history(step_dir: str, steps, losses) -> None:
  """Writes the run's (step, loss) history so far into a checkpoint's step directory."""
  with open(os.path.join(step_dir, HISTORY_FILE), "w") as fh:
    json.dump({"steps": list(steps), "losses": list(losses)}, fh)


def read_history(ckpt_dir: str, step: int):
  """(steps, losses) of the run up to checkpoint ``step``; ([], []) for a
  checkpoint written without them."""
  path = os.path.join(ckpt_dir, str(step), HISTORY_FILE)
  if not os.path.exists(path):
    return [], []
  with open(path) as fh:
    hist = json.load(fh)
  return list(hist["steps"]), list(hist["losses"])


def run_config_mismatch(cfg, stored: dict) -> list[str]:
  """``"--flag: <checkpoint> in the checkpoint, <cfg> now"`` for each run-defining difference."""
  return [f"{_flag(k)}: {stored[k]!r} in the checkpoint, {getattr(cfg, k)!r} now"
          for k in RUN_FIELDS if k in stored and stored[k] != getattr(cfg, k)]


def resume_point(cfg):
  """(last step, stored run config or None, cfg with the stored LR horizon) for ``cfg.resume``.

  Raises ResumeError when a run-defining field differs from the checkpoint's.
  """
  from te_jax import checkpoint  # pylint: disable=import-outside-toplevel
  if not cfg.ckpt_dir:
    raise ResumeError("--resume needs --ckpt_dir (the directory of the run to continue).")
  last = checkpoint.latest_step(cfg.ckpt_dir)
  if last is None:
    print(f"no checkpoint in {cfg.ckpt_dir}: starting from scratch")
    return None, None, cfg
  stored = read_run_config(cfg.ckpt_dir, last)
  if stored is None:
    print(f"note: {cfg.ckpt_dir}/{last} has no {RUN_CONFIG_FILE} (written by an older "
          f"train_gpt.py): its flags cannot be checked, and the LR schedule is built from "
          f"this run's --steps/--lr_horizon ({lr_horizon(cfg)} steps).")
    return last, None, cfg
  diff = run_config_mismatch(cfg, stored)
  if diff:
    raise ResumeError(
        f"cannot resume {cfg.ckpt_dir} (step {last}) with other settings than the run "
        f"that wrote it: {'; '.join(diff)}. Leave these flags out to continue with the "
        "checkpoint's values, or start a new run in another --ckpt_dir.")
  if cfg.lr_horizon is None:
    cfg = dataclasses.replace(cfg, lr_horizon=stored["lr_horizon"])
  elif cfg.lr_horizon != stored["lr_horizon"]:
    print(f"note: --lr_horizon {cfg.lr_horizon} replaces the checkpoint's LR schedule "
          f"horizon {stored['lr_horizon']} from step {last} on (the continuation is not "
          "the uninterrupted run's)")
  return last, stored, cfg


def restore_checkpoint(ckpt_dir: str, step: int, state, stored: Optional[dict]):
  """``te_jax.checkpoint.restore`` into ``state``; a ResumeError that says why if it fails."""
  from te_jax import checkpoint  # pylint: disable=import-outside-toplevel
  try:
    return checkpoint.restore(ckpt_dir, step, target=state)
  except Exception as e:  # pylint: disable=broad-except
    first = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
    why = ("" if stored is not None else
           " It has no run config: was it written with other --recipe, --hidden, "
           "--layers, --heads, --mlp, --dtype or --amax_history_len?")
    raise ResumeError(f"cannot restore {ckpt_dir}/{step} into this model.{why} "
                      f"({type(e).__name__}: {first})") from e
