"""Lines 3 to 5 of the seven, the scores, the weights and their mix: the kernel's call.

  s_BHTS = q . k / sqrt(K)         (each head divides by its own width)
  w_BHTS = softmax(s_BHTS)         (float32; masked entries get weight 0)
  o_BTHK = w_BHTS . v_BSHK         (one weighted average per head)

The kernels (mha_jax/kernels/: reference, xla, cudnn, blocked, pallas) compute these
three lines; kernels/dispatch.py chooses one (impl=, `auto`). Here: the score biases of
relative positions (rel_bias, ALiBi), the sliding window, the variant's kernel
arguments and maps, and the weight sites (pattern, and the variant's own).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from mha_jax.attention.params import ALIBI, REL_BIAS, Call, Params
from mha_jax.blocks import mix_values, relative_bias
from mha_jax.kernels import dispatch

IMPLS = dispatch.IMPLS
resolve_impl = dispatch.resolve_impl


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


def wants_weights(site, c: Call) -> bool:
  """The site reads or edits weights (pattern, or the variant's own weight sites): the
  reference kernel then runs, its weights explicit."""
  return site is not None and any(site.wants(n)
                                  for n in ("pattern",) + c.variant.weight_sites)


def edit_weights(site, outs: list, v_BSGK: jax.Array, c: Call) -> list:
  """The reference kernel's [(o, w)] per map after the weight sites: the variant's own
  (sink_weight, pattern2), then pattern; an edited map is what mixes the values."""
  if c.variant.edit_maps is not None:
    edited = c.variant.edit_maps(site, [w for _, w in outs])
    outs = [(o if e is w else mix_values(e, v_BSGK), e) for (o, w), e in zip(outs, edited)]
  o, w = outs[0]
  if site.wants("pattern"):
    edited = site("pattern", w)
    if edited is not w:
      w, o = edited, mix_values(edited, v_BSGK)
  return [(o, w)] + outs[1:]


def query_key_maps(q_BTHK, k_BSGK, c: Call, scale) -> list:
  """[(q, k)] per score map: whole heads, or the variant's `maps` parts of them along K;
  q times scale * sqrt(width) when a scale is given (the kernels divide by sqrt(width))."""
  maps = c.variant.maps
  if maps == 1:
    pairs = [(q_BTHK, k_BSGK)]
  else:
    w = c.k // maps
    pairs = [(q_BTHK[..., i * w:(i + 1) * w], k_BSGK[..., i * w:(i + 1) * w])
             for i in range(maps)]
  if scale is not None:
    width = pairs[0][0].shape[-1]
    pairs = [(qi * jnp.asarray(scale * math.sqrt(width), qi.dtype), ki) for qi, ki in pairs]
  return pairs


def choose_kernel(impl, pairs, v_BSGK, c: Call, mask, return_weights, window_left,
                  softcap, weights_site: bool, table) -> str:
  """The kernel of the call: reference when a site wants weights, else dispatch's
  choice; 'blocked' under auto when the value heads are wider than the keys'."""
  kernel = "reference" if weights_site else resolve_impl(
      impl, pairs[0][0], return_weights, c.bias is not None or table is not None,
      k_BSGK=pairs[0][1], has_mask=mask is not None or window_left,
      has_softcap=softcap is not None, variant=c.variant.name)
  if v_BSGK.shape[-1] != pairs[0][1].shape[-1] and kernel not in ("reference", "blocked"):
    if impl != "auto":
      raise ValueError(f"impl={impl!r} needs value heads as wide as the query/key heads; "
                       f"V={v_BSGK.shape[-1]} != K={pairs[0][1].shape[-1]} is served by "
                       f"'reference' and 'blocked' (or 'auto')")
    kernel = "blocked"
  return kernel


def attend(params: Params, q_BTHK, k_BSGK, v_BSGK, c: Call, mask, causal: bool, impl: str,
           return_weights: bool, window, scale, softcap, site, cached: bool):
  """(o (B, T, H, K), w (B, H, T, S) or None): the kernel's call, once per score map,
  the maps' outputs combined by the variant."""
  t, s, h, g = c.t, c.s, c.h, c.g
  bias = c.bias
  weights_site = wants_weights(site, c)
  if site is not None and (site.wants("k_q") or site.wants("v_q")):   # G = H from here
    k_BSGK = site("k_q", jnp.repeat(k_BSGK, h // g, axis=2))
    v_BSGK = site("v_q", jnp.repeat(v_BSGK, h // g, axis=2))
  pairs = query_key_maps(q_BTHK, k_BSGK, c, scale)
  table = position_table(params, t, s)
  window_left = window is not None and not cached
  kernel = choose_kernel(impl, pairs, v_BSGK, c, mask, return_weights, window_left, softcap,
                         weights_site, table)
  kernel_window = None
  if window_left and kernel in dispatch.TAKES_WINDOW:
    kernel_window = window
  elif window_left:
    band = (jnp.arange(t)[:, None] - jnp.arange(s)[None, :] < window)[None, None]
    mask = band if mask is None else mask & band
  if table is not None and (kernel not in dispatch.TAKES_TABLE or cached):
    rel = relative_bias(table, t, s, c.length)    # dense (1, H, T, S)
    bias = rel if bias is None else bias + rel
    table = None
  extra = {"softcap": softcap, "window": kernel_window}
  if c.variant.kernel_args is not None:
    extra.update(c.variant.kernel_args(params, c))
  outs = [dispatch.run_kernel(kernel, qi, ki, v_BSGK, mask, causal, bias, table, **extra)
          for qi, ki in pairs]
  if weights_site:
    outs = edit_weights(site, outs, v_BSGK, c)
  o_BTHK, w_BHTS = outs[0]
  if c.variant.combine is not None:
    o_BTHK = c.variant.combine(params, [o for o, _ in outs], c.layer)
  return o_BTHK, w_BHTS
