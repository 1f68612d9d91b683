"""Path expansion of an attention-only model's logits (Elhage et al. 2021).

With the attention patterns A^h frozen (taken from the model's own forward pass), an
attention-only model without LayerNorm is linear in its input x0 = embed + positions:
    logits = x0 U                                              direct path   (order 0)
           + sum_h A^h x0 OV^h U                               single heads  (order 1)
           + sum_{h1 < h2} A^h2 A^h1 x0 OV^h1 OV^h2 U          virtual heads (order 2)
           + ...                                               (row convention, OV = Wv Wo)
Orders are summed exactly by carrying each order's share of the residual through the
layers; term importance removes them order by order.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import optax

from mha_jax.errors import UserError
from mha_jax.models import common


def _check_linear(params):
  layers = [params["lm"][n] for n in common.layers_of(params["lm"])]
  if "ln_final" in params["lm"] or any(("ln1" in l or "mlp" in l) for l in layers):
    raise UserError("path expansion needs an attention-only model without LayerNorm "
                     "(model.attn_only=true, model.layer_norm=false)")
  if any("bo" in l["attn"] or "bv" in l["attn"] for l in layers):
    raise UserError("path expansion needs attention without biases (model.use_bias=false)")


def residual_input(params, tok, pos_in_residual):
  """The residual stream's input x0 (B, T, D), float64: token embeddings, plus the
  positions' when they enter the residual stream."""
  e = np.asarray(params["embed"], np.float64)
  x0 = e[tok]
  if pos_in_residual:
    if "pos_embed" in params:
      x0 = x0 + np.asarray(params["pos_embed"], np.float64)[: tok.shape[1]]
    else:
      x0 = x0 + np.asarray(common.sinusoidal(tok.shape[1], e.shape[1]), np.float64)
  return x0


def expand(params, tokens_BT, patterns: list[np.ndarray], *, pos_in_residual: bool = True
           ) -> dict[str, np.ndarray]:
  """Logits split by order: {"order_0": (B, T, V), "order_1": ..., ...}, float64.

  `patterns[l]` is layer l's frozen attention (B, H, T, T). With positions in Q and K
  only (model.pos="qk") the residual starts from the token embeddings alone.
  """
  _check_linear(params)
  tok = np.asarray(tokens_BT)
  x0 = residual_input(params, tok, pos_in_residual)
  orders = [x0]
  for l, name in enumerate(common.layers_of(params["lm"])):
    attn = {k: np.asarray(v, np.float64) for k, v in params["lm"][name]["attn"].items()}
    a = np.asarray(patterns[l], np.float64)                     # (B, H, T, T)
    ov = np.einsum("dhk,hke->hde", attn["wv"], attn["wo"])      # (H, D, D)
    new = [o.copy() for o in orders] + [np.zeros_like(x0)]
    for n, r in enumerate(orders):                              # order n -> n + 1
      # pairwise, through BLAS (one 3-operand einsum loops over all six indices)
      mixed = np.einsum("bhts,bsd->bhtd", a, r, optimize=True)
      new[n + 1] += np.einsum("bhtd,hde->bte", mixed, ov, optimize=True)
    orders = new
  u = np.asarray(params["unembed"], np.float64)
  return {f"order_{n}": r @ u for n, r in enumerate(orders)}


def single_head_terms(params, tokens_BT, patterns, *, pos_in_residual: bool = True
                      ) -> dict[str, np.ndarray]:
  """Order-1 logits of each head alone: A^h x0 OV^h U, keyed "lm.layer.head"."""
  _check_linear(params)
  tok = np.asarray(tokens_BT)
  x0 = residual_input(params, tok, pos_in_residual)
  u = np.asarray(params["unembed"], np.float64)
  out = {}
  for l, name in enumerate(common.layers_of(params["lm"])):
    attn = {k: np.asarray(v, np.float64) for k, v in params["lm"][name]["attn"].items()}
    for h in range(attn["wq"].shape[1]):
      out[f"lm.{l}.{h}"] = np.einsum("bts,bsd->btd", np.asarray(patterns[l])[:, h], x0) \
          @ attn["wv"][:, h] @ attn["wo"][h] @ u
  return out


def _loss(logits, tokens, mask):
  nll = np.asarray(optax.softmax_cross_entropy_with_integer_labels(
      jnp.asarray(logits[:, :-1]), jnp.asarray(tokens[:, 1:])))
  return float((nll * mask).sum() / mask.sum())


def term_importance(params, tokens_BT, patterns, mask=None, *,
                    pos_in_residual: bool = True) -> list[dict]:
  """Loss with orders 0..n kept, for each n, and the change when the rest is removed."""
  tok = np.asarray(tokens_BT)
  terms = expand(params, tok, patterns, pos_in_residual=pos_in_residual)
  mask = np.ones((tok.shape[0], tok.shape[1] - 1)) if mask is None else mask
  n_max = len(terms) - 1
  names = {0: "direct", 1: "single heads", 2: "virtual heads"}
  rows = []
  full = sum(terms.values())
  full_loss = _loss(full, tok, mask)
  for n in range(n_max + 1):
    kept = sum(terms[f"order_{m}"] for m in range(n + 1))
    removed = [names.get(m, f"order {m}") for m in range(n + 1, n_max + 1)]
    rows.append({"orders_kept": ", ".join(names.get(m, f"order {m}") for m in range(n + 1)),
                 "removed": ", ".join(removed) or "nothing",
                 "loss": _loss(kept, tok, mask),
                 "loss_change_vs_full": _loss(kept, tok, mask) - full_loss})
  return rows
