"""A PNG of an explorer page as a browser draws it (for the docs).

    python scripts/screenshot_explorer.py PAGE.html OUT.png [--table ID] [--hover NAME]
                                          [--width 1100] [--height 900]

Opens the page in the system Chromium through playwright (no network), picks the score
table, hovers one cell (a head name such as lm.23.3) and writes the visible part of the
page. Refuses a page that logs a console error or requests anything.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("page")
  p.add_argument("out")
  p.add_argument("--table", default=None, help="a score table id, e.g. patch.head_out")
  p.add_argument("--hover", default=None, help="a cell's name, e.g. lm.23.3")
  p.add_argument("--width", type=int, default=1100)
  p.add_argument("--height", type=int, default=900)
  args = p.parse_args(argv)
  from playwright.sync_api import sync_playwright
  exe = shutil.which("chromium") or shutil.which("chromium-browser")
  if exe is None:
    sys.exit("Chromium is not on PATH")
  url = "file://" + os.path.abspath(args.page)
  with sync_playwright() as pw:
    browser = pw.chromium.launch(executable_path=exe, args=[
        "--no-sandbox", "--disable-gpu", "--disable-background-networking"])
    page = browser.new_page(viewport={"width": args.width, "height": args.height})
    errors, requests = [], []
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.on("request", lambda r: None if r.url == url else requests.append(r.url))
    page.goto(url)
    if args.table:
      page.select_option("#ptable", args.table)
    if args.hover:
      page.hover(f"#pgrid td.cell[data-name='{args.hover}']")
    page.screenshot(path=args.out)
    browser.close()
  if errors or requests:
    sys.exit(f"the page logged errors {errors} or made requests {requests}")
  print(f"wrote {args.out}")
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
