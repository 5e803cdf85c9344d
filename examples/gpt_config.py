"""The settings of a ``train_gpt.py`` run: ``Config``, one field per flag.

A field left None takes the preset's value in :meth:`Config.resolved`, which
also checks the fields that must fit together (heads and key/value groups,
experts and the expert-parallel axis, sequence parallelism and ``--tp``).
Pure Python (no jax import), like ``gpt_presets.py`` it reads; ``train_gpt.py``
re-exports ``Config``, where the tests and benchmarks find it.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from gpt_presets import ALL_PRESETS, ARCHS, RECIPES

__all__ = ["Config"]


@dataclasses.dataclass
class Config:
  """A run's settings; ``None``: the preset's value (see :meth:`resolved`)."""
  recipe: str = "delayed"
  preset: str = "cpu"
  hidden: Optional[int] = None
  layers: Optional[int] = None
  heads: Optional[int] = None
  mlp: Optional[int] = None
  seq_len: Optional[int] = None
  batch: Optional[int] = None
  steps: Optional[int] = None
  lr_horizon: Optional[int] = None  # LR schedule length; None: --steps of the first run
  lr: Optional[float] = None
  warmup: Optional[int] = None
  dtype: Optional[str] = None
  arch: Optional[str] = None       # None: the preset's ("gpt" unless a Llama preset)
  kv_groups: Optional[int] = None  # None: the preset's, else = heads (no GQA)
  experts: Optional[int] = None    # routed experts per layer; 0: dense MLPs; None: preset's
  experts_per_token: Optional[int] = None
  shared_mlp: Optional[int] = None  # the shared expert's width; 0: none
  capacity_factor: Optional[float] = None  # None: dropless
  peak_tflops: Optional[float] = None  # for MFU; None: from the device kind
  weight_decay: float = 0.1
  amax_history_len: int = 16
  fsdp: int = -1                   # -1: every device not used by tp/dp
  tp: int = 1
  dp: int = 1
  ep: int = 1                      # expert-parallel mesh axis (splits the experts)
  sp: bool = False                 # sequence parallelism: tokens split over tp too
  seed: int = 0
  num_docs: Optional[int] = None
  remat: bool = False
  offload_optimizer: bool = False  # optimizer state in host memory (te_jax.offload)
  keep_fp8_copies: Optional[bool] = None  # fp8_autocast(keep_fp8_copies=): FP8 copies kept
                                   # for the backward (faster, more memory); None: the
                                   # preset's (on for llama)
  store_act_input_in_fp8: Optional[bool] = None  # fp8_autocast(store_act_input_in_fp8=):
                                   # the MLP's activation input kept in E4M3 (less memory);
                                   # None: the preset's (on for llama)
  doc_window: Optional[bool] = None  # attention only over a band as wide as the longest
                                   # document; None: the preset's (on for llama)
  ckpt_dir: Optional[str] = None
  ckpt_every: int = 0              # 0: only at the end
  resume: bool = False
  out_dir: Optional[str] = "runs/train_gpt"
  sample_chars: int = 80
  sample_tokens: int = 0           # KV-cache greedy sample after training (0: none)
  eval_batches: int = 2
  progress: bool = True
  log_every: int = 25

  def resolved(self) -> "Config":
    """This config with the preset's values in place of its None fields, checked.

    Raises ValueError naming the flag when a value is unknown or does not fit
    with another (the message says what would).
    """
    if self.preset not in ALL_PRESETS:
      raise ValueError(f"preset must be one of {sorted(ALL_PRESETS)}, got {self.preset!r}.")
    if self.recipe not in RECIPES:
      raise ValueError(f"recipe must be one of {RECIPES}, got {self.recipe!r}.")
    base = dict(ALL_PRESETS[self.preset])
    base.setdefault("arch", "gpt")
    base.setdefault("doc_window", False)
    base.setdefault("experts", 0)
    base.setdefault("keep_fp8_copies", False)
    base.setdefault("store_act_input_in_fp8", False)
    cfg = dataclasses.replace(
        self, **{k: v for k, v in base.items() if getattr(self, k) is None})
    if cfg.arch not in ARCHS:
      raise ValueError(f"arch must be one of {ARCHS}, got {cfg.arch!r}.")
    if cfg.kv_groups is not None and (cfg.kv_groups < 1 or cfg.heads % cfg.kv_groups):
      raise ValueError(f"--kv_groups {cfg.kv_groups} must divide --heads {cfg.heads} "
                       "(each key/value head serves heads / kv_groups query heads).")
    if cfg.experts:
      if not cfg.experts_per_token or not 1 <= cfg.experts_per_token <= cfg.experts:
        raise ValueError(f"--experts_per_token {cfg.experts_per_token} must be in 1 .. "
                         f"--experts {cfg.experts}.")
      if cfg.experts % cfg.ep:
        raise ValueError(f"--ep {cfg.ep} must divide --experts {cfg.experts} (each "
                         "expert-parallel device holds experts / ep experts).")
    elif cfg.ep != 1:
      raise ValueError(f"--ep {cfg.ep} needs a mixture of experts (--experts > 0, or "
                       "--preset moe / moe_tiny).")
    if cfg.sp and (cfg.tp < 2 or cfg.seq_len % cfg.tp):
      raise ValueError(f"--sp splits each row's {cfg.seq_len} tokens over --tp: it needs "
                       f"--tp >= 2 dividing --seq_len (got --tp {cfg.tp}).")
    return cfg
