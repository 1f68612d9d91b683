"""`mha-jax claims`: every verdict rule flips on small inputs, and the cheap claims end to
end with their values (the primer page in a real browser: test_primer.py)."""

import json
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mha_jax import attention
from mha_jax import cli
from mha_jax.machine import machine
from mha_jax.harness.claims import measure
from mha_jax.harness.claims import rules
from mha_jax.harness.claims import run as claims_run
from mha_jax.harness.claims import toy

H, F, I = rules.HOLDS, rules.FAILS, rules.INCONCLUSIVE


def test_cheap_claims_end_to_end(tmp_path, capsys):
  """The cheap claims through the CLI, without the primer page (test_primer.py writes
  and opens one)."""
  out = str(tmp_path / "claims")
  assert cli.main(["claims", "--only", "worked_example,mixture_dip,whole_token",
                   "--no-primer", "--out", out]) == 0
  assert f"wrote {out}/REPORT.md, claims.json in" in capsys.readouterr().out
  assert not os.path.exists(os.path.join(out, "primer.html"))
  with open(os.path.join(out, "claims.json")) as f:
    rep = {r["name"]: r for r in json.load(f)["claims"]}
  w = rep["worked_example"]["numbers"]
  np.testing.assert_allclose(w["scores"], [4, 0, 3], atol=1e-6)
  np.testing.assert_allclose(w["output"], [20 / 7, 20 / 7, 10 / 7], atol=1e-5)
  e = np.exp([4.0, 0.0, 3.0])
  np.testing.assert_allclose(w["softmax_weights"], e / e.sum(), atol=1e-6)
  m = rep["mixture_dip"]["numbers"]
  assert m["peak_at_half"] == pytest.approx(math.exp(2) / (2 * math.exp(2) + 4), abs=1e-5)
  assert m["peak_at_0"] == pytest.approx(math.exp(4) / (math.exp(4) + 5), abs=1e-5)
  assert m["argmin_mix"] == 0.5
  assert rep["whole_token"]["numbers"]["min_share_of_features_read"] == {
      "1": 1.0, "2": 1.0, "4": 1.0, "8": 1.0}
  assert all(r["settings"]["toy"]["verdict"] == H == r["settings"]["toy"]["per_seed"][0][
      "verdict"] for r in rep.values())
  md = open(os.path.join(out, "REPORT.md")).read()
  assert sum(l.startswith("| **") for l in md.splitlines()) == 3 and "**holds**" in md and rules.mixture_dip.text in md
  assert os.path.getsize(os.path.join(out, "mixture_dip.png")) > 1000


def test_only_rejects_unknown_names(tmp_path):
  with pytest.raises(ValueError, match="--only: unknown claim 'nope'"):
    claims_run.run_claims(str(tmp_path / "x"), only="nope")
  assert not (tmp_path / "x").exists()


def test_whole_token_flips_when_heads_read_slices():
  p = dict(attention.init_attention_params(jax.random.PRNGKey(0), 8, 4))
  x = jax.random.normal(jax.random.PRNGKey(1), (8,))
  g = measure.q_jacobian(p, x)
  assert (g > 0).all()
  sliced = np.zeros((8, 4, 2), np.float32)          # head h reads only its own 2 inputs
  for h in range(4):
    sliced[2 * h:2 * h + 2, h] = np.asarray(p["wq"])[2 * h:2 * h + 2, h]
  g2 = measure.q_jacobian({**p, "wq": jnp.asarray(sliced)}, x)
  share = ((g2 > 1e-9 * g2.max()).sum(0) / 8).min()
  assert share == 0.25
  assert rules.whole_token({"min_share_of_features_read": {"4": 1.0}}) == H
  assert rules.whole_token({"min_share_of_features_read": {"4": float(share)}}) == F


def test_mixture_rule_flips():
  c = measure.mixture_curve()
  n = {"peak_at_0": c["peak"][0], "peak_at_half": c["peak"][10], "peak_at_1": c["peak"][-1],
       "argmin_mix": c["ratios"][int(np.argmin(c["peak"]))]}
  assert rules.mixture_dip(n) == H
  assert rules.mixture_dip({**n, "peak_at_half": n["peak_at_0"]}) == F
  assert rules.mixture_dip({**n, "argmin_mix": 0.9}) == F


def test_divisor_rule_flips_when_the_divisors_swap():
  c = measure.divisor_curves(queries=256, keys=8, dk_grid=(1, 8, 64))
  assert rules.divisor(c) == H
  swapped = {"peak": {"1/sqrt(d_k)": c["peak"]["1/sqrt(d_model)"],
                      "1/sqrt(d_model)": c["peak"]["1/sqrt(d_k)"]},
             "entropy": {"1/sqrt(d_k)": c["entropy"]["1/sqrt(d_model)"],
                         "1/sqrt(d_model)": c["entropy"]["1/sqrt(d_k)"]}}
  assert rules.divisor(swapped) == F
  n = {"entropy": {"1/sqrt(d_k)": [4.0, 4.1], "1/sqrt(d_model)": [4.4, 4.5]}}
  assert rules.divisor_real_widths(n) == H
  assert rules.divisor_real_widths({"entropy": {"1/sqrt(d_k)": [3.0, 4.1],
                                            "1/sqrt(d_model)": [4.4, 4.5]}}) == F


def test_cost_rule_on_real_pytrees_and_a_broken_count():
  n = measure.cost_table(d_model=128, seq_len=16, heads=(1, 4, 16))
  n["gpt2_small_params"] = 2_359_296
  assert rules.cost(n) == H
  assert n["score_bytes"] == [h * 16 * 16 * 4 for h in (1, 4, 16)]
  assert rules.cost({**n, "params": [n["params"][0], n["params"][1] + 4, n["params"][2]]}) == F
  assert rules.cost({**n, "score_bytes": [1, 2, 3]}) == F


def test_dk1_rule_and_argmax_on_a_rank_one_layer():
  params = toy.init(jax.random.PRNGKey(0), vocab=8, d_model=4, heads=4, length=6)
  tokens = toy.two_target_batch(0, 8, 6, 8)["tokens"]
  assert measure.dk1_argmax_share(params, tokens) == 1.0       # any d_k=1 layer, trained or not
  n = {"argmax_at_extreme_share": 1.0, "loss_dk1": 1.2, "best_loss": 1.0}
  assert rules.dk1(n) == H
  assert rules.dk1({**n, "loss_dk1": 1.01}) == I
  assert rules.dk1({**n, "argmax_at_extreme_share": 0.7}) == F


def test_wo_share_is_zero_for_block_diagonal_and_the_rule_flips():
  rng = np.random.default_rng(0)
  heads = rng.normal(size=(2, 3, 4, 2))
  wo = rng.normal(size=(4, 2, 8))
  block = np.zeros_like(wo)
  for h in range(4):
    block[h, :, 2 * h:2 * h + 2] = wo[h, :, 2 * h:2 * h + 2]
  assert np.allclose(measure.wo_outside_share(heads, block), 0.0)
  full = measure.wo_outside_share(heads, wo)
  assert rules.wo_mixes({"mean_share_outside_slot": float(full.mean())}) == H
  assert rules.wo_mixes({"mean_share_outside_slot": 0.0}) == F
  s = measure.wo_slider(heads[0, 0], wo, alphas=[0.0, 1.0])
  assert s["other_share"][0] == 0.0 and s["other_share"][1] > 0.3


def test_compromise_rule_flips():
  n = {"loss_h1": 1.6, "loss_h2": 1.2, "loss_h4": 0.8, "chance_loss": 5.5,
       "h1_weight_previous": 0.35, "h1_weight_partner": 0.2}
  assert rules.one_head_compromises(n) == H
  assert rules.one_head_compromises({**n, "loss_h1": 0.85}) == F
  assert rules.one_head_compromises({**n, "h1_weight_partner": 0.01}) == F
  assert rules.one_head_compromises({**n, "loss_h2": 5.0, "loss_h4": 5.0}) == I


def test_two_target_data():
  b = toy.two_target_batch(0, 4, 10, 8)
  x, p = b["tokens"], b["partner"]
  assert (b["a"][:, 1:] == x[:, :-1]).all() and (b["mask_a"][:, 0] == 0).all()
  for r in range(4):
    for t in range(10):
      nouns = [j for j in range(t - 1) if x[r, j] >= 4]
      assert p[r, t] == (nouns[-1] if nouns else -1)
      if nouns:
        assert b["b"][r, t] == x[r, nouns[-1]]


def test_study_rules_flip():
  n = {"specialised_share_all": 0.4, "specialised_share_kept": 0.6,
       "last_heads_roles": ["positional", "other"], "bleu_all": 95.0, "bleu_kept": 93.0}
  assert rules.pruning(n) == H
  assert rules.pruning({**n, "bleu_kept": 80.0}) == F
  assert rules.pruning({**n, "specialised_share_kept": 0.2}) == F
  k = {"k_partner": "lm.0.1", "previous_token_head": "lm.0.1", "k_row_median": 0.01,
       "k_partner_score": 0.15, "previous_token_score": 0.95, "prefix_matching": 0.85,
       "k_partner_previous_token": 0.95, "induction_head": "lm.1.0"}
  assert rules.induction_k_composition(k) == H and rules.why(rules.induction_k_composition, k) == ""
  assert rules.induction_k_composition({**k, "k_partner_previous_token": 0.5}) == I
  assert rules.induction_k_composition({**k, "k_row_median": 0.1}) == I
  assert "3x" in rules.why(rules.induction_k_composition, {**k, "k_row_median": 0.1})
  assert rules.induction_k_composition({**k, "k_partner_previous_token": 0.2}) == F
  c = {"induction_head": "lm.1.0", "previous_token_head": "lm.0.1", "path_k_effect": 0.4,
       "best_other": "lm.0.2", "best_other_effect": 0.1}
  assert rules.induction_k_causal(c) == H
  assert rules.induction_k_causal({**c, "best_other_effect": 0.3}) == I
  assert rules.induction_k_causal({**c, "path_k_effect": 0.04, "best_other_effect": 0.0}) == I
  assert rules.induction_k_causal({**c, "best_other_effect": 0.5}) == F
  assert "lm.0.2" in rules.why(rules.induction_k_causal, c)
  # several induction heads: the majority's verdict, else inconclusive
  fail = {**c, "induction_head": "lm.1.3", "best_other_effect": 0.5}
  soft = {**c, "induction_head": "lm.1.2", "path_k_effect": 0.01, "best_other_effect": 0.0}
  assert rules.induction_k_causal({"receivers": [c, fail, c]}) == H
  assert rules.induction_k_causal({"receivers": [fail, c, fail]}) == F
  assert rules.induction_k_causal({"receivers": [c, fail, soft]}) == I
  assert "lm.1.3" in rules.why(rules.induction_k_causal, {"receivers": [c, fail]})
  m = {"share_at_0.99": 0.25, "share_at_0.95": 0.4, "heads": 72}
  assert rules.michel(m) == H
  assert rules.michel({**m, "share_at_0.99": 0.1}) == I
  assert rules.michel({**m, "share_at_0.99": 0.05, "share_at_0.95": 0.1}) == F
  c = {"corner_heads": ["lm.1.1"], "induction_heads": ["lm.1.1"]}
  assert rules.positivity_corner(c) == H
  assert rules.positivity_corner({**c, "corner_heads": ["lm.1.1", "lm.1.2"]}) == F
  assert rules.positivity_corner({"corner_heads": [], "induction_heads": []}) == F
  s = {"share_near_baseline": 0.8, "max_over_baseline": 0.2}
  assert rules.composition_sparse(s) == H and rules.composition_sparse(
      {**s, "share_near_baseline": 0.3}) == F
  t = {"loss_direct": 4.1, "loss_direct_single": 2.9, "loss_full": 2.8}
  assert rules.term_importance(t) == H
  assert rules.term_importance({**t, "loss_direct_single": 3.9}) == F
  assert rules.term_importance({**t, "loss_direct": 2.82}) == I
  b = {"weight_on_bos": 0.7, "max_weight_elsewhere": 0.2}
  assert rules.rests_on_first_token(b) == H
  assert rules.rests_on_first_token({**b, "weight_on_bos": 0.3}) == F
  w = {"scores": [4, 0, 3], "scores_expected": [4, 0, 3], "weights": [4 / 7, 0, 3 / 7],
       "weights_expected": [4 / 7, 0, 3 / 7], "output": [2.86, 2.85, 1.43],
       "output_expected": [20 / 7, 20 / 7, 10 / 7]}
  assert rules.worked_example(w) == F                       # the seed's printed rounding
  assert rules.worked_example({**w, "output": w["output_expected"]}) == H


def test_every_claim_has_a_rule_with_text():
  for name, (text, fn, rule, headline, where, source, _) in claims_run.CLAIMS.items():
    assert text and callable(fn) and len(rule.text) > 40, name
    assert headline and all(isinstance(k, str) and k for k in headline), name
    assert where and set(where) <= set(claims_run.SETTINGS), name
    assert source in (None, "toy_seeds") or callable(source), name


def _unit(seed, verdict, **numbers):
  return {"seed": seed, "verdict": verdict, "numbers": numbers, "figures": []}


def test_seed_aggregation_counts_and_spreads():
  units = [_unit(0, H, a=0.5, b="x"), _unit(1, F, a=0.2, b="y"), _unit(2, H, a=0.9, b="z")]
  c = claims_run.aggregate(units, ("a",), seeded=True)
  assert c["verdict"] == "holds in 2 of 3 seeds (does not hold in 1)"
  assert c["counts"] == {H: 2, F: 1} and c["spread"] == {"a": [0.2, 0.9]}
  assert c["seeds"] == [0, 1, 2] and c["numbers"] == units[0]["numbers"]
  same = claims_run.aggregate([_unit(s, I, a=s) for s in range(3)], ("a",), seeded=True)
  assert same["verdict"] == "inconclusive in 3 of 3 seeds"
  one = claims_run.aggregate([_unit(None, F, a=1.0)], ("a",), seeded=True)
  assert one["verdict"] == "does not hold in 1 of 1 seed"
  assert claims_run.aggregate([_unit(None, F, a=1.0)], ("a",), seeded=False)[
      "verdict"] == F
  assert "2 of 3" in claims_run.verdict_cell(c, ("a",)) and "0.2..0.9" in claims_run.verdict_cell(c, ("a",))


def test_report_has_one_column_per_setting_and_says_why(tmp_path):
  good = {"k_partner": "lm.0.1", "previous_token_head": "lm.0.1", "k_row_median": 0.01,
          "k_partner_score": 0.15, "previous_token_score": 0.95, "prefix_matching": 0.85,
          "k_partner_previous_token": 0.95, "induction_head": "lm.1.0"}
  soft = {**good, "induction_head": "lm.17.1", "prefix_matching": 0.6}
  cells = {"toy": claims_run.aggregate([_unit(s, H, **good) for s in range(3)],
                                       ("prefix_matching",), True),
           "text": {"verdict": "not run", "reason": "no --text-workdir given"},
           "smollm2": claims_run.aggregate([_unit(None, rules.induction_k_composition(soft),
                                                  **soft)], ("prefix_matching",), False),
           "voita": {"verdict": "n/a"}}
  rep = {"seconds": 1.0, "toy_seeds": [0, 1, 2], "settings": {s: s for s in cells},
         "claims": [{"name": "induction_k_composition", "claim": "c", "rule": "r",
                     "paper": "two layers", "settings": cells, "figures": []}]}
  md = claims_run.format_report(rep).splitlines()
  head = next(i for i, l in enumerate(md) if l.startswith("| claim |"))
  assert md[head] == "| claim | toy | text | smollm2 | voita |"
  row = md[head + 2].split(" | ")
  assert "holds in 3 of 3 seeds" in row[1] and "not run" in row[2] and row[4] == "n/a |"
  assert "**inconclusive**" in row[3] and "prefix_matching 0.6" in row[3]
  why = [l for l in md if l.startswith("**induction_k_composition**")]
  assert len(why) == 1 and "smollm2" in why[0] and "0.6 (rule: >= 0.8)" in why[0]
  assert "toy" not in why[0].split("(the papers")[0]


def test_settings_columns_in_a_run(tmp_path):
  out = str(tmp_path / "c")
  rep = claims_run.run_claims(out, only="pruning,induction_k_composition",
                              settings="voita,text,minilm", primer=False,
                              log=lambda s: None)        # nothing given: nothing runs
  by = {r["name"]: r["settings"] for r in rep["claims"]}
  assert by["pruning"] == {"text": {"verdict": "n/a"}, "minilm": {"verdict": "n/a"},
                           "voita": {"verdict": "not run",
                                     "reason": "no --voita-workdir given"}}
  assert by["induction_k_composition"]["text"]["verdict"] == "not run"
  with open(os.path.join(out, "claims.json")) as f:
    saved = json.load(f)
  assert list(saved["settings"]) == ["text", "voita", "minilm"]
  assert saved["machine"].keys() == machine().keys()      # the one record, its date in it
  assert claims_run.parse_settings(None, ["voita"]) == ["toy", "voita"]
  with pytest.raises(ValueError, match="--settings: unknown setting 'tpu'"):
    claims_run.run_claims(str(tmp_path / "y"), settings="toy,tpu")
  with pytest.raises(ValueError, match="--toy-seeds"):
    claims_run.run_claims(str(tmp_path / "y"), toy_seeds="0,0")


def test_random_start_places_both_copies_and_masks_follow():
  from mha_jax.data import repeated_tokens
  plain = repeated_tokens.repeated_tokens(5, 2, 16, 8, 30, 4, return_lengths=True)
  np.testing.assert_array_equal(plain[0], repeated_tokens.repeated_tokens(5, 2, 16, 8, 30, 4))
  x, m, p = repeated_tokens.repeated_tokens(5, 2, 16, 8, 30, 4, return_lengths=True, random_start=True)
  assert (p >= 0).all() and (p + 2 * m <= 16).all() and p.max() > 0
  masks = repeated_tokens.position_masks(m, 16, p)
  for r in range(16):
    s = 1 + p[r]
    np.testing.assert_array_equal(x[r, s:s + m[r]], x[r, s + m[r]:s + 2 * m[r]])
    assert np.nonzero(masks["repeat"][r])[0].tolist() == list(range(s + m[r], s + 2 * m[r] - 1))
    assert np.nonzero(masks["first"][r])[0].tolist() == list(range(s, s + m[r] - 1))


@pytest.mark.slow
def test_toy_claims_train_and_hold(tmp_path):
  """The claims that train the two-target toy models (about 1 minute on 2 cores)."""
  rep = claims_run.run_claims(str(tmp_path), only="one_head_compromises,dk1,wo_mixes",
                              log=lambda s: None)
  by = {r["name"]: r for r in rep["claims"]}
  assert by["dk1"]["settings"]["toy"]["seeds"] == [0, 1, 2]
  n = by["one_head_compromises"]["numbers"]
  assert n["loss_h1"] > n["loss_h4"] and len(set(n["attention_params"])) == 1
  assert by["dk1"]["numbers"]["argmax_at_extreme_share"] >= 0.99
  assert 0.5 < by["wo_mixes"]["numbers"]["mean_share_outside_slot"] < 1.0
  html = open(tmp_path / "primer.html").read()
  assert '"compromise"' in html and '"dk1"' in html and '"trained_layer"' in html


@pytest.fixture(scope="module")
def tiny_gemma(tmp_path_factory):
  """A tiny random Gemma 3 from transformers (3 layers, 4 query heads over 1 key/value
  head, q/k norms, post-attention norms, MLPs), imported through the one importer."""
  pytest.importorskip("transformers")
  from hf_models import build_hf, save_folder
  from mha_jax.pretrained import importer
  base = tmp_path_factory.mktemp("tiny_gemma")
  model = build_hf("gemma3")
  importer.import_model(str(base / "w"), file=save_folder(model, base / "hf"))
  return model, str(base / "w")


@pytest.mark.slow
def test_real_lm_circuit_claims_on_a_tiny_gemma(tiny_gemma, tmp_path):
  from mha_jax.harness.claims import studies
  model, wd = tiny_gemma
  ctx = measure.Context(out=str(tmp_path), log=lambda s: None)
  n = studies.claim_induction_k_composition(ctx, "gemma3", None, wd)["numbers"]
  assert n["weight_scores"].startswith("approximate")
  # The row recomputed from transformers' weights, Gemma's (1 + w) norm scales applied
  # by hand (input norm on Q, K, V; q/k norms on each head's K columns; the
  # post-attention norm on W_O's outputs), as |QK OV^T| / (|QK| |OV|) on D x D matrices
  # (row convention: keys read x_j OV, so the score is x_i QK (x_j OV)^T).
  sd = {k: v.double().numpy() for k, v in model.state_dict().items()}
  cfg = model.config
  k = cfg.head_dim

  def head(layer, h):
    a = f"model.layers.{layer}.self_attn."
    g = 1 + sd[f"model.layers.{layer}.input_layernorm.weight"][:, None]
    wq = g * sd[a + "q_proj.weight"].T[:, h * k:(h + 1) * k] * (1 + sd[a + "q_norm.weight"])
    wk = g * sd[a + "k_proj.weight"].T[:, :k] * (1 + sd[a + "k_norm.weight"])  # 1 kv head
    wv = g * sd[a + "v_proj.weight"].T[:, :k]
    wo = sd[a + "o_proj.weight"].T[h * k:(h + 1) * k] * (
        1 + sd[f"model.layers.{layer}.post_attention_layernorm.weight"])
    return wq @ wk.T, wv @ wo

  ll, lh = (int(v) for v in n["induction_head"].split(".")[1:])
  qk, _ = head(ll, lh)
  assert n["k_row_size"] == 4 * ll
  for early, got in n["k_row"].items():
    _, ov = head(*(int(v) for v in early.split(".")[1:]))
    want = np.linalg.norm(qk @ ov.T) / (np.linalg.norm(qk) * np.linalg.norm(ov))
    assert got == pytest.approx(want - n["baseline"], abs=1e-5), early
  assert n["k_partner"] == max(n["k_row"], key=n["k_row"].get)
  assert n["k_row_median"] == pytest.approx(np.median(list(n["k_row"].values())))
  sp = studies.claim_composition_sparse(ctx, "gemma3", None, wd)["numbers"]
  assert sp["pairs"] == 3 * 16 * 3                        # 3 kinds x pairs of layers
  pc = studies.claim_positivity_corner(ctx, "gemma3", None, wd)["numbers"]
  prev_layer = int(n["previous_token_head"].split(".")[1])
  assert pc["heads_scored"] == 4 * (3 - 1 - prev_layer)
  assert set(pc["corner_heads"]) <= set(pc["positivity"])
  b = studies.claim_rests_on_first_token(ctx, "gemma3", None, wd)["numbers"]
  assert 0.0 <= b["weight_on_bos"] <= 1.0 and b["positions"] > 0
  kc = studies.claim_induction_k_causal(ctx, "gemma3", None, wd)["numbers"]
  heads = studies.circuit_facts(ctx, "gemma3", None, wd)["res"]["heads"]
  assert kc["receivers"][0]["induction_head"] == n["induction_head"]
  for r in kc["receivers"]:
    li = int(r["induction_head"].split(".")[1])
    below = {h: v["previous_token"] for h, v in heads.items() if int(h.split(".")[1]) < li}
    assert r["previous_token_head"] == max(below, key=below.get)
    lp = r["previous_token_head"].split(".")[1]
    assert sorted(r["layer_row"]) == [f"lm.{lp}.{j}" for j in range(4)]
    assert all(np.isfinite(v) for v in r["layer_row"].values())
    assert r["verdict"] == rules.induction_k_causal_one(r)
  for name, fn in (("induction_k_composition", n), ("composition_sparse", sp),
                   ("positivity_corner", pc), ("rests_on_first_token", b),
                   ("induction_k_causal", kc)):
    assert claims_run.CLAIMS[name][2](fn) in (H, F, I)


def test_the_causal_induction_rule_takes_a_single_seed_text_workdir(tiny_attn_lm, tmp_path):
  """`claims --settings text --text-workdir W` on one run (no seeds.json, as
  `mha-jax train` writes by default): one unit, judged by the rule, whose receivers' own
  verdicts are the per-head rule's."""
  wd, _ = tiny_attn_lm
  rep = claims_run.run_claims(str(tmp_path / "c"), only="induction_k_causal",
                              settings="text", text_workdir=wd, primer=False,
                              log=lambda s: None)
  (claim,) = rep["claims"]
  cell = claim["settings"]["text"]
  assert list(claim["settings"]) == ["text"] and cell["runs"] == 1
  assert cell["seeds"] == [None] and cell["numbers"]["workdir"] == wd
  unit = cell["per_seed"][0]
  assert unit["verdict"] == rules.induction_k_causal(unit["numbers"])
  assert cell["verdict"] == f"{unit['verdict']} in 1 of 1 seed"
  for r in unit["numbers"]["receivers"]:
    assert r["verdict"] == rules.induction_k_causal_one(r)
    assert r["path_k_effect"] == r["layer_row"][r["previous_token_head"]]
  assert rep["workdirs"]["text"] == wd
