"""Training: one jitted, data-parallel step; orbax checkpoints; resume; preemption.

The same code runs on a laptop, on 8 fake CPU devices and on a TPU slice: params and
optimizer state live on a 2-D mesh ("data", "model"): each batch is split over "data",
heads and MLP units over "model" (train/sharding.py), and on several hosts each host
feeds its own rows of every global batch.
"""

from __future__ import annotations

import json
import os
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
from mha_jax.errors import UserError
from mha_jax.train import checkpoint as ckpt_lib
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


def prepare_workdir(cfg, workdir: str) -> None:
  """Writes config.json, or checks it against an existing one. Never overwrites a run of
  an incompatible config, nor a pruned model's workdir. A config.json without any
  checkpoint beside it (a run that failed before its first save) holds no run: it is
  replaced."""
  storage.makedirs(workdir)
  path = storage.join(workdir, "config.json")
  new = mc.to_dict(cfg)
  steps = ckpt_lib.step_dirs(workdir)
  if steps and (storage.exists(storage.join(workdir, "pruning.json")) or
                not any(ckpt_lib.has_train_state(workdir, s) for s in steps)):
    raise UserError(f"workdir {workdir!r} holds a pruned or exported model (params only, "
                    f"no optimizer state); train cannot resume it and left it untouched. "
                    f"Train a new run with another --workdir")
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
                       f"refusing to touch it. Use a new --workdir")
  elif steps:
    raise UserError(f"workdir {workdir!r} has checkpoints but no config.json; refusing "
                     f"to touch it")
  storage.write_json(path, new, atomic=True)   # process 0 only


class _Preemption:
  """Turns SIGTERM into a flag the loop checks between steps."""

  def __init__(self):
    self.requested = False
    self._old = None

  def __enter__(self):
    if threading.current_thread() is threading.main_thread():
      self._old = signal.signal(signal.SIGTERM, self._handle)
    return self

  def _handle(self, signum, frame):
    self.requested = True

  def __exit__(self, *exc):
    if self._old is not None:
      signal.signal(signal.SIGTERM, self._old)


def _finite(x) -> bool:
  return bool(np.isfinite(np.asarray(x)).all())


def train(cfg, workdir: str, *, log: Callable[[str], None] = print) -> dict:
  """Trains (or resumes) the run in `workdir`; returns a summary dict.

  summary["status"] is "done" or "preempted" (SIGTERM: saved, exited cleanly).
  Raises TrainingDiverged on a NaN/inf loss or one above train.max_loss_factor times
  the starting loss, after keeping the last good checkpoint. Resuming starts from the
  newest good checkpoint (see checkpoint.py); bad newer ones are moved to
  checkpoints.bad/, never deleted.
  """
  mc.validate(cfg)
  if jax.process_index() != 0:   # one process speaks for a multi-process run
    log = lambda s: None
  t = cfg.train
  mesh = sharding.make_mesh(cfg.mesh.data, cfg.mesh.model)
  n_data = mesh.shape["data"]
  if t.batch_size % n_data:
    raise UserError(f"train.batch_size={t.batch_size} must be divisible by the mesh's "
                    f"data axis ({n_data} devices)")
  prepare_workdir(cfg, workdir)
  task = tasks.build(cfg, workdir)
  replicated = NamedSharding(mesh, P())
  data_sharding = NamedSharding(mesh, P("data"))
  optimizer = make_optimizer(t)
  root_key = jax.random.PRNGKey(cfg.seed)

  def init_state(key):
    params = task.init_params(key)
    return params, optimizer.init(params)

  key0 = jax.random.fold_in(root_key, 0)
  state_shardings = sharding.shardings(jax.eval_shape(init_state, key0), mesh)
  init_state = jax.jit(init_state, out_shardings=state_shardings)
  params, opt_state = init_state(key0)

  ckpts = ckpt_lib.Checkpoints(workdir, max_to_keep=t.keep)
  writer, bar = None, None
  try:
    start, initial_loss = 0, None
    if ckpts.all_steps():
      params, opt_state, meta, start = ckpts.restore(None, params, opt_state)
      newer = [b for b in ckpts.bad_steps if b > start]
      if newer:   # out of the way of this run's next saves
        dest = ckpts.set_aside(newer)
        ckpt_lib.warn(f"moved bad checkpoint(s) {newer} to {dest} (kept, not deleted)")
      if meta.get("data_position") != start * t.batch_size:
        raise UserError(f"checkpoint {start} in {workdir!r} was written with another "
                        f"batch size (data position {meta.get('data_position')})")
      initial_loss = meta.get("initial_loss")
      log(f"resumed from step {start} in {workdir}")
    if initial_loss is None and start:     # checkpoints from before it was recorded
      initial_loss = float(np.log(task.vocab_size))

    def train_step(params, opt_state, batch, step):
      key = jax.random.fold_in(jax.random.fold_in(root_key, 1), step)
      (obj, metrics), grads = jax.value_and_grad(
          lambda p: task.loss(p, batch, key=key if cfg.model.dropout else None,
                              label_smoothing=t.get("label_smoothing", 0.0)),
          has_aux=True)(params)
      updates, opt_state = optimizer.update(grads, opt_state, params)
      params = optax.apply_updates(params, updates)
      metrics = dict(metrics, objective=obj, grad_norm=optax.tree.norm(grads))
      return params, opt_state, metrics

    train_step = jax.jit(train_step, donate_argnums=(0, 1),
                         out_shardings=(*state_shardings, replicated))

    writer = MetricsWriter(workdir, enabled=jax.process_index() == 0)
    if t.progress and sys.stderr.isatty():
      from tqdm import tqdm
      bar = tqdm(total=t.steps, initial=start, unit="step", dynamic_ncols=True)

    def save(step, last_metrics):
      if last_metrics is not None and not (_finite(last_metrics["objective"]) and
                                           _finite(last_metrics["grad_norm"])):
        return False
      ckpts.save(step, params, opt_state, {"step": step, "seed": cfg.seed,
                                           "data_position": step * t.batch_size,
                                           "initial_loss": initial_loss})
      return True

    def evaluate(step, split="valid"):
      res = task.evaluate(params, split, bleu=cfg.task == "translation")
      writer.write(step, split, res)
      log(f"step {step}: {split} " + " ".join(f"{k} {v:.4g}" for k, v in res.items()))
      return res

    factor = t.get("max_loss_factor", 0.0)
    status, step, last, window = "done", start, None, []
    t_last, valid = time.perf_counter(), None
    with _Preemption() as pre:
      while step < t.steps:
        if pre.requested:
          save(step, last)
          log(f"SIGTERM: saved checkpoint at step {step}; run the same command to resume")
          status = "preempted"
          break
        local = task.train_batch(step, jax.process_index(), jax.process_count())
        batch = {k: jax.make_array_from_process_local_data(data_sharding, v)
                 for k, v in local.items()}
        params, opt_state, last = train_step(params, opt_state, batch, jnp.int32(step))
        step += 1
        window.append(last)
        if bar is not None:
          bar.update(1)
        if step % t.log_every == 0 or step % t.checkpoint_every == 0 or step == t.steps:
          host = jax.device_get(window)
          window = []
          first = step - len(host) + 1
          if initial_loss is None:
            initial_loss = float(host[0]["loss"]) / max(float(host[0]["tokens"]), 1.0)
          good = ckpts.latest_step()
          where = (f"Last good checkpoint: step {good} in {ckpts.directory}" if good
                   else "No checkpoint saved yet")
          for i, m in enumerate(host):
            if not (_finite(m["objective"]) and _finite(m["grad_norm"])):
              raise TrainingDiverged(
                  f"loss became {float(m['objective'])} at step {first + i}; stopped. "
                  f"{where}. Lower train.lr or raise train.warmup")
            per_token = float(m["loss"]) / max(float(m["tokens"]), 1.0)
            if factor and per_token > factor * initial_loss:
              raise TrainingDiverged(
                  f"loss {per_token:.4g} at step {first + i} is more than "
                  f"train.max_loss_factor={factor:g} times the starting loss "
                  f"{initial_loss:.4g}; stopped. {where}. Lower train.lr or raise "
                  f"train.warmup")
          tokens = sum(float(m["tokens"]) for m in host)
          loss = sum(float(m["loss"]) for m in host) / max(tokens, 1.0)
          now = time.perf_counter()
          tok_s = tokens / max(now - t_last, 1e-9)
          t_last = now
          rec = {"loss": loss, "objective": float(np.mean([m["objective"] for m in host])),
                 "grad_norm": float(host[-1]["grad_norm"]), "tokens_per_s": tok_s}
          writer.write(step, "train", rec)
          if bar is not None:
            bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{tok_s:,.0f}")
          elif step % t.log_every == 0 or step == t.steps:
            log(f"step {step}/{t.steps}: loss {loss:.4f} tokens/s {tok_s:,.0f}")
        if step % t.checkpoint_every == 0 or step == t.steps:
          save(step, last)
        if step % t.eval_every == 0 or step == t.steps:
          valid = evaluate(step)
  finally:   # also on divergence or an error: flush metrics, close the bar and orbax
    if bar is not None:
      bar.close()
    if writer is not None:
      writer.close()
    ckpts.close()
  return {"status": status, "step": step, "workdir": workdir, "valid": valid}
