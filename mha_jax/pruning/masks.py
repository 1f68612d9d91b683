"""Head masks: turning gates into pruned params, exporting pruned checkpoints.

A mask is {stack: [(H_l,) 0/1 arrays]}. `mask_params` zeroes the W_O rows of masked
heads, which is exactly a gate of 0 (the gate multiplies the head's output before W_O),
so a masked checkpoint runs everywhere a normal one does. `export_pruned` then removes
those heads from W_Q, W_K, W_V, W_O for real: layers may end with different head counts,
zero included.
"""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np

from mha_jax.models import common as C


def ones_mask(params, stacks=None) -> dict:
  return {s: [np.ones(n, np.float32) for n in c] for s, c in C.head_counts(params).items()
          if stacks is None or s in stacks}


def full_gates(params, partial: dict) -> dict:
  """Gates for every stack: `partial` where given, ones elsewhere."""
  gates = C.ones_gates(params)
  for s, layers in partial.items():
    gates[s] = [jnp.asarray(g) for g in layers]
  return gates


def count(mask: dict) -> int:
  return int(sum(float(np.sum(m)) for layers in mask.values() for m in layers))


def kept_names(mask: dict) -> list[str]:
  return [f"{s}.{i}.{h}" for s, layers in mask.items() for i, m in enumerate(layers)
          for h in np.flatnonzero(np.asarray(m) > 0)]


def _block(params, stack, layer):
  top, attn = C.STACKS[stack]
  return params[top][f"layer_{layer}"][attn]


def _with_block(params, stack, layer, blk):
  top, attn = C.STACKS[stack]
  new = dict(params)
  new[top] = dict(new[top])
  new[top][f"layer_{layer}"] = dict(new[top][f"layer_{layer}"], **{attn: blk})
  return new


def mask_params(params, mask: dict):
  """Params whose masked heads write nothing (W_O rows zeroed)."""
  for stack, layers in mask.items():
    for i, m in enumerate(layers):
      blk = dict(_block(params, stack, i))
      blk["wo"] = blk["wo"] * jnp.asarray(m, blk["wo"].dtype)[:, None, None]
      params = _with_block(params, stack, i, blk)
  return params


def export_pruned(params, mask: dict):
  """Params with the masked heads physically removed."""
  for stack, layers in mask.items():
    for i, m in enumerate(layers):
      keep = np.flatnonzero(np.asarray(m) > 0)
      blk = _block(params, stack, i)
      new = {k: (v[:, keep] if k in ("wq", "wk", "wv") else v[keep]
                 if k in ("wo", "bq", "bk", "bv", "rel_bias") else v) for k, v in blk.items()}
      params = _with_block(params, stack, i, new)
  return params


def read_mask(workdir: str) -> dict | None:
  """The mask a pruning run recorded in DIR/pruning.json, if any."""
  path = os.path.join(workdir, "pruning.json")
  if not os.path.exists(path):
    return None
  with open(path) as f:
    info = json.load(f)
  return {s: [np.asarray(m, np.float32) for m in layers] for s, layers in info["mask"].items()}


def mask_to_json(mask: dict) -> dict:
  return {s: [np.asarray(m).astype(int).tolist() for m in layers] for s, layers in mask.items()}


def jsonable(tree):
  return jax.tree.map(lambda x: np.asarray(x).tolist(), tree)
