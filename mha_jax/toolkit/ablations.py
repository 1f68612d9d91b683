"""Ablations as uses of the one interventions mechanism: what a node or an edge carries
once it is taken out.

  zero      0
  mean      the mean over a reference set of prompts: per position (each position its own
            mean over the set's rows) or over positions (one mean over rows and positions)
  resample  each row takes another prompt's value (row r takes row perm[r]; by default
            the next row, r + 1 mod N: no row keeps its own)
  corrupt   the paired corrupt prompt's value

`values(kind, ...)` is the ablated value of a site, shape (B, T, ...); `edit(...)`
the replace Edit that puts it in (head selections and all); `mean_edits` is mean
ablation of heads' outputs (the z site), the same numbers as shifting the output bias
by mean(z) W_O with the head's gate at 0 (tested).
"""

from __future__ import annotations

from typing import Mapping, Sequence

import jax.numpy as jnp
import numpy as np

from mha_jax import interventions
from mha_jax.errors import UserError

KINDS = ("corrupt", "mean", "resample", "zero")


def check_kind(kind: str, what: str = "ablation") -> str:
  if kind not in KINDS:
    raise UserError(f"{what} must be one of {', '.join(KINDS)}; got {kind!r}", setting=what)
  return kind


def values(kind: str, clean, *, corrupt=None, reference=None, per_position: bool = True,
           perm: Sequence[int] | None = None):
  """The ablated value (B, T, ...) of a site whose run value is `clean` (B, T, ...).

  corrupt: (B, T, ...) the paired corrupt run's value (kind "corrupt").
  reference: (R, T, ...) the site on the reference prompts (kind "mean"; default: clean
    itself); per_position: a mean per position, else one over rows and positions.
  perm: (B,) the row each row takes (kind "resample"; default r -> r + 1 mod B).
  """
  check_kind(kind, "ablation")
  clean = jnp.asarray(clean)
  if kind == "zero":
    return jnp.zeros_like(clean)
  if kind == "corrupt":
    if corrupt is None or tuple(corrupt.shape) != tuple(clean.shape):
      raise UserError(f"corrupt ablation needs the corrupt run's value of shape "
                      f"{tuple(clean.shape)}; got {None if corrupt is None else corrupt.shape}")
    return jnp.asarray(corrupt, clean.dtype)
  if kind == "resample":
    b = clean.shape[0]
    perm = np.roll(np.arange(b), -1) if perm is None else np.asarray(perm)
    if perm.shape != (b,):
      raise UserError(f"resample: perm must have shape ({b},); got {perm.shape}")
    return clean[jnp.asarray(perm)]
  ref = clean if reference is None else jnp.asarray(reference, clean.dtype)
  if ref.shape[1:] != clean.shape[1:] and per_position:
    raise UserError(f"mean ablation per position: the reference set's shape {ref.shape} "
                    f"must match the site's {clean.shape} after the rows")
  m = ref.mean(0, keepdims=True) if per_position else ref.mean((0, 1), keepdims=True)
  return jnp.broadcast_to(m, clean.shape)


def edit(kind: str, clean, *, heads=None, positions=None, **kw) -> interventions.Edit:
  """The Edit that ablates a site (selections as interventions.replace)."""
  return interventions.replace(values(kind, clean, **kw), heads=heads, positions=positions)


def mean_edits(heads: Sequence[tuple[str, int, int]], means: Mapping) -> dict:
  """{site: [Edit]}: each listed (stack, layer, head)'s output z replaced by its mean
  (means {stack: [(H, K) per layer]}, as toolkit.importance.mean_head_outputs gives).
  Pass as a Hook's edits (`interventions.Hook(mean_edits(...))`, as `hook=`): every
  forward, loss and evaluation then runs with the heads mean-ablated."""
  out: dict = {}
  for stack, layer, head in heads:
    m = jnp.asarray(means[stack][layer][head])          # (K,)
    out.setdefault(f"{stack}.{layer}.attn.z", []).append(interventions.replace(m, heads=head))
  return out
