"""The primer's figures (mha_jax/harness/claims/primer.py) against independent computations, and
the page in a real browser: the four matrices, the seven lines at the zoo's widths,
Voita's pruning grid, the natural-text model's circuit."""

import json
import os

import jax
import numpy as np
import pytest

from mha_jax import accounting, assets
from mha_jax import attention
from mha_jax.toolkit import capture
from mha_jax.harness.claims import measure
from mha_jax.harness.claims import primer
from mha_jax.errors import UserError
from browser import open_page


def test_the_four_matrices_are_the_layer_and_run_the_seven_lines_in_numpy():
  params = measure.init_params(jax.random.PRNGKey(0), 8, 4)
  m = primer.four_matrices(params)
  assert m["d_model"] == 8 and m["d_k"] == 2 and m["cuts"] == {"1": 8, "2": 4, "4": 2, "8": 1}
  mats = {k: np.asarray(v) for k, v in m["matrices"].items()}
  assert all(v.shape == (8, 8) for v in mats.values())
  # The textbook's layer on the four D x D matrices, heads as column (row) blocks of
  # width d_k, equals the attention function on the stored (D, H, K) params.
  x = np.asarray(jax.random.normal(jax.random.PRNGKey(1), (5, 8)), np.float64)
  full = {k: np.asarray(params[f"w{k[-1].lower()}"], np.float64).reshape(8, 8)
          for k in ("W_Q", "W_K", "W_V", "W_O")}
  np.testing.assert_allclose(mats["W_Q"], full["W_Q"], atol=6e-4)     # shown to 3 places
  q, k, v = (x @ full[n] for n in ("W_Q", "W_K", "W_V"))
  heads = []
  for h in range(4):
    b = slice(2 * h, 2 * h + 2)
    s = q[:, b] @ k[:, b].T / np.sqrt(2)
    w = np.exp(s - s.max(-1, keepdims=True))
    heads.append((w / w.sum(-1, keepdims=True)) @ v[:, b])
  y = np.concatenate(heads, -1) @ full["W_O"]
  got = attention.multi_head_attention(params, x[None].astype(np.float32))[0]
  np.testing.assert_allclose(got, y, atol=1e-5)
  with pytest.raises(ValueError, match="params must be one standard layer"):
    primer.four_matrices({**params, "wo": params["wo"][:, :1]})


def test_the_seven_lines_run_at_zoo_widths_with_accountings_shapes():
  entries = [e for e in accounting.ZOO if e.name in ("Transformer-base", "LLaMA-3 8B")]
  rows = primer.seven_lines_zoo(entries=entries)
  zoo = {r["model"]: r for r in accounting.zoo_rows(seq_len=4)}
  for r in rows:
    z = zoo[r["model"]]
    assert (r["d_model"], r["heads"], r["kv_heads"], r["d_k"]) == (
        z["d_model"], z["heads"], z["kv_heads"], z["d_k"])
    assert r["output_shape"] == r["input_shape"] == [1, 4, z["d_model"]]
    assert r["params"] == z["params"] == r["params_formula"]
    assert r["stored"]["wk"] == [z["d_model"], z["kv_heads"], z["d_k"]]
    assert 1.0 <= r["flops"] / (z["gflops"] * 1e9) < 1.01    # matmuls + softmax, scaling
  code = primer.seven_lines_code()
  assert len(code) == 7 and code[0].startswith("q_BTD = ") and code[-1].startswith("y_BTD = ")


def _planted_translation(tmp_path, log_alpha, kept, roles):
  wd = tmp_path / "wd"
  (wd / "analysis").mkdir(parents=True)
  rows = [{"head": f"encoder.{l}.{h}", "role": roles[l][h]} for l in range(2)
          for h in range(4)] + [{"head": "decoder_self.0.0", "role": "positional"}]
  (wd / "analysis" / "heads.json").write_text(json.dumps(rows))
  (wd / "pruned_l0").mkdir()
  (wd / "pruned_l0" / "pruning.json").write_text(json.dumps({
      "source": str(wd), "method": "l0", "kept_heads": kept, "base": {"bleu": 30.0},
      "after": {"bleu": 28.5}, "log_alpha": {"encoder": log_alpha}}))
  return str(wd)


ROLES = [["positional", "other", "syntactic", "other"], ["rare", "other", "other", "syntactic"]]
LOG_ALPHA = [[3.0, -2.0, 1.5, -0.5], [2.0, 0.1, -1.0, 0.7]]
KEPT = ["encoder.0.0", "encoder.1.0", "encoder.0.2"]        # the top 3 of LOG_ALPHA


def test_the_pruning_grid_is_the_prune_result(tmp_path):
  wd = _planted_translation(tmp_path, LOG_ALPHA, KEPT, ROLES)
  ctx = measure.Context(out=str(tmp_path / "out"))
  found = primer.find_pruned(ctx, wd)
  assert found == os.path.join(wd, "pruned_l0")
  g = primer.pruning_grid(wd, found)
  assert (g["layers"], g["heads"]) == (2, 4) and g["kept"] == KEPT     # strongest gate first
  flat = {f"encoder.{l}.{h}": v for l, row in enumerate(LOG_ALPHA) for h, v in enumerate(row)}
  gone = sorted((n for n in flat if n not in KEPT), key=flat.get)    # lowest gate first
  assert list(g["removed_rank"]) == gone and list(g["removed_rank"].values()) == [1, 2, 3, 4, 5]
  assert g["roles_kept"] == {"other": 0, "positional": 1, "rare": 1, "syntactic": 1}
  assert g["specialised_share_kept"] == 1.0 and g["specialised_share_all"] == 0.5
  assert (g["bleu_all"], g["bleu_kept"]) == (30.0, 28.5) and "decoder_self.0.0" not in g["roles"]
  # A prune-curve folder: kept at 3, ranks by the curve's steps.
  curve = tmp_path / "curve"
  curve.mkdir()
  rows = [{"method": "l0", "kept": 8, "kept_heads": list(flat)},
          {"method": "l0", "kept": 5, "kept_heads": KEPT + ["encoder.1.3", "encoder.1.1"]},
          {"method": "l0", "kept": 3, "kept_heads": KEPT, "bleu": 27.0},
          {"method": "l0", "kept": 1, "kept_heads": KEPT[:1]},
          {"method": "random", "kept": 3, "kept_heads": list(flat)[:3]}]
  (curve / "curve.json").write_text(json.dumps({"rows": rows}))
  c = primer.pruning_grid(wd, str(curve), keep=3)
  assert sorted(c["kept"]) == sorted(KEPT) and c["bleu_kept"] == 27.0
  assert c["removed_rank"] == {"encoder.0.1": 1, "encoder.0.3": 1, "encoder.1.2": 1,
                               "encoder.1.1": 2, "encoder.1.3": 2}
  with pytest.raises(UserError, match="no l0 row keeping 4 heads"):
    primer.pruning_grid(wd, str(curve), keep=4)
  with pytest.raises(UserError, match="has no pruning.json or curve.json"):
    primer.find_pruned(ctx, wd, str(tmp_path))


@pytest.fixture(scope="module")
def text_lm(tiny_attn_lm):
  """A 2-step two-layer attention-only LM (the natural-text model's shape, tiny)."""
  return tiny_attn_lm[0]


def test_the_text_circuit_against_numpy(text_lm):
  from mha_jax.loader import load
  from mha_jax.roles import behaviour
  t = primer.text_circuit(text_lm, samples=20)
  loaded = load(text_lm)
  # The previous-token head: layer 0's largest mean weight on t-1, from the patterns.
  tokens, _ = behaviour.eval_tokens(loaded, 16)
  w0 = np.asarray(capture.captured(loaded.task, loaded.params, {"tokens": tokens})["lm"][0].weights)
  prev = w0[:, :, np.arange(1, w0.shape[2]), np.arange(w0.shape[2] - 1)].mean((0, 2))
  assert t["previous_token_head"] == f"lm.0.{int(np.argmax(prev))}"
  il, ih = (int(v) for v in t["induction_head"].split(".")[1:])
  assert il == 1
  # The K-composition row + the baseline = |Wq2 Wk2^T (Wv1 Wo1)^T|_F / (|.|_F |.|_F).
  a2 = loaded.params["lm"]["layer_1"]["attn"]
  wqk = np.asarray(a2["wq"][:, ih], np.float64) @ np.asarray(a2["wk"][:, ih], np.float64).T
  a1 = loaded.params["lm"]["layer_0"]["attn"]
  for h in range(a1["wq"].shape[1]):
    wov = np.asarray(a1["wv"][:, h], np.float64) @ np.asarray(a1["wo"][h], np.float64)
    raw = np.linalg.norm(wqk @ wov.T) / (np.linalg.norm(wqk) * np.linalg.norm(wov))
    assert t["k_composition"][f"lm.0.{h}"] + t["k_composition_baseline"] == pytest.approx(
        raw, abs=1e-9)
  pat = np.asarray(t["patterns"][t["induction_head"]])
  assert pat.shape == (16, 16) and np.triu(pat, 1).max() == 0
  np.testing.assert_allclose(pat.sum(-1), 1.0, atol=0.01)


@pytest.mark.slow
def test_the_new_figures_in_a_real_browser(tmp_path, text_lm):
  wd = _planted_translation(tmp_path, LOG_ALPHA, KEPT, ROLES)
  ctx = measure.Context(out=str(tmp_path / "out"))
  ctx.cache["seven_lines_zoo"] = primer.seven_lines_zoo(entries=accounting.ZOO[:2])
  path = str(tmp_path / "primer.html")
  data = primer.write(ctx, path, pruning_workdir=wd, text_workdir=text_lm)
  html = open(path).read()
  assert "http" not in html and "<link" not in html and "src=" not in html
  assert json.loads(html.split('<script id="data" type="application/json">', 1)[1]
                    .split("</script>", 1)[0]) == json.loads(json.dumps(data))
  assert data["sentence"] == list(measure.SENTENCE)
  assert data["cost"]["params"] == [4 * 768 * 768] * len(measure.COST_HEADS)
  playwright = pytest.importorskip("playwright.sync_api")
  with playwright.sync_playwright() as p:
    browser, page, errors, requests = open_page(p, path)

    def set_range(sel, v):
      page.eval_on_selector(sel, f"e => {{ e.value = '{v}'; e.dispatchEvent(new Event('input')); }}")

    def bar_values(svg):
      return page.eval_on_selector_all(f"#{svg} rect.bar", "rs => rs.map(r => +r.dataset.v)")

    # the thought experiment's sliders
    before = bar_values("s-query")
    assert before[:6] == pytest.approx(data["weights"][0][4], abs=1e-4)
    set_range("#q", 2)
    after = bar_values("s-query")
    assert after != before and after[:6] == pytest.approx(data["weights"][0][2], abs=1e-4)
    set_range("#mix", 10)
    assert max(bar_values("s-mix")) == pytest.approx(data["mixture"]["peak"][10], abs=1e-4)
    text0 = page.inner_text("#dkval")
    set_range("#dk", 7)
    assert page.inner_text("#dkval") != text0
    cut0 = page.inner_html("#s-cut")
    set_range("#h", 0)
    assert page.inner_html("#s-cut") != cut0 and "d_k = 8" in page.inner_text("#hval")
    # the closing figures

    for i, (h, dk) in enumerate(data["matrices"]["cuts"].items()):
      set_range("#hm", i)
      for name, mat in data["matrices"]["matrices"].items():
        cells = page.eval_on_selector_all(
            f"#s-mats rect.mcell[data-m='{name}']", "rs => rs.map(r => [+r.dataset.i, "
            "+r.dataset.j, +r.dataset.v])")
        assert cells == [[i_, j, v] for i_, row in enumerate(mat) for j, v in enumerate(row)]
        at = page.eval_on_selector_all(f"#s-mats line.block[data-m='{name}']",
                                       "ls => ls.map(l => +l.dataset.at)")
        assert at == list(range(0, 9, dk)), (h, name)
    outs = page.eval_on_selector_all("#zoo tr.zrow td.out", "ts => ts.map(t => t.textContent)")
    assert outs == [json.dumps([1, 4, e.d_model]).replace(" ", "") for e in accounting.ZOO[:2]]
    assert page.inner_text("#code").splitlines() == primer.seven_lines_code()
    ranks = dict(page.eval_on_selector_all("#s-prune rect.phead", "rs => rs.map(r => "
                                           "[r.dataset.head, r.dataset.rank])"))
    assert sorted(n for n, r in ranks.items() if r == "") == sorted(KEPT)
    assert {n: int(r) for n, r in ranks.items() if r} == data["pruning"]["removed_rank"]
    kept = page.eval_on_selector_all("#s-prune rect.kept", "rs => rs.map(r => r.dataset.head)")
    assert sorted(kept) == sorted(KEPT)
    set_range("#pr", 2)
    faded = page.eval_on_selector_all("#s-prune rect.phead", "rs => rs.filter(r => "
                                      "r.getAttribute('opacity') < 1).map(r => r.dataset.head)")
    assert sorted(faded) == sorted(list(data["pruning"]["removed_rank"])[:2])
    t = data["text_circuit"]
    shown = page.eval_on_selector_all(f"#s-text rect.tcell[data-head='{t['induction_head']}']",
                                      "rs => rs.map(r => +r.dataset.v)")
    assert shown == [v for row in t["patterns"][t["induction_head"]] for v in row]
    bars = page.eval_on_selector_all("#s-text rect.bar", "rs => rs.map(r => +r.dataset.v)")
    heads = len(t["k_composition"])
    assert bars[:heads] == pytest.approx(list(t["k_composition"].values()), abs=1e-5)
    assert bars[heads:] == pytest.approx(
        [t["previous_token_all"][f"lm.0.{h}"] for h in range(heads)]
        + [t["prefix_matching_all"][f"lm.1.{h}"] for h in range(heads)], abs=1e-5)
    assert errors == [] and requests == []
    browser.close()
  assert assets.read("primer.js", primer.ASSETS).strip() in html


@pytest.mark.slow    # the seven lines at every zoo width (GPT-3's 12288 included)
def test_the_primer_verb_writes_the_page_once(tmp_path, text_lm, capsys):
  from mha_jax import cli
  wd = _planted_translation(tmp_path, LOG_ALPHA, KEPT, ROLES)
  out = str(tmp_path / "page")
  argv = ["primer", "--out", out, "--pruning-workdir", wd, "--text-workdir", text_lm]
  path, html, data = _primer_page(cli, argv, out, capsys)
  assert sorted(data["pruning"]["kept"]) == sorted(KEPT)
  assert (data["pruning"]["bleu_all"], data["pruning"]["bleu_kept"]) == (30.0, 28.5)
  assert data["text_circuit"]["induction_head"].startswith("lm.1.")
  assert [r["params"] for r in data["seven_lines"]["rows"]] == [
      z["params"] for z in accounting.zoo_rows()]
  _second_run_refused(cli, argv, path, html, capsys)


def _primer_page(cli, argv, out, capsys):
  """(path, html, the page's data) of `mha-jax primer` run through the CLI: it prints
  the path it wrote and the page carries the sentence."""
  assert cli.main(argv) == 0, capsys.readouterr().err
  path = os.path.join(out, "primer.html")
  assert capsys.readouterr().out.strip() == f"wrote {path}"
  html = open(path).read()
  data = json.loads(html.split('<script id="data" type="application/json">', 1)[1]
                    .split("</script>", 1)[0])
  assert data["sentence"] == list(measure.SENTENCE)
  return path, html, data


def _second_run_refused(cli, argv, path, html, capsys):
  """A second run never overwrites the page."""
  assert cli.main(argv) == 2
  assert "already has primer.html; refusing to overwrite it" in capsys.readouterr().err
  assert open(path).read() == html


def test_the_primer_verb_on_no_runs_writes_the_page_once(tmp_path, monkeypatch, capsys):
  """`mha-jax primer --out` through the CLI, in the default run: the page from the
  measured sections alone (no runs given). The seven lines run at the zoo's two smallest
  widths here (every width, GPT-3's included, is the slow test above)."""
  from mha_jax import cli
  small = sorted(accounting.ZOO, key=lambda e: e.d_model)[:2]
  whole = primer.seven_lines_zoo
  monkeypatch.setattr(primer, "seven_lines_zoo", lambda: whole(entries=small))
  out = str(tmp_path / "page")
  path, html, data = _primer_page(cli, ["primer", "--out", out], out, capsys)
  assert "pruning" not in data and "text_circuit" not in data
  rows = data["seven_lines"]["rows"]
  assert [r["model"] for r in rows] == [e.name for e in small]
  for r in rows:
    assert r["params"] == r["params_formula"]
    assert r["output_shape"] == r["input_shape"] == [1, 4, r["d_model"]]
  _second_run_refused(cli, ["primer", "--out", out], path, html, capsys)
