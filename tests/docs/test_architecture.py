"""The import graph: no cycle, every import goes down the floors or stays on one, no study
imports another, and the core keeps its internal order.

Read from the source with `ast` (nothing is imported), function-level imports included.
The floors and the core's order are docs/architecture.md's table and list, parsed here:
a new module must find its floor on that page. The experiment harness (mha_jax/harness/)
sits above the library: nothing else in mha_jax/ imports it, except the CLI's one hook,
`mha_jax.cli.HARNESS`, a module name imported by importlib.
"""

import ast
import collections
import pathlib
import re

import pytest
import sources

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "mha_jax"
PAGE = ROOT / "docs" / "architecture.md"
HARNESS = "mha_jax.harness"
# A module named on the page followed by this sits on that floor alone (its package's
# __init__), not with its submodules.
INIT_ONLY = " (its `__init__` only"


def page_floors(text: str):
  """(floor of each name prefix, floor of each package __init__ alone, floor names) from
  the page's table: rows `| N name | `mha_jax.x`, ... | what |`."""
  floors, exact, names = {}, {}, {}
  for m in re.finditer(r"^\| (\d+) (\w+) \| (.+?) \|", text, re.M):
    n = int(m.group(1))
    names[n] = m.group(2)
    cell = m.group(3)
    for mod in re.finditer(r"`(mha_jax(?:\.\w+)*)`", cell):
      target = exact if cell[mod.end():].startswith(INIT_ONLY) else floors
      if mod.group(1) in target:
        raise AssertionError(f"docs/architecture.md: {mod.group(1)} is on two floors")
      target[mod.group(1)] = n
  return floors, exact, names


def page_core_order(text: str) -> dict[str, int]:
  """Level of each core module in the page's numbered list after 'Inside the core'."""
  section = text[text.index("Inside the core"):]
  section = section[:section.index("\n\n", section.index("\n1. "))]
  return {mod: int(m.group(1)) for m in re.finditer(r"^(\d+)\. (.+)$", section, re.M)
          for mod in re.findall(r"`(mha_jax(?:\.\w+)*)`", m.group(2))}


FLOORS, EXACT, NAMES = page_floors(PAGE.read_text())
CORE_ORDER = page_core_order(PAGE.read_text())
STUDIES = next(n for n, name in NAMES.items() if name == "studies")


def modules() -> dict[str, pathlib.Path]:
  out = {}
  for path in sorted(PACKAGE.rglob("*.py")):
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
  for node in ast.walk(sources.tree(path)):
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


def study_of(name: str) -> str | None:
  """The study (its floor's name prefix) a module belongs to; None off the studies floor."""
  if floor(name) != STUDIES:
    return None
  return max((p for p in FLOORS if name == p or name.startswith(p + ".")), key=len)


def sideways(g) -> list[str]:
  return [f"{a} imports {b}" for a, deps in g.items() for b in sorted(deps)
          if study_of(a) and study_of(b) and study_of(a) != study_of(b)]


def test_no_study_imports_another():
  assert sideways(graph()) == []


def core_level(name: str) -> int:
  best = max((p for p in CORE_ORDER if name == p or name.startswith(p + ".")), key=len,
             default=None)
  if best is None:
    raise AssertionError(f"core module {name} is not in docs/architecture.md's core order")
  return CORE_ORDER[best]


def core_order_violations(g) -> list[str]:
  """Core imports that do not go to an earlier line of the page's order (or inside one
  package, e.g. kernels.dispatch -> kernels.xla)."""
  bad = []
  for a, deps in g.items():
    if floor(a) != 1:
      continue
    for b in sorted(deps):
      same_pkg = a.split(".")[:2] == b.split(".")[:2] and a.count(".") + b.count(".") > 2
      if floor(b) == 1 and not same_pkg and core_level(b) >= core_level(a):
        bad.append(f"{a} (line {core_level(a)}) imports {b} (line {core_level(b)})")
  return bad


def test_the_core_keeps_the_order_the_page_gives():
  g = graph()
  assert g["mha_jax.blocks"] == set()
  assert core_order_violations(g) == []
  importers = {a for a, deps in g.items() if "mha_jax.attention" in deps and floor(a) == 1}
  assert importers == {"mha_jax.layers"}   # the page: only layers imports attention back


def test_no_two_modules_share_a_name():
  # `run.py` three times, or `report.py` in two studies, says nothing about what each holds.
  names = collections.Counter(n.rpartition(".")[2] for n in modules() if n != "mha_jax")
  assert sorted(n for n, k in names.items() if k > 1) == []


def test_the_page_names_only_modules_that_exist():
  mods = modules()
  named = set(FLOORS) | set(EXACT) | set(CORE_ORDER)
  assert sorted(n for n in named if n not in mods) == []
  assert set(NAMES) == set(range(1, len(NAMES) + 1))


def test_the_checks_can_fail():
  # A cycle and an upward import, planted in a copy of the real graph, are found.
  g = graph()
  g["mha_jax.blocks"] = {"mha_jax.attention"}
  assert any("mha_jax.blocks" in c and "mha_jax.attention" in c for c in cycles(g))
  assert floor("mha_jax.cli") > floor("mha_jax.analysis.analyze") > floor("mha_jax.toolkit")
  assert floor("mha_jax.toolkit") > floor("mha_jax.tasks")
  with pytest.raises(AssertionError, match="no floor"):
    floor("elsewhere.module")
  # A study importing another study, and a core module importing a later line, are found.
  g["mha_jax.pruning.prune_curve"] = g["mha_jax.pruning.prune_curve"] | {"mha_jax.analysis.analyze"}
  assert sideways(g) == ["mha_jax.pruning.prune_curve imports mha_jax.analysis.analyze"]
  g["mha_jax.blocks"] = {"mha_jax.layers"}
  assert core_order_violations(g) == ["mha_jax.blocks (line 1) imports mha_jax.layers (line 4)"]


def test_the_page_is_parsed():
  # A table row and the core list in the page's format give the floors the test checks.
  text = ("| 2 upper | `mha_jax.b`, `mha_jax.p` (its `__init__` only: re-exports) | x |\n"
          "| 1 lower | `mha_jax.a`, `mha_jax.p` | y |\n\nInside the core ...:\n\n"
          "1. `mha_jax.a`\n2. `mha_jax.b`, `mha_jax.c`\n\nSo ...")
  assert page_floors(text) == ({"mha_jax.b": 2, "mha_jax.a": 1, "mha_jax.p": 1},
                               {"mha_jax.p": 2}, {2: "upper", 1: "lower"})
  assert page_core_order(text) == {"mha_jax.a": 1, "mha_jax.b": 2, "mha_jax.c": 2}


def test_the_library_reaches_the_harness_through_the_one_hook_only():
  g = graph()
  inside = lambda name: name == HARNESS or name.startswith(HARNESS + ".")
  up = sorted(f"{a} imports {b}" for a, deps in g.items() if not inside(a)
              for b in deps if inside(b))
  assert up == []
  named = sorted(str(p.relative_to(ROOT)) for n, p in modules().items() if not inside(n)
                 for node in ast.walk(sources.tree(p))
                 if isinstance(node, ast.Constant) and isinstance(node.value, str)
                 and inside(node.value))
  assert named == ["mha_jax/cli/table.py"]        # HARNESS = "mha_jax.harness.verbs"
  assert floor("mha_jax.harness.verbs") > floor("mha_jax.cli")
  assert "mha_jax.cli" in g["mha_jax.harness.verbs"]


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
  files = [p for d in ("mha_jax", "tests", "scripts", "configs",
                       "docs/tutorials") for p in (ROOT / d).rglob("*.py")]
  words = collections.Counter(re.findall(r"\w+", "\n".join(p.read_text() for p in files)))
  dead = [f"{p.relative_to(ROOT)}: {n}" for p in sorted(PACKAGE.rglob("*.py"))
          for n in _module_names(sources.tree(p)) if words[n] <= 1]
  assert dead == []


@pytest.mark.parametrize("package", ["models", "tasks"])
def test_a_package_docstring_names_each_of_its_modules(package):
  doc = ast.get_docstring(sources.tree(PACKAGE / package / "__init__.py"))
  for path in (PACKAGE / package).glob("*.py"):
    if path.stem != "__init__":
      assert re.search(rf"\b{path.stem}\b", doc), f"mha_jax/{package}/__init__.py: {path.stem}"
