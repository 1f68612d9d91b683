"""The browser the page tests use: the system's Chromium (CI installs it in .ci/run; no
test installs anything)."""

import shutil

import pytest

def chromium_path():
  """Chromium from the system (CI installs it in .ci/run; tests install nothing)."""
  return shutil.which("chromium") or shutil.which("chromium-browser")


def launch_chromium(playwright):
  """Headless system Chromium with no background networking; skips when it is missing."""
  exe = chromium_path()
  if exe is None:
    pytest.skip("Chromium is not on PATH (CI installs it in .ci/run; locally, install "
                "Debian's chromium package)")
  return playwright.chromium.launch(executable_path=exe, args=[
      "--no-sandbox", "--disable-gpu", "--disable-background-networking",
      "--disable-component-update", "--disable-sync", "--no-first-run"])


def open_page(playwright, path):
  """(browser, page, errors, requests): `path` opened in launch_chromium, with console
  and page errors and every request but the page's own recorded."""
  browser = launch_chromium(playwright)
  page = browser.new_page()
  errors, requests = [], []
  page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
  page.on("pageerror", lambda e: errors.append(str(e)))
  url = "file://" + path
  page.on("request", lambda r: None if r.url == url else requests.append(r.url))
  page.goto(url)
  return browser, page, errors, requests
