"""Checkpoints under damage and interruption: a bad newest checkpoint falls back for load,
eval and resume; checksums; keep=0; SIGTERM during a save; a full disk; orbax's warnings
without asyncio tracebacks."""

import errno
import json
import os
import shutil
import signal
import subprocess
import sys

import numpy as np
import pytest

import mha_jax
from mha_jax import cli as cli_mod
from mha_jax import config as mc
from mha_jax.errors import BadCheckpoint, UserError
from mha_jax.train import checkpoint as ckpt_lib
from mha_jax.train import loop
from builders import QUIET, TINY_INDUCTION, copy_run, file_tree, induction_cfg, largest_files

# On the worker that trains conftest's ind_run and parallel_run (setup.cfg: --dist loadgroup).
pytestmark = pytest.mark.xdist_group("trained_runs")


def _flip(path, n=64):
  data = bytearray(open(path, "rb").read())
  mid = len(data) // 2
  for i in range(mid, mid + n):
    data[i] ^= 0xFF
  open(path, "wb").write(bytes(data))


def _damage(wd, how):
  step = os.path.join(wd, "checkpoints", "8")
  for big in largest_files(os.path.join(step, "params")):
    if how == "random_bytes":
      open(big, "wb").write(np.random.default_rng(0).bytes(os.path.getsize(big)))
    elif how == "truncated":
      open(big, "r+b").truncate(os.path.getsize(big) // 3)
    elif how == "deleted":
      os.remove(big)
    elif how == "flipped_64_bytes":
      _flip(big)
  if how == "params_swapped":   # readable by orbax, but not the bytes that were saved
    shutil.rmtree(os.path.join(step, "params"))
    shutil.copytree(os.path.join(wd, "checkpoints", "4", "params"), os.path.join(step, "params"))
  if how == "meta_garbled":
    open(os.path.join(step, "meta", "metadata"), "w").write("{not json")
  elif how == "params_removed":
    shutil.rmtree(os.path.join(step, "params"))


def test_keep_zero_is_refused_and_every_checkpoint_survives(ind_run, tmp_path):
  wd = copy_run(ind_run, tmp_path)
  before = file_tree(wd)
  for keep in ("0", "-1"):
    with pytest.raises(UserError, match=rf"train.keep must be >= 1 .*got {keep}"):
      loop.train(induction_cfg("--config.train.steps=12", f"--config.train.keep={keep}"),
                 wd, **QUIET)
    with pytest.raises(UserError, match="train.keep must be >= 1"):   # fresh run too
      loop.train(induction_cfg("--config.train.steps=4", f"--config.train.keep={keep}"),
                 str(tmp_path / "fresh"), **QUIET)
  assert file_tree(wd) == before and ckpt_lib.step_dirs(wd) == [4, 8]
  assert not os.path.exists(tmp_path / "fresh")


DAMAGE = ("random_bytes", "truncated", "deleted", "flipped_64_bytes", "params_swapped",
          "meta_garbled", "params_removed")


@pytest.mark.parametrize("how", DAMAGE)
def test_a_bad_newest_checkpoint_falls_back_for_load_and_eval(ind_run, tmp_path, how,
                                                              capsys):
  wd = copy_run(ind_run, tmp_path)
  good = mha_jax.load(wd, step=4, **QUIET).params
  _damage(wd, how)
  before = file_tree(wd)
  warnings = []
  loaded = mha_jax.load(wd, log=warnings.append)
  assert loaded.step == 4 and ckpt_lib.tree_equal(loaded.params, good)
  assert any(os.path.join("checkpoints", "8") in w for w in warnings), warnings
  with pytest.raises(BadCheckpoint, match=r"checkpoints/8"):        # asked for by name
    mha_jax.load(wd, step=8, **QUIET)
  assert cli_mod.main(["eval", "--workdir", wd, "--split", "valid"]) == 0
  out, err = capsys.readouterr()
  assert json.loads(out)["step"] == 4 and np.isfinite(json.loads(out)["loss"])
  assert "mha-jax: warning: checkpoint" in err and "checkpoints/8" in err
  assert file_tree(wd) == before                                        # nothing deleted or written


def test_resuming_train_starts_from_the_newest_good_checkpoint(ind_run, tmp_path, capsys):
  wd = copy_run(ind_run, tmp_path)
  _damage(wd, "params_swapped")
  logs = []
  res = loop.train(induction_cfg("--config.train.steps=8"), wd, log=logs.append)
  assert res["status"] == "done" and res["step"] == 8
  assert "resumed from step 4 in " + wd in logs
  err = capsys.readouterr().err
  assert "checkpoints/8: checksum mismatch in params" in err and "checkpoints.bad" in err
  assert ckpt_lib.step_dirs(wd) == [4, 8]                          # 8 written again
  assert os.listdir(os.path.join(wd, "checkpoints.bad")) == ["8"]  # the bad one, kept
  # Bit-identical to the undamaged run's step 8 (resume is deterministic).
  assert ckpt_lib.tree_equal(mha_jax.load(wd, **QUIET).params,
                             mha_jax.load(ind_run, **QUIET).params)


def test_checksums_are_saved_and_every_checkpoint_bad_is_an_error(ind_run, tmp_path):
  wd = copy_run(ind_run, tmp_path)
  meta = json.load(open(os.path.join(wd, "checkpoints", "8", "meta", "metadata")))
  assert set(meta["checksums"]) == {"params", "opt_state"}
  assert all(len(v) == 64 for v in meta["checksums"]["params"].values())
  for step in ("4", "8"):
    for f in largest_files(os.path.join(wd, "checkpoints", step, "params")):
      _flip(f)
  with pytest.raises(BadCheckpoint, match=r"every checkpoint .* is bad \(steps \[8, 4\]\)"):
    mha_jax.load(wd, **QUIET)
  assert ckpt_lib.step_dirs(wd) == [4, 8]


def _cli(*argv, timeout=240, env=None):
  """`python -m mha_jax.cli ARGV` in a subprocess: (returncode, stdout, stderr)."""
  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  p = subprocess.run([sys.executable, "-m", "mha_jax.cli", *argv], cwd=root, text=True,
                     capture_output=True, timeout=timeout, env={**os.environ, **(env or {})})
  return p.returncode, p.stdout, p.stderr


def _truncate_params(wd, step):
  from builders import largest_files
  for f in largest_files(os.path.join(wd, "checkpoints", str(step), "params")):
    open(f, "r+b").truncate(100)


@pytest.mark.slow
def test_the_checkpoint_fallback_prints_its_warnings_and_no_asyncio_tracebacks(ind_run,
                                                                              tmp_path):
  wd = copy_run(ind_run, tmp_path)
  _truncate_params(wd, 8)
  rc, out, err = _cli("eval", "--workdir", wd, "--split", "valid")
  assert rc == 0 and json.loads(out)["step"] == 4
  lines = err.strip().splitlines()
  assert len(lines) == 2 and "checkpoints/8 is unreadable" in lines[0], err[:3000]
  _truncate_params(wd, 4)                                      # every checkpoint bad
  rc, out, err = _cli("eval", "--workdir", wd)
  assert rc == 2 and "Traceback" not in err and "Event loop is closed" not in err, err[:3000]
  assert err.strip().splitlines()[-1].startswith("mha-jax: error: every checkpoint in")


def test_sigterm_during_a_checkpoint_save_saves_each_step_once_and_exits_0(tmp_path,
                                                                          monkeypatch,
                                                                          capsys):
  real = ckpt_lib.Checkpoints.save
  saves = []

  def save_then_sigterm(self, step, *a, **k):   # the preemption arrives during the save
    saves.append(step)
    real(self, step, *a, **k)
    os.kill(os.getpid(), signal.SIGTERM)
  monkeypatch.setattr(ckpt_lib.Checkpoints, "save", save_then_sigterm)
  wd = str(tmp_path / "run")
  assert cli_mod.main(["train", "--config", mc.REPO_ROOT + "/configs/induction.py",
                       "--workdir", wd, *TINY_INDUCTION, "--config.train.steps=12",
                       "--config.train.checkpoint_every=4", "--config.train.eval_every=100",
                       "--config.train.log_every=4", "--config.train.progress=false"]) == 0
  out = capsys.readouterr().out
  assert json.loads(out.strip().splitlines()[-1])["status"] == "preempted"
  assert saves == [4] and ckpt_lib.step_dirs(wd) == [4]
  # Preempted again at once after resuming: step 4 is on disk already.
  enter = loop.Preemption.__enter__
  monkeypatch.setattr(loop.Preemption, "__enter__",
                      lambda self: (enter(self), setattr(self, "requested", True))[0])
  res = loop.train(induction_cfg("--config.train.steps=12"), wd, **QUIET)
  assert res["status"] == "preempted" and res["step"] == 4 and saves == [4]


@pytest.mark.parametrize("error", [
    OSError(errno.ENOSPC, "No space left on device"),
    ValueError("RESOURCE_EXHAUSTED: Error writing local file: No space left on device")])
def test_a_full_disk_during_training_is_one_line_naming_the_last_good_checkpoint(
    tmp_path, monkeypatch, capsys, error):
  import orbax.checkpoint as ocp
  real = ocp.CheckpointManager.save
  wd = str(tmp_path / "run")

  def fill_up(self, step, *a, **k):
    if step < 8:
      return real(self, step, *a, **k)
    part = os.path.join(wd, "checkpoints", f"{step}.orbax-checkpoint-tmp-1", "params")
    os.makedirs(part)                         # what a save cut short leaves behind
    open(os.path.join(part, "d"), "wb").write(b"half")
    raise error
  monkeypatch.setattr(ocp.CheckpointManager, "save", fill_up)
  assert cli_mod.main(["train", "--config", mc.REPO_ROOT + "/configs/induction.py",
                       "--workdir", wd, *TINY_INDUCTION, "--config.train.steps=12",
                       "--config.train.checkpoint_every=4", "--config.train.eval_every=100",
                       "--config.train.log_every=4"]) == 2
  err = capsys.readouterr().err
  assert err.count("\n") == 1, err
  assert "checkpoint 8: cannot write" in err and "the disk is full" in err
  assert f"Last good checkpoint: step 4 in {wd}/checkpoints" in err
  assert os.listdir(os.path.join(wd, "checkpoints")) == ["4"]       # partial files removed
  assert not os.path.exists(os.path.join(wd, "train.lock"))
  monkeypatch.setattr(ocp.CheckpointManager, "save", real)
  assert mha_jax.load(wd, **QUIET).step == 4
