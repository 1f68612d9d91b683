"""Head importance and ablation, through the model's own head gates.

  michel_importance   I_h = E_x |dL(x)/d xi_h| at xi = 1 (Michel et al. 2019), per example,
                      normalised per layer (L2), as in their code
  ablate              evaluate with some heads zeroed, or replaced by their mean output
  leave_one_out       the loss (and BLEU) change of each single-head ablation

Mean ablation is param surgery, not new attention code: the head's gate goes to 0 and
its mean output (over a reference set) times its W_O rows is added to the block's
output bias, which is exactly what replacing the head's output by its mean does.
"""

from __future__ import annotations

from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from mha_jax import interventions, tasks
from mha_jax.errors import UserError
from mha_jax.data import vocab
from mha_jax.models import common
from mha_jax.toolkit import ablations

MODES = ("zero", "mean")   # an ablated head's output: 0, or its mean over valid


def parse_heads(params, names: str | Sequence[str]) -> list[tuple[str, int, int]]:
  """"encoder.2.5,decoder_cross.0.1" -> [(stack, layer, head)], checked against params."""
  if isinstance(names, str):
    names = [n for n in names.split(",") if n.strip()]
  counts = common.head_counts(params)
  out = []
  for name in names:
    parts = name.strip().split(".")
    ok = len(parts) == 3 and parts[1].isdigit() and parts[2].isdigit()
    if ok:
      stack, layer, head = parts[0], int(parts[1]), int(parts[2])
      ok = stack in counts and layer < len(counts[stack]) and head < counts[stack][layer]
    if not ok:
      valid = "; ".join(f"{s}.0-{len(c) - 1}.0-{max(c) - 1}" for s, c in counts.items())
      raise UserError(f"heads: {name!r} is not a head of this model; valid names are "
                      f"stack.layer.head within: {valid}", setting="heads")
    out.append((stack, layer, head))
  return out


def gates_without(params, heads: Sequence[tuple[str, int, int]]):
  gates = common.ones_head_gates(params)
  for stack, layer, head in heads:
    gates[stack][layer] = gates[stack][layer].at[head].set(0.0)
  return gates


def mean_head_outputs(loaded, split: str = "valid", limit: int = 256) -> dict:
  """{stack: [(H, K) mean output of each head over the reference set's real tokens]}."""
  from mha_jax.toolkit.capture import iter_captures
  sums, count = {}, {}
  for batch, cap, weight in iter_captures(loaded, split, limit=limit):
    for stack, layers in cap.items():
      for layer, r in layers.items():
        heads = np.asarray(r.heads, np.float64)                   # (B, T, H, K)
        mask = _query_mask(loaded, batch, stack, heads.shape[1]) * weight[:, None]
        s = (heads * mask[:, :, None, None]).sum((0, 1))
        sums.setdefault(stack, {})[layer] = sums.get(stack, {}).get(layer, 0) + s
        count.setdefault(stack, {})[layer] = count.get(stack, {}).get(layer, 0) + mask.sum()
  return {s: [sums[s][l] / max(count[s][l], 1) for l in sorted(sums[s])] for s in sums}


def _query_mask(loaded, batch, stack, t):
  if "src" in batch:
    ids = batch["src"] if stack == "encoder" else batch["tgt"][:, :-1]
    return (np.asarray(ids)[:, :t] != vocab.PAD_ID).astype(np.float64)
  return np.ones((len(batch["tokens"]), t))


def ablate(loaded, heads, *, mode: str = "zero", split: str = "test", means=None,
           bleu_limit: int | None = None) -> dict:
  """Metrics with `heads` ablated ("zero": output 0; "mean": output = its mean)."""
  if mode not in MODES:
    raise UserError(f"mode must be one of {', '.join(MODES)}; got {mode!r}", setting="mode")
  params = loaded.params
  edits = None
  if mode == "mean":    # the heads' z replaced by their means: an interventions edit
    means = means if means is not None else mean_head_outputs(loaded, "valid")
    edits = interventions.Hook(ablations.mean_edits(heads, means))
  hook = tasks.gates_hook(loaded.task, gates_without(loaded.params, heads), edits)
  out = loaded.task.evaluate(params, split, hook=hook, bleu_limit=bleu_limit)
  if loaded.task.decoder_only and not loaded.task.trainable:   # an imported LM: its eval split is
    out.update(repeated_loss(loaded, params, hook))         # text; also on repeated tokens
  return out


def repeated_loss(loaded, params=None, hook=None, *, batch: int = 8, half_len: int = 32,
                  seed: int = 7_000_003) -> dict[str, float]:
  """The LM loss on repeated random tokens of the model's own vocabulary (with BOS):
  on the first copy (loss_first, unpredictable) and on the repeated half (loss_repeat,
  what induction heads make predictable). hook: as the task's evaluate (edits only)."""
  from mha_jax.data import repeated_tokens as rt
  task = loaded.task
  tokens, m = task.repeated_tokens(seed, batch, half_len)
  masks = rt.position_masks(m, tokens.shape[1] - 1)
  b = {"tokens": tokens, "mask_first": masks["first"], "mask_repeat": masks["repeat"]}
  fn = tasks.jitted(task, "repeat_metrics",
                    lambda p, bt, e: task.loss(p, bt, hook=tasks.edits_hook(e))[1])
  t = jax.device_get(fn(loaded.params if params is None else params, b,
                        tasks.hook_edits(hook)))
  return {f"loss_{k}": float(t[f"loss_{k}"] / t[f"tokens_{k}"]) for k in ("first", "repeat")}


def random_draws(top: Sequence[str], heads: Sequence[str], draws: int, seed: int = 0
                 ) -> list[list[str]]:
  """`draws` sets of len(top) heads: for each top head one from its layer, or from any
  layer when its layer has none left; never a head of `top`, no head twice in a set."""
  top = list(top)
  others = [h for h in heads if h not in top]
  if len(others) < len(top):
    raise UserError(f"top_k {len(top)}: the model has only {len(others)} other heads to "
                    f"draw as many random ones")
  rng = np.random.default_rng(seed)
  out = []
  for _ in range(draws):
    pick: list[str] = []
    for n in top:
      layer = n.rsplit(".", 1)[0] + "."
      free = [o for o in others if o not in pick]
      pool = [o for o in free if o.startswith(layer)] or free
      pick.append(pool[int(rng.integers(len(pool)))])
    out.append(pick)
  return out


def induction_vs_random(loaded, scores: dict[str, float], *, top: int = 5, draws: int = 5,
                        mode: str = "zero", split: str = "test", seed: int = 0,
                        means=None, log=print) -> dict:
  """Ablate the `top` heads with the largest induction score together, against `draws`
  sets of random heads (one per top head, never a top head, no head twice), each drawn
  from its top head's layer, or from the other layers when that layer has no head left.
  Returns the metrics of both, their deltas from the unablated model, and each draw."""
  if mode == "mean" and means is None:
    means = mean_head_outputs(loaded, "valid")
  names = sorted(scores, key=lambda n: -scores[n])[:top]
  counts = common.head_counts(loaded.params)
  others = [f"{s}.{l}.{h}" for s, per in counts.items() for l, n in enumerate(per)
            for h in range(n) if f"{s}.{l}.{h}" not in names]
  if len(others) < len(names):
    total = len(others) + len(names)
    raise UserError(f"top {top}: the model has {len(others)} heads besides the top "
                    f"{len(names)}, too few to draw as many random ones; with {total} heads "
                    f"use top {total // 2} or less", setting=("top", "top"))
  base = loaded.task.evaluate(loaded.params, split)
  if loaded.task.decoder_only and not loaded.task.trainable:
    base.update(repeated_loss(loaded))
  def delta(res):
    return {k: res[k] - base[k] for k in res if k in base and isinstance(res[k], float)}
  top_res = ablate(loaded, parse_heads(loaded.params, names), mode=mode, split=split, means=means)
  log(f"  top {top} {names}: " + " ".join(f"{k} {v:+.3f}" for k, v in delta(top_res).items()))
  rand = []
  for i, pick in enumerate(random_draws(names, names + others, draws, seed)):
    res = ablate(loaded, parse_heads(loaded.params, pick), mode=mode, split=split, means=means)
    same = [p.rsplit(".", 1)[0] == n.rsplit(".", 1)[0] for p, n in zip(pick, names)]
    rand.append({"heads": pick, "same_layer": same, **res, "delta": delta(res)})
    log(f"  random draw {i}: {pick}: " +
        " ".join(f"{k} {v:+.3f}" for k, v in rand[-1]["delta"].items()))
  keys = rand[0]["delta"].keys() if rand else []
  return {"mode": mode, "split": split, "base": base, "top_heads": names,
          "top_scores": [scores[n] for n in names], "top": top_res, "top_delta": delta(top_res),
          "random_draws": rand,
          "random_delta_mean": {k: float(np.mean([r["delta"][k] for r in rand])) for k in keys}}


def michel_importance(loaded, split: str = "valid", *, limit: int = 512,
                      batch_size: int = 32, gates=None, params=None) -> dict[str, Any]:
  """{"raw": {head name: I_h}, "normalized": {head name: I_h / ||I_layer||},
  "examples": n}, from per-example gate gradients taken at `gates` (default: all 1)."""
  model = loaded.task
  params = loaded.params if params is None else params
  ones = common.ones_head_gates(params) if gates is None else gates
  if not loaded.task.trainable:   # imported real models: memory-bound
    batch_size = min(batch_size, int(loaded.config.eval.batch_size))

  def example_loss(gates, params, ex):
    batch = jax.tree.map(lambda a: a[None], ex)
    return model.loss(params, batch, hook=tasks.gates_hook(model, gates))[0]

  def example_outputs(gates, params, ex):   # tasks whose loss is flat at gates = 1
    batch = jax.tree.map(lambda a: a[None], ex)
    return model.importance_outputs(params, batch, hook=tasks.gates_hook(model, gates))[0]  # (K,)

  # One compile per model: Michel's iterative pruning calls this after every removal.
  # |dL/dxi| per example; or sum_k |d out_k / dxi| where the task gives importance_outputs.
  vector = model.compares_to_dense   # its loss is flat at the dense model
  grad = (lambda g, p, ex: jax.tree.map(lambda j: jnp.abs(j).sum(0), jax.jacrev(
      example_outputs)(g, p, ex))) if vector else jax.grad(example_loss)
  per_example = tasks.jitted(model, "gate_grads", jax.vmap(grad, in_axes=(None, None, 0)))
  total = jax.tree.map(jnp.zeros_like, ones)     # summed on the device
  n = 0
  for batch, weight in model.eval_batches(split, batch_size):
    g = per_example(ones, params, batch)
    w = jnp.asarray(weight)
    total = jax.tree.map(lambda t, x: t + jnp.einsum("b,bh->h", w, jnp.abs(x)), total, g)
    n += int(weight.sum())                        # host-side weights: no transfer
    if limit and n >= limit:
      break
  total = jax.tree.map(lambda t: np.asarray(t, np.float64), jax.device_get(total))
  raw, normed = {}, {}
  for stack, layers in total.items():
    for i, imp in enumerate(layers):
      imp = imp / max(n, 1)
      norm = np.linalg.norm(imp)
      for h, v in enumerate(imp):
        raw[f"{stack}.{i}.{h}"] = float(v)
        normed[f"{stack}.{i}.{h}"] = float(v / norm) if norm > 0 else 0.0
  return {"raw": raw, "normalized": normed, "examples": n}


def leave_one_out(loaded, *, split: str = "test", mode: str = "zero",
                  bleu_limit: int = 100, heads=None, base: dict | None = None) -> list[dict]:
  """For each head (all by default): the metrics' change when only it is ablated.
  `base` (the unablated metrics at the same split and bleu_limit) saves an evaluation."""
  if base is None:
    base = loaded.task.evaluate(loaded.params, split, bleu_limit=bleu_limit)
  means = mean_head_outputs(loaded, "valid") if mode == "mean" else None
  names = heads or common.head_names(loaded.params)
  rows = []
  for name in names:
    h = parse_heads(loaded.params, [name])
    res = ablate(loaded, h, mode=mode, split=split, means=means, bleu_limit=bleu_limit)
    row = {"head": name, **{f"{k}": v for k, v in res.items()}}
    for k in res:
      row[f"delta_{k}"] = res[k] - base[k]
    rows.append(row)
  return rows
