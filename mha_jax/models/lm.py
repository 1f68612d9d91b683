"""Decoder-only language model; `attn_only=True` drops the MLPs (circuit studies).

params = {
  "embed": (V, D), "pos_embed": (max_len, D)  (when pos="learned"),
  "lm": {"layer_{i}": {"ln1", "attn", "ln2", "mlp"}, "ln_final"},
  "unembed": (D, V),
}
With layer_norm=False there are no ln* entries; with attn_only=True no "mlp".
"""

from __future__ import annotations

import jax

from mha_jax.errors import UserError
from mha_jax import attention
from mha_jax import interventions
from mha_jax.models import common
from mha_jax.models import decoder


def init(key, *, vocab_size: int, d_model: int, num_heads: int, head_dim: int = 0,
         num_layers: int, d_ff: int, max_len: int, layer_norm: bool = True,
         attn_only: bool = False, use_bias: bool = False, pos: str = "learned",
         max_rel: int = 16, variant: str = "softmax") -> dict:
  """pos: "learned" (added to the residual), "sinusoidal", "qk" (learned, added to the
  inputs of Q and K only), "qk_sinusoidal" (sinusoidal, Q and K only: Shortformer's
  position-infused attention, Press et al. 2021) or "relative" (no positions in the
  stream; each attention has a learned "rel_bias" (H, 2 max_rel + 1) added to its
  scores by offset, clipped at max_rel: Shaw et al. 2018, T5) or "rope" (rotary
  embedding of each head's queries and keys, base 10000, every feature pair: Su et al.
  2021; nothing enters the stream). variant: the attention variant of every layer
  (mha_jax.attention.VARIANTS)."""
  keys = iter(jax.random.split(key, 4 + 2 * num_layers))
  layers = {}
  for i in range(num_layers):
    b = {"attn": attention.init_attention_params(
        next(keys), d_model, num_heads, head_dim=head_dim or None, use_bias=use_bias,
        max_rel=max_rel if pos == "relative" else 0, variant=variant)}
    if not attn_only:
      b["mlp"] = common.init_mlp(next(keys), d_model, d_ff)
    if layer_norm:
      b["ln1"] = common.init_layer_norm(d_model)
      if not attn_only:
        b["ln2"] = common.init_layer_norm(d_model)
    layers[f"layer_{i}"] = b
  if layer_norm:
    layers["ln_final"] = common.init_layer_norm(d_model)
  params = {
      "embed": jax.random.normal(next(keys), (vocab_size, d_model)) * 0.02,
      "lm": layers,
      "unembed": jax.random.normal(next(keys), (d_model, vocab_size)) * d_model ** -0.5,
  }
  if pos in ("learned", "qk"):
    params["pos_embed"] = jax.random.normal(next(keys), (max_len, d_model)) * 0.02
  return params


def apply(params, spec: common.ModelSpec, tokens_BT, *, gates=None, capture=False, key=None,
          hook=None, logits_at=None):
  """Next-token logits (B, T, V); with capture=True also {"lm": [AttentionOutput ...]}.

  hook: an interventions.Hook (sites lm.{i}.*, lm.ln_final.scale); gates and capture are
  uses of it. logits_at: (B,) or (B, n) int positions: logits only there, (B, 1, V)
  or (B, n, V).
  """
  hook = interventions.model_hook(hook, gates, capture)
  t = tokens_BT.shape[1]
  d = params["embed"].shape[1]
  x = params["embed"][tokens_BT]
  if "pos_embed" in params:
    if t > params["pos_embed"].shape[0]:
      raise UserError(f"sequence length {t} exceeds model.max_len="
                       f"{params['pos_embed'].shape[0]}")
    pos = params["pos_embed"][:t]
  elif spec.pos not in ("relative", "rope"):   # those act on each attention's scores
    pos = common.sinusoidal(t, d)
  qk_only = spec.pos in common.QK_POS   # Shortformer: positions enter Q and K, not the residual
  if spec.pos not in common.SCORE_POS:
    x = x + pos
  rope = attention.RoPE() if spec.pos == "rope" else None
  keys = common.key_stream(key)
  layers = common.layers_of(params["lm"])
  for i, name in enumerate(layers):
    p = params["lm"][name]
    s = f"lm.{i}"
    x = interventions.at(hook, f"{s}.resid_pre", x)
    h = common.layer_norm(p["ln1"], x) if "ln1" in p else x
    hq, hv = (h + pos, h) if qk_only else (h, None)
    ln = (lambda r: common.layer_norm(p["ln1"], r)) if "ln1" in p else (lambda r: r)  # noqa: E731
    per = decoder.head_inputs(hook, f"{s}.attn", x, p["attn"], ln)   # edge ends
    if per is not None and qk_only:
      per = (per[0] + pos[:, None], per[1] + pos[:, None], per[2])
    a = attention.multi_head_attention(p["attn"], hq, value_input=hv, causal=True, rope=rope,
                                       impl=spec.impl, variant=spec.attention, layer=i,
                                       site=interventions.scope(hook, f"{s}.attn"), head_inputs=per)
    a = interventions.at(hook, f"{s}.attn_out", a)
    x = interventions.at(hook, f"{s}.resid_mid", x + common.dropout(next(keys), spec.dropout, a))
    if "mlp" in p:
      m_in = interventions.at(hook, f"{s}.mlp_in", x)    # what the MLP reads; the stream goes on as x
      h = common.layer_norm(p["ln2"], m_in) if "ln2" in p else m_in
      m = interventions.at(hook, f"{s}.mlp_out", common.mlp(p["mlp"], h))
      x = x + common.dropout(next(keys), spec.dropout, m)
    x = interventions.at(hook, f"{s}.resid_post", x)
  if logits_at is not None:
    x = common.at_positions(x, logits_at)
  if "ln_final" in params["lm"]:
    x = common.layer_norm(params["lm"]["ln_final"], x, hook=hook, site="lm.ln_final.scale")
  logits = x @ params["unembed"]
  if capture:
    return logits, {"lm": interventions.captured(hook, "lm", len(layers), attention.AttentionOutput)}
  return logits
