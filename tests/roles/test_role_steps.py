"""The step at which each head role appears (roles.role_steps) on conftest's tiny
induction run (checkpoints at steps 4 and 8): each step's scores against the scores
recomputed by hand from that checkpoint's attention, the appearance step against its
recomputation from them, and the one checkpoint walker (loader.each_checkpoint)."""

import jax
import numpy as np
import pytest

import mha_jax
from builders import QUIET
from mha_jax.roles import role_steps
from mha_jax.errors import UserError
from mha_jax.loader import each_checkpoint
from mha_jax.machine import machine
from mha_jax.toolkit import capture, stability

# On the worker that trains conftest's ind_run (setup.cfg: --dist loadgroup).
pytestmark = pytest.mark.xdist_group("trained_runs")


def test_appears_at_is_the_first_step_from_which_the_score_stays_above():
  rows = [(100, 0.1), (200, 0.5), (300, 0.3), (400, 0.6), (500, 0.7)]
  assert stability.appears_at(rows, 0.5) == 400          # 200 was a blip
  assert stability.appears_at(rows, 0.1) == 100
  assert stability.appears_at(rows, 0.65) == 500
  assert stability.appears_at(rows, 0.71) is None
  assert stability.appears_at(rows[:3], 0.5) is None     # a transient is no appearance
  assert stability.appears_at([(1, 0.9), (2, None)], 0.5) is None


def _by_hand(wd, step):
  """previous-token and sink scores of every head at `step`, from its attention: the mean
  weight on key t-1 (queries 1..) over the repeated tokens role_steps reads (8 + 8 rows,
  seeds 7_000_003 and +1, 6 + 6 + BOS), and on key 0 (queries 1..) over the taxonomy's
  two text windows (the first rows of the test split's first evaluation batch)."""
  run = mha_jax.load(wd, step=step, **QUIET)
  prev = []
  for i in range(2):
    tok, _ = run.task.repeated_tokens(7_000_003 + i, 8, 6)
    cap = capture.captured(run.task, run.params, {"tokens": tok})
    prev.append([np.asarray(r.weights, np.float64) for r in cap["lm"]])
  batch, _ = next(iter(run.task.eval_batches("test", 2)))
  text = np.asarray(batch["tokens"])[:2, :129]
  cap = capture.captured(run.task, run.params, {"tokens": text})
  out = {"previous_token": {}, "attention_sink": {}}
  for layer, r in enumerate(cap["lm"]):
    w_sink = np.asarray(r.weights, np.float64)
    for h in range(w_sink.shape[1]):
      name = f"lm.{layer}.{h}"
      per = [np.mean([w[layer][b, h, t, t - 1] for b in range(8)
                      for t in range(1, w[layer].shape[2])]) for w in prev]
      out["previous_token"][name] = float(np.mean(per))
      out["attention_sink"][name] = float(w_sink[:, h, 1:, 0].mean())
  return out


def test_each_steps_scores_and_the_appearance_step_equal_their_recomputation(
    ind_run, tmp_path, monkeypatch):
  loaded = mha_jax.load(ind_run, **QUIET)
  opts = role_steps.RoleStepsOptions(roles=("previous_token", "induction",
                                            "attention_sink"), causal=False)
  doc = role_steps.role_steps(loaded, str(tmp_path / "out"), opts, log=lambda s: None)
  assert doc["steps"] == [4, 8]
  for row in doc["by_step"]:
    hand = _by_hand(ind_run, row["step"])
    for role, table in hand.items():
      assert row["scores"][role] == pytest.approx(table, abs=1e-5), (row["step"], role)
      best = max(table, key=table.get)
      assert row["best"][role]["head"] == best
      assert row["best"][role]["score"] == pytest.approx(table[best], abs=1e-5)
      assert row["qualifying"][role] == sum(v >= doc["thresholds"][role]
                                            for v in row["scores"][role].values())
  def by_hand(role, th):
    s4, s8 = (r["best"][role]["score"] for r in doc["by_step"])
    return 4 if s4 >= th and s8 >= th else 8 if s8 >= th else None

  for role, th in doc["thresholds"].items():
    assert doc["appears_at"][role] == by_hand(role, th), role
    # thresholds at, between and above the two steps' best scores (this tiny run's
    # scores sit below the taxonomy's own thresholds)
    s = sorted(r["best"][role]["score"] for r in doc["by_step"])
    for t in (s[0], (s[0] + s[1]) / 2, s[1] + 1e-3):
      assert role_steps.appearance(doc["by_step"], {role: t})[role] == by_hand(role, t)
    assert role_steps.appearance(doc["by_step"], {role: s[0]})[role] == 4
  saved = mha_jax.storage.read_json(str(tmp_path / "out" / "role_steps.json"))
  assert saved["appears_at"] == doc["appears_at"]
  assert saved["machine"].keys() == machine().keys()   # the one record
  assert (tmp_path / "out" / "role_steps.png").exists()
  # A rerun into the same folder reuses the rows it has (a training followed as it runs).
  monkeypatch.setattr(role_steps, "step_scores", lambda *a, **k: pytest.fail("rescored"))
  again = role_steps.role_steps(loaded, str(tmp_path / "out"), opts, log=lambda s: None)
  assert again["by_step"] == saved["by_step"] and again["appears_at"] == doc["appears_at"]


def test_the_walker_and_the_check_steps_are_checked_by_name(ind_run, tmp_path):
  loaded = mha_jax.load(ind_run, **QUIET)
  assert [a.step for a in each_checkpoint(loaded)] == [4, 8]
  at4 = next(iter(each_checkpoint(loaded, [4])))
  direct = mha_jax.load(ind_run, step=4, **QUIET).params
  for a, b in zip(jax.tree.leaves(at4.params), jax.tree.leaves(direct)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert at4.task is loaded.task                           # nothing rebuilt per step
  with pytest.raises(UserError, match="steps: 5 is not a saved step"):
    list(each_checkpoint(loaded, [4, 5]))
  with pytest.raises(UserError, match="check_steps: 4 is not a scored step"):
    role_steps.role_steps(loaded, str(tmp_path / "o"), role_steps.RoleStepsOptions(
        roles=("attention_sink",), steps=(8,), check_steps=(4,)), log=lambda s: None)
  assert role_steps.default_check_steps([100, 200, 300, 400], {"induction": 200}) == \
      [100, 200, 300, 400]
  assert role_steps.default_check_steps([100, 200, 300, 400], {"induction": None}) == [400]
  assert role_steps.default_check_steps([100, 200, 300], {"induction": 100}) == [100, 200, 300]


def test_the_causal_checks_reuse_the_steps_scores(ind_run, tmp_path, monkeypatch):
  loaded = mha_jax.load(ind_run, **QUIET)
  calls, score = [], role_steps.step_scores
  monkeypatch.setattr(role_steps, "step_scores",
                      lambda at, *a, **k: calls.append(at.step) or score(at, *a, **k))
  doc = role_steps.role_steps(loaded, str(tmp_path / "o"), role_steps.RoleStepsOptions(
      roles=("attention_sink",), check_steps=(8,), top_k=1, draws=1), log=lambda s: None)
  assert calls == [4, 8]                       # each step scored once, the check included
  check = doc["causal"][0]
  assert check["step"] == 8 and check["checks"]["attention_sink"]["top"] == [
      doc["by_step"][1]["best"]["attention_sink"]["head"]]
