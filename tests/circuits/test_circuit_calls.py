"""What the circuits study calls: over checkpoints it builds the task once."""


import pytest

import mha_jax
from builders import QUIET

# On the worker that trains conftest's ind_run and parallel_run (setup.cfg: --dist loadgroup).
pytestmark = pytest.mark.xdist_group("trained_runs")


def test_circuits_over_checkpoints_builds_the_task_once(ind_run, monkeypatch):
  from mha_jax import tasks
  from mha_jax.circuits import induction_circuits
  from mha_jax.roles import behaviour
  loaded = mha_jax.load(ind_run, **QUIET)
  tokens, lengths = behaviour.eval_tokens(loaded, batch=8)
  built = []
  real = tasks.build
  monkeypatch.setattr(tasks, "build", lambda *a, **k: built.append(1) or real(*a, **k))
  rows = induction_circuits.over_checkpoints(loaded, tokens, lengths, log=lambda s: None)
  assert [r["step"] for r in rows] == [4, 8] and built == []
  at4 = induction_circuits.over_checkpoints(loaded, tokens, lengths, log=lambda s: None)[0]
  direct = behaviour.icl_score(mha_jax.load(ind_run, step=4, **QUIET), tokens, lengths)
  assert at4["icl_score"] == pytest.approx(direct["icl_score"], abs=1e-6)


def test_dla_on_a_model_without_a_final_norm_is_each_heads_exact_share(ind_run):
  """The toy has no norm and no biases, so the logit difference is linear in the
  residual: each head's DLA is its result at the last position dotted with
  W_U[:, answer] - W_U[:, wrong], and the heads plus the embeddings sum to LD."""
  import numpy as np
  from mha_jax.toolkit import activation_patching, pairs
  loaded = mha_jax.load(ind_run, **QUIET)
  p = pairs.induction_pairs(loaded.task, n=3, half_len=4, seed=0)
  s = activation_patching.Study(loaded.task, loaded.params, p)
  d = s.dla()
  rows, t = np.arange(3), p.length - 1
  u = np.asarray(loaded.params["unembed"], np.float64)
  diff = u[:, p.answer] - u[:, p.wrong]                                   # (D, N)
  for layer in range(2):
    z = np.asarray(s.values("clean", [f"lm.{layer}.attn.z"])[f"lm.{layer}.attn.z"])
    wo = np.asarray(loaded.params["lm"][f"layer_{layer}"]["attn"]["wo"], np.float64)
    res = np.einsum("nhk,hkd->nhd", z[rows, t], wo)                      # (N, H, D)
    want = np.einsum("nhd,dn->nh", res, diff).mean(0)
    np.testing.assert_allclose(d["heads"][layer], want, atol=1e-4)
  assert not np.any(d["mlp"])                                             # attention only
  np.testing.assert_allclose(d["ld_frozen_sum"], d["ld"], atol=1e-4)
