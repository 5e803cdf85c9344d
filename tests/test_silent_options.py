"""Issue 44 items 12 and 13: both frameworks refuse the same options and inputs.

* Item 12: the Linen modules took options their NNX twins refuse -- dropout
  rates of 1.5 (an all-zero output), ``num_gqa_groups=0`` (silently plain
  multi-head attention), ``num_attention_heads=0`` (ZeroDivisionError), and
  with them ``head_dim=0`` / ``out_features=0`` (silently the default),
  ``mlp_hidden_size=0``, ``features=0`` (an empty output). One check per
  module in ``te_jax.layers.checks``, called by both, names the argument and
  its range.
* Item 13: a 0-D input to the norm layers gave ``IndexError: tuple index
  out of range``; ``segment_ids`` (or ``mask``) as a nested Python list
  passed the check and failed deep inside ("list indices must be
  integers"). Both are refused where they come in, naming the fix.
"""

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from te_jax import flax as tfx
from te_jax import nnx as tnx

X = jnp.ones((2, 8, 32))
KEY = jax.random.PRNGKey(0)
RANGE = {"int": "must be an int >= 1", "rate": r"must be a number in \[0, 1\)"}


def _linen(cls, *args, **kw):
  return lambda x=X: cls(*args, **kw).init(KEY, x)


def _nnx(cls, *args, **kw):
  return lambda x=X: cls(*args, **kw, rngs=nnx.Rngs(0))(x)


# (option, value, range kind, Linen call, NNX call): the same value given to
# the twins.
OPTIONS = [
    ("num_attention_heads", 0, "int", lambda v: _linen(tfx.MultiHeadAttention, v),
     lambda v: _nnx(tnx.MultiHeadAttention, v, 32)),
    ("num_gqa_groups", 0, "int", lambda v: _linen(tfx.MultiHeadAttention, 4, num_gqa_groups=v),
     lambda v: _nnx(tnx.MultiHeadAttention, 4, 32, num_gqa_groups=v)),
    ("head_dim", 0, "int", lambda v: _linen(tfx.MultiHeadAttention, 4, head_dim=v),
     lambda v: _nnx(tnx.MultiHeadAttention, 4, 32, head_dim=v)),
    ("out_features", 0, "int", lambda v: _linen(tfx.MultiHeadAttention, 4, out_features=v),
     lambda v: _nnx(tnx.MultiHeadAttention, 4, 32, out_features=v)),
    ("attention_dropout", 1.5, "rate",
     lambda v: _linen(tfx.MultiHeadAttention, 4, attention_dropout=v),
     lambda v: _nnx(tnx.MultiHeadAttention, 4, 32, attention_dropout=v)),
    ("intermediate_dim", 0, "int", lambda v: _linen(tfx.LayerNormMLP, v),
     lambda v: _nnx(tnx.LayerNormMLP, 32, v)),
    ("intermediate_dropout_rate", 1.5, "rate",
     lambda v: _linen(tfx.LayerNormMLP, 64, intermediate_dropout_rate=v),
     lambda v: _nnx(tnx.LayerNormMLP, 32, 64, intermediate_dropout_rate=v)),
    ("mlp_hidden_size", 0, "int", lambda v: _linen(tfx.TransformerLayer, 32, v, 4),
     lambda v: _nnx(tnx.TransformerLayer, 32, v, 4)),
    ("hidden_dropout", 1.5, "rate",
     lambda v: _linen(tfx.TransformerLayer, 32, 64, 4, hidden_dropout=v),
     lambda v: _nnx(tnx.TransformerLayer, 32, 64, 4, hidden_dropout=v)),
    ("intermediate_dropout", -0.1, "rate",
     lambda v: _linen(tfx.TransformerLayer, 32, 64, 4, intermediate_dropout=v),
     lambda v: _nnx(tnx.TransformerLayer, 32, 64, 4, intermediate_dropout=v)),
    ("attention_dropout", 1.0, "rate",
     lambda v: _linen(tfx.TransformerLayer, 32, 64, 4, attention_dropout=v),
     lambda v: _nnx(tnx.TransformerLayer, 32, 64, 4, attention_dropout=v)),
    ("num_attention_heads", 0, "int", lambda v: _linen(tfx.TransformerLayer, 32, 64, v),
     lambda v: _nnx(tnx.TransformerLayer, 32, 64, v)),
]


@pytest.mark.parametrize("framework", ["linen", "nnx"])
@pytest.mark.parametrize("option,value,kind,linen,nnx_call", OPTIONS,
                         ids=[f"{o[0]}={o[1]}-{i}" for i, o in enumerate(OPTIONS)])
def test_both_frameworks_refuse_the_option_naming_its_range(framework, option, value, kind,
                                                           linen, nnx_call):
  build = linen if framework == "linen" else nnx_call
  with pytest.raises(ValueError, match=f"{option} {RANGE[kind]}"):
    build(value)()


def test_linen_dense_refuses_zero_features():
  with pytest.raises(ValueError, match="features must be a positive int"):
    _linen(tfx.DenseGeneral, 0)()
  with pytest.raises(ValueError, match="features must be a positive int"):
    _linen(tfx.LayerNormDenseGeneral, (4, 0))()


def test_valid_options_still_run_in_both():
  _linen(tfx.MultiHeadAttention, 4, num_gqa_groups=2, head_dim=8, out_features=16,
         attention_dropout=0.5)()
  _nnx(tnx.MultiHeadAttention, 4, 32, num_gqa_groups=2, head_dim=8, out_features=16,
       attention_dropout=0.5)()


# ----------------------------------------------------------- item 13 ----

SCALAR = jnp.float32(1.0)
ZERO_D = [
    ("LayerNormMLP", _linen(tfx.LayerNormMLP, 64), _nnx(tnx.LayerNormMLP, 32, 64)),
    ("LayerNormDenseGeneral", _linen(tfx.LayerNormDenseGeneral, 16),
     _nnx(tnx.LayerNormLinear, 32, 16)),
    ("LayerNorm", _linen(tfx.LayerNorm), _nnx(tnx.LayerNorm, 32)),
    ("RMSNorm", _linen(tfx.RMSNorm), _nnx(tnx.RMSNorm, 32)),
    ("DenseGeneral", _linen(tfx.DenseGeneral, 16), _nnx(tnx.Linear, 32, 16)),
]


@pytest.mark.parametrize("framework", ["linen", "nnx"])
@pytest.mark.parametrize("name,linen,nnx_call", ZERO_D, ids=[z[0] for z in ZERO_D])
def test_zero_d_input_is_a_clear_value_error(framework, name, linen, nnx_call):
  call = linen if framework == "linen" else nnx_call
  with pytest.raises(ValueError, match=r"at least 1 dim|out of range for an input of rank 0"):
    call(SCALAR)
  assert name


@pytest.mark.parametrize("arg", ["segment_ids", "mask"])
@pytest.mark.parametrize("framework", ["linen", "nnx"])
def test_nested_list_segment_ids_or_mask_names_jnp_asarray(framework, arg):
  value = [[1] * 8, [1] * 8] if arg == "segment_ids" else [[[[True] * 8] * 8]]
  with pytest.raises(TypeError, match=rf"{arg} must be an array.*jnp.asarray\({arg}\)"):
    if framework == "linen" and arg == "segment_ids":
      tfx.TransformerLayer(32, 64, 4).init(KEY, X, segment_ids=value)
    elif framework == "linen":
      tfx.MultiHeadAttention(4).init(KEY, X, mask=value)
    elif arg == "segment_ids":
      tnx.TransformerLayer(32, 64, 4, rngs=nnx.Rngs(0))(X, segment_ids=value)
    else:
      tnx.MultiHeadAttention(4, 32, rngs=nnx.Rngs(0))(X, mask=value)
