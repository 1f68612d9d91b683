"""Lines 6 and 7 of the seven, o_BTD = merge_heads(o_BTHK); y_BTD = o_BTD @ W_O: the
heads' outputs, gated, concatenated and mixed by W_O.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from mha_jax.attention.params import Call, Params
from mha_jax.blocks import linear, merge_heads


class AttentionOutput(NamedTuple):
  """What ``multi_head_attention(..., return_weights=True)`` returns.

  out: (B, T, D) the layer's output.
  weights: (B, H, T, S) float32 attention weights (rows sum to 1, or 0 when fully
    masked; by variant: sigmoid weights, the keys' share beside the sink, or
    differential attention's first map).
  heads: (B, T, H, K) each head's output after its gate, the input of W_O.
  """
  out: jax.Array
  weights: jax.Array
  heads: jax.Array


def output(params: Params, x: jax.Array, o_BTHK, gate_BTHK, c: Call, site):
  """(y (B, T, D), the heads (B, T, H, K) that W_O reads): the variant's gate, head
  gates, the z and result sites, W_O and bo."""
  h, d = c.h, c.d
  k = o_BTHK.shape[-1]     # V, the value heads' width
  if c.variant.gate is not None:
    gate = c.variant.gate(params, x, gate_BTHK)
    if site is not None:
      gate = site("gate", gate)
    gate = gate if gate.ndim == o_BTHK.ndim else gate[..., None]
    o_BTHK = o_BTHK * gate.astype(o_BTHK.dtype)
  if c.gates is not None:
    o_BTHK = o_BTHK * c.gates.astype(o_BTHK.dtype)
  if site is not None:
    o_BTHK = site("z", o_BTHK)
  if site is not None and site.wants("result"):
    r_BTHD = jnp.einsum("bthk,hkd->bthd", o_BTHK, params["wo"].astype(o_BTHK.dtype))
    y_BTD = site("result", r_BTHD).sum(axis=2)
  else:
    y_BTD = linear(merge_heads(o_BTHK), params["wo"].reshape(h * k, d))
  if "bo" in params:
    y_BTD = y_BTD + params["bo"].astype(y_BTD.dtype)
  return y_BTD, o_BTHK


def zero_heads(params: Params, x: jax.Array, c: Call, site, return_weights: bool):
  """Every head pruned: the layer adds only its output bias."""
  b, t, s, d, k = c.b, c.t, c.s, c.d, params["wv"].shape[2]
  out = jnp.zeros((b, t, d), x.dtype) + params.get("bo", jnp.zeros((d,), x.dtype))
  if site is not None:
    for name, shape in (("pattern", (b, 0, t, s)), ("z", (b, t, 0, k))):
      if site.wants(name):
        site(name, jnp.zeros(shape, jnp.float32 if name == "pattern" else x.dtype))
  if return_weights:
    return AttentionOutput(out, jnp.zeros((b, 0, t, s), jnp.float32),
                           jnp.zeros((b, t, 0, k), x.dtype))
  return out
