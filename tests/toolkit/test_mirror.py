"""tests/toolkit/ mirrors mha_jax/toolkit/: each toolkit module has its test file here,
test_<module>.py, or is named below with where its tests are today."""

import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]

# Modules whose tests still live with a study's tests (they drive the tool through the
# study's inputs); a module leaves this table when its tests move here.
TESTED_ELSEWHERE = {
    "activation_patching": "tests/patching/test_patching.py",
    "capture": "tests/tasks/test_traces.py",
    "importance": "tests/analysis/test_analysis.py",
    "plots": "the studies' tests (the figures they write)",
}


def test_each_toolkit_module_has_its_test_file():
  modules = sorted(p.stem for p in (ROOT / "mha_jax" / "toolkit").glob("*.py")
                   if p.stem != "__init__")
  here = {p.stem.removeprefix("test_") for p in (ROOT / "tests" / "toolkit").glob("test_*.py")}
  assert [m for m in modules if m not in here and m not in TESTED_ELSEWHERE] == []
  assert sorted(set(TESTED_ELSEWHERE) & here) == []        # moved: leave the table
  assert sorted(set(TESTED_ELSEWHERE) - set(modules)) == []
