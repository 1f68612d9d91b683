"""What the circuits study calls: over checkpoints it builds the task once."""


import pytest

import mha_jax
from builders import QUIET

# On the worker that trains conftest's ind_run and parallel_run (setup.cfg: --dist loadgroup).
pytestmark = pytest.mark.xdist_group("trained_runs")


def test_circuits_over_checkpoints_builds_the_task_once(ind_run, monkeypatch):
  from mha_jax import tasks
  from mha_jax.circuits import behaviour, circuits_report
  loaded = mha_jax.load(ind_run, **QUIET)
  tokens, lengths = behaviour.eval_tokens(loaded, batch=8)
  built = []
  real = tasks.build
  monkeypatch.setattr(tasks, "build", lambda *a, **k: built.append(1) or real(*a, **k))
  rows = circuits_report.over_checkpoints(loaded, tokens, lengths, log=lambda s: None)
  assert [r["step"] for r in rows] == [4, 8] and built == []
  at4 = circuits_report.over_checkpoints(loaded, tokens, lengths, log=lambda s: None)[0]
  direct = behaviour.icl_score(mha_jax.load(ind_run, step=4, **QUIET), tokens, lengths)
  assert at4["icl_score"] == pytest.approx(direct["icl_score"], abs=1e-6)
