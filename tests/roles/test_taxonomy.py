"""`mha-jax taxonomy` (roles.taxonomy) through `mha_jax.cli.main` on conftest's tiny
induction run: the previous-token scores it writes against their recomputation by hand
from the run's attention, the assignment against the thresholds, and the refusal of a
run that is not a decoder LM."""

import json
import os

import numpy as np
import pytest

import mha_jax
from builders import QUIET
from mha_jax import cli
from mha_jax.errors import UserError
from mha_jax.roles import head_roles, taxonomy
from mha_jax.toolkit import capture

# On the worker that trains conftest's ind_run (setup.cfg: --dist loadgroup).
pytestmark = pytest.mark.xdist_group("trained_runs")


def previous_token_by_hand(wd: str) -> dict[str, float]:
  """Each head's mean weight on key t - 1 (queries 1..) over the repeated random tokens
  the taxonomy reads (2 batches of 8, seeds 7_000_003 and + 1, BOS + 2 x half_len)."""
  run = mha_jax.load(wd, **QUIET)
  half = head_roles.repeat_half_len(run)
  per_batch = []
  for i in range(2):
    tok, _ = run.task.repeated_tokens(7_000_003 + i, 8, half)
    cap = capture.captured(run.task, run.params, {"tokens": tok})
    per_batch.append({f"lm.{l}.{h}": np.mean([w[b, h, t, t - 1] for b in range(w.shape[0])
                                              for t in range(1, w.shape[2])])
                      for l, r in enumerate(cap["lm"])
                      for w in [np.asarray(r.weights, np.float64)] for h in range(w.shape[1])})
  return {name: float(np.mean([b[name] for b in per_batch])) for name in per_batch[0]}


def test_the_taxonomy_verb_writes_scores_equal_to_their_recomputation(ind_run, tmp_path,
                                                                      capsys):
  out = str(tmp_path / "tax")
  rc = cli.main(["taxonomy", "--workdir", ind_run, "--out", out,
                 "--roles", "previous_token,attention_sink", "--no-causal",
                 "--bootstrap-windows", "3", "--bootstrap-draws", "200"])
  assert rc == 0, capsys.readouterr()
  doc = json.load(open(os.path.join(out, "roles.json")))
  assert os.path.getsize(os.path.join(out, "taxonomy.png")) > 1000
  assert doc["roles"] == ["previous_token", "attention_sink"] and "causal" not in doc
  assert doc["workdir"] == ind_run
  hand = previous_token_by_hand(ind_run)
  assert doc["lm_roles"]["previous_token"] == pytest.approx(hand, abs=1e-5)
  th = doc["thresholds"]
  boot = doc["bootstrap"]["roles"]["attention_sink"]        # the sink by its interval
  assert list(boot) == ["threshold", "heads", "qualifies", "qualifies_point"]
  assert len(doc["bootstrap"]["windows"]) == 3 and doc["bootstrap"]["level"] == 0.9
  for head, v in boot["heads"].items():
    assert v["point"] == doc["lm_roles"]["attention_sink"][head]
    assert v["lo"] <= v["mean"] <= v["hi"] and v["stable"] == (v["lo"] >= th["attention_sink"])
  assert doc["qualifies"]["attention_sink"] == [h for h, v in boot["heads"].items()
                                                if v["stable"]]
  assert boot["qualifies_point"] == [h for h, v in doc["lm_roles"]["attention_sink"].items()
                                     if v >= th["attention_sink"]]
  for head, role in doc["assigned"].items():     # a head's role is one it qualifies for
    if role == "attention_sink":
      assert boot["heads"][head]["stable"]
    elif role != "other":
      assert doc["lm_roles"][role][head] >= th[role]
  assert sorted(doc["qualifies"]["previous_token"]) == sorted(
      h for h, v in hand.items() if v >= th["previous_token"])
  assert "wrote" in capsys.readouterr().out


def test_the_taxonomy_refuses_a_run_that_is_not_a_decoder_lm(parallel_run):
  loaded = mha_jax.load(parallel_run[0], **QUIET)
  with pytest.raises(UserError, match="taxonomy needs a decoder LM"):
    taxonomy.taxonomy(loaded, None, taxonomy.TaxonomyOptions(roles=("previous_token",)))


def test_the_taxonomy_takes_a_memory_budget(ind_run, tmp_path, capsys):
  """--memory-budget: the detectors' rows per batch come from it (roles.json's
  "memory_budget"); at one window per batch the scores equal all windows at once; a
  budget below one window is refused by name with the minimum."""
  args = ["taxonomy", "--workdir", ind_run, "--roles", "attention_sink,copy_suppression",
          "--no-causal"]
  assert cli.main(args + ["--out", str(tmp_path / "a"), "--memory-budget", "1GB"]) == 0
  a = json.load(open(tmp_path / "a" / "roles.json"))
  sink = a["memory_budget"]["plan"]["attention_sink"]
  windows = sink["rows_per_batch"]
  assert a["memory_budget"]["bytes"] == 10**9 and windows >= 2
  one = max(a["memory_budget"]["plan"][k]["bytes"] // windows
            for k in ("attention_sink", "copy_suppression"))
  assert cli.main(args + ["--out", str(tmp_path / "b"), "--memory-budget", str(one)]) == 0
  b = json.load(open(tmp_path / "b" / "roles.json"))
  assert b["memory_budget"]["plan"]["copy_suppression"]["rows_per_batch"] == 1
  for role in ("attention_sink", "copy_suppression"):
    assert b["lm_roles"][role].keys() == a["lm_roles"][role].keys()
    assert b["lm_roles"][role] == pytest.approx(a["lm_roles"][role], abs=1e-5), role
  capsys.readouterr()
  assert cli.main(args + ["--out", str(tmp_path / "c"), "--memory-budget", "1KB"]) == 2
  err = capsys.readouterr().err
  assert "memory-budget of 1,000 bytes" in err and "needs at least" in err, err
  assert not (tmp_path / "c").exists()


def test_the_pattern_roles_are_the_same_a_few_sequences_at_a_time(ind_run):
  """real_lm_roles with a budget of one captured sequence of its larger input (capture.plan)
  gives the same rows as every sequence at once."""
  run = mha_jax.load(ind_run, **QUIET)
  tok, _ = run.task.repeated_tokens(7_000_003, 8, head_roles.repeat_half_len(run))
  text, _ = next(iter(run.task.eval_batches("test", run.config.eval.batch_size)))
  one = max(capture.plan(run.task, run.params, b, 10**12).bytes // len(b["tokens"])
            for b in ({"tokens": tok}, {"tokens": np.asarray(text["tokens"])}))
  assert capture.plan(run.task, run.params, {"tokens": tok}, one).rows_per_batch < 8
  half = head_roles.repeat_half_len(run)
  want = head_roles.real_lm_roles(run, half_len=half)
  got = head_roles.real_lm_roles(run, half_len=half, memory_budget=one)
  assert [r["head"] for r in got] == [r["head"] for r in want]
  for a, b in zip(got, want):
    for k in ("previous_token", "induction", "duplicate_token", "sink_share", "entropy"):
      assert a[k] == pytest.approx(b[k], abs=1e-6), (a["head"], k)
