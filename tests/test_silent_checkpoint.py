"""Issue 44 item 11: the ``.npz`` checkpoint backend checks key paths.

``te_jax.checkpoint`` with ``backend="numpy"`` (and ``backend="auto"`` where
orbax is missing) stored leaf i as ``leaf_i`` and restored by position: a
model changed to the same shapes under other names silently got each
layer's weights in another layer. The key paths are now stored and checked;
a checkpoint written before that restores by position with a warning.
"""

import json
import os

import jax.numpy as jnp
import numpy as np
import pytest

from te_jax import checkpoint


def _tree(a_name="encoder", b_name="decoder"):
  return {"params": {a_name: {"kernel": jnp.full((4, 4), 1.0)},
                     b_name: {"kernel": jnp.full((4, 4), 2.0)}},
          "step": jnp.int32(3)}


def test_same_names_restore(tmp_path):
  checkpoint.save(tmp_path, 1, _tree(), backend="numpy")
  got = checkpoint.restore(tmp_path, 1, target=_tree(), backend="numpy")
  np.testing.assert_array_equal(got["params"]["decoder"]["kernel"], 2.0)


def test_renamed_layers_of_the_same_shape_are_refused_by_name(tmp_path):
  checkpoint.save(tmp_path, 1, _tree(), backend="numpy")
  # Same leaf count, shapes and dtypes: restoring by position would put the
  # encoder's weights into "attn" silently.
  with pytest.raises(ValueError) as e:
    checkpoint.restore(tmp_path, 1, target=_tree("attn", "mlp"), backend="numpy")
  msg = str(e.value)
  assert "params/encoder/kernel" in msg and "params/attn/kernel" in msg
  assert "only in the checkpoint" in msg and "only in the target" in msg


def test_a_leaf_count_change_names_the_missing_paths(tmp_path):
  checkpoint.save(tmp_path, 1, _tree(), backend="numpy")
  target = _tree()
  target["params"]["extra"] = {"bias": jnp.zeros(4)}
  with pytest.raises(ValueError, match="params/extra/bias"):
    checkpoint.restore(tmp_path, 1, target=target, backend="numpy")


def test_checkpoint_without_paths_restores_by_position_with_a_warning(tmp_path):
  path = checkpoint.save(tmp_path, 1, _tree(), backend="numpy")
  meta_file = os.path.join(path, "te_jax_meta.json")
  with open(meta_file) as fh:
    meta = json.load(fh)
  del meta["paths"]                      # the format written before the paths
  with open(meta_file, "w") as fh:
    json.dump(meta, fh)
  with pytest.warns(UserWarning, match="by position only"):
    got = checkpoint.restore(tmp_path, 1, target=_tree(), backend="numpy")
  np.testing.assert_array_equal(got["params"]["encoder"]["kernel"], 1.0)


def test_restore_refuses_an_unknown_backend(tmp_path):
  checkpoint.save(tmp_path, 1, _tree(), backend="numpy")
  with pytest.raises(ValueError, match="backend must be one of"):
    checkpoint.restore(tmp_path, 1, target=_tree(), backend="npz")


def test_restore_with_the_other_backend_named_says_which_wrote_it(tmp_path):
  # backend="orbax" on an npz checkpoint used to hand the npz directory to orbax.
  checkpoint.save(tmp_path, 1, _tree(), backend="numpy")
  with pytest.raises(ValueError, match="written by the numpy backend"):
    checkpoint.restore(tmp_path, 1, target=_tree(), backend="orbax")
