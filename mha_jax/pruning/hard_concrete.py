"""Hard Concrete head gates (Louizos, Welling & Kingma 2018), as Voita et al. (2019) use.

One parameter log_alpha per head. Training draws
    u ~ U(eps, 1 - eps),  s = sigmoid((log u - log(1 - u) + log_alpha) / beta),
    g = clip(s * (r - l) + l, 0, 1),
and pays the expected L0 norm  sum_h sigmoid(log_alpha_h - beta * log(-l / r)).
Evaluation uses the deterministic gate clip(sigmoid(log_alpha) * (r - l) + l, 0, 1), as
the authors' code does. A head counts as kept when that gate is non-zero (their sparsity
rule, binarize="nonzero") or above 0.5 (binarize="threshold").
Defaults follow lib/layers/concrete_gate.py of the-story-of-heads: beta = 1/3,
(l, r) = (-0.1, 1.1); Louizos et al. used beta = 2/3.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from mha_jax.errors import UserError


BINARIZE = ("nonzero", "threshold")   # HardConcrete.binarize


@dataclasses.dataclass(frozen=True)
class HardConcrete:
  beta: float = 1.0 / 3.0
  low: float = -0.1
  high: float = 1.1
  eps: float = 1e-6
  init_log_alpha: float = 2.0
  per_layer_mean: bool = False      # average the penalty per layer instead of summing
  binarize: str = "nonzero"         # or "threshold" (deterministic gate > 0.5)

  def validate(self):
    if not 0 < self.beta:
      raise UserError(f"beta must be > 0; got {self.beta}")
    if not (self.low < 0 < 1 < self.high):
      raise UserError(f"stretch limits must satisfy low < 0 and high > 1; got "
                       f"({self.low}, {self.high})")
    if self.binarize not in BINARIZE:
      raise UserError(f"binarize must be one of {', '.join(BINARIZE)}; got {self.binarize!r}")


def init_log_alpha(counts: dict[str, list[int]], hc: HardConcrete) -> dict:
  """{stack: [(H_l,) log_alpha]} for the stacks to prune."""
  return {s: [jnp.full((h,), hc.init_log_alpha, jnp.float32) for h in c]
          for s, c in counts.items()}


def sample(log_alpha, key, hc: HardConcrete):
  """Stochastic gates in [0, 1] (same tree as log_alpha)."""
  leaves, tree = jax.tree.flatten(log_alpha)
  keys = jax.random.split(key, len(leaves))
  out = []
  for la, k in zip(leaves, keys):
    u = jax.random.uniform(k, la.shape, minval=hc.eps, maxval=1.0 - hc.eps)
    s = jax.nn.sigmoid((jnp.log(u) - jnp.log1p(-u) + la) / hc.beta)
    out.append(jnp.clip(s * (hc.high - hc.low) + hc.low, 0.0, 1.0))
  return jax.tree.unflatten(tree, out)


def deterministic(log_alpha, hc: HardConcrete):
  """Evaluation gates: clip(sigmoid(log_alpha) * (r - l) + l, 0, 1)."""
  return jax.tree.map(
      lambda la: jnp.clip(jax.nn.sigmoid(la) * (hc.high - hc.low) + hc.low, 0.0, 1.0),
      log_alpha)


def binary(log_alpha, hc: HardConcrete):
  """Kept (1) or pruned (0) per head, by the binarisation rule."""
  thresh = 0.0 if hc.binarize == "nonzero" else 0.5
  return jax.tree.map(lambda g: (g > thresh).astype(jnp.float32), deterministic(log_alpha, hc))


def l0_penalty(log_alpha, hc: HardConcrete):
  """Expected number of open gates: sum_h sigmoid(log_alpha - beta * log(-l / r))."""
  shift = hc.beta * math.log(-hc.low / hc.high)
  terms = [jax.nn.sigmoid(la - shift) for la in jax.tree.leaves(log_alpha)]
  if hc.per_layer_mean:
    return sum(t.mean() for t in terms if t.size)
  return sum(t.sum() for t in terms)
