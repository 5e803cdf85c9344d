"""Issue 44, the sweep: more places where state or a cache was silently ignored.

* A Linen ``apply`` whose collections are all mutable (``mutable=True``, as
  to collect intermediates) on variables without FP8 state, under
  ``DelayedScaling``, created a fresh state inside the call: every step
  started over from scale 1 and nothing kept the state. Only ``init``
  creates it now; the ``apply`` raises the missing-state error.
* A ``MultiHeadAttention`` with ``decode=False`` given variables that hold
  its key/value cache ignored the cache (each call attended within its own
  input: a decode loop whose module lost ``decode=True`` produced tokens
  without their context). It warns once, naming both fixes.
"""

import warnings

import jax
import jax.numpy as jnp
import pytest

import te_jax
from te_jax import flax as tfx
from te_jax import recipe
from te_jax.flax import kv_cache

R = recipe.DelayedScaling(amax_history_len=4)
X = jax.random.normal(jax.random.PRNGKey(0), (2, 8, 32))


def test_apply_with_all_collections_mutable_does_not_create_fp8_state():
  layer = tfx.DenseGeneral(16)
  variables = layer.init(jax.random.PRNGKey(1), X)             # FP8 off: no state
  with te_jax.fp8_autocast(True, R):
    with pytest.raises(ValueError, match="init creates the state"):
      layer.apply(variables, X, mutable=True)
    # init still creates it, and an apply with it runs (mutable or not).
    variables = layer.init(jax.random.PRNGKey(1), X)
    layer.apply(variables, X, mutable=True)


def _decode_variables():
  mha = tfx.MultiHeadAttention(4, attention_impl="xla")
  return mha, mha.clone(decode=True).init(jax.random.PRNGKey(1), X)


def test_attention_given_a_cache_without_decode_warns_once(monkeypatch):
  monkeypatch.setattr(kv_cache, "_WARNED", set())
  mha, variables = _decode_variables()
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    mha.apply(variables, X[:, :1])
    mha.apply(variables, X[:, :2])
  msgs = [str(w.message) for w in caught if "key/value cache" in str(w.message)]
  assert len(msgs) == 1 and "decode=True" in msgs[0] and "'cache'" in msgs[0]


def test_attention_without_a_cache_is_quiet(monkeypatch):
  monkeypatch.setattr(kv_cache, "_WARNED", set())
  mha, variables = _decode_variables()
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    mha.apply({"params": variables["params"]}, X)
  assert not [w for w in caught if "key/value cache" in str(w.message)]
