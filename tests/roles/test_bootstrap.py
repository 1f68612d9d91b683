"""The text roles' bootstrap over windows (roles.bootstrap) on test_head_taxonomy's planted
tiny LLaMA (layer 1's head 1 suppresses copies, head 2 is a sink): the planted heads
qualify on every window and no other head does, the mean over windows equals the
detector on all windows at once, and the interval of a two-window score is the one
worked out by hand."""

import numpy as np
import pytest

from mha_jax.errors import UserError
from mha_jax.roles import bootstrap, detectors
from test_head_taxonomy import Task, planted, text

TH = {"copy_suppression": 1.0, "attention_sink": 0.8}


class TextTask(Task):
  """The planted task with a test split of 6 text windows, served in batches."""
  rows = text(5, b=6, t=10)

  def eval_batches(self, split, batch_size):
    for i in range(0, len(self.rows), 4):
      b = self.rows[i:i + 4]
      yield {"tokens": np.pad(b, ((0, 4 - len(b)), (0, 0)))}, np.arange(4) < len(b)


def test_planted_heads_are_stable_and_the_mean_is_the_batched_detector():
  task, p = TextTask(), planted()
  heads = [f"lm.{l}.{h}" for l in range(2) for h in range(3)]
  sample = np.arange(1, 12)
  ov = detectors.ov_self_scores(p, detectors.effective_embeddings(task, p, range(1, 12)), sample)
  ov_self = {h: float(ov[int(h[3]), int(h[5])]) for h in heads}
  point = {r: {h: 0.0 for h in heads} for r in TH}
  got = bootstrap.stability(task, p, heads, TH, point, ov_self, sample, n=4, text_len=8,
                            draws=500)
  assert got["windows"] == [0, 1, 3, 5] and got["windows_in_split"] == 6
  assert got["roles"]["attention_sink"]["qualifies"] == ["lm.1.2"]
  assert got["roles"]["copy_suppression"]["qualifies"] == ["lm.1.1"]
  whole = detectors.sink_scores(task, p, TextTask.rows[[0, 1, 3, 5], :9])
  for h, v in got["roles"]["attention_sink"]["heads"].items():
    assert v["mean"] == pytest.approx(float(whole[int(h[3]), int(h[5])]), abs=1e-5)
    assert v["lo"] <= v["mean"] <= v["hi"] and v["point"] == 0.0
    assert v["stable"] == (v["lo"] >= TH["attention_sink"])


def test_the_interval_of_two_windows_is_worked_out_by_hand():
  # scores 0 and 1 on two windows: resampled means 0, 0.5, 1 with chances 1/4, 1/2, 1/4
  x = np.asarray([0.0, 1.0]).reshape(2, 1, 1)
  mean, lo, hi = bootstrap.intervals(x, draws=20000, level=0.9, seed=1)
  assert (mean[0, 0], lo[0, 0], hi[0, 0]) == (0.5, 0.0, 1.0)
  _, lo, hi = bootstrap.intervals(x, draws=20000, level=0.4, seed=1)   # 30 % and 70 %
  assert (lo[0, 0], hi[0, 0]) == (0.5, 0.5)
  with pytest.raises(UserError, match="bootstrap_level"):
    bootstrap.intervals(x, 10, 1.0, 0)
  with pytest.raises(UserError, match="bootstrap_windows"):
    bootstrap.spread_windows(TextTask(), 0, 8)
