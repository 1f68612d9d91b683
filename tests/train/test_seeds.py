"""Many seeds in one program (train.seeds): layout, equality with single-seed runs, resume,
divergence, and the stability report of `mha-jax analyze` over a multi-seed workdir."""

import json
import os
import shutil
import sys

import jax
import numpy as np
import pytest

import mha_jax
from mha_jax import config as mc
from mha_jax.errors import UserError
from mha_jax.train import checkpoint as ckpt_lib
from mha_jax.train import loop
from mha_jax.train.metrics import read_metrics

from builders import TINY_INDUCTION, TINY_TRANSLATION, tiny, with_devices

pytestmark = pytest.mark.xdist_group("seeds")   # one worker builds the shared 3-seed run

QUIET = dict(log=lambda s: None)
STEPS = ("--config.train.steps=4", "--config.train.checkpoint_every=2",
         "--config.train.eval_every=4", "--config.train.log_every=2",
         "--config.eval.bleu_examples=4", "--config.train.lr=5e-3")


def seeds_cfg(seeds, *extra):
  return tiny("configs/translation.py", TINY_TRANSLATION, *STEPS,
              f"--config.train.seeds={seeds}", *extra)


def params_of(workdir):
  return mha_jax.load(workdir).params


def max_diff(a, b):
  return max(float(np.max(np.abs(np.asarray(x) - np.asarray(y))))
             for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


@pytest.fixture(scope="session")
def three(tmp_path_factory):
  """seeds=3 of the tiny translation config, 4 steps, in one program."""
  wd = str(tmp_path_factory.mktemp("seeds") / "run")
  summary = loop.train(seeds_cfg(3), wd, **QUIET)
  return wd, summary


def test_seed_list_parses_counts_ranges_and_lists():
  cfg = seeds_cfg(1)
  assert mc.seed_list(cfg) == [0]
  for text, want in (("3", [0, 1, 2]), ("2-4", [2, 3, 4]), ("3,5,9", [3, 5, 9])):
    mc.override(cfg, "train.seeds", text)
    assert mc.seed_list(cfg) == want
  mc.override(cfg, "seed", "7")
  mc.override(cfg, "train.seeds", "2")
  assert mc.seed_list(cfg) == [7, 8]
  for bad in ("0", "5-2", "a", "1,1", "-3"):
    mc.override(cfg, "train.seeds", bad)
    with pytest.raises(UserError, match="train.seeds"):
      mc.validate(cfg)


def test_old_config_json_upgrades_to_one_seed():
  d = mc.to_dict(seeds_cfg(1))
  del d["train"]["seeds"], d["train"]["shuffle_seed"]
  cfg = mc.from_dict(d)
  assert cfg.train.seeds == "1" and cfg.train.shuffle_seed == -1
  assert mc.seed_list(cfg) == [0]


def test_three_seeds_write_ordinary_workdirs(three):
  wd, summary = three
  assert summary["status"] == "done" and summary["step"] == 4
  assert summary["seeds"] == [0, 1, 2]
  man = json.load(open(os.path.join(wd, "seeds.json")))
  assert man["seeds"] == [0, 1, 2]
  assert man["workdirs"] == ["seed_0", "seed_1", "seed_2"]
  assert not os.path.exists(os.path.join(wd, "config.json"))
  for s in (0, 1, 2):
    sd = os.path.join(wd, f"seed_{s}")
    loaded = mha_jax.load(sd)
    assert loaded.step == 4 and loaded.config.seed == s
    assert loaded.config.train.seeds == "1" and loaded.config.train.shuffle_seed == s
    assert ckpt_lib.step_dirs(sd) == [2, 4]
    assert [r["step"] for r in read_metrics(sd) if r["split"] == "train"] == [2, 4]
    assert [r["step"] for r in read_metrics(sd) if r["split"] == "valid"] == [4]
  with pytest.raises(UserError, match="multi-seed"):
    mha_jax.load(wd)


@pytest.mark.slow
def test_seed_of_the_vmapped_run_equals_a_plain_run_of_its_config(three, tmp_path):
  # seed 2: another init key and another data order than the config's own (seed 0)
  wd, _ = three
  cfg = mha_jax.loader.load_config(os.path.join(wd, "seed_2"))
  plain = str(tmp_path / "plain_2")
  loop.train(cfg, plain, **QUIET)
  d = max_diff(params_of(plain), params_of(os.path.join(wd, "seed_2")))
  assert d < 1e-5, d
  a, b, c = (params_of(os.path.join(wd, f"seed_{s}")) for s in (0, 1, 2))
  assert max_diff(a, b) > 1e-2 and max_diff(b, c) > 1e-2 and max_diff(a, c) > 1e-2


def test_seeds_have_their_own_data_order(three):
  from mha_jax import tasks
  wd, _ = three
  batches = [tasks.build(mha_jax.loader.load_config(os.path.join(wd, f"seed_{s}")),
                         None).train_batch(0)["src"] for s in (0, 1)]
  assert not np.array_equal(*batches)
  base = tasks.build(seeds_cfg(1), None).train_batch(0)["src"]
  assert np.array_equal(base, batches[0])     # seed 0 keeps data.seed=0's order


@pytest.mark.slow
def test_resumed_multi_seed_run_matches_an_uninterrupted_one(three, tmp_path):
  # A copy of the 4-step run interrupted after its step-2 save: step 4 set aside.
  wd, _ = three
  other = str(tmp_path / "resumed")
  shutil.copytree(wd, other)
  for s in (0, 1, 2):
    shutil.rmtree(os.path.join(other, f"seed_{s}", "checkpoints", "4"))
  logs = []
  loop.train(seeds_cfg(3), other, log=logs.append)
  assert any("resumed from step 2" in l for l in logs)
  for s in (0, 1, 2):
    d = max_diff(params_of(os.path.join(other, f"seed_{s}")),
                 params_of(os.path.join(wd, f"seed_{s}")))
    assert d <= 1e-6, (s, d)


@pytest.mark.slow
def test_seeds_out_of_step_resume_from_the_oldest(three, tmp_path):
  # Interrupted between the seeds' saves: seed 0 has no checkpoint yet, seed 1 has steps
  # 2 and 4, seed 2 step 2: all restart from step 0, the others' checkpoints set aside.
  wd, _ = three
  other = str(tmp_path / "ragged")
  shutil.copytree(wd, other)
  shutil.rmtree(os.path.join(other, "seed_0", "checkpoints"))
  shutil.rmtree(os.path.join(other, "seed_2", "checkpoints", "4"))
  loop.train(seeds_cfg(3, "--config.train.steps=2"), other, **QUIET)
  assert sorted(os.listdir(os.path.join(other, "seed_1", "checkpoints.bad"))) == ["2", "4"]
  for s in (0, 1, 2):
    assert ckpt_lib.step_dirs(os.path.join(other, f"seed_{s}")) == [2]
    d = max_diff(params_of(os.path.join(other, f"seed_{s}")),
                 mha_jax.load(os.path.join(wd, f"seed_{s}"), step=2).params)
    assert d <= 1e-6, (s, d)


def test_multi_seed_workdir_refuses_mismatched_runs(three, tmp_path):
  wd, _ = three
  with pytest.raises(UserError, match="multi-seed run"):
    loop.train(seeds_cfg(1), wd, **QUIET)
  with pytest.raises(UserError, match=r"holds seeds \[0, 1, 2\]"):
    loop.train(seeds_cfg(2), wd, **QUIET)
  with pytest.raises(UserError, match="mesh.model=2"):
    loop.train(seeds_cfg(2, "--config.mesh.model=2"), str(tmp_path / "m"), **QUIET)


@pytest.mark.slow
def test_a_diverging_seed_stops_the_run_naming_it(tmp_path):
  # lr 100 with a long warmup: the loss grows past 4x its start (test_objective.py)
  cfg = tiny("configs/induction.py", TINY_INDUCTION, "--config.train.steps=12",
             "--config.train.lr=100", "--config.train.warmup=1000",
             "--config.train.log_every=1", "--config.train.checkpoint_every=4",
             "--config.train.seeds=5-6")
  wd = str(tmp_path / "div")
  with pytest.raises(loop.TrainingDiverged, match=r"seed ([56]) of train.seeds='5-6': "
                                                   r".*Last good checkpoint: step (\d+)") as e:
    loop.train(cfg, wd, **QUIET)
  seed = int(str(e.value).split()[1])
  good = int(str(e.value).split("Last good checkpoint: step ")[1].split()[0])
  assert f"seed_{seed}" in str(e.value)
  assert ckpt_lib.step_dirs(os.path.join(wd, f"seed_{seed}"))[-1] == good


def test_role_stability_counts_seeds_per_layer():
  from mha_jax.toolkit import stability

  def rows(roles_by_layer):
    return [{"head": f"encoder.{l}.{h}", "stack": "encoder", "layer": l, "index": h,
             "role": role} for l, roles in enumerate(roles_by_layer)
            for h, role in enumerate(roles)]

  rep = stability.role_stability({
      0: rows([["positional", "positional", "other"], ["rare", "other", "other"]]),
      1: rows([["positional", "other", "other"], ["other", "other", "other"]]),
      2: rows([["other", "other", "other"], ["positional", "rare", "syntactic"]])})
  by = {(r["layer"], r["role"]): r for r in rep["layers"]}
  assert rep["roles"] == ["positional", "syntactic", "rare", "other"]
  assert by[(0, "positional")]["seeds_with_role"] == 2
  assert by[(0, "positional")]["heads_per_seed"] == [2, 1, 0]
  assert by[(0, "positional")]["heads_mean"] == pytest.approx(1.0)
  assert by[(0, "positional")]["heads_std"] == pytest.approx(1.0)
  assert by[(1, "rare")]["seeds_with_role"] == 2 and by[(1, "syntactic")]["seeds_with_role"] == 1
  assert by[(0, "rare")]["seeds_with_role"] == 0
  assert rep["totals"]["encoder"]["positional"]["per_seed"] == [2, 1, 1]
  md = stability.format_roles(rep)
  assert "| encoder | 0 | 2/3 (1.0 ± 1.0) |" in md


def _check_counts(rep, per_seed_rows):
  seeds = sorted(per_seed_rows)
  assert rep["seeds"] == seeds and rep["n_seeds"] == len(seeds) and rep["layers"]
  stacks = set()
  for r in rep["layers"]:
    want = sum(any(h["stack"] == r["stack"] and h["layer"] == r["layer"] and
                   h["role"] == r["role"] for h in per_seed_rows[s]) for s in seeds)
    assert 0 <= r["seeds_with_role"] <= len(seeds)
    assert r["seeds_with_role"] == want, r
    stacks.add(r["stack"])
  assert stacks == {"encoder", "decoder_self"}
  for stack in stacks:       # every head of every seed is counted once
    n_heads = [sum(h["stack"] == stack for h in per_seed_rows[s]) for s in seeds]
    assert [sum(t["per_seed"][i] for t in rep["totals"][stack].values())
            for i in range(len(seeds))] == n_heads


def test_analyze_roles_over_a_multi_seed_workdir_writes_the_stability_table(three, capsys):
  from mha_jax import cli
  wd, _ = three
  out = os.path.join(os.path.dirname(wd), "roles_only")
  assert cli.main(["analyze", "--workdir", wd, "--roles-only", "--out", out]) == 0
  rep = json.load(open(os.path.join(out, "stability.json")))
  rows = {s: json.load(open(os.path.join(out, f"seed_{s}", "roles_only.json")))
          for s in (0, 1, 2)}
  _check_counts(rep, rows)
  assert {"positional", "syntactic", "rare", "other"} <= set(rep["roles"])
  for name in ("stability.md", "stability.png"):
    assert os.path.getsize(os.path.join(out, name)) > 0
  assert not os.path.exists(os.path.join(out, "seed_1", "explorer.html"))
  assert "seeds with at least one head" in capsys.readouterr().out


@pytest.mark.slow
def test_full_analyze_over_a_multi_seed_workdir_reports_each_seed(three):
  from mha_jax import cli
  wd, _ = three
  assert cli.main(["analyze", "--workdir", wd, "--no-ablations"]) == 0
  rep = json.load(open(os.path.join(wd, "analysis", "stability.json")))
  rows = {s: json.load(open(os.path.join(wd, f"seed_{s}", "analysis", "heads.json")))
          for s in (0, 1, 2)}
  _check_counts(rep, rows)
  assert os.path.exists(os.path.join(wd, "seed_2", "analysis", "explorer.html"))


_MESH_SCRIPT = r"""
import json, sys
import jax, numpy as np
sys.path.insert(0, sys.argv[1] + "/tests")
from builders import TINY_INDUCTION, tiny
from mha_jax.train import loop, checkpoint as ckpt_lib
base = sys.argv[2]
def run(name, data):
  cfg = tiny("configs/induction.py", TINY_INDUCTION, "--config.train.steps=4",
             "--config.train.seeds=2", f"--config.mesh.data={data}")
  loop.train(cfg, f"{base}/{name}", log=lambda s: None)
  out = []
  for s in (0, 1):
    c = ckpt_lib.Checkpoints(f"{base}/{name}/seed_{s}", read_only=True)
    out.append(c.restore_params(4)[0]); c.close()
  return out
one, two = run("d1", 1), run("d2", 2)
print("RESULT" + json.dumps({"devices": len(jax.devices()), "diff": max(
    float(np.abs(np.asarray(a) - np.asarray(b)).max())
    for s in (0, 1) for a, b in zip(jax.tree.leaves(one[s]), jax.tree.leaves(two[s])))}))
"""


@pytest.mark.slow
def test_multi_seed_batches_split_over_two_devices_match_one(tmp_path):
  import subprocess
  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  env = with_devices(2)
  r = subprocess.run([sys.executable, "-c", _MESH_SCRIPT, root, str(tmp_path)], env=env,
                     capture_output=True, text=True, timeout=600)
  assert r.returncode == 0, r.stderr[-3000:]
  res = json.loads(r.stdout.split("RESULT")[1])
  assert res["devices"] == 2
  assert res["diff"] < 1e-5, res


def test_curve_stability_gives_mean_and_spread_per_method_and_count():
  from mha_jax.toolkit import stability

  def curve(l0, rnd):
    return {"rows": [{"method": "l0", "kept": 4, "bleu": l0, "roles": {"positional": 1}},
                     {"method": "random", "kept": 4, "bleu": rnd, "roles": {}}]}

  rep = stability.curve_stability({0: curve(10.0, 2.0), 1: curve(14.0, 4.0)}, "bleu")
  by = {(r["method"], r["kept"]): r for r in rep["rows"]}
  assert by[("l0", 4)]["mean"] == pytest.approx(12.0)
  assert by[("l0", 4)]["std"] == pytest.approx(np.std([10.0, 14.0], ddof=1))
  assert (by[("random", 4)]["min"], by[("random", 4)]["max"]) == (2.0, 4.0)
  assert by[("l0", 4)]["roles_kept_mean"] == {"positional": 1.0}
  assert "| 4 | 12 ± 2.8 (10-14) | 3 ± 1.4 (2-4) | positional 1.0 |" in \
      stability.format_curve(rep)


@pytest.mark.slow
def test_prune_curve_over_a_multi_seed_workdir(three, tmp_path):
  from mha_jax import cli
  wd, _ = three
  out = str(tmp_path / "curve")
  assert cli.main(["prune-curve", "--workdir", wd, "--out", out, "--counts", "8,4,1",
                   "--steps", "3", "--bleu-limit", "4"]) == 0
  rep = json.load(open(os.path.join(out, "curve_stability.json")))
  assert rep["seeds"] == [0, 1, 2] and rep["metric"] == "bleu"
  for r in rep["rows"]:
    per_seed = [next(x["bleu"] for x in json.load(open(os.path.join(
        out, f"seed_{s}", "curve.json")))["rows"] if x["method"] == r["method"] and
                     x["kept"] == r["kept"]) for s in (0, 1, 2)]
    assert r["values"] == per_seed and r["mean"] == pytest.approx(np.mean(per_seed))
  assert {(r["method"], r["kept"]) for r in rep["rows"]} == {
      (m, k) for m in ("l0", "michel", "random") for k in (8, 4, 1)}
  assert os.path.getsize(os.path.join(out, "curve_stability.png")) > 0
