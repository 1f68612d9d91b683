"""Flax linen layer that owns attention params and calls `attention.multi_head_attention`.

Linen is used because its variables are plain nested dicts: a checkpoint's
`params` is exactly the pytree the pure functions take, with no module state to
thread through analysis code.
"""

from __future__ import annotations

from typing import Any, Mapping

import flax.linen as nn
import jax
import jax.numpy as jnp

from mha_jax.errors import UserError
from mha_jax import attention

_FLAX_NAMES = {"query": ("wq", "bq"), "key": ("wk", "bk"), "value": ("wv", "bv"),
               "out": ("wo", "bo")}


class MultiHeadAttention(nn.Module):
  """Multi-head attention with params {wq: (D, H, K); wk, wv: (D, G, K); wo: (H, K, D);
  biases}.

  Attributes:
    num_heads: H, the query heads.
    head_dim: K; default D // H (D read from the input).
    use_bias: add bq (H, K), bk, bv (G, K) and bo (D,).
    impl: kernel choice, see `attention.multi_head_attention`.
    param_dtype: dtype of the params.
    num_kv_heads: G key/value heads dividing H (grouped-query attention); None = H.
    rope: an attention.RoPE to rotate q and k by position; None = no rotation.
  """
  num_heads: int
  head_dim: int | None = None
  use_bias: bool = False
  impl: str = "auto"
  param_dtype: Any = jnp.float32
  num_kv_heads: int | None = None
  rope: attention.RoPE | None = None

  @nn.compact
  def __call__(self, x_BTD, context_BSD=None, *, mask=None, causal=False,
               head_gates=None, return_weights=False, positions=None):
    d = x_BTD.shape[-1]
    if self.head_dim is None and (self.num_heads < 1 or d % self.num_heads):
      raise UserError(f"num_heads={self.num_heads} does not divide d_model={d}")
    g = self.num_heads if self.num_kv_heads is None else self.num_kv_heads
    if g < 1 or self.num_heads % g:
      raise UserError(f"num_kv_heads={self.num_kv_heads} does not divide "
                       f"num_heads={self.num_heads}")
    k = self.head_dim or d // self.num_heads
    shapes = attention.param_shapes(d, self.num_heads, k, g)
    names = attention.WEIGHT_KEYS + (attention.BIAS_KEYS if self.use_bias else ())
    params = {n: self.param(n, attention.PARAM_INITS[n], shapes[n], self.param_dtype)
              for n in names}
    return attention.multi_head_attention(
        params, x_BTD, context_BSD, mask=mask, causal=causal, head_gates=head_gates,
        impl=self.impl, return_weights=return_weights, rope=self.rope, positions=positions)


def from_flax_linen(flax_params: Mapping[str, Any]) -> dict[str, jax.Array]:
  """`flax.linen.MultiHeadDotProductAttention` params -> this project's layout.

  Accepts the module's `params` collection ({"query": {"kernel", "bias"}, ...}), or a
  variables dict holding it under "params". Works for `flax.nnx.MultiHeadAttention`'s
  state converted to a pure dict too, which uses the same names and shapes.
  """
  if "params" in flax_params and "query" not in flax_params:
    flax_params = flax_params["params"]
  missing = [n for n in _FLAX_NAMES if n not in flax_params]
  if missing:
    raise UserError(f"flax_params is missing {missing}; got keys {sorted(flax_params)}")
  out = {}
  for flax_name, (w_name, b_name) in _FLAX_NAMES.items():
    sub = flax_params[flax_name]
    out[w_name] = jnp.asarray(sub["kernel"])
    if "bias" in sub:
      out[b_name] = jnp.asarray(sub["bias"])
  has_bias = [b for b in attention.BIAS_KEYS if b in out]
  if has_bias and len(has_bias) != 4:
    raise UserError(f"flax_params has biases for {has_bias} only; expected all or none")
  attention.check_attention_params(out)
  return out


def to_flax_linen(params: Mapping[str, jax.Array]) -> dict[str, dict[str, jax.Array]]:
  """This project's layout -> `flax.linen.MultiHeadDotProductAttention` params.

  The Flax module must be built with `use_bias` matching whether `params` has biases.
  """
  _, h, _ = attention.check_attention_params(params)
  if attention.num_kv_heads_of(params) != h:
    raise UserError(f"params has {attention.num_kv_heads_of(params)} key/value heads for "
                     f"{h} query heads (grouped-query attention), which "
                     f"flax.linen.MultiHeadDotProductAttention cannot express")
  if attention.REL_BIAS in params:
    raise UserError("params has 'rel_bias' (relative positions), which "
                     "flax.linen.MultiHeadDotProductAttention has no place for")
  out = {}
  for flax_name, (w_name, b_name) in _FLAX_NAMES.items():
    out[flax_name] = {"kernel": params[w_name]}
    if b_name in params:
      out[flax_name]["bias"] = params[b_name]
  return out
