"""Training, checkpoints, resume, preemption, determinism, devices, the loader, eval."""

import json
import os
import random
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

import mha_jax
from mha_jax import cli as cli_mod
from mha_jax import tasks
from mha_jax.train import checkpoint as ckpt_lib
from mha_jax.train import loop
from mha_jax.train.metrics import read_metrics
from builders import ROOT, TINY_INDUCTION, TINY_TRANSLATION, tiny, with_devices

def cli(*args, env=None, **kw):
  return subprocess.run([sys.executable, "-m", "mha_jax.cli", *args], cwd=ROOT, text=True,
                        capture_output=True, env={**os.environ, **(env or {})}, **kw)


def test_train_writes_metrics_checkpoints_and_resumes(tmp_path):
  wd = str(tmp_path / "run")
  logs = []
  cfg = tiny("configs/translation.py", TINY_TRANSLATION, "--config.train.steps=6",
             "--config.train.checkpoint_every=3", "--config.train.eval_every=6",
             "--config.train.log_every=3")
  out = loop.train(cfg, wd, log=logs.append)
  assert out["status"] == "done" and out["step"] == 6
  assert set(out["valid"]) == {"loss", "accuracy", "bleu"}
  m = read_metrics(wd)
  assert [r["step"] for r in m if r["split"] == "train"] == [3, 6]
  assert [r["step"] for r in m if r["split"] == "valid"] == [6]
  assert all(r["tokens_per_s"] > 0 for r in m if r["split"] == "train")
  assert any(f.startswith("events.out.tfevents") for f in os.listdir(os.path.join(wd, "tb")))
  c = ckpt_lib.Checkpoints(wd, read_only=True)
  assert c.all_steps() == [3, 6]
  c.close()
  for f in ("train.src", "train.tgt", "train.arcs.jsonl", "train_freqs.json", "vocab.json"):
    assert os.path.exists(os.path.join(wd, "data", f)), f
  # The same run with more steps resumes where it stopped.
  cfg2 = tiny("configs/translation.py", TINY_TRANSLATION, "--config.train.steps=9",
              "--config.train.checkpoint_every=3", "--config.train.eval_every=6",
              "--config.train.log_every=3")
  logs.clear()
  assert loop.train(cfg2, wd, log=logs.append)["step"] == 9
  assert any("resumed from step 6" in l for l in logs)
  assert [r["step"] for r in read_metrics(wd) if r["split"] == "train"] == [3, 6, 9]


def test_loss_falls_when_training(tmp_path):
  cfg = tiny("configs/translation.py", TINY_TRANSLATION, "--config.train.steps=40",
             "--config.train.log_every=10", "--config.train.lr=1e-2",
             "--config.train.schedule=constant")
  loop.train(cfg, str(tmp_path / "r"), log=lambda s: None)
  train = [r["loss"] for r in read_metrics(str(tmp_path / "r")) if r["split"] == "train"]
  assert train[-1] < train[0] - 1.0


@pytest.mark.slow
def test_wsd_schedule_is_the_constant_one_until_its_linear_decay_to_zero():
  import ml_collections
  from mha_jax import config as mc
  t = ml_collections.ConfigDict(dict(lr=3e-3, warmup=10, steps=100, schedule="wsd",
                                     decay_steps=40))
  wsd = loop.make_schedule(t)
  const = loop.make_schedule(ml_collections.ConfigDict(dict(t, schedule="constant")))
  for step in (0, 5, 10, 37, 60):
    assert float(wsd(step)) == float(const(step))
  for step in (61, 80, 99, 100):                  # lr * (100 - step) / 40
    assert float(wsd(step)) == pytest.approx(3e-3 * (100 - step) / 40, abs=1e-9)
  cfg = mc.load_config(os.path.join(ROOT, "configs/attn_only_text.py:steps=300,decay=100"))
  assert (cfg.train.schedule, cfg.train.decay_steps) == ("wsd", 100)
  mc.validate(cfg)
  assert "decay_steps" not in mc.load_config(os.path.join(ROOT, "configs/attn_only_text.py")).train
  for bad in (300, 0):
    cfg.train.decay_steps = bad
    with pytest.raises(ValueError, match=rf"train.decay_steps .* between 1 and train.steps - "
                                         rf"train.warmup = 200; got {bad}"):
      mc.validate(cfg)


def test_incompatible_workdir_is_refused_and_left_untouched(tmp_path):
  wd = str(tmp_path / "run")
  cfg = tiny("configs/induction.py", TINY_INDUCTION, "--config.train.steps=2")
  loop.train(cfg, wd, log=lambda s: None)
  before = open(os.path.join(wd, "config.json")).read()
  other = tiny("configs/induction.py", TINY_INDUCTION, "--config.train.steps=2",
               "--config.model.num_heads=2")
  with pytest.raises(ValueError, match=r"holds a run of another config \(model.num_heads: "
                                       r"4 -> 2\); refusing"):
    loop.train(other, wd, log=lambda s: None)
  assert open(os.path.join(wd, "config.json")).read() == before
  c = ckpt_lib.Checkpoints(wd, read_only=True)
  assert c.all_steps() == [2]
  c.close()


def test_nan_loss_stops_and_keeps_the_last_good_checkpoint(tmp_path):
  wd = str(tmp_path / "run")
  cfg = tiny("configs/induction.py", TINY_INDUCTION, "--config.train.steps=50",
             "--config.train.lr=1e30", "--config.train.warmup=1", "--config.train.clip=1e30",
             "--config.train.log_every=1", "--config.train.checkpoint_every=1")
  with pytest.raises(loop.TrainingDiverged, match=r"loss became (nan|inf) at step \d+; "
                                                  r"stopped. Last good checkpoint: step \d+"):
    loop.train(cfg, wd, log=lambda s: None)
  loaded = mha_jax.load(wd)
  assert loaded.step >= 1
  assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(loaded.params))


def test_load_returns_config_model_params_and_eval_cli(tmp_path):
  wd = str(tmp_path / "run")
  loop.train(tiny("configs/induction.py", TINY_INDUCTION, "--config.train.steps=3"), wd,
             log=lambda s: None)
  config, model, params = mha_jax.load(wd)
  assert config.model.num_heads == 4 and isinstance(model, tasks.LMTask)
  assert params["lm"]["layer_1"]["attn"]["wq"].shape == (16, 4, 4)
  assert mha_jax.load(wd).head_names[:2] == ["lm.0.0", "lm.0.1"]
  r = cli("eval", "--workdir", wd, "--split", "valid")
  assert r.returncode == 0, r.stderr
  res = json.loads(r.stdout.strip().splitlines()[-1])
  assert res["step"] == 3 and {"loss", "accuracy", "loss_first", "loss_repeat"} <= set(res)
  assert abs(res["loss_first"] - np.log(12)) < 0.5      # random tokens: about ln V
  with pytest.raises(ValueError, match="has no config.json"):
    mha_jax.load(str(tmp_path / "nothing"))
  with pytest.raises(ValueError, match=r"step 7 is not in .*saved steps: \[3\]"):
    mha_jax.load(wd, step=7)


def _params_at(wd, step):
  return ckpt_lib.Checkpoints(wd, read_only=True).restore_params(step)[0]


@pytest.mark.slow
def test_sigkill_at_any_moment_then_resume_is_bit_identical(tmp_path):
  args = ["train", "--config", "configs/induction.py", *TINY_INDUCTION,
          "--config.train.steps=120", "--config.train.checkpoint_every=20",
          "--config.train.log_every=20", "--config.train.eval_every=1000"]
  ref = str(tmp_path / "ref")      # the uninterrupted run, in this process (the same CLI)
  assert cli_mod.main([*args, "--workdir", ref]) == 0
  wd = str(tmp_path / "killed")
  rng = random.Random(0)
  for _attempt in range(1):     # kill at a random moment, then let it finish
    seen = max(ckpt_lib.step_dirs(wd), default=0)
    p = subprocess.Popen([sys.executable, "-m", "mha_jax.cli", *args, "--workdir", wd],
                         cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while time.time() < deadline and max(ckpt_lib.step_dirs(wd), default=0) <= seen:
      time.sleep(0.02)
    time.sleep(rng.uniform(0.0, 0.3))
    p.send_signal(signal.SIGKILL)
    p.wait()
    # The kill interrupted training: the process did not exit by itself, and the run
    # is saved part of the way, past where this attempt started.
    assert p.returncode == -signal.SIGKILL
    assert seen < max(ckpt_lib.step_dirs(wd)) < 120, ckpt_lib.step_dirs(wd)
  r = cli(*args, "--workdir", wd)
  assert r.returncode == 0 and "resumed from step" in r.stdout, r.stdout + r.stderr
  assert ckpt_lib.tree_equal(_params_at(ref, 120), _params_at(wd, 120))


@pytest.mark.slow
def test_sigterm_saves_and_exits_cleanly(tmp_path):
  wd = str(tmp_path / "run")
  p = subprocess.Popen([sys.executable, "-m", "mha_jax.cli", "train", "--config",
                        "configs/induction.py", *TINY_INDUCTION, "--config.train.steps=100000",
                        "--config.train.checkpoint_every=100000", "--config.train.log_every=5",
                        "--workdir", wd], cwd=ROOT, stdout=subprocess.PIPE,
                       stderr=subprocess.STDOUT, text=True)
  deadline = time.time() + 120
  while time.time() < deadline and not read_metrics(wd):
    time.sleep(0.1)
  p.send_signal(signal.SIGTERM)
  out, _ = p.communicate(timeout=120)
  assert p.returncode == 0, out
  saved = int(out.split("SIGTERM: saved checkpoint at step ")[1].split(";")[0])
  assert saved >= 5
  c = ckpt_lib.Checkpoints(wd, read_only=True)
  assert c.latest_step() == saved
  c.close()


@pytest.mark.slow   # three 8-device/1-device runs in subprocesses (~27 s)
def test_checkpoints_move_between_8_devices_and_1(tmp_path):
  eight = {"XLA_FLAGS": with_devices(8)["XLA_FLAGS"]}
  args = ["train", "--config", "configs/induction.py", *TINY_INDUCTION,
          "--config.train.checkpoint_every=2", "--config.train.eval_every=100"]
  # 8 devices write step 4; 1 device resumes to 6. And the other way round.
  a, b, ref = (str(tmp_path / n) for n in ("a", "b", "ref"))
  assert cli(*args, "--config.train.steps=4", "--workdir", a, env=eight).returncode == 0
  r = cli(*args, "--config.train.steps=6", "--workdir", a)
  assert r.returncode == 0 and "resumed from step 4" in r.stdout, r.stdout + r.stderr
  assert cli(*args, "--config.train.steps=4", "--workdir", b).returncode == 0
  r = cli(*args, "--config.train.steps=6", "--workdir", b, env=eight)
  assert r.returncode == 0 and "resumed from step 4" in r.stdout, r.stdout + r.stderr
  assert cli(*args, "--config.train.steps=6", "--workdir", ref).returncode == 0
  p_ref = _params_at(ref, 6)
  for wd in (a, b):   # same maths; only the order of the cross-device sum differs
    close = jax.tree.map(lambda x, y: np.allclose(x, y, atol=1e-4), _params_at(wd, 6), p_ref)
    assert all(jax.tree.leaves(close))
  r = subprocess.run([sys.executable, "-c", "import jax; print(jax.device_count())"],
                     capture_output=True, text=True, env={**os.environ, **eight})
  assert r.stdout.strip() == "8"


@pytest.mark.slow  # default run: test_objective.py::test_lm_label_smoothing_changes_the_objective_as_the_formula_says
def test_token_losses_match_optax_with_and_without_label_smoothing():
  import jax.numpy as jnp
  import optax
  k1, k2 = jax.random.split(jax.random.PRNGKey(3))
  logits = jax.random.normal(k1, (3, 5, 40)) * 3
  targets = jax.random.randint(k2, (3, 5), 0, 40)
  for eps in (0.0, 0.1):
    labels = optax.smooth_labels(jax.nn.one_hot(targets, 40), eps)
    nll, obj, correct = tasks.token_losses(logits, targets, eps)
    np.testing.assert_allclose(obj, optax.softmax_cross_entropy(logits, labels), atol=1e-5)
    np.testing.assert_allclose(
        nll, optax.softmax_cross_entropy_with_integer_labels(logits, targets), atol=1e-5)
    np.testing.assert_array_equal(correct, logits.argmax(-1) == targets)
    g = jax.grad(lambda l: tasks.token_losses(l, targets, eps)[1].sum())(logits)
    g_ref = jax.grad(lambda l: optax.softmax_cross_entropy(l, labels).sum())(logits)
    np.testing.assert_allclose(g, g_ref, atol=1e-6)
  # Label smoothing changes the objective, not the reported nll.
  assert float(jnp.abs(tasks.token_losses(logits, targets, 0.1)[1]
                       - tasks.token_losses(logits, targets, 0.0)[1]).max()) > 1e-3


@pytest.mark.slow    # a benchmark run end to end (~11 s); `pytest -m slow`
def test_bench_train_times_ours_and_flax_linen_and_writes_json(tmp_path):
  out = tmp_path / "bt.json"
  r = cli("bench", "train", "--config", "configs/translation.py:quickstart", "--rounds", "1",
          "--warmup", "1", "--workdir", str(tmp_path / "wd"), "--out", str(out),
          "--matmul-size", "256",
          "--config.model.enc_layers=1", "--config.model.dec_layers=1",
          "--config.data.train_size=200", "--config.data.valid_size=20",
          "--config.data.test_size=20", "--config.train.batch_size=8")
  assert r.returncode == 0, r.stdout + r.stderr
  res = json.loads(out.read_text())
  rows = {row["model"]: row for row in res["rows"]}
  assert set(rows) == {"mha_jax", "flax.linen", "mha_jax packed"}
  # each row's ratio is its own step time over flax.linen's
  for row in rows.values():
    np.testing.assert_allclose(row["vs_flax_linen"],
                               row["step_ms"] / rows["flax.linen"]["step_ms"], rtol=1e-9)
  assert rows["mha_jax"]["gflop"] > 0 and res["machine"]["matmul_gflops"] > 0
  # the packed row: the same 8 pairs in fewer rows, so fewer FLOPs
  assert rows["mha_jax packed"]["batch_shapes"]["src"][0] < 8
  assert rows["mha_jax"]["batch_shapes"]["src"][0] == 8
  assert rows["mha_jax packed"]["gflop"] < rows["mha_jax"]["gflop"]
  assert "| mha_jax |" in r.stdout and "% matmul" in r.stdout
