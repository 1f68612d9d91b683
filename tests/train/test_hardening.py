"""Faults and bad input, round 2 (issue 25): one writer per workdir, no user file
overwritten, no silently wrong model, clear errors on full disks and read-only places.
Every test here failed before the fix it guards."""

import errno
import json
import os
import signal
import subprocess
import sys

import numpy as np
import pytest

import mha_jax
from mha_jax import cli as cli_mod
from mha_jax import config as mc
from mha_jax.errors import UserError
from mha_jax.train import checkpoint as ckpt_lib
from mha_jax.train import loop
from conftest import numpy_mha
from helpers import QUIET, TINY_INDUCTION, _copy, _tree, copy_with_own_data, induction_cfg

pytestmark = pytest.mark.xdist_group('faults')


@pytest.fixture(scope="module")
def run8(ind_run):
  """A tiny induction run with checkpoints at steps 4 and 8 (copy it before changing it):
  conftest's ind_run, trained once per worker for this module, test_faults and the rest."""
  return ind_run


# ------------------------------------------------------------------ masked NaN / inf

@pytest.mark.parametrize("impl", ["reference", "xla", "blocked"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("poison", [np.nan, np.inf])
def test_a_nan_or_inf_in_a_masked_key_or_value_does_not_reach_real_queries(impl, causal,
                                                                           poison):
  import jax
  import jax.numpy as jnp
  from mha_jax import attention
  b, t, d, h = 2, 6, 8, 2
  params = attention.init_attention_params(jax.random.PRNGKey(0), d, h)
  x = np.asarray(jax.random.normal(jax.random.PRNGKey(1), (b, t, d)))
  lengths = np.array([4, 6])
  valid_BT = np.arange(t)[None] < lengths[:, None]
  mask = valid_BT[:, None, None, :]                                  # padding as keys
  clean = np.where(valid_BT[..., None], x, 0.0)
  want, _ = numpy_mha(params, clean, mask=mask, causal=causal)
  dirty = np.where(valid_BT[..., None], x, poison)                   # padded rows poisoned
  got = np.asarray(attention.multi_head_attention(params, jnp.asarray(dirty),
                                                  mask=jnp.asarray(mask), causal=causal,
                                                  impl=impl))
  assert np.isfinite(got[valid_BT]).all()
  np.testing.assert_allclose(got[valid_BT], want[valid_BT], atol=1e-5)
  # The kernel alone, with poisoned keys and values at the padded positions only.
  q = jax.random.normal(jax.random.PRNGKey(2), (b, t, h, 4))
  k = jax.random.normal(jax.random.PRNGKey(3), (b, t, h, 4))
  v = jax.random.normal(jax.random.PRNGKey(4), (b, t, h, 4))
  pad = ~valid_BT[:, :, None, None]
  from mha_jax.kernels import dispatch
  ref, _ = dispatch.run_kernel("reference", q, k * valid_BT[:, :, None, None],
                               v * valid_BT[:, :, None, None], jnp.asarray(mask), causal, None)
  out, _ = dispatch.run_kernel(impl, q, jnp.where(pad, poison, k), jnp.where(pad, poison, v),
                               jnp.asarray(mask), causal, None)
  np.testing.assert_allclose(np.asarray(out)[valid_BT], np.asarray(ref)[valid_BT], atol=1e-5)


# ------------------------------------------------------------------ silent nonsense

@pytest.fixture
def no_load(monkeypatch):
  """mha_jax.load fails the test: nothing may be loaded before the checks."""
  from mha_jax import loader
  # The studies take a loaded run; the CLI loads it, through loader.load, after the checks.
  monkeypatch.setattr(loader, "load", lambda *a, **k: pytest.fail("worked before checking"))


@pytest.mark.parametrize("argv,msg", [
    (["ablate", "--induction-vs-random", "--top", "0"], r"--top must be >= 1; got 0"),
    (["ablate", "--induction-vs-random", "--draws", "-1"], r"--draws must be >= 1; got -1"),
    (["prune", "--method", "l0", "--lr", "-1", "--keep", "2"], r"--lr must be > 0; got -1.0"),
    (["prune", "--bleu-limit", "-1", "--keep", "2"],
     r"--bleu-limit must be >= 0 \(0 = all\); got -1"),
    (["prune-curve", "--counts", "4,-2"], r"--counts must be >= 0; got -2"),
    (["prune", "--l0-lambda", "nan"], r"--l0-lambda must be a finite number; got nan"),
    (["generate", "--prompt", "x", "--max-new-tokens", "0"],
     r"--max-new-tokens must be >= 1; got 0"),
])
def test_every_numeric_flag_is_range_checked_before_any_work(run8, tmp_path, argv, msg,
                                                             capsys, no_load):
  out = str(tmp_path / "out")
  assert cli_mod.main([argv[0], "--workdir", run8, *argv[1:]] +
                      (["--out", out] if argv[0] in ("prune", "prune-curve") else [])) == 2
  err = capsys.readouterr().err
  assert err.count("\n") == 1 and msg.replace("\\", "") in err.replace("\\", "") or \
      pytest.fail(err)
  assert not os.path.exists(out)


def test_an_empty_workdir_is_refused_and_the_current_folder_untouched(tmp_path, capsys,
                                                                      monkeypatch):
  monkeypatch.chdir(tmp_path)
  (tmp_path / "config.json").write_text('{"mine": 1}')
  assert cli_mod.main(["train", "--config", mc.REPO_ROOT + "/configs/induction.py",
                       "--workdir", ""]) == 2
  assert "--workdir must name a folder or file; got ''" in capsys.readouterr().err
  assert os.listdir(tmp_path) == ["config.json"]
  assert (tmp_path / "config.json").read_text() == '{"mine": 1}'


def test_a_bogus_split_is_refused_naming_the_valid_ones(run8, capsys):
  assert cli_mod.main(["analyze", "--workdir", run8, "--split", "bogus"]) == 2
  assert "argument --split: invalid choice: 'bogus' (choose from" in capsys.readouterr().err
  loaded = mha_jax.load(run8, **QUIET)
  with pytest.raises(UserError, match=r"split must be one of train, valid, test; got 'bogus'"):
    loaded.task.evaluate(loaded.params, "bogus")
  with pytest.raises(UserError, match=r"split must be one of train, valid, test"):
    next(loaded.task.eval_batches("bogus", 4))


def test_an_unknown_impl_is_refused_with_the_other_config_fields(tmp_path):
  wd = str(tmp_path / "run")
  with pytest.raises(UserError, match=r"model.impl must be one of auto, reference, xla, "
                                      r"cudnn, blocked, pallas; got 'fast'"):
    loop.train(induction_cfg("--config.train.steps=2", "--config.model.impl=fast"), wd,
               **QUIET)
  assert not os.path.exists(wd)


@pytest.mark.parametrize("heads,msg", [
    (("2", "1", "0"), r"sentence 1 of .*: the heads form a cycle \(tokens 1 -> 2 -> 1\)"),
    (("1", "0", "2"), r"the heads form a cycle \(tokens 1 -> 1\)"),
    (("2", "3", "1"), r"sentence 1 of .* has no root \(no token with head 0\)"),
])
def test_conllu_heads_that_form_no_tree_are_refused(tmp_path, heads, msg):
  from mha_jax.data import parallel
  p = tmp_path / "t.conllu"
  p.write_text(f"1\tthe\tthe\tDET\t_\t_\t{heads[0]}\tdet\t_\t_\n"
               f"2\tdog\tdog\tNOUN\t_\t_\t{heads[1]}\troot\t_\t_\n"
               f"3\truns\trun\tVERB\t_\t_\t{heads[2]}\troot\t_\t_\n\n")
  with pytest.raises(UserError, match=msg):
    parallel.read_conllu_arcs(str(p), [["the", "dog", "runs"]], "data.conllu.train")


# ------------------------------------------------------------------ orbax closed cleanly

def _cli(*argv, timeout=240, env=None):
  """`python -m mha_jax.cli ARGV` in a subprocess: (returncode, stdout, stderr)."""
  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  p = subprocess.run([sys.executable, "-m", "mha_jax.cli", *argv], cwd=root, text=True,
                     capture_output=True, timeout=timeout, env={**os.environ, **(env or {})})
  return p.returncode, p.stdout, p.stderr


def _truncate_params(wd, step):
  from helpers import _largest
  for f in _largest(os.path.join(wd, "checkpoints", str(step), "params")):
    open(f, "r+b").truncate(100)


def test_the_checkpoint_fallback_prints_its_warnings_and_no_asyncio_tracebacks(run8,
                                                                              tmp_path):
  wd = _copy(run8, tmp_path)
  _truncate_params(wd, 8)
  rc, out, err = _cli("eval", "--workdir", wd, "--split", "valid")
  assert rc == 0 and json.loads(out)["step"] == 4
  lines = err.strip().splitlines()
  assert len(lines) == 2 and "checkpoints/8 is unreadable" in lines[0], err[:3000]
  _truncate_params(wd, 4)                                      # every checkpoint bad
  rc, out, err = _cli("eval", "--workdir", wd)
  assert rc == 2 and "Traceback" not in err and "Event loop is closed" not in err, err[:3000]
  assert err.strip().splitlines()[-1].startswith("mha-jax: error: every checkpoint in")


# ------------------------------------------------------------------ one writer per workdir

def test_a_second_train_on_a_locked_workdir_refuses_naming_the_holder(run8, tmp_path):
  import socket
  from mha_jax.train import lock as lock_lib
  wd = _copy(run8, tmp_path)
  before = _tree(wd)
  held = lock_lib.Lock(wd).acquire()            # a live run of this process
  try:
    with pytest.raises(UserError, match=rf"workdir '{wd}' is in use by another run: host "
                                        rf"{socket.gethostname()}, PID {os.getpid()}, "
                                        r"started .* UTC \(lock .*train.lock\)"):
      loop.train(induction_cfg("--config.train.steps=12"), wd, **QUIET)
  finally:
    held.release()
  assert _tree(wd) == before and not os.path.exists(os.path.join(wd, "train.lock"))


def test_a_stale_lock_is_taken_over_with_a_warning(run8, tmp_path, capsys):
  import socket
  import time
  from mha_jax.train import lock as lock_lib
  wd = _copy(run8, tmp_path)
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
  before = _tree(str(wd))
  with pytest.raises(UserError, match=r"is not empty and holds no mha-jax run \(no "
                                      r"mha-jax-run.json; it holds config.json, notes.txt\)"):
    loop.train(induction_cfg("--config.train.steps=2"), str(wd), **QUIET)
  assert _tree(str(wd)) == before


def test_a_run_is_marked_and_a_marked_or_older_run_resumes(run8, tmp_path):
  from mha_jax.train import lock as lock_lib
  wd = _copy(run8, tmp_path)
  os.remove(os.path.join(wd, lock_lib.MARKER))    # a run from before the marker
  loop.train(induction_cfg("--config.train.steps=12"), wd, **QUIET)
  marker = json.load(open(os.path.join(wd, lock_lib.MARKER)))
  assert marker["mha_jax"] == "run" and ckpt_lib.step_dirs(wd)[-1] == 12


def test_edited_data_is_refused_before_any_data_file_changes(parallel_run, tmp_path):  # noqa: F811
  wd, paths = parallel_run
  wd, cfg = copy_with_own_data(wd, paths, tmp_path)
  before = _tree(wd)
  with open(cfg["data"]["train_src"], "a") as f:
    f.write("brand new words\n")
  with open(cfg["data"]["train_tgt"], "a") as f:
    f.write("words new brand\n")
  resume = mc.from_dict(cfg)
  with resume.unlocked():
    resume.train.steps = 2
  with pytest.raises(UserError, match="no longer matches the run's vocabulary"):
    loop.train(resume, wd, **QUIET)
  assert _tree(wd) == before                      # data/train_freqs.json too


def _read_only_under(monkeypatch, folder):
  """Every new file or folder under `folder` fails as on a read-only mount."""
  from mha_jax import storage
  gpath = type(storage.path(str(folder)))
  real_open, real_mkdir = os.open, gpath.mkdir

  def ro_open(p, flags, *a, **k):
    if str(p).startswith(str(folder)) and flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT):
      raise OSError(errno.EROFS, "Read-only file system", str(p))
    return real_open(p, flags, *a, **k)

  def ro_mkdir(self, *a, **k):
    if str(self).startswith(str(folder)) and not self.exists():
      raise OSError(errno.EROFS, "Read-only file system", str(self))
    return real_mkdir(self, *a, **k)
  monkeypatch.setattr(storage.os, "open", ro_open)
  monkeypatch.setattr(gpath, "mkdir", ro_mkdir)


def test_train_into_read_only_places_files_and_paths_under_files(run8, tmp_path,
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
  _read_only_under(monkeypatch, ro)
  assert cli_mod.main(cfg + ["--workdir", str(ro / "run")]) == 2
  err = capsys.readouterr().err
  assert err.count("\n") == 1 and f"cannot write '{ro / 'run'}" in err and "read-only" in err
  assert os.listdir(ro) == []
  # A finished run on a read-only mount: nothing to do, nothing written.
  _read_only_under(monkeypatch, run8)
  before = _tree(run8)
  res = loop.train(induction_cfg("--config.train.steps=8", "--config.train.log_every=2"),
                   run8, **QUIET)
  assert res["status"] == "done" and res["step"] == 8 and _tree(run8) == before


# ------------------------------------------------------------------ faults

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
  enter = loop._Preemption.__enter__
  monkeypatch.setattr(loop._Preemption, "__enter__",
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


# ------------------------------------------------------------------ ids, contexts, imports

def test_token_ids_beyond_the_vocabulary_are_refused_where_they_enter(run8):
  loaded = mha_jax.load(run8, **QUIET)
  v = loaded.task.vocab_size
  tokens = np.zeros((2, 9), np.int32)
  assert np.isfinite(np.asarray(loaded.task.apply(loaded.params, {"tokens": tokens}))).all()
  tokens[1, 3] = v + 5
  with pytest.raises(UserError, match=rf"token id {v + 5} is not in the vocabulary of {v} "
                                      rf"tokens \(ids 0..{v - 1}\)"):
    loaded.task.apply(loaded.params, {"tokens": tokens})
  tokens[1, 3] = -1
  with pytest.raises(UserError, match=r"token id -1 is negative"):
    loaded.task.loss(loaded.params, {"tokens": tokens})


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
  """A tiny LLaMA GGUF (context 128, vocabulary 256) and its imported workdir."""
  from mha_jax.pretrained import importer
  from helpers import _tiny_llama_hf, _write_tiny_gguf
  base = tmp_path_factory.mktemp("tiny_llama")
  w, cfg = _tiny_llama_hf(np.random.default_rng(0))
  path = base / "tiny.gguf"
  _write_tiny_gguf(path, w, cfg)
  wd = str(base / "wd")
  importer.import_model(wd, file=str(path))
  return str(path), wd


def test_generate_beyond_the_context_is_refused_naming_both_numbers(tiny_llama, capsys):
  _, wd = tiny_llama
  assert cli_mod.main(["generate", "--workdir", wd, "--prompt", "abc",
                       "--max-new-tokens", "9000"]) == 2
  err = capsys.readouterr().err
  assert "the prompt's 3 tokens plus --max-new-tokens 9000 make 9003, more than the " \
         "model's context of 128 tokens" in err, err
  assert cli_mod.main(["generate", "--workdir", wd, "--prompt", "abc",
                       "--max-new-tokens", "2"]) == 0
  loaded = mha_jax.load(wd, **QUIET)
  with pytest.raises(UserError, match=r"token id 300 is not in the vocabulary of 256"):
    loaded.task.logits(loaded.params, np.full((1, 4), 300, np.int32))


def test_a_full_disk_during_import_is_one_line_and_leaves_nothing(tiny_llama, tmp_path,
                                                                  monkeypatch, capsys):
  import orbax.checkpoint as ocp
  path, _ = tiny_llama
  real = ocp.CheckpointManager.save

  def fill_up(self, step, *a, **k):
    os.makedirs(os.path.join(str(self.directory), f"{step}.orbax-checkpoint-tmp-7", "params"))
    raise ValueError("RESOURCE_EXHAUSTED: Error writing local file: No space left on device")
  monkeypatch.setattr(ocp.CheckpointManager, "save", fill_up)
  out = tmp_path / "imports"
  out.mkdir()
  assert cli_mod.main(["import", "--file", path, "--workdir", str(out / "wd")]) == 2
  err = capsys.readouterr().err
  assert err.count("\n") == 1 and "the disk is full" in err, err
  assert os.listdir(out) == []                        # no .import-* folder left behind
  monkeypatch.setattr(ocp.CheckpointManager, "save", real)


def test_a_config_json_edited_after_training_is_refused_naming_the_field(run8, tmp_path,
                                                                         capsys):
  wd = _copy(run8, tmp_path)
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


# ------------------------------------------------------------------ studies' outputs

def test_out_inside_a_managed_folder_or_equal_to_the_source_is_refused(run8, tmp_path,
                                                                       capsys, request):
  wd = _copy(run8, tmp_path)
  before = _tree(wd)
  for argv, msg in (
      (["prune", "--method", "random", "--keep", "2", "--stacks", "lm",
        "--out", os.path.join(wd, "checkpoints", "999")], "lies inside checkpoints/"),
      (["export-pruned", "--out", os.path.join(wd, "data", "x")], "lies inside data/"),
      (["export-pruned", "--out", wd + "/"], "is the source workdir"),
      (["ablate", "--heads", "lm.0.0", "--out", os.path.join(wd, "checkpoints.bad")],
       "lies inside checkpoints.bad/")):
    assert cli_mod.main([argv[0], "--workdir", wd, *argv[1:]]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and msg in err, err
  assert _tree(wd) == before and ckpt_lib.step_dirs(wd) == [4, 8]
  a_file = tmp_path / "curve_out"
  a_file.write_text("")
  request.getfixturevalue("no_load")
  assert cli_mod.main(["prune-curve", "--workdir", wd, "--out", str(a_file),
                       "--stacks", "lm", "--counts", "2"]) == 2
  assert f"--out '{a_file}' is a file, not a folder" in capsys.readouterr().err


def test_circuits_writes_to_out_and_a_read_only_workdir_needs_it(run8, tmp_path, capsys,
                                                                 monkeypatch):
  before = _tree(run8)
  out = str(tmp_path / "c")
  assert cli_mod.main(["circuits", "--workdir", run8, "--out", out, "--no-track"]) == 0
  assert {"circuits.json", "composition.png"} <= set(os.listdir(out))
  assert _tree(run8) == before
  _read_only_under(monkeypatch, run8)
  assert cli_mod.main(["circuits", "--workdir", run8, "--no-track"]) == 2
  err = capsys.readouterr().err
  assert "--out" in err and "read-only workdir needs --out elsewhere" in err, err


def test_a_full_disk_under_analyze_out_is_one_line_and_leaves_no_partial_file(
    run8, tmp_path, monkeypatch, capsys):
  from mha_jax import storage
  out = tmp_path / "out"
  gpath = type(storage.path(str(out)))
  real_open = gpath.open

  def full_open(self, mode="r", *a, **k):
    f = real_open(self, mode, *a, **k)
    if "w" in mode and str(self).startswith(str(out)) and self.name == "heads.csv":
      f.write(b"half a line")                    # some bytes got to disk, then none fit
      f.close()
      raise OSError(errno.ENOSPC, "No space left on device", str(self))
    return f
  monkeypatch.setattr(gpath, "open", full_open)
  assert cli_mod.main(["analyze", "--workdir", run8, "--split", "valid", "--no-ablations",
                       "--out", str(out)]) == 2
  err = capsys.readouterr().err
  assert err.strip() == (f"mha-jax: error: cannot write '{out / 'heads.csv'}': the disk is "
                         f"full (no space left on device)"), err
  assert "heads.csv" not in os.listdir(out)


def test_a_model_without_heads_runs_through_analyze_and_circuits(run8, tmp_path, capsys):
  pruned, exported = str(tmp_path / "p0"), str(tmp_path / "e0")
  assert cli_mod.main(["prune", "--workdir", run8, "--out", pruned, "--method", "random",
                       "--keep", "0", "--stacks", "lm"]) == 0
  assert cli_mod.main(["export-pruned", "--workdir", pruned, "--out", exported]) == 0
  loaded = mha_jax.load(exported, **QUIET)
  assert loaded.head_names == []
  tokens = np.asarray(next(loaded.task.eval_batches("test", 4))[0]["tokens"])
  want = loaded.params["embed"][tokens[:, :-1]] @ loaded.params["unembed"]   # no heads: the
  np.testing.assert_allclose(loaded.task.apply(loaded.params, {"tokens": tokens}), want,
                             atol=1e-5)                                 # direct path only
  capsys.readouterr()
  out = str(tmp_path / "a")
  assert cli_mod.main(["analyze", "--workdir", exported, "--split", "valid",
                       "--out", out]) == 0
  assert json.load(open(os.path.join(out, "heads.json"))) == []
  assert {"roles.png", "explorer.html"} <= set(os.listdir(out))
  assert cli_mod.main(["circuits", "--workdir", exported, "--out", str(tmp_path / "c")]) == 0
  res = json.load(open(os.path.join(str(tmp_path / "c"), "circuits.json")))
  assert res["heads"] == {} and res["induction_heads"] == []
  assert res["previous_token_head"] is None
  assert "no attention heads in this model" in capsys.readouterr().out


def test_reference_scores_that_cannot_fit_are_explained_before_any_allocation(monkeypatch):
  import jax
  import jax.numpy as jnp
  from mha_jax import attention
  from mha_jax.kernels import dispatch
  monkeypatch.setattr(dispatch, "memory_limit",
                      lambda: (8 * 2**30, "the process's address-space limit (RLIMIT_AS)"),
                      raising=False)
  params = attention.init_attention_params(jax.random.PRNGKey(0), 16, 8)
  x = jax.ShapeDtypeStruct((1, 16384, 16), jnp.float32)       # never allocated
  call = lambda impl, **k: jax.eval_shape(
      lambda x: attention.multi_head_attention(params, x, causal=True, impl=impl, **k), x)
  with pytest.raises(ValueError, match=r"impl='reference' holds the \(B, H, T, S\) = "
                                       r"\(1, 8, 16384, 16384\) attention scores whole: "
                                       r"16.0 GiB .* more than the process's address-space "
                                       r"limit \(RLIMIT_AS\) \(8.0 GiB\)\. Use impl='blocked' "
                                       r"\(or 'auto', which picks it at this size\)"):
    call("reference")
  with pytest.raises(ValueError, match=r"Attention weights \(return_weights=True\) are this tensor"):
    call("auto", return_weights=True)
  assert call("blocked").shape == (1, 16384, 16)
  assert call("auto").shape == (1, 16384, 16)
