"""CUDA custom-call path of ``ops/concat_quantize.py`` (FFI handlers in
``custom_calls/ffi/concat_quantize.cc``).

One call reads the parts and writes both FP8 copies of their concatenation
plus the scales; the concatenation itself never reaches memory. Blockwise
scales come back in the LOGICAL layout through the layout's ``from_native``
(``tiling.py``), as in ``quantize_cuda.py``. Argument checks live in ``concat_quantize.py``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from te_jax.ops import quantize_cuda
from te_jax.ops import tiling
from te_jax.ops.fp8 import QuantizedTensor, nan_scale_inv_if_non_finite

__all__ = ["concat_quantize"]

_F32 = jnp.float32


def _sds(shape, dtype):
  return jax.ShapeDtypeStruct(shape, jnp.dtype(dtype))


def concat_quantize(parts, mode: str, dtype, scale, power_2_scale: bool):
  """The ``QuantizedTensor`` of the concatenation of the (M, F_i) ``parts``
  along their last dim; see ``concat_quantize.concat_quantize``."""
  m = parts[0].shape[0]
  w = sum(p.shape[1] for p in parts)
  fp8 = (_sds((m, w), dtype), _sds((w, m), dtype))
  if mode == "tensorwise":
    data, data_t, scale_inv, amax = jax.ffi.ffi_call(
        "te_jax_concat_quantize_tensorwise", fp8 + (_sds((), _F32), _sds((), _F32)))(
            jnp.asarray(scale, _F32), *parts)
    return nan_scale_inv_if_non_finite(
        QuantizedTensor(data, scale_inv, data_t, scale_inv, amax))
  if mode == "current":
    data, data_t, scale_inv, amax = jax.ffi.ffi_call(
        "te_jax_concat_quantize_current", fp8 + (_sds((), _F32), _sds((), _F32)))(*parts)
    return QuantizedTensor(data, scale_inv, data_t, scale_inv, amax)
  layout = tiling.mode_layout(mode)
  s_out, st_out = quantize_cuda.blockwise_scale_outputs(m, w, layout, True)
  data, s, data_t, st = jax.ffi.ffi_call(
      "te_jax_concat_quantize_blockwise", (fp8[0], s_out, fp8[1], st_out))(
          *parts, power_2_scale=np.int64(bool(power_2_scale)))
  return quantize_cuda.blockwise_result(data, s, data_t, st, m, w, layout)
