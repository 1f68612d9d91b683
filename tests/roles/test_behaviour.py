"""roles/behaviour.py's copying score, worked out by hand."""

import numpy as np
import pytest

from mha_jax.roles import behaviour


def test_copying_is_the_attended_token_s_logit_over_the_mean_where_the_head_reads_a_token():
  """Queries 2 and 3 attend to tokens 1 and 2: (2 - 2/3) and (-1 - 0), mean 1/6. Query 1
  rests on BOS (key 0) and writes against its logit (-5): not copying, left out (with it
  the score would be negative); query 0 is always left out."""
  u = np.asarray([[1.0, 0.0, -1.0], [0.0, 2.0, 0.0]])                 # (D 2, V 3)
  tokens = np.asarray([[0, 1, 2, 1]])
  keys = [0, 0, 1, 2]                                                  # most-attended key
  weights = np.eye(4)[keys][None] * 0.7 + 0.1                          # (1, T, S)
  write = np.asarray([[[3.0, 3.0], [-5.0, 0.0], [0.0, 1.0], [1.0, 0.0]]])
  assert behaviour.copying(write, weights, tokens, u) == pytest.approx(1 / 6)
  resting = np.eye(4)[[0, 0, 0, 0]][None]
  assert behaviour.copying(write, resting, tokens, u) == 0.0
