"""What the pruning methods call and leave alone: the caller's mask, one gate training per
curve, no lambda for keep-k."""

import json
import os

import numpy as np
import pytest

import mha_jax
from mha_jax import cli as cli_mod
from builders import QUIET

# On the worker that trains conftest's ind_run and parallel_run (setup.cfg: --dist loadgroup).
pytestmark = pytest.mark.xdist_group("trained_runs")


def test_michel_and_random_masks_leave_the_callers_mask_alone(ind_run):
  from mha_jax.toolkit import head_masks
  from mha_jax.pruning import methods
  loaded = mha_jax.load(ind_run, **QUIET)
  start = head_masks.ones_head_mask(loaded.params, ["lm"])
  start["lm"][0][1] = 0.0
  snapshot = {s: [m.copy() for m in ls] for s, ls in start.items()}
  rnd = methods.random_masks(loaded, stacks=["lm"], counts=[2], start_mask=start)
  mic = methods.michel_masks(loaded, stacks=["lm"], counts=[5], start_mask=start, limit=8,
                             log=lambda s: None)
  assert head_masks.count(rnd[2]) == 2 and head_masks.count(mic[5]) == 5 and mic[5]["lm"][0][1] == 0
  for s in start:
    for a, b in zip(start[s], snapshot[s]):
      np.testing.assert_array_equal(a, b)


def test_prune_curve_trains_the_gates_once(ind_run, tmp_path, monkeypatch):
  from mha_jax.pruning import methods, prune_curve
  calls = []
  real = methods.train_gates
  monkeypatch.setattr(methods, "train_gates", lambda *a, **k: calls.append(1) or real(*a, **k))
  rows = prune_curve.prune_curve(mha_jax.load(ind_run, **QUIET), str(tmp_path / "c"),
                           prune_curve.CurveOptions(counts=(8, 4, 1), stacks=("lm",), steps=2),
                           log=lambda s: None)
  assert len(calls) == 1
  l0 = {r["kept"]: set(r["kept_heads"]) for r in rows if r["method"] == "l0"}
  assert len(l0[1]) == 1 and l0[1] <= l0[4] <= l0[8]     # nested: one ranking, top K


def test_prune_l0_keep_k_needs_no_lambda(ind_run, tmp_path, capsys):
  out = str(tmp_path / "p")
  assert cli_mod.main(["prune", "--workdir", ind_run, "--out", out, "--method", "l0",
                       "--keep", "3", "--stacks", "lm", "--steps", "2"]) == 0
  info = json.load(open(os.path.join(out, "pruning.json")))
  assert info["kept"] == 3 and info["lambda"] == 0.05
  assert cli_mod.main(["prune", "--workdir", ind_run, "--out", str(tmp_path / "q"),
                       "--method", "l0", "--stacks", "lm"]) == 2
  assert "--l0-lambda X, --lambdas a,b,c or --keep K" in capsys.readouterr().err
