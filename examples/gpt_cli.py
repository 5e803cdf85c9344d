"""The command line of ``train_gpt.py`` (and the flags ``compare_recipes.py`` shares).

Flags with their defaults (``HelpFormatter``), usage errors in two lines
(``Parser``), the GPU presets' device check, and the multi-process start
(``init_distributed``). Imports no jax at module level: ``train_gpt.py``
parses its command line with this before jax loads, so ``--help`` and usage
errors answer at once.
"""

from __future__ import annotations

import argparse
import os
from typing import Optional

from gpt_presets import ALL_PRESETS, GPU_PRESETS, LLAMA_PRESETS, MOE_PRESETS, RECIPES


class HelpFormatter(argparse.RawDescriptionHelpFormatter,
                    argparse.ArgumentDefaultsHelpFormatter):
  """Keeps the epilog's line breaks; adds "(default: ...)" where a help string has none."""

  def _get_help_string(self, action):
    if "(default" in (action.help or ""):
      return action.help
    return super()._get_help_string(action)


class Parser(argparse.ArgumentParser):
  """An ``ArgumentParser`` whose usage errors are two lines: a short usage
  line pointing to ``--help``, then the error (argparse's own usage line
  lists every flag: about 20 lines before the message)."""

  def error(self, message):
    self.exit(2, f"usage: {self.prog} [flags]  (--help lists them)\n"
                 f"{self.prog}: error: {message}\n")


def _listed(presets, name: str) -> str:
  return ", ".join(f"{p} {presets[p][name]}" for p in sorted(presets) if name in presets[p])


def _preset_default(name: str) -> str:
  dense = {p: v for p, v in ALL_PRESETS.items() if p not in MOE_PRESETS}
  return (f"(default: from --preset: {_listed(dense, name)}; MoE presets: "
          f"{_listed(MOE_PRESETS, name)})")


def add_model_flags(parser: argparse.ArgumentParser):
  """Flags shared with compare_recipes.py."""
  parser.add_argument("--preset", default="cpu", choices=sorted(ALL_PRESETS),
                      help="model size and training defaults: cpu (0.4M parameters, about "
                           "70 s on two CPU cores), h200 (340M, needs a GPU), tiny (tests); "
                           "Llama-style (RMSNorm, SwiGLU, rotary, grouped-query attention, "
                           "no biases): llama (1.13B, seq 4096, needs a GPU), llama_tiny "
                           "(tests); mixture of experts (Llama-style with 64 experts of "
                           "which 8 per token, a shared expert, DeepSeek-V3 balancing): "
                           "moe (1.71B, needs a GPU), moe_tiny (tests)")
  for name, typ, what in (
      ("hidden", int, "model width"), ("layers", int, "transformer layers"),
      ("heads", int, "attention heads"), ("mlp", int, "MLP hidden size"),
      ("seq_len", int, "tokens per row"), ("batch", int, "rows per step"),
      ("steps", int, "train until this step"), ("lr", float, "peak learning rate"),
      ("warmup", int, "linear LR warmup steps"),
      ("num_docs", int, "documents in the generated training corpus")):
    parser.add_argument(f"--{name}", type=typ, default=None,
                        help=f"{what} {_preset_default(name)}")
  parser.add_argument("--dtype", default=None, choices=["float32", "bfloat16"],
                      help="compute dtype " + _preset_default("dtype"))
  parser.add_argument("--fsdp", type=int, default=-1,
                      help="FSDP mesh axis size; -1 = devices / (dp * tp)")
  parser.add_argument("--tp", type=int, default=1, help="tensor-parallel mesh axis size")
  parser.add_argument("--dp", type=int, default=1, help="data-parallel mesh axis size")
  parser.add_argument("--amax_history_len", type=int, default=16,
                      help="amax history length of the delayed-scaling recipe")
  parser.add_argument("--seed", type=int, default=0,
                      help="seed of the parameters, the corpus and the data order")
  parser.add_argument("--remat", action="store_true", help="rematerialize each layer")
  parser.add_argument("--no_progress", action="store_true",
                      help="plain log lines instead of a progress bar")
  parser.add_argument("--log_every", type=int, default=25,
                      help="with --no_progress: print every N steps")
  parser.add_argument("--force", action="store_true",
                      help="run --preset " + " or ".join(sorted(GPU_PRESETS)) +
                           " even where jax sees no GPU")


def device_problem(preset: str) -> Optional[str]:
  """Why ``preset`` cannot run on this machine's jax backend, or None."""
  import jax  # pylint: disable=import-outside-toplevel
  if preset not in GPU_PRESETS or jax.default_backend() != "cpu":
    return None
  small = ("llama_tiny" if preset in LLAMA_PRESETS else
           "moe_tiny" if preset in MOE_PRESETS else "tiny")
  return (f"--preset {preset} needs a GPU: {GPU_PRESETS[preset]}, and jax sees only the "
          "CPU here (on a GPU machine, install a CUDA build of jax). Use --preset cpu "
          f"(about 70 s on two cores) or --preset {small}, or pass --force to try anyway.")


_EPILOG = """resuming (--ckpt_dir D --resume):
  flags left out are taken from the checkpoint's train_gpt_run.json, so
  "--ckpt_dir D --resume" alone continues the run to its --steps; a
  run-defining flag (--preset --recipe --hidden --layers --heads --mlp
  --kv_groups --dtype --amax_history_len --seq_len --batch --num_docs
  --seed --lr --warmup) given with another value is an error. The LR
  schedule keeps the first invocation's horizon (--lr_horizon, else its
  --steps), so
  "--steps 100" then "--steps 200 --resume" is bit-identical to one run of
  "--steps 200 --lr_horizon 100"; to split a 200-step schedule, give the
  first part --lr_horizon 200. A run already at --steps says so, exits 0.
"""


def build_parser(description: str) -> argparse.ArgumentParser:
  parser = Parser(description=description, epilog=_EPILOG, formatter_class=HelpFormatter)
  parser.add_argument("--recipe", default="delayed", choices=RECIPES,
                      help="FP8 recipe of the transformer layers' GEMMs; none = FP8 off")
  add_model_flags(parser)
  # Here, not in add_model_flags: compare_recipes.py builds its Config without them.
  parser.add_argument("--doc_window", action=argparse.BooleanOptionalAction, default=None,
                      help="self attention computes only a causal band as wide as the "
                           "corpus's longest document (rounded up to 128 tokens): the same "
                           "answer, less work on rows of many short documents (default: "
                           "on for --preset llama, off for the others)")
  parser.add_argument("--kv_groups", type=int, default=None,
                      help="key/value heads (grouped-query attention; must divide --heads) "
                           "(default: from --preset: " + _listed(LLAMA_PRESETS, "kv_groups")
                           + "; the others --heads, i.e. multi-head attention, but the MoE "
                           "presets: " + _listed(MOE_PRESETS, "kv_groups") + ")")
  parser.add_argument("--experts", type=int, default=None,
                      help="routed experts per layer; 0: a dense MLP, else a mixture of "
                           "experts in its place, each --mlp wide (default: from --preset: "
                           + _listed(MOE_PRESETS, "experts") + "; the others 0)")
  parser.add_argument("--experts_per_token", type=int, default=None,
                      help="experts each token is routed to (default: from --preset: "
                           + _listed(MOE_PRESETS, "experts_per_token") + ")")
  parser.add_argument("--shared_mlp", type=int, default=None,
                      help="width of the shared expert every token goes through; 0: none "
                           "(default: from --preset: " + _listed(MOE_PRESETS, "shared_mlp")
                           + ")")
  parser.add_argument("--capacity_factor", type=float, default=None,
                      help="each expert keeps at most this times its mean load of "
                           "assignments per device, the rest are dropped and counted in the "
                           "log (default: none: dropless)")
  parser.add_argument("--ep", type=int, default=1,
                      help="expert-parallel mesh axis size: the experts are split over it, "
                           "every other layer sees it as a data axis (must divide --experts)")
  parser.add_argument("--sp", action="store_true",
                      help="sequence parallelism: the layers outside attention split each "
                           "row's tokens over the tp axis too (needs --tp >= 2)")
  parser.add_argument("--peak_tflops", type=float, default=None,
                      help="dense bf16 peak TFLOP/s of one device, for the model FLOP "
                           "utilisation printed (default: known for H100/H200/A100 from "
                           "the device kind; elsewhere no MFU)")
  parser.add_argument("--lr_horizon", type=int, default=None,
                      help="length of the LR schedule in steps (warmup, cosine decay to "
                           "lr/10, then lr/10) (default: --steps of the run's first "
                           "invocation; a resumed run keeps its checkpoint's)")
  parser.add_argument("--ckpt_dir", default=None,
                      help="orbax checkpoint directory (default: none, no checkpoints)")
  parser.add_argument("--ckpt_every", type=int, default=0,
                      help="checkpoint every N steps (0: only at the end)")
  parser.add_argument("--resume", action="store_true",
                      help="continue the run in --ckpt_dir from its latest checkpoint "
                           "(see below)")
  parser.add_argument("--offload_optimizer", action="store_true",
                      help="keep the optimizer state (AdamW's moments) in host memory between "
                           "steps (te_jax.offload; the same losses, less device memory); "
                           "under FSDP each device's shard goes to its host")
  parser.add_argument("--keep_fp8_copies", action=argparse.BooleanOptionalAction,
                      default=None,
                      help="the fused norm and MLP blocks keep their FP8 copies of norm(x) and "
                           "the kernels for the backward instead of quantizing them again there "
                           "(te_jax.fp8_autocast(keep_fp8_copies=True): faster, one byte per "
                           "element more device memory; default: on for --preset llama, off "
                           "for the others)")
  parser.add_argument("--store_act_input_in_fp8", action=argparse.BooleanOptionalAction,
                      default=None,
                      help="the fused MLP blocks keep their activation's input h for the "
                           "backward in E4M3 (1x128 tiles) instead of the compute dtype "
                           "(te_jax.fp8_autocast(store_act_input_in_fp8=True): less device "
                           "memory, one more quantize pass; see BENCHMARKS.md; default: on "
                           "for --preset llama, off for the others)")
  parser.add_argument("--out_dir", default="runs/train_gpt",
                      help="where loss_curve.png and metrics.json go")
  parser.add_argument("--sample_chars", type=int, default=80,
                      help="greedy sample length after training (0: none)")
  parser.add_argument("--sample_tokens", type=int, default=0,
                      help="after training, greedily decode N tokens with the KV cache "
                           "(decode=True) after a validation prompt and print the decode "
                           "tokens/s (0: none)")
  parser.add_argument("--eval_batches", type=int, default=2,
                      help="held-out batches to evaluate after training (0: none)")
  parser.add_argument("--coordinator_address", default=None,
                      help="HOST:PORT where process 0 serves JAX's distributed runtime, for "
                           "a run of several processes; give all three of "
                           "--coordinator_address --num_processes --process_id, or none "
                           "under SLURM's srun or Open MPI's mpirun, which set them "
                           "(default: none: one process)")
  parser.add_argument("--num_processes", type=int, default=None,
                      help="processes in a multi-process run (default: none: one process, "
                           "or what the cluster launcher sets)")
  parser.add_argument("--process_id", type=int, default=None,
                      help="this process's index, 0 .. --num_processes - 1 (default: none: "
                           "one process, or what the cluster launcher sets)")
  return parser


_DISTRIBUTED_FLAGS = ("coordinator_address", "num_processes", "process_id")


def cluster_launcher() -> Optional[str]:
  """The launcher that started this process as one of several, or None.

  The two whose settings ``jax.distributed.initialize()`` reads by itself:
  SLURM's srun (one task per GPU: jax gives task i the GPU SLURM_LOCALID)
  and Open MPI's mpirun. One task of either is an ordinary one-process run.
  """
  env = os.environ
  if "SLURM_STEP_NODELIST" in env and int(env.get("SLURM_NTASKS", "1")) > 1:
    return "SLURM"
  if "OMPI_MCA_orte_hnp_uri" in env and int(env.get("OMPI_COMM_WORLD_SIZE", "1")) > 1:
    return "Open MPI"
  return None


def init_distributed(args, parser) -> bool:
  """Starts JAX's multi-controller runtime if this process is one of several.

  Must run before anything touches a jax backend. Returns whether it did.
  """
  given = {f: getattr(args, f) for f in _DISTRIBUTED_FLAGS}
  launcher = cluster_launcher()
  if launcher is None and all(v is None for v in given.values()):
    return False
  if launcher is None:
    missing = [f"--{f}" for f, v in given.items() if v is None]
    if missing:
      parser.error(f"a run of several processes needs --coordinator_address, "
                   f"--num_processes and --process_id (or SLURM's srun / Open MPI's "
                   f"mpirun, which set them); missing {', '.join(missing)}")
    if args.num_processes < 1 or not 0 <= args.process_id < args.num_processes:
      parser.error(f"--process_id {args.process_id} must be in 0 .. {args.num_processes - 1} "
                   f"(--num_processes {args.num_processes})")
  # Flags given win; jax fills the rest from the launcher's environment.
  # On CPU the cross-process collectives are gloo's (jax's default).
  import jax  # pylint: disable=import-outside-toplevel
  jax.distributed.initialize(coordinator_address=args.coordinator_address,
                             num_processes=args.num_processes, process_id=args.process_id)
  if jax.config.jax_compilation_cache_dir and jax.config.jax_enable_compilation_cache:
    # jax writes only process 0's executables to the persistent cache (each
    # process has its own key): a second run would pair process 0's cached step
    # with the others' fresh compiles, and on jax 0.12.1 those do not meet in
    # their collectives (the first step hangs).
    jax.config.update("jax_enable_compilation_cache", False)
    if jax.process_index() == 0:
      print(f"note: the persistent compilation cache ({jax.config.jax_compilation_cache_dir}) "
            "is off for this run of several processes: only process 0 would reuse its "
            "executables, and mixed cached and fresh ones can hang the first step")
  return True
