"""Pruning: Hard Concrete gates, L0 training, exact counts, baselines, export, bad input."""

import json
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mha_jax
from mha_jax import cli
from mha_jax.toolkit import importance
from mha_jax.roles import head_roles
from mha_jax.models import common
from mha_jax.pruning import hard_concrete
from mha_jax.toolkit import head_masks
from mha_jax.pruning import methods
from mha_jax.pruning import prune as prune_lib
from mha_jax.train import checkpoint as ckpt_lib
from builders import trained_translation


# One worker builds this module's trained fixture once (see setup.cfg: --dist loadgroup).
pytestmark = pytest.mark.xdist_group('pruning')

HC = hard_concrete.HardConcrete()


def test_hard_concrete_sample_gate_and_penalty_formulas():
  la = {"encoder": [jnp.array([-8.0, 0.0, 8.0])]}
  det = hard_concrete.deterministic(la, HC)["encoder"][0]
  np.testing.assert_allclose(det, np.clip(1 / (1 + np.exp(-np.array([-8.0, 0, 8]))) * 1.2 - 0.1,
                                          0, 1), atol=1e-6)
  assert det[0] == 0.0 and det[2] == 1.0
  assert hard_concrete.binary(la, HC)["encoder"][0].tolist() == [0.0, 1.0, 1.0]
  thr = hard_concrete.HardConcrete(binarize="threshold")
  assert hard_concrete.binary({"e": [jnp.array([-1.0])]}, thr)["e"][0].tolist() == [0.0]  # gate 0.23
  shift = (1 / 3) * math.log(0.1 / 1.1)
  want = sum(1 / (1 + math.exp(-(v - shift))) for v in (-8.0, 0.0, 8.0))
  assert abs(float(hard_concrete.l0_penalty(la, HC)) - want) < 1e-5
  # The expected L0 is the probability that a sampled gate is non-zero.
  la1 = {"e": [jnp.full((200_000,), 0.5)]}
  g = hard_concrete.sample(la1, jax.random.PRNGKey(0), HC)["e"][0]
  assert float(g.min()) >= 0.0 and float(g.max()) <= 1.0
  p_open = float(hard_concrete.l0_penalty(la1, HC)) / 200_000
  assert abs(float((g > 0).mean()) - p_open) < 0.005
  assert 0.05 < float((g == 0).mean()) and 0.05 < float((g == 1).mean())   # hard zeros and ones
  with pytest.raises(ValueError, match="stretch limits"):
    hard_concrete.HardConcrete(low=0.1).validate()


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
  return trained_translation(tmp_path_factory, "pr", "--config.model.num_heads=4",
                             "--config.model.enc_layers=2")


@pytest.mark.slow  # default run: test_prune_cli_and_bad_input
def test_gate_training_freezes_the_model_and_lambda_prunes(loaded):
  la, params, hist = methods.train_gates(loaded, 0.5, stacks=["encoder"], steps=40, lr=0.2,
                                         log=lambda s: None)
  assert ckpt_lib.tree_equal(params, loaded.params)        # multi_transform froze the rest
  kept_strong = head_masks.count(methods.l0_mask(la, HC))
  la0, _, _ = methods.train_gates(loaded, 0.0, stacks=["encoder"], steps=40, lr=0.2,
                                  log=lambda s: None)
  assert head_masks.count(methods.l0_mask(la0, HC)) == 8 > kept_strong
  assert hist[-1]["l0"] < hist[0]["l0"]
  _, tuned, _ = methods.train_gates(loaded, 0.1, stacks=["encoder"], steps=3, finetune=True,
                                    log=lambda s: None)
  assert not ckpt_lib.tree_equal(tuned, loaded.params)
  top = methods.top_k_mask(la, 3)
  assert head_masks.count(top) == 3
  best = sorted(((float(v), i, h) for i, l in enumerate(la["encoder"])
                 for h, v in enumerate(np.asarray(l))), reverse=True)[:3]
  assert {(i, h) for _, i, h in best} == {(i, h) for i, m in enumerate(top["encoder"])
                                          for h in np.flatnonzero(m)}


def test_baselines_reach_exact_counts(loaded):
  ms = methods.michel_masks(loaded, stacks=["encoder"], counts=[6, 1], limit=16,
                            log=lambda s: None)
  assert head_masks.count(ms[6]) == 6 and head_masks.count(ms[1]) == 1
  kept6 = set(head_masks.kept_names(ms[6]))
  assert set(head_masks.kept_names(ms[1])) <= kept6                  # iterative: nested
  one = methods.michel_masks(loaded, stacks=["encoder"], counts=[2], keep_one_per_layer=True,
                             limit=16, log=lambda s: None)[2]
  assert [int(m.sum()) for m in one["encoder"]] == [1, 1]
  rnd = methods.random_masks(loaded, stacks=["encoder"], counts=[5, 0], seed=3)
  assert head_masks.count(rnd[5]) == 5 and head_masks.count(rnd[0]) == 0
  assert methods.schedule(48) == [48, 43, 38, 33, 28, 23, 18, 13, 8, 3, 0]


@pytest.mark.slow
def test_prune_export_and_reuse_with_an_empty_layer(loaded, tmp_path):
  out, exp = str(tmp_path / "pruned"), str(tmp_path / "exported")
  # Keep 3 encoder heads chosen at random with a seed that empties layer 1? Force it:
  mask = {"encoder": [np.array([1, 1, 0, 1], np.float32), np.zeros(4, np.float32)]}
  info = prune_lib.save_pruned(loaded, out, loaded.params, mask, {"method": "manual"}, 0,
                           log=lambda s: None)
  assert info["kept"] == 3 and info["kept_heads"] == ["encoder.0.0", "encoder.0.1",
                                                      "encoder.0.3"]
  gated = loaded.task.evaluate(loaded.params, "valid", bleu=False, hook=mha_jax.tasks.gates_hook(
      loaded.task, head_masks.full_head_gates(loaded.params, mask)))
  masked = mha_jax.load(out)
  assert abs(masked.task.evaluate(masked.params, "valid", bleu=False)["loss"]
             - gated["loss"]) < 1e-5
  prune_lib.export_pruned(mha_jax.load(out), exp, log=lambda s: None)
  ex = mha_jax.load(exp)
  assert common.head_counts(ex.params)["encoder"] == [3, 0]
  assert ex.params["encoder"]["layer_1"]["self_attn"]["wq"].shape == (16, 0, 4)
  batch = next(loaded.task.eval_batches("valid", 8))[0]
  gated_hook = mha_jax.tasks.gates_hook(loaded.task, head_masks.full_head_gates(loaded.params, mask))
  np.testing.assert_allclose(ex.task.apply(ex.params, batch),
                             loaded.task.apply(loaded.params, batch, hook=gated_hook), atol=1e-5)
  # The exported model works everywhere: eval, analysis, ablation, further pruning.
  # Exported and masked are one model: the same loss and the same greedy translations.
  ev = json.loads(json.dumps(ex.task.evaluate(ex.params, "valid")))
  ev_masked = masked.task.evaluate(masked.params, "valid")
  assert ev["loss"] == pytest.approx(ev_masked["loss"], abs=1e-5)
  assert ev["bleu"] == pytest.approx(ev_masked["bleu"], abs=1e-6)
  assert ex.task.translate(ex.params, "valid") == masked.task.translate(masked.params,
                                                                          "valid")
  rows = head_roles.translation_roles(ex, "valid")
  assert len([r for r in rows if r["stack"] == "encoder"]) == 3
  imp = importance.michel_importance(ex, "valid", limit=8)
  assert "encoder.0.2" in imp["raw"] and "encoder.1.0" not in imp["raw"]
  # Ablating exported head 0 of layer 0 = also closing that head in the source model.
  abl = importance.ablate(ex, [("encoder", 0, 0)], split="valid", bleu_limit=4)
  closed = {"encoder": [np.array([0, 1, 0, 1], np.float32), np.zeros(4, np.float32)]}
  want = loaded.task.evaluate(loaded.params, "valid", bleu=False, hook=mha_jax.tasks.gates_hook(
      loaded.task, head_masks.full_head_gates(loaded.params, closed)))
  assert abl["loss"] == pytest.approx(want["loss"], abs=1e-5)
  again = prune_lib.prune(ex, str(tmp_path / "again"),
                          prune_lib.PruneOptions(method="l0", l0_lambda=0.1, keep=2, steps=3),
                          log=lambda s: None)
  assert again["kept"] == 2
  with pytest.raises(ValueError, match=r"keep must be between 0 and the 3 heads left"):
    prune_lib.prune(ex, str(tmp_path / "more"), prune_lib.PruneOptions(method="random", keep=4),
                    log=lambda s: None)
  with pytest.raises(ValueError, match=r"keep must be between 0 and the 3 heads left"):
    prune_lib.prune(masked, str(tmp_path / "more"),
                    prune_lib.PruneOptions(method="random", keep=5), log=lambda s: None)


def test_prune_cli_and_bad_input(loaded, tmp_path, capsys):
  out = str(tmp_path / "l0")
  assert cli.main(["prune", "--workdir", loaded.workdir, "--out", out, "--method", "l0",
                   "--l0-lambda", "0.05", "--keep", "2", "--steps", "4"]) == 0
  res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
  assert res["kept"] == 2 and set(res["after"]) == {"loss", "accuracy", "bleu"}
  info = json.load(open(os.path.join(out, "pruning.json")))
  assert info["lambda"] == 0.05 and info["beta"] == pytest.approx(1 / 3)
  bad = [(["--l0-lambda", "-1"], "--l0-lambda must be >= 0; got -1"),
         (["--method", "random", "--keep", "-1"], "--keep must be between 0 and the 8"),
         (["--method", "random", "--keep", "9"], "--keep must be between 0 and the 8"),
         (["--method", "magic", "--keep", "1"], "argument --method: invalid choice: 'magic'"),
         (["--method", "random"], "--method random needs --keep K"),
         (["--stacks", "lm", "--method", "random", "--keep", "1"], "--stacks: 'lm' is not")]
  for args, msg in bad:
    assert cli.main(["prune", "--workdir", loaded.workdir, "--out", str(tmp_path / "x"),
                     *args]) == 2, args
    assert msg in capsys.readouterr().err, args
    assert not os.path.exists(str(tmp_path / "x"))
  assert cli.main(["prune", "--workdir", loaded.workdir, "--out", out, "--method", "random",
                   "--keep", "1"]) == 2
  assert "exists and is not empty; refusing" in capsys.readouterr().err
  assert json.load(open(os.path.join(out, "pruning.json")))["kept"] == 2   # untouched
  assert cli.main(["prune", "--workdir", str(tmp_path / "nothing"), "--method", "random",
                   "--keep", "1"]) == 2
  assert "no config.json" in capsys.readouterr().err
  assert cli.main(["export-pruned", "--workdir", loaded.workdir, "--out",
                   str(tmp_path / "e")]) == 2
  assert "export-pruned needs a run `mha-jax prune` wrote (its pruning.json" in \
      capsys.readouterr().err


@pytest.mark.slow
def test_pruning_curve_joins_roles_and_writes_outputs(loaded, tmp_path):
  from mha_jax.pruning import prune_curve
  out = str(tmp_path / "curve")
  rows = prune_curve.prune_curve(loaded, out, prune_curve.CurveOptions(counts=(8, 4, 0), steps=3,
                                                      random_draws=3, save_workdirs=(4,)),
                           log=lambda s: None)
  assert {(r["method"], r["kept"]) for r in rows} == {
      (m, k) for m in ("l0", "michel", "random") for k in (8, 4, 0)}
  by = {(r["method"], r["kept"]): r for r in rows}
  for m in ("l0", "michel", "random"):      # all heads kept = the dense model
    assert abs(by[(m, 8)]["loss"] - by[("l0", 8)]["loss"]) < 1e-6
    assert sum(by[(m, 4)]["roles"].values()) == 4 and by[(m, 0)]["roles"] == {}
    assert by[(m, 0)]["loss"] > by[(m, 8)]["loss"]
  assert os.path.getsize(os.path.join(out, "curve.png")) > 1000
  table = open(os.path.join(out, "curve.md")).read()
  assert table.splitlines()[2].startswith("| 8 |")
  # random: the mean over 3 orders (the first one's heads), each draw recorded
  r4 = by[("random", 4)]
  assert len(r4["draws"]) == 3 and r4["loss"] == pytest.approx(
      np.mean([d["loss"] for d in r4["draws"]]))
  assert len({d["loss"] for d in r4["draws"]}) > 1
  # --save-workdirs: each method's model at 4 heads, a pruned workdir like prune's
  for m in ("l0", "michel", "random"):
    saved = os.path.join(out, f"{m}_k4")
    info = json.load(open(os.path.join(saved, "pruning.json")))
    assert info["kept_heads"] == by[(m, 4)]["kept_heads"] and info["method"] == m
    again = mha_jax.load(saved)
    res = again.task.evaluate(again.params, "test", bleu=False)
    want = by[(m, 4)]["draws"][0] if m == "random" else by[(m, 4)]   # random: 1st draw
    assert res["loss"] == pytest.approx(want["loss"], rel=1e-5, abs=1e-6)
    assert info["after"]["loss"] == pytest.approx(want["loss"], rel=1e-6)
  ex = prune_lib.export_pruned(mha_jax.load(os.path.join(out, "l0_k4")), str(tmp_path / "ex"),
                               log=lambda s: None)
  assert sum(ex["head_counts"]["encoder"]) == 4 and ex["max_abs_diff_vs_masked"] < 1e-4
  assert ex["forward_speed"]["interleaved"] and ex["forward_speed"]["exported_tokens_per_s"] > 0
  with pytest.raises(ValueError, match="save_workdirs: .*l0_k4.* not empty"):
    prune_curve.prune_curve(loaded, out, prune_curve.CurveOptions(counts=(8, 4), save_workdirs=(4,)),
                      log=lambda s: None)
  with pytest.raises(ValueError, match=r"counts: 9 is outside 0..8"):
    prune_curve.prune_curve(loaded, out, prune_curve.CurveOptions(counts=(9,)), log=lambda s: None)


def test_lambda_sweep_records_heads_kept_and_bleu(loaded, tmp_path):
  out = str(tmp_path / "sweep")
  res = prune_lib.prune(loaded, out, prune_lib.PruneOptions(method="l0", lambdas=(0.0, 5.0),
                                                        steps=30, lr=0.3), log=lambda s: None)
  rows = json.load(open(os.path.join(out, "lambdas.json")))
  assert [r["lambda"] for r in rows] == [0.0, 5.0] == [r["lambda"] for r in res["lambdas"]]
  assert rows[0]["kept"] == 8 and rows[1]["kept"] < rows[0]["kept"]
  assert all({"bleu", "loss"} <= set(r) for r in rows)
  for l in ("0", "5"):
    info = json.load(open(os.path.join(out, f"lambda_{l}", "pruning.json")))
    assert mha_jax.load(os.path.join(out, f"lambda_{l}")).step == loaded.step
    assert info["kept"] == rows[int(l == "5")]["kept"]


def test_workdir_without_a_trained_checkpoint_is_refused(loaded, tmp_path):
  wd = tmp_path / "untrained"
  wd.mkdir()
  (wd / "config.json").write_text(open(os.path.join(loaded.workdir, "config.json")).read())
  with pytest.raises(ValueError, match="has no trained checkpoint"):   # the one loader
    mha_jax.load(str(wd))
  assert not (tmp_path / "o").exists()
