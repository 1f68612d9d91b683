"""Training: one jitted, data-parallel step; orbax checkpoints; resume; preemption.

The same code runs on a laptop, on 8 fake CPU devices and on a TPU slice: params and
optimizer state live on a 2-D mesh ("data", "model"): each batch is split over "data",
heads and MLP units over "model" (train/sharding.py), and on several hosts each host
feeds its own rows of every global batch. With train.seeds > 1 the same step is vmapped
over a leading seed axis: N runs of one config in one program (train/seeds.py).
"""

from __future__ import annotations

import contextlib
import json
import math
import signal
import sys
import threading
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

from mha_jax import config as mc
from mha_jax import storage
from mha_jax import tasks
from mha_jax.data import packing
from mha_jax.errors import StorageFault, UserError
from mha_jax.train import checkpoint as ckpt_lib
from mha_jax.train import distributed
from mha_jax.train import lock as lock_lib
from mha_jax.train import seeds as seeds_lib
from mha_jax.train import sharding
from mha_jax.train.metrics import MetricsWriter


class TrainingDiverged(RuntimeError):
  """The loss or the gradients became NaN or inf, or the loss grew past
  train.max_loss_factor times its starting value."""


def make_schedule(t) -> optax.Schedule:
  warm = max(1, t.warmup)
  if t.schedule == "constant":
    return optax.join_schedules([optax.linear_schedule(0.0, t.lr, warm),
                                 optax.constant_schedule(t.lr)], [warm])
  if t.schedule == "wsd":
    # warmup, stable, decay (Hu et al. 2024, MiniCPM): constant, then linear to 0 over the
    # last train.decay_steps steps. Until the decay starts it is the constant schedule,
    # so a decay can branch from any checkpoint of a constant run of the same rate.
    start = t.steps - t.decay_steps
    return optax.join_schedules([optax.linear_schedule(0.0, t.lr, warm),
                                 optax.constant_schedule(t.lr),
                                 optax.linear_schedule(t.lr, 0.0, t.decay_steps)],
                                [warm, start])
  if t.schedule == "cosine":
    return optax.warmup_cosine_decay_schedule(0.0, t.lr, warm, max(t.steps, warm + 1),
                                              end_value=t.lr * 0.1)
  # inverse square root after warmup (Vaswani et al. 2017)
  return lambda step: t.lr * jnp.minimum((step + 1) / warm,
                                         jnp.sqrt(warm / jnp.maximum(step + 1, 1)))


def make_optimizer(t) -> optax.GradientTransformation:
  """AdamW with warmup + decay and global-norm clipping."""
  clip = optax.clip_by_global_norm(t.clip) if t.clip > 0 else optax.identity()
  return optax.chain(clip,
                     optax.adamw(make_schedule(t), b1=0.9, b2=t.b2,
                                 weight_decay=t.weight_decay))


def check_workdir(cfg, workdir: str) -> dict:
  """Checks `workdir` for a run of `cfg` and returns the config dict to write; writes
  nothing. Refuses a user's folder (train/lock.py), a run of an incompatible config, and
  a pruned model's workdir. A config.json without any checkpoint beside it (a run that
  failed before its first save) holds no run: it may be replaced."""
  lock_lib.check_workdir(workdir)
  path = storage.join(workdir, "config.json")
  new = mc.to_dict(cfg)
  steps = ckpt_lib.step_dirs(workdir)
  if steps and (storage.exists(storage.join(workdir, "pruning.json")) or
                not any(ckpt_lib.has_train_state(workdir, s) for s in steps)):
    raise UserError(f"workdir {workdir!r} holds a pruned or exported model (params only, "
                    f"no optimizer state); train cannot resume it and left it untouched. "
                    f"Train a new run with another workdir", setting="workdir")
  if storage.exists(path) and steps:
    try:
      saved = mc.upgrade(storage.read_json(path))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
      raise UserError(f"{path} is not valid JSON ({e}); refusing to touch the run") from None
    bad = mc.incompatible_fields(saved, new)
    if bad:
      diffs = ", ".join(f"{k}: {mc.flatten(saved).get(k)!r} -> {mc.flatten(new).get(k)!r}"
                        for k in bad[:6])
      raise UserError(f"workdir {workdir!r} holds a run of another config ({diffs}); "
                       f"refusing to touch it. Use a new workdir", setting="workdir")
  elif steps:
    raise UserError(f"workdir {workdir!r} has checkpoints but no config.json; refusing "
                     f"to touch it")
  return new


def write_workdir(workdir: str, new: dict) -> None:
  """config.json and the run marker (process 0 only), once every check has passed."""
  storage.makedirs(workdir)
  storage.write_json(storage.join(workdir, "config.json"), new, atomic=True)
  lock_lib.write_marker(workdir)


def prepare_workdir(cfg, workdir: str) -> None:
  """check_workdir, then write_workdir."""
  write_workdir(workdir, check_workdir(cfg, workdir))


def _finished(cfg, workdir: str) -> int | None:
  """The step of a finished run of a compatible config in `workdir` (its newest good
  checkpoint reached train.steps): there is nothing to do, and nothing is written (a
  finished run on a read-only mount). None otherwise."""
  steps = ckpt_lib.step_dirs(workdir)
  path = storage.join(workdir, "config.json")
  if not steps or max(steps) < cfg.train.steps or not storage.isfile(path):
    return None
  try:
    if mc.incompatible_fields(mc.upgrade(storage.read_json(path)), mc.to_dict(cfg)):
      return None
  except (OSError, ValueError):
    return None
  tasks.build(cfg, workdir, read_only=True)    # the data still matches the run's
  ckpts = ckpt_lib.Checkpoints(workdir, read_only=True, this_process_only=True)
  try:
    _, step = ckpts.restore_params(None, log=lambda m: None)
    if ckpts.bad_steps:
      return None        # a resume sets the bad ones aside: that writes
  except UserError:
    return None
  finally:
    ckpts.close()
  return step if step >= cfg.train.steps else None


@contextlib.contextmanager
def _last_good_named(all_ckpts):
  """A StorageFault (full disk, read-only place) in the loop, with the run's last good
  checkpoint added to its one line."""
  try:
    yield
  except StorageFault as e:
    good = [(c.latest_step(), c.directory) for c in all_ckpts]
    where = "; ".join(f"step {s} in {d}" for s, d in good if s is not None)
    fix = ("" if getattr(e, "kind", None) in ("cut off", "unavailable") else
           "free space (or make the place writable) and ")
    fault = StorageFault(f"train: {e}. Last good checkpoint: {where or 'none yet'}; "
                         f"{fix}run the same command to resume")
    fault.kind, fault.where = getattr(e, "kind", None), getattr(e, "where", None)
    raise fault from None


class Preemption:
  """Turns SIGTERM into a flag the loop checks between steps."""

  def __init__(self):
    self.requested = False
    self._old = None

  def __enter__(self):
    # Several processes: JAX's own SIGTERM handler (its preemption notifier) stays.
    if threading.current_thread() is threading.main_thread() and jax.process_count() == 1:
      self._old = signal.signal(signal.SIGTERM, self._handle)
    return self

  def _handle(self, signum, frame):
    self.requested = True

  def __exit__(self, *exc):
    if self._old is not None:
      signal.signal(signal.SIGTERM, self._old)


def _finite(x) -> bool:
  return bool(np.isfinite(np.asarray(x)).all())


def make_train_step(task, optimizer: optax.GradientTransformation, cfg) -> Callable:
  """The one training step: (params, opt_state, batch, step, root_key) -> (params,
  opt_state, metrics). A multi-seed run vmaps this same function over a leading seed
  axis of everything but `step`. Dropout keys come from root_key and the step number."""
  t = cfg.train

  def train_step(params, opt_state, batch, step, root_key):
    key = jax.random.fold_in(jax.random.fold_in(root_key, 1), step)
    (obj, metrics), grads = jax.value_and_grad(
        lambda p: task.loss(p, batch, key=key if cfg.model.dropout else None,
                            label_smoothing=t.get("label_smoothing", 0.0)),
        has_aux=True)(params)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    metrics = dict(metrics, objective=obj, grad_norm=optax.tree.norm(grads))
    return params, opt_state, metrics

  return train_step


def packing_ladder(run_tasks, t, multiple: int) -> tuple[tuple[int, ...], list[int]]:
  """The row counts a packed run uses (data/packing.py), and the sample behind them: the
  rows each task's first 64 training batches need."""
  sample = [tk.train_rows_needed(s) for tk in run_tasks for s in range(min(64, t.steps))]
  return packing.rows_ladder(sample, t.batch_size, multiple), sample


def packed_batches(run_tasks, step: int, ladder: tuple[int, ...], process_index: int = 0,
                   process_count: int = 1) -> list[dict]:
  """Each task's training batch `step`, packed at one rung of the ladder (the smallest
  that holds every task's batch), this process's share of the rows."""
  whole = [tk.packed_train_batch(step, ladder) for tk in run_tasks]
  rows = max(len(b["src"]) for b in whole)
  whole = [b if len(b["src"]) == rows else tk.packed_train_batch(step, rows)
           for tk, b in zip(run_tasks, whole)]
  part = tasks.local_rows(rows, process_index, process_count)
  return [{k: v[part] for k, v in b.items()} for b in whole]


def _seed_slice(tree, i: int | None):
  """Seed i of a tree with a leading seed axis; the tree itself when i is None."""
  return tree if i is None else jax.tree.map(lambda x: x[i], tree)


def train(cfg, workdir: str, *, log: Callable[[str], None] = print) -> dict:
  """Trains (or resumes) the run in `workdir`; returns a summary dict.

  summary["status"] is "done" or "preempted" (SIGTERM: saved, exited cleanly).
  Raises TrainingDiverged on a NaN/inf loss or one above train.max_loss_factor times
  the starting loss, after keeping the last good checkpoint. Resuming starts from the
  newest good checkpoint (see checkpoint.py); bad newer ones are moved to
  checkpoints.bad/, never deleted.

  With train.seeds naming N > 1 seeds, the N runs train as one program (the step
  vmapped over a leading seed axis) into workdir/seed_<s>/ (train/seeds.py); they save,
  evaluate and resume together, and a seed that diverges stops them all, naming it.
  """
  mc.validate(cfg)
  if jax.process_index() != 0:   # one process speaks for a multi-process run
    log = lambda s: None
  t = cfg.train
  seeds = mc.seed_list(cfg)
  multi = len(seeds) > 1
  if multi and cfg.mesh.model > 1:
    raise UserError(f"train.seeds={t.seeds!r} ({len(seeds)} seeds) with mesh.model="
                    f"{cfg.mesh.model}: a multi-seed run replicates params over the mesh; "
                    f"set mesh.model=1 or train.seeds=1")
  mesh = sharding.make_mesh(cfg.mesh.data, cfg.mesh.model)
  n_data = mesh.shape["data"]
  if t.batch_size % n_data:
    raise UserError(f"train.batch_size={t.batch_size} must be divisible by the mesh's "
                    f"data axis ({n_data} devices)")
  runs = seeds_lib.runs(cfg, workdir) if multi else [(cfg, workdir)]
  distributed.set_context(f"workdir {workdir}")

  def plan():   # reads the workdir: process 0 alone, for every process (distributed.share)
    if multi:
      seeds_lib.plan(cfg, workdir)        # checks only; written below
    else:
      seeds_lib.refuse_single(workdir)
    lock_lib.check_workdir(workdir)
    for c, w in runs:
      check_workdir(c, w)
    return None if multi else _finished(cfg, workdir)

  done = distributed.share("train:plan", plan)
  if done is not None:
    log(f"nothing to do: {workdir} holds step {done} of train.steps={t.steps}")
    return {"status": "done", "step": done, "workdir": workdir, "valid": None}
  with lock_lib.hold(workdir):
    news = distributed.share(   # again, under the lock
        "train:check", lambda: [check_workdir(c, w) for c, w in runs])
    run_tasks = tasks.build_seeds(runs)   # each seed's data files, after the data's checks
    if multi:
      seeds_lib.write_manifest(cfg, workdir)
      lock_lib.write_marker(workdir)
    for (_c, w), new in zip(runs, news):
      write_workdir(w, new)
    # Traced inside the mesh: the kernel choice reads its devices and the Pallas kernels
    # run shard_map over it (kernels/target.py, kernels/pallas.py).
    with jax.set_mesh(mesh):
      return _train(cfg, workdir, runs, run_tasks, mesh, n_data, log)


class _Stacked:
  """The seeds of one train call as one state. With several seeds every array has a
  leading seed axis and the per-seed functions are vmapped over it; with one it has none.
  The one place that tells the two apart."""

  def __init__(self, runs):
    self.runs, self.multi = runs, len(runs) > 1
    self.slices = list(range(len(runs))) if self.multi else [None]  # seed i of the state

  def vmap(self, fn, in_axes=0):
    return jax.vmap(fn, in_axes=in_axes) if self.multi else fn

  def stack(self, trees: list, xp=np):
    """Per-seed trees -> the state's tree (a leading seed axis only when several)."""
    return jax.tree.map(lambda *xs: xp.stack(xs), *trees) if self.multi else trees[0]

  def seed(self, tree, i: int):
    """Seed i's part of a stacked tree."""
    return _seed_slice(tree, self.slices[i])

  def spec(self, *axes) -> P:
    """A PartitionSpec of a per-seed array's axes, behind the seed axis if any."""
    return P(None, *axes) if self.multi else P(*axes)

  def who(self, i: int, t) -> str:
    """Names seed i in a message (nothing with one seed)."""
    return f"seed {self.runs[i][0].seed} of train.seeds={t.seeds!r}: " if self.multi else ""


def _train(cfg, workdir, runs, run_tasks, mesh, n_data, log) -> dict:
  """train's loop, once the workdir is checked, locked and written."""
  t, st = cfg.train, _Stacked(runs)
  task = run_tasks[0]   # seeds differ only in their batches' order: one task computes
  optimizer = make_optimizer(t)
  root_key = st.stack([jax.random.PRNGKey(c.seed) for c, _ in runs], jnp)

  def init_state(key):
    params = task.init_params(jax.random.fold_in(key, 0))
    return params, optimizer.init(params)

  init_state = st.vmap(init_state)
  state_shardings = sharding.shardings(jax.eval_shape(init_state, root_key), mesh)
  params, opt_state = jax.jit(init_state, out_shardings=state_shardings)(root_key)
  all_ckpts = [ckpt_lib.Checkpoints(w, max_to_keep=t.keep) for _, w in runs]
  writers, bar = [], None
  try:
    params, opt_state, start, initial_loss = _resume(
        all_ckpts, st, params, opt_state, state_shardings, t, task, workdir, log)
    step_fn = st.vmap(make_train_step(task, optimizer, cfg), in_axes=(0, 0, 0, None, 0))
    train_step = jax.jit(step_fn, donate_argnums=(0, 1),
                         out_shardings=(*state_shardings, NamedSharding(mesh, P())))
    writers = [MetricsWriter(w, enabled=jax.process_index() == 0) for _, w in runs]
    if t.progress and sys.stderr.isatty():
      from tqdm import tqdm
      bar = tqdm(total=t.steps, initial=start, unit="step", dynamic_ncols=True)
    batch_at = _batches(run_tasks, t, n_data, st, NamedSharding(mesh, st.spec("data")), log)
    saved = start or None   # the step of the last save (a resume's is on disk already)
    status, step, last, window = "done", start, None, []
    t_last, valid = time.perf_counter(), None
    with Preemption() as pre, _last_good_named(all_ckpts):
      while step < t.steps:
        # several processes: JAX's preemption sync manager (SIGTERM to any of them)
        # picks the step every process stops at
        if distributed.preempted(step) if distributed.multi() else pre.requested:
          saved = _save(all_ckpts, st, step, saved, params, opt_state, last, initial_loss, t)
          log(f"SIGTERM: saved checkpoint at step {step}; run the same command to resume")
          status = "preempted"
          break
        params, opt_state, last = train_step(params, opt_state, batch_at(step),
                                             jnp.int32(step), root_key)
        step += 1
        distributed.progress()   # the watchdog's measure of a stall (distributed.Watchdog)
        window.append(last)
        if bar is not None:
          bar.update(1)
        if step % t.log_every == 0 or step % t.checkpoint_every == 0 or step == t.steps:
          now = time.perf_counter()
          losses = _record(jax.device_get(window), step, max(now - t_last, 1e-9), st,
                           all_ckpts, writers, initial_loss, t)
          window, t_last = [], now
          _report(bar, losses, step, t, st.multi, log)
        if step % t.checkpoint_every == 0 or step == t.steps:
          saved = _save(all_ckpts, st, step, saved, params, opt_state, last, initial_loss, t)
          distributed.progress()
        if step % t.eval_every == 0 or step == t.steps:
          valid = _evaluate(task, st, params, writers, step, log)
          distributed.progress()
  except BaseException:   # divergence or an error: that is what the user must see
    _close(bar, writers, all_ckpts, quiet=True)
    raise
  _close(bar, writers, all_ckpts)
  out = {"status": status, "step": step, "workdir": workdir}
  if st.multi:
    out.update(seeds=mc.seed_list(cfg), workdirs=[w for _, w in runs])
  return {**out, "valid": valid}


def _resume(all_ckpts, st: _Stacked, params, opt_state, state_shardings, t, task, workdir,
            log):
  """(params, opt_state, start step, each seed's initial loss): the fresh state given, or
  the newest checkpoints' (their configs and batch size checked against the run's)."""
  start, initial_loss = 0, [None] * len(st.runs)
  if distributed.multi() or any(c.all_steps() for c in all_ckpts):
    params, opt_state, metas, start = _restore(all_ckpts, st.runs, params, opt_state,
                                               state_shardings, st.slices)
    for i, ((c, w), meta) in enumerate(zip(st.runs, metas)):
      ckpt_lib.check_model_config(meta, mc.to_dict(c), f"checkpoint {start} in {w!r}",
                                  storage.join(w, "config.json"))
      if meta.get("data_position") != start * t.batch_size:
        raise UserError(f"checkpoint {start} in {w!r} was written with another "
                        f"batch size (data position {meta.get('data_position')})")
      initial_loss[i] = meta.get("initial_loss")
    if start:
      log(f"resumed from step {start} in {workdir}")
  for i in range(len(st.runs)):
    if initial_loss[i] is None and start:     # checkpoints from before it was recorded
      initial_loss[i] = float(np.log(task.vocab_size))
  return params, opt_state, start, initial_loss


def _batches(run_tasks, t, n_data: int, st: _Stacked, data_sharding, log) -> Callable:
  """batch_at(step): the global training batch of every seed (packed when train.pack)."""
  ladder = None
  if run_tasks[0].packs and t.get("pack", False):   # data/packing.py
    ladder, sample = packing_ladder(run_tasks, t, math.lcm(n_data, jax.process_count()))
    log(f"packing {t.batch_size} sentence pairs per step into {ladder[0]} rows "
        f"(the first {len(sample) // len(run_tasks)} batches needed {min(sample)}-"
        f"{max(sample)}; {ladder[-1]} rows if one needs more; train.pack=false turns "
        f"it off)")

  def batch_at(step):
    if ladder is not None:
      local = packed_batches(run_tasks, step, ladder, jax.process_index(),
                             jax.process_count())
    else:
      local = [tk.train_batch(step, jax.process_index(), jax.process_count())
               for tk in run_tasks]
    return {k: jax.make_array_from_process_local_data(data_sharding, v)
            for k, v in st.stack(local).items()}

  return batch_at


def _save(all_ckpts, st: _Stacked, step, saved, params, opt_state, last_metrics,
          initial_loss, t):
  """Saves every seed's state at `step` (not twice; a seed whose last metrics are not
  finite keeps its last good checkpoint). Returns the step of the last save."""
  if saved == step:
    return saved
  for i, ((c, _), ckpts) in enumerate(zip(st.runs, all_ckpts)):
    m = st.seed(last_metrics, i) if last_metrics is not None else None
    if m is not None and not (_finite(m["objective"]) and _finite(m["grad_norm"])):
      continue
    ckpts.save(step, st.seed(params, i), st.seed(opt_state, i),
               {"step": step, "seed": c.seed, "data_position": step * t.batch_size,
                "initial_loss": initial_loss[i], "task": c.task,
                "model": mc.to_dict(c)["model"]})
  return step


def _evaluate(task, st: _Stacked, params, writers, step, log, split="valid"):
  """Each seed's evaluation on `split`, written and logged: a list with several seeds."""
  out = []
  for i, ((c, _), writer) in enumerate(zip(st.runs, writers)):
    res = task.evaluate(st.seed(params, i), split)
    writer.write(step, split, res)
    who = f"seed {c.seed} " if st.multi else ""
    log(f"step {step}: {who}{split} " + " ".join(f"{k} {v:.4g}" for k, v in res.items()))
    out.append(res)
  return out if st.multi else out[0]


def _record(host_all, step, elapsed, st: _Stacked, all_ckpts, writers, initial_loss, t):
  """Checks and writes the steps since the last record (host_all: their metrics, stacked
  like the state); raises TrainingDiverged on a loss that is not finite or above
  train.max_loss_factor times the starting one. Returns each seed's (loss, tokens/s)."""
  factor = t.get("max_loss_factor", 0.0)
  first = step - len(host_all) + 1
  losses = []
  for i, ckpts in enumerate(all_ckpts):
    host = [st.seed(m, i) for m in host_all]
    if initial_loss[i] is None:
      initial_loss[i] = float(host[0]["loss"]) / max(float(host[0]["tokens"]), 1.0)
    good = ckpts.latest_step()
    where = (f"Last good checkpoint: step {good} in {ckpts.directory}" if good
             else "No checkpoint saved yet")
    who = st.who(i, t)
    for j, m in enumerate(host):
      if not (_finite(m["objective"]) and _finite(m["grad_norm"])):
        raise TrainingDiverged(
            f"{who}loss became {float(m['objective'])} at step {first + j}; "
            f"stopped. {where}. Lower train.lr or raise train.warmup")
      per_token = float(m["loss"]) / max(float(m["tokens"]), 1.0)
      if factor and per_token > factor * initial_loss[i]:
        raise TrainingDiverged(
            f"{who}loss {per_token:.4g} at step {first + j} is more than "
            f"train.max_loss_factor={factor:g} times the starting loss "
            f"{initial_loss[i]:.4g}; stopped. {where}. Lower train.lr or raise "
            f"train.warmup")
    tokens = sum(float(m["tokens"]) for m in host)
    loss = sum(float(m["loss"]) for m in host) / max(tokens, 1.0)
    tok_s = tokens / elapsed
    writers[i].write(step, "train", {
        "loss": loss, "objective": float(np.mean([m["objective"] for m in host])),
        "grad_norm": float(host[-1]["grad_norm"]), "tokens_per_s": tok_s})
    losses.append((loss, tok_s))
  return losses


def _report(bar, losses, step, t, multi: bool, log) -> None:
  """The progress bar's postfix, or a log line at train.log_every: the seeds' mean loss
  (and spread) and their summed tokens/s."""
  loss, tok_s = float(np.mean([l for l, _ in losses])), sum(s for _, s in losses)
  if bar is not None:
    bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{tok_s:,.0f}")
  elif step % t.log_every == 0 or step == t.steps:
    spread = (f" (seeds {min(l for l, _ in losses):.4f}.."
              f"{max(l for l, _ in losses):.4f})" if multi else "")
    log(f"step {step}/{t.steps}: loss {loss:.4f}{spread} tokens/s {tok_s:,.0f}")


def _close(bar, writers, all_ckpts, quiet: bool = False) -> None:
  """Flushes the metrics, closes the bar and orbax. quiet: after an error, whatever
  fails here (the metrics' last flush onto the same full disk) is not said."""
  for close in ([bar.close] if bar is not None else []) + [w.close for w in writers] + \
      [c.close for c in all_ckpts]:
    try:
      close()
    except Exception:  # noqa: BLE001
      if not quiet:
        raise


def _newest_common(all_ckpts, fresh: Callable[[int], tuple], sharding=None):
  """Every seed's newest good checkpoint at one step: the oldest of the seeds' newest
  (a run interrupted between the seeds' saves), step 0 (the fresh state given) when a
  seed has none. Checkpoints newer than that step are set aside, never deleted.
  fresh(i): seed i's (params, opt_state), the restore's target. Returns (found, step),
  found[i] = [params, opt_state, meta, step]."""
  found = []
  for i, ckpts in enumerate(all_ckpts):
    if ckpts.all_steps():
      found.append(list(ckpts.restore(None, *fresh(i), sharding=sharding)))
    else:
      found.append([*fresh(i), {"data_position": 0, "initial_loss": None}, 0])
  start = min(f[3] for f in found)
  for i, ckpts in enumerate(all_ckpts):
    if found[i][3] != start:     # this seed ran ahead of another
      found[i] = (list(ckpts.restore(start, *fresh(i), sharding=sharding)) if start else
                  [*fresh(i), {"data_position": 0, "initial_loss": None}, 0])
    bad = sorted(b for b in set(ckpts.bad_steps) if b > start)
    ahead = sorted(b for b in ckpts.all_steps() if b > start and b not in bad)
    for which, what in ((bad, "bad checkpoint(s)"), (ahead, "checkpoint(s)")):
      which = [b for b in which if storage.isdir(ckpts.step_dir(b))]
      if which:   # out of the way of this run's next saves
        dest = ckpts.set_aside(which)
        ckpt_lib.warn(f"moved {what} {which} to {dest} (kept, not deleted)" +
                      (f": the other seeds resume from step {start}" if what[0] == "c"
                       else ""))
  return found, start


def _decide_start(runs, shapes: Callable[[int], tuple]) -> dict:
  """Process 0 of a multi-process run, alone: the step every process resumes from and
  each seed's meta, read and verified through managers of its own (restored onto its
  first device), bad and ahead checkpoints set aside as on one process."""
  local = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
  probes = [ckpt_lib.Checkpoints(w, read_only=True, this_process_only=True)
            for _, w in runs]
  try:
    found, start = _newest_common(probes, shapes, local)
  finally:
    for c in probes:
      c.close()
  return {"start": start, "metas": [f[2] for f in found]}


def _restore(all_ckpts, runs, params, opt_state, state_shardings, slices):
  """The state to train from: _newest_common's step, decided by process 0 and shared in
  a multi-process run (every process then restores that step, without a fallback of
  its own). Returns (params, opt_state, metas, step), stacked like the state given."""
  fresh = lambda i: (_seed_slice(params, slices[i]), _seed_slice(opt_state, slices[i]))
  if not distributed.multi():
    found, start = _newest_common(all_ckpts, fresh)
  else:
    shapes = lambda i: jax.eval_shape(lambda: fresh(i))
    plan = distributed.share("train:resume", lambda: _decide_start(runs, shapes))
    start, metas = plan["start"], plan["metas"]
    for c in all_ckpts:
      c.manager.reload()    # process 0 may have set checkpoints aside
    if start:
      seen = distributed.gather("train:sees", all(
          ckpt_lib.has_train_state(w, start) for _, w in runs))
      blind = [i for i, ok in enumerate(seen) if not ok]
      if blind:
        raise UserError(f"process(es) {blind} do not see checkpoint {start} that process "
                        f"0 resumes from in {runs[0][1]!r}: every process must see the "
                        f"same workdir (a shared disk or a bucket)")
    found = [[*(c.restore(start, *fresh(i))[:2] if start else fresh(i)), metas[i], start]
             for i, c in enumerate(all_ckpts)]
  if slices[0] is None:
    p, o, meta, _ = found[0]
    return p, o, [meta], start
  stack = lambda trees, shard: jax.device_put(
      jax.tree.map(lambda *xs: jnp.stack(xs), *trees), shard)
  params = stack([f[0] for f in found], state_shardings[0])
  opt_state = stack([f[1] for f in found], state_shardings[1])
  return params, opt_state, [f[2] for f in found], start
