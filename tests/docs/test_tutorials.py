"""Every tutorial in docs/tutorials/ runs as a script (as a reader would run it).

Marked `tutorials` (excluded from the default run; `.ci/run` runs `pytest -m tutorials`).
Each must finish within 60 s on 2 CPU cores at its small settings; the limit here is
looser (shared machines), the time is printed.
"""

import os
import pathlib
import subprocess
import sys
import time

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCRIPTS = sorted((ROOT / "docs" / "tutorials").glob("*.py"))
LIMIT_S = 300
# Run as notebooks only (tests/docs/test_notebooks.py executes the same cells): minutes of
# SmolLM2's patching and circuit studies, too long to run twice in CI.
NOTEBOOK_ONLY = {"first_ten_minutes"}


def test_there_are_tutorials():
  assert {p.stem for p in SCRIPTS} >= {"head_roles", "ablate_prune", "induction_circuit"}


@pytest.mark.tutorials
@pytest.mark.parametrize("script", SCRIPTS, ids=[p.stem for p in SCRIPTS])
def test_tutorial_runs(script, tmp_path, tmp_path_factory):
  if script.stem in NOTEBOOK_ONLY:
    pytest.skip(f"{script.name} runs as a notebook (tests/docs/test_notebooks.py)")
  env = {**os.environ, "PYTHONPATH": os.pathsep.join(
      [str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]),
         "TMPDIR": str(tmp_path),
         # one model cache for the run's tutorials (mha_jax.load imports each model once)
         "MHA_JAX_MODELS": str(tmp_path_factory.getbasetemp() / "models")}
  t0 = time.time()
  proc = subprocess.run([sys.executable, str(script)], cwd=ROOT, env=env, capture_output=True,
                        text=True, timeout=LIMIT_S)
  seconds = time.time() - t0
  print(f"{script.name}: {seconds:.1f} s")
  assert proc.returncode == 0, f"{script.name} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
  assert proc.stdout.strip(), f"{script.name} printed nothing"
