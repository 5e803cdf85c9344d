"""Train the small character-level GPT of ``train_gpt.py`` with the NNX modules.

The same model (token embedding, ``te_jax.nnx.TransformerLayer`` blocks,
final norm, LM head; submodules named as the Linen ``train_gpt.GPT``, so
``te_jax.nnx.load_linen_variables`` moves its checkpoints over), the same
generated data and packing, trained by a standard NNX loop on one device:
``nnx.Optimizer(model, tx, wrt=nnx.Param)``, ``nnx.value_and_grad`` over the
parameters and the FP8 state, ``nnx.jit``, and one te_jax call,
``te_jax.nnx.apply_fp8_updates``, for the delayed-scaling state.

  python3 examples/train_gpt_nnx.py                      # CPU preset, delayed scaling
  python3 examples/train_gpt_nnx.py --recipe blockwise --steps 100
  python3 examples/train_gpt_nnx.py --preset tiny

Single device only (no mesh, no checkpoints): ``train_gpt.py`` has those.
"""

from __future__ import annotations

import argparse
import math
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import te_jax
from te_jax import nnx as tnx
from te_jax import packing

import train_gpt  # the data, presets and recipes of the Linen example

RECIPES = train_gpt.RECIPES
PRESETS = train_gpt.PRESETS


class GPT(nnx.Module):
  """Decoder-only transformer: embedding, TransformerLayers, norm, LM head.

  The GEMMs of the transformer layers run in FP8 under ``fp8_autocast``; the
  embedding and the LM head stay in higher precision. Attribute names follow
  the Linen ``train_gpt.GPT`` (``embed``, ``layer_i``, ``final_norm``,
  ``lm_head``).
  """

  def __init__(self, vocab_size, hidden, layers, heads, mlp, *, dtype=jnp.bfloat16,
               rngs: nnx.Rngs):
    self.num_layers, self.dtype = layers, dtype
    self.embed = nnx.Embed(vocab_size, hidden, dtype=dtype,
                           embedding_init=jax.nn.initializers.normal(1.0), rngs=rngs)
    for i in range(layers):
      setattr(self, f"layer_{i}", tnx.TransformerLayer(
          hidden, mlp, heads, layer_type="decoder", enable_rotary_pos_emb=True,
          dtype=dtype, rngs=rngs))
    self.final_norm = tnx.LayerNorm(hidden, dtype=dtype, rngs=rngs)
    self.lm_head = nnx.Linear(hidden, vocab_size, dtype=jnp.float32,
                              kernel_init=jax.nn.initializers.normal(0.02), rngs=rngs)

  def __call__(self, tokens, segment_ids, positions):
    x = self.embed(tokens)
    for i in range(self.num_layers):
      x = getattr(self, f"layer_{i}")(x, segment_ids=segment_ids,
                                      segment_positions=positions)
    return self.lm_head(self.final_norm(x).astype(jnp.float32))


def loss_fn(model, batch):
  """Mean next-token cross entropy over real (same-document) positions."""
  tokens, seg, pos = batch
  logits = model(tokens, seg, pos)
  targets, mask = packing.next_token_targets(tokens, seg)
  ce = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
  return packing.masked_mean(ce, mask=mask)


@nnx.jit
def train_step(model, optimizer, batch):
  loss, grads = nnx.value_and_grad(loss_fn, argnums=nnx.DiffState(0, tnx.WRT))(model, batch)
  optimizer.update(model, grads)
  tnx.apply_fp8_updates(model, grads)     # the delayed-scaling state advances
  return loss


def train(preset: str = "cpu", recipe: str = "delayed", steps=None, seed: int = 0,
          log_every: int = 25, verbose: bool = True) -> dict:
  """Trains the GPT; returns ``{"losses", "seconds_per_step", "amax_history"}``
  (the last: the first layer's QKV input amax history, [] without FP8 state)."""
  p = dict(PRESETS[preset])
  steps = p["steps"] if steps is None else steps
  dtype = jnp.dtype(p["dtype"])
  r = train_gpt.make_recipe(recipe)
  docs = train_gpt.make_corpus(p["num_docs"], seed=seed)
  sched = optax.warmup_cosine_decay_schedule(
      0.0, p["lr"], warmup_steps=max(1, p["warmup"]),
      decay_steps=max(steps, p["warmup"] + 1), end_value=p["lr"] * 0.1)
  tx = optax.chain(optax.clip_by_global_norm(1.0),
                   optax.adamw(sched, b1=0.9, b2=0.95, weight_decay=0.1,
                               mask=lambda params: jax.tree.map(lambda a: a.ndim >= 2,
                                                                params)))
  losses, times = [], []
  # Construction and the first (tracing) call of the step inside the autocast.
  with te_jax.fp8_autocast(enabled=r is not None, fp8_recipe=r):
    model = GPT(train_gpt.VOCAB_SIZE, p["hidden"], p["layers"], p["heads"], p["mlp"],
                dtype=dtype, rngs=nnx.Rngs(seed))
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    for step in range(steps):
      batch = tuple(jnp.asarray(a) for a in train_gpt.make_batch(
          docs, step, p["batch"], p["seq_len"], seed=seed))
      t0 = time.perf_counter()
      loss = float(train_step(model, optimizer, batch))
      times.append(time.perf_counter() - t0)
      losses.append(loss)
      if verbose and (step % log_every == 0 or step == steps - 1):
        print(f"step {step:4d}  loss {loss:.4f}")
  if not all(math.isfinite(l) for l in losses):
    raise FloatingPointError(f"non-finite loss: {losses}")
  state = getattr(model.layer_0.self_attention.qkv, "fp8_meta", None)
  hist = [] if state is None else np.asarray(state.get_value()["x"]["amax_history"]).tolist()
  out = {"losses": losses,
         "seconds_per_step": float(np.median(times[1:])) if len(times) > 1 else None,
         "amax_history": hist}
  if verbose:
    print(f"recipe {recipe}: loss {losses[0]:.3f} -> {losses[-1]:.3f}, "
          f"{out['seconds_per_step'] or float('nan'):.3f} s/step after compilation")
  return out


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--preset", default="cpu", choices=sorted(PRESETS),
                      help="model and data size (train_gpt.py's presets)")
  parser.add_argument("--recipe", default="delayed", choices=RECIPES,
                      help="FP8 recipe; none = the module dtype")
  parser.add_argument("--steps", type=int, default=None,
                      help="training steps (default: the preset's)")
  parser.add_argument("--seed", type=int, default=0, help="init and data seed")
  parser.add_argument("--log_every", type=int, default=25, help="print every N steps")
  args = parser.parse_args(argv)
  if train_gpt.device_problem(args.preset):
    parser.error(train_gpt.device_problem(args.preset))
  train(args.preset, args.recipe, args.steps, args.seed, args.log_every)


if __name__ == "__main__":
  main()
