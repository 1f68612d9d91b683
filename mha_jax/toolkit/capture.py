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


def _program(task):
  """The capture forward (compiled once per task): fn(params, batch, edits) -> {stack:
  [AttentionOutput per layer]}."""
  from mha_jax.tasks import edits_hook, jitted

  def forward(p, b, e):
    hook = interventions.model_hook(edits_hook(e), capture=True, stacks=task.stacks)
    task.apply(p, b, hook=hook)
    return {s: interventions.captured(hook, s, _layers(hook.values, s), AttentionOutput)
            for s in task.stacks if _layers(hook.values, s)}
  return jitted(task, "capture", forward)


def captured(task, params, batch, hook=None) -> dict:
  """{stack: [AttentionOutput per layer]} on the host, read from the sites of the task's
  own forward (`{stack}.{i}.attn.pattern`, `attn.z`, `attn_out`; compiled once per task
  and shape), with `hook`'s edits applied (an edits-only Hook: head gates through
  `tasks.gates_hook`, ablations; see `tasks.hook_edits`)."""
  from mha_jax.tasks import hook_edits
  return jax.device_get(_program(task)(params, batch, hook_edits(hook)))


def captured_rows(task, params, batch, hook=None, rows: int | None = None) -> dict:
  """`captured` of `batch`, `rows` sequences at a time (None: all at once), joined."""
  if rows is None:
    return captured(task, params, batch, hook)
  n = max(int(np.shape(a)[0]) for a in jax.tree.leaves(batch) if np.ndim(a))  # sequences
  if rows >= n:
    return captured(task, params, batch, hook)
  part = lambda a, lo: a[lo:lo + rows] if np.ndim(a) and np.shape(a)[0] == n else a  # noqa: E731
  caps = [captured(task, params, {k: part(v, lo) for k, v in batch.items()}, hook)
          for lo in range(0, n, rows)]
  return jax.tree.map(lambda *xs: np.concatenate(xs), *caps)


def plan(task, params, batch, budget: int, rows: int | None = None):
  """memory.RowsPlan: the sequences per captured batch of `batch`'s length in `budget`
  bytes, of at most `rows` (default the batch's), from the capture's shapes (traced, not
  compiled): what it keeps per sequence (every layer's weights, z and output), one
  layer's activations and the float32 logits at every position."""
  from mha_jax.toolkit import memory
  out = jax.eval_shape(_program(task), params, batch, None)
  leaves = jax.tree.leaves(out)
  b = int(leaves[0].shape[0])
  kept = sum(int(np.prod(x.shape)) * 4 for x in leaves) // b     # float32 on the host
  first = next(iter(out.values()))[0]
  _, h, t, keys = first.weights.shape
  d = int(first.out.shape[-1])
  shapes = memory.PatchShapes(
      layers=max(len(v) for v in out.values()), heads=h, kv_heads=h,
      head_dim=int(first.heads.shape[-1]), d_model=d, d_mlp=memory.mlp_width(params, d),
      vocab=int(getattr(task, "vocab_size", 0) or 0), t=t, t_keys=keys, pairs=b,
      dtype_bytes=memory.dtype_bytes(params))
  return memory.rows_plan(shapes, rows or b, budget, kept_per_row=kept, logits_positions=t,
                          what="one captured sequence")


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
                  limit: int = 0, hook=None, memory_budget: int | None = None
                  ) -> Iterator[tuple[dict, dict, np.ndarray]]:
  """Yields (batch, captured, example_weight) per batch of `split` (with `hook`'s edits,
  as `captured`); memory_budget (bytes): each batch captured `plan`'s sequences at a
  time (the same batches and captures, less device memory).

  `captured[stack][layer]` = AttentionOutput with .weights (B, H, T, S) and .heads
  (B, T, H, K) as NumPy arrays. example_weight is 0 for rows that only pad the last batch.
  `limit` > 0 stops after that many examples.
  """
  model, params = loaded.task, loaded.params
  rows = None
  seen = 0
  for batch, weight in model.eval_batches(split, batch_size):
    if memory_budget is not None and rows is None:
      rows = plan(model, params, batch, memory_budget).rows_per_batch
    cap = captured_rows(model, params, batch, hook, rows)
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
            limit: int = 0, reducers: Sequence[Callable] = (), keep_full: bool = False,
            memory_budget: int | None = None):
  """Runs `reducers(batch, captured, weight)` on every batch; returns the full captures
  (a list of (batch, captured, weight)) only when keep_full is True. memory_budget:
  as iter_captures."""
  kept = []
  for item in iter_captures(loaded, split, stacks=stacks, layers=layers,
                            batch_size=batch_size, limit=limit, memory_budget=memory_budget):
    for r in reducers:
      r(*item)
    if keep_full:
      kept.append(item)
  return kept if keep_full else None
