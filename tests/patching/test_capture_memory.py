"""capture's memory plan (toolkit/capture.plan): sequences per captured batch from the
capture's shapes and a budget, its bytes within the budget, the same captures at any
batching, and a budget below one sequence refused with the minimum."""

import numpy as np
import pytest

import mha_jax
from mha_jax.errors import UserError
from mha_jax.toolkit import capture


@pytest.fixture(scope="module")
def lm(tiny_attn_lm):
  wd, cfg = tiny_attn_lm
  return mha_jax.load(wd), cfg


def test_the_plan_fits_and_is_the_most_that_fits(lm):
  loaded, cfg = lm
  batch, _ = next(iter(loaded.task.eval_batches("valid", 4)))
  t = int(np.shape(batch["tokens"])[1]) - 1
  one = capture.plan(loaded.task, loaded.params, batch, 10**12).bytes // 4
  for budget in (one, 3 * one - 1, 3 * one, 10**9):
    p = capture.plan(loaded.task, loaded.params, batch, budget)
    assert p.bytes <= budget and p.bytes == p.rows_per_batch * one
    assert p.rows_per_batch == 4 or (p.rows_per_batch + 1) * one > budget
  assert capture.plan(loaded.task, loaded.params, batch, 3 * one).rows_per_batch == 3
  # one sequence's bytes from the config alone
  m = cfg.model
  d, h, v = m.d_model, m.num_heads, loaded.task.vocab_size
  k = d // h
  kept = 4 * 2 * (h * t * t + t * h * k + t * d)
  layer = 16 * t * d + 4 * t * 4 * h * k + 8 * h * t * t + 3 * 4 * t * 4 * d
  assert one == kept + layer + 8 * t * v


def test_captures_are_the_same_at_any_batching(lm):
  loaded, _ = lm
  batch, _ = next(iter(loaded.task.eval_batches("valid", 4)))
  one = capture.plan(loaded.task, loaded.params, batch, 10**12).bytes // 4
  full = capture.capture(loaded, batch_size=4, limit=4, keep_full=True)
  small = capture.capture(loaded, batch_size=4, limit=4, keep_full=True, memory_budget=one)
  assert len(small) == len(full) == 1
  for i in range(2):
    want, got = full[0][1]["lm"][i], small[0][1]["lm"][i]
    assert got.weights.shape == want.weights.shape and got.weights.shape[0] == 4
    for f in ("weights", "heads", "out"):
      np.testing.assert_allclose(getattr(got, f), getattr(want, f), atol=1e-5, rtol=1e-5)


def test_a_budget_below_one_sequence_is_refused_by_name(lm):
  loaded, _ = lm
  batch, _ = next(iter(loaded.task.eval_batches("valid", 4)))
  one = capture.plan(loaded.task, loaded.params, batch, 10**12).bytes // 4
  with pytest.raises(UserError, match=f"memory_budget of {one - 1:,} bytes.*one captured "
                                      f"sequence.*at least {one:,} bytes") as e:
    capture.capture(loaded, batch_size=4, limit=4, memory_budget=one - 1)
  assert e.value.settings == ("memory_budget",)
