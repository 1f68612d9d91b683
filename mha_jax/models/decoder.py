"""One decoder-only forward for every decoder family (LLaMA, Mistral, Qwen2/3, Gemma 2/3,
OLMo 2, Phi-3, GPT-2, GPT-NeoX), driven by the params present and a DecoderSpec.

params = {
  "embed": (V, D),
  "pos_embed": (P, D)                        learned absolute positions (GPT-2, OPT) or absent
  "ln_embed": norm                           on the embeddings (BLOOM) or absent
  "lm": {"layer_{i}": {
            "ln1": norm        before attention          (absent: OLMo 2)
            "attn": {"wq": (D, H, K), "wk", "wv": (D, G, K), "wo": (H, K, D),
                     optional "bq" (H, K), "bk", "bv" (G, K), "bo" (D,),
                     optional "alibi" (H,) ALiBi slopes (BLOOM),
                     optional "q_norm", "k_norm": (K,) per head or (H, K) / (G, K)},
            "ln1_post": norm   on the attention's output (Gemma 2/3, OLMo 2) or absent
            "ln2": norm        before the MLP            (absent: OLMo 2)
            "mlp": {"w_gate": (D, F) (gated MLPs only), "w_up": (D, F), "w_down": (F, D),
                    optional "b_gate", "b_up" (F,), "b_down" (D,)},
            "ln2_post": norm   on the MLP's output (Gemma 2/3, OLMo 2) or absent},
         "ln_final": norm},
  "unembed": (D, V)                          absent when the embeddings are tied
}
A norm is {"scale": (D,)} (RMSNorm) or {"scale", "bias": (D,)} (LayerNorm, spec.norm).
Gemma's (1 + w) scales are stored as 1 + w (the importers add the 1, as llama.cpp does).

Edge ends (sites lm.{i}.attn.in_q, in_k, in_v, lm.{i}.mlp_in; see interventions.py):
edited, each head's q, k and v read their own copy of the residual, normed by ln1.

A layer: h = x + post1(attn(ln1(x))); out = h + post2(mlp(ln2(h))); with spec.parallel
(GPT-NeoX): out = x + attn(ln1(x)) + mlp(ln2(x)). Everything per layer that the shapes
do not say (RoPE, sliding window, score scale) is in the spec, one entry per layer or
one for all. Attention is the one multi_head_attention of mha_jax.attention.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from mha_jax import attention
from mha_jax import interventions
from mha_jax.errors import UserError
from mha_jax.models import common
from mha_jax.models import rope_scaling

NORMS = ("rms", "layer")
ACTS = ("silu", "gelu", "gelu_tanh", "relu")
# How a mixture-of-experts router turns its float32 logits into the top-k experts'
# weights: "softmax_renorm" softmax, top-k, renormalised to sum 1 (Mixtral; Qwen3-MoE and
# OLMoE with norm_topk_prob); "softmax" softmax then top-k as they are (norm_topk_prob
# false); "topk_softmax" top-k of the logits, then a softmax over those k (gpt-oss);
# "sigmoid" / "sigmoid_renorm" DeepSeek-V3's: sigmoid scores, the top-k of score +
# router_correction (among the moe_groups groups with the best sum of their two best),
# weighted by their scores (renormalised to sum 1).
ROUTINGS = ("softmax_renorm", "softmax", "topk_softmax", "sigmoid", "sigmoid_renorm")


@dataclasses.dataclass(frozen=True)
class DecoderSpec:
  """Static (hashable) settings of a decoder that the params' shapes do not say.

  norm: "rms" (RMSNorm) or "layer" (LayerNorm with bias); norm_eps its epsilon (also
    the QK-norm's).
  act: the MLP's activation: "silu", "gelu" (exact), "gelu_tanh" (the tanh
    approximation: gelu_new, gelu_pytorch_tanh), "relu".
  parallel: attention and MLP read the same input (GPT-NeoX use_parallel_residual).
  rope: an attention.RoPE, None (no RoPE), or a tuple with one of those per layer.
  window: sliding window (int), None, or a tuple per layer (None = full attention).
  attn_scale: the score scale, None = 1 / sqrt(K), or a tuple per layer.
  attn_softcap / final_softcap: Gemma 2's soft-capping of the scores / of the logits.
  embed_scale: multiplies the embeddings (Gemma: sqrt(D), Granite's
    embedding_multiplier); None = 1.
  residual_scale: multiplies what attention and the MLP add to the stream, before the
    attn_out / mlp_out sites (Granite's residual_multiplier); None = 1.
  logit_scale: multiplies the logits, before final_softcap (Cohere's logit_scale,
    Granite's 1 / logits_scaling); None = 1.
  moe_top_k, moe_routing: experts per token and how the router weighs them (ROUTINGS),
    for the layers whose MLP has a "router" (mixture of experts).
  moe_scale: multiplies the chosen experts' weights (DeepSeek's routed_scaling_factor);
    None = 1. moe_groups: (n_group, topk_group): the top-k is taken among the experts of
    the topk_group groups with the highest expert score (DeepSeek's
    group_limited_greedy); None: among all.
  swiglu_limit, swiglu_alpha: gpt-oss's clamped SwiGLU in the experts: gate clamped
    to <= limit, up to [-limit, limit], out (up + 1) * gate * sigmoid(alpha gate);
    None: act(gate) * up.
  impl: attention kernel (mha_jax.attention IMPLS).
  """
  norm: str = "rms"
  norm_eps: float = 1e-5
  act: str = "silu"
  parallel: bool = False
  rope: Any = attention.RoPE()
  window: Any = None
  attn_scale: Any = None
  attn_softcap: float | None = None
  final_softcap: float | None = None
  embed_scale: float | None = None
  residual_scale: float | None = None
  logit_scale: float | None = None
  moe_top_k: int = 0
  moe_routing: str = "softmax_renorm"
  moe_scale: float | None = None
  moe_groups: tuple | None = None
  swiglu_limit: float | None = None
  swiglu_alpha: float | None = None
  impl: str = "auto"

  def __post_init__(self):
    if self.norm not in NORMS:
      raise ValueError(f"DecoderSpec.norm must be one of {NORMS}; got {self.norm!r}")
    if self.act not in ACTS:
      raise ValueError(f"DecoderSpec.act must be one of {ACTS}; got {self.act!r}")
    if self.moe_routing not in ROUTINGS:
      raise ValueError(f"DecoderSpec.moe_routing must be one of {ROUTINGS}; got "
                       f"{self.moe_routing!r}")
    if self.impl not in attention.IMPLS:
      raise ValueError(f"DecoderSpec.impl must be one of {attention.IMPLS}; got "
                       f"{self.impl!r}")

  @property
  def rope_base(self) -> float:
    """The RoPE base of layer 0 (llama_spec's setting, for code written against it)."""
    r = self.layer("rope", 0)
    return 0.0 if r is None else float(r.base)

  def layer(self, field: str, i: int):
    """The setting `field` of layer i (a per-layer tuple, or one value for all)."""
    v = getattr(self, field)
    if isinstance(v, tuple):
      if i >= len(v):
        raise UserError(f"DecoderSpec.{field} has {len(v)} per-layer entries; the params "
                        f"have a layer {i}")
      return v[i]
    return v


# --------------------------------------------------------------------------
# From an imported model's config (config.json "model" section).
# --------------------------------------------------------------------------


def spec_from_config(m, impl: str = "auto") -> DecoderSpec:
  """The DecoderSpec of an imported model's config: model.decoder (written by the
  importers: norm, act, parallel, per-layer rope / window / scale, soft-caps, embedding
  scale), or the LLaMA settings of workdirs imported before it existed."""
  d = m.get("decoder") if hasattr(m, "get") else None
  if d is None:       # older llama workdirs: rope_base and norm_eps only
    return DecoderSpec(norm_eps=float(m["norm_eps"]),
                       rope=attention.RoPE(base=float(m["rope_base"])), impl=impl)
  d = dict(d)
  layers = list(d["layers"])
  layout = d.get("rope_layout", "half")
  ropes = tuple(rope_scaling.make_rope(None if l["rope"] is None else dict(l["rope"]), layout)
                for l in layers)
  windows = tuple(None if l.get("window") is None else int(l["window"]) for l in layers)
  scales = tuple(None if l.get("scale") is None else float(l["scale"]) for l in layers)
  opt = lambda k: None if d.get(k) is None else float(d[k])   # noqa: E731
  return DecoderSpec(norm=d["norm"], norm_eps=float(d["norm_eps"]), act=d["act"],
                     parallel=bool(d.get("parallel", False)), rope=ropes, window=windows,
                     attn_scale=scales, attn_softcap=opt("attn_softcap"),
                     final_softcap=opt("final_softcap"), embed_scale=opt("embed_scale"),
                     residual_scale=opt("residual_scale"), logit_scale=opt("logit_scale"),
                     moe_top_k=int(d.get("moe_top_k", 0)),
                     moe_routing=d.get("moe_routing", "softmax_renorm"),
                     moe_scale=opt("moe_scale"), moe_groups=None if d.get(
                         "moe_groups") is None else tuple(int(g) for g in d["moe_groups"]),
                     swiglu_limit=opt("swiglu_limit"), swiglu_alpha=opt("swiglu_alpha"),
                     impl=impl)


# --------------------------------------------------------------------------
# Pieces.
# --------------------------------------------------------------------------


def rms_norm(p, x, eps, *, hook=None, site=None):
  """x / sqrt(mean(x^2) + eps) * scale, in float32; the factor 1 / sqrt(...) (..., 1) is
  the intervention site `site` when named (lm.ln_final.scale)."""
  x32 = x.astype(jnp.float32)
  inv = jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
  if site is not None:
    inv = interventions.at(hook, site, inv)
  y = x32 * inv
  return (y * p["scale"]).astype(x.dtype)


def norm(p, x, spec: DecoderSpec, *, hook=None, site=None):
  if spec.norm == "layer":
    x32 = x.astype(jnp.float32)
    return common.layer_norm(p, x32, spec.norm_eps, hook=hook, site=site).astype(x.dtype)
  return rms_norm(p, x, spec.norm_eps, hook=hook, site=site)


def activation(name: str, x):
  if name == "silu":
    return jax.nn.silu(x)
  if name == "gelu":
    return jax.nn.gelu(x, approximate=False)
  if name == "gelu_tanh":
    return jax.nn.gelu(x, approximate=True)
  return jax.nn.relu(x)


def mlp(p, x, act: str):
  """Gated (w_gate present: act(x W_gate) * x W_up) or plain (act(x W_up)) MLP, then W_down;
  optional biases b_gate, b_up, b_down."""
  def lin(w, b):
    y = x @ p[w].astype(x.dtype)
    return y if b not in p else y + p[b].astype(x.dtype)
  up = lin("w_up", "b_up")
  hidden = activation(act, lin("w_gate", "b_gate")) * up if "w_gate" in p else \
      activation(act, up)
  out = hidden @ p["w_down"].astype(x.dtype)
  return out if "b_down" not in p else out + p["b_down"].astype(x.dtype)


def _gated(spec: DecoderSpec, gate, up):
  """act(gate) * up, or gpt-oss's clamped SwiGLU (spec.swiglu_limit)."""
  if spec.swiglu_limit is None:
    return activation(spec.act, gate) * up
  lim = jnp.asarray(spec.swiglu_limit, gate.dtype)
  gate, up = jnp.minimum(gate, lim), jnp.clip(up, -lim, lim)
  return (up + 1) * gate * jax.nn.sigmoid(gate * jnp.asarray(spec.swiglu_alpha, gate.dtype))


def route(p, x_BTD, spec: DecoderSpec):
  """(B, T, E) float32: each expert's weight for each token, zero outside its top-k
  (the router site's value). The router's logits x @ router (+ router_bias) are
  computed in float32 and ranked by jax.lax.top_k (ties: the lower expert index)."""
  logits = x_BTD.astype(jnp.float32) @ p["router"].astype(jnp.float32)
  if "router_bias" in p:
    logits = logits + p["router_bias"].astype(jnp.float32)
  e, k = logits.shape[-1], spec.moe_top_k
  if spec.moe_routing.startswith("sigmoid"):
    top, idx = _sigmoid_route(p, logits, spec)
  elif spec.moe_routing == "topk_softmax":
    top, idx = jax.lax.top_k(logits, k)
    top = jax.nn.softmax(top, axis=-1)
  else:
    probs = jax.nn.softmax(logits, axis=-1)
    if spec.moe_groups is not None:    # keep the experts of the best topk_group groups
      n, keep = spec.moe_groups
      best = jnp.max(probs.reshape(*probs.shape[:-1], n, e // n), axis=-1)
      chosen = jnp.sum(jax.nn.one_hot(jax.lax.top_k(best, keep)[1], n), axis=-2)
      probs = probs * jnp.repeat(chosen, e // n, axis=-1)
    top, idx = jax.lax.top_k(probs, k)
    if spec.moe_routing == "softmax_renorm":
      top = top / jnp.sum(top, axis=-1, keepdims=True)
  if spec.moe_scale is not None:
    top = top * jnp.float32(spec.moe_scale)
  return jnp.einsum("btk,btke->bte", top, jax.nn.one_hot(idx, e, dtype=jnp.float32))


def _sigmoid_route(p, logits, spec: DecoderSpec):
  """DeepSeek-V3's top-k (weights (B, T, k), expert indices): the sigmoid scores' top-k
  of score + router_correction (E,) within the moe_groups (n_group, topk_group) groups
  ranked by the sum of their two best corrected scores; each chosen expert weighs its
  score (not the corrected one), renormalised for "sigmoid_renorm" (sum + 1e-20, as
  transformers)."""
  e, k = logits.shape[-1], spec.moe_top_k
  scores = jax.nn.sigmoid(logits)
  choice = scores + p["router_correction"].astype(jnp.float32) if "router_correction" in p \
      else scores
  if spec.moe_groups is not None:
    n, keep = spec.moe_groups
    best = jnp.sum(jax.lax.top_k(choice.reshape(*choice.shape[:-1], n, e // n), 2)[0], -1)
    chosen = jnp.sum(jax.nn.one_hot(jax.lax.top_k(best, keep)[1], n), axis=-2)
    choice = jnp.where(jnp.repeat(chosen, e // n, axis=-1) > 0, choice, -jnp.inf)
  idx = jax.lax.top_k(choice, k)[1]
  top = jnp.take_along_axis(scores, idx, axis=-1)
  if spec.moe_routing == "sigmoid_renorm":
    top = top / (jnp.sum(top, axis=-1, keepdims=True) + jnp.float32(1e-20))
  return top, idx


def moe(p, x_BTD, spec: DecoderSpec, hook=None, site: str | None = None):
  """A mixture-of-experts MLP: sum over experts e of weight[e] * expert_e(x), the
  weights from `route` through the site `{site}.router` (B, T, E) (read it to see the
  router's choices; replace it to fix them). Every expert runs on every token and the
  unchosen ones are weighted 0: the same sum as a sparse dispatch, E / k times its
  FLOPs. Experts: w_gate, w_up (E, D, F), w_down (E, F, D), optional b_gate, b_up
  (E, F), b_down (E, D); optional "shared" {w_gate, w_up, w_down}: shared experts, a
  dense MLP every token runs (DeepSeek), added."""
  w_BTE = route(p, x_BTD, spec)
  if site is not None:
    w_BTE = interventions.at(hook, f"{site}.router", w_BTE)
  w_BTE = w_BTE.astype(x_BTD.dtype)

  def lin(w, b):
    y = jnp.einsum("btd,edf->btef", x_BTD, p[w].astype(x_BTD.dtype))
    return y if b not in p else y + p[b].astype(x_BTD.dtype)
  h_BTEF = _gated(spec, lin("w_gate", "b_gate"), lin("w_up", "b_up")) * w_BTE[..., None]
  out = jnp.einsum("btef,efd->btd", h_BTEF, p["w_down"].astype(x_BTD.dtype))
  if "b_down" in p:
    out = out + w_BTE @ p["b_down"].astype(x_BTD.dtype)
  return out if "shared" not in p else out + mlp(p["shared"], x_BTD, spec.act)


def unembed(params, x_BTD):
  """Logits (B, T, V) in float32: x @ unembed, or x @ embed.T when tied; plus
  unembed_bias (V,) where the family has one (Phi, GPT-J)."""
  # accumulated and returned in float32 (bfloat16 params: the metrics read these)
  if "unembed" in params:
    y = jnp.matmul(x_BTD, params["unembed"].astype(x_BTD.dtype),
                   preferred_element_type=jnp.float32)
  else:
    y = jnp.einsum("btd,vd->btv", x_BTD, params["embed"].astype(x_BTD.dtype),
                   preferred_element_type=jnp.float32)
  return y if "unembed_bias" not in params else y + params["unembed_bias"].astype(y.dtype)


def positions_from_mask(mask_BT):
  """Positions (B, T) that count only real tokens: left padding does not shift them."""
  return jnp.maximum(jnp.cumsum(mask_BT.astype(jnp.int32), axis=1) - 1, 0)


def _softcap(x, cap):
  return x if cap is None else jnp.tanh(x / cap) * cap


def _embed(params, spec, tokens_BT, positions_BT):
  x = params["embed"][tokens_BT]
  if spec.embed_scale is not None:
    x = x * jnp.asarray(spec.embed_scale, jnp.float32).astype(x.dtype)
  if "pos_embed" in params:
    x = x + params["pos_embed"][positions_BT].astype(x.dtype)
  if "ln_embed" in params:     # BLOOM: a LayerNorm on the embeddings
    x = norm(params["ln_embed"], x, spec)
  return x


def head_inputs(hook, prefix: str, x_BTD, attn, norm_fn):
  """Each head's own input (q (B, T, H, D), k and v (B, T, G, D)) from the edge-end
  sites `{prefix}.in_q`, `.in_k`, `.in_v` (the residual before the norm, broadcast per
  head, then edited), each through norm_fn; None when no such site is edited or read
  (the plain forward)."""
  if hook is None or not any(hook.wants(f"{prefix}.in_{c}") for c in "qkv"):
    return None
  b, t, d = x_BTD.shape
  counts = {"q": attn["wq"].shape[1], "k": attn["wk"].shape[1], "v": attn["wk"].shape[1]}
  return tuple(norm_fn(interventions.at(hook, f"{prefix}.in_{c}", jnp.broadcast_to(
      x_BTD[:, :, None], (b, t, counts[c], d)))) for c in "qkv")


def _block(p, x, spec: DecoderSpec, i: int, *, key_mask=None, positions_BT=None,
           cache=None, hook=None):
  """One decoder layer with its intervention sites (lm.{i}.resid_pre, .attn.*, .attn_out,
  .resid_mid, .mlp_out, .resid_post; attn_out and mlp_out after the post-norms). Returns
  (x, the new KV cache with `cache`, else None)."""
  name = f"lm.{i}"
  x = interventions.at(hook, f"{name}.resid_pre", x)
  h = norm(p["ln1"], x, spec) if "ln1" in p else x
  rope = spec.layer("rope", i)
  kw = dict(causal=True, mask=key_mask, rope=rope, impl=spec.impl,
            window=spec.layer("window", i), scale=spec.layer("attn_scale", i),
            softcap=spec.attn_softcap, qk_norm_eps=spec.norm_eps,
            variant="sink" if "sink_logit" in p["attn"] else "softmax",
            site=interventions.scope(hook, f"{name}.attn"))
  if positions_BT is not None and rope is not None:
    kw["positions"] = positions_BT
  # edge ends: every head reads its own residual (with a cache: the new tokens')
  kw["head_inputs"] = head_inputs(hook, f"{name}.attn", x, p["attn"], lambda r: norm(
      p["ln1"], r, spec) if "ln1" in p else r)
  new_cache = None
  if cache is not None:
    a, new_cache = attention.multi_head_attention(p["attn"], h, cache=cache, **kw)
  else:
    a = attention.multi_head_attention(p["attn"], h, **kw)
  if "ln1_post" in p:      # its 1/rms is a site: DLA freezes it (attention then linear)
    a = norm(p["ln1_post"], a, spec, hook=hook, site=f"{name}.ln1_post.scale")
  a = interventions.at(hook, f"{name}.attn_out", _residual(a, spec))
  if spec.parallel:     # GPT-NeoX: the MLP reads the layer's input, not resid_mid
    m_in = interventions.at(hook, f"{name}.mlp_in", x)
    mid = interventions.at(hook, f"{name}.resid_mid", x + a)
    m = _mlp_out(p, m_in, spec, hook, name)
    return interventions.at(hook, f"{name}.resid_post", mid + m), new_cache
  x = interventions.at(hook, f"{name}.resid_mid", x + a)
  m_in = interventions.at(hook, f"{name}.mlp_in", x)     # what the MLP reads; the stream goes on as x
  m = _mlp_out(p, m_in, spec, hook, name)
  return interventions.at(hook, f"{name}.resid_post", x + m), new_cache


def _residual(y, spec: DecoderSpec):
  """What a sublayer adds to the stream: y, times Granite's residual_multiplier."""
  if spec.residual_scale is None:
    return y
  return y * jnp.asarray(spec.residual_scale, jnp.float32).astype(y.dtype)


def _mlp_out(p, m_in, spec: DecoderSpec, hook, name: str):
  """The MLP's output (site {name}.mlp_out) from what it reads: normed by ln2, or, in a
  parallel block without ln2 (Phi, GPT-J, Cohere, Falcon), by ln1 (one norm for both);
  then ln2_post and the residual multiplier."""
  ln = p.get("ln2", p.get("ln1") if spec.parallel else None)
  h = norm(ln, m_in, spec) if ln is not None else m_in
  m = moe(p["mlp"], h, spec, hook, f"{name}.mlp") if "router" in p["mlp"] else \
      mlp(p["mlp"], h, spec.act)
  if "ln2_post" in p:
    m = norm(p["ln2_post"], m, spec)
  return interventions.at(hook, f"{name}.mlp_out", _residual(m, spec))


def _final(params, spec, x, hook=None):
  h = norm(params["lm"]["ln_final"], x, spec, hook=hook, site="lm.ln_final.scale")
  logits = unembed(params, h)
  if spec.logit_scale is not None:
    logits = logits * jnp.float32(spec.logit_scale)
  return _softcap(logits, spec.final_softcap)


def apply(params, spec: DecoderSpec, tokens_BT, *, mask_BT=None, positions_BT=None,
          gates=None, capture=False, cache=None, last_only: bool = False, hook=None,
          logits_at=None, start=None, stream=None):
  """Logits (B, T, V) for every position of tokens_BT.

  mask_BT: True for real tokens, False for padding (keys that no query may read); with
    it, positions count real tokens only (left or right padding).
  gates: {"lm": [(H,) or (B, H) per layer]} head gates.
  capture: also return {"lm": [AttentionOutput per layer]} (weights (B, H, T, S)).
  cache: {"layer_{i}": attention KV cache} from `init_cache`; then tokens are appended at
    the cache's length and (logits, new_cache) is returned. With a cache, mask_BT covers
    the whole cache (B, S_max): True where a key is real.
  last_only: logits of the last position only, (B, 1, V) (a prompt's prefill).
  hook: an interventions.Hook (sites lm.{i}.*, lm.ln_final.scale; see interventions.py).
  logits_at: (B,) or (B, n) int positions: logits only there, (B, 1, V) or
    (B, n, V) (patching metrics, retrieval).
  start, stream: resume at layer `start` (int or () int32, traced welcome) from the
    residual stream `stream` (L, B, T, D) of a run of the same tokens (its lm.{i}.resid_pre,
    e.g. read by a forward): a layer i before `start` does not run (lax.cond: skipped
    where `start` is not batched) and hands on stream[i + 1], so layer `start` reads
    stream[start]. Exact when the stream is this run's up to `start` (a patching sweep's
    base run, edited from `start` on). Sites before `start` are not reached; reads cannot
    be combined with it, and with a cache the skipped layers' caches come back as they
    were.
  Gates and capture are uses of the interventions (a scale of lm.{i}.attn.z; reads).
  """
  if capture and cache is not None:
    raise UserError("capture=True cannot be combined with a KV cache")
  hook = interventions.model_hook(hook, gates, capture)
  if (start is None) != (stream is None):
    raise UserError(f"start and stream go together; got start={start!r} and a stream of "
                    f"shape {None if stream is None else jnp.shape(stream)}")
  if start is not None and hook is not None and hook.read:
    raise UserError(f"start (resuming at a layer) cannot be combined with reads; got "
                    f"read={list(hook.read)}")
  tokens_BT = jnp.asarray(tokens_BT)
  b, t = tokens_BT.shape
  key_mask = None if mask_BT is None else jnp.asarray(mask_BT, bool)[:, None, None, :]
  if positions_BT is None and mask_BT is not None and cache is None:
    positions_BT = positions_from_mask(mask_BT)
  if "pos_embed" in params:   # learned positions need them explicitly
    if positions_BT is None:
      first = 0 if cache is None else next(iter(cache.values()))["length"]
      positions_BT = jnp.broadcast_to(first + jnp.arange(t)[None], (b, t))
  x = _embed(params, spec, tokens_BT, positions_BT)
  layers = common.layers_of(params["lm"])
  new_cache = {}
  if stream is not None and jnp.shape(stream) != (len(layers),) + x.shape:
    raise UserError(f"stream must be (L, B, T, D) = {(len(layers),) + x.shape}; got "
                    f"{jnp.shape(stream)}")
  for i, name in enumerate(layers):
    def block(x, c, i=i, name=name):
      y, c = _block(params["lm"][name], x, spec, i, key_mask=key_mask,
                    positions_BT=positions_BT, hook=hook, cache=c)
      return y.astype(x.dtype), c      # the stream keeps its dtype
    c = None if cache is None else cache[name]
    if start is None:
      x, new_cache[name] = block(x, c)
    else:         # resume: a layer before start hands on the stream entering the next
      nxt = stream[min(i + 1, len(layers) - 1)].astype(x.dtype)
      x, new_cache[name] = jax.lax.cond(i >= start, block, lambda x, c, nxt=nxt: (nxt, c),
                                        x, c)
  if logits_at is not None:
    x = common.at_positions(x, logits_at)
  logits = _final(params, spec, x[:, -1:] if last_only else x, hook)
  if cache is not None:
    return logits, new_cache
  if capture:
    return logits, {"lm": interventions.captured(hook, "lm", len(layers), attention.AttentionOutput)}
  return logits


def init_cache(params, batch: int, max_len: int, dtype=jnp.float32) -> dict:
  """An empty KV cache per layer: {"layer_{i}": {"k", "v": (B, S_max, H_kv, K), "length"}}."""
  out = {}
  for name in common.layers_of(params["lm"]):
    _, h_kv, k = params["lm"][name]["attn"]["wk"].shape
    v = params["lm"][name]["attn"]["wv"].shape[2]
    out[name] = attention.init_kv_cache(batch, max_len, h_kv, k, dtype, v_dim=v)
  return out


def _prefill(params, spec, tokens_BT, cache):
  logits, cache = apply(params, spec, tokens_BT, cache=cache, last_only=True)
  return logits[:, -1], cache


def _step(params, spec, token_B, cache):
  logits, cache = apply(params, spec, token_B[:, None], cache=cache)
  return logits[:, -1], cache


# generate's two compiled programs: one each per cache length, whatever the prompt
prefill_jit = jax.jit(_prefill, static_argnames="spec", donate_argnames="cache")
step_jit = jax.jit(_step, static_argnames="spec", donate_argnames="cache")


def _longrope_switch(spec: DecoderSpec, n_layers: int) -> int | None:
  """The switch length of the model's LongRoPE layers (None: none); one for all."""
  got = {r.max_positions for r in (spec.layer("rope", i) for i in range(n_layers))
         if r is not None and r.long_inv_freq is not None}
  if len(got) > 1:
    raise UserError(f"LongRoPE layers with different switch lengths {sorted(got)}: "
                    f"generate recomputes the cache at one length")
  return got.pop() if got else None


def generate(params, spec: DecoderSpec, prompt_BT, max_new_tokens: int, *,
             eos_id: int | None = None, return_logits: bool = False):
  """Greedy decoding with a KV cache: the prompt in one compiled call, then one compiled
  1-token step per new token (the same program every step: no retrace).

  Returns new tokens (B, N), N <= max_new_tokens (stops early once every row has emitted
  eos_id; later tokens of a finished row are eos_id); with return_logits also the
  float32 logits (B, N, V) that chose them. The layers stay unrolled in the compiled
  programs: a scan over stacked layers compiles ~4x faster but, measured on CPU, decodes
  ~2.5x slower (78 vs 30 ms per token for SmolLM2).

  LongRoPE (a RoPE with long_inv_freq): when the tokens so far first number
  max_positions + 1 (the prompt being shorter), the cache is rebuilt from all of them
  with the long frequencies, as transformers' Phi-3 generate does; dynamic NTK needs
  nothing (each step's keys keep the frequencies of their step, as in transformers).
  """
  prompt_BT = jnp.asarray(prompt_BT, jnp.int32)
  if prompt_BT.ndim != 2 or prompt_BT.shape[1] < 1:
    raise UserError(f"prompt_BT must be (B, T) with T >= 1; got shape {prompt_BT.shape}")
  if max_new_tokens < 1:
    raise UserError(f"max_new_tokens must be >= 1; got {max_new_tokens}")
  b, t = prompt_BT.shape
  if "pos_embed" in params and t + max_new_tokens > params["pos_embed"].shape[0]:
    raise UserError(f"the prompt ({t} tokens) plus max_new_tokens={max_new_tokens} exceed "
                    f"the model's {params['pos_embed'].shape[0]} learned positions")
  cache = init_cache(params, b, t + max_new_tokens)
  logits, cache = prefill_jit(params, spec, prompt_BT, cache)
  switch = _longrope_switch(spec, len(cache))
  out, kept = [], []
  done = np.zeros((b,), bool)
  for _ in range(max_new_tokens):
    tok = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    tok_np = np.asarray(tok)
    if eos_id is not None:
      tok_np = np.where(done, eos_id, tok_np)
      done |= tok_np == eos_id
    out.append(tok_np)
    if return_logits:
      kept.append(np.asarray(logits))
    if eos_id is not None and done.all():
      break
    if len(out) < max_new_tokens and switch is not None and t <= switch \
        and t + len(out) == switch + 1:    # LongRoPE: recompute with the long factors
      so_far = jnp.concatenate([prompt_BT, jnp.asarray(np.stack(out, 1), jnp.int32)], 1)
      logits, cache = prefill_jit(params, spec, so_far, init_cache(
          params, b, t + max_new_tokens))
    elif len(out) < max_new_tokens:
      logits, cache = step_jit(params, spec, jnp.asarray(tok_np), cache)
  tokens = np.stack(out, axis=1)
  return (tokens, np.stack(kept, axis=1)) if return_logits else tokens
