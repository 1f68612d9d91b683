"""BERT encoder (all-MiniLM, bert-base layout): post-LN, learned positions, token types.

params = {
  "embed": (V, D), "pos_embed": (P, D), "type_embed": (N_types, D), "ln_embed": {"scale", "bias"},
  "encoder": {"layer_{i}": {"self_attn": {"wq", "wk", "wv": (D, H, K), "bq", "bk", "bv": (H, K),
                                          "wo": (H, K, D), "bo": (D,)},
                            "ln1": {...}, "mlp": {"w1": (D, F), "b1", "w2": (F, D), "b2"},
                            "ln2": {...}}},
}
Each layer: x = LN1(x + attn(x)); x = LN2(x + W2 gelu(x W1 + b1) + b2), GELU exact (erf).
Padding keys are masked; the output is the last hidden states (B, T, D).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from mha_jax.errors import UserError
from mha_jax import attention
from mha_jax import interventions
from mha_jax.models import common


@dataclasses.dataclass(frozen=True)
class BertSpec:
  norm_eps: float = 1e-12
  impl: str = "auto"


def mlp(p, x):
  return jax.nn.gelu(x @ p["w1"] + p["b1"], approximate=False) @ p["w2"] + p["b2"]


def init(key, *, vocab_size: int, d_model: int, num_heads: int, num_layers: int, d_ff: int,
         max_len: int = 512, type_vocab_size: int = 2) -> dict:
  """Fresh params (random; the real ones come from mha_jax.pretrained)."""
  keys = iter(jax.random.split(key, 3 + 2 * num_layers))
  layers = {}
  for i in range(num_layers):
    layers[f"layer_{i}"] = {
        "self_attn": attention.init_attention_params(next(keys), d_model, num_heads,
                                                     use_bias=True),
        "ln1": common.init_layer_norm(d_model), "mlp": common.init_mlp(next(keys), d_model, d_ff),
        "ln2": common.init_layer_norm(d_model)}
  return {"embed": jax.random.normal(next(keys), (vocab_size, d_model)) * 0.02,
          "pos_embed": jax.random.normal(next(keys), (max_len, d_model)) * 0.02,
          "type_embed": jax.random.normal(next(keys), (type_vocab_size, d_model)) * 0.02,
          "ln_embed": common.init_layer_norm(d_model), "encoder": layers}


def apply(params, spec: BertSpec, tokens_BT, *, mask_BT=None, token_types_BT=None,
          gates=None, capture=False, hook=None):
  """Last hidden states (B, T, D); with capture=True also {"encoder": [AttentionOutput]}.

  hook: an interventions.Hook (sites encoder.{i}.attn.*, encoder.{i}.{resid_pre,
  attn_out, resid_mid, mlp_out, resid_post}, the latter two after the post-norms);
  gates and capture are uses of it.

  mask_BT: True for real tokens (default: all); padding keys get zero weight.
  token_types_BT: segment ids (default 0).
  gates: {"encoder": [(H,) or (B, H) per layer]}.
  """
  b, t = tokens_BT.shape
  if t > params["pos_embed"].shape[0]:
    raise UserError(f"sequence length {t} exceeds the model's {params['pos_embed'].shape[0]} "
                     f"positions")
  types = jnp.zeros_like(tokens_BT) if token_types_BT is None else token_types_BT
  x = params["embed"][tokens_BT] + params["pos_embed"][:t][None] + params["type_embed"][types]
  x = common.layer_norm(params["ln_embed"], x, spec.norm_eps)
  key_mask = None if mask_BT is None else jnp.asarray(mask_BT, bool)[:, None, None, :]
  hook = interventions.model_hook(hook, gates, capture, stacks=("encoder",))
  layers = common.layers_of(params["encoder"])
  for i, name in enumerate(layers):
    p = params["encoder"][name]
    s = f"encoder.{i}"
    x = interventions.at(hook, f"{s}.resid_pre", x)
    a = attention.multi_head_attention(p["self_attn"], x, mask=key_mask, impl=spec.impl,
                                       site=interventions.scope(hook, f"{s}.attn"))
    a = interventions.at(hook, f"{s}.attn_out", a)
    x = interventions.at(hook, f"{s}.resid_mid", common.layer_norm(p["ln1"], x + a, spec.norm_eps))
    m = interventions.at(hook, f"{s}.mlp_out", mlp(p["mlp"], x))
    x = interventions.at(hook, f"{s}.resid_post", common.layer_norm(p["ln2"], x + m, spec.norm_eps))
  if capture:
    return x, {"encoder": interventions.captured(hook, "encoder", len(layers), attention.AttentionOutput)}
  return x


def mean_pool(hidden_BTD, mask_BT=None, *, normalize: bool = False):
  """Mean of the real tokens' hidden states (B, D) (sentence-transformers' pooling);
  normalize=True divides by the L2 norm, as all-MiniLM-L6-v2's last module does."""
  if mask_BT is None:
    pooled = hidden_BTD.mean(axis=1)
  else:
    m = jnp.asarray(mask_BT, hidden_BTD.dtype)[..., None]
    pooled = (hidden_BTD * m).sum(1) / jnp.maximum(m.sum(1), 1e-9)
  if normalize:
    pooled = pooled / jnp.maximum(jnp.linalg.norm(pooled, axis=-1, keepdims=True), 1e-12)
  return pooled
