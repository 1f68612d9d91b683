"""compare-runs on a two-run sweep (the shared tiny LM as softmax_h4 plus a gated twin
trained two steps): every tabled value equals the study it reuses, called directly; the
variants' claim rules flip at their boundaries; the variants setting pairs its runs."""

import collections
import functools
import json
import os
import shutil

import numpy as np
import pytest

from mha_jax import cli
from mha_jax import compare_runs as compare_runs_lib
from mha_jax import settings
from mha_jax.harness.claims import rules
from mha_jax.harness.claims import variants as variant_claims
from mha_jax.errors import UserError

H, F, I = rules.HOLDS, rules.FAILS, rules.INCONCLUSIVE
CHEAP = compare_runs_lib.CompareOptions(prune_steps=3, windows=4, composition_samples=4)


@pytest.fixture(scope="module")
def sweep(tiny_attn_lm, tmp_path_factory):
  """A sweep workdir of two points: softmax_h4 (the shared tiny LM) and gated_h4."""
  from mha_jax.train import loop
  wd, cfg = tiny_attn_lm
  d = str(tmp_path_factory.mktemp("variant_sweep"))
  heads = cfg.model.num_heads
  shutil.copytree(wd, os.path.join(d, f"softmax_h{heads}"))
  gated = cfg.copy_and_resolve_references()
  gated.model.attention = "gated"
  loop.train(gated, os.path.join(d, f"gated_h{heads}"), log=lambda s: None)
  return d, heads


@pytest.mark.slow
def test_compare_runs_tables_the_studies_values(sweep, tmp_path):
  from mha_jax.roles import behaviour
  from mha_jax.circuits import induction_circuits as circuits
  from mha_jax.loader import load
  from mha_jax.pruning import methods
  from mha_jax import tasks
  from mha_jax.toolkit import head_masks
  from mha_jax.roles import head_roles
  d, heads = sweep
  out = str(tmp_path / "cmp")
  load = functools.cache(load)             # the direct calls reuse the runs' compilations
  res = compare_runs_lib.compare_runs([d], out, CHEAP, log=lambda s: None, load_fn=load)
  rows = {r["variant"]: r for r in res["rows"]}
  assert set(rows) == {"softmax", "gated"} and all(r["heads"] == heads for r in rows.values())
  for variant, row in rows.items():
    loaded = load(os.path.join(d, f"{variant}_h{heads}"))
    assert row["loss"] == pytest.approx(loaded.task.evaluate(loaded.params, "test")["loss"], rel=1e-6)
    text = head_roles.sink_and_entropy(loaded, "test", windows=CHEAP.windows)
    share = np.mean(np.concatenate([t["sink_share"] for t in text.values()]))
    ent = np.mean(np.concatenate([t["entropy"] for t in text.values()]))
    assert row["first_token_share"] == pytest.approx(share, rel=1e-6)
    assert row["entropy"] == pytest.approx(ent, rel=1e-6)
    assert 0 < row["first_token_share"] < 1
    roles = head_roles.role_of(head_roles.head_roles(loaded, "test"))
    assert row["roles"] == dict(collections.Counter(roles.values()))
    tokens, lengths = behaviour.eval_tokens(loaded)
    scores = circuits.circuit_scores(loaded, tokens, samples=CHEAP.composition_samples,
                                     log=lambda s: None)
    assert row["induction_heads"] == [r["head"] for r in scores["induction_heads"]]
    assert row["k_composition_max"] == pytest.approx(max(scores["composition"]["k"].values()))
    steps = circuits.over_checkpoints(loaded, tokens, lengths, lambda s: None)
    assert [r["step"] for r in row["over_steps"]] == [r["step"] for r in steps]
    assert row["phase_change_step"] == compare_runs_lib.phase_change_step(steps, CHEAP.phase_threshold)
    # the pruning: the same gates, the fewest heads within the tolerance
    la, _, _ = methods.train_gates(loaded, CHEAP.prune_lambda, stacks=("lm",),
                                   steps=CHEAP.prune_steps, log=lambda s: None)
    k = row["heads_kept"]
    loss_k = loaded.task.evaluate(loaded.params, "test", hook=tasks.gates_hook(
        loaded.task, head_masks.full_head_gates(loaded.params, methods.top_k_mask(la, k))))["loss"]
    assert row["pruning"]["by_k"][k] == pytest.approx(loss_k, rel=1e-6)
    assert row["heads_total"] == 2 * heads
    assert all(v > row["loss"] + CHEAP.loss_tolerance
               for kk, v in row["pruning"]["by_k"].items() if kk < k)
    assert loss_k <= row["loss"] + CHEAP.loss_tolerance or k == row["heads_total"]
  seen = []                                # a rerun reuses each run's row
  again = compare_runs_lib.compare_runs([d], out, CHEAP, log=seen.append, load_fn=load)
  assert sum("measured already" in m for m in seen) == 2
  assert [r["loss"] for r in again["rows"]] == [r["loss"] for r in res["rows"]]
  with open(os.path.join(out, "compare.json")) as f:
    saved = json.load(f)
  assert saved["machine"]["date"] and saved["machine"]["cpu_count"] == os.cpu_count()
  assert len(saved["rows"]) == 2
  md = open(os.path.join(out, "compare.md")).read()
  assert md.count("\n| gated |") == 1 and md.count("\n| softmax |") == 1
  assert os.path.getsize(os.path.join(out, "compare.png")) > 0


def test_compare_runs_cli_and_bad_input(sweep, tmp_path):
  d, _ = sweep
  with pytest.raises(UserError, match="phase_threshold must be in"):
    settings.check(compare_runs_lib.CompareOptions(phase_threshold=1.5))
  with pytest.raises(UserError, match="prune_steps must be >= 1; got 0"):
    settings.check(compare_runs_lib.CompareOptions(prune_steps=0))
  with pytest.raises(UserError, match="holds no run"):
    compare_runs_lib.expand([str(tmp_path)])
  assert [n for n, _, _ in compare_runs_lib.expand([d])] == sorted(os.listdir(d))


def test_phase_change_step():
  row = lambda step, pm: {"step": step, "max_prefix_matching": pm}
  rows = [row(50, 0.1), row(100, 0.3), row(150, 0.2), row(200, 0.4), row(250, 0.5)]
  assert compare_runs_lib.phase_change_step(rows, 0.3) == 200          # stays from 200 on; 100 was a blip
  assert compare_runs_lib.phase_change_step(rows, 0.5) == 250
  assert compare_runs_lib.phase_change_step(rows, 0.51) is None
  assert compare_runs_lib.phase_change_step(rows[:3], 0.3) is None     # a transient is no phase change
  assert compare_runs_lib.phase_change_step([row(5, None)], 0.1) is None


def _pair(variant, share, soft=0.5, uniform=0.06, **more):
  return {"h": 4, "softmax_first_token_share": soft, f"{variant}_first_token_share": share,
          "uniform_share": uniform, **more}


def test_gating_rule_boundaries():
  assert rules.gating_removes_sink(_pair("gated", 0.1)) == H          # exactly 5-fold
  assert rules.gating_removes_sink(_pair("gated", 0.1001)) == F
  assert rules.gating_removes_sink(_pair("gated", 0.01, soft=0.119)) == I   # < 2 x 0.06: no sink
  assert rules.gating_removes_sink(_pair("gated", 0.01, soft=0.12)) == H
  assert "0.2" in rules.why(rules.gating_removes_sink, _pair("gated", 0.2))


def test_differential_rule_boundaries():
  d = lambda eff, **kw: _pair("differential", 0.3,
                              differential_effective_first_token_share=eff, **kw)
  assert rules.differential_less_sink(d(0.25)) == H
  assert rules.differential_less_sink(d(0.26)) == I
  assert rules.differential_less_sink(d(0.5)) == F
  assert rules.differential_less_sink(d(0.0, soft=0.1)) == I


def test_sink_rule_boundaries():
  s = lambda share, weight, **kw: _pair("sink", share, sink_logit_weight=weight, **kw)
  assert rules.sink_takes_first_token(s(0.25, 0.25)) == H
  assert rules.sink_takes_first_token(s(0.26, 0.4)) == F              # the share did not halve
  assert rules.sink_takes_first_token(s(0.1, 0.24)) == F              # the logit took too little
  assert rules.sink_takes_first_token(s(0.0, 0.0, soft=0.1)) == I
  assert "sink logit takes 0.24" in rules.why(rules.sink_takes_first_token, s(0.1, 0.24))


def test_uniform_share():
  assert variant_claims.uniform_first_token_share(3) == pytest.approx((1 / 2 + 1 / 3) / 2)


def test_variants_setting_pairs_runs(sweep, tmp_path):
  d, heads = sweep
  ctx = type("Ctx", (), {"variants_workdir": d})()
  (seed, unit), = variant_claims.variant_runs(ctx, "variants")
  assert seed is None and unit["h"] == heads
  assert unit["gated"].endswith(f"gated_h{heads}")
  with pytest.raises(UserError, match="no softmax_hH point"):
    variant_claims.variant_runs(type("Ctx", (), {"variants_workdir": str(tmp_path)})(), "variants")


@pytest.mark.slow
def test_claims_cli_variants_setting(sweep, tmp_path):
  d, heads = sweep
  out = str(tmp_path / "claims")
  assert cli.main(["claims", "--only", "gating_removes_sink", "--settings", "variants",
                   "--variants-workdir", d, "--out", out]) == 0
  with open(os.path.join(out, "claims.json")) as f:
    cell = json.load(f)["claims"][0]["settings"]["variants"]
  n = cell["numbers"]
  rows = {v: variant_claims.attention_facts(type("Ctx", (), {"cache": {}})(), os.path.join(d, f"{v}_h{heads}"))
          for v in ("softmax", "gated")}
  assert n["softmax_first_token_share"] == pytest.approx(rows["softmax"]["first_token_share"])
  assert n["gated_first_token_share"] == pytest.approx(rows["gated"]["first_token_share"])
  assert cell["per_seed"][0]["verdict"] == rules.gating_removes_sink(n)
