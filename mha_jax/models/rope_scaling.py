"""RoPE variants of the decoder families: the frequencies of scaled RoPE.

A RoPE setting is a plain dict (what an imported model's config.json stores per layer):

  {"type": "default" | "linear" | "llama3" | "yarn" | "dynamic" | "longrope",
   "base": float, "dim": int (rotated features per head), and the type's own numbers}

  linear  theta_i / factor (position interpolation; Chen et al. 2023).
  llama3  Llama 3.1: low frequencies divided by factor, high ones kept, a smooth ramp
          between (factor, low_freq_factor, high_freq_factor,
          original_max_position_embeddings).
  yarn    YaRN (Peng et al. 2023): per-frequency blend of interpolated and extrapolated
          theta_i, and cos/sin scaled by attention_factor (factor, beta_fast, beta_slow,
          original_max_position_embeddings, attention_factor or mscale/mscale_all_dim,
          truncate).
  dynamic NTK-aware dynamic scaling: the base grows with the call's length L past
          max_position_embeddings L0 (factor, max_position_embeddings); computed per
          call inside attention.apply_rope (RoPE.dynamic_factor).
  longrope LongRoPE (Phi-3): theta_i / short_factor_i while L <= L0, theta_i /
          long_factor_i past it, cos/sin scaled by attention_factor (short_factor,
          long_factor, original_max_position_embeddings L0, factor, attention_factor).

The formulas follow transformers' modeling_rope_utils (the reference the parity tests
compare against); the static ones are computed in float64 and rounded to float32 once.
transformers keeps a dynamic model's longest length seen between calls (its state);
here a call's frequencies depend on that call's positions only, which is what
transformers gives on a fresh model and in one generate (lengths only grow there).
"""

from __future__ import annotations

import math

import numpy as np

from mha_jax import attention

TYPES = ("default", "linear", "llama3", "yarn", "dynamic", "longrope")   # the numbers each reads: the docstring


def _base_inv_freq(base: float, dim: int) -> np.ndarray:
  return 1.0 / float(base) ** (np.arange(0, dim, 2, dtype=np.float64) / dim)


def inv_freq_and_factor(setting: dict) -> tuple[np.ndarray, float]:
  """(the dim / 2 frequencies theta_i, the cos/sin attention factor) of a RoPE setting."""
  kind = setting.get("type", "default")
  if kind not in TYPES:
    raise ValueError(f"RoPE type must be one of {TYPES}; got {kind!r}")
  base, dim = float(setting["base"]), int(setting["dim"])
  inv = _base_inv_freq(base, dim)
  if kind in ("default", "dynamic"):   # dynamic: the base frequencies up to L0
    return inv, 1.0
  factor = float(setting["factor"])
  if kind == "longrope":
    old = float(setting["original_max_position_embeddings"])
    att = setting.get("attention_factor")
    if att is None:
      att = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(old))
    return inv / np.asarray(setting["short_factor"], np.float64), float(att)
  if kind == "linear":
    return inv / factor, 1.0
  if kind == "llama3":
    low, high = float(setting["low_freq_factor"]), float(setting["high_freq_factor"])
    old = float(setting["original_max_position_embeddings"])
    low_wl, high_wl = old / low, old / high
    wavelen = 2 * math.pi / inv
    out = np.where(wavelen > low_wl, inv / factor, inv)
    smooth = (old / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * out / factor + smooth * out
    medium = ~(wavelen < high_wl) & ~(wavelen > low_wl)
    return np.where(medium, smoothed, out), 1.0
  # yarn
  old = float(setting["original_max_position_embeddings"])
  att = setting.get("attention_factor")
  mscale, mscale_all = setting.get("mscale"), setting.get("mscale_all_dim")

  def get_mscale(scale, m=1.0):
    return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

  if att is None:
    att = (get_mscale(factor, mscale) / get_mscale(factor, mscale_all)
           if mscale and mscale_all else get_mscale(factor))
  beta_fast = setting.get("beta_fast") or 32
  beta_slow = setting.get("beta_slow") or 1

  def corr_dim(rot):
    return dim * math.log(old / (rot * 2 * math.pi)) / (2 * math.log(base))

  lo, hi = corr_dim(beta_fast), corr_dim(beta_slow)
  if setting.get("truncate", True):
    lo, hi = math.floor(lo), math.ceil(hi)
  lo, hi = max(lo, 0), min(hi, dim - 1)
  if lo == hi:
    hi += 0.001
  ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - lo) / (hi - lo), 0, 1)
  extra = 1 - ramp
  inv = (inv / factor) * (1 - extra) + inv * extra
  return inv, float(att)


def make_rope(setting: dict | None, layout: str = "half") -> attention.RoPE | None:
  """The attention.RoPE of a setting dict (None: no RoPE)."""
  if setting is None:
    return None
  kind = setting.get("type", "default")
  dim = int(setting["dim"])
  if kind == "default":
    return attention.RoPE(base=float(setting["base"]), layout=layout, dim=dim)
  if kind == "dynamic":
    return attention.RoPE(base=float(setting["base"]), layout=layout, dim=dim,
                          dynamic_factor=float(setting["factor"]),
                          max_positions=int(setting["max_position_embeddings"]))
  inv, att = inv_freq_and_factor(setting)
  as_f32 = lambda a: tuple(float(x) for x in np.float32(a))   # noqa: E731
  extra = {}
  if kind == "longrope":
    long = _base_inv_freq(float(setting["base"]), dim) / np.asarray(setting["long_factor"],
                                                                    np.float64)
    extra = dict(long_inv_freq=as_f32(long),
                 max_positions=int(setting["original_max_position_embeddings"]))
  return attention.RoPE(base=float(setting["base"]), layout=layout, dim=dim,
                        inv_freq=as_f32(inv), attention_factor=float(att), **extra)
