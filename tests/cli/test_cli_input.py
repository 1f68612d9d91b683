"""The command line's bad input: one line (no traceback) for the user's mistakes, a
traceback for bugs; flags, workdirs, splits, head names and --out checked before any
work."""

import os

import pytest

import mha_jax
from mha_jax import cli as cli_mod
from mha_jax import config as mc
from mha_jax.errors import UserError
from mha_jax.train import checkpoint as ckpt_lib
from builders import QUIET, copy_run, file_tree

# On the worker that trains conftest's ind_run and parallel_run (setup.cfg: --dist loadgroup).
pytestmark = pytest.mark.xdist_group("trained_runs")


def test_cli_prints_one_line_for_bad_input_and_a_traceback_for_bugs(ind_run, tmp_path,
                                                                    capsys, monkeypatch):
  bad = tmp_path / "bad.py"
  bad.write_text("def get_config(arg=None)\n  return 1\n")
  assert cli_mod.main(["train", "--config", str(bad), "--workdir", str(tmp_path / "w")]) == 2
  err = capsys.readouterr().err
  assert err.count("\n") == 1 and f"--config: '{bad}' line 1" in err, err
  wd = copy_run(ind_run, tmp_path)
  open(os.path.join(wd, "config.json"), "w").write('{"task": "lm",')
  assert cli_mod.main(["eval", "--workdir", wd]) == 2
  err = capsys.readouterr().err
  assert err.count("\n") == 1 and os.path.join(wd, "config.json") + " is not valid JSON" in err
  import mha_jax.loader

  def bug(*a, **k):
    raise ValueError("an internal shape bug")        # e.g. raised inside JAX
  monkeypatch.setattr(mha_jax.loader, "load_workdir", bug)
  with pytest.raises(ValueError, match="an internal shape bug"):
    cli_mod.main(["eval", "--workdir", ind_run])


def test_ablate_checks_head_names_before_evaluating(ind_run, capsys, monkeypatch):
  from mha_jax import tasks

  def no_eval(*a, **k):
    raise AssertionError("evaluated before checking --heads")
  monkeypatch.setattr(tasks.LMTask, "evaluate", no_eval)
  assert cli_mod.main(["ablate", "--workdir", ind_run, "--heads", "lm.99.0"]) == 2
  assert "lm.99.0" in capsys.readouterr().err


@pytest.fixture
def no_load(monkeypatch):
  """mha_jax.load fails the test: nothing may be loaded before the checks."""
  from mha_jax import loader
  # The studies take a loaded run; the CLI loads it, through loader.load, after the checks.
  monkeypatch.setattr(loader, "load_workdir", lambda *a, **k: pytest.fail("worked before checking"))


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
def test_every_numeric_flag_is_range_checked_before_any_work(ind_run, tmp_path, argv, msg,
                                                             capsys, no_load):
  out = str(tmp_path / "out")
  assert cli_mod.main([argv[0], "--workdir", ind_run, *argv[1:]] +
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


def test_a_bogus_split_is_refused_naming_the_valid_ones(ind_run, capsys):
  assert cli_mod.main(["analyze", "--workdir", ind_run, "--split", "bogus"]) == 2
  assert "argument --split: invalid choice: 'bogus' (choose from" in capsys.readouterr().err
  loaded = mha_jax.load(ind_run, **QUIET)
  with pytest.raises(UserError, match=r"split must be one of train, valid, test; got 'bogus'"):
    loaded.task.evaluate(loaded.params, "bogus")
  with pytest.raises(UserError, match=r"split must be one of train, valid, test"):
    next(loaded.task.eval_batches("bogus", 4))


def test_out_inside_a_managed_folder_or_equal_to_the_source_is_refused(ind_run, tmp_path,
                                                                       capsys, request):
  wd = copy_run(ind_run, tmp_path)
  before = file_tree(wd)
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
  assert file_tree(wd) == before and ckpt_lib.step_dirs(wd) == [4, 8]
  a_file = tmp_path / "curve_out"
  a_file.write_text("")
  request.getfixturevalue("no_load")
  assert cli_mod.main(["prune-curve", "--workdir", wd, "--out", str(a_file),
                       "--stacks", "lm", "--counts", "2"]) == 2
  assert f"--out '{a_file}' is a file, not a folder" in capsys.readouterr().err
