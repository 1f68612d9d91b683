"""toolkit/ablations.py: each ablation's value against NumPy written out here (zero, the
paired corrupt value, a mean per position or over everything, a resampled row), and the
refusals naming what is wrong."""

import numpy as np
import pytest

from mha_jax.errors import UserError
from mha_jax.toolkit import ablations

RNG = np.random.default_rng(0)
CLEAN = RNG.normal(size=(3, 4, 2)).astype(np.float32)      # (B, T, H)
REF = RNG.normal(size=(5, 4, 2)).astype(np.float32)        # (R, T, H)


def test_each_kind_against_numpy():
  np.testing.assert_array_equal(ablations.values("zero", CLEAN), np.zeros_like(CLEAN))
  corrupt = CLEAN[::-1].copy()
  np.testing.assert_array_equal(ablations.values("corrupt", CLEAN, corrupt=corrupt), corrupt)
  np.testing.assert_allclose(ablations.values("mean", CLEAN, reference=REF),
                             np.broadcast_to(REF.mean(0), CLEAN.shape), rtol=1e-6)
  np.testing.assert_allclose(ablations.values("mean", CLEAN, per_position=False),
                             np.broadcast_to(CLEAN.mean((0, 1)), CLEAN.shape), rtol=1e-6)
  np.testing.assert_array_equal(ablations.values("resample", CLEAN), CLEAN[[1, 2, 0]])
  np.testing.assert_array_equal(ablations.values("resample", CLEAN, perm=[2, 2, 0]),
                                CLEAN[[2, 2, 0]])


def test_refusals_name_the_problem():
  with pytest.raises(UserError, match="ablation must be one of") as e:
    ablations.values("noise", CLEAN)
  assert e.value.settings == ("ablation",)
  with pytest.raises(UserError, match="corrupt run's value of shape"):
    ablations.values("corrupt", CLEAN, corrupt=CLEAN[:2])
  with pytest.raises(UserError, match=r"perm must have shape \(3,\)"):
    ablations.values("resample", CLEAN, perm=[0, 1])
  with pytest.raises(UserError, match="must match the site's"):
    ablations.values("mean", CLEAN, reference=REF[:, :3])
