"""Stream per-head attention weights and outputs out of the unchanged model.

The task's own forward runs with a hook that reads each layer's pattern, z and output
sites (interventions); nothing here re-implements attention. Memory stays bounded: each batch is handed to
reducers and dropped, unless full tensors are asked for.
"""

from __future__ import annotations

from typing import Callable, Iterator, Sequence

import jax
import numpy as np

from mha_jax import interventions
from mha_jax.attention import AttentionOutput
from mha_jax.errors import UserError


def captured(task, params, batch, hook=None) -> dict:
  """{stack: [AttentionOutput per layer]} on the host, read from the sites of the task's
  own forward (`{stack}.{i}.attn.pattern`, `attn.z`, `attn_out`; compiled once per task
  and shape), with `hook`'s edits applied (an edits-only Hook: head gates through
  `tasks.gates_hook`, ablations; see `tasks.hook_edits`)."""
  from mha_jax.tasks import edits_hook, hook_edits, jitted

  def forward(p, b, e):
    hook = interventions.model_hook(edits_hook(e), capture=True, stacks=task.stacks)
    task.apply(p, b, hook=hook)
    return {s: interventions.captured(hook, s, _layers(hook.values, s), AttentionOutput)
            for s in task.stacks if _layers(hook.values, s)}
  return jax.device_get(jitted(task, "capture", forward)(params, batch, hook_edits(hook)))


def _layers(values: dict, stack: str) -> int:
  """How many layers of `stack` the forward recorded (its `attn_out` sites)."""
  return sum(1 for k in values if k.startswith(f"{stack}.") and k.endswith(".attn_out"))


def _select(cap: dict, stacks: Sequence[str] | None, layers: Sequence[int] | None) -> dict:
  out = {}
  for stack, per_layer in cap.items():
    if stacks is not None and stack not in stacks:
      continue
    out[stack] = {i: r for i, r in enumerate(per_layer) if layers is None or i in layers}
  return out


def iter_captures(loaded, split: str = "valid", *, stacks: Sequence[str] | None = None,
                  layers: Sequence[int] | None = None, batch_size: int = 64,
                  limit: int = 0, hook=None) -> Iterator[tuple[dict, dict, np.ndarray]]:
  """Yields (batch, captured, example_weight) per batch of `split` (with `hook`'s edits,
  as `captured`).

  `captured[stack][layer]` = AttentionOutput with .weights (B, H, T, S) and .heads
  (B, T, H, K) as NumPy arrays. example_weight is 0 for rows that only pad the last batch.
  `limit` > 0 stops after that many examples.
  """
  model, params = loaded.task, loaded.params
  seen = 0
  for batch, weight in model.eval_batches(split, batch_size):
    cap = captured(model, params, batch, hook)
    missing = [s for s in stacks or () if s not in cap]
    if missing:
      raise UserError(f"stacks: {missing[0]!r} is not in this model; it has {sorted(cap)}")
    cap = _select(cap, stacks, layers)
    if limit and seen + len(weight) > limit:
      weight = weight.copy()
      weight[max(0, limit - seen):] = 0.0
    yield batch, cap, weight
    seen += int(weight.sum())
    if limit and seen >= limit:
      break



def capture(loaded, split: str = "valid", *, stacks=None, layers=None, batch_size: int = 64,
            limit: int = 0, reducers: Sequence[Callable] = (), keep_full: bool = False):
  """Runs `reducers(batch, captured, weight)` on every batch; returns the full captures
  (a list of (batch, captured, weight)) only when keep_full is True."""
  kept = []
  for item in iter_captures(loaded, split, stacks=stacks, layers=layers,
                            batch_size=batch_size, limit=limit):
    for r in reducers:
      r(*item)
    if keep_full:
      kept.append(item)
  return kept if keep_full else None
