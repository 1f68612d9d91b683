"""Pages out of Python: the explorer (mha_jax/assets/) and the harness's primer
(mha_jax/harness/claims/primer_assets/) are package data, put together by assets.page with the data
injected as JSON."""

import ast
import configparser
import json
import pathlib
import re

import pytest

from mha_jax import assets
import sources

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("name,package", [(n, "mha_jax.assets") for n in assets.PAGES] +
                         [("primer", "mha_jax.harness.claims.primer_assets")])
def test_a_page_is_one_self_contained_file_with_its_data(name, package):
  data = {"text": "a </script><script>alert(1)</script> b", "n": [1, 2.5]}
  page = assets.page(name, data, package=package, title="t &amp; u")
  assert not re.search(r"{{\w+}}", page)
  assert assets.read(f"{name}.css", package).strip() in page
  assert assets.read(f"{name}.js", package).strip() in page
  blob = page.split('<script id="data" type="application/json">', 1)[1].split("</script>", 1)[0]
  assert json.loads(blob) == data                  # the data, and it cannot end the script
  assert "http" not in page and "<link" not in page and "src=" not in page


def test_placeholders_are_filled_once_and_checked():
  page = assets.page("explorer", {"x": "{{js}}"}, title="{{data}}")
  assert '"{{js}}"' in page and "explorer: {{data}}" in page   # inserted text stays as is
  with pytest.raises(ValueError, match=r"needs values for \['title'\]"):
    assets.page("explorer", {})
  with pytest.raises(ValueError, match="name must be one of"):
    assets.page("nope", {})


def test_no_page_lives_in_a_python_string_and_the_assets_are_package_data():
  for path in (ROOT / "mha_jax").rglob("*.py"):
    for node in ast.walk(sources.tree(path)):
      if isinstance(node, ast.Constant) and isinstance(node.value, str):
        assert "<!doctype" not in node.value.lower() and "<script" not in node.value, path
  cfg = configparser.ConfigParser()
  cfg.read(ROOT / "setup.cfg")
  for package, names in (("mha_jax.assets", assets.PAGES),
                         ("mha_jax.harness.claims.primer_assets", ("primer",))):
    patterns = cfg["options.package_data"][package]
    for ext in ("html", "css", "js"):
      assert f"*.{ext}" in patterns
    for name in names:
      for ext in ("html", "css", "js"):
        assert (ROOT.joinpath(*package.split(".")) / f"{name}.{ext}").is_file()
