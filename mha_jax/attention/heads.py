"""Line 2 of the seven, q_BTHK = split_heads(q_BTD, H): the heads, made ready to attend.

Each head's query, key and value (the projection's output is already split: its
reshape is split_heads', see params.project), then per head the QK-norm and the rotary
position embedding (RoPE), the intervention sites q, k, v, and the KV cache a decoder
keeps between steps (init_kv_cache, check_cache, write_cache: the cache logic is here
and only here).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from mha_jax.attention.params import Call, Params, project_shared, project
from mha_jax.blocks import check_rank, merge_heads, split_heads  # noqa: F401

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


def check_positions(name: str, positions: Any, b: int, t: int, letter: str = "T") -> jax.Array:
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
  check_rank("x_BTHK", x_BTHK, 4, "B, T, H, K")
  b, t, _, k = x_BTHK.shape
  pos_BT = check_positions("positions", positions_BT, b, t)
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


def rope_heads(x_BTHK: jax.Array, pos, rope: RoPE, maps: int) -> jax.Array:
  """RoPE of each head, or of each of its `maps` parts (a variant with several score
  maps, e.g. differential's halves: the parts are the heads)."""
  if maps == 1:
    return apply_rope(x_BTHK, pos, rope)
  b, t, n, k = x_BTHK.shape
  return apply_rope(x_BTHK.reshape(b, t, maps * n, k // maps), pos, rope).reshape(b, t, n, k)


def prepare_qkv(params: Params, x: jax.Array, c: Call, rope, qk_norm_eps: float, site):
  """(q (B, T, H, K) or None when H = 0, k, v (B, S, G, K), the variant's gate logits
  (B, T, H, K) or None): projected, QK-normed, rotated and through their sites."""
  jobs = ([("q", x, params["wq"], params.get("bq"))] if c.h else []) + [
      ("k", c.ctx, params["wk"], params.get("bk")), ("v", c.val, params["wv"], params.get("bv"))]
  if c.variant.gate_projection is not None and c.h:
    w, b = c.variant.gate_projection
    jobs.append(("g", x, params[w], params[b]))
  proj = project_shared(jobs)
  maps = c.variant.maps
  k_BSGK, v_BSGK = proj["k"], proj["v"]
  if "k_norm" in params:
    k_BSGK = qk_rms_norm(k_BSGK, params["k_norm"], qk_norm_eps, None if "wk_rest" not in
                         params else project(c.ctx, params["wk_rest"], params.get("bk_rest")))
  if rope is not None:
    k_BSGK = rope_heads(k_BSGK, c.k_pos, rope, maps)
  if site is not None:
    k_BSGK, v_BSGK = site("k", k_BSGK), site("v", v_BSGK)
  if not c.h:
    return None, k_BSGK, v_BSGK, None
  q_BTHK = proj["q"]
  if "q_norm" in params:
    q_BTHK = qk_rms_norm(q_BTHK, params["q_norm"], qk_norm_eps, None if "wq_rest" not in
                         params else project(x, params["wq_rest"], params.get("bq_rest")))
  if rope is not None:
    q_BTHK = rope_heads(q_BTHK, c.q_pos, rope, maps)
  if site is not None:
    q_BTHK = site("q", q_BTHK)
  return q_BTHK, k_BSGK, v_BSGK, proj.get("g")


def write_cache(cache, k_BSGK, v_BSGK, c: Call, causal: bool, window):
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
    the cache with length + T. An MLA layer (params with "wkv_a") caches each head's
    decompressed key and value (G = H, V = its value width), written after the k / v
    sites, not the shared latent: a head keeps keys and values of its own.
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


def check_cache(cache: Any, b: int, g: int, k: int, t: int, v: int | None = None
                 ) -> tuple[int, jax.Array]:
  """Validates a KV cache for x (B, T, D); returns (S_max, length as int32)."""
  if not isinstance(cache, Mapping) or set(cache) != {"k", "v", "length"}:
    raise ValueError(f"cache must be a dict with keys ['k', 'length', 'v'] (from "
                     f"init_kv_cache); got "
                     f"{sorted(cache) if isinstance(cache, Mapping) else type(cache).__name__}")
  ck, cv = cache["k"], cache["v"]
  check_rank("cache['k']", ck, 4, "B, S_max, G, K")
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


