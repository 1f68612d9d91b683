"""Names that read across the project.

No private name crosses a module line: a `_name` of a project module is used only in
that module. Another module (the library's, the harness's, a script's, a config's or a
tutorial's) that imports one (`from mha_jax.x import _y`) or reaches one as an attribute
of an imported project module (`x._y`, `mha_jax.x._y`) is listed. Read with `ast`; nothing
is imported. (Tests are held to the same rule by tests/docs/test_repository.py.)

No function is named like a class (`LlamaSpec` was one). No module is imported under a
one-letter alias (`import ... as R`): `P` meant pairs in
one file and the primer in the next."""

import ast
import pathlib
import sources

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGES = ("mha_jax",)
USERS = ("scripts", "configs", "docs/tutorials")
SOURCES = ("mha_jax", "tests", *USERS)

# A crossing a branch is removing may be listed here until that branch lands.
BEING_FIXED: set[str] = set()   # crossings allowed while a branch fixes them


def _private(name: str) -> bool:
  return name.startswith("_") and not name.startswith("__")


def project_modules(root: pathlib.Path = ROOT) -> dict[str, pathlib.Path]:
  """Dotted name -> file of every module of the project's packages."""
  out = {}
  for package in PACKAGES:
    for path in sorted((root / package).rglob("*.py")):
      parts = path.relative_to(root).with_suffix("").parts
      out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
  return out


def crossings(name: str, source: str, known, *, is_package: bool = False) -> list[str]:
  """`name: module._private` for each private name of another project module that the
  source of module `name` imports or reaches through an imported module."""
  tree = sources.parse(source)
  pkg = name if is_package else name.rpartition(".")[0]
  bound, found = {}, set()     # local name -> project module it stands for
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      for a in node.names:
        if a.name in known:
          bound[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
    elif isinstance(node, ast.ImportFrom):
      if node.level:
        mod = ".".join(pkg.split(".")[:len(pkg.split(".")) - node.level + 1]
                       + ([node.module] if node.module else []))
      else:
        mod = node.module or ""
      for a in node.names:
        if f"{mod}.{a.name}" in known:
          bound[a.asname or a.name] = f"{mod}.{a.name}"
        elif mod in known and _private(a.name) and mod != name:
          found.add(f"{name}: {mod}.{a.name}")
  for node in ast.walk(tree):
    if isinstance(node, ast.Attribute) and _private(node.attr):
      chain, value = [], node.value
      while isinstance(value, ast.Attribute):
        chain.append(value.attr)
        value = value.value
      if isinstance(value, ast.Name) and value.id in bound:
        target = ".".join([bound[value.id], *reversed(chain)])
        if target in known and target != name:
          found.add(f"{name}: {target}.{node.attr}")
  return sorted(found)


def all_crossings() -> list[str]:
  known = project_modules()
  users = {str(p.relative_to(ROOT)): p for d in USERS for p in sorted((ROOT / d).rglob("*.py"))}
  found = []
  for name, path in [*known.items(), *users.items()]:
    found += crossings(name, path.read_text(), known, is_package=path.name == "__init__.py")
  return found


def test_no_private_name_crosses_a_module_line():
  found = all_crossings()
  assert sorted(set(found) - BEING_FIXED) == []


def test_the_allow_list_holds_only_what_still_crosses():
  # An entry fixed on its branch leaves this list too.
  assert sorted(BEING_FIXED - set(all_crossings())) == []


def test_the_check_can_fail():
  known = {"mha_jax", "mha_jax.a", "mha_jax.sub", "mha_jax.sub.b", "mha_jax.sub.c"}
  planted = {
      "from mha_jax.a import _x": ["mha_jax.sub.b: mha_jax.a._x"],
      "from ..a import _x": ["mha_jax.sub.b: mha_jax.a._x"],
      "from . import c\nc._y()": ["mha_jax.sub.b: mha_jax.sub.c._y"],
      "import mha_jax.sub.c\nmha_jax.sub.c._y": ["mha_jax.sub.b: mha_jax.sub.c._y"],
      "import mha_jax.a as m\nm._Z": ["mha_jax.sub.b: mha_jax.a._Z"],
      "def f():\n  from mha_jax import a\n  return a._x": ["mha_jax.sub.b: mha_jax.a._x"],
  }
  for source, want in planted.items():
    assert crossings("mha_jax.sub.b", source, known) == want, source
  for source in ("from mha_jax.a import x", "self._x", "obj._y", "from jax._src import lib",
                 "from mha_jax import a\na.__name__", "from mha_jax.a import x\nx._y",
                 "def _own():\n  pass\n_own()"):
    assert crossings("mha_jax.sub.b", source, known) == [], source


def one_letter_aliases(source: str) -> list[str]:
  """Imports of a module under a one-letter name: every `import x as Y`, and a
  `from x import y as Y` of a lower-case name (a module; classes such as
  `PartitionSpec as P` are CamelCase)."""
  bad = []
  for node in ast.walk(sources.parse(source)):
    if isinstance(node, (ast.Import, ast.ImportFrom)):
      for a in node.names:
        if a.asname and len(a.asname) == 1 and (isinstance(node, ast.Import)
                                                 or a.name.islower()):
          bad.append(f"{ast.unparse(node)} (line {node.lineno})")
  return bad


def test_no_module_has_a_one_letter_alias():
  found = {str(p.relative_to(ROOT)): one_letter_aliases(p.read_text())
           for d in SOURCES for p in sorted((ROOT / d).rglob("*.py"))}
  assert {p: b for p, b in found.items() if b} == {}
  for source in ("from mha_jax.claims import rules as R", "import numpy.linalg as L",
                 "from mha_jax.toolkit import pairs as p"):
    assert one_letter_aliases(source), source
  for source in ("from jax.sharding import PartitionSpec as P", "import numpy as np",
                 "from mha_jax.toolkit import pairs as pairs_lib"):
    assert one_letter_aliases(source) == [], source


def test_no_function_is_named_like_a_class():
  bad = [f"{p.relative_to(ROOT)}: {node.name}" for p in sorted((ROOT / "mha_jax").rglob("*.py"))
         for node in ast.walk(sources.tree(p))
         if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name[:1].isupper()]
  assert bad == []
