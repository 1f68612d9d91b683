"""MkDocs hooks: results pages from the committed JSON, tutorials as Markdown.

Before every build: docs/index.md is the README with its links made relative,
scripts/docs_results.py writes docs/results/*.md, and each
Jupytext percent script docs/tutorials/NAME.py becomes docs/tutorials/NAME.md
(code and prose; the scripts themselves run in the tests), and each committed patching
result docs/results/patching/NAME/ gets its explorer.html from mha_jax/assets. All are
build outputs.
"""

from __future__ import annotations

import importlib.util
import pathlib
import sys

import jupytext

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _module(path: pathlib.Path):
  """The module of a file (mkdocs runs this hook in its own process: the checkout's
  mha_jax need not be installed, as mkdocstrings' `paths: [.]` reads it from the tree)."""
  spec = importlib.util.spec_from_file_location(path.stem, path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


docs_results = _module(ROOT / "scripts" / "docs_results.py")


def write_tutorials(docs):
  """Converts docs/tutorials/*.py (percent format) to Markdown next to them."""
  paths = []
  for src in sorted((docs / "tutorials").glob("*.py")):
    text = jupytext.writes(jupytext.read(src), fmt="md")
    text += f"\n\nRun it: `python docs/tutorials/{src.name}` (the source of this page).\n"
    dst = src.with_suffix(".md")
    if not dst.exists() or dst.read_text() != text:
      dst.write_text(text)
    paths.append(dst)
  return paths


# The README is the site's home page; its links point into docs/ (for GitHub).
README_LINKS = {"docs/guide/)": "guide/attention.md)", "docs/tutorials/)": "tutorials/head_roles.md)",
                "docs/results/)": "results/attention.md)"}


def write_index(docs):
  """docs/index.md: the README, its links made relative to docs/."""
  text = (ROOT / "README.md").read_text()
  for a, b in README_LINKS.items():
    text = text.replace("](" + a, "](" + b)
  text = text.replace("](docs/", "](")
  dst = docs / "index.md"
  if not dst.exists() or dst.read_text() != text:
    dst.write_text(text)
  return dst


def write_patching_pages(docs):
  """docs/results/patching/*/explorer.html from their JSON (patching.patch_explorer.write)."""
  if sys.path[:1] != [str(ROOT)]:    # this checkout's mha_jax, installed or not
    sys.path.insert(0, str(ROOT))
  from mha_jax.patching import patch_explorer
  return [patch_explorer.write(str(d)) for d in sorted((docs / "results" / "patching").glob("*/"))
          if (d / "patching.json").exists() or (d / "dla.json").exists()]


def on_config(config):
  docs = pathlib.Path(config["docs_dir"])
  write_patching_pages(docs)
  docs_results.write_pages(docs)
  write_index(docs)
  write_tutorials(docs)
  return config
