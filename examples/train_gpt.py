"""Train a small character-level GPT with te_jax FP8 layers.

The model is a stack of ``te_jax.flax.TransformerLayer`` blocks (causal,
rotary, packed-sequence aware) between a token embedding and an LM head
(``gpt_model.py``), trained on a generated corpus (``gpt_data.py``, no
downloads) packed into fixed-length rows with ``te_jax.packing`` (segment ids
and positions go to the model, so attention never crosses documents; the
loss is masked with ``next_token_targets``). Here: the mesh, optimizer and
loss, and ``Trainer``: one ``jax.jit`` step (optax AdamW, warmup + cosine)
over a ``jax.sharding`` mesh ``(dp, ep, fsdp, tp)`` of the available
devices, parameters sharded by te_jax's logical axis rules. The loop
(progress, orbax checkpoints of parameters, optimizer and FP8 state,
resuming, the summary) is ``gpt_train_loop.py``; the run's settings
(``Config``) ``gpt_config.py``; its flags ``gpt_cli.py``. README "Examples"
and "Multi-host" (several processes, one log from process 0) say more.

  python3 examples/train_gpt.py                        # CPU default, ~70 s
  python3 examples/train_gpt.py --recipe blockwise --steps 300
  python3 examples/train_gpt.py --sample_tokens 64   # then decode with the KV cache
  python3 examples/train_gpt.py --preset h200 --recipe delayed   # needs a GPU
  python3 examples/train_gpt.py --preset llama    # Llama-style, 1.13B: one H200
  python3 examples/train_gpt.py --preset llama --offload_optimizer   # AdamW state on host
  python3 examples/train_gpt.py --preset moe      # mixture of experts, 1.71B: one H100
  python3 examples/train_gpt.py --preset moe_tiny --ep 2 --fsdp 2 --tp 2   # 8 devices
  python3 examples/train_gpt.py --ckpt_dir /tmp/gpt --steps 100   # then:
  python3 examples/train_gpt.py --ckpt_dir /tmp/gpt --steps 200 --resume

Outputs (``--out_dir``): ``loss_curve.png`` and ``metrics.json``, both over
the whole run (a resumed run reads the earlier steps' losses from its
checkpoint). Each run prints tokens/s and, where the device's dense bf16
peak is known (or given by ``--peak_tflops``), the model FLOP utilisation
(``model_flops_per_token``). The progress bar is drawn on a terminal only;
elsewhere (a log file, a pipe) a line every ``--log_every`` steps.

Presets: ``cpu``, ``tiny`` and ``h200`` are GPTs (LayerNorm, GELU MLP);
``llama`` and ``llama_tiny`` Llama-style (RMSNorm, SwiGLU, grouped-query
attention, no biases); all use rotary positions. ``moe`` and ``moe_tiny``
are Llama-style with a mixture of experts in place of each MLP
(``TransformerLayer(mlp_type="moe")``, DeepSeek-V3 style: many narrow
experts, a shared one, sigmoid router, bias-based balancing): the training
loss adds the layers' auxiliary loss, the router biases are updated after
each step (``TrainState.model_state``), the log shows the dropped
assignments (0 unless ``--capacity_factor``), and ``--ep`` splits the
experts over an expert-parallel mesh axis. ``--offload_optimizer`` keeps
AdamW's moments in host memory between steps (``te_jax.offload``): the same
losses, 8 bytes per parameter less on the device during the forward and
backward passes, for moving them to the device and back at each update.

Resuming (``--ckpt_dir D --resume``). Each checkpoint step directory also
holds ``train_gpt_run.json``: the run-defining flags (``RUN_FIELDS``), its
``--steps`` and LR horizon. Flags left out are taken from it, so ``--ckpt_dir
D --resume`` alone continues the run to its ``--steps``; a run-defining flag
with another value is an error naming it (use a new ``--ckpt_dir``), while
flags of how the run executes (``--fsdp --tp --dp --remat``, checkpointing,
logging, output) may change (another mesh: exact only to rounding). The LR
schedule (linear warmup, cosine decay to lr/10, then lr/10) keeps the horizon
of the first invocation (``--lr_horizon``, else its ``--steps``), so
``--steps 100`` then ``--steps 200 --resume`` is bit-identical to one run of
``--steps 200 --lr_horizon 100``; to split one 200-step schedule, give the
first part ``--lr_horizon 200``; ``--lr_horizon`` on a resume sets a new
horizon from there on. A resumed run says at start what the schedule does for its steps;
one whose checkpoint is already at ``--steps`` says it is finished, exits 0.
"""

from __future__ import annotations

import sys

if __name__ == "__main__":
  # --help and usage errors answer before jax loads (seconds): the parser
  # (gpt_cli, beside this file) imports no jax. main() parses again.
  import gpt_cli as _early_cli
  _early_cli.build_parser(__doc__.splitlines()[0]).parse_args()

import argparse
import contextlib
import dataclasses
from typing import Any, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax.training import train_state
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import te_jax
from te_jax import offload, packing, recipe as recipe_lib, sharding
from te_jax.flax import moe as tfx_moe

# The example's other parts, beside this file (examples/ is sys.path[0] when
# it runs by path). Their public names are re-exported here, where the tests,
# notebooks and compare_recipes.py have always found them.
import gpt_cli
import gpt_train_loop
from gpt_cli import (HelpFormatter, add_model_flags, cluster_launcher, device_problem,
                     init_distributed)
from gpt_config import Config
from gpt_data import (CHARS, PAD_ID, VOCAB_SIZE, decode, encode, make_batch, make_corpus,
                      make_document)
from gpt_model import (ALL_PRESETS, ARCHS, GPT, GPU_PRESETS, LLAMA_PRESETS, MOE_PRESETS,
                       PEAK_BF16_TFLOPS, PRESETS, RECIPES, moe_config, model_flops_per_token,
                       param_count, peak_flops)
from gpt_runs import (HISTORY_FILE, RUN_CONFIG_FILE, RUN_FIELDS, ResumeError, describe_sample,
                      final_loss_window, lr_horizon, lr_schedule_note, progress_bar,
                      read_history, read_run_config, restore_checkpoint, resume_point,
                      run_config, run_config_mismatch, save_checkpoint, save_loss_plot, smooth,
                      write_history)

__all__ = [
    # defined here
    "Trainer", "train", "main", "build_parser", "document_window", "make_recipe",
    "make_mesh", "mesh_problem", "make_optimizer", "loss_fn", "loss_and_updates",
    "MESH_RESOURCE", "MODEL_STATE", "TrainState",
    # re-exported from the example's other parts
    "Config", "HelpFormatter", "add_model_flags", "cluster_launcher", "device_problem",
    "init_distributed", "CHARS", "PAD_ID", "VOCAB_SIZE", "decode", "encode", "make_batch",
    "make_corpus", "make_document", "ALL_PRESETS", "ARCHS", "GPT", "GPU_PRESETS",
    "LLAMA_PRESETS", "MOE_PRESETS", "PEAK_BF16_TFLOPS", "PRESETS", "RECIPES",
    "moe_config", "model_flops_per_token",
    "param_count", "peak_flops", "RUN_CONFIG_FILE", "RUN_FIELDS", "ResumeError", "lr_horizon",
    "read_run_config", "run_config", "run_config_mismatch", "save_checkpoint",
    "save_loss_plot", "smooth",
]

# -------------------------------------------------------------- helpers ----


def document_window(docs, seq_len: int, multiple: int = 128) -> Optional[int]:
  """The attention band for ``--doc_window``: the longest document (a row holds
  at most ``seq_len`` of it) rounded up to ``multiple`` tokens (whole cuDNN
  tiles), or None when that is the whole row (no band to gain)."""
  longest = min(max(len(d) for d in docs), seq_len)
  window = -(-longest // multiple) * multiple
  return window if window < seq_len else None


def make_recipe(name: str, amax_history_len: int = 16):
  """None (FP8 off: the module dtype) or a te_jax recipe."""
  return {"none": None,
          "delayed": recipe_lib.DelayedScaling(amax_history_len=amax_history_len),
          "current": recipe_lib.Float8CurrentScaling(),
          "blockwise": recipe_lib.Float8BlockScaling()}[name]


def make_mesh(fsdp: int = -1, tp: int = 1, dp: int = 1, devices=None, ep: int = 1) -> Mesh:
  """A ``(dp, ep, fsdp, tp)`` mesh over ``devices`` (default all); fsdp=-1 fills."""
  devices = list(jax.devices() if devices is None else devices)
  n = len(devices)
  if fsdp == -1:
    if n % (tp * dp * ep):
      raise ValueError(f"{n} devices do not split into tp={tp} x dp={dp} x ep={ep}.")
    fsdp = n // (tp * dp * ep)
  if dp * ep * fsdp * tp != n:
    raise ValueError(f"mesh dp={dp} x ep={ep} x fsdp={fsdp} x tp={tp} = "
                     f"{dp * ep * fsdp * tp} devices, but {n} are available; use --fsdp -1 "
                     "to fill.")
  return Mesh(np.array(devices).reshape(dp, ep, fsdp, tp), BATCH_AXES + ("tp",))


def mesh_problem(cfg: Config) -> Optional[str]:
  """Why the mesh flags (--fsdp --tp --dp) and --batch of a resolved ``cfg``
  do not fit the devices jax sees, with what would; None when they do."""
  try:
    mesh = make_mesh(cfg.fsdp, cfg.tp, cfg.dp, ep=cfg.ep)
  except ValueError as e:
    return str(e)
  shards = sharding.mesh_axis_size(mesh, BATCH_AXES)
  if cfg.batch % shards:
    fits = -(-cfg.batch // shards) * shards
    return (f"--batch {cfg.batch} must be divisible by the {shards} batch shards (dp x ep x fsdp "
            f"over {len(jax.devices())} devices): use --batch {fits}, or a mesh with fewer "
            "batch shards (--tp / --fsdp)")
  return None


MESH_RESOURCE = sharding.MeshResource(dp_resource="dp", fsdp_resource="fsdp",
                                      tp_resource="tp", ep_resource="ep")
# The mesh axes the batch is split over, in the order the layers split it.
BATCH_AXES = ("dp", "ep", "fsdp")
# Variable collections the model updates itself in a training step (the MoE
# router biases): kept apart from the optimizer's parameters, in
# TrainState.model_state.
MODEL_STATE = (tfx_moe.ROUTER_BIAS_COLLECTION,)


class TrainState(train_state.TrainState):
  """``flax.training.train_state.TrainState`` with ``model_state``: the
  collections of ``MODEL_STATE`` (no gradient, no optimizer: the step
  replaces them with what the model's forward pass wrote)."""
  model_state: Any = None

  def variables(self):
    """What ``model.apply`` takes: the parameters (and FP8 state) and the model state."""
    return {**self.params, **(self.model_state or {})}

# ------------------------------------------------------------- training ----

def _decay_mask(params):
  """AdamW weight decay on matrices only (not norms, biases)."""
  return jax.tree.map(lambda p: p.ndim >= 2, params)


def make_optimizer(cfg: Config):
  """AdamW with linear warmup, cosine decay to lr/10 at ``lr_horizon(cfg)``, then lr/10."""
  sched = optax.warmup_cosine_decay_schedule(
      0.0, cfg.lr, warmup_steps=max(1, cfg.warmup),
      decay_steps=max(lr_horizon(cfg), cfg.warmup + 1), end_value=cfg.lr * 0.1)
  tx = optax.chain(optax.clip_by_global_norm(1.0),
                   optax.adamw(sched, b1=0.9, b2=0.95, weight_decay=cfg.weight_decay,
                               mask=_decay_mask))
  # --offload_optimizer: the same update, its state in host memory between steps.
  return offload.offload_optimizer(tx) if cfg.offload_optimizer else tx


def loss_and_updates(model, variables, batch):
  """The training loss and what else a step reads from the forward pass.

  Returns ``(loss, metrics, model_state)``: loss the mean next-token cross
  entropy over real (same-document) positions plus the mixture of experts'
  auxiliary loss (``te_jax.moe.aux_totals`` of what the MoE layers sow; 0
  for a dense model); metrics ``{"tokens", "cross_entropy", "aux_loss",
  "dropped"}``; model_state the ``MODEL_STATE`` collections as the forward
  pass left them (the updated router biases; {} for a dense model).
  """
  tokens, seg, pos = batch
  mutable = ["intermediates"] + [c for c in MODEL_STATE if c in variables]
  logits, updates = model.apply(variables, tokens, seg, pos, mutable=mutable)
  targets, mask = packing.next_token_targets(tokens, seg)
  ce = packing.masked_mean(optax.softmax_cross_entropy_with_integer_labels(logits, targets),
                           mask=mask)
  totals = te_jax.moe.aux_totals(updates.get("intermediates", {}))
  metrics = {"tokens": jnp.sum(mask), "cross_entropy": ce, "aux_loss": totals["aux_loss"],
             "dropped": totals["dropped"]}
  return ce + totals["aux_loss"], metrics, {c: updates[c] for c in MODEL_STATE if c in updates}


def loss_fn(model, variables, batch):
  """(training loss, real tokens): :func:`loss_and_updates`'s loss."""
  loss, metrics, _ = loss_and_updates(model, variables, batch)
  return loss, metrics["tokens"]


class Trainer:
  """Model, optimizer, mesh and jitted steps for one ``Config``."""

  def __init__(self, cfg: Config, mesh: Optional[Mesh] = None):
    self.cfg = cfg = cfg.resolved()
    self.recipe = make_recipe(cfg.recipe, cfg.amax_history_len)
    self.mesh = mesh if mesh is not None else make_mesh(cfg.fsdp, cfg.tp, cfg.dp, ep=cfg.ep)
    self.mesh_resource = dataclasses.replace(MESH_RESOURCE, sequence_parallel=cfg.sp)
    self.rules = sharding.logical_axis_rules(self.mesh_resource)
    self.batch_shards = sharding.mesh_axis_size(self.mesh, BATCH_AXES)
    if cfg.batch % self.batch_shards:
      raise ValueError(f"--batch {cfg.batch} must be divisible by the {self.batch_shards} "
                       "batch shards (dp x ep x fsdp).")
    self.docs = make_corpus(cfg.num_docs, cfg.seed)
    self.eval_docs = make_corpus(200, cfg.seed + 12345)
    self.doc_window = (document_window(self.docs + self.eval_docs, cfg.seq_len)
                       if cfg.doc_window else None)
    self.model = GPT(VOCAB_SIZE, cfg.hidden, cfg.layers, cfg.heads, cfg.mlp,
                     dtype=jnp.dtype(cfg.dtype), remat=cfg.remat, arch=cfg.arch,
                     kv_groups=cfg.kv_groups, max_document_length=self.doc_window,
                     moe=moe_config(cfg), fuse_qkv=self.fuse_qkv())
    self.tx = make_optimizer(cfg)
    block = self.recipe.token_block if self.recipe is not None else 16
    # Under --sp a device holds rows x seq_len / tp tokens: a multiple of the
    # recipe's block when rows x seq_len is one of block x tp.
    self.block = max(block, 16) * (cfg.tp if cfg.sp else 1)
    self.batch_sharding = NamedSharding(self.mesh, P(BATCH_AXES, None))
    self._build()

  def fuse_qkv(self) -> bool:
    """One Q/K/V kernel per layer unless tensor parallelism splits heads: the
    grouped-query kernel fused in one (E, heads + 2 groups, head_dim) array
    has no split that gives a device its own heads
    (te_jax.layers.attention.fused_qkv_layout)."""
    return sharding.mesh_axis_size(self.mesh, self.mesh_resource.tp_resource) == 1

  def autocast(self):
    return te_jax.fp8_autocast(enabled=self.recipe is not None, fp8_recipe=self.recipe,
                               mesh_resource=self.mesh_resource,
                               keep_fp8_copies=self.cfg.keep_fp8_copies,
                               store_act_input_in_fp8=self.cfg.store_act_input_in_fp8)

  def batch(self, step: int, docs=None):
    """The global batch of ``step`` as arrays sharded over the mesh's batch axes.

    Every process packs the same global batch (a pure function of the step,
    so all agree without communication) and feeds only the rows its own
    devices hold (``jax.make_array_from_process_local_data``); one process
    feeds all of it.
    """
    t, s, p = make_batch(self.docs if docs is None else docs, step, self.cfg.batch,
                         self.cfg.seq_len, seed=self.cfg.seed, block=self.block,
                         num_shards=self.batch_shards)
    if jax.process_count() == 1:
      return tuple(jax.device_put(a, self.batch_sharding) for a in (t, s, p))
    rows = self.local_rows(t.shape)
    return tuple(jax.make_array_from_process_local_data(self.batch_sharding, a[rows], a.shape)
                 for a in (t, s, p))

  def local_rows(self, shape) -> slice:
    """The rows of a global batch of ``shape`` that this process's devices hold.

    Devices are ordered by process in ``jax.devices()``, so the rows of one
    process are one contiguous run; anything else is an error here rather
    than a wrong batch.
    """
    ranges = {index[0].indices(shape[0])[:2] for index in
              self.batch_sharding.addressable_devices_indices_map(shape).values()}
    covered = {r for a, b in ranges for r in range(a, b)}
    lo, hi = min(covered), max(covered) + 1
    if covered != set(range(lo, hi)):
      raise ValueError(f"process {jax.process_index()} holds batch rows {sorted(ranges)}, "
                       "not one contiguous run; order the mesh's devices by process.")
    return slice(lo, hi)

  def _build(self):
    cfg, model = self.cfg, self.model
    # The smallest batch that shards evenly with FP8-aligned tokens per device.
    zeros = np.zeros((1, cfg.seq_len), np.int32)
    dummy = tuple(jnp.asarray(a) for a in packing.pad_batch(
        zeros, zeros, zeros, block=self.block, num_shards=self.batch_shards))

    def init_state(rng):
      variables = dict(model.init(rng, *dummy))
      model_state = {c: variables.pop(c) for c in MODEL_STATE if c in variables}
      return TrainState.create(apply_fn=model.apply, params=variables, tx=self.tx,
                               model_state=model_state)

    def train_step(state, batch):
      def loss_of(params):
        loss, metrics, model_state = loss_and_updates(
            model, {**params, **state.model_state}, batch)
        return loss, (metrics, model_state)
      (loss, (metrics, model_state)), grads = jax.value_and_grad(
          loss_of, has_aux=True)(state.params)
      # apply_gradients also swaps in the new FP8 state ("gradient" of the
      # "_overwrite_with_gradient" collection); the router biases the forward
      # pass moved replace the old ones.
      gnorm = jnp.sqrt(sum(jnp.sum(jnp.square(g.astype(jnp.float32)))
                        for g in jax.tree.leaves(grads["params"])))
      state = state.apply_gradients(grads=grads).replace(model_state=model_state)
      return state, dict(metrics, loss=loss, grad_norm=gnorm)

    def eval_step(state, batch):
      return loss_and_updates(model, state.variables(), batch)[1]["cross_entropy"]

    with jax.set_mesh(self.mesh), nn.logical_axis_rules(self.rules), self.autocast():
      abstract = jax.eval_shape(init_state, jax.random.PRNGKey(cfg.seed))
      specs = nn.get_partition_spec(abstract)
      self.state_sharding = nn.logical_to_mesh_sharding(specs, self.mesh, self.rules)
      if cfg.offload_optimizer:   # declared in host memory, or the step would bring it back
        self.state_sharding = self.state_sharding.replace(
            opt_state=offload.host_shardings(self.state_sharding.opt_state))
      self._init = jax.jit(lambda r: nn.meta.unbox(init_state(r)),
                           out_shardings=self.state_sharding)
      bs = (self.batch_sharding,) * 3
      self._step = jax.jit(train_step, in_shardings=(self.state_sharding, bs),
                           out_shardings=(self.state_sharding, None), donate_argnums=0)
      self._eval = jax.jit(eval_step, in_shardings=(self.state_sharding, bs))

  def _ctx(self):
    stack = contextlib.ExitStack()
    stack.enter_context(jax.set_mesh(self.mesh))
    stack.enter_context(nn.logical_axis_rules(self.rules))
    stack.enter_context(self.autocast())
    return stack

  def init(self):
    with self._ctx():
      return self._init(jax.random.PRNGKey(self.cfg.seed))

  def step(self, state, batch):
    with self._ctx():
      return self._step(state, batch)

  def evaluate(self, state, num_batches: int = 2) -> float:
    with self._ctx():
      losses = [float(self._eval(state, self.batch(i, self.eval_docs)))
                for i in range(num_batches)]
    return float(np.mean(losses))

  def sample(self, state, prompt: str, num_chars: int) -> str:
    """Greedy continuation of ``prompt`` (recomputes the whole row per char)."""
    seq = self.cfg.seq_len
    ids = list(encode(prompt))[-(seq - 1):]
    model = self.model

    @jax.jit
    def next_id(params, tokens, n):
      seg = (jnp.arange(seq) < n).astype(jnp.int32)[None]
      pos = jnp.arange(seq, dtype=jnp.int32)[None] * seg
      logits = model.apply(params, tokens, seg, pos)
      return jnp.argmax(logits[0, n - 1, 1:len(CHARS) + 1]) + 1

    params = self.host_params(state)
    # Host copies on one device, no mesh: no mesh resource either (te_jax
    # would warn that one is set while no mesh is active).
    with te_jax.fp8_autocast(enabled=self.recipe is not None, fp8_recipe=self.recipe):
      for _ in range(num_chars):
        ids = ids[-(seq - 1):]
        buf = np.zeros((1, seq), np.int32)
        buf[0, :len(ids)] = ids
        nxt = int(next_id(params, jnp.asarray(buf), len(ids)))
        ids.append(nxt)
        if CHARS[nxt - 1] == "\n":
          break
    return decode(ids)


  def host_params(self, state):
    """The model's variables (``state.variables()``: parameters, FP8 state,
    router biases) as numpy arrays, whole in every process.

    With several processes a parameter is sharded over devices of other
    processes too, so it is gathered (a collective: every process calls this).
    """
    if jax.process_count() == 1:
      return jax.device_get(state.variables())
    from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel
    return multihost_utils.process_allgather(state.variables(), tiled=True)


def train(cfg: Config, trainer: Optional[Trainer] = None) -> dict:
  """Trains per ``cfg``; returns a dict of per-step losses and a summary.

  The loop (progress, checkpoints, resuming, metrics.json, the plot) is
  ``gpt_train_loop.train``; it builds a :class:`Trainer` for the resolved
  ``cfg`` (the checkpoint's flags filled in on a resume) when ``trainer`` is
  None. With ``cfg.resume``, continues the latest checkpoint in
  ``cfg.ckpt_dir`` ("Resuming" above; a finished run returns ``{"finished":
  True, ...}`` without training); raises ResumeError when the checkpoint
  cannot continue this run. With several processes every process calls
  this; only process 0 prints and writes files.
  """
  return gpt_train_loop.train(cfg, trainer, make_trainer=Trainer)


def build_parser() -> argparse.ArgumentParser:
  """The parser of ``main`` (described by this file's first docstring line)."""
  return gpt_cli.build_parser(__doc__.splitlines()[0])


def main(argv=None):
  parser = build_parser()
  args = parser.parse_args(argv)
  if init_distributed(args, parser) and args.ckpt_dir:
    from te_jax import checkpoint  # pylint: disable=import-outside-toplevel
    if not checkpoint.orbax_available():
      parser.error("--ckpt_dir with several processes needs orbax-checkpoint (each process "
                   "writes its own shards): python3 -m pip install orbax-checkpoint")
  if args.resume:
    if not args.ckpt_dir:
      parser.error("--resume needs --ckpt_dir (the directory of the run to continue)")
    # Flags left out: the checkpoint's values.
    gpt_train_loop.flags_from_checkpoint(args, sys.argv[1:] if argv is None else argv,
                                         build_parser())
  problem = device_problem(args.preset)
  if problem and not args.force:
    parser.error(problem)
  # Every flag named as a Config field sets it (--arch and --weight_decay are
  # not flags: the preset's and the default); --no_progress turns progress off.
  cfg = Config(progress=not args.no_progress,
               **{f.name: getattr(args, f.name) for f in dataclasses.fields(Config)
                  if hasattr(args, f.name)})
  try:
    problem = mesh_problem(cfg.resolved())  # flags that cannot go together: usage errors
  except ValueError as e:
    problem = str(e)
  if problem is None and cfg.offload_optimizer and offload.host_memory_kind() is None:
    problem = (f"--offload_optimizer needs the {offload.HOST_MEMORY_KIND!r} memory, which "
               f"jax's {jax.default_backend()} devices do not have here")
  if problem:
    parser.error(problem)
  try:
    return train(cfg)
  except ResumeError as e:
    parser.error(str(e))


if __name__ == "__main__":
  main()
