"""Line 1 of the seven, q_BTD = x_BTD @ W_Q: the params and the projections.

The param dict's names and shapes, fresh params, the checks of a param dict, and the
projections of the inputs into query, key and value heads (with MLA's latent inputs).
"""

from __future__ import annotations

from typing import Any, Mapping, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from mha_jax import attention_variants as variants
from mha_jax.blocks import check_rank, kv_group_size, linear, split_heads

Params = Mapping[str, jax.Array]

WEIGHT_KEYS = ("wq", "wk", "wv", "wo")
BIAS_KEYS = ("bq", "bk", "bv", "bo")
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
MLA_KEYS = ("wq_a", "q_a_norm", "wkv_a", "kv_a_norm", "wk_rope")
MLA_NORM_EPS = 1e-6     # DeepSeek's latent norms' epsilon (DeepseekV2RMSNorm's default)
# QK-norm scales (RMSNorm of queries and keys after their projections, before RoPE):
# (K,) shared by every head (Qwen3, Gemma 3) or (H, K) / (G, K) over the whole
# projection at once (OLMo 2).
QK_NORM_KEYS = ("q_norm", "k_norm")
# Removed heads' projections kept only for a whole-projection QK-norm's statistics (an
# exported OLMo 2 model, toolkit/masks.export_pruned): "wq_rest" (D, H_r, K) and
# optional "bq_rest" (H_r, K) for queries, "wk_rest" (D, G_r, K), "bk_rest" (G_r, K) for
# keys. Their squares join the mean of the kept heads' over (H + H_r) * K features; they
# are not attention heads (nothing reads or attends with them).
NORM_REST_KEYS = ("wq_rest", "bq_rest", "wk_rest", "bk_rest")

# The variants (mha_jax/attention_variants.py, the one registry): a live view of the
# registered names.
VARIANTS = variants.NAMES


def check_variant(variant: Any) -> str:
  """The variant's name; refuses an unknown one by name."""
  return variants.get(variant).name


def variant_param_shapes(variant: str, d_model: int, num_heads: int,
                         head_dim: int) -> dict[str, tuple[int, ...]]:
  """Shapes of the params `variant` adds, for (D, H, K) (its registry entry)."""
  return variants.get(variant).params(d_model, num_heads, head_dim)


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
  var = variants.get(variant)
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
  kv_group_size(int(num_heads), int(num_kv_heads), f"num_kv_heads={num_kv_heads}")
  d, h, k, g = int(d_model), int(num_heads), int(head_dim), int(num_kv_heads)
  names = WEIGHT_KEYS + (BIAS_KEYS if use_bias else ())
  keys = jax.random.split(key, len(names))
  shapes = param_shapes(d, h, k, g)
  out = {n: PARAM_INITS[n](kn, shapes[n], dtype) for n, kn in zip(names, keys)}
  if max_rel:
    out[REL_BIAS] = jnp.zeros((h, 2 * int(max_rel) + 1), dtype)
  if var.name != "softmax":   # a key of its own, so the weights above stay as they were
    out.update(variants.init_params(
        var, jax.random.fold_in(key, 1 + VARIANTS.index(var.name)), d, h, k, dtype))
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
  d, h, k, g = _check_weights(params)
  wq, wk, wv = params["wq"], params["wk"], params["wv"]
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
  _check_norms(params, d, h, k, g)
  _check_positional(params, h)
  _check_variant_params(params, variant, d, h, k)
  if variant is not None and wv.shape[2] != k and variants.get(variant).needs_square_heads:
    raise ValueError(f"variant={variant!r} needs value heads as wide as the query/key "
                     f"heads; params['wv'] {tuple(wv.shape)} has V={wv.shape[2]}, K={k}")
  return d, h, k


def _check_weights(params: Params) -> tuple[int, int, int, int]:
  """(D, H, K, G) from wq and wk, after the dict's keys and the weights' ranks."""
  if not isinstance(params, Mapping):
    raise ValueError(f"params must be a dict with keys {WEIGHT_KEYS}; got {type(params).__name__}")
  missing = [k for k in WEIGHT_KEYS if k not in params]
  if missing:
    raise ValueError(f"params is missing {missing}; it has keys {sorted(params)}")
  allowed = (WEIGHT_KEYS + BIAS_KEYS + (REL_BIAS, ALIBI) + QK_NORM_KEYS + NORM_REST_KEYS
             + variants.owned_keys() + MLA_KEYS)
  unknown = sorted(set(params) - set(allowed))
  if unknown:
    raise ValueError(f"params has unknown keys {unknown}; allowed: {allowed}")
  wq = params["wq"]
  check_rank("params['wq']", wq, 3, "D, H, K")
  d, h, k = wq.shape
  wk = params["wk"]
  check_rank("params['wk']", wk, 3, "D, G, K")
  g = wk.shape[1]
  if h and (g < 1 or h % g):
    raise ValueError(f"params['wk'] {tuple(wk.shape)} has G={g} key/value heads, which must "
                     f"divide the H={h} query heads of params['wq'] {tuple(wq.shape)} "
                     f"(grouped-query attention)")
  check_rank("params['wv']", params["wv"], 3, "D, G, V")
  return d, h, k, g


def _check_norms(params: Params, d: int, h: int, k: int, g: int) -> None:
  """QK-norm scales, and removed heads' projections kept for their statistics."""
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


def _check_positional(params: Params, h: int) -> None:
  """ALiBi's slopes or a relative-position table, one at most."""
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


def _check_mla(params: Params) -> int:
  """The model width D of an MLA attention's params, their shapes checked (MLA_KEYS)."""
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
                     f"{ {n: shape(n) for n in MLA_KEYS + ('wq', 'wk', 'wv')} }")
  for n in NORM_REST_KEYS + (REL_BIAS, ALIBI):
    if n in params:
      raise ValueError(f"params['{n}'] cannot be combined with MLA's latent keys")
  return d


def _check_variant_params(params: Params, variant: str | None, d: int, h: int, k: int):
  """The variant's params are present with their shapes; no other variant's are."""
  owned = variants.owned_keys()
  present = [n for n in owned if n in params]
  if variant is None:    # shapes only, against the variant that fits the most of them
    _check_owned_shapes(params, present, d, h, k)
    return
  var = variants.get(variant)
  shapes = var.params(d, h, k)
  stray = [n for n in present if n not in shapes]
  if stray:
    raise ValueError(f"params has {stray}, which variant={variant!r} does not use; pass "
                     f"the variant the params were made for")
  var.check_width(k)
  for n, shape in shapes.items():
    if n not in params:
      raise ValueError(f"variant={variant!r} needs params['{n}'] of shape {shape} "
                       f"(init_attention_params(..., variant={variant!r})); params has "
                       f"keys {sorted(params)}")
    if n in owned and tuple(params[n].shape) != shape:
      raise ValueError(f"params['{n}'] must have shape {shape} for variant={variant!r}; "
                       f"got {tuple(params[n].shape)}")


def _check_owned_shapes(params: Params, present: list, d: int, h: int, k: int) -> None:
  """Each variant-owned param present has its shape in the variant that owns it (gated
  and gated_head share names: the one whose shapes fit the most decides)."""
  by_owner: dict[str, list] = {}
  for name in variants.NAMES:
    shapes = variants.get(name).params(d, h, k)
    for n in present:
      if n in shapes:
        by_owner.setdefault(n, []).append((name, shapes))
  fits = lambda shapes: sum(n in params and tuple(params[n].shape) == s  # noqa: E731
                            for n, s in shapes.items())
  for n in present:
    owner, shapes = max(by_owner[n], key=lambda o: fits(o[1]))
    if tuple(params[n].shape) != shapes[n]:
      raise ValueError(f"params['{n}'] must have shape {shapes[n]} ({owner}); got "
                       f"{tuple(params[n].shape)}")


def num_heads_of(params: Params) -> int:
  """H, the query heads, read from params['wq'] (D, H, K)."""
  return int(params["wq"].shape[1])


def num_kv_heads_of(params: Params) -> int:
  """G, the key/value heads, read from params['wk'] (D, G, K); G = H unless grouped."""
  return int(params["wk"].shape[1])


# --------------------------------------------------------------------------
# Projections.
# --------------------------------------------------------------------------


def project(inp_BTD: jax.Array, w_DHK: jax.Array, b_HK: jax.Array | None = None
            ) -> jax.Array:
  """(B, T, D) x (D, H, K) (+ (H, K)) -> (B, T, H, K): lines 1 and 2, W as the full-width
  D x H*K matrix (blocks.linear), then split_heads."""
  if inp_BTD.ndim == 4:    # head_inputs: head n projects its own input (B, T, N, D)
    y = jnp.einsum("btnd,dnk->btnk", inp_BTD, w_DHK.astype(inp_BTD.dtype))
    return y if b_HK is None else y + b_HK.astype(inp_BTD.dtype)
  d, h, k = w_DHK.shape
  y_BTHK = split_heads(linear(inp_BTD, w_DHK.reshape(d, h * k)), h)
  return y_BTHK if b_HK is None else y_BTHK + b_HK.astype(inp_BTD.dtype)


def project_shared(jobs) -> dict[str, jax.Array]:
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
    y = project(grp[0][1], ws[0] if len(ws) == 1 else jnp.concatenate(ws, axis=1))
    starts = np.cumsum([0] + [w.shape[1] for w in ws])
    for (name, _, _, bias), a, z in zip(grp, starts[:-1], starts[1:]):
      part = y if len(ws) == 1 else y[:, :, a:z]
      out[name] = part if bias is None else part + bias.astype(part.dtype)
  return out


def mla_inputs(params: Params, x, ctx, val, eps: float = MLA_NORM_EPS):
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


class Call(NamedTuple):
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
  variant: variants.Variant
  sigmoid_bias: float | None
  layer: int
