"""The attention variants: one registry that attention, accounting, dispatch and the configs read.

A variant is an option of the one attention (multi_head_attention(..., variant=NAME)),
never a copy of it. Its entry (a Variant) declares everything the house needs:

  params    the params it adds to wq, wk, wv, wo: {name: shape} for (D, H, K)
  init      how each of them is drawn (zeros unless named)
  hooks     where it changes the computation, each optional: a gate on each head's
            output (gate, with gate_projection when its logits are a projection of x
            made with q, k and v), extra arguments of the kernel (kernel_args: the
            kernel's own sums change), several score maps per head (maps, combine),
            the edits of its own weight sites (edit_maps)
  sites     the intervention sites it adds (mha_jax/interventions.py)
  kernels   the impl= kernels that serve it; None: every kernel (it acts outside them)
  flops     the matmul FLOPs it adds per sequence; maps multiplies the mixing FLOPs
            and the score memory

Adding a variant is one register(Variant(...)) here (or from any module: the registry
is read at call time), plus the kernels' support when kernel_args are new
(docs/architecture.md, "A variant"). Built in:

  softmax       softmax(q k^T / sqrt(K)) v: the default.
  gated         the head's output times sigmoid(x wg[:, h, :] + bg[h]), elementwise,
                after attention and before W_O (Qiu et al. 2025): wg (D, H, K), bg (H, K).
  gated_head    the same with one scalar gate per head: wg (D, H), bg (H,).
  differential  (softmax(q1 k1^T / sqrt(K/2)) - lambda_h softmax(q2 k2^T / sqrt(K/2))) v
                over the two halves of each head's query and key, then a per-head RMS
                norm and the (1 - lambda_init) scale (Ye et al. 2025): lambda_q1,
                lambda_k1, lambda_q2, lambda_k2 (H, K/2) and diff_norm (K,).
  sigmoid       sigmoid(q k^T / sqrt(K) + b) v, b = -log S by default, no
                normalisation over the keys (Ramapuram et al. 2025): no params.
  sink          softmax over the keys and one learned logit per head whose weight
                mixes nothing (gpt-oss): sink_logit (H,).
  qk_norm       RMS-normalised queries and keys per head before RoPE: q_norm, k_norm (K,).

It sits at the bottom of the core (it imports nothing of the project), so the kernels'
dispatcher and accounting, which attention itself stands on, read the same entries.
"""

from __future__ import annotations

import collections.abc
import dataclasses
import math
from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np


Shapes = dict[str, tuple[int, ...]]


@dataclasses.dataclass(frozen=True)
class Variant:
  """One attention variant: what it adds and where it acts (see the module docstring).

  Attributes:
    name: the variant= name.
    equation: one line, what it computes.
    params: (D, H, K) -> {name: shape} of the params it adds.
    init: {name: initializer(key, shape, dtype)}; the others start at zero.
    shared: param names that also come without the variant (QK-norm scales of imported
      families): their shapes are checked by attention, not here.
    sites: the intervention sites it adds.
    weight_sites: those of `sites` that read or edit weights (they force the reference
      kernel); edit_maps applies them.
    kernels: the impl names that serve it; None: every kernel.
    options: the multi_head_attention arguments only it reads (e.g. "sigmoid_bias").
    maps: score maps per head: q and k are cut into `maps` equal parts along K, the
      kernel runs once per part, combine merges the outputs.
    gate_projection: (weight, bias) params projected from x with q, k and v (one
      matmul), the gate's logits (B, T, H, K).
    gate: (params, x_BTD, logits or None) -> the gate, (B, T, H, K) or (B, T, H), that
      multiplies each head's output before the head gates; the site "gate" sees it.
    kernel_args: (params, call) -> extra keyword arguments of the kernel; call has
      .s (key slots) and the options.
    combine: (params, [o_BTHK per map], layer) -> o_BTHK.
    edit_maps: (site, [w_BHTS per map]) -> the weights after its weight sites (a map
      that is not the same object is what mixes the values).
    flops: (T, S, D, H or None) -> matmul FLOPs it adds to the projections, per
      sequence (2 per multiply-add); a ValueError when it needs H.
    needs_square_heads: it needs value heads as wide as the query/key heads (V = K).
  """
  name: str
  equation: str
  params: Callable[[int, int, int], Shapes] = lambda d, h, k: {}
  init: Mapping[str, Callable] = dataclasses.field(default_factory=dict)
  shared: tuple[str, ...] = ()
  sites: tuple[str, ...] = ()
  weight_sites: tuple[str, ...] = ()
  kernels: tuple[str, ...] | None = None
  options: tuple[str, ...] = ()
  maps: int = 1
  gate_projection: tuple[str, str] | None = None
  gate: Callable | None = None
  kernel_args: Callable | None = None
  combine: Callable | None = None
  edit_maps: Callable | None = None
  flops: Callable[[int, int, int, Any], int] = lambda t, s, d, h: 0
  needs_square_heads: bool = False

  def check_width(self, k: int) -> None:
    """Refuses a head width K that its maps cannot cut."""
    if k % self.maps:
      parts = "two halves" if self.maps == 2 else f"{self.maps} parts"
      raise ValueError(f"variant={self.name!r} splits each head's query and key in {parts}: "
                       f"the head width K={k} must be "
                       f"{'even' if self.maps == 2 else f'a multiple of {self.maps}'}")

  def param_count(self, d: int, h: int, k: int) -> int:
    """Numbers in the params it adds."""
    return sum(int(np.prod(s)) for s in self.params(d, h, k).values())


_REGISTRY: dict[str, Variant] = {}


def register(variant: Variant) -> Variant:
  """Adds a variant (its name must be new); returns it."""
  if not isinstance(variant, Variant):
    raise ValueError(f"variant must be an attention_variants.Variant; got {variant!r}")
  if not isinstance(variant.name, str) or not variant.name.isidentifier():
    raise ValueError(f"variant name must be an identifier; got {variant.name!r}")
  if variant.name in _REGISTRY:
    raise ValueError(f"variant {variant.name!r} is already registered")
  if isinstance(variant.maps, bool) or not isinstance(variant.maps, int) or variant.maps < 1:
    raise ValueError(f"variant {variant.name!r}: maps must be a positive integer; got "
                     f"{variant.maps!r}")
  _REGISTRY[variant.name] = variant
  return variant


def unregister(name: str) -> None:
  """Removes a variant added with register (the built-in ones stay)."""
  if name in BUILT_IN:
    raise ValueError(f"variant {name!r} is built in; it cannot be removed")
  get(name)
  del _REGISTRY[name]


def get(name: Any) -> Variant:
  """The variant called `name`; refuses an unknown one by name (a ValueError)."""
  if not isinstance(name, str) or name not in _REGISTRY:
    raise ValueError(f"variant must be one of {tuple(_REGISTRY)}; got {name!r}")
  return _REGISTRY[name]


class Names(collections.abc.Sequence):
  """The registered variants' names, in registration order: a live view (a variant
  registered later is in it); compares, prints and indexes like a tuple."""

  def __getitem__(self, i):
    return tuple(_REGISTRY)[i]

  def __len__(self):
    return len(_REGISTRY)

  def __contains__(self, name):
    return isinstance(name, str) and name in _REGISTRY

  def __eq__(self, other):
    return tuple(self) == (tuple(other) if isinstance(other, (tuple, Names)) else other)

  def __hash__(self):
    return hash(tuple(self))

  def __add__(self, other):
    return tuple(self) + tuple(other)

  def __radd__(self, other):
    return tuple(other) + tuple(self)

  def __repr__(self):
    return repr(tuple(self))


NAMES = Names()


def owned_keys() -> tuple[str, ...]:
  """Param names only variants use (not their shared ones), in registration order."""
  out: dict[str, None] = {}
  for v in _REGISTRY.values():
    shared = set(v.shared)
    out.update({n: None for n in v.params(2, 2, 2) if n not in shared})
  return tuple(out)


def init_params(variant: Variant, key: jax.Array, d: int, h: int, k: int,
                dtype: Any) -> dict[str, jax.Array]:
  """Fresh params of a variant, one key of `key` per param, in its params' order."""
  variant.check_width(k)
  shapes = variant.params(d, h, k)
  out = {}
  for name, key_n in zip(shapes, jax.random.split(key, max(len(shapes), 1))):
    out[name] = variant.init.get(name, jax.nn.initializers.zeros)(key_n, shapes[name], dtype)
  return out


# --------------------------------------------------------------------------
# The built-in variants' equations.
# --------------------------------------------------------------------------

# Differential attention's per-head RMS norm epsilon (the paper's code: 1e-5).
DIFF_NORM_EPS = 1e-5


def diff_lambda_init(layer: int) -> float:
  """Differential attention's lambda_init for a layer (0-based index l - 1 of the
  paper's l = 1..L): 0.8 - 0.6 exp(-0.3 (l - 1))."""
  if isinstance(layer, bool) or not isinstance(layer, (int, np.integer)) or layer < 0:
    raise ValueError(f"layer must be an integer >= 0; got {layer!r}")
  return 0.8 - 0.6 * math.exp(-0.3 * int(layer))


def diff_lambda(params, lambda_init: float) -> jax.Array:
  """(H,) float32: differential attention's lambda_h = exp(lambda_q1 . lambda_k1) -
  exp(lambda_q2 . lambda_k2) + lambda_init (Ye et al. 2025, eq. 2); a head's effective
  map is pattern - lambda_h pattern2."""
  f32 = jnp.float32
  dot = lambda a, b: jnp.sum(params[a].astype(f32) * params[b].astype(f32), axis=-1)
  return (jnp.exp(dot("lambda_q1", "lambda_k1")) - jnp.exp(dot("lambda_q2", "lambda_k2"))
          + lambda_init)


def differential_heads(params, outs: list, layer: int) -> jax.Array:
  """(o1 - lambda_h o2), RMS-normed per head with scale diff_norm (K,), times
  (1 - lambda_init); lambda_h = exp(lambda_q1 . lambda_k1) - exp(lambda_q2 . lambda_k2)
  + lambda_init (Ye et al. 2025, eq. 2-3), in float32. outs: [o1, o2] (B, T, H, K)."""
  o1_BTHK, o2_BTHK = outs
  lambda_init = diff_lambda_init(layer)
  f32 = jnp.float32
  lam_H = diff_lambda(params, lambda_init)
  o = o1_BTHK.astype(f32) - lam_H[:, None] * o2_BTHK.astype(f32)
  o = o * jax.lax.rsqrt(jnp.mean(o * o, axis=-1, keepdims=True) + DIFF_NORM_EPS)
  o = o * params["diff_norm"].astype(f32) * (1.0 - lambda_init)
  return o.astype(o1_BTHK.dtype)


def _edit_second_map(site, weights: list) -> list:
  """pattern2 (B, H, T, S), differential's second map, read or replaced."""
  if site.wants("pattern2"):
    weights = [weights[0], site("pattern2", weights[1])]
  return weights


def _edit_sink_weight(site, weights: list) -> list:
  """sink_weight (B, H, T) = 1 - the pattern's row sum; an edit rescales the row so the
  keys share what the sink leaves."""
  w = weights[0]
  if site.wants("sink_weight"):
    sw_BHT = 1.0 - jnp.sum(w, axis=-1)
    edited = site("sink_weight", sw_BHT)
    if edited is not sw_BHT:
      left = 1.0 - sw_BHT
      ratio = jnp.where(left > 0, (1.0 - edited) / jnp.where(left > 0, left, 1.0), 0.0)
      w = w * ratio[..., None]
  return [w] + weights[1:]


def _head_gate(params, x, logits):
  """gated_head's gate (B, T, H): sigmoid(x wg + bg), wg (D, H) as one 2-D matmul."""
  b, t, d = x.shape[0], x.shape[1], x.shape[-1]
  g_BTH = (x.reshape(b * t, d) @ params["wg"].astype(x.dtype)).reshape(b, t, -1)
  return jax.nn.sigmoid(g_BTH + params["bg"].astype(x.dtype))


def _sigmoid_args(params, call) -> dict:
  """b of sigmoid(scores + b): the call's sigmoid_bias, or -log S."""
  b = call.sigmoid_bias
  return {"sigmoid_bias": float(b) if b is not None else (-math.log(call.s) if call.s else 0.0)}


def _gated_head_flops(t, s, d, h):
  if h is None:
    raise ValueError("variant='gated_head' needs num_heads (its gate is D x h)")
  return 2 * t * d * h


def _lecun(rank: int):
  """LeCun normal (truncated) over the first axis, as the projections."""
  return jax.nn.initializers.variance_scaling(1.0, "fan_in", "truncated_normal", in_axis=0,
                                              out_axis=tuple(range(1, rank)))


def _ones(key, shape, dtype):
  return jnp.ones(shape, dtype)


def _lambda_init(key, shape, dtype):
  return 0.1 * jax.random.normal(key, shape, dtype)


_LAMBDAS = ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2")
_REFERENCE_AND_BLOCKED = ("reference", "blocked")

BUILT_IN = tuple(register(v).name for v in (
    Variant("softmax", "softmax(q k^T / sqrt(K)) v"),
    Variant("gated", "each head's output times sigmoid(x wg + bg), elementwise",
            params=lambda d, h, k: {"wg": (d, h, k), "bg": (h, k)},
            init={"wg": _lecun(3)}, sites=("gate",), gate_projection=("wg", "bg"),
            gate=lambda params, x, logits: jax.nn.sigmoid(logits),
            flops=lambda t, s, d, h: 2 * t * d * d, needs_square_heads=True),
    Variant("gated_head", "each head's output times the scalar sigmoid(x wg + bg)",
            params=lambda d, h, k: {"wg": (d, h), "bg": (h,)},
            init={"wg": _lecun(2)}, sites=("gate",), gate=_head_gate,
            flops=_gated_head_flops),
    Variant("differential", "(softmax(q1 k1) - lambda_h softmax(q2 k2)) v, RMS-normed",
            params=lambda d, h, k: {**{n: (h, k // 2) for n in _LAMBDAS}, "diff_norm": (k,)},
            init={**{n: _lambda_init for n in _LAMBDAS}, "diff_norm": _ones},
            sites=("pattern2",), weight_sites=("pattern2",), kernels=_REFERENCE_AND_BLOCKED,
            maps=2, combine=differential_heads, edit_maps=_edit_second_map,
            needs_square_heads=True),
    Variant("sigmoid", "sigmoid(q k^T / sqrt(K) + b) v, unnormalised",
            kernels=_REFERENCE_AND_BLOCKED, options=("sigmoid_bias",),
            kernel_args=_sigmoid_args),
    Variant("sink", "softmax over the keys and one learned logit per head",
            params=lambda d, h, k: {"sink_logit": (h,)}, sites=("sink_weight",),
            weight_sites=("sink_weight",), kernels=_REFERENCE_AND_BLOCKED,
            kernel_args=lambda params, call: {"sink_H": params["sink_logit"]},
            edit_maps=_edit_sink_weight),
    Variant("qk_norm", "RMS-normalised queries and keys per head before RoPE",
            params=lambda d, h, k: {"q_norm": (k,), "k_norm": (k,)},
            init={"q_norm": _ones, "k_norm": _ones}, shared=("q_norm", "k_norm")),
))
