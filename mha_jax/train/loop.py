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
from mha_jax import tasks
from mha_jax.train import checkpoint as ckpt_lib
from mha_jax.train import sharding
from mha_jax.train.metrics import MetricsWriter


class TrainingDiverged(RuntimeError):
  """The loss or the gradients became NaN or inf."""


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
  return optax.chain(optax.clip_by_global_norm(t.clip),
                     optax.adamw(make_schedule(t), b1=0.9, b2=t.b2,
                                 weight_decay=t.weight_decay))


def prepare_workdir(cfg, workdir: str) -> None:
  """Writes config.json, or checks it against an existing one. Never overwrites a run of
  an incompatible config."""
  os.makedirs(workdir, exist_ok=True)
  path = os.path.join(workdir, "config.json")
  new = mc.to_dict(cfg)
  if os.path.exists(path):
    with open(path) as f:
      saved = mc.upgrade(json.load(f))
    bad = mc.incompatible_fields(saved, new)
    if bad:
      diffs = ", ".join(f"{k}: {mc.flatten(saved).get(k)!r} -> {mc.flatten(new).get(k)!r}"
                        for k in bad[:6])
      raise ValueError(f"workdir {workdir!r} holds a run of another config ({diffs}); "
                       f"refusing to touch it. Use a new --workdir")
  elif os.path.isdir(os.path.join(workdir, "checkpoints")):
    raise ValueError(f"workdir {workdir!r} has checkpoints but no config.json; refusing "
                     f"to touch it")
  if jax.process_index() == 0:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
      json.dump(new, f, indent=1)
    os.replace(tmp, path)


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
  Raises TrainingDiverged on a NaN/inf loss, after keeping the last good checkpoint.
  """
  mc.validate(cfg)
  if jax.process_index() != 0:   # one process speaks for a multi-process run
    log = lambda s: None
  t = cfg.train
  mesh = sharding.make_mesh(cfg.mesh.data, cfg.mesh.model)
  n_data = mesh.shape["data"]
  if t.batch_size % n_data:
    raise ValueError(f"train.batch_size={t.batch_size} must be divisible by the mesh's "
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
  start = ckpts.latest_step() or 0
  if start:
    params, opt_state, meta = ckpts.restore(start, params, opt_state)
    if meta.get("data_position") != start * t.batch_size:
      raise ValueError(f"checkpoint {start} in {workdir!r} was written with another batch "
                       f"size (data position {meta.get('data_position')})")
    log(f"resumed from step {start} in {workdir}")

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
  bar = None
  if t.progress and sys.stderr.isatty():
    from tqdm import tqdm
    bar = tqdm(total=t.steps, initial=start, unit="step", dynamic_ncols=True)

  def save(step, last_metrics):
    if last_metrics is not None and not (_finite(last_metrics["objective"]) and
                                         _finite(last_metrics["grad_norm"])):
      return False
    ckpts.save(step, params, opt_state, {"step": step, "seed": cfg.seed,
                                         "rng": np.asarray(jax.random.key_data(
                                             root_key)).tolist(),
                                         "data_position": step * t.batch_size})
    return True

  def evaluate(step, split="valid"):
    res = task.evaluate(params, split, bleu=cfg.task == "translation")
    writer.write(step, split, res)
    log(f"step {step}: {split} " + " ".join(f"{k} {v:.4g}" for k, v in res.items()))
    return res

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
        bad = [i for i, m in enumerate(host) if not (_finite(m["objective"]) and
                                                     _finite(m["grad_norm"]))]
        if bad:
          good = ckpts.latest_step()
          where = f"step {good}" if good else "none yet"
          raise TrainingDiverged(
              f"loss became {float(host[bad[0]]['objective'])} at step "
              f"{step - len(host) + bad[0] + 1}; stopped. Last good checkpoint: {where} "
              f"in {ckpts.directory}. Lower train.lr or raise train.warmup")
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
  if bar is not None:
    bar.close()
  writer.close()
  ckpts.close()
  return {"status": status, "step": step, "workdir": workdir, "valid": valid}
