"""MIB's tasks generated offline: aligned tokens, a counterfactual that flips the
answer, and MIB's metric, checked by re-reading each prompt."""

import re

import numpy as np
import pytest

from mha_jax.circuits import circuit_behaviours, mib_tasks
from mha_jax.toolkit import pairs as pairs_lib


class WordTokenizer:
  """Words with their leading space, single digits, single other characters."""

  def __init__(self):
    self.ids = {}

  def encode(self, text):
    return [self.ids.setdefault(p, len(self.ids) + 1)
            for p in re.findall(r" ?[A-Za-z]+| ?\d|\s|[^\sA-Za-z\d]", text)]


class FakeTask:
  vocab_size = 1000
  adds_bos = True
  bos_id = 0

  def __init__(self):
    self.tokenizer = WordTokenizer()


def first(task, text):
  return task.tokenizer.encode(text)[0]


def answer_of(name, prompt):
  """The answer a prompt asks for, read from the prompt (MIB's label string)."""
  if name == "mib-ioi":
    m = re.search(r"(\w+) and (\w+) (?:went|got|were)", prompt)
    s2 = re.search(r"[.,] (\w+) (?:gave|decided)", prompt).group(1)
    return " " + ({m.group(1), m.group(2)} - {s2}).pop()
  if name == "mib-mcqa":
    color = re.search(r" are (\w+)\. What", prompt).group(1)
    return re.search(rf"\n(\w)\. {color}\n", prompt + "\n").group(1)
  a, op, b = re.fullmatch(r"(\d+)([+-])(\d+)=", prompt).groups()
  return str(int(a) + int(b) if op == "+" else int(a) - int(b))


@pytest.mark.parametrize("name", mib_tasks.TASKS)
def test_mib_pairs_align_and_the_counterfactual_flips_the_answer(name):
  task = FakeTask()
  pairs = mib_tasks.make(task, name, 6, seed=1)
  assert len(pairs) == 6
  for i, t in enumerate(pairs.text):
    ci, xi = pairs_lib.encode(task, t["clean"]), pairs_lib.encode(task, t["corrupt"])
    assert len(ci) == len(xi) == pairs.length[i]
    assert list(pairs.clean[i, :len(ci)]) == ci and list(pairs.corrupt[i, :len(xi)]) == xi
    assert t["clean"] != t["corrupt"]
    a, w = answer_of(name, t["clean"]), answer_of(name, t["corrupt"])
    assert pairs.answer[i] == first(task, a) and pairs.wrong[i] == first(task, w)
    assert pairs.answer[i] != pairs.wrong[i], t
  if name.startswith("mib-arithmetic"):
    assert all(re.fullmatch(r"\d\d[+-]\d\d=", t["clean"]) for t in pairs.text)


def test_mib_tasks_are_circuit_behaviours_with_mib_s_logit_difference():
  class Loaded:
    task = FakeTask()
  pairs, spec = circuit_behaviours.make(Loaded(), "mib-mcqa", None, 4, 0)
  assert spec == "logit_diff" and "mib-ioi" in circuit_behaviours.BEHAVIOURS
  logits = np.random.default_rng(0).normal(size=(len(pairs), 50))
  rows = np.arange(len(pairs))
  want = logits[rows, pairs.answer] - logits[rows, pairs.wrong]   # MIB's logit_diff
  got = np.asarray(circuit_behaviours.metric_of(pairs, spec)(logits))
  np.testing.assert_allclose(got, want, rtol=1e-6)
