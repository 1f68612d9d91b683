"""The building blocks of attention: the textbook's lines as pure functions.

One function per line of the seven (mha_jax/attention/'s docstring):

  line 1  q = x @ W_Q              linear           (attention/params.py calls it)
  line 2  split the heads          split_heads      (attention/params.py)
  line 3  scores q . k / sqrt(K)   attention_scores (kernels/reference.py)
  line 4  softmax                  attention_weights, masked_softmax (kernels/reference.py)
  line 5  mix the values           mix_values       (kernels/reference.py)
  line 6  concatenate the heads    merge_heads      (attention/mixing.py)
  line 7  y = o @ W_O              linear           (attention/mixing.py)

The other kernels (kernels/) compute lines 3-5 their own way and are tested against
these. A leaf module: it imports nothing of the project, so the attention package and
every kernel can use these without an import cycle; mha_jax.attention re-exports the
public names.

Shape letters: B batch, T queries, S keys, D d_model, H query heads, G key/value heads,
K head width.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


def _shape_error(name: str, value: Any, expected: str) -> ValueError:
  shape = getattr(value, "shape", value)
  return ValueError(f"{name} must be {expected}; got shape {tuple(shape)}"
                    if hasattr(value, "shape") else f"{name} must be {expected}; got {value!r}")


def check_rank(name: str, x: Any, rank: int, letters: str) -> None:
  """Refuses x unless it is an array of that rank (letters name its axes, e.g. "B, T, D")."""
  if not hasattr(x, "shape") or x.ndim != rank:
    raise _shape_error(name, x, f"a rank-{rank} array ({letters})")


def linear(x_BTD: jax.Array, w_DN: jax.Array) -> jax.Array:
  """(B, T, D) @ (D, N) -> (B, T, N), in x's dtype: lines 1 and 7 (W_Q, W_K, W_V and W_O
  as D x H*K and H*K x D matrices). One 2-D (B*T, D) x (D, N) matmul: XLA:CPU then needs
  no transposes of the residual stream's gradient, which it was fusing, recomputed,
  into every consumer."""
  check_rank("x_BTD", x_BTD, 3, "B, T, D")
  check_rank("w_DN", w_DN, 2, "D, N")
  b, t, d = x_BTD.shape
  if w_DN.shape[0] != d:
    raise ValueError(f"w_DN has {w_DN.shape[0]} input features for x_BTD's D={d}")
  return (x_BTD.reshape(b * t, d) @ w_DN.astype(x_BTD.dtype)).reshape(b, t, w_DN.shape[1])


def split_heads(x_BTD: jax.Array, num_heads: int) -> jax.Array:
  """(B, T, H*K) -> (B, T, H, K) by reshape only: head i owns features [i*K, (i+1)*K)."""
  check_rank("x_BTD", x_BTD, 3, "B, T, D")
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
  check_rank("x_BTHK", x_BTHK, 4, "B, T, H, K")
  b, t, h, k = x_BTHK.shape
  return x_BTHK.reshape(b, t, h * k)


def kv_group_size(h: int, g: int, what: str) -> int:
  """H // G, the query heads per key/value head; refuses G not dividing H."""
  if g < 1 or h % g:
    raise ValueError(f"{what}: the number of key/value heads G={g} must divide the number "
                     f"of query heads H={h} (grouped-query attention)")
  return h // g


def attention_scores(q_BTHK: jax.Array, k_BSGK: jax.Array,
                     scale: float | None = None) -> jax.Array:
  """Scaled dot products of every query with every key, per query head.

  Args:
    q_BTHK: queries (B, T, H, K).
    k_BSGK: keys (B, S, G, K); same B and K as the queries, G dividing H. Query head
      i reads key head i // (H // G) (G = H: one key head per query head).
    scale: multiplies the dot products. None means 1/sqrt(K), the head's own width.

  Returns:
    s_BHTS: (B, H, T, S) scores in float32.
  """
  check_rank("q_BTHK", q_BTHK, 4, "B, T, H, K")
  check_rank("k_BSGK", k_BSGK, 4, "B, S, G, K")
  bq, t, hq, kq = q_BTHK.shape
  bk, s, hk, kk = k_BSGK.shape
  if kq != kk:
    raise ValueError(f"q_BTHK and k_BSGK must have the same head width K; got q "
                     f"K={kq} (shape {q_BTHK.shape}) and k K={kk} (shape {k_BSGK.shape})")
  r = kv_group_size(hq, hk, "q_BTHK and k_BSGK")
  if bq != bk:
    raise ValueError(f"q_BTHK and k_BSGK must have the same batch size; got {bq} and {bk}")
  if scale is None:
    scale = 1.0 / math.sqrt(kq)
  # Scaling q (T*K numbers) rather than the scores (T*S per head) is the same maths
  # and far cheaper when H is large.
  q_BTHK = q_BTHK * jnp.asarray(scale, q_BTHK.dtype)
  if r == 1:
    return jnp.einsum("bthk,bshk->bhts", q_BTHK, k_BSGK, preferred_element_type=jnp.float32)
  # Grouped: query head g*R + r reads key head g; no copy of the keys.
  q_BTGRK = q_BTHK.reshape(bq, t, hk, r, kq)
  s_BGRTS = jnp.einsum("btgrk,bsgk->bgrts", q_BTGRK, k_BSGK,
                       preferred_element_type=jnp.float32)
  return s_BGRTS.reshape(bq, hq, t, s)


def soft_cap(s_BHTS: jax.Array, cap: float) -> jax.Array:
  """Attention-logit soft-capping (Gemma 2): cap * tanh(s / cap), in s's dtype."""
  return jnp.tanh(s_BHTS / cap) * cap


def attention_weights(s_BHTS: jax.Array, mask: jax.Array | None = None) -> jax.Array:
  """Softmax over keys in float32, whatever the input dtype.

  Args:
    s_BHTS: scores (..., T, S).
    mask: boolean, True = may attend, broadcastable to s_BHTS. Masked entries get
      weight exactly 0; a row with no True gets all-zero weights (never NaN).

  Returns:
    w_BHTS: float32 weights of the scores' shape.
  """
  w_BHTS, live = masked_softmax(s_BHTS, mask)
  return w_BHTS if live is None else w_BHTS * live


def masked_softmax(s_BHTS: jax.Array, mask: jax.Array | None):
  """(w_BHTS, live): float32 softmax over allowed keys, and live rows (..., T, 1) as
  float32 1/0 (None when unmasked).

  Masked scores are filled with the float32 minimum before jax.nn.softmax, whose own
  derivative rule keeps the backward pass to one fused expression: a masked entry then
  gets weight exactly 0 whenever its row allows any key. A row that allows none comes
  out uniform here; callers zero it with `live` (computed on the unbroadcast mask, so
  it is small for padding or causal masks).
  """
  s = jnp.asarray(s_BHTS).astype(jnp.float32)
  if mask is None:
    return jax.nn.softmax(s, axis=-1), None
  mask = jnp.asarray(mask)
  if mask.dtype != jnp.bool_:
    raise ValueError(f"mask must be boolean (True = may attend); got dtype {mask.dtype}")
  try:
    if jnp.broadcast_shapes(mask.shape, s.shape) != s.shape:
      raise ValueError
  except ValueError:
    raise ValueError(f"mask of shape {mask.shape} does not broadcast to the scores' "
                     f"shape {s.shape}") from None
  live = jnp.any(mask, axis=-1, keepdims=True)
  w = jax.nn.softmax(jnp.where(mask, s, jnp.finfo(jnp.float32).min), axis=-1)
  return w, live.astype(jnp.float32)


def sigmoid_weights(s_BHTS: jax.Array, mask: jax.Array | None, bias: float) -> jax.Array:
  """sigmoid(s + bias) in float32, 0 where masked: sigmoid attention's weights (Ramapuram
  et al. 2025), not normalised over the keys."""
  w = jax.nn.sigmoid(jnp.asarray(s_BHTS).astype(jnp.float32) + jnp.float32(bias))
  return w if mask is None else jnp.where(mask, w, 0.0)


def sink_softmax(s_BHTS: jax.Array, mask: jax.Array | None, sink_H: jax.Array) -> jax.Array:
  """exp(s_j) / (exp(sink_h) + sum_k exp(s_k)) over allowed keys, float32 (B, H, T, S):
  a softmax with one more logit per head whose weight mixes nothing (gpt-oss). A row
  with no allowed key gives its whole weight to the sink (zero weights here)."""
  s = jnp.asarray(s_BHTS).astype(jnp.float32)
  c = jnp.asarray(sink_H).astype(jnp.float32)[None, :, None, None]
  if mask is not None:
    s = jnp.where(mask, s, -jnp.inf)
  m = jax.lax.stop_gradient(jnp.maximum(jnp.max(s, axis=-1, keepdims=True), c))
  e = jnp.exp(s - m)                       # exp(-inf) = 0 where masked
  return e / (jnp.sum(e, axis=-1, keepdims=True) + jnp.exp(c - m))


def drop_masked_keys(k_BSGK: jax.Array, v_BSGK: jax.Array, mask: jax.Array | None):
  """(k, v) zeroed at the key positions no query may attend to under `mask` (padding).

  A masked key gets weight exactly 0, but 0 * NaN is NaN: a NaN or inf in a padded
  key or value would otherwise reach every output through the weighted sum. mask:
  boolean, True = may attend, broadcastable to (B, H, T, S) ((T, S) too); a key
  position counts as masked when no query of any head of its batch row may see it.
  """
  if mask is None:
    return k_BSGK, v_BSGK
  m = jnp.asarray(mask)
  if m.ndim == 2:
    m = m[None, None]
  b, s = k_BSGK.shape[0], k_BSGK.shape[1]
  seen_BS11 = jnp.broadcast_to(jnp.any(m, axis=(1, 2)), (b, s))[:, :, None, None]
  return jnp.where(seen_BS11, k_BSGK, 0), jnp.where(seen_BS11, v_BSGK, 0)


def mix_values(w_BHTS: jax.Array, v_BSGK: jax.Array) -> jax.Array:
  """Each query head's output: its weights times its value head's values.

  (B, H, T, S) x (B, S, G, K) -> (B, T, H, K), G dividing H; query head i reads value
  head i // (H // G).
  """
  check_rank("w_BHTS", w_BHTS, 4, "B, H, T, S")
  check_rank("v_BSGK", v_BSGK, 4, "B, S, G, K")
  b, h, t, s = w_BHTS.shape
  g, k = v_BSGK.shape[2], v_BSGK.shape[3]
  if s != v_BSGK.shape[1]:
    raise ValueError(f"w_BHTS {w_BHTS.shape} and v_BSGK {v_BSGK.shape} disagree on S")
  r = kv_group_size(h, g, "w_BHTS and v_BSGK")
  w_BHTS = w_BHTS.astype(v_BSGK.dtype)
  if r == 1:
    return jnp.einsum("bhts,bshk->bthk", w_BHTS, v_BSGK)
  o_BTGRK = jnp.einsum("bgrts,bsgk->btgrk", w_BHTS.reshape(b, g, r, t, s), v_BSGK)
  return o_BTGRK.reshape(b, t, h, k)


def relative_bias(table_HR: jax.Array, t: int, s: int, q_offset: Any = 0) -> jax.Array:
  """(1, H, T, S) score bias table_HR[h, R + clip(j - i, -R, R)] for query i, key j.

  The table is (H, 2R + 1): one scalar per head and clipped offset (Shaw et al. 2018;
  T5 buckets offsets logarithmically instead of clipping). q_offset (an int, or a
  traced scalar such as a KV cache's length) is the position of query 0.
  """
  r = (table_HR.shape[1] - 1) // 2
  xp = np if isinstance(q_offset, (int, np.integer)) else jnp
  off_TS = relative_index(xp.arange(t)[:, None] + q_offset, xp.arange(s)[None, :], r)
  return table_HR[:, off_TS][None]


def relative_index(q_pos, k_pos, r: int):
  """Column of the (H, 2R + 1) relative-position table for query position q_pos and key
  position k_pos (broadcast): R + clip(k - q, -R, R). NumPy in, NumPy out."""
  xp = np if isinstance(q_pos, np.ndarray) and isinstance(k_pos, np.ndarray) else jnp
  return xp.clip(k_pos - q_pos, -r, r) + r
