"""Where the studies write: analyze, ablate and circuits only under --out (a read-only
workdir needs one); a full disk leaves no partial file; a model without heads runs
through."""

import errno
import json
import os

import numpy as np
import pytest

import mha_jax
from mha_jax import cli as cli_mod
from mha_jax.models import common
from builders import QUIET, file_tree, read_only_under

# On the worker that trains conftest's ind_run and parallel_run (setup.cfg: --dist loadgroup).
pytestmark = pytest.mark.xdist_group("trained_runs")


def test_analyze_and_ablate_write_only_to_out(ind_run, tmp_path, capsys):
  before = file_tree(ind_run)
  out = str(tmp_path / "out")
  assert cli_mod.main(["ablate", "--workdir", ind_run, "--heads", "lm.0.0", "--split",
                       "valid", "--out", out]) == 0
  assert cli_mod.main(["analyze", "--workdir", ind_run, "--split", "valid",
                       "--no-ablations", "--out", out]) == 0
  assert {"ablation_zero.json", "heads.json"} <= set(os.listdir(out))
  assert file_tree(ind_run) == before
  blocker = tmp_path / "file"
  blocker.write_text("")
  capsys.readouterr()
  assert cli_mod.main(["ablate", "--workdir", ind_run, "--heads", "lm.0.0",
                       "--out", str(blocker / "x")]) == 2
  assert "cannot be created" in capsys.readouterr().err


def test_circuits_writes_to_out_and_a_read_only_workdir_needs_it(ind_run, tmp_path, capsys,
                                                                 monkeypatch):
  before = file_tree(ind_run)
  out = str(tmp_path / "c")
  assert cli_mod.main(["circuits", "--workdir", ind_run, "--out", out, "--no-track"]) == 0
  assert {"circuits.json", "composition.png"} <= set(os.listdir(out))
  assert file_tree(ind_run) == before
  read_only_under(monkeypatch, ind_run)
  assert cli_mod.main(["circuits", "--workdir", ind_run, "--no-track"]) == 2
  err = capsys.readouterr().err
  assert "--out" in err and "read-only workdir needs --out elsewhere" in err, err


def test_a_full_disk_under_analyze_out_is_one_line_and_leaves_no_partial_file(
    ind_run, tmp_path, monkeypatch, capsys):
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
  assert cli_mod.main(["analyze", "--workdir", ind_run, "--split", "valid", "--no-ablations",
                       "--out", str(out)]) == 2
  err = capsys.readouterr().err
  assert err.strip() == (f"mha-jax: error: cannot write '{out / 'heads.csv'}': the disk is "
                         f"full (no space left on device)"), err
  assert "heads.csv" not in os.listdir(out)


def test_a_model_without_heads_runs_through_analyze_and_circuits(ind_run, tmp_path, capsys):
  pruned, exported = str(tmp_path / "p0"), str(tmp_path / "e0")
  assert cli_mod.main(["prune", "--workdir", ind_run, "--out", pruned, "--method", "random",
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


def test_circuits_on_an_imported_lm_through_the_cli(tiny_hf_folder, tmp_path, capsys):
  """`mha-jax circuits` on an imported LLaMA (GQA, RMSNorm, MLPs): every head scored, the
  top heads by prefix matching (in that order) with their OV positivity and K-composition
  partners from earlier layers, the machine recorded; it names the files it wrote."""
  wd, out = str(tmp_path / "w"), str(tmp_path / "c")
  assert cli_mod.main(["import", "--file", tiny_hf_folder, "--workdir", wd]) == 0
  capsys.readouterr()
  assert cli_mod.main(["circuits", "--workdir", wd, "--out", out]) == 0
  assert f"wrote {out}/ (circuits.json, induction.png)" in capsys.readouterr().out
  assert sorted(os.listdir(out)) == ["circuits.json", "induction.png"]
  res = json.load(open(os.path.join(out, "circuits.json")))
  counts = common.head_counts(mha_jax.load(wd).params)["lm"]
  assert set(res["heads"]) == {f"lm.{l}.{h}" for l, n in enumerate(counts) for h in range(n)}
  top = res["top_induction_heads"]
  prefix = [r["prefix_matching"] for r in top]
  assert top and prefix == sorted(prefix, reverse=True)
  for r in top:
    assert res["heads"][r["head"]]["copying"] == r["copying"]
    assert -1.0 <= r["ov_positivity"] <= 1.0
    assert all(int(p["head"].split(".")[1]) < int(r["head"].split(".")[1])
               for p in r["k_partners"])
  assert res["machine"]["date"]
