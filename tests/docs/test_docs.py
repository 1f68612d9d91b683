"""The README and the site: one screen, the commands CI follows, results pages made from
the committed JSON, and a nav whose every page exists (`mkdocs build --strict` itself
runs in .ci/run)."""

import json
import pathlib
import re
import shutil
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
import docs_results  # noqa: E402


def test_the_readme_fits_one_screen_and_ci_runs_its_commands():
  readme = (ROOT / "README.md").read_text()
  assert len(readme.splitlines()) <= 150
  first = readme.split("```bash\n", 1)[1].split("```", 1)[0].splitlines()
  assert len(first) == 2 and "mha-jax quickstart" in first[0] and "pytest" in first[1]
  ci = (ROOT / ".ci" / "run").read_text()
  for part in first[1].split("#")[0].split("&&"):     # the test command, step by step
    assert part.strip() in ci, part
  extras = set(re.findall(r"pip install -e '\.\[(\w+)\]'", readme))
  installed = {e for group in re.findall(r"pip install -e '\.\[([\w,]+)\]'", ci)
               for e in group.split(",")}
  assert {"test", "docs", "lint"} <= extras <= installed | {"tpu", "cuda", "gcs"}
  for step in ("ruff check .", "mkdocs build --strict", "pytest -m tutorials"):
    assert step in ci


def test_results_pages_are_made_from_the_committed_json(tmp_path):
  docs = tmp_path / "docs"
  shutil.copytree(ROOT / "docs" / "results", docs / "results")
  shutil.copytree(ROOT / "docs" / "claims", docs / "claims")
  paths = docs_results.write_pages(docs)
  assert [p.stem for p in paths] == list(docs_results.PAGES)
  att = (docs / "results" / "attention.md").read_text()
  rows = json.loads((docs / "results" / "bench_attention_cpu.json").read_text())["rows"]
  for r in rows[:3] + rows[-3:]:
    assert f"{r['median_ms']:,.1f}" in att
  claims = (docs / "results" / "claims.md").read_text()
  for c in json.loads((docs / "claims" / "claims.json").read_text())["claims"]:
    verdicts = [v["verdict"] for v in c["settings"].values() if "per_seed" in v] \
        if "settings" in c else [c["verdict"]]
    assert f"`{c['name']}`" in claims and all(f"**{v}**" in claims for v in verdicts)
  variants = (docs / "results" / "variants.md").read_text()
  for r in json.loads((docs / "results" / "variants" / "compare.json").read_text())["rows"]:
    assert f"| {r['variant']} | {r['heads']} | {r['loss']:,.3f} |" in variants
  cmds = (docs / "results" / "commands.md").read_text()
  for r in json.loads((docs / "results" / "compile_cache.json").read_text())["commands"].values():
    assert f"| {r['second']['seconds']:,.1f}" in cmds
    if "ratio_to_sweep" in r["second"]:
      assert f"({r['second']['ratio_to_sweep']:.2f}x its sweep" in cmds
  parts = json.loads((docs / "results" / "attention_parts_cpu.json").read_text())["heads"]
  assert all(f"| {h} | core | {r['rows']['core']['median_ms']:,.1f} |" in att
             for h, r in parts.items())
  # A number changed in the JSON changes the page: nothing is copied by hand.
  path = docs / "results" / "bench_train_cpu.json"
  d = json.loads(path.read_text())
  d["rows"][0]["step_ms"] = 12345.6
  path.write_text(json.dumps(d))
  docs_results.write_pages(docs)
  assert "12,345.6" in (docs / "results" / "training-step.md").read_text()


def _nav_pages(nav):
  for item in nav:
    value = next(iter(item.values())) if isinstance(item, dict) else item
    if isinstance(value, list):
      yield from _nav_pages(value)
    else:
      yield value


def test_every_nav_page_exists_or_is_made_before_the_build():
  yaml = pytest.importorskip("yaml", reason="the docs tools: pip install -e '.[docs]'")
  pytest.importorskip("jupytext", reason="the docs tools: pip install -e '.[docs]'")
  import mkdocs_hooks

  class Loader(yaml.SafeLoader):
    pass
  Loader.add_multi_constructor("", lambda loader, suffix, node: None)
  cfg = yaml.load((ROOT / "mkdocs.yml").read_text(), Loader=Loader)
  docs = ROOT / "docs"
  made = ({"index.md"} | {f"results/{p}.md" for p in docs_results.PAGES}
          | {f"tutorials/{p.stem}.md" for p in (docs / "tutorials").glob("*.py")})
  pages = list(_nav_pages(cfg["nav"]))
  assert len(pages) == len(set(pages))
  missing = [p for p in pages if not (docs / p).exists() and p not in made
             and p not in mkdocs_hooks.PENDING]
  assert missing == []
  for p in (docs / "tutorials").glob("*.py"):         # every tutorial is in the nav
    assert f"tutorials/{p.stem}.md" in pages
  for page in (docs / "reference").glob("*.md"):      # and every reference page
    assert f"reference/{page.name}" in pages


def test_every_test_file_the_docs_name_exists():
  """The docs name test files by their path in the package-shaped tests/ tree."""
  pages = [ROOT / "README.md", ROOT / ".ci" / "run", *(ROOT / "docs").rglob("*.md")]
  named = {m for p in pages for m in re.findall(r"tests/[\w/]+\.py", p.read_text())}
  assert "tests/conftest.py" in named and "tests/docs/test_docs.py" in named
  assert sorted(n for n in named if not (ROOT / n).exists()) == []


def test_every_relative_link_in_the_docs_resolves():
  """A page's relative link names a file of the tree or a page made before the build (what
  `mkdocs build --strict` refuses, caught here in seconds)."""
  docs = ROOT / "docs"
  made = ({docs / "index.md"} | {docs / "results" / f"{p}.md" for p in docs_results.PAGES}
          | {docs / "tutorials" / f"{p.stem}.md" for p in (docs / "tutorials").glob("*.py")})
  broken = []
  for page in docs.rglob("*.md"):
    if page in made:
      continue
    for target in re.findall(r"\]\(([^)\s#]+\.md)(?:#[^)]*)?\)", page.read_text()):
      if "://" in target:
        continue
      path = (page.parent / target).resolve()
      if not path.exists() and path not in made:
        broken.append(f"{page.relative_to(ROOT)} -> {target}")
  assert broken == []
