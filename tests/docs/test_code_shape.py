"""The code's shape: no function outside the kernels is longer than a screen.

Read from the source with `ast`. A function's length is its lines from `def` to its
last statement, less its docstring (a long docstring is welcome; a long body is a
function doing several things). The kernels (mha_jax/kernels/) keep their fused loops.
"""

import ast
import pathlib
import sources

ROOT = pathlib.Path(__file__).resolve().parents[2]
MAX_LINES = 80
EXEMPT = ("mha_jax/kernels/",)


def function_lengths(path: pathlib.Path) -> list[tuple[int, str]]:
  """(lines without the docstring, qualified name) of every function in the file."""
  out = []

  def visit(node, prefix):
    for child in ast.iter_child_nodes(node):
      if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
        n = child.end_lineno - child.lineno + 1
        doc = child.body[0]
        if (isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant)
            and isinstance(doc.value.value, str)):
          n -= doc.end_lineno - doc.lineno + 1
        out.append((n, prefix + child.name))
        visit(child, prefix + child.name + ".")
      elif isinstance(child, ast.ClassDef):
        visit(child, prefix + child.name + ".")

  visit(sources.tree(path), "")
  return out


def test_function_lengths_counts_the_body_without_the_docstring(tmp_path):
  src = tmp_path / "probe.py"
  src.write_text('def f():\n  """one\n  two"""\n  a = 1\n  return a\n\n\n'
                 'class C:\n  def g(self):\n    def h():\n      pass\n    return h\n')
  assert function_lengths(src) == [(3, "f"), (4, "C.g"), (2, "C.g.h")]


def test_no_function_outside_the_kernels_is_over_80_lines():
  long = []
  for path in sorted((ROOT / "mha_jax").rglob("*.py")):
    rel = path.relative_to(ROOT).as_posix()
    if rel.startswith(EXEMPT):
      continue
    long += [f"{rel}:{name} ({n} lines)" for n, name in function_lengths(path)
             if n > MAX_LINES]
  assert not long, f"split these into functions of at most {MAX_LINES} lines: {long}"
