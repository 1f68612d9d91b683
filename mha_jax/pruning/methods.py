"""Pruning methods. Each returns a mask {stack: [(H_l,) 0/1]} over the stacks it prunes.

  l0        train Hard Concrete gates on loss + lambda * expected L0 (Voita et al. 2019);
            the rest of the model is frozen by an optax multi_transform unless finetune
  keep K    exactly K heads: train the gates at lambda, then keep the K heads with the
            largest log_alpha (a top-K relaxation; no bisection over lambda)
  michel    iteratively remove the least important 10 % by I_h, re-scoring each time
  random    remove heads in a random order
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax

from mha_jax.errors import UserError
from mha_jax.toolkit import importance
from mha_jax.pruning import hard_concrete
from mha_jax.toolkit import head_masks
from mha_jax.tasks import gates_hook, jitted


def train_gates(loaded, lam: float, *, stacks, steps: int = 300, lr: float = 0.05,
                finetune: bool = False, param_lr: float = 1e-4, seed: int = 0,
                hc: hard_concrete.HardConcrete = hard_concrete.HardConcrete(), start_mask: dict | None = None,
                log: Callable[[str], None] = print):
  """Trains log_alpha (and the params when finetune) on loss + lam * L0. Returns
  (log_alpha, params, history)."""
  if lam < 0:
    raise UserError(f"l0_lambda must be >= 0; got {lam}", setting="l0_lambda")
  if steps < 1:
    raise UserError(f"steps must be >= 1; got {steps}", setting="steps")
  hc.validate()
  task = loaded.task
  counts = head_masks.ones_head_mask(loaded.params, stacks)
  log_alpha = hard_concrete.init_log_alpha({s: [len(m) for m in c] for s, c in counts.items()}, hc)
  # Heads removed by an earlier prune stay closed; a mask argument, not a constant.
  fixed = {s: [jnp.asarray(start_mask[s][i] if start_mask and s in start_mask else m)
               for i, m in enumerate(c)] for s, c in counts.items()}
  smoothing = loaded.config.get("train", {}).get("label_smoothing", 0.0)

  def objective(params, log_alpha, batch, key, lam, fixed):
    g = hard_concrete.sample(log_alpha, key, hc)
    g = {s: [gi * fixed[s][i] for i, gi in enumerate(layers)] for s, layers in g.items()}
    loss, _ = task.loss(params, batch, hook=gates_hook(task, head_masks.full_head_gates(params, g)),
                        label_smoothing=smoothing)
    pen = hard_concrete.l0_penalty(log_alpha, hc)
    return loss + lam * pen, (loss, pen)

  if finetune:      # gates and model: one optimizer over both
    tx = optax.multi_transform({"gates": optax.adam(lr), "model": optax.adam(param_lr)},
                               {"params": "model", "log_alpha": "gates"})

    def step(st, opt_state, batch, key, lam, fixed):
      (_, aux), grads = jax.value_and_grad(
          lambda st: objective(st["params"], st["log_alpha"], batch, key, lam, fixed),
          has_aux=True)(st)
      updates, opt_state = tx.update(grads, opt_state, st)
      return optax.apply_updates(st, updates), opt_state, aux
  else:
    # Frozen model: the gradient is taken w.r.t. log_alpha alone, so no weight gradient
    # (embedding, projections) is ever formed; the params are a jit argument that is
    # read, never updated or copied (no optimizer state for them).
    tx = optax.adam(lr)

    def gate_step(la, opt_state, params, batch, key, lam, fixed):
      (_, aux), g_la = jax.value_and_grad(
          lambda la: objective(params, la, batch, key, lam, fixed), has_aux=True)(la)
      updates, opt_state = tx.update(g_la, opt_state, la)
      return optax.apply_updates(la, updates), opt_state, aux

    gate_step = jitted(task, f"gate_step/{lr}/{smoothing}/{hc}", gate_step)

    def step(st, opt_state, batch, key, lam, fixed):
      la, opt_state, aux = gate_step(st["log_alpha"], opt_state, st["params"], batch, key,
                                     lam, fixed)
      return dict(st, log_alpha=la), opt_state, aux

  state = {"params": loaded.params, "log_alpha": log_alpha}
  opt_state = tx.init(state if finetune else log_alpha)
  # Committed like the step's outputs, or the second step compiles again.
  state["log_alpha"], opt_state = jax.device_put((log_alpha, opt_state),
                                                 jax.local_devices()[0])
  if finetune:    # compiled once per setting and model: a lambda sweep or a curve reuses it
    step = jitted(task, f"gate_step/{finetune}/{lr}/{param_lr}/{smoothing}/{hc}", step)
  lam_arg = jnp.float32(lam)
  key = jax.random.PRNGKey(seed)
  history, losses = [], []
  for i in range(steps):
    batch = task.train_batch(i)
    state, opt_state, (loss, pen) = step(state, opt_state, batch, jax.random.fold_in(key, i),
                                         lam_arg, fixed)
    losses.append(loss)
    if (i + 1) % max(1, steps // 5) == 0 or i + 1 == steps:
      kept = head_masks.count(hard_concrete.binary(state["log_alpha"], hc))
      mean = float(np.mean(jax.device_get(losses)))   # over the steps since the last line
      history.append({"step": i + 1, "loss": float(loss), "loss_mean": mean,
                      "l0": float(pen), "kept": kept})
      log(f"  gate step {i + 1}/{steps}: loss {float(loss):.3f} (mean {mean:.3f}) "
          f"expected L0 {float(pen):.1f} kept {kept}")
      losses = []
  return state["log_alpha"], state["params"], history


def l0_mask(log_alpha, hc: hard_concrete.HardConcrete, start_mask=None) -> dict:
  mask = {s: [np.asarray(m) for m in layers] for s, layers in hard_concrete.binary(log_alpha, hc).items()}
  return _and(mask, start_mask)


def top_k_mask(log_alpha, k: int, start_mask=None) -> dict:
  """Keep the k heads with the largest log_alpha (among those not already removed)."""
  flat = [(float(v), s, i, h) for s, layers in log_alpha.items()
          for i, la in enumerate(layers) for h, v in enumerate(np.asarray(la))
          if start_mask is None or s not in start_mask or start_mask[s][i][h] > 0]
  keep = {(s, i, h) for _, s, i, h in sorted(flat, reverse=True)[:k]}
  return {s: [np.asarray([1.0 if (s, i, h) in keep else 0.0 for h in range(len(la))],
                         np.float32) for i, la in enumerate(layers)]
          for s, layers in log_alpha.items()}


def _and(mask, start):
  if not start:
    return mask
  return {s: [m * start[s][i] if s in start else m for i, m in enumerate(layers)]
          for s, layers in mask.items()}


def schedule(total: int, fraction: float = 0.1) -> list[int]:
  """Head counts visited when removing `fraction` of the heads per step."""
  step = max(1, int(round(total * fraction)))
  return list(range(total, -1, -step)) + ([0] if total % step else [])


def michel_masks(loaded, *, stacks, counts: list[int], keep_one_per_layer: bool = False,
                 start_mask=None, limit: int = 256, log: Callable[[str], None] = print
                 ) -> dict[int, dict]:
  """Masks at each requested head count, removing the least important heads by I_h
  (re-scored after every removal step)."""
  mask = _copy(start_mask or head_masks.ones_head_mask(loaded.params, stacks))   # never the caller's lists
  out = {}
  for target in sorted(counts, reverse=True):
    while head_masks.count(mask) > target:
      gates = head_masks.full_head_gates(loaded.params, mask)
      imp = importance.michel_importance(loaded, "valid", limit=limit, gates=gates)["normalized"]
      cands = []
      for s, layers in mask.items():
        for i, m in enumerate(layers):
          alive = np.flatnonzero(m > 0)
          if keep_one_per_layer and len(alive) <= 1:
            continue
          cands += [(imp[f"{s}.{i}.{h}"], s, i, h) for h in alive]
      if not cands:
        break
      n_remove = min(head_masks.count(mask) - target, max(1, int(round(0.1 * _total(mask)))))
      for _, s, i, h in sorted(cands)[:n_remove]:
        mask[s][i][h] = 0.0
      log(f"  michel: {head_masks.count(mask)} heads left")
    out[target] = {s: [m.copy() for m in layers] for s, layers in mask.items()}
  return out


def _copy(mask) -> dict:
  return {s: [np.array(m, np.float32) for m in layers] for s, layers in mask.items()}


def _total(mask):
  return sum(len(m) for layers in mask.values() for m in layers)


def random_masks(loaded, *, stacks, counts: list[int], seed: int = 0, start_mask=None
                 ) -> dict[int, dict]:
  mask = _copy(start_mask or head_masks.ones_head_mask(loaded.params, stacks))
  order = [(s, i, h) for s, layers in mask.items() for i, m in enumerate(layers)
           for h in np.flatnonzero(m > 0)]
  np.random.default_rng(seed).shuffle(order)
  out = {}
  for target in sorted(counts, reverse=True):
    while head_masks.count(mask) > target and order:
      s, i, h = order.pop()
      mask[s][i][h] = 0.0
    out[target] = {s: [m.copy() for m in layers] for s, layers in mask.items()}
  return out
