"""The import graph: no cycle, and every import goes down the floors or stays on one.

Read from the source with `ast` (nothing is imported), function-level imports included.
The floors are docs/architecture.md's table; a new module must find its floor here. The
experiment harness (experiments/) sits above the library: nothing in mha_jax/ imports it,
except the CLI's one hook, `mha_jax.cli.HARNESS`, a module name imported by importlib.
"""

import ast
import collections
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "mha_jax"
HARNESS = ROOT / "experiments"

# Floor of each module, by the longest matching name prefix.
FLOORS = {
    # 1 core: attention and what everything needs
    "mha_jax.blocks": 1, "mha_jax.kernels": 1, "mha_jax.attention": 1,
    "mha_jax.interventions": 1, "mha_jax.layers": 1, "mha_jax.accounting": 1,
    "mha_jax.errors": 1, "mha_jax.storage": 1, "mha_jax.config": 1, "mha_jax.assets": 1,
    "mha_jax.compile_cache": 1, "mha_jax.settings": 1,
    # 2 models and the data they eat; the readers of real models' files
    "mha_jax.models": 2, "mha_jax.data": 2, "mha_jax.pretrained": 2,
    # 3 tasks; making, training and loading runs
    "mha_jax.tasks": 3, "mha_jax.pretrained.importer": 3,
    "mha_jax.train": 3, "mha_jax.loader": 3, "mha_jax.sweep": 3, "mha_jax.toolkit": 3,
    # 4 studies
    "mha_jax.analysis": 4, "mha_jax.pruning": 4, "mha_jax.circuits": 4,
    "mha_jax.patching": 4, "mha_jax.quickstart": 4,
    # 5 the command line and the package's facade
    "mha_jax.cli": 5, "mha_jax": 5,
    # 6 the experiment harness: claims, benchmarks, and the verbs it adds to the CLI
    "experiments": 6,
}
# Package facades that re-export a higher floor's names sit on that floor.
EXACT = {"mha_jax.pretrained": 3}
NAMES = {1: "core", 2: "models", 3: "tasks", 4: "studies", 5: "cli", 6: "harness"}


def modules() -> dict[str, pathlib.Path]:
  out = {}
  for path in sorted([*PACKAGE.rglob("*.py"), *HARNESS.rglob("*.py")]):
    parts = path.relative_to(ROOT).with_suffix("").parts
    if parts[-1] == "__init__":
      parts = parts[:-1]
    out[".".join(parts)] = path
  return out


def imports(name: str, path: pathlib.Path, known) -> set[str]:
  """The project modules `name` imports anywhere in its file."""
  is_pkg = path.name == "__init__.py"
  pkg = name if is_pkg else name.rpartition(".")[0]
  found = set()
  for node in ast.walk(ast.parse(path.read_text(), str(path))):
    if isinstance(node, ast.Import):
      targets = [a.name for a in node.names]
    elif isinstance(node, ast.ImportFrom):
      if node.level:
        base = pkg.split(".")[:len(pkg.split(".")) - node.level + 1]
        mod = ".".join(base + ([node.module] if node.module else []))
      else:
        mod = node.module or ""
      targets = [f"{mod}.{a.name}" if f"{mod}.{a.name}" in known else mod for a in node.names]
    else:
      continue
    for t in targets:
      while t and t not in known:   # `import mha_jax.a.b` names mha_jax.a.b, or a parent
        t = t.rpartition(".")[0]
      if t and t != name:
        found.add(t)
  return found


def floor(name: str) -> int:
  if name in EXACT:
    return EXACT[name]
  best = max((p for p in FLOORS if name == p or name.startswith(p + ".")), key=len,
             default=None)
  if best is None:
    raise AssertionError(f"module {name} has no floor in tests/docs/test_architecture.py FLOORS")
  return FLOORS[best]


def graph() -> dict[str, set[str]]:
  mods = modules()
  return {n: imports(n, p, mods) for n, p in mods.items()}


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
  """Strongly connected components with more than one module (Tarjan)."""
  index, low, stack, on, out = {}, {}, [], set(), []

  def visit(v):
    index[v] = low[v] = len(index)
    stack.append(v)
    on.add(v)
    for w in g.get(v, ()):
      if w not in index:
        visit(w)
        low[v] = min(low[v], low[w])
      elif w in on:
        low[v] = min(low[v], index[w])
    if low[v] == index[v]:
      comp = []
      while True:
        w = stack.pop()
        on.discard(w)
        comp.append(w)
        if w == v:
          break
      if len(comp) > 1:
        out.append(sorted(comp))

  for v in sorted(g):
    if v not in index:
      visit(v)
  return out


def test_every_module_has_a_floor():
  for name in modules():
    floor(name)


def test_no_import_cycle():
  assert cycles(graph()) == []


def test_imports_go_down_or_stay():
  bad = [f"{a} ({NAMES[floor(a)]}) imports {b} ({NAMES[floor(b)]})"
         for a, deps in graph().items() for b in sorted(deps) if floor(b) > floor(a)]
  assert bad == []


def test_blocks_is_a_leaf_and_the_core_never_imports_attention_back():
  g = graph()
  assert g["mha_jax.blocks"] == set()
  for name, deps in g.items():
    if name.startswith("mha_jax.kernels"):
      assert "mha_jax.attention" not in deps, name


def test_the_checks_can_fail():
  # A cycle and an upward import, planted in a copy of the real graph, are found.
  g = graph()
  g["mha_jax.blocks"] = {"mha_jax.attention"}
  assert any("mha_jax.blocks" in c and "mha_jax.attention" in c for c in cycles(g))
  assert floor("mha_jax.cli") > floor("mha_jax.analysis.report") > floor("mha_jax.tasks")
  with pytest.raises(AssertionError, match="no floor"):
    floor("elsewhere.module")


def test_the_library_reaches_the_harness_through_the_one_hook_only():
  g = graph()
  up = sorted(f"{a} imports {b}" for a, deps in g.items() if a.startswith("mha_jax")
              for b in deps if b.startswith("experiments"))
  assert up == []
  named = sorted(str(p.relative_to(ROOT)) for p in PACKAGE.rglob("*.py")
                 for node in ast.walk(ast.parse(p.read_text()))
                 if isinstance(node, ast.Constant) and isinstance(node.value, str)
                 and re.fullmatch(r"experiments(\.\w+)*", node.value))
  assert named == ["mha_jax/cli.py"]        # HARNESS = "experiments.verbs"
  assert floor("experiments.verbs") > floor("mha_jax.cli")
  assert "mha_jax.cli" in g["experiments.verbs"]


def test_relative_and_function_level_imports_are_seen(tmp_path):
  pkg = tmp_path / "mha_jax"
  (pkg / "sub").mkdir(parents=True)
  (pkg / "__init__.py").write_text("")
  (pkg / "sub" / "__init__.py").write_text("")
  (pkg / "a.py").write_text("")
  (pkg / "sub" / "b.py").write_text("def f():\n  from .. import a\n  from . import c\n")
  (pkg / "sub" / "c.py").write_text("")
  known = {"mha_jax", "mha_jax.a", "mha_jax.sub", "mha_jax.sub.b", "mha_jax.sub.c"}
  assert imports("mha_jax.sub.b", pkg / "sub" / "b.py", known) == {"mha_jax.a", "mha_jax.sub.c"}


def _module_names(tree):
  """Module-level CONSTANTS and _private functions, classes and assignments."""
  for node in tree.body:
    if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
      names = [node.name]
    elif isinstance(node, ast.Assign):
      names = [n.id for t in node.targets for n in ast.walk(t) if isinstance(n, ast.Name)]
    else:
      continue
    for n in names:
      if (n.isupper() or n.startswith("_")) and not n.startswith("__"):
        yield n


# Names another branch is still building on (unread today); the lead removes them from
# here when their branch lands or reads them.


def test_no_dead_module_names():
  # A constant or private helper that nothing reads (mha_jax, tests, scripts, configs,
  # tutorials) is stale: it says something the code no longer does.
  sources = [p for d in ("mha_jax", "experiments", "tests", "scripts", "configs",
                         "docs/tutorials") for p in (ROOT / d).rglob("*.py")]
  words = collections.Counter(re.findall(r"\w+", "\n".join(p.read_text() for p in sources)))
  dead = [f"{p.relative_to(ROOT)}: {n}" for p in sorted([*PACKAGE.rglob("*.py"),
                                                          *HARNESS.rglob("*.py")])
          for n in _module_names(ast.parse(p.read_text())) if words[n] <= 1]
  assert dead == []


@pytest.mark.parametrize("package", ["models", "tasks"])
def test_a_package_docstring_names_each_of_its_modules(package):
  doc = ast.get_docstring(ast.parse((PACKAGE / package / "__init__.py").read_text()))
  for path in (PACKAGE / package).glob("*.py"):
    if path.stem != "__init__":
      assert re.search(rf"\b{path.stem}\b", doc), f"mha_jax/{package}/__init__.py: {path.stem}"
