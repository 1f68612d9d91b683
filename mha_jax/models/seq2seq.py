"""Encoder-decoder Transformer, the setting of Voita et al. 2019 (LayerNorm before or
after each block: model.ln_position "pre" or "post").

params = {
  "embed": (V, D)                      shared source/target embedding, tied output
  "encoder": {"layer_{i}": {"ln1", "self_attn", "ln2", "mlp"}, "ln_final"},
  "decoder": {"layer_{i}": {"ln1", "self_attn", "ln2", "cross_attn", "ln3", "mlp"},
              "ln_final"},
}
Every attention block is `attention.multi_head_attention` on its own params.
Positions: sinusoidal, added to the embeddings (Vaswani et al.), or "relative": no
absolute positions; each self-attention block has "rel_bias" (H, 2R + 1), one learned
score bias per head and clipped offset (Shaw et al. 2018), applied by the attention
function. Cross-attention has no positional term in either case.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from mha_jax import attention
from mha_jax import interventions
from mha_jax.models import common

STACKS = ("encoder", "decoder_self", "decoder_cross")


def init(key, *, vocab_size: int, d_model: int, num_heads: int, head_dim: int = 0,
         enc_layers: int, dec_layers: int, d_ff: int, layer_norm: bool = True,
         attn_only: bool = False, use_bias: bool = False, ln_position: str = "pre",
         pos: str = "sinusoidal", max_rel: int = 16, variant: str = "softmax") -> dict:
  """Fresh params. head_dim 0 means d_model // num_heads. Post-LN has no final LN.
  pos="relative" adds a zero (H, 2 max_rel + 1) "rel_bias" to every self-attention.
  variant: the attention variant of every attention (mha_jax.attention.VARIANTS)."""
  k = head_dim or None
  keys = iter(jax.random.split(key, 1 + 4 * (enc_layers + dec_layers)))

  def block(cross):
    rel = max_rel if pos == "relative" else 0
    b = {"self_attn": attention.init_attention_params(next(keys), d_model, num_heads,
                                                      head_dim=k, use_bias=use_bias,
                                                      max_rel=rel, variant=variant)}
    if cross:
      b["cross_attn"] = attention.init_attention_params(next(keys), d_model, num_heads,
                                                        head_dim=k, use_bias=use_bias,
                                                        variant=variant)
    if not attn_only:
      b["mlp"] = common.init_mlp(next(keys), d_model, d_ff)
    if layer_norm:
      for ln in ("ln1", "ln2", "ln3")[: 2 + cross]:
        b[ln] = common.init_layer_norm(d_model)
    return b

  params = {
      "embed": jax.random.normal(next(keys), (vocab_size, d_model)) * d_model ** -0.5,
      "encoder": {f"layer_{i}": block(False) for i in range(enc_layers)},
      "decoder": {f"layer_{i}": block(True) for i in range(dec_layers)},
  }
  if layer_norm and ln_position == "pre":
    params["encoder"]["ln_final"] = common.init_layer_norm(d_model)
    params["decoder"]["ln_final"] = common.init_layer_norm(d_model)
  return params


def _norm(p, name, x):
  return common.layer_norm(p[name], x) if name in p else x


def _sublayer(x, p, ln, fn, spec, key):
  """Residual block: pre-LN x + f(LN(x)), or post-LN LN(x + f(x)) (Vaswani et al.)."""
  if spec.ln_position == "post":
    return _norm(p, ln, x + common.dropout(key, spec.dropout, fn(x)))
  return x + common.dropout(key, spec.dropout, fn(_norm(p, ln, x)))


def _embed(params, spec, ids_BT, keys, pos_BT=None):
  """Scaled shared embedding (plus sinusoidal positions unless pos="relative": arange(T),
  or pos_BT, each token's position in its packed pair), dropout."""
  d = params["embed"].shape[1]
  x = params["embed"][ids_BT] * common.embed_scale(d)
  if spec.pos != "relative":
    table = common.sinusoidal(ids_BT.shape[1], d)
    x = x + (table if pos_BT is None else table[pos_BT])
  return common.dropout(next(keys), spec.dropout, x)


def _segment_mask(q_seg_BT, k_seg_BS):
  """(B, 1, T, S): query and key in the same packed pair (segment ids, 0 = padding)."""
  return ((q_seg_BT[:, None, :, None] == k_seg_BS[:, None, None, :])
          & (k_seg_BS != 0)[:, None, None, :])


def encode(params, spec: common.ModelSpec, src_BS, *, gates=None, hook=None, key=None,
           src_seg_BS=None, src_pos_BS=None):
  """Encoder states (B, S, D). hook: an interventions.Hook (sites encoder.{i}.attn.*,
  encoder.{i}.attn_out); gates are scale edits of it.
  src_seg_BS, src_pos_BS: segment ids and positions of a packed batch (data/packing.py)."""
  hook = interventions.model_hook(hook, gates, stacks=STACKS)
  keys = common.key_stream(key)
  x = _embed(params, spec, src_BS, keys, src_pos_BS)
  if src_seg_BS is None:
    pad_mask = (src_BS != spec.pad_id)[:, None, None, :]
  else:
    pad_mask = _segment_mask(src_seg_BS, src_seg_BS)
  for i, name in enumerate(common.layers_of(params["encoder"])):
    p = params["encoder"][name]
    x = _sublayer(x, p, "ln1", lambda h: _attend(p["self_attn"], h, None, pad_mask, False,
                                                 spec, hook, f"encoder.{i}"),
                  spec, next(keys))
    if "mlp" in p:
      x = _sublayer(x, p, "ln2", lambda h: common.mlp(p["mlp"], h), spec, next(keys))
  return _norm(params["encoder"], "ln_final", x)


def decode(params, spec: common.ModelSpec, enc_BSD, src_BS, tgt_in_BT, *, gates=None,
           hook=None, key=None, src_seg_BS=None, tgt_seg_BT=None, tgt_pos_BT=None):
  """Logits (B, T, V) for the next target token at every position. The *_seg and
  tgt_pos_BT arrays describe a packed batch (data/packing.py). hook: sites
  decoder_self.{i}.attn.*, decoder_cross.{i}.attn.* and their .attn_out."""
  hook = interventions.model_hook(hook, gates, stacks=STACKS)
  keys = common.key_stream(key)
  x = _embed(params, spec, tgt_in_BT, keys, tgt_pos_BT)
  self_mask = None
  if src_seg_BS is None:
    src_mask = (src_BS != spec.pad_id)[:, None, None, :]
  else:
    src_mask = _segment_mask(tgt_seg_BT, src_seg_BS)
    self_mask = _segment_mask(tgt_seg_BT, tgt_seg_BT)
  for i, name in enumerate(common.layers_of(params["decoder"])):
    p = params["decoder"][name]
    x = _sublayer(x, p, "ln1", lambda h: _attend(p["self_attn"], h, None, self_mask, True,
                                                 spec, hook, f"decoder_self.{i}"),
                  spec, next(keys))
    x = _sublayer(x, p, "ln2", lambda h: _attend(p["cross_attn"], h, enc_BSD, src_mask,
                                                 False, spec, hook, f"decoder_cross.{i}"),
                  spec, next(keys))
    if "mlp" in p:
      x = _sublayer(x, p, "ln3", lambda h: common.mlp(p["mlp"], h), spec, next(keys))
  x = _norm(params["decoder"], "ln_final", x)
  return x @ params["embed"].T


def apply(params, spec: common.ModelSpec, src_BS, tgt_in_BT, *, gates=None, capture=False,
          key=None, packed=None, hook=None):
  """Logits (B, T, V); with capture=True also {stack: [AttentionOutput per layer]}.
  packed: {"src_seg", "src_pos" (B, S), "tgt_seg", "tgt_pos" (B, T)} of a packed batch
  (data/packing.py), already cut to tgt_in_BT's positions.
  hook: an interventions.Hook over both stacks' sites; gates and capture are uses of it."""
  hook = interventions.model_hook(hook, gates, capture, stacks=STACKS)
  ke, kd = jax.random.split(key) if key is not None else (None, None)
  pk = packed or {}
  enc = encode(params, spec, src_BS, hook=hook, key=ke,
               src_seg_BS=pk.get("src_seg"), src_pos_BS=pk.get("src_pos"))
  logits = decode(params, spec, enc, src_BS, tgt_in_BT, hook=hook, key=kd,
                  src_seg_BS=pk.get("src_seg"), tgt_seg_BT=pk.get("tgt_seg"),
                  tgt_pos_BT=pk.get("tgt_pos"))
  if not capture:
    return logits
  counts = common.head_counts(params)
  return logits, {s: interventions.captured(hook, s, len(counts[s]), attention.AttentionOutput)
                  for s in STACKS if s in counts}


def _attend(p, x, ctx, mask, causal, spec, hook, name):
  a = attention.multi_head_attention(p, x, ctx, mask=mask, causal=causal, impl=spec.impl,
                                     variant=spec.attention, layer=int(name.split(".")[1]),
                                     site=interventions.scope(hook, f"{name}.attn"))
  return interventions.at(hook, f"{name}.attn_out", a)


def greedy_decode(params, spec: common.ModelSpec, src_BS, max_len: int, bos_id: int,
                  eos_id: int, edits=None):
  """Greedy translations (B, max_len): [BOS, y_1, ..., EOS, PAD...]. One compile per shape.
  edits: {site: [interventions.Edit]} applied in the encoder and at every decoding step
  (a fresh interventions.Hook each forward)."""
  def hook():
    return interventions.Hook(edits) if edits else None
  enc = encode(params, spec, src_BS, hook=hook())
  b = src_BS.shape[0]
  out = jnp.full((b, max_len), spec.pad_id, jnp.int32).at[:, 0].set(bos_id)

  def step(i, state):
    out, done = state
    logits = decode(params, spec, enc, src_BS, out, hook=hook())
    nxt = jnp.argmax(logits[:, i - 1], axis=-1).astype(jnp.int32)
    nxt = jnp.where(done, spec.pad_id, nxt)
    return out.at[:, i].set(nxt), done | (nxt == eos_id)

  out, _ = jax.lax.fori_loop(1, max_len, step, (out, jnp.zeros((b,), bool)))
  return out
