"""PNGs of the inline views (`mha_jax.show`) as Chromium draws them, for the docs.

    python scripts/screenshot_views.py --patching DIR --circuit DIR [--out docs/guide/views]

The attention view is a trace of SmolLM2-135M (`mha_jax.load("smollm2-135m")`) on an IOI
prompt; the patching heatmap and DLA bars come from a `mha-jax patch` folder, the circuit
view from a `mha-jax circuit` folder, the roles table from the committed SmolLM2 taxonomy,
the curve from the committed MiniLM pruning curve. Each view is saved alone, opened in
the system Chromium (no network) and written as a PNG of its first screen; a view that
logs a console error or requests anything is refused.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def views_to_draw(patching: str, circuit: str) -> dict:
  """{name: (View, height)} of every view (the trace's model loaded here)."""
  import mha_jax
  from mha_jax import notebook, views
  loaded = mha_jax.load("smollm2-135m")
  tr = loaded.run("When Mary and John went to the store, John gave a drink to")
  dla = json.load(open(os.path.join(patching, "dla.json")))["heads"]
  roles = os.path.join(ROOT, "docs", "results", "taxonomy", "smollm2")
  rows = json.load(open(os.path.join(ROOT, "docs", "results", "real_models",
                                     "minilm_curve_curve.json")))["rows"]
  return {"attention": (mha_jax.show(tr), 900),
          "patching": (notebook.patching_view(patching), 700),
          "dla": (views.bars(dla, "direct logit attribution"), 520),
          "circuit": (notebook.circuit_view(circuit), 760),
          "roles": (mha_jax.show(roles), 620),
          "curve": (notebook.curve_view(rows), 320)}


def shoot(view, height: int, out: str, browser) -> None:
  with tempfile.TemporaryDirectory() as tmp:
    path = view.save(os.path.join(tmp, "view.html"))
    url = "file://" + path
    page = browser.new_page(viewport={"width": 1000, "height": height})
    errors, requests = [], []
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.on("request", lambda r: None if r.url == url else requests.append(r.url))
    page.goto(url)
    page.wait_for_timeout(800)
    page.screenshot(path=out)
    page.close()
  if errors or requests:
    sys.exit(f"{out}: the view logged errors {errors} or made requests {requests}")


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--patching", required=True, help="a `mha-jax patch` folder (with dla.json)")
  p.add_argument("--circuit", required=True, help="a `mha-jax circuit` folder")
  p.add_argument("--out", default=os.path.join(ROOT, "docs", "guide", "views"))
  args = p.parse_args(argv)
  from playwright.sync_api import sync_playwright
  exe = shutil.which("chromium") or shutil.which("chromium-browser")
  if exe is None:
    sys.exit("Chromium is not on PATH")
  todo = views_to_draw(args.patching, args.circuit)
  os.makedirs(args.out, exist_ok=True)
  with sync_playwright() as pw:
    browser = pw.chromium.launch(executable_path=exe, args=[
        "--no-sandbox", "--disable-gpu", "--disable-background-networking"])
    for name, (view, height) in todo.items():
      shoot(view, height, os.path.join(args.out, f"{name}.png"), browser)
      print(f"wrote {args.out}/{name}.png")
    browser.close()
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
