"""Multi-head attention as pure functions: the one attention of this project.

Shape letters used in names (nanodo style):
  B batch, T query positions, S key/value positions, D d_model,
  H heads, K head width d_k (= D / H for a standard layer).

The whole computation, for one layer, is the textbook's seven lines:

  q_BTD = x_BTD @ W_Q              (W_Q holds D x D numbers for every H)
  q_BTHK = split_heads(q_BTD, H)   (heads are a reshape; each reads the whole token)
  s_BHTS = q . k / sqrt(K)         (each head divides by its own width)
  w_BHTS = softmax(s_BHTS)         (float32; masked entries get weight 0)
  o_BTHK = w_BHTS . v_BSHK         (one weighted average per head)
  o_BTD = merge_heads(o_BTHK)      (concatenate)
  y_BTD = o_BTD @ W_O              (W_O mixes the heads)

Parameters are a plain dict: ``wq`` of shape (D, H, K), ``wk``, ``wv`` of shape
(D, G, K), ``wo`` of shape (H, K, D), optional ``bq`` (H, K), ``bk``, ``bv`` (G, K)
and ``bo`` (D,), and optional
``rel_bias`` (H, 2R + 1): one learned score bias per head and relative offset
(Shaw et al. 2018), so every per-head parameter lives in the block and removing a
head is slicing its row. H, G and K are read from the shapes, so a layer whose
heads were removed still runs. G is the number of key/value heads: G = H is
multi-head attention, G dividing H is grouped-query attention (Ainslie et al. 2023;
G = 1 is multi-query, Shazeer 2019). Query head i reads key/value head i // (H // G),
the order of Hugging Face's ``repeat_kv``: kv head j serves query heads
j*H/G ... (j+1)*H/G - 1. Everything per head (gates, weights, masks, biases, the
returned heads) is per query head.

Rotary position embeddings (RoPE) rotate q and k inside the function; a KV cache
(init_kv_cache) lets a decoder attend one step at a time over earlier keys and values.
The attention variants (VARIANTS: gated, gated_head, differential, sigmoid, sink,
qk_norm) are options of the same function (variant=...), their params made by
init_attention_params(..., variant=...).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping, NamedTuple

import chex
import jax
import jax.numpy as jnp
import numpy as np

from mha_jax.blocks import (_check_rank, _group, _shape_error, attention_scores,  # noqa: F401
                             attention_weights, masked_softmax, merge_heads, mix_values,
                             relative_bias, relative_index, split_heads)
from mha_jax.kernels import dispatch as _dispatch

Params = Mapping[str, jax.Array]

IMPLS = _dispatch.IMPLS
_WEIGHT_KEYS = ("wq", "wk", "wv", "wo")
_BIAS_KEYS = ("bq", "bk", "bv", "bo")
REL_BIAS = "rel_bias"
# ALiBi (Press et al. 2022; BLOOM): "alibi" (H,) one slope per head, the score bias
# slope_h * (j - i) for query i and key j (slots), built as a relative-position table
# over every offset of the call (H, 2 max(T, S) - 1): the blocked kernel makes it per
# block (O(H (T + S)), no dense bias), the others get it dense.
ALIBI = "alibi"
# Multi-head latent attention (DeepSeek-V2/V3, MLA): keys and values are read from a
# per-token latent, not from the residual itself: latent = [RMSNorm(x wkv_a) * kv_a_norm
# (C features), x wk_rope (R features, shared by every head)], and wk (C + R, G, K),
# wv (C + R, G, V) project it per head (G = H: each head its own decompressed key and
# value). Queries read x, or the low-rank RMSNorm(x wq_a) * q_a_norm (Cq features) with
# wq (Cq, H, K). The importer lays each head's key as [rotary R; non-rotary K - R]
# (wk's rope rows an identity, so every head's rotary part is the shared x wk_rope) and
# the query the same way, so RoPE(dim=R) rotates exactly those features.
_MLA_KEYS = ("wq_a", "q_a_norm", "wkv_a", "kv_a_norm", "wk_rope")
MLA_NORM_EPS = 1e-6     # DeepSeek's latent norms' epsilon (DeepseekV2RMSNorm's default)
# QK-norm scales (RMSNorm of queries and keys after their projections, before RoPE):
# (K,) shared by every head (Qwen3, Gemma 3) or (H, K) / (G, K) over the whole
# projection at once (OLMo 2).
_QK_NORM_KEYS = ("q_norm", "k_norm")
# Removed heads' projections kept only for a whole-projection QK-norm's statistics (an
# exported OLMo 2 model, toolkit/masks.export_pruned): "wq_rest" (D, H_r, K) and
# optional "bq_rest" (H_r, K) for queries, "wk_rest" (D, G_r, K), "bk_rest" (G_r, K) for
# keys. Their squares join the mean of the kept heads' over (H + H_r) * K features; they
# are not attention heads (nothing reads or attends with them).
_NORM_REST_KEYS = ("wq_rest", "bq_rest", "wk_rest", "bk_rest")

# Variants of the one attention (multi_head_attention(..., variant=...)) and the params
# each adds to wq, wk, wv, wo (shapes in variant_param_shapes):
#   softmax       softmax(q k^T / sqrt(K)) v: the default.
#   gated         the head's output times sigmoid(x wg[:, h, :] + bg[h]), elementwise,
#                 after attention and before W_O (Qiu et al. 2025): wg (D, H, K), bg (H, K).
#   gated_head    the same with one scalar gate per head: wg (D, H), bg (H,).
#   differential  (softmax(q1 k1^T / sqrt(K/2)) - lambda_h softmax(q2 k2^T / sqrt(K/2))) v
#                 over the two halves of each head's query and key, then a per-head RMS
#                 norm and the (1 - lambda_init) scale (Ye et al. 2025): lambda_q1,
#                 lambda_k1, lambda_q2, lambda_k2 (H, K/2) and diff_norm (K,).
#   sigmoid       sigmoid(q k^T / sqrt(K) + b) v, b = -log S by default, no
#                 normalisation over the keys (Ramapuram et al. 2025): no params.
#   sink          softmax over the keys and one learned logit per head whose weight
#                 mixes nothing (gpt-oss): sink_logit (H,).
#   qk_norm       RMS-normalised queries and keys per head before RoPE: q_norm, k_norm (K,).
VARIANTS = ("softmax", "gated", "gated_head", "differential", "sigmoid", "sink", "qk_norm")
_VARIANT_KEYS = {"gated": ("wg", "bg"), "gated_head": ("wg", "bg"),
                 "differential": ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2",
                                  "diff_norm"),
                 "sink": ("sink_logit",), "qk_norm": ("q_norm", "k_norm")}
# Keys only a variant owns (q_norm / k_norm also come with imported families' softmax).
_VARIANT_ONLY_KEYS = ("wg", "bg", "lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2",
                      "diff_norm", "sink_logit")
# Differential attention's per-head RMS norm epsilon (the paper's code: 1e-5).
DIFF_NORM_EPS = 1e-5


def check_variant(variant: Any) -> str:
  """The variant's name; refuses an unknown one by name."""
  if not isinstance(variant, str) or variant not in VARIANTS:
    raise ValueError(f"variant must be one of {VARIANTS}; got {variant!r}")
  return variant


def diff_lambda_init(layer: int) -> float:
  """Differential attention's lambda_init for a layer (0-based index l - 1 of the
  paper's l = 1..L): 0.8 - 0.6 exp(-0.3 (l - 1))."""
  if isinstance(layer, bool) or not isinstance(layer, (int, np.integer)) or layer < 0:
    raise ValueError(f"layer must be an integer >= 0; got {layer!r}")
  return 0.8 - 0.6 * math.exp(-0.3 * int(layer))


def variant_param_shapes(variant: str, d_model: int, num_heads: int,
                         head_dim: int) -> dict[str, tuple[int, ...]]:
  """Shapes of the params `variant` adds, for (D, H, K)."""
  d, h, k = d_model, num_heads, head_dim
  return {"softmax": {}, "sigmoid": {},
          "gated": {"wg": (d, h, k), "bg": (h, k)},
          "gated_head": {"wg": (d, h), "bg": (h,)},
          "differential": {**{n: (h, k // 2) for n in _VARIANT_KEYS["differential"][:4]},
                           "diff_norm": (k,)},
          "sink": {"sink_logit": (h,)},
          "qk_norm": {"q_norm": (k,), "k_norm": (k,)}}[check_variant(variant)]


def _init_variant_params(key: jax.Array, variant: str, d: int, h: int, k: int,
                         dtype: Any) -> dict[str, jax.Array]:
  """Fresh params of a variant: gate weights LeCun normal over D with zero biases;
  differential lambdas normal(0, 0.1) and a unit norm scale (the paper's code); a zero
  sink logit; unit QK-norm scales."""
  if variant == "differential" and k % 2:
    raise ValueError(f"variant='differential' splits each head's query and key in two "
                     f"halves: the head width K={k} must be even")
  shapes = variant_param_shapes(variant, d, h, k)
  out = {}
  for name, key_n in zip(shapes, jax.random.split(key, max(len(shapes), 1))):
    shape = shapes[name]
    if name == "wg":
      init = jax.nn.initializers.variance_scaling(
          1.0, "fan_in", "truncated_normal", in_axis=0, out_axis=tuple(range(1, len(shape))))
      out[name] = init(key_n, shape, dtype)
    elif name.startswith("lambda_"):
      out[name] = 0.1 * jax.random.normal(key_n, shape, dtype)
    elif name in ("diff_norm", "q_norm", "k_norm"):
      out[name] = jnp.ones(shape, dtype)
    else:
      out[name] = jnp.zeros(shape, dtype)
  return out


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


# --------------------------------------------------------------------------
# Parameters.
# --------------------------------------------------------------------------


def init_attention_params(key: jax.Array, d_model: int, num_heads: int, *,
                          head_dim: int | None = None, use_bias: bool = False,
                          max_rel: int = 0, dtype: Any = jnp.float32,
                          num_kv_heads: int | None = None,
                          variant: str = "softmax") -> dict[str, jax.Array]:
  """Fresh parameters for one attention layer.

  Weights are LeCun-normal (truncated) over their input features, as Flax's
  DenseGeneral does; biases are zero.

  Args:
    key: a PRNG key.
    d_model: D, the model width.
    num_heads: H >= 1. Must divide d_model unless head_dim is given.
    head_dim: K; default d_model // num_heads.
    use_bias: add bq, bk, bv (H, K) and bo (D,).
    max_rel: R > 0 adds a zero "rel_bias" (H, 2R + 1): relative positions, offsets
      j - i clipped to +-R.
    dtype: parameter dtype.
    num_kv_heads: G, the key/value heads (grouped-query attention); must divide
      num_heads. None means num_heads (multi-head); 1 is multi-query.
    variant: one of VARIANTS; adds that variant's params (variant_param_shapes): gated
      wg (D, H, K), bg (H, K); gated_head wg (D, H), bg (H,); differential lambda_q1,
      lambda_k1, lambda_q2, lambda_k2 (H, K/2), diff_norm (K,); sink sink_logit (H,);
      qk_norm q_norm, k_norm (K,). The weights wq, wk, wv, wo are drawn as for softmax.

  Returns:
    {"wq": (D, H, K), "wk", "wv": (D, G, K), "wo": (H, K, D)} plus biases if asked
    (bq (H, K), bk, bv (G, K), bo (D,)) and the variant's params.
  """
  check_variant(variant)
  for name, val in (("d_model", d_model), ("num_heads", num_heads)):
    if not isinstance(val, (int, np.integer)) or isinstance(val, bool) or val < 1:
      raise ValueError(f"{name} must be a positive integer; got {val!r}")
  if head_dim is None:
    if d_model % num_heads:
      raise ValueError(f"num_heads={num_heads} does not divide d_model={d_model}: "
                       f"d_k = d_model / h must be a whole number (or pass head_dim)")
    head_dim = d_model // num_heads
  elif not isinstance(head_dim, (int, np.integer)) or head_dim < 1:
    raise ValueError(f"head_dim must be a positive integer; got {head_dim!r}")
  if not isinstance(max_rel, (int, np.integer)) or max_rel < 0:
    raise ValueError(f"max_rel must be an integer >= 0; got {max_rel!r}")
  if num_kv_heads is None:
    num_kv_heads = num_heads
  if (not isinstance(num_kv_heads, (int, np.integer)) or isinstance(num_kv_heads, bool)
      or num_kv_heads < 1):
    raise ValueError(f"num_kv_heads must be a positive integer; got {num_kv_heads!r}")
  _group(int(num_heads), int(num_kv_heads), f"num_kv_heads={num_kv_heads}")
  d, h, k, g = int(d_model), int(num_heads), int(head_dim), int(num_kv_heads)
  names = _WEIGHT_KEYS + (_BIAS_KEYS if use_bias else ())
  keys = jax.random.split(key, len(names))
  shapes = param_shapes(d, h, k, g)
  out = {n: PARAM_INITS[n](kn, shapes[n], dtype) for n, kn in zip(names, keys)}
  if max_rel:
    out[REL_BIAS] = jnp.zeros((h, 2 * int(max_rel) + 1), dtype)
  if variant != "softmax":   # a key of its own, so the weights above stay as they were
    out.update(_init_variant_params(jax.random.fold_in(key, 1 + VARIANTS.index(variant)),
                                    variant, d, h, k, dtype))
  return out


def param_shapes(d_model: int, num_heads: int, head_dim: int,
                 num_kv_heads: int | None = None, v_dim: int | None = None
                 ) -> dict[str, tuple[int, ...]]:
  """Shapes of every attention param for (D, H, K), G key/value heads (None = H) and
  value heads of width V (None = K; DeepSeek's MLA has V != K)."""
  d, h, k = d_model, num_heads, head_dim
  g = h if num_kv_heads is None else num_kv_heads
  v = k if v_dim is None else v_dim
  return {"wq": (d, h, k), "wk": (d, g, k), "wv": (d, g, v), "wo": (h, v, d),
          "bq": (h, k), "bk": (g, k), "bv": (g, v), "bo": (d,)}


_in_init = jax.nn.initializers.variance_scaling(
    1.0, "fan_in", "truncated_normal", in_axis=0, out_axis=(1, 2))
_out_init = jax.nn.initializers.variance_scaling(
    1.0, "fan_in", "truncated_normal", in_axis=(0, 1), out_axis=2)
# Initializer of each param: LeCun normal over input features; zero biases.
PARAM_INITS = {"wq": _in_init, "wk": _in_init, "wv": _in_init, "wo": _out_init,
               "bq": jax.nn.initializers.zeros, "bk": jax.nn.initializers.zeros,
               "bv": jax.nn.initializers.zeros, "bo": jax.nn.initializers.zeros}


def check_attention_params(params: Params, variant: str | None = None
                           ) -> tuple[int, int, int]:
  """Validates the param dict's keys and shapes; returns (D, H, K).

  G (key/value heads) is read from params['wk'] and must divide H; see num_kv_heads_of.
  variant: also check that params hold exactly that variant's params (None: check the
  shapes of whichever are present).
  """
  if not isinstance(params, Mapping):
    raise ValueError(f"params must be a dict with keys {_WEIGHT_KEYS}; got {type(params).__name__}")
  missing = [k for k in _WEIGHT_KEYS if k not in params]
  if missing:
    raise ValueError(f"params is missing {missing}; it has keys {sorted(params)}")
  allowed = (_WEIGHT_KEYS + _BIAS_KEYS + (REL_BIAS, ALIBI) + _QK_NORM_KEYS + _NORM_REST_KEYS
             + _VARIANT_ONLY_KEYS + _MLA_KEYS)
  unknown = sorted(set(params) - set(allowed))
  if unknown:
    raise ValueError(f"params has unknown keys {unknown}; allowed: {allowed}")
  wq = params["wq"]
  _check_rank("params['wq']", wq, 3, "D, H, K")
  d, h, k = wq.shape
  wk = params["wk"]
  _check_rank("params['wk']", wk, 3, "D, G, K")
  g = wk.shape[1]
  if h and (g < 1 or h % g):
    raise ValueError(f"params['wk'] {tuple(wk.shape)} has G={g} key/value heads, which must "
                     f"divide the H={h} query heads of params['wq'] {tuple(wq.shape)} "
                     f"(grouped-query attention)")
  wv = params["wv"]
  _check_rank("params['wv']", wv, 3, "D, G, V")
  ins = {}
  if "wkv_a" in params:    # MLA: q and k/v project their own inputs
    d = _check_mla(params)
    ins = {"wq": wq.shape[0], "wk": wk.shape[0], "wv": wk.shape[0]}
  for name, shape in param_shapes(d, h, k, g, wv.shape[2]).items():
    shape = (ins[name],) + shape[1:] if name in ins else shape
    if name in params and tuple(params[name].shape) != shape:
      raise ValueError(f"params['{name}'] must have shape {shape} to match "
                       f"params['wq'] {tuple(wq.shape)} (D, H, K), params['wk'] "
                       f"{tuple(wk.shape)} (D, G, K) and params['wv'] {tuple(wv.shape)} "
                       f"(D, G, V); got {tuple(params[name].shape)}")
  if k < 1:
    raise ValueError(f"head width K read from params['wq'] must be >= 1; got shape {wq.shape}")
  for name, heads in (("q_norm", h), ("k_norm", g)):
    if name in params and tuple(params[name].shape) not in ((k,), (heads, k)):
      raise ValueError(f"params['{name}'] must have shape (K,) = ({k},) (per head) or "
                       f"({heads}, {k}) (over the whole projection); got "
                       f"{tuple(params[name].shape)}")
  for w, b, norm, heads in (("wq_rest", "bq_rest", "q_norm", h),
                            ("wk_rest", "bk_rest", "k_norm", g)):
    if w not in params and b not in params:
      continue
    rest = params.get(w)
    if (rest is None or norm not in params or tuple(params[norm].shape) != (heads, k)
        or rest.ndim != 3 or rest.shape[0] != d or rest.shape[2] != k):
      raise ValueError(f"params['{w}'] (removed heads' projections for the statistics of "
                       f"a whole-projection QK-norm) must be (D, n, K) = ({d}, n, {k}) with "
                       f"params['{norm}'] of shape ({heads}, {k}); got {w} "
                       f"{None if rest is None else tuple(rest.shape)}, {norm} "
                       f"{tuple(params[norm].shape) if norm in params else None}")
    if b in params and tuple(params[b].shape) != tuple(rest.shape[1:]):
      raise ValueError(f"params['{b}'] must have shape {tuple(rest.shape[1:])}; got "
                       f"{tuple(params[b].shape)}")
  if ALIBI in params and tuple(params[ALIBI].shape) != (h,):
    raise ValueError(f"params['alibi'] (ALiBi slopes) must have shape (H,) = ({h},); got "
                     f"{tuple(params[ALIBI].shape)}")
  if ALIBI in params and REL_BIAS in params:
    raise ValueError("params has both 'alibi' and 'rel_bias': one relative-position bias "
                     "per attention")
  if REL_BIAS in params:
    rb = params[REL_BIAS]
    if rb.ndim != 2 or rb.shape[0] != h or rb.shape[1] % 2 != 1:
      raise ValueError(f"params['rel_bias'] must have shape (H, 2R + 1) = ({h}, odd); got "
                       f"{tuple(rb.shape)}")
  _check_variant_params(params, variant, d, h, k)
  if wv.shape[2] != k and variant in ("gated", "differential"):
    raise ValueError(f"variant={variant!r} needs value heads as wide as the query/key "
                     f"heads; params['wv'] {tuple(wv.shape)} has V={wv.shape[2]}, K={k}")
  return d, h, k


def _check_mla(params: Params) -> int:
  """The model width D of an MLA attention's params, their shapes checked (_MLA_KEYS)."""
  shape = lambda n: tuple(params[n].shape) if n in params else None  # noqa: E731
  d = params["wo"].shape[-1]
  c, r = (shape("wkv_a") or (0, 0))[1], (shape("wk_rope") or (0, 0))[-1]
  q_in = shape("wq_a")[1] if "wq_a" in params else d
  want = {"wkv_a": (d, c), "kv_a_norm": (c,), "wk_rope": (d, r)}
  if "wq_a" in params or "q_a_norm" in params:
    want.update({"wq_a": (d, q_in), "q_a_norm": (q_in,)})
  bad = {n: shape(n) for n, w in want.items() if shape(n) != w}
  if bad or params["wk"].shape[0] != c + r or params["wq"].shape[0] != q_in:
    raise ValueError(f"MLA params must be wkv_a (D, C), kv_a_norm (C,), wk_rope (D, R), "
                     f"wk / wv (C + R, G, .), optional wq_a (D, Cq) with q_a_norm (Cq,), "
                     f"wq (Cq or D, H, K), D = {d} from wo; got "
                     f"{ {n: shape(n) for n in _MLA_KEYS + ('wq', 'wk', 'wv')} }")
  for n in _NORM_REST_KEYS + (REL_BIAS, ALIBI):
    if n in params:
      raise ValueError(f"params['{n}'] cannot be combined with MLA's latent keys")
  return d


def _mla_inputs(params: Params, x, ctx, val, eps: float = MLA_NORM_EPS):
  """(queries' input, keys' input, values' input) of an MLA attention: x, or its
  low-rank RMSNorm(x wq_a) * q_a_norm; the latent [RMSNorm(z wkv_a) * kv_a_norm,
  z wk_rope] of the keys' and values' inputs z. Each (..., features): 3-D, or 4-D
  per-head inputs (edge patching)."""
  def rms(y, scale):
    y32 = y.astype(jnp.float32)
    y32 = y32 * jax.lax.rsqrt(jnp.mean(y32 * y32, axis=-1, keepdims=True) + eps)
    return (y32 * scale.astype(jnp.float32)).astype(y.dtype)

  def lin(z, w):
    return jnp.einsum("...d,dc->...c", z, params[w].astype(z.dtype))

  def latent(z):
    return jnp.concatenate([rms(lin(z, "wkv_a"), params["kv_a_norm"]), lin(z, "wk_rope")], -1)
  q_in = x if "wq_a" not in params else rms(lin(x, "wq_a"), params["q_a_norm"])
  k_in = latent(ctx)
  return q_in, k_in, k_in if val is ctx else latent(val)


def _check_variant_params(params: Params, variant: str | None, d: int, h: int, k: int):
  """The variant's params are present with their shapes; no other variant's are."""
  present = [n for n in _VARIANT_ONLY_KEYS if n in params]
  if variant is None:    # shapes only; gated and gated_head told apart by wg's rank
    guess = ("gated" if "wg" in params and params["wg"].ndim == 3 else "gated_head")
    for v in (guess, "differential", "sink"):
      for n, shape in variant_param_shapes(v, d, h, k).items():
        if n in params and tuple(params[n].shape) != shape:
          raise ValueError(f"params['{n}'] must have shape {shape} ({v}); got "
                           f"{tuple(params[n].shape)}")
    return
  check_variant(variant)
  shapes = variant_param_shapes(variant, d, h, k)
  stray = [n for n in present if n not in shapes]
  if stray:
    raise ValueError(f"params has {stray}, which variant={variant!r} does not use; pass "
                     f"the variant the params were made for")
  if variant == "differential" and k % 2:
    raise ValueError(f"variant='differential' splits each head's query and key in two "
                     f"halves: the head width K={k} must be even")
  for n, shape in shapes.items():
    if n not in params:
      raise ValueError(f"variant={variant!r} needs params['{n}'] of shape {shape} "
                       f"(init_attention_params(..., variant={variant!r})); params has "
                       f"keys {sorted(params)}")
    if n in _VARIANT_ONLY_KEYS and tuple(params[n].shape) != shape:
      raise ValueError(f"params['{n}'] must have shape {shape} for variant={variant!r}; "
                       f"got {tuple(params[n].shape)}")


def num_heads_of(params: Params) -> int:
  """H, the query heads, read from params['wq'] (D, H, K)."""
  return int(params["wq"].shape[1])


def num_kv_heads_of(params: Params) -> int:
  """G, the key/value heads, read from params['wk'] (D, G, K); G = H unless grouped."""
  return int(params["wk"].shape[1])


# --------------------------------------------------------------------------
# Rotary position embeddings (RoPE, Su et al. 2021).
# --------------------------------------------------------------------------

ROPE_LAYOUTS = ("half", "interleaved")


@dataclasses.dataclass(frozen=True)
class RoPE:
  """Rotary position embedding of queries and keys (hashable: a static jit argument).

  Feature pair i of a head (i < dim / 2) turns by the angle p * theta_i at position p,
  theta_i = base ** (-2 i / dim), so a rotated query . key depends on positions only
  through their difference.

  Attributes:
    base: the frequency base (10000 in the paper and LLaMA-2, 500000 in LLaMA-3).
    layout: which features form a pair. "half" pairs i with i + dim/2 (Hugging Face
      rotate_half, GPT-NeoX, LLaMA checkpoints in HF layout); "interleaved" pairs 2i
      with 2i + 1 (the paper, GPT-J, Meta's original LLaMA code).
    dim: how many leading features of each head rotate (even); None = all K. The
      rest pass through (partial rotary, as in GPT-NeoX and Phi).
    inv_freq: the dim / 2 frequencies theta_i when they are not base ** (-2 i / dim)
      (scaled RoPE: linear, llama3, yarn; see mha_jax/models/rope_scaling.py); a tuple
      of floats, so the RoPE stays hashable.
    attention_factor: multiplies cos and sin (YaRN's and LongRoPE's attention
      scaling); 1 otherwise.
    max_positions: the length L0 past which the two length-dependent kinds below
      change the frequencies. The length L of a call is max(positions) + 1 (over the
      batch; with a KV cache, the cache's length plus T), as transformers takes it.
    dynamic_factor: NTK-aware dynamic scaling (transformers' "dynamic"): the base
      becomes base * (factor * L' / L0 - (factor - 1)) ** (dim / (dim - 2)) with
      L' = max(L, L0), computed in float32 per call.
    long_inv_freq: LongRoPE (Phi-3): these frequencies when L > L0, inv_freq (the
      short ones) otherwise.
  """
  base: float = 10000.0
  layout: str = "half"
  dim: int | None = None
  inv_freq: tuple | None = None
  attention_factor: float = 1.0
  max_positions: int | None = None
  dynamic_factor: float | None = None
  long_inv_freq: tuple | None = None

  def __post_init__(self):
    if self.layout not in ROPE_LAYOUTS:
      raise ValueError(f"RoPE layout must be one of {ROPE_LAYOUTS}; got {self.layout!r}")
    if (isinstance(self.base, bool) or not isinstance(self.base, (int, float, np.number))
        or not self.base > 0):
      raise ValueError(f"RoPE base must be a positive number; got {self.base!r}")
    if self.dim is not None and (
        isinstance(self.dim, bool) or not isinstance(self.dim, (int, np.integer))
        or self.dim < 2 or self.dim % 2):
      raise ValueError(f"RoPE dim (rotated features per head) must be an even integer "
                       f">= 2 or None; got {self.dim!r}")
    if self.inv_freq is not None and not isinstance(self.inv_freq, tuple):
      raise ValueError(f"RoPE inv_freq must be a tuple of floats (hashable) or None; got "
                       f"{type(self.inv_freq).__name__}")
    if not (isinstance(self.attention_factor, (int, float, np.number))
            and self.attention_factor > 0):
      raise ValueError(f"RoPE attention_factor must be a positive number; got "
                       f"{self.attention_factor!r}")
    if self.long_inv_freq is not None and not (isinstance(self.long_inv_freq, tuple)
                                                and self.inv_freq is not None):
      raise ValueError(f"RoPE long_inv_freq must be a tuple of floats, with inv_freq (the "
                       f"short ones); got {type(self.long_inv_freq).__name__}")
    if self.dynamic_factor is not None and self.long_inv_freq is not None:
      raise ValueError("RoPE takes dynamic_factor or long_inv_freq, not both")
    if self.dynamic_factor is not None and not (
        isinstance(self.dynamic_factor, (int, float, np.number)) and self.dynamic_factor > 0):
      raise ValueError(f"RoPE dynamic_factor must be a positive number; got "
                       f"{self.dynamic_factor!r}")
    by_length = self.dynamic_factor is not None or self.long_inv_freq is not None
    if by_length != (self.max_positions is not None):
      raise ValueError(f"RoPE max_positions (the switch length) goes with dynamic_factor "
                       f"or long_inv_freq, and they need it; got max_positions="
                       f"{self.max_positions!r}")
    if self.max_positions is not None and (isinstance(self.max_positions, bool) or not
                                           isinstance(self.max_positions, (int, np.integer))
                                           or self.max_positions < 1):
      raise ValueError(f"RoPE max_positions must be a positive integer; got "
                       f"{self.max_positions!r}")

  def rotated_dim(self, head_dim: int) -> int:
    """The number of rotated features for heads of width head_dim (checks dim <= K)."""
    dim = head_dim if self.dim is None else int(self.dim)
    if dim > head_dim:
      raise ValueError(f"RoPE dim={dim} exceeds the head width K={head_dim}")
    if dim % 2:
      raise ValueError(f"RoPE rotates feature pairs: the head width K={head_dim} is odd; "
                       f"pass RoPE(dim=an even number <= K)")
    return dim


def _check_positions(name: str, positions: Any, b: int, t: int, letter: str = "T") -> jax.Array:
  """(T,) or (B|1, T) integer positions -> (B|1, T)."""
  pos = jnp.asarray(positions)
  if not jnp.issubdtype(pos.dtype, jnp.integer):
    raise ValueError(f"{name} must be integer positions; got dtype {pos.dtype}")
  if pos.ndim == 1:
    pos = pos[None]
  if pos.ndim != 2 or pos.shape[1] != t or pos.shape[0] not in (1, b):
    raise ValueError(f"{name} must have shape ({letter},) = ({t},) or (B, {letter}) = "
                     f"({b}, {t}); got {tuple(jnp.shape(positions))}")
  return pos


def rope_frequencies(rope: RoPE, dim: int, positions_BT: jax.Array) -> jax.Array:
  """The dim / 2 float32 frequencies theta_i that rotate at `positions_BT` (B, T): fixed,
  or (dynamic_factor, long_inv_freq) chosen by the call's length max(positions) + 1."""
  half = dim // 2
  for name in ("inv_freq", "long_inv_freq"):
    got = getattr(rope, name)
    if got is not None and len(got) != half:
      raise ValueError(f"RoPE {name} has {len(got)} frequencies; rotating {dim} features "
                       f"needs {half}")
  if rope.dynamic_factor is not None:   # float32 throughout, as transformers computes it
    f32 = jnp.float32
    old = jnp.asarray(rope.max_positions, jnp.int32)
    length = jnp.maximum(jnp.max(positions_BT).astype(jnp.int32) + 1, old).astype(f32)
    f = f32(rope.dynamic_factor)
    base = f32(rope.base) * ((f * length / old.astype(f32)) - (f - 1)) ** f32(dim / (dim - 2))
    return 1.0 / base ** (jnp.arange(0, dim, 2).astype(f32) / f32(dim))
  if rope.inv_freq is not None:
    short = jnp.asarray(np.asarray(rope.inv_freq, np.float64), jnp.float32)
    if rope.long_inv_freq is None:
      return short
    long = jnp.asarray(np.asarray(rope.long_inv_freq, np.float64), jnp.float32)
    return jnp.where(jnp.max(positions_BT) + 1 > rope.max_positions, long, short)
  # theta_i = base^(-2i/dim), exact in float64, then float32 like the angles.
  return jnp.asarray(1.0 / float(rope.base) ** (np.arange(half, dtype=np.float64) * 2.0 / dim),
                     jnp.float32)


def apply_rope(x_BTHK: jax.Array, positions_BT: jax.Array, rope: RoPE) -> jax.Array:
  """Rotates each head's feature pairs by position: RoPE on queries or keys.

  Args:
    x_BTHK: (B, T, H, K) queries or keys (any number of heads).
    positions_BT: integer absolute positions, (B, T) or (T,).
    rope: a RoPE (base, layout, dim).

  Returns:
    (B, T, H, K) in x's dtype; angles and the rotation are computed in float32 (or
    wider, when x is).
  """
  if not isinstance(rope, RoPE):
    raise ValueError(f"rope must be an attention.RoPE; got {rope!r}")
  _check_rank("x_BTHK", x_BTHK, 4, "B, T, H, K")
  b, t, _, k = x_BTHK.shape
  pos_BT = _check_positions("positions", positions_BT, b, t)
  dim = rope.rotated_dim(k)
  half = dim // 2
  ang_BTF = pos_BT.astype(jnp.float32)[..., None] * rope_frequencies(rope, dim, pos_BT)
  cos, sin = jnp.cos(ang_BTF)[:, :, None], jnp.sin(ang_BTF)[:, :, None]   # (B, T, 1, F)
  if rope.attention_factor != 1.0:
    cos = cos * jnp.float32(rope.attention_factor)
    sin = sin * jnp.float32(rope.attention_factor)
  ct = jnp.promote_types(x_BTHK.dtype, jnp.float32)
  x = x_BTHK.astype(ct)
  if rope.layout == "half":
    x1, x2 = x[..., :half], x[..., half:dim]
  else:
    x1, x2 = x[..., 0:dim:2], x[..., 1:dim:2]
  r1, r2 = x1 * cos - x2 * sin, x2 * cos + x1 * sin
  if rope.layout == "half":
    rot = jnp.concatenate([r1, r2], axis=-1)
  else:
    rot = jnp.stack([r1, r2], axis=-1).reshape(*r1.shape[:-1], dim)
  if dim < k:
    rot = jnp.concatenate([rot, x[..., dim:]], axis=-1)
  return rot.astype(x_BTHK.dtype)


# --------------------------------------------------------------------------
# KV cache: keys and values of earlier tokens, for decoding one step at a time.
# --------------------------------------------------------------------------


def init_kv_cache(batch: int, max_len: int, num_kv_heads: int, head_dim: int,
                  dtype: Any = jnp.float32, v_dim: int | None = None
                  ) -> dict[str, jax.Array]:
  """An empty cache for one self-attention layer (a plain pytree; jit-friendly).

  Returns:
    {"k": (B, S_max, G, K) zeros, "v": (B, S_max, G, V) zeros (V = v_dim, default K),
    "length": int32 0}.
    Keys are stored after RoPE. Pass it as multi_head_attention(..., cache=cache);
    each call writes its T new keys and values at [length, length + T) and returns
    the cache with length + T.
  """
  for name, val in (("batch", batch), ("max_len", max_len), ("num_kv_heads", num_kv_heads),
                    ("head_dim", head_dim)):
    if not isinstance(val, (int, np.integer)) or isinstance(val, bool) or val < 1:
      raise ValueError(f"{name} must be a positive integer; got {val!r}")
  if v_dim is not None and (isinstance(v_dim, bool) or not isinstance(
      v_dim, (int, np.integer)) or v_dim < 1):
    raise ValueError(f"v_dim must be a positive integer or None; got {v_dim!r}")
  shape = (int(batch), int(max_len), int(num_kv_heads), int(head_dim))
  vshape = shape[:3] + (int(head_dim if v_dim is None else v_dim),)
  return {"k": jnp.zeros(shape, dtype), "v": jnp.zeros(vshape, dtype),
          "length": jnp.zeros((), jnp.int32)}


def _check_cache(cache: Any, b: int, g: int, k: int, t: int, v: int | None = None
                 ) -> tuple[int, jax.Array]:
  """Validates a KV cache for x (B, T, D); returns (S_max, length as int32)."""
  if not isinstance(cache, Mapping) or set(cache) != {"k", "v", "length"}:
    raise ValueError(f"cache must be a dict with keys ['k', 'length', 'v'] (from "
                     f"init_kv_cache); got "
                     f"{sorted(cache) if isinstance(cache, Mapping) else type(cache).__name__}")
  ck, cv = cache["k"], cache["v"]
  _check_rank("cache['k']", ck, 4, "B, S_max, G, K")
  if ck.shape[0] != b or ck.shape[2:] != (g, k):
    raise ValueError(f"cache['k'] must have shape (B, S_max, G, K) = ({b}, S_max, {g}, {k}) "
                     f"for x and params; got {tuple(ck.shape)}")
  want_v = tuple(ck.shape[:3]) + (k if v is None else v,)
  if tuple(getattr(cv, "shape", ())) != want_v:
    raise ValueError(f"cache['v'] must have shape (B, S_max, G, V) = {want_v}; got "
                     f"{getattr(cv, 'shape', cv)}")
  s_max = ck.shape[1]
  if t > s_max:
    raise ValueError(f"x has T={t} tokens, more than the cache holds (S_max={s_max})")
  length = jnp.asarray(cache["length"])
  if length.ndim != 0 or not jnp.issubdtype(length.dtype, jnp.integer):
    raise ValueError(f"cache['length'] must be an integer scalar; got shape "
                     f"{length.shape} dtype {length.dtype}")
  # Traced under jit: checked by a NaN guard. (Not try/except: building JAX's
  # ConcretizationTypeError costs ~25 ms, once per layer in every traced forward.)
  n = None if isinstance(length, jax.core.Tracer) else int(length)
  if n is not None and not 0 <= n <= s_max - t:
    raise ValueError(f"cache['length']={n} plus T={t} new tokens exceeds the cache's "
                     f"S_max={s_max} (or is negative)")
  return s_max, length.astype(jnp.int32)


# --------------------------------------------------------------------------
# Kernels live in mha_jax/kernels/ (reference, xla, blocked, pallas); dispatch.py
# holds the impl switch and `auto`. All take (B, T, H, K) q and (B, S, G, K) k, v.
# --------------------------------------------------------------------------

resolve_impl = _dispatch.resolve_impl


# --------------------------------------------------------------------------
# The layer.
# --------------------------------------------------------------------------


def qk_rms_norm(x_BTHK: jax.Array, scale: jax.Array, eps: float,
                rest_BTRK: jax.Array | None = None) -> jax.Array:
  """RMSNorm of queries or keys (B, T, H, K) in float32: per head with a (K,) scale, or
  over all H * K features of a token at once with an (H, K) scale (OLMo 2). rest_BTRK:
  removed heads' projections (B, T, R, K) whose squares count in that whole-projection
  mean (over (H + R) * K features); they are not returned."""
  ct = jnp.promote_types(x_BTHK.dtype, jnp.float32)
  x = x_BTHK.astype(ct)
  axes = (-1,) if scale.ndim == 1 else (-2, -1)
  if rest_BTRK is None:
    ms = jnp.mean(x * x, axis=axes, keepdims=True)
  else:
    r = rest_BTRK.astype(ct)
    n = (x.shape[-2] + r.shape[-2]) * x.shape[-1]
    ms = (jnp.sum(x * x, axis=axes, keepdims=True)
          + jnp.sum(r * r, axis=axes, keepdims=True)) / n
  y = x * jax.lax.rsqrt(ms + eps)
  return (y * scale.astype(y.dtype)).astype(x_BTHK.dtype)


def _check_4d(name: str, arr: jax.Array, b: int, h: int, t: int, s: int) -> jax.Array:
  """(T, S) -> (1, 1, T, S); refuses what does not broadcast to (B, H, T, S)."""
  if arr.ndim == 2:
    arr = arr[None, None]
  if arr.ndim != 4:
    raise ValueError(f"{name} must have rank 4 (B, H, T, S) or rank 2 (T, S); got shape "
                     f"{arr.shape}. For a per-example (B, T, S) {name} pass {name}[:, None]")
  for got, want, letter in zip(arr.shape, (b, h, t, s), "BHTS"):
    if got not in (1, want):
      raise ValueError(f"{name} of shape {arr.shape} does not broadcast to (B, H, T, S) = "
                       f"{(b, h, t, s)}: its {letter} dimension is {got}")
  return arr


def _check_float(name: str, arr: Any) -> None:
  if not jnp.issubdtype(arr.dtype, jnp.floating):
    raise ValueError(f"{name} must be a float array (embeddings, not token ids); got dtype "
                     f"{arr.dtype}")


def _check_mask(mask: Any, b: int, h: int, t: int, s: int) -> jax.Array:
  mask = jnp.asarray(mask)
  if mask.dtype != jnp.bool_:
    raise ValueError(f"mask must be boolean (True = may attend); got dtype {mask.dtype}")
  return _check_4d("mask", mask, b, h, t, s)


def _check_bias(bias: Any, b: int, h: int, t: int, s: int) -> jax.Array:
  bias = jnp.asarray(bias)
  if not jnp.issubdtype(bias.dtype, jnp.floating):
    raise ValueError(f"bias must be a float array added to the scores; got dtype {bias.dtype}")
  return _check_4d("bias", bias, b, h, t, s)


def _check_gates(head_gates: Any, b: int, h: int) -> jax.Array:
  g = jnp.asarray(head_gates)
  if g.ndim == 1 and g.shape[0] == h:
    return g[None, None, :, None]
  if g.ndim == 2 and g.shape == (b, h):
    return g[:, None, :, None]
  raise ValueError(f"head_gates must have shape (H,) = ({h},) or (B, H) = ({b}, {h}); "
                   f"got {g.shape}")


def _project(inp_BTD: jax.Array, w_DHK: jax.Array, b_HK: jax.Array | None = None
             ) -> jax.Array:
  """(B, T, D) x (D, H, K) (+ (H, K)) -> (B, T, H, K) as one full-width (B*T, D) x
  (D, H*K) matmul; the heads are a reshape of its output. (2-D matmuls: XLA:CPU then
  needs no transposes of the residual stream's gradient, which it was fusing,
  recomputed, into every consumer: measured 1.1x.)"""
  if inp_BTD.ndim == 4:    # head_inputs: head n projects its own input (B, T, N, D)
    y = jnp.einsum("btnd,dnk->btnk", inp_BTD, w_DHK.astype(inp_BTD.dtype))
    return y if b_HK is None else y + b_HK.astype(inp_BTD.dtype)
  bb, tt, dd = inp_BTD.shape
  w2 = w_DHK.reshape(dd, w_DHK.shape[1] * w_DHK.shape[2]).astype(inp_BTD.dtype)
  y_BTHK = (inp_BTD.reshape(bb * tt, dd) @ w2).reshape(bb, tt, *w_DHK.shape[1:])
  return y_BTHK if b_HK is None else y_BTHK + b_HK.astype(inp_BTD.dtype)


def _project_shared(jobs) -> dict[str, jax.Array]:
  """{name: (B, T, N, K)} of jobs [(name, input (B, T, D), w (D, N, K), b (N, K) or
  None)], each after its bias.

  Jobs that read the same input array with the same K (self-attention: q, k, v and
  the gated variant's gate; cross-attention: k and v) are one matmul of their weights
  concatenated along the head axis, (D, H + 2G, K), split after: one pass over the
  input instead of three, and one larger matmul in forward and backward. The params
  keep their names.
  """
  groups: list[list] = []
  for job in jobs:
    for grp in groups:
      if grp[0][1] is job[1] and grp[0][2].shape[2] == job[2].shape[2]:
        grp.append(job)
        break
    else:
      groups.append([job])
  out = {}
  for grp in groups:
    ws = [w for _, _, w, _ in grp]
    y = _project(grp[0][1], ws[0] if len(ws) == 1 else jnp.concatenate(ws, axis=1))
    starts = np.cumsum([0] + [w.shape[1] for w in ws])
    for (name, _, _, bias), a, z in zip(grp, starts[:-1], starts[1:]):
      part = y if len(ws) == 1 else y[:, :, a:z]
      out[name] = part if bias is None else part + bias.astype(part.dtype)
  return out


class _Call(NamedTuple):
  """A checked call of multi_head_attention: sizes and normalised arguments."""
  d: int
  h: int
  k: int
  g: int
  b: int
  t: int
  s: int
  ctx: jax.Array          # keys' input (B, S, D)
  val: jax.Array          # values' input (B, S, D)
  length: Any             # the cache's length (0 without one)
  mask: Any
  bias: Any
  gates: Any              # head_gates as (B|1, 1, H, 1)
  q_pos: Any
  k_pos: Any
  variant: str
  sigmoid_bias: float | None
  lambda_init: float


def _check_inputs(x, context, value_input, d: int):
  """(keys' input, values' input) after checking x, context and value_input."""
  _check_rank("x", x, 3, "B, T, D")
  _check_float("x", x)
  if context is not None:
    _check_rank("context", context, 3, "B, S, D")
    _check_float("context", context)
  ctx = x if context is None else context
  if x.shape[-1] != d:
    raise ValueError(f"x has d_model={x.shape[-1]} (shape {x.shape}) but params['wq'] "
                     f"expects D={d}")
  if ctx.shape[-1] != d:
    raise ValueError(f"context has d_model={ctx.shape[-1]} (shape {ctx.shape}) but "
                     f"params['wk'] expects D={d}")
  if ctx.shape[0] != x.shape[0]:
    raise ValueError(f"context batch {ctx.shape[0]} differs from x batch {x.shape[0]}")
  val = ctx if value_input is None else value_input
  if value_input is not None and (not hasattr(val, "shape") or val.shape != ctx.shape):
    raise ValueError(f"value_input must have the keys' input shape {tuple(ctx.shape)}; "
                     f"got {getattr(val, 'shape', val)}")
  if value_input is not None:
    _check_float("value_input", value_input)
  return ctx, val


def _check_options(impl, window, scale, softcap, rope, positions, kv_positions, context,
                   variant, sigmoid_bias) -> None:
  if impl not in IMPLS:
    raise ValueError(f"impl must be one of {IMPLS}; got {impl!r}")
  if window is not None and (isinstance(window, bool) or not isinstance(
      window, (int, np.integer)) or window < 1):
    raise ValueError(f"window must be a positive integer or None; got {window!r}")
  for name, num in (("scale", scale), ("softcap", softcap)):
    if num is not None and (isinstance(num, bool) or not isinstance(
        num, (int, float, np.number)) or not num > 0):
      raise ValueError(f"{name} must be a positive number or None; got {num!r}")
  if rope is not None and not isinstance(rope, RoPE):
    raise ValueError(f"rope must be an attention.RoPE or None; got {rope!r}")
  if rope is None and (positions is not None or kv_positions is not None):
    raise ValueError("positions and kv_positions only place the rotary embedding; pass "
                     "rope=attention.RoPE(...) with them")
  if kv_positions is not None and context is None:
    raise ValueError("kv_positions are for cross-attention (with context); in "
                     "self-attention the keys use the queries' positions")
  if sigmoid_bias is not None and variant != "sigmoid":
    raise ValueError(f"sigmoid_bias is the bias of variant='sigmoid'; got it with "
                     f"variant={variant!r}")
  if sigmoid_bias is not None and (isinstance(sigmoid_bias, bool) or not isinstance(
      sigmoid_bias, (int, float, np.number)) or not math.isfinite(sigmoid_bias)):
    raise ValueError(f"sigmoid_bias must be a finite number or None; got {sigmoid_bias!r}")


def _check_call(params, x, context, value_input, mask, causal, bias, head_gates, impl,
                rope, positions, kv_positions, cache, window, scale, softcap, variant,
                sigmoid_bias, layer) -> _Call:
  """Every argument of multi_head_attention checked, bad ones refused by name."""
  d, h, k = check_attention_params(params, check_variant(variant))
  ctx, val = _check_inputs(x, context, value_input, d)
  if not isinstance(causal, (bool, np.bool_)):
    raise ValueError(f"causal must be a bool; got {causal!r}")
  b, t, _ = x.shape
  s = ctx.shape[1]
  g = num_kv_heads_of(params)
  length = 0
  if cache is not None:
    if context is not None or value_input is not None:
      raise ValueError("cache is for self-attention (decoding); got it together with "
                       "context or value_input")
    s, length = _check_cache(cache, b, g, k, t, params["wv"].shape[2])
  if mask is not None:
    mask = _check_mask(mask, b, h, t, s)
  gates = None if head_gates is None else _check_gates(head_gates, b, h)
  if bias is not None:
    bias = _check_bias(bias, b, h, t, s)
  _check_options(impl, window, scale, softcap, rope, positions, kv_positions, context,
                 variant, sigmoid_bias)
  lambda_init = diff_lambda_init(layer)
  q_pos = k_pos = None
  if rope is not None:
    rope.rotated_dim(k // 2 if variant == "differential" else k)
    q_pos = (length + jnp.arange(t)[None] if positions is None
             else _check_positions("positions", positions, b, t))
    if context is None:
      k_pos = q_pos
    else:
      k_pos = (jnp.arange(s)[None] if kv_positions is None
               else _check_positions("kv_positions", kv_positions, b, s, "S"))
  if variant == "sigmoid" and sigmoid_bias is None:
    sigmoid_bias = -math.log(s) if s else 0.0
  return _Call(d, h, k, g, b, t, s, ctx, val, length, mask, bias, gates, q_pos, k_pos,
               variant, None if sigmoid_bias is None else float(sigmoid_bias), lambda_init)


def _rope_heads(x_BTHK: jax.Array, pos, rope: RoPE, halves: bool) -> jax.Array:
  """RoPE of each head, or of each half-head (differential: the halves are the heads)."""
  if not halves:
    return apply_rope(x_BTHK, pos, rope)
  b, t, n, k = x_BTHK.shape
  return apply_rope(x_BTHK.reshape(b, t, 2 * n, k // 2), pos, rope).reshape(b, t, n, k)


def _prepare_qkv(params: Params, x: jax.Array, c: _Call, rope, qk_norm_eps: float, site):
  """(q (B, T, H, K) or None when H = 0, k, v (B, S, G, K), the gated variant's gate
  logits (B, T, H, K) or None): projected, QK-normed, rotated and through their sites."""
  jobs = ([("q", x, params["wq"], params.get("bq"))] if c.h else []) + [
      ("k", c.ctx, params["wk"], params.get("bk")), ("v", c.val, params["wv"], params.get("bv"))]
  if c.variant == "gated" and c.h:
    jobs.append(("g", x, params["wg"], params["bg"]))
  proj = _project_shared(jobs)
  halves = c.variant == "differential"
  k_BSGK, v_BSGK = proj["k"], proj["v"]
  if "k_norm" in params:
    k_BSGK = qk_rms_norm(k_BSGK, params["k_norm"], qk_norm_eps, None if "wk_rest" not in
                         params else _project(c.ctx, params["wk_rest"], params.get("bk_rest")))
  if rope is not None:
    k_BSGK = _rope_heads(k_BSGK, c.k_pos, rope, halves)
  if site is not None:
    k_BSGK, v_BSGK = site("k", k_BSGK), site("v", v_BSGK)
  if not c.h:
    return None, k_BSGK, v_BSGK, None
  q_BTHK = proj["q"]
  if "q_norm" in params:
    q_BTHK = qk_rms_norm(q_BTHK, params["q_norm"], qk_norm_eps, None if "wq_rest" not in
                         params else _project(x, params["wq_rest"], params.get("bq_rest")))
  if rope is not None:
    q_BTHK = _rope_heads(q_BTHK, c.q_pos, rope, halves)
  if site is not None:
    q_BTHK = site("q", q_BTHK)
  return q_BTHK, k_BSGK, v_BSGK, proj.get("g")


def _write_cache(cache, k_BSGK, v_BSGK, c: _Call, causal: bool, window):
  """(k, v over the cache's S_max slots, mask, causal=False, new cache): the T new keys
  and values written at [length, length + T), the slots each query may read as a mask."""
  length, t, s = c.length, c.t, c.s
  at = (jnp.int32(0), length, jnp.int32(0), jnp.int32(0))
  new_cache = {
      "k": jax.lax.dynamic_update_slice(cache["k"], k_BSGK.astype(cache["k"].dtype), at),
      "v": jax.lax.dynamic_update_slice(cache["v"], v_BSGK.astype(cache["v"].dtype), at),
      "length": length + t}
  slot_S = jnp.arange(s)
  if causal:  # key slot j <= the query's slot length + i
    valid = (slot_S[None, :] <= length + jnp.arange(t)[:, None])[None, None]
  else:
    valid = (slot_S < length + t)[None, None, None]
  if window is not None:   # slots within the window of the query's slot
    valid = valid & (length + jnp.arange(t)[:, None] - slot_S[None, :] < window)[None, None]
  mask = valid if c.mask is None else c.mask & valid
  dtype = k_BSGK.dtype
  return new_cache["k"].astype(dtype), new_cache["v"].astype(dtype), mask, False, new_cache


def _zero_heads(params: Params, x: jax.Array, c: _Call, site, return_weights: bool):
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


_PATTERN_SITES = ("pattern", "pattern2", "sink_weight")


def _edit_patterns(site, outs: list, v_BSGK: jax.Array, variant: str) -> list:
  """The reference kernel's [(o, w)] (two for differential) after the pattern sites:
  sink_weight (B, H, T) = 1 - the pattern's row sum, then pattern, then pattern2; an
  edited map is what mixes the values."""
  o, w = outs[0]
  if variant == "sink" and site.wants("sink_weight"):
    sw_BHT = 1.0 - jnp.sum(w, axis=-1)
    edited = site("sink_weight", sw_BHT)
    if edited is not sw_BHT:   # the keys share what the sink leaves
      left = 1.0 - sw_BHT
      ratio = jnp.where(left > 0, (1.0 - edited) / jnp.where(left > 0, left, 1.0), 0.0)
      w = w * ratio[..., None]
      o = mix_values(w, v_BSGK)
  if site.wants("pattern"):
    edited = site("pattern", w)
    if edited is not w:
      w, o = edited, mix_values(edited, v_BSGK)
  outs = [(o, w)] + outs[1:]
  if variant == "differential" and site.wants("pattern2"):
    o2, w2 = outs[1]
    edited = site("pattern2", w2)
    if edited is not w2:
      outs[1] = (mix_values(edited, v_BSGK), edited)
  return outs


def diff_lambda(params: Params, lambda_init: float) -> jax.Array:
  """(H,) float32: differential attention's lambda_h = exp(lambda_q1 . lambda_k1) -
  exp(lambda_q2 . lambda_k2) + lambda_init (Ye et al. 2025, eq. 2); a head's effective
  map is pattern - lambda_h pattern2."""
  f32 = jnp.float32
  dot = lambda a, b: jnp.sum(params[a].astype(f32) * params[b].astype(f32), axis=-1)
  return (jnp.exp(dot("lambda_q1", "lambda_k1")) - jnp.exp(dot("lambda_q2", "lambda_k2"))
          + lambda_init)


def _differential_heads(params: Params, o1_BTHK, o2_BTHK, lambda_init: float):
  """(o1 - lambda_h o2), RMS-normed per head with scale diff_norm (K,), times
  (1 - lambda_init); lambda_h = exp(lambda_q1 . lambda_k1) - exp(lambda_q2 . lambda_k2)
  + lambda_init (Ye et al. 2025, eq. 2-3), in float32."""
  f32 = jnp.float32
  lam_H = diff_lambda(params, lambda_init)
  o = o1_BTHK.astype(f32) - lam_H[:, None] * o2_BTHK.astype(f32)
  o = o * jax.lax.rsqrt(jnp.mean(o * o, axis=-1, keepdims=True) + DIFF_NORM_EPS)
  o = o * params["diff_norm"].astype(f32) * (1.0 - lambda_init)
  return o.astype(o1_BTHK.dtype)


def alibi_slopes(num_heads: int) -> np.ndarray:
  """(H,) float32 ALiBi slopes as BLOOM makes them: 2^(-8 i / n) for i = 1..n, n the
  largest power of two <= H, then every other slope of the 2n sequence for the rest."""
  n = 2 ** int(math.floor(math.log2(num_heads)))
  base = np.float32(2 ** (-(2 ** -(math.log2(n) - 3))))
  slopes = [base ** np.float32(i) for i in range(1, n + 1)]
  if n != num_heads:
    extra = np.float32(2 ** (-(2 ** -(math.log2(2 * n) - 3))))
    slopes += [extra ** np.float32(i) for i in range(1, 2 * (num_heads - n), 2)]
  return np.asarray(slopes, np.float32)


def position_table(params: Params, t: int, s: int):
  """The (H, 2R + 1) relative-position table of the call: params' rel_bias, or ALiBi's
  slope_h * offset over every offset of T queries and S keys (R = max(T, S) - 1, so no
  offset is clipped; with a cache, S = S_max covers the cache's length); None."""
  if ALIBI not in params:
    return params.get(REL_BIAS)
  r = max(t, s, 2) - 1
  slopes = params[ALIBI].astype(jnp.float32)
  return slopes[:, None] * jnp.arange(-r, r + 1, dtype=jnp.float32)[None]


def _attend(params: Params, q_BTHK, k_BSGK, v_BSGK, c: _Call, mask, causal: bool, impl: str,
            return_weights: bool, window, scale, softcap, site, cached: bool):
  """(o (B, T, H, K), w (B, H, T, S) or None): the kernel's call (two for differential)."""
  h, g, t, s = c.h, c.g, c.t, c.s
  bias = c.bias
  site_pattern = site is not None and any(site.wants(n) for n in _PATTERN_SITES)
  if site is not None and (site.wants("k_q") or site.wants("v_q")):   # G = H from here
    k_BSGK = site("k_q", jnp.repeat(k_BSGK, h // g, axis=2))
    v_BSGK = site("v_q", jnp.repeat(v_BSGK, h // g, axis=2))
  if c.variant == "differential":   # two maps over the halves of each query and key
    half = c.k // 2
    pairs = [(q_BTHK[..., :half], k_BSGK[..., :half]), (q_BTHK[..., half:], k_BSGK[..., half:])]
  else:
    pairs = [(q_BTHK, k_BSGK)]
  if scale is not None:   # the kernels divide by sqrt(width): q carries the rest
    width = pairs[0][0].shape[-1]
    pairs = [(qi * jnp.asarray(scale * math.sqrt(width), qi.dtype), ki) for qi, ki in pairs]
  table = position_table(params, t, s)
  window_left = window is not None and not cached
  kernel = "reference" if site_pattern else resolve_impl(
      impl, pairs[0][0], return_weights, bias is not None or table is not None,
      k_BSGK=pairs[0][1], has_mask=mask is not None or window_left,
      has_softcap=softcap is not None, variant=c.variant)
  if v_BSGK.shape[-1] != pairs[0][1].shape[-1] and kernel not in ("reference", "blocked"):
    if impl != "auto":
      raise ValueError(f"impl={impl!r} needs value heads as wide as the query/key heads; "
                       f"V={v_BSGK.shape[-1]} != K={pairs[0][1].shape[-1]} is served by "
                       f"'reference' and 'blocked' (or 'auto')")
    kernel = "blocked"
  kernel_window = None
  if window_left and kernel in _dispatch.TAKES_WINDOW:
    kernel_window = window
  elif window_left:
    band = (jnp.arange(t)[:, None] - jnp.arange(s)[None, :] < window)[None, None]
    mask = band if mask is None else mask & band
  if table is not None and (kernel not in _dispatch.TAKES_TABLE or cached):
    rel = relative_bias(table, t, s, c.length)    # dense (1, H, T, S)
    bias = rel if bias is None else bias + rel
    table = None
  extra = {"softcap": softcap, "window": kernel_window}
  if c.variant == "sigmoid":
    extra["sigmoid_bias"] = c.sigmoid_bias
  if c.variant == "sink":
    extra["sink_H"] = params["sink_logit"]
  outs = [_dispatch.run_kernel(kernel, qi, ki, v_BSGK, mask, causal, bias, table, **extra)
          for qi, ki in pairs]
  if site_pattern:
    outs = _edit_patterns(site, outs, v_BSGK, c.variant)
  o_BTHK, w_BHTS = outs[0]
  if c.variant == "differential":
    o_BTHK = _differential_heads(params, o_BTHK, outs[1][0], c.lambda_init)
  return o_BTHK, w_BHTS


def _output(params: Params, x: jax.Array, o_BTHK, gate_BTHK, c: _Call, site):
  """(y (B, T, D), the heads (B, T, H, K) that W_O reads): the variant's gate, head
  gates, the z and result sites, W_O and bo."""
  b, t, h, d = c.b, c.t, c.h, c.d
  k = o_BTHK.shape[-1]     # V, the value heads' width
  if c.variant == "gated_head":
    gate_BTHK = (x.reshape(b * t, d) @ params["wg"].astype(x.dtype)).reshape(b, t, h)
    gate_BTHK = gate_BTHK + params["bg"].astype(x.dtype)
  if c.variant in ("gated", "gated_head"):
    gate = jax.nn.sigmoid(gate_BTHK)
    if site is not None:
      gate = site("gate", gate)
    o_BTHK = o_BTHK * (gate if c.variant == "gated" else gate[..., None]).astype(o_BTHK.dtype)
  if c.gates is not None:
    o_BTHK = o_BTHK * c.gates.astype(o_BTHK.dtype)
  if site is not None:
    o_BTHK = site("z", o_BTHK)
  if site is not None and site.wants("result"):
    r_BTHD = jnp.einsum("bthk,hkd->bthd", o_BTHK, params["wo"].astype(o_BTHK.dtype))
    y_BTD = site("result", r_BTHD).sum(axis=2)
  else:
    y_BTD = (o_BTHK.reshape(b * t, h * k) @ params["wo"].reshape(h * k, d).astype(
        o_BTHK.dtype)).reshape(b, t, d)
  if "bo" in params:
    y_BTD = y_BTD + params["bo"].astype(y_BTD.dtype)
  return y_BTD, o_BTHK


def _check_head_inputs(inputs, q_shape, kv_shape, context, params) -> None:
  if context is not None or "wq_rest" in params or "wk_rest" in params:
    raise ValueError("head_inputs are for self-attention without removed heads' QK-norm "
                     "statistics")
  if not isinstance(inputs, (tuple, list)) or len(inputs) != 3:
    raise ValueError("head_inputs must be (q (B, T, H, D), k (B, S, G, D), v (B, S, G, D))")
  for name, arr, shape in zip("qkv", inputs, (q_shape, kv_shape, kv_shape)):
    if tuple(arr.shape) != shape:
      raise ValueError(f"head_inputs {name} must have shape {shape}; got {tuple(arr.shape)}")


def multi_head_attention(params: Params, x: jax.Array, context: jax.Array | None = None, *,
                         value_input: jax.Array | None = None,
                         mask: jax.Array | None = None, causal: bool = False,
                         bias: jax.Array | None = None,
                         head_gates: jax.Array | None = None, impl: str = "auto",
                         return_weights: bool = False, rope: RoPE | None = None,
                         positions: jax.Array | None = None,
                         kv_positions: jax.Array | None = None,
                         cache: Mapping[str, jax.Array] | None = None,
                         window: int | None = None, scale: float | None = None,
                         softcap: float | None = None, qk_norm_eps: float = 1e-6,
                         variant: str = "softmax", sigmoid_bias: float | None = None,
                         layer: int = 0, site: Any = None, head_inputs: Any = None):
  """Multi-head attention of x over itself, or over `context` (cross-attention).

  Args:
    params: {"wq": (D, H, K), "wk": (D, G, K), "wv": (D, G, V), "wo": (H, V, D)},
      optional {"bq": (H, K), "bk": (G, K), "bv": (G, V), "bo": (D,)}, optional
      "rel_bias" (H, 2R + 1) or "alibi" (H,). V, the value heads' width, is K unless
      the model says otherwise (DeepSeek's MLA); V != K runs on the reference and
      blocked kernels (auto picks among them) and not with gated / differential.
      H, G and K are read from the shapes; G (key/value heads) divides H, and query
      head i reads key/value head i // (H // G) (grouped-query attention).
    x: (B, T, D) queries' input.
    context: (B, S, D) keys' and values' input; None means x (self-attention).
    value_input: (B, S, D) values' input when it differs from the keys' (e.g. positions
      in Q and K only, as in Shortformer); None means context.
    mask: boolean, True = may attend; (B|1, H|1, T|1, S|1) or (T, S). H is per
      query head, as are bias, head_gates and the returned weights and heads.
    causal: also forbid attending to later positions (key j > query i).
    bias: float, added to the scaled scores before the softmax; (B|1, H|1, T|1, S|1)
      or (T, S) (e.g. ALiBi). A params["rel_bias"] table adds its relative-position
      bias on top.
    head_gates: (H,) or (B, H); multiplies each head's output before W_O.
    impl: "reference" (explicit weights), "xla" (jax.nn.dot_product_attention),
      "cudnn" (GPU, bf16/f16), "blocked" (flash-style, pure JAX, O(T) memory),
      "pallas" (Pallas flash kernels on GPU/TPU), or "auto": reference when weights
      are asked for, else the fastest that can serve the call on this backend and
      never one whose scores would not fit in memory (mha_jax/kernels/dispatch.py).
    return_weights: also return the weights and the per-head outputs.
    rope: a RoPE: rotary position embedding of q and k after their projections and
      biases (values are not rotated). None: no rotation.
    positions: integer absolute positions of the queries, (B, T) or (T,); default
      arange(T). Only with rope. In self-attention the keys use them too.
    kv_positions: integer positions of the keys with `context`, (B, S) or (S,);
      default arange(S). Only with rope and context.
    cache: a KV cache from init_kv_cache (self-attention only). x's keys and values
      (rotated at positions, default length + arange(T)) are written at
      [length, length + T); the T queries attend over the whole cache: key slot j
      counts when j < length + T and, with causal, when j <= length + i. mask and
      bias then have S = S_max (e.g. a prompt's padding). Works under jit with a
      traced length; a write past S_max raises when length is concrete and gives NaN
      outputs when it is traced.
    window: a sliding window (Mistral, Gemma 2/3): query i may read key j only when
      i - j < window (in slots: with a cache, the query's slot is length + i), on top
      of mask and causal. Every kernel serves it: blocked skips the key blocks wholly
      outside it (cost ~ T * window), the others read it as a boolean band mask.
    scale: multiplies the dot products q . k; None means 1 / sqrt(K) (Gemma's
      query_pre_attn_scalar ** -0.5, GPT-2's 1 / (sqrt(K) * (layer + 1)) differ).
    softcap: attention-logit soft-capping (Gemma 2): the scaled scores become
      softcap * tanh(scores / softcap) before bias and mask. Served by reference,
      blocked and xla (which then runs the building blocks: jax.nn's fused attention
      takes no cap), pallas through TPU splash only; cudnn refuses it.
    qk_norm_eps: epsilon of the QK-norm when params hold "q_norm" / "k_norm" (RMSNorm of
      each head's query and key, scale (K,), or of the whole projection, scale (H, K)
      and (G, K)), applied after the projections' biases and before RoPE.
    variant: one of VARIANTS (the constant's comment gives each one's equation):
      "softmax" (the default), "gated", "gated_head", "differential", "sigmoid",
      "sink", "qk_norm"; params must hold that variant's params
      (init_attention_params(..., variant=...)). differential, sigmoid and sink run in
      the reference and blocked kernels only (auto picks among those; the others
      refuse them by name); the rest in every kernel. With return_weights, weights are
      the sigmoid weights (sigmoid), the keys' softmax weights summing to 1 minus the
      sink's (sink), the first map (differential).
    sigmoid_bias: b of variant="sigmoid"; None means -log(S), S the number of key
      positions of the call (with a cache, S_max: pass b to decode as the model was
      trained).
    layer: the layer's index from 0, read by variant="differential" only:
      lambda_init = 0.8 - 0.6 exp(-0.3 layer) (diff_lambda_init).
    site: None, or a hook (mha_jax/interventions.py; the core imports nothing for it):
      an object with `site(name, x) -> x` and `site.wants(name) -> bool`. It is called
      with "k", "v" (B, S, G, K) and "q" (B, T, H, K) after their biases and RoPE;
      "k_q", "v_q" (B, S, H, K), the keys and values as each query head reads them
      (repeat_kv order), only when wanted (the rest then runs with G = H); "pattern"
      (B, H, T, S), only when wanted (it forces the reference kernel; an edited pattern
      is what mixes the values); by variant, also only when wanted: "pattern2"
      (B, H, T, S) differential's second map, "sink_weight" (B, H, T) the sink's
      weight (an edit rescales the pattern's row to 1 minus it), both forcing the
      reference kernel, and "gate" (B, T, H, K) (gated) or (B, T, H) (gated_head) the
      sigmoid gate; "z" (B, T, H, K) after the gates; "result"
      (B, T, H, D), each head's output after W_O, only when wanted (the layer's output
      is then their sum plus bo). Whatever it returns flows on.
    head_inputs: None, or (q (B, T, H, D), k (B, S, G, D), v (B, S, G, D)): each head's
      own input to its projection in place of x / context / value_input (edge patching:
      every head reads its own residual); self-attention (with a cache: the T new
      tokens' inputs, S = T).

  Returns:
    y_BTD (B, T, D), or AttentionOutput(out, weights (B, H, T, S), heads (B, T, H, K))
    when return_weights is True. With a cache: (that, new_cache), new_cache's length
    being length + T, and S = S_max.
  """
  c = _check_call(params, x, context, value_input, mask, causal, bias, head_gates, impl,
                  rope, positions, kv_positions, cache, window, scale, softcap, variant,
                  sigmoid_bias, layer)
  if c.h == 0 and cache is None:
    return _zero_heads(params, x, c, site, return_weights)
  if head_inputs is not None:    # edge patching: each head reads its own input
    _check_head_inputs(head_inputs, (c.b, c.t, c.h, c.d),   # with a cache: the T new keys
                       (c.b, c.t if cache is not None else c.s, c.g, c.d), context, params)
    x = head_inputs[0]
    c = c._replace(ctx=head_inputs[1], val=head_inputs[2])
  x_q = x
  if "wkv_a" in params:
    x_q, ctx, val = _mla_inputs(params, x, c.ctx, c.val)
    c = c._replace(ctx=ctx, val=val)
  q_BTHK, k_BSGK, v_BSGK, gate_BTHK = _prepare_qkv(params, x_q, c, rope, qk_norm_eps, site)
  mask, new_cache = c.mask, None
  if cache is not None:
    k_BSGK, v_BSGK, mask, causal, new_cache = _write_cache(cache, k_BSGK, v_BSGK, c, causal,
                                                           window)
  # Without a cache, a window goes to the kernels that skip the blocks outside it
  # (TAKES_WINDOW); the others get it as a band mask once the kernel is known.

  def finish(result):
    return result if new_cache is None else (result, new_cache)

  if c.h == 0:  # still keeps the cache up to date (the keys are the kv heads')
    return finish(_zero_heads(params, x, c, site, return_weights))
  o_BTHK, w_BHTS = _attend(params, q_BTHK, k_BSGK, v_BSGK, c, mask, causal, impl,
                           return_weights, window, scale, softcap, site,
                           cached=new_cache is not None)
  y_BTD, o_BTHK = _output(params, x, o_BTHK, gate_BTHK, c, site)
  if new_cache is not None:  # a write past S_max (traced length) poisons the output
    y_BTD = jnp.where(c.length + c.t <= c.s, y_BTD, jnp.nan)
  chex.assert_shape(y_BTD, (c.b, c.t, c.d))
  chex.assert_shape(o_BTHK, (c.b, c.t, c.h, params["wv"].shape[2]))
  if return_weights:
    return finish(AttentionOutput(y_BTD, w_BHTS, o_BTHK))
  return finish(y_BTD)
