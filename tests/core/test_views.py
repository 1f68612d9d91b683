"""Inline views (mha_jax.views, mha_jax.show): self-contained HTML whose numbers, read
back from the page in Chromium, are the model's and the studies' own."""

import json
import pathlib

import numpy as np
import pytest

import mha_jax
from browser import open_page
from mha_jax import views
from mha_jax.errors import UserError
from mha_jax.toolkit.capture import captured
from mha_jax.roles.role_scores import ROLE_COLORS

ROOT = pathlib.Path(__file__).resolve().parents[2]
PATCHING = str(ROOT / "docs" / "results" / "patching" / "ioi")       # committed results
ROLES = str(ROOT / "docs" / "results" / "taxonomy" / "smollm2")
PROMPTS = ["t5 t9 t3 t7 t5 t9 t3", "t1 t2 t3"]

READ_ROWS = "rows => rows.map(r => [...r.querySelectorAll('td.w')].map(td => +td.dataset.w))"


def offline(html: str) -> bool:
  return not any(s in html for s in ("http://", "https://", "<link", " src="))


def test_show_outside_a_notebook_returns_views_and_prints_params(tiny_hf_run, capsys):
  tr = tiny_hf_run.run(PROMPTS)
  v = mha_jax.show(tr)
  assert isinstance(v, views.View) and offline(v.html)
  formatters = pytest.importorskip("IPython.core.formatters")
  html = formatters.DisplayFormatter().format      # what a notebook shows
  assert html(v)[0]["text/html"] == html(tr)[0]["text/html"] == v.html
  assert "treescope" in html(tiny_hf_run)[0]["text/html"]
  assert mha_jax.show(tiny_hf_run) is None
  out = capsys.readouterr().out
  assert "lm/layer_0/attn/wq  (64, 4, 16)  float32" in out
  assert out.strip().endswith(" numbers")
  data = views.trace_data(tr)
  want = tr["attn.pattern", 1][1][:, :3, :3]
  np.testing.assert_allclose(np.asarray(data["weights"][1]["lm"][1]), want, atol=5e-4 + 1e-7)
  assert data["sentences"][1]["tokens"] == ["t1", "t2", "t3"]
  with pytest.raises(ValueError, match="capture=\\['attn.pattern'\\]"):
    views.trace_data(tiny_hf_run.run(PROMPTS, capture=["attn.z"]))
  with pytest.raises(UserError, match="x: show draws"):
    mha_jax.show(3)
  with pytest.raises(UserError, match="holds no result"):
    mha_jax.show(str(ROOT / "docs"))


def test_every_view_in_chromium_shows_its_own_numbers(tiny_hf_run, tmp_path):
  pytest.importorskip("playwright")
  from playwright.sync_api import sync_playwright
  tr = tiny_hf_run.run(PROMPTS)
  ids = np.concatenate([tr.ids, tr.ids[:, -1:]], axis=1)[:1]
  want = captured(tiny_hf_run.task, tiny_hf_run.params, {"tokens": ids})["lm"][1].weights[0, 2]
  patching = json.load(open(f"{PATCHING}/patching.json"))
  dla = json.load(open(f"{PATCHING}/dla.json"))["heads"]
  roles = json.load(open(f"{ROLES}/roles.json"))["assigned"]
  curve = {"random": [(1, 0.5), (4, 0.8)], "l0": [(1, 0.7), (4, 0.9)]}
  page = (mha_jax.show(tr) + mha_jax.show(PATCHING) + views.roles_table(roles, ROLE_COLORS)
          + views.curves(curve, "c", "kept", "cosine"))
  assert offline(page.html)
  path = page.save(str(tmp_path / "views.html"))
  with sync_playwright() as p:
    browser, pg, errors, requests = open_page(p, path)
    try:
      pg.wait_for_timeout(500)
      attn, patch = [f.content_frame() for f in pg.query_selector_all("iframe")]
      attn.select_option("#layer", "1")
      attn.click("#heads button[data-head='2']")
      rows = attn.eval_on_selector_all("#att tr.row", READ_ROWS)
      np.testing.assert_allclose(np.asarray(rows), want, atol=1e-3)
      cells = patch.eval_on_selector_all("#pgrid td.cell", "cs => cs.map(c => "
                                         "[c.dataset.name, +c.dataset.value])")
      first = next(iter(patching["scores"]))
      assert dict(cells) == pytest.approx(patching["scores"][first], abs=1e-9)
      shown = pg.eval_on_selector_all("tr.bar", "bs => bs.map(b => [b.dataset.name, "
                                      "+b.dataset.value])")
      top = sorted(dla.items(), key=lambda kv: -abs(kv[1]))[:20]
      assert [n for n, _ in shown] == [n for n, _ in top]
      assert dict(shown) == pytest.approx(dict(top))
      cells = pg.eval_on_selector_all("td.role", "cs => cs.map(c => [c.dataset.name, "
                                      "c.dataset.role, getComputedStyle(c).backgroundColor])")
      assert {n: r for n, r, _ in cells} == roles
      colour = {r: c for _, r, c in cells}
      assert len(set(colour.values())) == len(colour)       # one colour per role
      pts = pg.eval_on_selector_all("circle.point", "cs => cs.map(c => [c.dataset.series, "
                                    "+c.dataset.x, +c.dataset.value])")
      assert sorted(map(tuple, pts)) == sorted((k, x, y) for k, s in curve.items() for x, y in s)
      assert errors == [] and requests == []
    finally:
      browser.close()
