"""Circuits: hand-computed composition and positivity, path expansion, a trained model."""

import glob
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mha_jax.circuits import paths, induction_circuits
from mha_jax.toolkit import composition as scores
from mha_jax.data import repeated_tokens
from mha_jax.loader import load
from mha_jax.models import common
from mha_jax.models import lm
from mha_jax.train import loop
from builders import tiny


def _one_head(wq, wk, wv, wo):
  return {"wq": jnp.asarray(wq)[:, None], "wk": jnp.asarray(wk)[:, None],
          "wv": jnp.asarray(wv)[:, None], "wo": jnp.asarray(wo)[None]}


def test_positivity_identity_and_minus_identity():
  d = 6
  eye = np.eye(d)
  for sign in (1.0, -1.0):
    params = {"embed": jnp.asarray(eye), "unembed": jnp.asarray(eye),
              "lm": {"layer_0": {"attn": _one_head(eye, eye, eye, sign * eye)}}}
    assert scores.ov_positivity(params, "lm", 0, 0) == pytest.approx(sign)
  assert scores.positivity(np.array([2.0, -1.0, 1.0])) == pytest.approx(0.5)
  # K-composition term: prev head copies tokens (OV = I), later head matches same tokens.
  params = {"embed": jnp.asarray(eye), "unembed": jnp.asarray(eye), "lm": {
      "layer_0": {"attn": _one_head(eye, eye, eye, eye)},
      "layer_1": {"attn": _one_head(eye, eye, eye, eye)}}}
  assert scores.k_composition_positivity(params, (0, 0), (1, 0)) == pytest.approx(1.0)
  params["lm"]["layer_1"]["attn"] = _one_head(eye, -eye, eye, eye)
  assert scores.k_composition_positivity(params, (0, 0), (1, 0)) == pytest.approx(-1.0)


def test_composition_hand_values_and_random_baseline():
  rng = np.random.default_rng(0)
  u, v, w = (rng.standard_normal((5, 1)) for _ in range(3))
  assert scores.composition(u @ v.T, v @ w.T) == pytest.approx(1.0)      # aligned rank 1
  n = np.linalg.svd(v.T)[2][1][:, None]                                 # n is orthogonal to v
  assert scores.composition(u @ v.T, n @ w.T) == pytest.approx(0.0, abs=1e-12)
  p = lm.init(jax.random.PRNGKey(3), vocab_size=20, d_model=32, num_heads=8, num_layers=2,
              d_ff=0, max_len=8, attn_only=True, layer_norm=False)
  comp = scores.composition_scores(p, samples=400)
  for kind in ("q", "k", "v"):
    vals = np.array(list(comp["corrected"][kind].values()))
    assert len(vals) == 64
    assert abs(vals.mean()) < 0.02 and comp["baseline"][kind] > 0.1    # ~0 once subtracted
  # Every raw score recomputed from the weights, in the papers' column notation:
  # W_QK = Wq Wk^T, W_OV = (Wv Wo)^T; Q: W_QK^T W_OV, K: W_QK W_OV, V: W_OV W_OV.
  a0, a1 = (jax.tree.map(lambda x: np.asarray(x, np.float64), p["lm"][f"layer_{l}"]["attn"])
            for l in (0, 1))
  for i in range(8):
    ov_e = (a0["wv"][:, i] @ a0["wo"][i]).T
    for j in range(8):
      qk_l = a1["wq"][:, j] @ a1["wk"][:, j].T
      ov_l = (a1["wv"][:, j] @ a1["wo"][j]).T
      for kind, a in (("q", qk_l.T), ("k", qk_l), ("v", ov_l)):
        want = np.linalg.norm(a @ ov_e) / (np.linalg.norm(a) * np.linalg.norm(ov_e))
        got = comp["raw"][kind][(f"lm.0.{i}", f"lm.1.{j}")]
        assert got == pytest.approx(want, rel=1e-9), (kind, i, j)
        assert comp["corrected"][kind][(f"lm.0.{i}", f"lm.1.{j}")] == pytest.approx(
            want - comp["baseline"][kind], rel=1e-9)


@pytest.mark.parametrize("pos", [pytest.param("learned", marks=pytest.mark.slow), "qk",
                                 pytest.param("qk_sinusoidal", marks=pytest.mark.slow),
                                 pytest.param("relative", marks=pytest.mark.slow)])
def test_path_expansion_sums_to_the_logits(pos):
  p = lm.init(jax.random.PRNGKey(0), vocab_size=30, d_model=16, num_heads=2, num_layers=2,
              d_ff=0, max_len=12, attn_only=True, layer_norm=False, pos=pos)
  spec = common.ModelSpec("lm", layer_norm=False, attn_only=True, pos=pos)
  tok = jax.random.randint(jax.random.PRNGKey(1), (3, 12), 0, 30)
  logits, cap = lm.apply(p, spec, tok, capture=True)
  pats = [np.asarray(r.weights) for r in cap["lm"]]
  terms = paths.expand(p, tok, pats, pos_in_residual=pos not in common.SCORE_POS)
  assert sorted(terms) == ["order_0", "order_1", "order_2"]
  np.testing.assert_allclose(sum(terms.values()), logits, atol=1e-4)
  single = paths.single_head_terms(p, tok, pats, pos_in_residual=pos not in common.SCORE_POS)
  np.testing.assert_allclose(sum(single.values()), terms["order_1"], atol=1e-6)
  rows = paths.term_importance(p, tok, pats, pos_in_residual=pos not in common.SCORE_POS)
  assert rows[-1]["removed"] == "nothing" and rows[-1]["loss_change_vs_full"] == 0.0
  with pytest.raises(ValueError, match="attention-only model without LayerNorm"):
    paths.expand(lm.init(jax.random.PRNGKey(0), vocab_size=30, d_model=16, num_heads=2,
                         num_layers=1, d_ff=8, max_len=12), tok, pats[:1])


def test_variable_copy_length_defeats_a_positional_shortcut():
  x, m = repeated_tokens.repeated_tokens(0, 0, 200, 12, 50, min_half_len=6,
                                         return_lengths=True)
  assert len(set(m.tolist())) == 7 and x.shape == (200, 25)
  for row, k in zip(x, m):
    np.testing.assert_array_equal(row[1:1 + k], row[1 + k:1 + 2 * k])
  masks = repeated_tokens.position_masks(m, 24)
  assert (masks["first"].sum(1) == m - 1).all() and (masks["repeat"].sum(1) == m - 1).all()


@pytest.mark.slow   # trains the induction config to its phase change (~50 s on 2 cores)
def test_trained_two_layer_model_has_an_induction_head(tmp_path):
  """A layer-2 head with high prefix matching and copying, whose strongest
  K-composition is with the layer-1 head that attends most to the previous token."""
  wd = str(tmp_path / "ind")
  cfg = tiny("configs/induction.py", ["--config.train.progress=false",
                                      "--config.train.checkpoint_every=500"])
  loop.train(cfg, wd, log=lambda s: None)
  res = induction_circuits.circuits(load(wd), log=lambda s: None)
  prev = res["previous_token_head"]
  heads = [r for r in res["induction_heads"] if r["head"].startswith("lm.1.")]
  assert heads, res["heads"]
  # The model may grow several induction heads; at least one matches prefixes and copies.
  assert any(r["prefix_matching"] > 0.3 and r["copying"] > 0.1 for r in heads), heads
  strongest = [r for r in heads if r["k_partner"] == prev]
  assert strongest, (prev, heads)
  steps = res["over_steps"]
  assert steps[-1]["icl_score"] < min(-1.5, steps[0]["icl_score"] - 1.5)   # the phase change
  rows = res["term_importance"]
  # As in the paper, single-head terms carry most of the effect, virtual heads little.
  assert rows[1]["loss_change_vs_full"] < 0.25 * rows[0]["loss_change_vs_full"]
  assert res["path_expansion_max_error"] < 1e-3
  for f in ("circuits.json", "composition.png", "positivity.png", "icl.png"):
    assert os.path.getsize(os.path.join(wd, "circuits", f)) > 500, f
  # The loss on the repeats falls from about ln V to below 1 nat; the first copy stays.
  from mha_jax.train.metrics import read_metrics
  valid = [r for r in read_metrics(wd) if r["split"] == "valid"]
  assert abs(valid[0]["loss_first"] - np.log(64)) < 0.1
  assert valid[-1]["loss_repeat"] < 1.0 < valid[0]["loss_repeat"]
  assert valid[-1]["loss_first"] > 3.9


@pytest.mark.slow   # 700 steps of configs/attn_only_text.py, one seed (~9 min on 2 cores)
def test_natural_text_model_grows_a_previous_token_head_then_an_induction_head(tmp_path):
  """The papers' shape on the standard library's code: by step 700 a layer-0 head puts
  over half its attention on t-1 and a layer-1 head matches prefixes on repeated random
  tokens, neither of which the model has at its first checkpoint (docs/guide/circuits.md:
  0.56 and 0.29 at step 700 of the committed seed 0)."""
  import dataclasses
  from mha_jax.roles import behaviour
  from mha_jax.train import checkpoint as ckpt_lib
  wd = str(tmp_path / "text")
  cfg = tiny("configs/attn_only_text.py:steps=700", ["--config.train.progress=false",
                                                     "--config.train.eval_every=700"])
  loop.train(cfg, wd, log=lambda s: None)
  loaded = load(wd)
  rt, _ = behaviour.eval_tokens(loaded, batch=16)
  c = ckpt_lib.Checkpoints(wd, read_only=True)
  first = dataclasses.replace(loaded, params=c.restore_params(100)[0], step=100)
  c.close()

  def best(at):
    hs = behaviour.head_scores(at, rt)
    return (max(v["previous_token"] for k, v in hs.items() if k.startswith("lm.0.")),
            max(v["prefix_matching"] for k, v in hs.items() if k.startswith("lm.1.")))

  prev0, prefix0 = best(first)
  prev, prefix = best(loaded)
  assert prev0 < 0.4 and prefix0 < 0.05, (prev0, prefix0)
  assert prev > 0.5 and prefix > 0.2, (prev, prefix)


@pytest.mark.slow
def test_circuits_runs_on_a_text_model_with_layernorm(tmp_path):
  wd = str(tmp_path / "text")
  cfg = tiny("configs/lm.py:attn_only,layers=2", [
      "--config.train.progress=false", "--config.train.steps=3", "--config.data.tokenizer=bytes",
      "--config.model.d_model=16", "--config.model.max_len=32", "--config.train.batch_size=4",
      "--config.eval.batch_size=4", "--config.eval.lm_batches=1", "--config.model.pos=qk"])
  loop.train(cfg, wd, log=lambda s: None)
  res = induction_circuits.circuits(load(wd), None, induction_circuits.CircuitsOptions(samples=20),
                        log=lambda s: None)
  assert len(res["heads"]) == 16 and "term_importance" not in res    # LayerNorm: no paths
  # Olsson et al.'s ICL score on the run's own text: token 32 (the context) minus token 6.
  loaded = load(wd)
  w = loaded.task.text_windows("valid", 128)
  logits = np.asarray(loaded.task.apply(loaded.params, {"tokens": w}), np.float64)
  logp = logits - logits.max(-1, keepdims=True)
  logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
  nll = -np.take_along_axis(logp, w[:, 1:, None], -1)[..., 0]
  last = res["over_steps"][-1]
  assert (last["text_early_token"], last["text_late_token"]) == (6, 32)
  assert last["text_icl_score"] == pytest.approx(nll[:, 31].mean() - nll[:, 5].mean(),
                                                 abs=1e-4)
  assert len(res["composition"]["k"]) == 64 and res["over_steps"][0]["step"] == 3


@pytest.mark.slow  # default run: test_study_outputs.py's circuits cells
def test_a_text_model_without_layernorm_has_its_terms_measured_on_its_own_text(tmp_path):
  """The natural-text config itself (BPE over three stdlib modules), shrunk: a previous-token
  head needs its phase change (the slow test above; no reduced size grows one in a few
  hundred steps, docs/guide/circuits.md), so this checks the circuits pipeline on it."""
  import sysconfig
  files = ",".join(sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py")))[:3])
  wd = str(tmp_path / "text")
  cfg = tiny(f"configs/attn_only_text.py:heads=4,d_model=16,head_dim=4,max_len=32,batch=4,"
             f"vocab=300,steps=3,corpus={files}", [
                 "--config.train.progress=false", "--config.eval.batch_size=4",
                 "--config.eval.lm_batches=1"])
  assert cfg.model.pos == "qk_sinusoidal" and not cfg.model.layer_norm
  loop.train(cfg, wd, log=lambda s: None)
  res = induction_circuits.circuits(load(wd), None,
                        induction_circuits.CircuitsOptions(samples=20, track=False), log=lambda s: None)
  assert res["term_importance_on"] == "text" and res["path_expansion_max_error"] < 1e-4
  loaded = load(wd)
  w = loaded.task.text_windows("valid", 16)        # the full model's loss on those windows
  logits = np.asarray(loaded.task.apply(loaded.params, {"tokens": w}), np.float64)[:, :-1]
  logp = logits - logits.max(-1, keepdims=True)
  logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
  nll = -np.take_along_axis(logp, w[:, 1:-1, None], -1)[..., 0]
  assert res["term_importance"][-1]["loss"] == pytest.approx(nll.mean(), abs=1e-4)


def test_circuit_roles_names_heads_at_the_taxonomys_thresholds(tmp_path, capsys):
  """scripts/circuit_roles.py: the attention-first rule uses the taxonomy's thresholds;
  --relabel names a roles.json's heads again from its scores; a results copy of
  circuit.json (its strongest edges only) is refused."""
  import pathlib
  import shutil
  import sys
  from mha_jax.roles import head_taxonomy
  root = pathlib.Path(__file__).resolve().parents[2]
  sys.path.insert(0, str(root / "scripts"))
  import circuit_roles
  t = head_taxonomy.ClassifyOptions().thresholds()
  head = {"previous_token": 0.0, "prefix_matching": t["induction"], "duplicate_token": 0.0,
          "logit_edge": 0.5, "dla": -0.2}
  th = circuit_roles.thresholds()
  assert circuit_roles.role(head, th) == "induction"
  head["prefix_matching"] = t["induction"] - 0.01
  assert circuit_roles.role(head, th) == "negative mover"
  src = root / "docs" / "results" / "circuits" / "smollm2_induction"
  shutil.copy(src / "roles.json", tmp_path / "roles.json")
  res = circuit_roles.main([str(tmp_path), "--relabel"])
  rows = res["top_by_edge_mass"]
  assert res["thresholds"]["induction"] == t["induction"] and len(rows) == 12
  assert [r["role"] for r in rows] == [circuit_roles.role(r, th) for r in rows]
  assert any(r["role"] == "induction" for r in rows)
  shutil.copy(src / "circuit.json", tmp_path / "circuit.json")
  with pytest.raises(SystemExit):
    circuit_roles.main([str(tmp_path), "--workdir", str(tmp_path)])
  assert "holds 300 of the graph's 70651 edges" in capsys.readouterr().err
