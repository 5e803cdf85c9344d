"""Quickstart: train a small FP8 MLP classifier with each te_jax recipe.

The task is embedded (no downloads): three interleaved 2-D spirals, lifted to
64 features by a fixed random projection, classified by a 3-layer MLP of
``te_jax.flax.DenseGeneral`` layers. Runs on CPU in well under a minute; on a
GPU with the CUDA custom calls built the GEMMs run in our FP8 kernels.

  python examples/quickstart.py [--steps 200]
"""

import argparse
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax.training import train_state

import te_jax
from te_jax import flax as tfx
from te_jax import recipe


def spirals(n_per_class=512, classes=3, features=64, seed=0):
  """Three noisy spirals, projected to ``features`` dims. Returns (x, labels)."""
  rng = np.random.default_rng(seed)
  xs, ys = [], []
  for c in range(classes):
    t = np.linspace(0.2, 3.5, n_per_class)
    angle = t * 2.2 + c * 2 * np.pi / classes
    pts = np.stack([t * np.cos(angle), t * np.sin(angle)], 1)
    xs.append(pts + rng.normal(0, 0.08, pts.shape))
    ys.append(np.full(n_per_class, c))
  proj = rng.normal(0, 1, (2, features))
  x = np.tanh(np.concatenate(xs) @ proj)
  return jnp.asarray(x, jnp.float32), jnp.asarray(np.concatenate(ys), jnp.int32)


class Classifier(nn.Module):
  hidden: int = 256
  classes: int = 3

  @nn.compact
  def __call__(self, x):
    for i in range(2):
      x = jax.nn.gelu(tfx.DenseGeneral(self.hidden, use_bias=True, name=f"dense{i}")(x))
    return tfx.DenseGeneral(self.classes, use_bias=True, name="logits")(x)


def train(fp8_recipe, x, labels, steps):
  model = Classifier()

  def loss_fn(variables, x, labels):
    logits = model.apply(variables, x).astype(jnp.float32)
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
    return loss, jnp.mean(jnp.argmax(logits, -1) == labels)

  # The recipe is read while tracing, so init and the first step run inside.
  with te_jax.fp8_autocast(enabled=fp8_recipe is not None, fp8_recipe=fp8_recipe):
    variables = model.init(jax.random.PRNGKey(0), x)
    state = train_state.TrainState.create(apply_fn=model.apply, params=variables,
                                          tx=optax.adam(3e-3))

    @jax.jit
    def step(state, x, labels):  # data as arguments: XLA would constant-fold it
      (loss, acc), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params, x, labels)
      return state.apply_gradients(grads=grads), loss, acc

    log = []
    for i in range(steps):
      state, loss, acc = step(state, x, labels)
      if i % (steps // 4) == 0 or i == steps - 1:
        log.append(f"{i}:{float(loss):.3f}")
  return log, float(loss), float(acc)


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--steps", type=int, default=200)
  args = parser.parse_args()
  x, labels = spirals()
  print(f"te_jax {te_jax.__version__} on {jax.default_backend()}; "
        f"{x.shape[0]} points, {args.steps} steps")
  recipes = {"bf16 (FP8 off)": None,
             "DelayedScaling": recipe.DelayedScaling(amax_history_len=16),
             "Float8CurrentScaling": recipe.Float8CurrentScaling(),
             "Float8BlockScaling": recipe.Float8BlockScaling()}
  for name, r in recipes.items():
    t0 = time.perf_counter()
    log, loss, acc = train(r, x, labels, args.steps)
    print(f"{name:22s} loss {' -> '.join(log)}  final acc {acc:.3f}  "
          f"({time.perf_counter() - t0:.1f} s)")


if __name__ == "__main__":
  main()
