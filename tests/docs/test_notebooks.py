"""Every tutorial in docs/tutorials/ as a notebook: executed in a real Jupyter kernel
(nbclient), converted to HTML (nbconvert), opened offline in Chromium, and read back.

Marked `notebooks` (excluded from the default run; `.ci/run` runs `pytest -m notebooks`
after `pip install -e '.[notebook]'`). In the page: no console error and no request
(nbconvert's lab template less its CDN scripts, tests/docs/offline_lab/); every view
draws; where the tutorial's model is a known one, the attention view of a named head
shows the model's own pattern (`captured` on the prompt tokenised again) to 1e-3; a
patching heatmap's cells are the patching.json the tutorial wrote. Each notebook's time
is printed.
"""

import json
import os
import pathlib
import re
import time

import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCRIPTS = sorted((ROOT / "docs" / "tutorials").glob("*.py"))
# tutorial -> (the known model its attention views show, the heads checked)
MODELS = {"first_ten_minutes": ("smollm2-135m", [(9, 4), (14, 0)]),
          "patch_smollm2": ("smollm2-135m", [(23, 3)])}
LIMIT_S = 900

READ_ROWS = "rows => rows.map(r => [...r.querySelectorAll('td.w')].map(td => +td.dataset.w))"


@pytest.fixture(scope="session")
def model_cache(tmp_path_factory):
  """One model cache for the kernels and this process (each model imported once)."""
  return str(tmp_path_factory.mktemp("models"))


def execute(script, tmp_path, model_cache, monkeypatch) -> tuple:
  """(the executed notebook, seconds): the kernel inherits PYTHONPATH (this checkout),
  TMPDIR (tmp_path) and the model cache."""
  import jupytext
  import nbclient
  monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
      [str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
  monkeypatch.setenv("TMPDIR", str(tmp_path))
  monkeypatch.setenv("MHA_JAX_MODELS", model_cache)
  nb = jupytext.read(script)
  client = nbclient.NotebookClient(nb, timeout=LIMIT_S, kernel_name="python3",
                                   resources={"metadata": {"path": str(ROOT)}})
  t0 = time.time()
  client.execute()
  return nb, time.time() - t0


def to_html(nb, path) -> str:
  import nbconvert
  exporter = nbconvert.HTMLExporter(template_name="offline_lab",
                                    extra_template_basedirs=[str(ROOT / "tests" / "docs")])
  body, _ = exporter.from_notebook_node(nb)
  path.write_text(body, encoding="utf-8")
  return str(path)


def check_attention(frame, name, heads, model_cache) -> float | None:
  """The named heads of the view against `captured` on its prompt tokenised again: the
  tolerance they were checked to; None when the view's tokens are not a prompt's
  (random tokens do not survive re-tokenising)."""
  import mha_jax
  from mha_jax import traces
  from mha_jax.toolkit.capture import captured
  loaded = mha_jax.load(name, cache=model_cache, log=lambda s: None)
  switch = frame.query_selector("#views button[data-view='attention']")
  # a trace's view keeps 3 places; a patching or circuit page's attention view 2
  # (activation_patching.attention_data): half a unit of the last place
  atol = 5e-3 + 1e-6 if switch else 1e-3
  if switch:
    switch.click()
  tokens = frame.evaluate("D.sentences[+document.getElementById('sent').value].tokens")
  ids = traces.prompt_ids(loaded.task, "".join(tokens))
  if traces.token_strings(loaded.task, ids) != tokens:
    return None
  batch = {"tokens": np.asarray([ids + ids[-1:]], np.int32)}
  cap = captured(loaded.task, loaded.params, batch)["lm"]
  for layer, head in heads:
    frame.select_option("#layer", str(layer))
    frame.click(f"#heads button[data-head='{head}']")
    shown = np.asarray(frame.eval_on_selector_all("#att tr.row", READ_ROWS))
    np.testing.assert_allclose(shown, cap[layer].weights[0, head], atol=atol,
                               err_msg=f"lm.{layer}.{head}")
  return atol


def check_page(path, stem, tmp_path, model_cache):
  from playwright.sync_api import sync_playwright
  from browser import open_page
  with sync_playwright() as p:
    browser, page, errors, requests = open_page(p, path)
    try:
      page.wait_for_timeout(1000)
      frames = [f.content_frame() for f in page.query_selector_all("iframe.mha-jax-view")]
      checked = []
      for frame in frames:
        assert frame.query_selector("h2"), "a view drew nothing"
        if frame.query_selector("#att tr.row") and stem in MODELS:
          checked.append(check_attention(frame, *MODELS[stem], model_cache))
        if frame.query_selector("#pgrid td.cell"):
          docs = list(tmp_path.rglob("patching.json"))
          assert len(docs) == 1, docs
          scores = json.loads(docs[0].read_text())["scores"]
          cells = frame.eval_on_selector_all("#pgrid td.cell", "cs => cs.map(c => "
                                             "[c.dataset.name, +c.dataset.value])")
          assert dict(cells) == pytest.approx(scores[next(iter(scores))], abs=1e-9)
      if stem in MODELS:
        assert 1e-3 in checked, "no trace's attention view of a prompt was checked to 1e-3"
      drawn = page.query_selector_all(".mha-jax-view")   # frames, bars, roles, curves, params
      assert drawn, "the notebook shows no view"
      for v in drawn:
        assert v.bounding_box() and v.bounding_box()["height"] > 20, "a view drew nothing"
      assert errors == [], errors
      assert requests == [], requests
      return len(drawn)
    finally:
      browser.close()


def code_lines(block: str) -> int:
  return sum(1 for line in block.splitlines() if line.strip() and not line.strip().startswith("#"))


def test_the_guide_counts_the_lines_it_shows():
  # docs/guide/notebooks.md: the IOI head study here and in TransformerLens, and its table
  page = (ROOT / "docs" / "guide" / "notebooks.md").read_text()
  section = page[page.index("## The IOI head study"):]
  ours, peer = [code_lines(b) for b in re.findall(r"```python\n(.*?)```", section, re.S)]
  assert f"mha-jax ({ours} lines)" in section and f"TransformerLens ({peer} lines)" in section
  assert f"comments and blank lines not) | {ours} | {peer} |" in section


@pytest.mark.notebooks
@pytest.mark.parametrize("script", SCRIPTS, ids=[p.stem for p in SCRIPTS])
def test_tutorial_as_a_notebook(script, tmp_path, model_cache, monkeypatch):
  pytest.importorskip("nbclient")
  pytest.importorskip("nbconvert")
  nb, seconds = execute(script, tmp_path, model_cache, monkeypatch)
  t0 = time.time()
  path = to_html(nb, tmp_path / f"{script.stem}.html")
  views = check_page(path, script.stem, tmp_path, model_cache)
  print(f"{script.name}: executed in {seconds:.1f} s, {views} views checked in "
        f"{time.time() - t0:.1f} s")
  outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]
  assert not [o for o in outputs if o.get("output_type") == "error"]
