"""Head masks: turning gates into pruned params, exporting pruned checkpoints.

A head mask (`head_mask`, not an attention mask) is {stack: [(H_l,) 0/1 arrays]}, 1 for a
kept head. `mask_params` zeroes the W_O rows of masked
heads, which is exactly a gate of 0 (the gate multiplies the head's output before W_O),
so a masked checkpoint runs everywhere a normal one does. `export_pruned` then removes
those heads from W_Q, W_K, W_V, W_O for real: layers may end with different head counts,
zero included.
"""

from __future__ import annotations


import jax
import jax.numpy as jnp
import numpy as np

from mha_jax import storage
from mha_jax.models import common


def ones_head_mask(params, stacks=None) -> dict:
  return {s: [np.ones(n, np.float32) for n in c] for s, c in common.head_counts(params).items()
          if stacks is None or s in stacks}


def full_head_gates(params, partial: dict) -> dict:
  """Gates for every stack: `partial` where given, ones elsewhere."""
  gates = common.ones_head_gates(params)
  for s, layers in partial.items():
    gates[s] = [jnp.asarray(g) for g in layers]
  return gates


def count(head_mask: dict) -> int:
  return int(sum(float(np.sum(m)) for layers in head_mask.values() for m in layers))


def kept_names(head_mask: dict) -> list[str]:
  return [f"{s}.{i}.{h}" for s, layers in head_mask.items() for i, m in enumerate(layers)
          for h in np.flatnonzero(np.asarray(m) > 0)]


def _block(params, stack, layer):
  top, attn = common.STACKS[stack]
  return params[top][f"layer_{layer}"][attn]


def _with_block(params, stack, layer, blk):
  top, attn = common.STACKS[stack]
  new = dict(params)
  new[top] = dict(new[top])
  new[top][f"layer_{layer}"] = dict(new[top][f"layer_{layer}"], **{attn: blk})
  return new


def mask_params(params, head_mask: dict):
  """Params whose masked heads write nothing (W_O rows zeroed)."""
  for stack, layers in head_mask.items():
    for i, m in enumerate(layers):
      blk = dict(_block(params, stack, i))
      blk["wo"] = blk["wo"] * jnp.asarray(m, blk["wo"].dtype)[:, None, None]
      params = _with_block(params, stack, i, blk)
  return params


def gqa_layout(m, num_heads: int, num_kv_heads: int):
  """How a layer's head mask becomes grouped-query shapes: (query heads kept, kv heads kept,
  real (1) or padding (0) per kept query head). A kv head goes once all its query heads
  are gone. Groups must stay equal in size (query head i reads kv head i // (H' / G')),
  so a group with fewer survivors than the largest keeps some of its removed query heads
  as padding with W_O zeroed: they write nothing, exactly as masked."""
  m = np.asarray(m) > 0
  per = num_heads // num_kv_heads
  groups = [[h for h in range(g * per, (g + 1) * per) if m[h]] for g in range(num_kv_heads)]
  kv = [g for g in range(num_kv_heads) if groups[g]]
  size = max((len(groups[g]) for g in kv), default=0)
  q, real = [], []
  for g in kv:
    pad = [h for h in range(g * per, (g + 1) * per) if not m[h]][:size - len(groups[g])]
    q += groups[g] + pad
    real += [1.0] * len(groups[g]) + [0.0] * len(pad)
  return np.asarray(q, np.int64), np.asarray(kv, np.int64), np.asarray(real, np.float32)


# Attention variants' per-query-head params, head on axis 0 (mha_jax.attention).
_PER_QUERY_HEAD = ("bg", "sink_logit", "alibi", "lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2")


def export_pruned(params, head_mask: dict):
  """Params with the masked heads physically removed. With grouped-query attention a
  key/value head is removed once all its query heads are (see gqa_layout).

  A QK-norm over the whole projection (OLMo 2: q_norm (H, K), k_norm (G, K)) takes its
  mean over every head's features, so a removed head's query (key) still scales the kept
  heads'. Its projection columns then move to wq_rest / bq_rest (wk_rest / bk_rest):
  computed for the norm's statistics only (attention.qk_rms_norm), never attended with.
  The export stays exact; it saves the removed heads' attention and W_O rows, not their
  Q (K) columns."""
  for stack, layers in head_mask.items():
    for i, m in enumerate(layers):
      blk = _block(params, stack, i)
      h, g = int(blk["wq"].shape[1]), int(blk["wk"].shape[1])
      if g == h:
        q = kv = np.flatnonzero(np.asarray(m) > 0)
        real = np.ones(len(q), np.float32)
      else:
        q, kv, real = gqa_layout(m, h, g)
      new = {}
      gone_q = np.setdiff1d(np.arange(h), q)
      gone_kv = np.setdiff1d(np.arange(g), kv)
      for norm, w, b, gone in (("q_norm", "wq", "bq", gone_q), ("k_norm", "wk", "bk", gone_kv)):
        if norm in blk and np.ndim(blk[norm]) == 2 and len(gone):
          for src, axis in ((w, 1), (b, 0)):
            if src in blk:
              cut = jnp.take(blk[src], gone, axis=axis)
              old = blk.get(src + "_rest")
              new[src + "_rest"] = cut if old is None else jnp.concatenate([old, cut], axis)
      for k, v in blk.items():
        if k in new:
          continue
        if k == "wq":
          new[k] = v[:, q]
        elif k in ("wk", "wv"):
          new[k] = v[:, kv]
        elif k in ("bk", "bv"):
          new[k] = v[kv]
        elif k == "k_norm" and np.ndim(v) == 2:
          new[k] = v[kv]
        elif k == "q_norm" and np.ndim(v) == 2:
          new[k] = v[q]
        elif k == "wo":
          new[k] = v[q] * jnp.asarray(real, v.dtype)[:, None, None]
        elif k == "wg":      # the gated variants' gate weights (D, H, ...)
          new[k] = v[:, q]
        elif k in ("bq", "rel_bias") + _PER_QUERY_HEAD:
          new[k] = v[q]
        else:
          new[k] = v
      params = _with_block(params, stack, i, new)
  return params


def exported_head_mask(params, head_mask: dict) -> dict:
  """The head mask of export_pruned(params, head_mask): 1 for kept heads, 0 for GQA
  padding."""
  out = {}
  for stack, layers in head_mask.items():
    out[stack] = []
    for i, m in enumerate(layers):
      blk = _block(params, stack, i)
      h, g = int(blk["wq"].shape[1]), int(blk["wk"].shape[1])
      out[stack].append(np.ones(int((np.asarray(m) > 0).sum()), np.float32) if g == h
                        else gqa_layout(m, h, g)[2])
  return out


def read_head_mask(workdir: str) -> dict | None:
  """The head mask a pruning run recorded in DIR/pruning.json, if any."""
  path = storage.join(workdir, "pruning.json")
  if not storage.exists(path):
    return None
  info = storage.read_json(path)
  return {s: [np.asarray(m, np.float32) for m in layers] for s, layers in info["mask"].items()}


def head_mask_to_json(head_mask: dict) -> dict:
  return {s: [np.asarray(m).astype(int).tolist() for m in layers]
          for s, layers in head_mask.items()}


def jsonable(tree):
  return jax.tree.map(lambda x: np.asarray(x).tolist(), tree)
