"""The MoE layer's programs do not grow with the number of experts (issue 47).

Compile time follows program size, so a Python loop over experts (or over
groups) that unrolls into the traced program makes a layer of 64 experts
take tens of seconds to compile where 4 take one. These tests lower the
programs for two expert counts and compare their StableHLO op counts, which
are exact and machine-independent (a wall-clock bound would be neither).

Sizes are chosen so that no two initializers see the same shape (router
(H, E), expert branches (H, F) and (F, H), shared (H, FS) and (FS, H) with
E in EXPERT_COUNTS and H, F, FS distinct): JAX emits one function for
same-shaped initializer calls, which would change the count for a reason
that has nothing to do with unrolling.
"""

import collections
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import te_jax
from te_jax import flax as tfx, moe, nnx as tnx, recipe
from te_jax.layers import moe as moe_core
from te_jax.layers.init import default_kernel_init, gated_kernel_init

EXPERT_COUNTS = (4, 16)
H, F, FS, K = 64, 32, 48, 2
RECIPES = {"off": None, "delayed": recipe.DelayedScaling(amax_history_len=4),
           "blockwise": recipe.Float8BlockScaling()}
_OP = re.compile(r"\b((?:stablehlo|chlo|func)\.[a-z_]+)")


def op_counts(lowered) -> collections.Counter:
  """{op name: count} of a lowered program's StableHLO text."""
  return collections.Counter(_OP.findall(lowered.as_text()))


def _linen(num_experts):
  return tfx.MoE(num_experts=num_experts, num_experts_per_token=K, intermediate_dim=F,
                 shared_intermediate_dim=FS, dtype=jnp.bfloat16, impl="reference")


def _autocast(r):
  return te_jax.fp8_autocast(enabled=r is not None, fp8_recipe=r)


def test_expert_kernel_init_is_each_experts_init_with_its_own_key():
  init = gated_kernel_init(default_kernel_init)
  key, shape = jax.random.key(3), (5, 16, 2, 8)
  got = moe_core.expert_kernel_init(init)(key, shape)
  want = [init(k, shape[1:]) for k in jax.random.split(key, shape[0])]
  np.testing.assert_array_equal(np.asarray(got), np.stack([np.asarray(w) for w in want]))


def test_expert_kernel_init_program_does_not_grow_with_num_experts():
  init = moe_core.expert_kernel_init(gated_kernel_init(default_kernel_init))
  counts = [op_counts(jax.jit(init, static_argnums=1).lower(jax.random.key(0), (e, H, 2, F)))
            for e in EXPERT_COUNTS]
  assert counts[0] == counts[1], (counts[0] - counts[1]) + (counts[1] - counts[0])


def test_linen_init_program_does_not_grow_with_num_experts():
  x = jax.ShapeDtypeStruct((2, 24, H), jnp.bfloat16)
  counts = [op_counts(jax.jit(_linen(e).init).lower(jax.random.key(0), x))
            for e in EXPERT_COUNTS]
  assert counts[0] == counts[1], counts[1] - counts[0]


def test_nnx_init_program_does_not_grow_with_num_experts():
  def init(e):
    return lambda key: nnx.state(tnx.MoE(H, e, K, F, shared_intermediate_dim=FS,
                                         rngs=nnx.Rngs(params=key)))
  counts = [op_counts(jax.jit(init(e)).lower(jax.random.key(0))) for e in EXPERT_COUNTS]
  assert counts[0] == counts[1], counts[1] - counts[0]


@pytest.mark.parametrize("name", list(RECIPES))
def test_linen_training_step_does_not_grow_with_num_experts(name):
  """Forward + backward with the FP8 state: routing, dispatch, the grouped
  GEMMs (a loop over groups on the device, not in the program), combine."""
  r = RECIPES[name]
  x = jax.ShapeDtypeStruct((2, 24, H), jnp.bfloat16)
  counts = []
  for e in EXPERT_COUNTS:
    module = _linen(e)
    with _autocast(r):
      variables = jax.eval_shape(module.init, jax.random.key(0), x)

      def loss(v, x, module=module):
        y, st = module.apply(v, x, mutable=["intermediates"])
        return jnp.sum(y.astype(jnp.float32)) + moe.aux_totals(st)["aux_loss"]
      counts.append(op_counts(jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
                              .lower(variables, x)))
  assert counts[0] == counts[1], (counts[0] - counts[1]) + (counts[1] - counts[0])
