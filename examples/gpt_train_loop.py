"""The training loop of ``train_gpt.py``: steps, progress, checkpoints, resuming, the summary.

:func:`train` drives a ``train_gpt.Trainer`` (model, optimizer, mesh, jitted
step) to ``cfg.steps``: it restores the checkpoint a resumed run continues
(``gpt_runs.resume_point``), says what runs (sizes, mesh, model FLOPs per
token), shows a progress bar or a log line every ``--log_every`` steps,
checkpoints with the run's flags and loss history, and ends with the
held-out loss, a greedy sample, ``metrics.json`` and the loss plot.

It is given the function that builds a Trainer (``make_trainer``) rather than
importing ``train_gpt``: ``train_gpt.py`` runs as ``__main__``, and importing
it by name here would load it a second time, with a second ``Config`` class.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import time
from typing import Callable

import jax
import numpy as np

import te_jax
from gpt_data import CHARS, decode
from gpt_model import model_flops_per_token, param_count, peak_flops
from gpt_runs import (HISTORY_FILE, RUN_CONFIG_FILE, RUN_FIELDS, describe_sample,
                      final_loss_window, lr_horizon, lr_schedule_note, progress_bar,
                      read_history, read_run_config, restore_checkpoint, resume_point,
                      run_config, save_checkpoint, save_loss_plot, smooth, write_history)

__all__ = ["train", "flags_from_checkpoint"]


def train(cfg, trainer=None, *, make_trainer: Callable) -> dict:
  """Trains per ``cfg`` (a ``train_gpt.Config``); returns a dict of per-step
  losses and a summary. ``make_trainer(resolved_cfg)`` builds the Trainer
  when ``trainer`` is None.

  With ``cfg.resume``, continues the latest checkpoint in ``cfg.ckpt_dir``
  (see ``train_gpt.py``'s docstring: run-defining fields must match the
  checkpoint's, the LR horizon is the checkpoint's unless ``cfg.lr_horizon``
  is set, a finished run returns ``{"finished": True, ...}`` without
  training). Raises ResumeError when the checkpoint cannot continue this run.

  With several processes (``jax.distributed.initialize`` called first, as
  ``train_gpt.main`` does), every process calls this: each feeds its share of
  every batch and writes its shards of the checkpoints; only process 0 prints
  and writes ``metrics.json`` and the plot, so the run has one log.
  """
  with contextlib.ExitStack() as quiet:
    if jax.process_index() != 0:
      quiet.enter_context(contextlib.redirect_stdout(quiet.enter_context(open(os.devnull, "w"))))
    # One call site for every process: jax records the caller's source line
    # in the compiled program's metadata, and processes whose programs differ
    # there (jax 0.12.1) do not meet in their collectives (the step hangs).
    return _train(cfg, trainer, make_trainer)


def _train(cfg, trainer, make_trainer: Callable) -> dict:
  """``train`` in one process (of one or several)."""
  cfg = trainer.cfg if trainer is not None else cfg.resolved()
  last, stored = None, None
  if cfg.resume:
    last, stored, cfg = resume_point(cfg)
    if last is not None and last >= cfg.steps:
      print(f"{cfg.ckpt_dir} is at step {last}: the run is finished (--steps {cfg.steps}); "
            "nothing to train. Pass a larger --steps to continue it.")
      return {"config": dataclasses.asdict(cfg), "finished": True, "resumed_step": last,
              "steps": [], "losses": [], "state": None}
  if trainer is None:
    trainer = make_trainer(cfg)
  elif lr_horizon(trainer.cfg) != lr_horizon(cfg):
    raise ValueError(f"the given Trainer's LR schedule has horizon {lr_horizon(trainer.cfg)}, "
                     f"the checkpoint's {lr_horizon(cfg)}: build the Trainer with "
                     f"lr_horizon={lr_horizon(cfg)}.")
  state, start, run_steps, run_losses = _initial_state(cfg, trainer, last, stored)
  n_params = param_count(state)
  _print_run(cfg, trainer, n_params, start)
  flops_tok = model_flops_per_token(cfg, state)
  peak = peak_flops(jax.devices()[0], cfg.peak_tflops)
  peak_all = peak * len(jax.devices()) if peak else None
  print(f"model FLOPs per token {flops_tok / 1e9:.3f} G (6 N + 12 layers seq hidden); "
        + (f"MFU against the dense bf16 peak, {peak / 1e12:g} TFLOP/s per device "
           f"x {len(jax.devices())}" if peak else
           f"no MFU: no known peak for {jax.devices()[0].device_kind!r} (--peak_tflops)"))

  moe = trainer.model.moe
  steps, losses, times, toks, ptoks, aux_losses, dropped = [], [], [], [], [], [], []
  bar = progress_bar(cfg.steps, start, cfg.progress)
  t_start = time.perf_counter()
  for step in range(start, cfg.steps):
    batch = trainer.batch(step)
    t0 = time.perf_counter()
    state, metrics = trainer.step(state, batch)
    loss = float(metrics["loss"])               # waits for the step
    dt = time.perf_counter() - t0
    ntok = int(metrics["tokens"])
    aux_losses.append(float(metrics["aux_loss"]))
    dropped.append(int(metrics["dropped"]))
    moe_s = f" | aux {aux_losses[-1]:.4f} | dropped {dropped[-1]}" if moe is not None else ""
    steps.append(step)
    losses.append(loss)
    run_steps.append(step)
    run_losses.append(loss)
    times.append(dt)
    toks.append(ntok)
    ptoks.append(int(np.prod(batch[0].shape)))   # padding included: the FLOPs spent
    mfu_s = f" | MFU {flops_tok * ptoks[-1] / dt / peak_all:.1%}" if peak_all else ""
    if not math.isfinite(loss):
      print(f"step {step}: loss is {loss}, stopping")
      break
    if bar is not None:
      bar.set_postfix_str(f"loss {loss:.3f}{moe_s} | {ntok / dt:,.0f} tok/s | "
                          f"{dt * 1e3:.0f} ms/step{mfu_s}")
      bar.update(1)
    elif (step + 1) % cfg.log_every == 0 or step == start:
      print(f"step {step + 1:5d}  loss {loss:.4f}{moe_s.replace(' |', ' ')}  "
            f"{ntok / dt:,.0f} tok/s  {dt * 1e3:.0f} ms/step{mfu_s}", flush=True)
    last_step = step + 1 == cfg.steps
    if cfg.ckpt_dir and ((cfg.ckpt_every and (step + 1) % cfg.ckpt_every == 0) or last_step):
      _save(cfg, step + 1, state, run_steps, run_losses)
  if bar is not None:
    bar.close()
  wall = time.perf_counter() - t_start

  # Steady state excludes the first step of this process (compilation).
  steady = slice(1, None) if len(times) > 1 else slice(None)
  step_time = float(np.median(times[steady])) if times else float("nan")
  tok_s = float(np.sum(toks[steady]) / np.sum(times[steady])) if times else float("nan")
  mfu = (float(flops_tok * np.sum(ptoks[steady]) / np.sum(times[steady]) / peak_all)
         if times and peak_all else None)
  # "steps"/"losses": this invocation's; "run_steps"/"run_losses": the whole
  # run's across resumes (from the checkpoint's history), which the summary
  # line, metrics.json's first/final loss and the plot cover.
  window = final_loss_window(len(run_losses))
  result = {
      "config": dataclasses.asdict(cfg), "params": n_params, "start_step": start,
      "steps": steps, "losses": losses, "step_times": times,
      "aux_losses": aux_losses, "dropped": dropped,
      "run_steps": run_steps, "run_losses": run_losses,
      "first_loss": run_losses[0] if run_losses else None,
      "final_loss": float(np.mean(run_losses[-window:])) if run_losses else None,
      "final_loss_steps": window,
      "tokens_per_s": tok_s, "step_time_s": step_time, "wall_s": wall,
      "backend": jax.default_backend(), "devices": len(jax.devices()),
      "processes": jax.process_count(), "model_flops_per_token": flops_tok,
      "peak_flops_per_device": peak, "mfu": mfu,
  }
  _finish(cfg, trainer, state, result)
  return result


def _initial_state(cfg, trainer, last, stored):
  """``(state, start step, run_steps, run_losses)``: a fresh state, or the one
  of checkpoint step ``last`` with the run's loss history so far."""
  from te_jax import checkpoint  # pylint: disable=import-outside-toplevel
  start = 0
  state = trainer.init()
  if cfg.ckpt_dir and not checkpoint.orbax_available():
    print("orbax-checkpoint is not installed: checkpoints are written as .npz files "
          "(single host; python3 -m pip install orbax-checkpoint for orbax)")
  existing = checkpoint.latest_step(cfg.ckpt_dir) if cfg.ckpt_dir and not cfg.resume else None
  if existing is not None:
    print(f"note: {cfg.ckpt_dir} already holds checkpoints (up to step {existing}); "
          "without --resume this run starts from scratch and replaces the steps it saves")
  run_steps, run_losses = [], []     # the whole run's, across invocations
  if last is not None:
    state = restore_checkpoint(cfg.ckpt_dir, last, state, stored)
    if cfg.offload_optimizer:     # where the step expects it (the optimizer state on host)
      state = jax.device_put(state, trainer.state_sharding)
    start = int(state.step)
    run_steps, run_losses = read_history(cfg.ckpt_dir, last)
    print(f"resumed from {cfg.ckpt_dir} at step {start}. {lr_schedule_note(cfg, start)}")
    if not run_steps and start:
      print(f"note: {cfg.ckpt_dir}/{last} has no {HISTORY_FILE} (an older train_gpt.py): "
            f"metrics.json and the loss plot start at step {start}")
  return state, start, run_steps, run_losses


def _print_run(cfg, trainer, n_params: int, start: int) -> None:
  """The lines that say what runs: sizes, mesh, recipe, steps, experts, processes."""
  print(f"te_jax {te_jax.__version__} | {jax.default_backend()} x{len(jax.devices())} "
        f"mesh {dict(trainer.mesh.shape)}{' sequence-parallel' if cfg.sp else ''} | "
        f"recipe {cfg.recipe} | "
        f"{n_params / 1e6:.2f}M params, {cfg.layers} layers, hidden {cfg.hidden}, "
        f"{cfg.dtype} | batch {cfg.batch}x{cfg.seq_len} | steps {start}->{cfg.steps}"
        + (f" | attention band {trainer.doc_window} tokens" if trainer.doc_window else "")
        + (" | optimizer state in host memory" if cfg.offload_optimizer else ""))
  moe = trainer.model.moe
  if moe is not None:
    print(f"mixture of experts: {moe.num_experts} experts of width {cfg.mlp}, "
          f"{moe.num_experts_per_token} per token"
          + (f", a shared expert of width {cfg.shared_mlp}" if cfg.shared_mlp else "")
          + f", over ep={cfg.ep} device(s); "
          + (f"capacity factor {cfg.capacity_factor}" if cfg.capacity_factor else "dropless")
          + f"; grouped GEMMs: {_grouped_gemm_path(cfg)}")
  if jax.process_count() > 1:
    print(f"{jax.process_count()} processes, {jax.local_device_count()} devices each; "
          "this log is process 0's")


def _grouped_gemm_path(cfg) -> str:
  """Which implementation the experts' grouped GEMMs run, for the banner."""
  from te_jax.ops import grouped_gemm_cuda  # pylint: disable=import-outside-toplevel
  if cfg.recipe == "none":
    return "FP8 off, te_jax's float reference under XLA"
  why = grouped_gemm_cuda.auto_reference_reason()
  return f"the pure-JAX reference ({why})" if why else "te_jax's sm_90a FP8 kernel"


def _save(cfg, step: int, state, run_steps, run_losses) -> None:
  """Checkpoint ``step`` with the run's flags and loss history beside it."""
  path = save_checkpoint(cfg.ckpt_dir, step, state)
  if jax.process_index() == 0:   # one writer; the directory is shared
    with open(os.path.join(path, RUN_CONFIG_FILE), "w") as fh:
      json.dump(run_config(cfg), fh, indent=1)
    write_history(path, run_steps, run_losses)


def _finish(cfg, trainer, state, result: dict) -> None:
  """Adds the held-out loss, the samples and the final state to ``result``;
  prints the summary; writes ``metrics.json`` and the loss plot."""
  losses, run_steps, run_losses = result["losses"], result["run_steps"], result["run_losses"]
  if losses and cfg.eval_batches:
    result["eval_loss"] = trainer.evaluate(state, cfg.eval_batches)
  if losses and cfg.sample_chars:
    result["sample"] = trainer.sample(state, "the cat ", cfg.sample_chars)
  result["state"] = state
  if losses:
    window, mfu = result["final_loss_steps"], result["mfu"]
    print(f"done: {len(losses)} steps in {result['wall_s']:.1f} s | loss {run_losses[0]:.3f} "
          f"at step {run_steps[0]} -> {result['final_loss']:.3f} (mean of the last {window} "
          f"step{'s' if window > 1 else ''}) | "
          f"eval {result.get('eval_loss', float('nan')):.3f} | "
          f"{result['tokens_per_s']:,.0f} tok/s | {result['step_time_s'] * 1e3:.1f} ms/step"
          + (f" | MFU {mfu:.1%}" if mfu is not None else ""))
    if "sample" in result:
      print("sample: " + describe_sample("the cat ", result["sample"], run_steps[-1] + 1))
  if losses and cfg.sample_tokens:     # KV-cache decoding; gpt_sampling.py is beside this file
    import gpt_sampling  # pylint: disable=import-outside-toplevel
    result["kv_sample"] = gpt_sampling.sample_with_cache(
        trainer, state, cfg.sample_tokens, to_text=decode, token_range=(1, len(CHARS) + 1))
  if cfg.out_dir and losses and jax.process_index() == 0:
    os.makedirs(cfg.out_dir, exist_ok=True)
    with open(os.path.join(cfg.out_dir, "metrics.json"), "w") as fh:
      json.dump({k: v for k, v in result.items() if k != "state"}, fh, indent=1)
    png = os.path.join(cfg.out_dir, "loss_curve.png")
    if save_loss_plot(png, {f"{cfg.recipe} (raw)": (run_steps, run_losses),
                            f"{cfg.recipe} (10-step mean)": (run_steps, smooth(run_losses))},
                      f"train_gpt: {cfg.preset} preset, recipe {cfg.recipe}"):
      print(f"wrote {png}")


def flags_from_checkpoint(args, argv, parser: argparse.ArgumentParser) -> None:
  """On ``--resume``: each run-defining flag (``RUN_FIELDS``) and ``--steps``
  that ``argv`` leaves out takes the value in ``train_gpt_run.json`` of the
  latest checkpoint in ``args.ckpt_dir`` (``args`` is changed in place;
  nothing changes without one). ``parser`` (a fresh one: its defaults are
  dropped here) tells which flags ``argv`` gives."""
  from te_jax import checkpoint  # pylint: disable=import-outside-toplevel
  last = checkpoint.latest_step(args.ckpt_dir)
  stored = read_run_config(args.ckpt_dir, last) if last is not None else None
  if stored is None:
    return
  for action in parser._actions:  # pylint: disable=protected-access
    action.default = argparse.SUPPRESS
  given = set(vars(parser.parse_args(argv)))
  for name in RUN_FIELDS + ("steps",):
    if name not in given and hasattr(args, name) and name in stored:
      setattr(args, name, stored[name])
