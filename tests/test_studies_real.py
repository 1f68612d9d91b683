"""Studies on the real imported models (SmolLM2-135M sliced to its first layers,
all-MiniLM-L6-v2), through the same commands and modules as models trained here."""

import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mha_jax
from mha_jax.analysis import explorer, importance, report
from mha_jax.circuits import scores
from mha_jax.models import common as C
from mha_jax.pruning import masks as M
from mha_jax.pruning import methods
from mha_jax.pruning import run as prune_run

pytestmark = pytest.mark.xdist_group("pretrained")
LAYERS = 30


def _imported(src: str, d, eval_cfg):
  """A copy of a freshly imported real model (conftest), evaluated on small batches."""
  shutil.copytree(src, str(d / "w"))
  path = str(d / "w" / "config.json")
  with open(path) as f:
    cfg = json.load(f)
  cfg["eval"] = eval_cfg
  with open(path, "w") as f:
    json.dump(cfg, f)
  return mha_jax.load(str(d / "w"))


@pytest.fixture(scope="session")
def smol(smollm2_workdir, tmp_path_factory):
  """SmolLM2-135M, all 30 layers (270 query heads, 90 kv heads), on short windows: a
  prefix of its layers would not predict tokens (its strongest induction heads sit in
  layers 17-23)."""
  return _imported(smollm2_workdir, tmp_path_factory.mktemp("studies_smol"),
                   {"batch_size": 2, "seq_len": 32, "windows": 4})


@pytest.fixture(scope="session")
def minilm(minilm_workdir, tmp_path_factory):
  return _imported(minilm_workdir, tmp_path_factory.mktemp("studies_minilm"),
                   {"batch_size": 8, "seq_len": 48, "windows": 16})


@pytest.fixture(scope="session")
def smol_rows(smol):
  return report.real_lm_roles(smol, "test", batches=1, batch_size=4, half_len=16,
                              text_windows=4)


def test_real_lm_roles_score_every_head(smol, smol_rows):
  assert len(smol_rows) == LAYERS * 9 == len(smol.head_names)
  for r in smol_rows:
    for k in ("previous_token", "duplicate_token", "induction", "sink_share"):
      assert 0.0 <= r[k] <= 1.0 + 1e-6, (r["head"], k)
    assert 0.0 <= r["entropy"] <= np.log(32) + 1e-6
  # a real LM has a strong previous-token head in its first layers, and attention sinks
  assert max(r["previous_token"] for r in smol_rows) > 0.5
  assert max(r["sink_share"] for r in smol_rows) > 0.5
  # repeated random tokens: the repeated half is predicted far better than the first
  rep = importance.repeated_loss(smol, batch=4, half_len=16)
  assert rep["loss_repeat"] < rep["loss_first"] - 1.0


def test_top_induction_head_costs_more_repeat_loss_than_random_heads_of_its_layer(
    smol, smol_rows):
  top = max(smol_rows, key=lambda r: r["induction"])
  base = importance.repeated_loss(smol, batch=4, half_len=16)["loss_repeat"]
  def cost(name):
    g = importance.gates_without(smol.params, importance.parse_heads(smol.params, [name]))
    return importance.repeated_loss(smol, gates=g, batch=4, half_len=16)["loss_repeat"] - base
  others = [r["head"] for r in smol_rows if r["layer"] == top["layer"] and r is not top]
  rng = np.random.default_rng(0)
  rand = [cost(n) for n in rng.choice(others, 3, replace=False)]
  assert cost(top["head"]) > max(rand), (top["head"], rand)


def test_gqa_head_matrices_and_factored_scores(smol):
  attn = smol.params["lm"]["layer_1"]["attn"]
  m = scores.head_matrices(attn, 4)             # 9 query heads, 3 kv heads: kv head 1
  np.testing.assert_array_equal(m["Wk"], np.asarray(attn["wk"][:, 1], np.float64))
  np.testing.assert_array_equal(m["Wq"], np.asarray(attn["wq"][:, 4], np.float64))
  early = scores.head_matrices(smol.params["lm"]["layer_0"]["attn"], 2)
  for kind in "qkv":
    full = scores.composition(*scores.pair_matrices(kind, early, m))
    assert scores.composition_factored(kind, early, m) == pytest.approx(full, rel=1e-9)
  partners = scores.k_composition_partners(smol.params, (2, 0), samples=5)
  assert sorted(partners) == [f"lm.{l}.{h}" for l in range(2) for h in range(9)]


def test_ov_positivity_through_the_small_factor_equals_the_vocab_matrix():
  rng = np.random.default_rng(0)
  v, d, k = 40, 12, 3
  attn = {"wq": rng.standard_normal((d, 4, k)), "wk": rng.standard_normal((d, 2, k)),
          "wv": rng.standard_normal((d, 2, k)), "wo": rng.standard_normal((4, k, d))}
  params = {"embed": rng.standard_normal((v, d)), "lm": {"layer_0": {"attn": attn}}}
  e, u = params["embed"], params["embed"].T            # tied embeddings
  full = e @ attn["wv"][:, 1] @ attn["wo"][3] @ u      # query head 3 reads kv head 1
  ev = np.linalg.eigvals(full)
  want = float(np.real(ev.sum()) / np.abs(ev).sum())
  assert scores.ov_positivity(params, "lm", 0, 3) == pytest.approx(want, abs=1e-8)


def test_gqa_export_removes_kv_heads_and_matches_the_masked_model(smol):
  mask = {"lm": [np.ones(9, np.float32) for _ in range(LAYERS)]}
  mask["lm"][0][[0, 1, 2]] = 0      # all of kv group 0: the kv head goes
  mask["lm"][1][[0, 4]] = 0         # uneven groups: padded with zero-output heads
  mask["lm"][2][:] = 0              # the whole layer
  masked = M.mask_params(smol.params, mask)
  pruned = M.export_pruned(masked, mask)
  counts = [int(p["wq"].shape[1]) for _, _, p in C.attention_blocks(pruned)]
  kv = [int(p["wk"].shape[1]) for _, _, p in C.attention_blocks(pruned)]
  assert counts[:3] == [6, 9, 0] and kv[:3] == [2, 3, 0]
  # layer 1 keeps groups {1, 2}, {3, 5}, {6, 7, 8}: heads 0 and 4 stay as padding
  assert [list(x) for x in M.exported_mask(masked, mask)["lm"][:2]] == [
      [1] * 6, [1, 1, 0, 1, 1, 0, 1, 1, 1]]
  batch = {"tokens": smol.model.windows("test")[:2]}
  a = np.asarray(smol.model.apply(masked, batch))
  b = np.asarray(smol.model.apply(pruned, batch))
  np.testing.assert_allclose(a, b, atol=2e-3, rtol=1e-4)
  gated = np.asarray(smol.model.apply(smol.params, batch, gates=M.full_gates(
      smol.params, mask)))
  np.testing.assert_allclose(a, gated, atol=2e-3, rtol=1e-4)


@pytest.mark.slow    # the gate step compiles a backward pass of all 30 layers (minutes)
def test_prune_and_export_an_imported_lm(smol, tmp_path):
  out = str(tmp_path / "random")
  info = prune_run.prune(smol.workdir, out, method="random", keep=20, stacks=["lm"],
                         log=lambda s: None, loaded=smol)
  assert info["kept"] == 20 and info["after"]["loss"] > info["base"]["loss"]
  ex = prune_run.export(out, str(tmp_path / "exported"), log=lambda s: None)
  assert ex["max_abs_diff_vs_masked"] < 2e-3
  assert sum(ex["head_counts"]["lm"]) >= 20 and ex["forward_speed"]["speedup"] > 0
  # L0 gates train on the built-in text's train split, the model frozen
  la, params, hist = methods.train_gates(smol, 0.05, stacks=["lm"], steps=2,
                                         log=lambda s: None)
  assert np.isfinite(hist[-1]["loss"])
  np.testing.assert_array_equal(params["lm"]["layer_0"]["attn"]["wq"],
                                smol.params["lm"]["layer_0"]["attn"]["wq"])   # frozen
  assert not np.allclose(np.asarray(la["lm"][0]), 2.0)


def test_bert_roles_importance_and_cosine_pruning(minilm, tmp_path):
  rows = report.embedding_roles(minilm, "test")
  assert len(rows) == 72
  for r in rows:
    assert 0 <= r["cls_share"] <= 1 + 1e-6 and 0 <= r["sep_share"] <= 1 + 1e-6
    if r["role"] == "sep":
      assert r["sep_share"] >= 0.5
  roles = {r["role"] for r in rows}
  assert "positional" in roles and roles & {"cls", "sep"}
  minilm.model.set_reference(minilm.params)
  imp = importance.michel_importance(minilm, "valid", limit=8)
  assert len(imp["raw"]) == 72 and min(imp["raw"].values()) >= 0
  assert np.mean(list(imp["raw"].values())) > 0     # the cosine loss alone would give 0s
  full = minilm.model.evaluate(minilm.params, "test")
  assert full["cosine_to_full"] == pytest.approx(1.0, abs=1e-5)
  info = prune_run.prune(minilm.workdir, str(tmp_path / "p"), method="random", keep=24,
                         stacks=["encoder"], log=lambda s: None, loaded=minilm)
  assert 0.0 < info["after"]["cosine_to_full"] < 0.999


def test_explorer_model_and_head_view_in_a_real_browser(smol, smol_rows, tmp_path):
  from test_analysis import launch_chromium
  path = str(tmp_path / "explorer.html")
  data = explorer.write(smol, smol_rows, path)
  text = open(path).read()
  assert "http" not in text.replace("http-equiv", "")          # no network at all
  assert len(text) < 5e6
  assert len(data["weights"][0]["lm"]) == LAYERS and len(data["sentences"]) == 3
  playwright = pytest.importorskip("playwright.sync_api")
  with playwright.sync_playwright() as p:
    browser = launch_chromium(p)
    page = browser.new_page()
    errors, requests = [], []
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.on("request", lambda r: requests.append(r.url) if not r.url.startswith("file:")
            else None)
    page.goto("file://" + path)
    assert page.locator("canvas.thumb").count() == LAYERS * 9
    page.click("canvas.thumb[data-layer='3'][data-head='7']")
    assert page.inner_text("#info").startswith("lm.3.7 role: ")
    want = data["weights"][0]["lm"][3][7]
    n_lines = sum(v >= 0.02 for row in want for v in row)
    assert page.locator("#headview line").count() == n_lines
    w = page.eval_on_selector_all("#headview line", "ls => ls.map(l => +l.dataset.w)")
    assert max(w) == max(max(row) for row in want)
    assert errors == [] and requests == []
    browser.close()
