"""The repository as a newcomer meets it: CI installs the
browser and no test installs anything, the results the README cites are committed."""

import ast
import glob
import json
import os
import re
import subprocess

from builders import ROOT
import sources


def test_ci_installs_the_browser_and_no_test_installs_anything():
  root = ROOT
  ci = open(os.path.join(root, ".ci", "run")).read()
  assert "apt-get install -y -qq chromium" in ci and "command -v chromium" in ci
  runners = {"run", "Popen", "call", "check_call", "check_output", "system", "popen"}
  for path in glob.glob(os.path.join(root, "tests", "**", "*.py"), recursive=True):
    name = os.path.relpath(path, root)
    if os.path.abspath(path) != os.path.abspath(__file__):
      tree = sources.tree(path)
      for node in ast.walk(tree):    # a command a test runs: subprocess.* / os.system
        func = getattr(node, "func", None)
        if isinstance(node, ast.Call) and getattr(func, "attr", getattr(func, "id", "")) in runners:
          words = [c.value for a in node.args for c in ast.walk(a)
                   if isinstance(c, ast.Constant) and isinstance(c.value, str)]
          text = " ".join(words)
          assert "apt-get" not in text and "pip" not in words and "pip install" not in text, \
              (name, text)


def test_the_results_the_readme_cites_are_in_the_repository():
  root = ROOT
  pages = [os.path.join(root, "README.md")] + glob.glob(os.path.join(root, "docs", "guide",
                                                                     "*.md"))
  readme = "\n".join(open(p).read() for p in pages)    # the README and the guide pages
  cited = set(re.findall(r"docs/results/[\w.\-{},*/]+", readme))
  assert cited
  tracked = subprocess.run(["git", "ls-files", "docs/results"], cwd=root, text=True,
                           capture_output=True).stdout.split()
  ignored = subprocess.run(["git", "check-ignore", "docs/results/x.json"], cwd=root).returncode
  assert ignored == 1                                   # .gitignore no longer hides them
  for c in cited:
    m = re.fullmatch(r"(.*?)\{(.*?)\}(.*)", c)     # stem{a,b}tail
    names = ([m[1] + e + m[3] for e in m[2].split(",")] if m else [c.rstrip(".")])
    for n in names:
      folder = n if n.endswith("/") else n + "/"
      if n.endswith("/") or any(t.startswith(folder) for t in tracked):
        assert any(t.startswith(folder) for t in tracked), (n, tracked)   # a folder
        continue
      pat = re.escape(n).replace(r"\*", ".*")
      assert any(re.fullmatch(pat, t) for t in tracked), (n, tracked)


def test_every_committed_results_json_records_its_machine_and_date():
  tracked = subprocess.run(["git", "ls-files", "docs/results", "docs/claims"], cwd=ROOT,
                           text=True, capture_output=True, check=True).stdout.split()
  files = [t for t in tracked if t.endswith(".json")]
  assert len(files) > 40, files
  for name in files:
    doc = json.load(open(os.path.join(ROOT, name)))
    assert isinstance(doc, dict) and doc.get("machine"), name
    inner = doc["machine"] if isinstance(doc["machine"], dict) else {}
    # the run's own date (top level, or in its machine record), else the commit's day
    date = doc.get("date") or inner.get("date") or inner.get("written") or doc.get("commit_date")
    assert isinstance(date, str) and re.match(r"20\d\d-\d\d-\d\d", date), (name, date)


# Private names of other libraries that tests reach (never a name of mha_jax).
OTHERS_PRIVATE = {"_attn_implementation": "transformers' model config",
                  "_registry": "fsspec's registry", "_get_filesystem": "etils.epath's backend",
                  "_cache_size": "a jax.jit function's count of compiled programs"}
TEST_HELPERS = ("builders", "oracles", "conftest", "browser", "hf_models", "golden_cases",
                "fault_runner")


def _private(name: str) -> bool:
  return name.startswith("_") and not name.startswith("__")


def private_uses(source: str) -> list[str]:
  """The private names of mha_jax (its harness included) a test's source uses: imported
  (`from mha_jax.x import _y`, `mha_jax._x`), or reached as an attribute or an attribute
  string (monkeypatch.setattr(obj, "_y", ...)) of anything but the test's own objects
  (self, cls, its helper modules) and OTHERS_PRIVATE."""
  tree = sources.parse(source)
  ours = ("mha_jax",)
  helpers = {a.asname or a.name for n in ast.walk(tree)
             if isinstance(n, (ast.Import, ast.ImportFrom)) for a in n.names
             if (getattr(n, "module", None) or a.name).split(".")[0] in TEST_HELPERS}
  own = {"self", "cls"} | helpers

  def root(node):
    while isinstance(node, (ast.Attribute, ast.Call, ast.Subscript)):
      node = node.func if isinstance(node, ast.Call) else node.value
    return node.id if isinstance(node, ast.Name) else None

  bad = []
  for n in ast.walk(tree):
    if isinstance(n, ast.ImportFrom) and (n.module or "").split(".")[0] in ours:
      bad += [f"from {n.module} import {a.name}" for a in n.names
              if _private(a.name) or any(map(_private, n.module.split(".")))]
    elif isinstance(n, ast.Import):
      bad += [f"import {a.name}" for a in n.names
              if a.name.split(".")[0] in ours and any(map(_private, a.name.split(".")))]
    elif (isinstance(n, ast.Attribute) and _private(n.attr) and n.attr not in OTHERS_PRIVATE
          and root(n.value) not in own):
      bad.append(f"{ast.unparse(n)} (line {n.lineno})")
    elif (isinstance(n, ast.Call) and len(n.args) >= 2
          and ast.unparse(n.func).split(".")[-1] in ("setattr", "getattr", "delattr")
          and isinstance(n.args[1], ast.Constant) and isinstance(n.args[1].value, str)
          and _private(n.args[1].value) and n.args[1].value not in OTHERS_PRIVATE
          and root(n.args[0]) not in own):
      bad.append(f"{ast.unparse(n)[:60]} (line {n.lineno})")
  return bad


def test_no_test_uses_a_private_name_of_the_package():
  found = {os.path.relpath(p, ROOT): private_uses(open(p).read())
           for p in sorted(glob.glob(os.path.join(ROOT, "tests", "**", "*.py"), recursive=True))}
  assert {p: b for p, b in found.items() if b} == {}
  # the check can fail: each form it refuses
  for src in ("from mha_jax.cli import _load", "import mha_jax._x",
              "from mha_jax import cli\ncli._load(1)", "task._jit_cache",
              "monkeypatch.setattr(cli, '_load', f)", "getattr(loaded.task, '_x')"):
    assert private_uses(src), src
  for src in ("self._x", "import builders\nbuilders._helper()", "cfg._attn_implementation",
              "obj.__dict__", "from mha_jax.cli import main", "not hasattr(bench, '_gone')"):
    assert not private_uses(src), src
