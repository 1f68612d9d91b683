"""Python sources parsed once per process: the docs tests walk every module's syntax tree
several times (imports, names, shapes, assets), and parsing dominates them. The trees
are shared: read them, never change them."""

import ast
import functools
import pathlib


@functools.lru_cache(maxsize=None)
def parse(source: str) -> ast.Module:
  """ast.parse(source), once per distinct source text."""
  return ast.parse(source)


def tree(path) -> ast.Module:
  """The syntax tree of the file at `path`."""
  return parse(pathlib.Path(path).read_text())
