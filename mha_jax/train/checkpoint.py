"""Orbax checkpoints of a run: params, optimizer state, step, RNG and data position.

Layout of a workdir:
  config.json            the resolved config
  checkpoints/<step>/    params/, opt_state/, meta/ (step, rng, data position)
  metrics.jsonl, tb/     metrics
"""

from __future__ import annotations

import os
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

ITEMS = ("params", "opt_state", "meta")


class Checkpoints:
  """A thin wrapper over `orbax.checkpoint.CheckpointManager` (synchronous saves)."""

  def __init__(self, workdir: str, *, max_to_keep: int = 3, read_only: bool = False):
    self.directory = os.path.abspath(os.path.join(workdir, "checkpoints"))
    # "read_only" here means: never create, delete or clean anything up.
    options = ocp.CheckpointManagerOptions(
        max_to_keep=None if read_only else max_to_keep, create=not read_only,
        enable_async_checkpointing=False, cleanup_tmp_directories=not read_only)
    if read_only and not os.path.isdir(self.directory):
      raise ValueError(f"workdir {os.path.dirname(self.directory)!r} has no trained "
                       f"checkpoint (no {self.directory})")
    handlers = {"params": ocp.StandardCheckpointHandler(),
                "opt_state": ocp.StandardCheckpointHandler(),
                "meta": ocp.JsonCheckpointHandler()}
    self.manager = ocp.CheckpointManager(self.directory, options=options,
                                         item_handlers=handlers)

  def latest_step(self) -> int | None:
    return self.manager.latest_step()

  def all_steps(self) -> list[int]:
    return list(self.manager.all_steps())

  def save(self, step: int, params, opt_state, meta: dict[str, Any]) -> None:
    self.manager.save(step, args=ocp.args.Composite(
        params=ocp.args.StandardSave(params), opt_state=ocp.args.StandardSave(opt_state),
        meta=ocp.args.JsonSave(meta)), force=True)
    self.manager.wait_until_finished()

  def save_params(self, step: int, params, meta: dict[str, Any]) -> None:
    """A checkpoint of params only (pruned or exported models: nothing to resume).

    Orbax cannot store zero-size arrays (a layer with every head removed), so those
    are stored as 1-element placeholders and their shapes kept in meta["empty"].
    """
    empty = {}

    def fill(path, x):
      if np.size(x) == 0:
        empty[jax.tree_util.keystr(path)] = [list(np.shape(x)), str(np.asarray(x).dtype)]
        return np.zeros((1,), np.asarray(x).dtype)
      return x

    params = jax.tree_util.tree_map_with_path(fill, params)
    self.manager.save(step, args=ocp.args.Composite(
        params=ocp.args.StandardSave(params),
        meta=ocp.args.JsonSave({**meta, "empty": empty})), force=True)
    self.manager.wait_until_finished()

  def restore(self, step: int, params_like, opt_state_like):
    """Restores into the shapes, dtypes and shardings of the given abstract trees, so a
    checkpoint written on N devices restores on M."""
    def abstract(tree):
      return jax.tree.map(
          lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)
    r = self.manager.restore(step, args=ocp.args.Composite(
        params=ocp.args.StandardRestore(abstract(params_like)),
        opt_state=ocp.args.StandardRestore(abstract(opt_state_like)),
        meta=ocp.args.JsonRestore()))
    return r["params"], r["opt_state"], r["meta"]

  def restore_params(self, step: int | None = None):
    """Params as saved (their own shapes: a pruned checkpoint keeps its head counts),
    on the default device."""
    step = self.latest_step() if step is None else step
    if step is None:
      raise ValueError(f"no checkpoint in {self.directory}")
    meta = self.manager.item_metadata(step)["params"]
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    target = jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=sharding),
                          meta)
    r = self.manager.restore(step, args=ocp.args.Composite(
        params=ocp.args.StandardRestore(target), meta=ocp.args.JsonRestore()))
    empty = (r["meta"] or {}).get("empty", {})
    params = jax.tree_util.tree_map_with_path(
        lambda path, x: (jax.numpy.zeros(empty[jax.tree_util.keystr(path)][0],
                                         empty[jax.tree_util.keystr(path)][1])
                         if jax.tree_util.keystr(path) in empty else x), r["params"])
    return params, step

  def close(self) -> None:
    self.manager.close()


def tree_equal(a, b) -> bool:
  """Bit-for-bit equality of two pytrees."""
  la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
  return (jax.tree.structure(a) == jax.tree.structure(b) and
          all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(la, lb)))
