"""Training's objective and its guards: clipping off at 0, a loss growing without NaN
stops the run, label smoothing as its formula says."""

import json
import os

import numpy as np
import pytest

from oracles import assert_f32_close
from mha_jax import config as mc
from mha_jax.train import checkpoint as ckpt_lib
from mha_jax.train import loop
from builders import QUIET, induction_cfg


def test_clip_zero_means_no_clipping():
  import jax.numpy as jnp
  g = {"w": jnp.asarray([3.0, -4.0])}

  def first_update(clip):
    cfg = induction_cfg(f"--config.train.clip={clip}", "--config.train.schedule=constant",
                        "--config.train.warmup=0")
    mc.validate(cfg)
    opt = loop.make_optimizer(cfg.train)
    state = opt.update(g, opt.init(g), {"w": jnp.zeros(2)})[1]   # step 0 has lr 0
    return np.asarray(opt.update(g, state, {"w": jnp.zeros(2)})[0]["w"])

  none = first_update("0")       # was clip_by_global_norm(0): every gradient zeroed
  assert np.all(np.abs(none) > 1e-4)
  np.testing.assert_allclose(none, first_update("1e30"), rtol=1e-6)


def test_a_loss_that_grows_without_nan_stops_the_run(tmp_path, monkeypatch):
  # lr 100 with a long warmup: the loss climbs from ln 12 = 2.48 to 20,000 without NaN.
  closed = []
  for cls in (loop.MetricsWriter, ckpt_lib.Checkpoints):
    monkeypatch.setattr(cls, "close", lambda self, real=cls.close, name=cls.__name__: (
        closed.append(name), real(self))[1])
  wd = str(tmp_path / "run")
  with pytest.raises(loop.TrainingDiverged,
                     match=r"is more than train.max_loss_factor=4 times the starting loss "
                           r"2.48.*Last good checkpoint: step 4"):
    loop.train(induction_cfg("--config.train.steps=12", "--config.train.lr=100",
                             "--config.train.warmup=1000", "--config.train.log_every=1"),
               wd, **QUIET)
  assert ckpt_lib.step_dirs(wd) == [4]
  assert sorted(closed) == ["Checkpoints", "MetricsWriter"]   # closed on the way out
  meta = json.load(open(os.path.join(wd, "checkpoints", "4", "meta", "metadata")))
  assert meta["initial_loss"] == pytest.approx(np.log(12), abs=0.05)


def test_lm_label_smoothing_changes_the_objective_as_the_formula_says():
  import jax
  import jax.numpy as jnp
  import optax
  from mha_jax import tasks
  cfg = induction_cfg()
  task = tasks.build(cfg)
  params = task.init_params(jax.random.PRNGKey(0))
  batch = task.train_batch(0)
  plain, m = task.loss(params, batch)
  smooth, m2 = task.loss(params, batch, label_smoothing=0.2)
  logits = task.apply(params, batch).astype(jnp.float32)
  v = logits.shape[-1]
  labels = 0.8 * jax.nn.one_hot(batch["tokens"][:, 1:], v) + 0.2 / v
  want = optax.softmax_cross_entropy(logits, labels).mean()
  assert float(smooth) == pytest.approx(float(want), rel=1e-5)
  assert float(smooth) != pytest.approx(float(plain), rel=1e-4)
  assert_f32_close(m["loss"], m2["loss"])       # the metric is plain NLL (two programs)
