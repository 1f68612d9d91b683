"""toolkit/composition.py's scores on matrices whose answers are known: composition
|AB|_F / (|A|_F |B|_F) and eigenvalue positivity sum(l) / sum(|l|)."""

import numpy as np
import pytest

from mha_jax.toolkit import composition


def test_composition_of_known_pairs():
  eye = np.eye(3)
  assert composition.composition(eye, eye) == pytest.approx(np.sqrt(3) / 3)
  a = np.zeros((3, 3))
  a[0, 1] = 1.0                            # e0 e1^T
  b = np.zeros((3, 3))
  b[2, 0] = 1.0                            # e2 e0^T: A B = 0
  assert composition.composition(a, b) == 0.0
  assert composition.composition(b, a) == pytest.approx(1.0)   # B A = e2 e1^T
  assert composition.composition(np.zeros((2, 2)), eye[:2, :2]) == 0.0


def test_positivity_of_known_spectra():
  assert composition.positivity(np.array([1.0, 2.0])) == 1.0
  assert composition.positivity(np.array([-1.0, -3.0])) == -1.0
  assert composition.positivity(np.array([3.0, -1.0])) == pytest.approx(0.5)
  assert composition.positivity(np.array([1j, -1j])) == 0.0
  assert composition.positivity(np.zeros(2)) == 0.0
