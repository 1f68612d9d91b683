"""Orbax checkpoints of a run: params, optimizer state, and meta (step, seed, data
position, the starting loss, and a SHA-256 of every array).

Layout of a workdir:
  config.json            the resolved config
  checkpoints/<step>/    params/, opt_state/, meta/
  checkpoints.bad/       bad checkpoints a resumed run moved out of its way
  metrics.jsonl, tb/     metrics

Integrity lives here and nowhere else. A checkpoint is *bad* when an item is missing or
unreadable or an array's SHA-256 differs from the one saved with it. Restoring without a
step falls back to the newest good checkpoint and reports every bad one it skipped
(`log`, by default a warning on stderr); nothing is deleted. The training RNG is not
restored: every step's key is derived from config.seed and the step number.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import sys
from typing import Any, Callable

import jax
import numpy as np
import orbax.checkpoint as ocp

from mha_jax import config as mc
from mha_jax import storage
from mha_jax.errors import BadCheckpoint, StorageFault, UserError



def warn(message: str) -> None:
  print(f"mha-jax: warning: {message}", file=sys.stderr)


def _digest(x) -> str | None:
  """SHA-256 of an array's dtype, shape and bytes; None for an array split over several
  processes (no process holds all its bytes: such arrays go unchecked)."""
  if isinstance(x, jax.Array) and not x.is_fully_addressable:
    if not x.sharding.is_fully_replicated:
      return None
    x = x.addressable_data(0)
  a = np.ascontiguousarray(np.asarray(x))
  h = hashlib.sha256(f"{a.dtype.str}{a.shape}".encode())
  h.update(a.reshape(-1).view(np.uint8))    # the bytes, not a copy of them
  return h.hexdigest()


def checksums(tree) -> dict[str, str]:
  """{path: SHA-256} of every array in a pytree."""
  return {jax.tree_util.keystr(p): _digest(x)
          for p, x in jax.tree_util.tree_leaves_with_path(tree)}


def _run_draining(coro):
  """orbax's run-in-a-fresh-event-loop, except that the loop is closed only once every
  task it started has finished. When one array of a checkpoint cannot be read, orbax's
  gather fails at once while the other reads are still in TensorStore; closing the loop
  then makes each of them print "Event loop is closed" (and "Task exception was never
  retrieved") long after the error was handled."""
  loop = asyncio.new_event_loop()
  try:
    asyncio.set_event_loop(loop)
    return loop.run_until_complete(coro)
  finally:
    pending = asyncio.all_tasks(loop)
    if pending:
      loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
    asyncio.set_event_loop(None)
    loop.close()


@contextlib.contextmanager
def _orbax_drains():
  """Every orbax call inside runs its event loops through _run_draining."""
  from orbax.checkpoint._src import asyncio_utils
  real = getattr(asyncio_utils, "_run_sync_via_new_loop", None)
  if real is None:        # another orbax layout: nothing to replace
    yield
    return
  asyncio_utils._run_sync_via_new_loop = _run_draining
  try:
    yield
  finally:
    asyncio_utils._run_sync_via_new_loop = real


class _QuietStorageFaults(logging.Filter):
  """Drops orbax's background-thread reports ("_SignalingThread.run() raised an
  exception", with a traceback) of a full disk, a read-only place or a write cut off on
  an object store: the same exception reaches the caller, which says it in one line
  (storage.faults, Checkpoints._faults)."""

  removed: set[str] = set()    # partial checkpoints removed (bucket paths, no scheme)

  def filter(self, record: logging.LogRecord) -> bool:
    exc = record.exc_info[1] if record.exc_info else None
    if exc is None:   # the saves _params_handler batches on purpose say so: not a fault
      return not str(record.msg).startswith("No prioritized params found for saving")
    # orbax's other threads still writing into a partial checkpoint that was removed
    if any(p in str(exc) for p in self.removed):
      return False
    return storage.fault_kind(exc) is None and storage.transient_cause(exc) is None


QUIET_FILTER = _QuietStorageFaults()   # the one filter quiet_storage_faults installs


def quiet_storage_faults() -> None:
  """Installs QUIET_FILTER on absl's logger (the one orbax logs through), once: orbax's
  background reports of storage faults the checkpointer handles are dropped."""
  log = logging.getLogger("absl")
  if QUIET_FILTER not in log.filters:
    log.addFilter(QUIET_FILTER)


def _short(e: BaseException) -> str:
  text = " ".join(str(e).split())
  return f"{type(e).__name__}: {text[:200]}" + ("..." if len(text) > 200 else "")


def step_dirs(workdir: str) -> list[int]:
  """Steps that have a folder under workdir/checkpoints (good or bad), ascending."""
  d = storage.join(workdir, "checkpoints")
  if not storage.isdir(d):
    return []
  return sorted(int(n) for n in storage.listdir(d) if n.isdigit())


def has_train_state(workdir: str, step: int) -> bool:
  """Whether checkpoint `step` holds an optimizer state (a pruned or exported model's
  checkpoint holds params only)."""
  return storage.isdir(storage.join(workdir, "checkpoints", str(step), "opt_state"))


def data_file_bytes(host_bytes: int) -> int:
  """The OCDBT data files' target size of a save with host_bytes: TensorStore holds the
  data files being filled in memory (orbax's default target, 2 GiB, is the whole of a
  1B model), so they are a 16th of the largest array, from 1 MiB to 64 MiB."""
  return int(min(max(host_bytes // 16, 1 << 20), 64 << 20))


def _params_handler(host_bytes: int | None, mp) -> ocp.StandardCheckpointHandler:
  """The params item's handler: orbax's, or with host_bytes, one whose save holds little
  beside the params: NumPy leaves written as they are (orbax deep-copies each by
  default), jax.Array leaves copied from the devices to the host in batches of at most
  host_bytes, each written before the next is copied (orbax's device-host limit, which
  its Standard handler does not pass on, and every array "deprioritized": by default
  orbax copies them all to the host first), and OCDBT data files of data_file_bytes(host_bytes).
  The checkpoint's format is the same."""
  h = ocp.StandardCheckpointHandler(multiprocessing_options=mp)
  if host_bytes is None:
    return h
  import copy
  import dataclasses
  from orbax.checkpoint._src.serialization import type_handler_registry as thr
  from orbax.checkpoint._src.serialization import types as ser

  class Later(ser.DefaultSerializationStatusCallback):
    def key_priority(self, _):
      return ser.TransferPriority.ASYNCHRONOUS_DEPRIORITIZED

  size = data_file_bytes(host_bytes)

  class SmallFiles(ocp.PyTreeCheckpointHandler):
    async def async_save(self, directory, *a, args=None, **k):
      if args is not None:
        args = dataclasses.replace(args, ocdbt_target_data_file_size=size, save_args=(
            args.save_args or jax.tree.map(lambda _: ocp.SaveArgs(chunk_byte_size=size),
                                           args.item)))
      return await super().async_save(directory, *a, args=args, **k)
  registry = copy.copy(thr.GLOBAL_TYPE_HANDLER_REGISTRY)
  registry._type_registry = list(registry._type_registry)
  registry._typestr_registry = dict(registry._typestr_registry)
  registry.add(jax.Array, ocp.type_handlers.ArrayHandler(callback=Later()), override=True,
               ignore_warnings=True)
  registry.add(np.ndarray, ocp.type_handlers.NumpyHandler(deepcopy_host_arrays=False),
               override=True, ignore_warnings=True)
  h._impl = SmallFiles(
      save_device_host_concurrent_gb=(int(host_bytes) + 1) / 1e9,
      type_handler_registry=registry, multiprocessing_options=mp, use_ocdbt=True)
  _few_files_at_once(h._impl._handler_impl, max(1, host_bytes // size))
  return h


def _few_files_at_once(impl, files: int) -> None:
  """TensorStore writes (and so buffers) at most `files` data files at once in impl's
  saves (orbax: 128, the whole of a small model when the disk is slower than encoding)."""
  from orbax.checkpoint._src.serialization import tensorstore_utils as ts_utils
  from orbax.checkpoint._src.serialization import types as ser
  ctx = ts_utils.get_ts_context(use_ocdbt=True, file_io_concurrency_limit=int(files))
  infos = impl._get_param_infos

  def bounded(*a, **k):
    return jax.tree.map(lambda i: i.replace(ts_context=ctx), infos(*a, **k),
                        is_leaf=lambda x: isinstance(x, ser.ParamInfo))
  impl._get_param_infos = bounded


class Checkpoints:
  """A thin wrapper over `orbax.checkpoint.CheckpointManager` (synchronous saves)."""

  def __init__(self, workdir: str, *, max_to_keep: int = 3, read_only: bool = False,
               this_process_only: bool = False, host_bytes: int | None = None):
    """this_process_only: a read-only manager that process 0 of a multi-process run
    uses alone (its restores wait for no other process), to decide what every process
    then does (train/loop.py). host_bytes: the most bytes a params save copies from the
    devices to the host at once (orbax's device-host limit; it must exceed the largest
    array): an import then writes its arrays a few at a time instead of copying the
    whole model first (None: no limit)."""
    quiet_storage_faults()
    self.directory = storage.abspath(storage.join(workdir, "checkpoints"))
    # "read_only" here means: never create, delete or clean anything up.
    mp = ocp.options.MultiprocessingOptions()
    if this_process_only and jax.process_count() > 1:
      if not read_only:
        raise ValueError("Checkpoints: this_process_only=True needs read_only=True")
      me = jax.process_index()
      mp = ocp.options.MultiprocessingOptions(primary_host=me, active_processes={me},
                                              barrier_sync_key_prefix=f"mha-jax-p{me}")
    options = ocp.CheckpointManagerOptions(
        max_to_keep=None if read_only else max_to_keep, create=not read_only,
        enable_async_checkpointing=False, cleanup_tmp_directories=not read_only,
        multiprocessing_options=mp)
    self.bad_steps: list[int] = []   # what the last restore without a step skipped
    self.meta: dict = {}             # the meta item restore_params last read
    if read_only and not storage.isdir(self.directory):
      raise UserError(f"workdir {storage.dirname(self.directory)!r} has no trained "
                       f"checkpoint (no {self.directory})")
    self.host_bytes = host_bytes
    handlers = {"params": _params_handler(host_bytes, mp),
                "opt_state": ocp.StandardCheckpointHandler(),
                "meta": ocp.JsonCheckpointHandler()}
    self.manager = ocp.CheckpointManager(storage.path(self.directory), options=options,
                                         item_handlers=handlers)

  def latest_step(self) -> int | None:
    return self.manager.latest_step()

  def all_steps(self) -> list[int]:
    return list(self.manager.all_steps())

  def step_dir(self, step: int) -> str:
    return storage.join(self.directory, str(step))

  def partial_dirs(self, step: int) -> list[str]:
    """What a save of `step` that did not finish may have left: its folder and orbax's
    temporary folders for it."""
    if not storage.isdir(self.directory):
      return []
    return [storage.join(self.directory, n) for n in storage.listdir(self.directory)
            if n == str(step) or (n.startswith(f"{step}.") and "tmp" in n)]

  @contextlib.contextmanager
  def _faults(self, step: int):
    """A full disk, a read-only place or a write cut off (a transient object-store
    error: orbax's own writes are not retried) during the save of `step`: the partial
    checkpoint is removed, so it is never listed, and a StorageFault names the place."""
    try:
      yield
    except Exception as e:
      kind = storage.fault_kind(e)
      cause = storage.transient_cause(e) if kind is None else None
      if kind is None and cause is None:
        raise
      kind = kind or "cut off"
      QUIET_FILTER.removed.add(self.step_dir(step).split("://")[-1].rstrip("/") + "/")
      for p in self.partial_dirs(step):
        storage.rmtree(p, ignore_errors=True)
      try:
        self.manager.reload()
      except Exception:  # noqa: BLE001 - the fault is what the user must see
        pass
      fault = StorageFault(storage.fault_message(kind, self.step_dir(step),
                                                 f"checkpoint {step}") +
                           (f" ({_short(cause)})" if cause is not None else "") +
                           "; the partial checkpoint was removed")
      fault.kind, fault.where = kind, self.step_dir(step)
      raise fault from e

  def save(self, step: int, params, opt_state, meta: dict[str, Any]) -> None:
    meta = {**meta, "checksums": {"params": checksums(params),
                                  "opt_state": checksums(opt_state)}}
    with self._faults(step), _orbax_drains():
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
    sums = checksums(params)
    if jax.process_count() == 1 and self.host_bytes is None:
      # orbax deep-copies every NumPy leaf before writing it (3x slower than a jax.Array
      # on CPU: an imported 1 GB model saves in 5 s instead of 15); with host_bytes
      # they are written as they are
      params = jax.tree.map(lambda x: jax.device_put(x) if isinstance(x, np.ndarray) and
                            x.dtype == jax.dtypes.canonicalize_dtype(x.dtype) else x, params)
    with self._faults(step), _orbax_drains():
      self.manager.save(step, args=ocp.args.Composite(
          params=ocp.args.StandardSave(params),
          meta=ocp.args.JsonSave({**meta, "empty": empty,
                                  "checksums": {"params": sums}})), force=True)
      self.manager.wait_until_finished()

  def _verify(self, step: int, restored: dict) -> None:
    meta = restored.get("meta")
    if not isinstance(meta, dict):
      raise BadCheckpoint(f"checkpoint {self.step_dir(step)} has no readable meta item")
    saved = meta.get("checksums")
    if saved is None:        # written before checksums existed: nothing to compare
      return
    for item in ("params", "opt_state"):
      if item not in restored or item not in saved:
        continue
      got = checksums(restored[item])
      bad = sorted(k for k in set(got) | set(saved[item]) if got.get(k) != saved[item].get(k)
                   and got.get(k) is not None and saved[item].get(k) is not None)
      if bad:
        raise BadCheckpoint(f"checkpoint {self.step_dir(step)}: checksum mismatch in "
                            f"{item}{bad[0]}" + (f" and {len(bad) - 1} more arrays"
                                                if len(bad) > 1 else ""))

  def _restore_checked(self, step: int, make_args: Callable[[int], dict]) -> dict:
    """One checkpoint restored and verified; BadCheckpoint names it and says why."""
    try:   # make_args may read metadata, which fails on a damaged checkpoint too
      with _orbax_drains():
        args = make_args(step)
        restored = self.manager.restore(step, args=ocp.args.Composite(**args))
      restored = {k: restored[k] for k in args}
    except BadCheckpoint:
      raise
    except Exception as e:   # orbax/TensorStore/JSON errors all mean: unreadable
      raise BadCheckpoint(f"checkpoint {self.step_dir(step)} is unreadable ({_short(e)})"
                          ) from e
    self._verify(step, restored)
    return restored

  def _newest_good(self, step: int | None, make_args, log) -> tuple[dict, int]:
    """The given step, or else the newest checkpoint that restores and verifies."""
    if step is not None:
      return self._restore_checked(step, make_args), step
    steps = sorted(self.all_steps(), reverse=True)
    if not steps:
      raise UserError(f"no checkpoint in {self.directory}")
    bad = self.bad_steps = []
    for s in steps:
      try:
        restored = self._restore_checked(s, make_args)
      except BadCheckpoint as e:
        bad.append(s)
        log(f"{e}; falling back to an older checkpoint")
        continue
      if bad:
        log(f"using checkpoint {self.step_dir(s)} (step {s}); skipped bad step(s) "
            f"{bad}, left on disk")
      return restored, s
    raise BadCheckpoint(f"every checkpoint in {self.directory} is bad (steps {bad}); "
                        f"nothing was deleted")

  def restore(self, step: int | None, params_like, opt_state_like, *,
              log: Callable[[str], None] = warn, sharding=None):
    """(params, opt_state, meta, step) in the shapes, dtypes and shardings of the given
    abstract trees (or all on `sharding`), so a checkpoint written on N devices restores
    on M. step None: the newest good checkpoint."""
    def abstract(tree):
      return jax.tree.map(lambda x: jax.ShapeDtypeStruct(
          x.shape, x.dtype, sharding=sharding or x.sharding), tree)
    def make_args(s):
      if not has_train_state(storage.dirname(self.directory), s):
        raise BadCheckpoint(f"checkpoint {self.step_dir(s)} has no optimizer state "
                            f"(opt_state/)")
      return dict(params=ocp.args.StandardRestore(abstract(params_like)),
                  opt_state=ocp.args.StandardRestore(abstract(opt_state_like)),
                  meta=ocp.args.JsonRestore())
    r, step = self._newest_good(step, make_args, log)
    return r["params"], r["opt_state"], r["meta"], step

  def restore_params(self, step: int | None = None, *, log: Callable[[str], None] = warn):
    """(params, step): params as saved (their own shapes: a pruned checkpoint keeps its
    head counts), on this process's first device. step None: the newest good
    checkpoint."""
    sharding = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])

    def make_args(s):
      meta = self.manager.item_metadata(s)["params"]
      if meta is None:
        raise BadCheckpoint(f"checkpoint {self.step_dir(s)} has no params item")
      target = jax.tree.map(
          lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=sharding), meta)
      return dict(params=ocp.args.StandardRestore(target), meta=ocp.args.JsonRestore())

    r, step = self._newest_good(step, make_args, log)
    self.meta = r["meta"] or {}
    empty = self.meta.get("empty", {})
    params = jax.tree_util.tree_map_with_path(
        lambda path, x: (jax.numpy.zeros(empty[jax.tree_util.keystr(path)][0],
                                         empty[jax.tree_util.keystr(path)][1])
                         if jax.tree_util.keystr(path) in empty else x), r["params"])
    return params, step

  def set_aside(self, steps: list[int]) -> str:
    """Moves bad checkpoints out of the way of new saves (to checkpoints.bad/), so a
    resumed run can write those steps again; nothing is deleted. Returns the folder."""
    dest = self.directory + ".bad"
    storage.makedirs(dest)
    for s in steps:
      target, n = storage.join(dest, str(s)), 1
      while storage.exists(target):
        target, n = storage.join(dest, f"{s}.{n}"), n + 1
      storage.rename(self.step_dir(s), target)
    self.manager.reload()
    return dest

  def close(self) -> None:
    with _orbax_drains():
      self.manager.close()


# Model fields that do not change what the params compute (the kernel; dropout is off
# outside training).
FREE_MODEL_FIELDS = ("impl", "dropout")


def check_model_config(meta: dict, cfg_dict: dict, where: str, config_path: str) -> None:
  """The model config saved with a checkpoint (meta["model"], meta["task"]) against the
  workdir's config.json: a difference means the params would be run as another model,
  so it is refused naming the field. Checkpoints from before the model was saved with
  them are not checked."""
  if not isinstance(meta.get("model"), dict):
    return
  added = {k: v for k, v in mc.ADDED_FIELDS.get(meta.get("task"), {}).items()
           if k.startswith("model.")}     # fields added since, with their old value
  saved = {"task": meta.get("task"), **added,
           **{f"model.{k}": v for k, v in meta["model"].items()
              if k not in FREE_MODEL_FIELDS}}
  now = {"task": cfg_dict.get("task"), **added,
         **{f"model.{k}": v for k, v in (cfg_dict.get("model") or {}).items()
            if k not in FREE_MODEL_FIELDS}}
  bad = sorted(k for k in set(saved) | set(now) if saved.get(k) != now.get(k))
  if bad:
    diffs = ", ".join(f"{k}: {saved.get(k)!r} in the checkpoint, {now.get(k)!r} in "
                      f"config.json" for k in bad[:4])
    raise UserError(f"{config_path} does not describe the model of {where} ({diffs}); "
                    f"the checkpoint was trained as the model it records. Restore "
                    f"config.json, or train a new run")


def tree_equal(a, b) -> bool:
  """Bit-for-bit equality of two pytrees."""
  la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
  return (jax.tree.structure(a) == jax.tree.structure(b) and
          all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(la, lb)))
