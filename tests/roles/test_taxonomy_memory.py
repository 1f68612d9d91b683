"""The taxonomy's memory plan (roles.head_taxonomy.plan): rows per batch of each causal
check and each detector chosen from the shapes and a budget, its bytes within the budget,
the same behaviour values and scores at any batching, and a budget below one row refused
with the minimum."""

import types

import numpy as np
import pytest

from mha_jax.roles import detectors, head_taxonomy as taxonomy
from mha_jax.errors import UserError
from mha_jax.toolkit import memory
from oracles import D, G, H, K, L, LlamaTask, tiny_llama_pairs


class NoBosTask(LlamaTask):
  bos_id = -1           # the tiny LLaMA has no BOS (detectors.bos_of)


@pytest.fixture(scope="module")
def run_inputs():
  params, pairs = tiny_llama_pairs(slice(1, 3), [7, 6, 7])
  rng = np.random.default_rng(0)
  rep = rng.integers(1, 37, (5, 9)).astype(np.int32)
  mask = np.zeros((5, 8), np.float32)
  mask[:, 4:] = 1.0
  text = rng.integers(1, 37, (3, 7)).astype(np.int32)
  run = types.SimpleNamespace(task=NoBosTask(), params=params)
  return run, {"repeat": (rep, mask), "text": text, "ioi": pairs}


def row_bytes(t: int, positions: int, kept: int = 0) -> int:
  """One row's forward, from the tiny LLaMA's sizes (memory.layer_bytes, forward_bytes)."""
  layer = 16 * t * D + 4 * t * (2 * H + 2 * G) * K + 8 * H * t * t + 3 * 4 * t * 24
  return layer + 8 * positions * 37 + kept


def test_the_plan_is_each_check_s_rows_within_the_budget(run_inputs):
  run, inputs = run_inputs
  sh = taxonomy.model_shapes(run, 8)
  assert (sh.layers, sh.heads, sh.kv_heads, sh.head_dim, sh.d_model, sh.d_mlp, sh.vocab) == \
      (L, H, G, K, D, 24, 37)
  want = {"repeat_loss": (5, row_bytes(8, 8)), "text_loss": (3, row_bytes(6, 6)),
          "context_logit": (3, row_bytes(6, 6, 4 * 36)), "ioi_logit_diff": (3, row_bytes(7, 1))}
  for budget in (10**5, 2 * 10**5, 10**9):
    got = taxonomy.plan(run, inputs, budget)
    assert set(got) == set(want) | {"attention_sink", "copy_suppression"}
    for name, (rows, one) in want.items():
      r = got[name].rows_per_batch
      assert got[name].bytes == r * one <= budget
      assert r == rows or (r + 1) * one > budget, name


@pytest.mark.slow  # default run: test_taxonomy.py's test_the_taxonomy_takes_a_memory_budget
def test_the_checks_are_the_same_at_any_batching(run_inputs):
  """At a budget of one row of the largest program (copy suppression's), each check runs
  its rows a few at a time (the last batch padded) and equals all rows at once."""
  run, inputs = run_inputs
  inputs = dict(inputs, text=np.concatenate([inputs["text"]] * 3))     # 9 windows
  settings = taxonomy.ClassifyOptions()
  full = taxonomy.behaviours(run, settings, inputs)
  one = max(p.bytes for p in taxonomy.plan(run, inputs, 10**9).values()) // 5
  need = {n: p.bytes // p.rows_per_batch for n, p in taxonomy.plan(run, inputs, 10**9).items()}
  budget = max(need.values())          # one row of the largest check: 1-2 rows of each
  small = taxonomy.behaviours(run, settings, inputs, budget)
  rows = {n: p.rows_per_batch for n, p in taxonomy.plan(run, inputs, budget).items()}
  assert rows["copy_suppression"] == 1 and one > 0
  assert rows["repeat_loss"] < 5 and rows["text_loss"] < 9 and rows["context_logit"] < 9
  assert 5 % rows["repeat_loss"] and 9 % rows["text_loss"]             # padded last batches
  edits = taxonomy.mean_edits(run.params, ["lm.1.2"], [np.zeros((H, K), np.float32)] * L)
  for name in ("repeat_loss", "text_loss", "context_logit", "ioi_logit_diff"):
    for e in ({}, edits):
      assert small[name](e) == pytest.approx(full[name](e), rel=1e-5, abs=1e-6), name


def test_a_budget_below_one_row_is_refused_by_name(run_inputs):
  run, inputs = run_inputs
  one = row_bytes(8, 8)
  with pytest.raises(UserError, match=f"memory_budget of {one - 1:,} bytes.*repeat_loss.*"
                                      f"at least {one:,} bytes"):
    taxonomy.plan(run, {"repeat": inputs["repeat"]}, one - 1)
  assert taxonomy.plan(run, {"repeat": inputs["repeat"]}, one)["repeat_loss"].bytes == one
  assert memory.rows_plan(taxonomy.model_shapes(run, 8), 5, one).rows_per_batch == 1


def test_the_detectors_plan_their_windows_within_the_budget(run_inputs):
  """attention_sink keeps every layer's float32 pattern, copy_suppression also every
  layer's head results and one layer's effects on the key and sample tokens,
  effective_embeddings a forward of [BOS, token] (the tiny LLaMA has no BOS: 1 + 1)."""
  run, inputs = run_inputs
  t = 6
  pat = 4 * L * H * t * t
  want = {"attention_sink": (3, row_bytes(t, t, pat)),
          "copy_suppression": (3, row_bytes(t, t, pat + 4 * L * t * H * D
                                            + 4 * H * t * (t + taxonomy.COPY_SAMPLE))),
          "effective_embeddings": (50, row_bytes(1, 1))}
  for budget in (2 * 10**5, 10**6, 10**9):
    got = taxonomy.plan(run, {"text": inputs["text"], "embeddings": 50}, budget)
    assert set(got) == set(want) | {"context_logit", "text_loss"}
    for name, (rows, one) in want.items():
      r = got[name].rows_per_batch
      assert got[name].bytes == r * one <= budget, name
      assert r == rows or (r + 1) * one > budget, name
  one = want["copy_suppression"][1]
  with pytest.raises(UserError, match=f"at least {one:,} bytes") as e:
    taxonomy.plan(run, {"text": inputs["text"]}, one - 1)
  assert e.value.settings == ("memory_budget",) and "copy_suppression" in str(e.value)


def test_the_detectors_are_the_same_one_window_at_a_time(run_inputs):
  """Forced to one row per batch (and two), the detectors' scores equal all rows at once."""
  run, inputs = run_inputs
  task, p, text = run.task, run.params, inputs["text"]
  sample = np.arange(1, 37)
  for rows in (1, 2):
    np.testing.assert_allclose(detectors.sink_scores(task, p, text, rows),
                               detectors.sink_scores(task, p, text), rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(detectors.copy_suppression_text(task, p, text, sample, rows),
                               detectors.copy_suppression_text(task, p, text, sample),
                               rtol=1e-5, atol=1e-6)
  each = detectors.copy_suppression_text(task, p, text, sample, per_window=True)
  assert each.shape == (len(text),) + detectors.sink_scores(task, p, text).shape
  for w in range(len(text)):        # per window: the window alone, through the one program
    np.testing.assert_allclose(each[w], detectors.copy_suppression_text(
        task, p, text[w:w + 1], sample), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(detectors.sink_scores(task, p, text, per_window=True)[w],
                               detectors.sink_scores(task, p, text[w:w + 1]), rtol=1e-6)
  ids = np.arange(1, 12)
  np.testing.assert_allclose(detectors.effective_embeddings(task, p, ids, 4),
                             detectors.effective_embeddings(task, p, ids), rtol=1e-6, atol=1e-7)
