"""toolkit/stability.py: statistics over seeds and the pruning curve's table across
seeds, against values written out here."""

import numpy as np
import pytest

from mha_jax.toolkit import stability


def test_stats_over_seeds():
  got = stability.stats([1.0, 2.0, 4.0])
  assert got["mean"] == pytest.approx(7 / 3)
  assert got["std"] == pytest.approx(np.sqrt(((1 - 7 / 3) ** 2 + (2 - 7 / 3) ** 2
                                              + (4 - 7 / 3) ** 2) / 2))
  assert (got["min"], got["max"]) == (1.0, 4.0)
  assert stability.stats([5.0])["std"] == 0.0


def test_curve_stability_tables_each_method_and_count_across_seeds():
  curves = {0: {"rows": [{"method": "random", "kept": 4, "bleu": 10.0, "roles": {"a": 2}},
                         {"method": "random", "kept": 2, "bleu": 6.0}]},
            1: {"rows": [{"method": "random", "kept": 4, "bleu": 14.0, "roles": {"a": 1}}]}}
  rep = stability.curve_stability(curves, "bleu")
  assert rep["seeds"] == [0, 1] and rep["n_seeds"] == 2 and rep["metric"] == "bleu"
  four, two = rep["rows"]                 # the most heads kept first
  assert (four["kept"], four["n"], four["values"]) == (4, 2, [10.0, 14.0])
  assert four["mean"] == 12.0 and four["std"] == pytest.approx(np.std([10, 14], ddof=1))
  assert four["roles_kept_mean"] == {"a": 1.5}
  assert (two["kept"], two["n"], two["std"], two["roles_kept_mean"]) == (2, 1, 0.0, {})
