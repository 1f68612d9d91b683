"""Workdirs: what train accepts, refuses and leaves behind (a failed run, a pruned or
locked workdir, a user's folder, read-only places), and what loading never writes; data
and config.json edited after training are refused by name."""

import json
import os
import shutil
import subprocess
import sys

import pytest

import mha_jax
from mha_jax import cli as cli_mod
from mha_jax import config as mc
from mha_jax.errors import UserError
from mha_jax.train import checkpoint as ckpt_lib
from mha_jax.train import loop
from builders import QUIET, copy_run, copy_with_own_data, file_tree, induction_cfg, read_only_under

# On the worker that trains conftest's ind_run and parallel_run (setup.cfg: --dist loadgroup).
pytestmark = pytest.mark.xdist_group("trained_runs")


def test_a_failed_train_leaves_a_workdir_that_a_later_run_may_use(tmp_path):
  wd = str(tmp_path / "run")
  with pytest.raises(UserError, match="more than model.max_len"):   # fails after config.json
    loop.train(induction_cfg("--config.train.steps=2", "--config.data.half_len=9"), wd, **QUIET)
  assert ckpt_lib.step_dirs(wd) == []
  loop.prepare_workdir(induction_cfg("--config.train.steps=2"), wd)   # was "another config"
  assert json.load(open(os.path.join(wd, "config.json")))["data"]["half_len"] == 6


def test_train_refuses_a_pruned_workdir_and_leaves_config_json_untouched(ind_run, tmp_path):
  loaded = mha_jax.load(ind_run, **QUIET)
  wd = str(tmp_path / "pruned")
  os.makedirs(wd)
  shutil.copy(os.path.join(ind_run, "config.json"), wd)
  c = ckpt_lib.Checkpoints(wd)
  c.save_params(8, loaded.params, {"step": 8})
  c.close()
  before = open(os.path.join(wd, "config.json"), "rb").read()
  with pytest.raises(UserError, match="pruned or exported model .* no optimizer state"):
    loop.train(induction_cfg("--config.train.steps=12"), wd, **QUIET)
  assert open(os.path.join(wd, "config.json"), "rb").read() == before
  assert mha_jax.load(wd, **QUIET).step == 8                          # still loads


def test_loading_and_evaluating_never_write_to_the_workdir(parallel_run, ind_run):
  for wd in (parallel_run[0], ind_run):
    before = file_tree(wd)
    loaded = mha_jax.load(wd)
    loaded.task.evaluate(loaded.params, "valid", bleu=False)
    assert file_tree(wd) == before


def test_data_edited_after_training_is_refused_and_the_vocabulary_kept(parallel_run,
                                                                       tmp_path):
  wd, paths = parallel_run
  wd, cfg = copy_with_own_data(wd, paths, tmp_path)
  vocab = open(os.path.join(wd, "data", "vocab.json")).read()
  assert mha_jax.load(wd).task.vocab_size == len(json.loads(vocab))
  with open(cfg["data"]["train_src"], "a") as f:
    f.write("brand new words\n")
  with open(cfg["data"]["train_tgt"], "a") as f:
    f.write("words new brand\n")
  with pytest.raises(UserError, match=r"data.train_src/data.train_tgt: the training data no "
                                      r"longer matches the run's vocabulary .*3 new"):
    mha_jax.load(wd)
  assert open(os.path.join(wd, "data", "vocab.json")).read() == vocab


def test_a_second_train_on_a_locked_workdir_refuses_naming_the_holder(ind_run, tmp_path):
  import socket
  from mha_jax.train import lock as lock_lib
  wd = copy_run(ind_run, tmp_path)
  before = file_tree(wd)
  held = lock_lib.Lock(wd).acquire()            # a live run of this process
  try:
    with pytest.raises(UserError, match=rf"workdir '{wd}' is in use by another run: host "
                                        rf"{socket.gethostname()}, PID {os.getpid()}, "
                                        r"started .* UTC \(lock .*train.lock\)"):
      loop.train(induction_cfg("--config.train.steps=12"), wd, **QUIET)
  finally:
    held.release()
  assert file_tree(wd) == before and not os.path.exists(os.path.join(wd, "train.lock"))


def test_a_stale_lock_is_taken_over_with_a_warning(ind_run, tmp_path, capsys):
  import socket
  import time
  from mha_jax.train import lock as lock_lib
  wd = copy_run(ind_run, tmp_path)
  gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                        capture_output=True, text=True).stdout.strip()   # a PID now free
  lock = os.path.join(wd, "train.lock")
  json.dump({"host": socket.gethostname(), "pid": int(gone), "started": "then",
             "heartbeat": time.time()}, open(lock, "w"))
  res = loop.train(induction_cfg("--config.train.steps=12"), wd, **QUIET)
  assert res["status"] == "done" and res["step"] == 12 and not os.path.exists(lock)
  err = capsys.readouterr().err
  assert f"taking over the stale lock {lock} of host {socket.gethostname()}, PID {gone}" in err
  assert f"PID {gone} is no longer running on this host" in err
  # Another host: judged by the heartbeat alone.
  now = time.time()
  assert lock_lib.stale_reason({"host": "elsewhere", "pid": 1, "heartbeat": now}) is None
  assert "no heartbeat for 11 min" in lock_lib.stale_reason(
      {"host": "elsewhere", "pid": 1, "heartbeat": now - 660}, now)


def test_train_refuses_a_folder_that_holds_a_users_files(tmp_path):
  wd = tmp_path / "mine"
  wd.mkdir()
  (wd / "config.json").write_text('{"learning_rate": 3}')
  (wd / "notes.txt").write_text("keep me")
  before = file_tree(str(wd))
  with pytest.raises(UserError, match=r"is not empty and holds no mha-jax run \(no "
                                      r"mha-jax-run.json; it holds config.json, notes.txt\)"):
    loop.train(induction_cfg("--config.train.steps=2"), str(wd), **QUIET)
  assert file_tree(str(wd)) == before


def test_a_run_is_marked_and_a_marked_or_older_run_resumes(ind_run, tmp_path):
  from mha_jax.train import lock as lock_lib
  wd = copy_run(ind_run, tmp_path)
  os.remove(os.path.join(wd, lock_lib.MARKER))    # a run from before the marker
  loop.train(induction_cfg("--config.train.steps=12"), wd, **QUIET)
  marker = json.load(open(os.path.join(wd, lock_lib.MARKER)))
  assert marker["mha_jax"] == "run" and ckpt_lib.step_dirs(wd)[-1] == 12


def test_edited_data_is_refused_before_any_data_file_changes(parallel_run, tmp_path):  # noqa: F811
  wd, paths = parallel_run
  wd, cfg = copy_with_own_data(wd, paths, tmp_path)
  before = file_tree(wd)
  with open(cfg["data"]["train_src"], "a") as f:
    f.write("brand new words\n")
  with open(cfg["data"]["train_tgt"], "a") as f:
    f.write("words new brand\n")
  resume = mc.from_dict(cfg)
  with resume.unlocked():
    resume.train.steps = 2
  with pytest.raises(UserError, match="no longer matches the run's vocabulary"):
    loop.train(resume, wd, **QUIET)
  assert file_tree(wd) == before                      # data/train_freqs.json too


def test_train_into_read_only_places_files_and_paths_under_files(ind_run, tmp_path,
                                                                 monkeypatch, capsys):
  cfg = ["train", "--config", mc.REPO_ROOT + "/configs/induction.py",
         "--config.train.steps=2", "--config.data.half_len=6", "--config.model.d_model=16",
         "--config.model.max_len=16"]
  a_file = tmp_path / "a_file"
  a_file.write_text("x")
  for wd, msg in ((a_file, f"--workdir '{a_file}' is a file, not a folder"),
                  (a_file / "run", "a part of the path is a file, not a folder")):
    assert cli_mod.main(cfg + ["--workdir", str(wd)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and msg in err, err
  assert a_file.read_text() == "x"
  ro = tmp_path / "ro"
  ro.mkdir()
  read_only_under(monkeypatch, ro)
  assert cli_mod.main(cfg + ["--workdir", str(ro / "run")]) == 2
  err = capsys.readouterr().err
  assert err.count("\n") == 1 and f"cannot write '{ro / 'run'}" in err and "read-only" in err
  assert os.listdir(ro) == []
  # A finished run on a read-only mount: nothing to do, nothing written.
  read_only_under(monkeypatch, ind_run)
  before = file_tree(ind_run)
  res = loop.train(induction_cfg("--config.train.steps=8", "--config.train.log_every=2"),
                   ind_run, **QUIET)
  assert res["status"] == "done" and res["step"] == 8 and file_tree(ind_run) == before


def test_a_config_json_edited_after_training_is_refused_naming_the_field(ind_run, tmp_path,
                                                                         capsys):
  wd = copy_run(ind_run, tmp_path)
  path = os.path.join(wd, "config.json")
  cfg = json.load(open(path))
  assert cfg["model"]["pos"] == "qk"
  cfg["model"]["pos"] = "learned"                    # qk -> learned, by hand
  json.dump(cfg, open(path, "w"))
  assert cli_mod.main(["eval", "--workdir", wd, "--split", "valid"]) == 2
  err = capsys.readouterr().err
  assert "does not describe the model of" in err and "checkpoints/8" in err
  assert "model.pos: 'qk' in the checkpoint, 'learned' in config.json" in err, err
  with pytest.raises(UserError, match=r"model.pos: 'qk' in the checkpoint"):
    loop.train(induction_cfg("--config.train.steps=12", "--config.model.pos=learned"), wd,
               **QUIET)
  cfg["model"]["pos"], cfg["model"]["impl"] = "qk", "reference"   # the kernel may change
  json.dump(cfg, open(path, "w"))
  assert mha_jax.load(wd, **QUIET).step == 8
