"""The pages the studies write (the explorer) as package data: NAME.html with NAME.css
and NAME.js, read through importlib.resources and put together into one self-contained
file (no network request), the data injected as JSON. Another package's pages (the
experiment harness's primer) are put together the same way (`package=`)."""

from __future__ import annotations

import json
import re
from importlib import resources

PAGES = ("explorer",)


def read(name: str, package: str = __name__) -> str:
  """The text of one asset file of `package`, e.g. read("explorer.js")."""
  return resources.files(package).joinpath(name).read_text(encoding="utf-8")


def json_for_script(data) -> str:
  """`data` as JSON that is safe inside a script element ("</" cannot end it)."""
  return json.dumps(data, separators=(",", ":")).replace("</", "<\\/")


def page(name: str, data, *, package: str = __name__, **values: str) -> str:
  """assets/NAME.html with its CSS, JS, the JSON of `data` and `values` (already
  HTML-escaped by the caller) put in place of {{css}}, {{js}}, {{data}}, {{key}}, in one
  pass: nothing inserted is read for placeholders again."""
  if package == __name__ and name not in PAGES:
    raise ValueError(f"name must be one of {PAGES}; got {name!r}")
  fill = {"css": read(f"{name}.css", package), "js": read(f"{name}.js", package),
          "data": json_for_script(data), **values}
  template = read(f"{name}.html", package)
  missing = set(re.findall(r"{{(\w+)}}", template)) - set(fill)
  if missing:
    raise ValueError(f"page {name!r} needs values for {sorted(missing)}")
  return re.sub(r"{{(\w+)}}", lambda m: fill[m.group(1)], template)
