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

Parameters are a plain dict: ``wq``, ``wk``, ``wv`` of shape (D, H, K), ``wo`` of
shape (H, K, D), optional ``bq``, ``bk``, ``bv`` (H, K) and ``bo`` (D,), and optional
``rel_bias`` (H, 2R + 1): one learned score bias per head and relative offset
(Shaw et al. 2018), so every per-head parameter lives in the block and removing a
head is slicing its row. H and K
are read from the shapes, so a layer whose heads were removed still runs.
"""

from __future__ import annotations

import math
from typing import Any, Mapping, NamedTuple

import chex
import jax
import jax.numpy as jnp
import numpy as np

Params = Mapping[str, jax.Array]

IMPLS = ("auto", "reference", "xla", "cudnn")
_WEIGHT_KEYS = ("wq", "wk", "wv", "wo")
_BIAS_KEYS = ("bq", "bk", "bv", "bo")
REL_BIAS = "rel_bias"


class AttentionOutput(NamedTuple):
  """What ``multi_head_attention(..., return_weights=True)`` returns.

  out: (B, T, D) the layer's output.
  weights: (B, H, T, S) float32 attention weights (rows sum to 1, or 0 when fully
    masked).
  heads: (B, T, H, K) each head's output after its gate, the input of W_O.
  """
  out: jax.Array
  weights: jax.Array
  heads: jax.Array


def _shape_error(name: str, value: Any, expected: str) -> ValueError:
  shape = getattr(value, "shape", value)
  return ValueError(f"{name} must be {expected}; got shape {tuple(shape)}"
                    if hasattr(value, "shape") else f"{name} must be {expected}; got {value!r}")


def _check_rank(name: str, x: Any, rank: int, letters: str) -> None:
  if not hasattr(x, "shape") or x.ndim != rank:
    raise _shape_error(name, x, f"a rank-{rank} array ({letters})")


# --------------------------------------------------------------------------
# Building blocks, each usable alone.
# --------------------------------------------------------------------------


def split_heads(x_BTD: jax.Array, num_heads: int) -> jax.Array:
  """(B, T, H*K) -> (B, T, H, K) by reshape only: head i owns features [i*K, (i+1)*K)."""
  _check_rank("x_BTD", x_BTD, 3, "B, T, D")
  if not isinstance(num_heads, (int, np.integer)) or num_heads < 1:
    raise ValueError(f"num_heads must be a positive integer; got {num_heads!r}")
  d = x_BTD.shape[-1]
  if d % num_heads:
    raise ValueError(
        f"num_heads={num_heads} does not divide the last dimension {d} of x_BTD")
  b, t, _ = x_BTD.shape
  return x_BTD.reshape(b, t, int(num_heads), d // int(num_heads))


def merge_heads(x_BTHK: jax.Array) -> jax.Array:
  """(B, T, H, K) -> (B, T, H*K) by reshape only: the concatenation of the heads."""
  _check_rank("x_BTHK", x_BTHK, 4, "B, T, H, K")
  b, t, h, k = x_BTHK.shape
  return x_BTHK.reshape(b, t, h * k)


def attention_scores(q_BTHK: jax.Array, k_BSHK: jax.Array,
                     scale: float | None = None) -> jax.Array:
  """Scaled dot products of every query with every key, per head.

  Args:
    q_BTHK: queries (B, T, H, K).
    k_BSHK: keys (B, S, H, K); same B, H and K as the queries.
    scale: multiplies the dot products. None means 1/sqrt(K), the head's own width.

  Returns:
    s_BHTS: (B, H, T, S) scores in float32.
  """
  _check_rank("q_BTHK", q_BTHK, 4, "B, T, H, K")
  _check_rank("k_BSHK", k_BSHK, 4, "B, S, H, K")
  bq, _, hq, kq = q_BTHK.shape
  bk, _, hk, kk = k_BSHK.shape
  if kq != kk:
    raise ValueError(f"q_BTHK and k_BSHK must have the same head width K; got q "
                     f"K={kq} (shape {q_BTHK.shape}) and k K={kk} (shape {k_BSHK.shape})")
  if hq != hk:
    raise ValueError(f"q_BTHK and k_BSHK must have the same number of heads; got "
                     f"{hq} and {hk}")
  if bq != bk:
    raise ValueError(f"q_BTHK and k_BSHK must have the same batch size; got {bq} and {bk}")
  if scale is None:
    scale = 1.0 / math.sqrt(kq)
  # Scaling q (T*K numbers) rather than the scores (T*S per head) is the same maths
  # and far cheaper when H is large.
  q_BTHK = q_BTHK * jnp.asarray(scale, q_BTHK.dtype)
  return jnp.einsum("bthk,bshk->bhts", q_BTHK, k_BSHK, preferred_element_type=jnp.float32)


def attention_weights(s_BHTS: jax.Array, mask: jax.Array | None = None) -> jax.Array:
  """Softmax over keys in float32, whatever the input dtype.

  Args:
    s_BHTS: scores (..., T, S).
    mask: boolean, True = may attend, broadcastable to s_BHTS. Masked entries get
      weight exactly 0; a row with no True gets all-zero weights (never NaN).

  Returns:
    w_BHTS: float32 weights of the scores' shape.
  """
  s = jnp.asarray(s_BHTS).astype(jnp.float32)
  if mask is None:
    return jax.nn.softmax(s, axis=-1)
  mask = jnp.asarray(mask)
  if mask.dtype != jnp.bool_:
    raise ValueError(f"mask must be boolean (True = may attend); got dtype {mask.dtype}")
  try:
    mask = jnp.broadcast_to(mask, s.shape)
  except ValueError:
    raise ValueError(f"mask of shape {mask.shape} does not broadcast to the scores' "
                     f"shape {s.shape}") from None
  row_max = jnp.max(jnp.where(mask, s, -jnp.inf), axis=-1, keepdims=True)
  row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
  # Double `where` keeps gradients finite on masked entries.
  e = jnp.where(mask, jnp.exp(jnp.where(mask, s - row_max, 0.0)), 0.0)
  denom = jnp.sum(e, axis=-1, keepdims=True)
  return e / jnp.where(denom > 0, denom, 1.0)


def mix_values(w_BHTS: jax.Array, v_BSHK: jax.Array) -> jax.Array:
  """Each head's output: its weights times the values, (B, H, T, S) x (B, S, H, K) -> (B, T, H, K)."""
  _check_rank("w_BHTS", w_BHTS, 4, "B, H, T, S")
  _check_rank("v_BSHK", v_BSHK, 4, "B, S, H, K")
  if w_BHTS.shape[3] != v_BSHK.shape[1] or w_BHTS.shape[1] != v_BSHK.shape[2]:
    raise ValueError(f"w_BHTS {w_BHTS.shape} and v_BSHK {v_BSHK.shape} disagree on S or H")
  return jnp.einsum("bhts,bshk->bthk", w_BHTS.astype(v_BSHK.dtype), v_BSHK)


# --------------------------------------------------------------------------
# Parameters.
# --------------------------------------------------------------------------


def init_attention_params(key: jax.Array, d_model: int, num_heads: int, *,
                          head_dim: int | None = None, use_bias: bool = False,
                          max_rel: int = 0, dtype: Any = jnp.float32) -> dict[str, jax.Array]:
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

  Returns:
    {"wq", "wk", "wv": (D, H, K), "wo": (H, K, D)} plus biases if asked.
  """
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
  d, h, k = int(d_model), int(num_heads), int(head_dim)
  names = _WEIGHT_KEYS + (_BIAS_KEYS if use_bias else ())
  keys = jax.random.split(key, len(names))
  out = {n: PARAM_INITS[n](kn, param_shapes(d, h, k)[n], dtype) for n, kn in zip(names, keys)}
  if max_rel:
    out[REL_BIAS] = jnp.zeros((h, 2 * int(max_rel) + 1), dtype)
  return out


def relative_bias(table_HR: jax.Array, t: int, s: int) -> jax.Array:
  """(1, H, T, S) score bias table_HR[h, R + clip(j - i, -R, R)] for query i, key j.

  The table is (H, 2R + 1): one scalar per head and clipped offset (Shaw et al. 2018;
  T5 buckets offsets logarithmically instead of clipping).
  """
  r = (table_HR.shape[1] - 1) // 2
  off_TS = np.clip(np.arange(s)[None, :] - np.arange(t)[:, None], -r, r) + r
  return table_HR[:, off_TS][None]


def param_shapes(d_model: int, num_heads: int, head_dim: int) -> dict[str, tuple[int, ...]]:
  """Shapes of every attention param for (D, H, K)."""
  d, h, k = d_model, num_heads, head_dim
  return {"wq": (d, h, k), "wk": (d, h, k), "wv": (d, h, k), "wo": (h, k, d),
          "bq": (h, k), "bk": (h, k), "bv": (h, k), "bo": (d,)}


_in_init = jax.nn.initializers.variance_scaling(
    1.0, "fan_in", "truncated_normal", in_axis=0, out_axis=(1, 2))
_out_init = jax.nn.initializers.variance_scaling(
    1.0, "fan_in", "truncated_normal", in_axis=(0, 1), out_axis=2)
# Initializer of each param: LeCun normal over input features; zero biases.
PARAM_INITS = {"wq": _in_init, "wk": _in_init, "wv": _in_init, "wo": _out_init,
               "bq": jax.nn.initializers.zeros, "bk": jax.nn.initializers.zeros,
               "bv": jax.nn.initializers.zeros, "bo": jax.nn.initializers.zeros}


def check_attention_params(params: Params) -> tuple[int, int, int]:
  """Validates the param dict's keys and shapes; returns (D, H, K)."""
  if not isinstance(params, Mapping):
    raise ValueError(f"params must be a dict with keys {_WEIGHT_KEYS}; got {type(params).__name__}")
  missing = [k for k in _WEIGHT_KEYS if k not in params]
  if missing:
    raise ValueError(f"params is missing {missing}; it has keys {sorted(params)}")
  unknown = sorted(set(params) - set(_WEIGHT_KEYS) - set(_BIAS_KEYS) - {REL_BIAS})
  if unknown:
    raise ValueError(f"params has unknown keys {unknown}; allowed: "
                     f"{_WEIGHT_KEYS + _BIAS_KEYS + (REL_BIAS,)}")
  wq = params["wq"]
  _check_rank("params['wq']", wq, 3, "D, H, K")
  d, h, k = wq.shape
  for name, shape in param_shapes(d, h, k).items():
    if name in params and tuple(params[name].shape) != shape:
      raise ValueError(f"params['{name}'] must have shape {shape} to match "
                       f"params['wq'] {tuple(wq.shape)} (D, H, K); got {tuple(params[name].shape)}")
  if k < 1:
    raise ValueError(f"head width K read from params['wq'] must be >= 1; got shape {wq.shape}")
  if REL_BIAS in params:
    rb = params[REL_BIAS]
    if rb.ndim != 2 or rb.shape[0] != h or rb.shape[1] % 2 != 1:
      raise ValueError(f"params['rel_bias'] must have shape (H, 2R + 1) = ({h}, odd); got "
                       f"{tuple(rb.shape)}")
  return d, h, k


def num_heads_of(params: Params) -> int:
  """H, read from params['wq'] (D, H, K)."""
  return int(params["wq"].shape[1])


# --------------------------------------------------------------------------
# Kernels: what `impl` dispatches to. All take (B, T, H, K) q and (B, S, H, K) k, v.
# --------------------------------------------------------------------------


def _gpu_available() -> bool:
  try:
    return any(d.platform == "gpu" for d in jax.devices())
  except RuntimeError:
    return False


def _check_cudnn_supported(q_BTHK: jax.Array) -> None:
  if not _gpu_available():
    raise ValueError(f"impl='cudnn' needs an NVIDIA GPU; this process has backend "
                     f"{jax.default_backend()!r}. Use impl='auto', 'xla' or 'reference'")
  if q_BTHK.dtype not in (jnp.bfloat16, jnp.float16):
    raise ValueError(f"impl='cudnn' needs bfloat16 or float16 inputs; got dtype "
                     f"{q_BTHK.dtype}. Cast x and params, or use impl='xla'")
  k = q_BTHK.shape[-1]
  if k % 8 or k > 256:
    raise ValueError(f"impl='cudnn' needs a head width K that is a multiple of 8 and "
                     f"at most 256; got K={k}")


def resolve_impl(impl: str, q_BTHK: jax.Array, return_weights: bool,
                 has_bias: bool = False) -> str:
  """The kernel `impl` means for this call: 'reference', 'xla' or 'cudnn'."""
  if impl not in IMPLS:
    raise ValueError(f"impl must be one of {IMPLS}; got {impl!r}")
  if return_weights:
    if impl in ("xla", "cudnn"):
      raise ValueError(f"impl={impl!r} does not expose attention weights; use "
                       f"impl='reference' or 'auto' with return_weights=True")
    return "reference"
  if impl == "cudnn":
    _check_cudnn_supported(q_BTHK)
  if impl != "auto":
    return impl
  # Measured (scripts/bench_attention.py): on CPU the explicit path beats jax.nn's
  # XLA path, most in forward+backward and at large h. A score bias (learned, for
  # relative positions) stays on the explicit path: its gradient through cuDNN is untested.
  if has_bias:
    return "reference"
  try:
    _check_cudnn_supported(q_BTHK)
    return "cudnn"
  except ValueError:
    return "reference"


def _causal_mask(t: int, s: int) -> jax.Array:
  """(1, 1, T, S): query i may attend to keys j <= i (top-left aligned, as jax.nn)."""
  return jnp.tril(jnp.ones((t, s), jnp.bool_))[None, None]


def _reference_kernel(q_BTHK, k_BSHK, v_BSHK, mask_BHTS, bias_BHTS=None):
  s_BHTS = attention_scores(q_BTHK, k_BSHK)
  if bias_BHTS is not None:
    s_BHTS = s_BHTS + bias_BHTS.astype(s_BHTS.dtype)
  w_BHTS = attention_weights(s_BHTS, mask_BHTS)
  return mix_values(w_BHTS, v_BSHK), w_BHTS


def _fused_kernel(q_BTHK, k_BSHK, v_BSHK, mask_BHTS, causal, implementation,
                  bias_BHTS=None):
  if bias_BHTS is not None:
    bias_BHTS = bias_BHTS.astype(q_BTHK.dtype)
  o_BTHK = jax.nn.dot_product_attention(
      q_BTHK, k_BSHK, v_BSHK, bias=bias_BHTS, mask=mask_BHTS, is_causal=causal,
      scale=1.0 / math.sqrt(q_BTHK.shape[-1]), implementation=implementation)
  if mask_BHTS is not None:
    # jax.nn spreads a fully masked row uniformly; the contract is a zero output.
    full = mask_BHTS
    if causal:
      full = full & _causal_mask(q_BTHK.shape[1], k_BSHK.shape[1])
    live_BHT = jnp.any(full, axis=-1)
    o_BTHK = jnp.where(jnp.swapaxes(live_BHT, 1, 2)[..., None], o_BTHK, 0)
  return o_BTHK


# --------------------------------------------------------------------------
# The layer.
# --------------------------------------------------------------------------


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


def multi_head_attention(params: Params, x: jax.Array, context: jax.Array | None = None, *,
                         value_input: jax.Array | None = None,
                         mask: jax.Array | None = None, causal: bool = False,
                         bias: jax.Array | None = None,
                         head_gates: jax.Array | None = None, impl: str = "auto",
                         return_weights: bool = False):
  """Multi-head attention of x over itself, or over `context` (cross-attention).

  Args:
    params: {"wq", "wk", "wv": (D, H, K), "wo": (H, K, D)}, optional
      {"bq", "bk", "bv": (H, K), "bo": (D,)}. H and K are read from the shapes.
    x: (B, T, D) queries' input.
    context: (B, S, D) keys' and values' input; None means x (self-attention).
    value_input: (B, S, D) values' input when it differs from the keys' (e.g. positions
      in Q and K only, as in Shortformer); None means context.
    mask: boolean, True = may attend; (B|1, H|1, T|1, S|1) or (T, S).
    causal: also forbid attending to later positions (key j > query i).
    bias: float, added to the scaled scores before the softmax; (B|1, H|1, T|1, S|1)
      or (T, S) (e.g. ALiBi). A params["rel_bias"] table adds its relative-position
      bias on top.
    head_gates: (H,) or (B, H); multiplies each head's output before W_O.
    impl: "reference" (explicit weights), "xla" (jax.nn.dot_product_attention),
      "cudnn" (GPU, bf16/f16), or "auto" (cudnn where it can serve the call and there
      is no score bias, else reference, the faster of the other two in our benchmark).
    return_weights: also return the weights and the per-head outputs.

  Returns:
    y_BTD (B, T, D), or AttentionOutput(out, weights (B, H, T, S), heads (B, T, H, K))
    when return_weights is True.
  """
  d, h, k = check_attention_params(params)
  _check_rank("x", x, 3, "B, T, D")
  ctx = x if context is None else context
  _check_rank("context", ctx, 3, "B, S, D")
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
  if not isinstance(causal, (bool, np.bool_)):
    raise ValueError(f"causal must be a bool; got {causal!r}")
  b, t, _ = x.shape
  s = ctx.shape[1]
  if mask is not None:
    mask = _check_mask(mask, b, h, t, s)
  gates = None if head_gates is None else _check_gates(head_gates, b, h)
  if bias is not None:
    bias = _check_bias(bias, b, h, t, s)
  if REL_BIAS in params and h:
    rel = relative_bias(params[REL_BIAS], t, s)
    bias = rel if bias is None else bias + rel
  if impl not in IMPLS:
    raise ValueError(f"impl must be one of {IMPLS}; got {impl!r}")

  if h == 0:  # Every head pruned: the layer adds only its output bias.
    out = jnp.zeros((b, t, d), x.dtype) + params.get("bo", jnp.zeros((d,), x.dtype))
    if return_weights:
      return AttentionOutput(out, jnp.zeros((b, 0, t, s), jnp.float32),
                             jnp.zeros((b, t, 0, k), x.dtype))
    return out

  # Projections: W (D, H*K) viewed as (D, H, K). Heads are a reshape of the output.
  def project(inp, w, bias):
    y_BTD = inp @ w.reshape(d, h * k).astype(inp.dtype)
    y_BTHK = split_heads(y_BTD, h)
    return y_BTHK if bias is None else y_BTHK + bias.astype(inp.dtype)

  q_BTHK = project(x, params["wq"], params.get("bq"))
  k_BSHK = project(ctx, params["wk"], params.get("bk"))
  v_BSHK = project(val, params["wv"], params.get("bv"))

  kernel = resolve_impl(impl, q_BTHK, return_weights, bias is not None)
  if kernel == "reference":
    full = mask
    if causal:
      cm = _causal_mask(t, s)
      full = cm if full is None else full & cm
    o_BTHK, w_BHTS = _reference_kernel(q_BTHK, k_BSHK, v_BSHK, full, bias)
  else:
    o_BTHK = _fused_kernel(q_BTHK, k_BSHK, v_BSHK, mask, causal, kernel, bias)
    w_BHTS = None

  if gates is not None:
    o_BTHK = o_BTHK * gates.astype(o_BTHK.dtype)
  y_BTD = merge_heads(o_BTHK) @ params["wo"].reshape(h * k, d).astype(o_BTHK.dtype)
  if "bo" in params:
    y_BTD = y_BTD + params["bo"].astype(y_BTD.dtype)
  chex.assert_shape(y_BTD, (b, t, d))
  chex.assert_shape(o_BTHK, (b, t, h, k))
  if return_weights:
    return AttentionOutput(y_BTD, w_BHTS, o_BTHK)
  return y_BTD
