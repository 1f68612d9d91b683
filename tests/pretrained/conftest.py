"""Fixtures shared by the family tests (test_families.py, test_family_studies.py: one
xdist group, so one worker builds each tiny model once per session)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def imported(tmp_path_factory):
  """case -> (HF model, mha_jax.load of its import, the HF folder); each case of
  hf_models.CASES built, saved and imported once per session (the workdir is the
  folder's sibling "w")."""
  import mha_jax
  from hf_models import build_hf, save_folder
  from mha_jax.pretrained import importer
  cache = {}

  def get(case):
    if case not in cache:
      base = tmp_path_factory.mktemp(case)
      model = build_hf(case)
      folder = save_folder(model, base / "hf")
      importer.import_model(str(base / "w"), file=folder)
      cache[case] = (model, mha_jax.load(str(base / "w")), folder)
    return cache[case]

  return get
