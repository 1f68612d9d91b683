"""Analysis from checkpoints: capture, importance, ablation, the report and its explorer."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mha_jax
from mha_jax import cli, interventions, tasks
from mha_jax.toolkit import ablations
from mha_jax.toolkit import capture, importance
from mha_jax.analysis import analyze, attention_explorer
from mha_jax.roles import head_roles
from mha_jax.models import common
from builders import trained_translation


# One worker builds this module's trained fixture once (see setup.cfg: --dist loadgroup).
from browser import launch_chromium


# One worker builds this module's trained fixture once (see setup.cfg: --dist loadgroup).
pytestmark = pytest.mark.xdist_group('analysis')


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
  return trained_translation(tmp_path_factory, "an", "--config.model.num_heads=2")


def test_capture_streams_weights_from_the_unchanged_model(loaded):
  seen = []
  capture.capture(loaded, "valid", stacks=("encoder",), batch_size=8, limit=12,
                  reducers=[lambda b, cap, w: seen.append((set(cap), w.sum()))])
  assert [s for s, _ in seen] == [{"encoder"}, {"encoder"}]
  assert sum(n for _, n in seen) == 12                   # limit honoured, padding rows weigh 0
  full = capture.capture(loaded, "valid", batch_size=8, limit=8, keep_full=True)
  batch, cap, _ = full[0]
  w = cap["decoder_cross"][0].weights
  assert w.shape == (8, 2, batch["tgt"].shape[1] - 1, batch["src"].shape[1])
  # The captured forward is the model's own: its output equals the plain apply, and the
  # captured weights are the pattern site's values.
  logits = loaded.task.apply(loaded.params, batch)
  logits2, vals = interventions.run_with_hook(
      lambda hook: loaded.task.apply(loaded.params, batch, hook=hook),
      read=["decoder_cross.0.attn.pattern"])
  np.testing.assert_allclose(logits, logits2, atol=1e-5)
  np.testing.assert_allclose(vals["decoder_cross.0.attn.pattern"], w, atol=1e-6)
  with pytest.raises(ValueError, match=r"stacks: 'lm' is not in this model"):
    next(capture.iter_captures(loaded, "valid", stacks=("lm",)))


def test_head_names_are_checked_with_the_valid_ones_listed(loaded):
  assert importance.parse_heads(loaded.params, "encoder.0.1,decoder_cross.0.0") == [
      ("encoder", 0, 1), ("decoder_cross", 0, 0)]
  for bad in ("encoder.0.2", "encoder.1.0", "decoderx.0.0", "encoder.0"):
    with pytest.raises(ValueError, match=r"heads: .* is not a head of this model; valid "
                                         r"names .*encoder\.0-0\.0-1"):
      importance.parse_heads(loaded.params, bad)


def test_zero_ablation_of_all_heads_equals_physically_removing_them(loaded):
  heads = [("encoder", 0, 0), ("encoder", 0, 1)]
  zeroed = importance.ablate(loaded, heads, mode="zero", split="valid", bleu_limit=0)
  p = jax.tree.map(lambda x: x, loaded.params)
  blk = p["encoder"]["layer_0"]["self_attn"]
  p["encoder"]["layer_0"]["self_attn"] = {k: (v[:, :0] if k in ("wq", "wk", "wv") else v[:0])
                                          for k, v in blk.items()}
  removed = loaded.task.evaluate(p, "valid", bleu_limit=0)
  for k in ("loss", "accuracy", "bleu"):
    assert abs(zeroed[k] - removed[k]) < 1e-4, k


@pytest.mark.slow
def test_mean_ablation_replaces_the_output_by_its_mean(loaded):
  means = importance.mean_head_outputs(loaded, "valid")
  heads = [("decoder_cross", 0, 1)]
  hook = tasks.gates_hook(loaded.task, importance.gates_without(loaded.params, heads),
                          interventions.Hook(ablations.mean_edits(heads, means)))
  batch = next(loaded.task.eval_batches("valid", 4))[0]
  logits = loaded.task.apply(loaded.params, batch, hook=hook)
  cap = capture.captured(loaded.task, loaded.params, batch, hook)
  cap0 = capture.captured(loaded.task, loaded.params, batch)
  blk = loaded.params["decoder"]["layer_0"]["cross_attn"]
  # Output of the block = (other heads through W_O) + mean of head 1 through its W_O.
  heads0 = np.asarray(cap0["decoder_cross"][0].heads).copy()
  heads0[:, :, 1] = means["decoder_cross"][0][1]
  want = np.einsum("bthk,hkd->btd", heads0, np.asarray(blk["wo"]))
  np.testing.assert_allclose(cap["decoder_cross"][0].out, want, atol=1e-4)
  # the same numbers as the earlier way: the output bias shifted by mean(z) W_O, gate 0
  p = jax.tree.map(lambda x: x, loaded.params)
  shift = np.asarray(means["decoder_cross"][0][1]) @ np.asarray(blk["wo"][1])
  p["decoder"]["layer_0"]["cross_attn"] = dict(blk, bo=np.asarray(blk.get(
      "bo", np.zeros(shift.shape))) + shift)
  shifted = loaded.task.apply(p, batch, hook=tasks.gates_hook(
      loaded.task, importance.gates_without(loaded.params, heads)))
  np.testing.assert_allclose(logits, shifted, atol=1e-4)
  assert np.abs(np.asarray(logits) - np.asarray(loaded.task.apply(loaded.params, batch))).max() > 1e-3
  m = importance.ablate(loaded, heads, mode="mean", split="valid", means=means, bleu_limit=0)
  m_shift = loaded.task.evaluate(p, "valid", hook=tasks.gates_hook(
      loaded.task, importance.gates_without(loaded.params, heads)), bleu_limit=0)
  assert abs(m["loss"] - m_shift["loss"]) < 1e-4


def test_michel_importance_matches_a_finite_difference(loaded):
  imp = importance.michel_importance(loaded, "valid", limit=1, batch_size=1)
  assert imp["examples"] == 1
  batch = jax.tree.map(lambda a: a[:1], next(loaded.task.eval_batches("valid", 1))[0])
  loss = lambda g: float(loaded.task.loss(loaded.params, batch,
                                          hook=tasks.gates_hook(loaded.task, g))[0])
  eps = 1e-2
  up, down = common.ones_head_gates(loaded.params), common.ones_head_gates(loaded.params)
  up["encoder"][0] = up["encoder"][0].at[1].add(eps)
  down["encoder"][0] = down["encoder"][0].at[1].add(-eps)
  fd = abs(loss(up) - loss(down)) / (2 * eps)
  assert abs(imp["raw"]["encoder.0.1"] - fd) < 0.05 * fd + 1e-4
  norms = [np.linalg.norm([imp["normalized"][f"{s}.0.{h}"] for h in range(2)])
           for s in ("encoder", "decoder_self", "decoder_cross")]
  np.testing.assert_allclose(norms, 1.0, atol=1e-6)


def test_ablate_cli_writes_json_and_plot(loaded, capsys):
  assert cli.main(["ablate", "--workdir", loaded.workdir, "--heads", "encoder.0.1",
                   "--mode", "mean", "--split", "valid"]) == 0
  out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
  assert out["mode"] == "mean" and set(out["delta"]) == {"loss", "accuracy", "bleu"}
  d = os.path.join(loaded.workdir, "analysis")
  assert os.path.exists(os.path.join(d, "ablation_mean.json"))
  assert os.path.getsize(os.path.join(d, "ablation_mean.png")) > 1000
  assert cli.main(["ablate", "--workdir", loaded.workdir, "--each", "--split", "valid"]) == 0
  each = json.load(open(os.path.join(d, "ablation_each_zero.json")))
  assert len(each["each"]) == len(loaded.head_names)
  assert cli.main(["ablate", "--workdir", loaded.workdir, "--heads", "encoder.3.0"]) == 2
  assert "valid names" in capsys.readouterr().err
  assert cli.main(["ablate", "--workdir", loaded.workdir, "--heads", "encoder.0.0",
                   "--mode", "half"]) == 2


def test_analyze_writes_the_report(loaded):
  opts = analyze.AnalyzeOptions(split="valid", bleu_limit=8, importance_limit=16)
  summary = analyze.analyze(loaded, None, opts, log=lambda s: None)
  d = os.path.join(loaded.workdir, "analysis")
  rows = json.load(open(os.path.join(d, "heads.json")))
  assert len(rows) == len(loaded.head_names) == 6
  enc = [r for r in rows if r["stack"] == "encoder"]
  assert all({"confidence", "positional_share", "rare_share", "role", "importance",
              "delta_loss", "delta_bleu"} <= set(r) for r in enc)
  assert open(os.path.join(d, "heads.csv")).readline().startswith("head,")
  for png in ("roles.png", "importance.png", "ablation.png"):
    assert os.path.getsize(os.path.join(d, png)) > 1000, png
  assert sum(summary["role_counts"]["encoder"].values()) == 2
  # The five heads with the largest I_h, largest first, as heads.json records them.
  want = sorted(((r["importance_raw"], r["head"]) for r in rows), reverse=True)[:5]
  assert [(h, pytest.approx(v)) for v, h in want] == [tuple(t) for t in
                                                      summary["top_importance"]]
  assert want[0][0] > want[-1][0] > 0


def test_explorer_renders_the_json_rows_in_a_real_browser(loaded, tmp_path):
  rows = [{"head": n, "role": ("syntactic" if n == "encoder.0.1" else "other")}
          for n in loaded.head_names]
  path = str(tmp_path / "explorer.html")
  data = attention_explorer.write(loaded, rows, path, split="valid", sentences=3)
  assert "http" not in open(path).read().replace("http-equiv", "")   # no network at all
  playwright = pytest.importorskip("playwright.sync_api")
  with playwright.sync_playwright() as p:
    browser = launch_chromium(p)
    page = browser.new_page()
    page.goto("file://" + path)
    page.select_option("#sent", "2")
    page.select_option("#stack", "encoder")
    page.select_option("#layer", "0")
    page.click("button.head[data-head='1']")
    assert page.inner_text("#info") == "encoder.0.1 role: syntactic"
    color = page.eval_on_selector("button.head[data-head='1']", "b => b.style.background")
    assert color == "rgb(44, 160, 44)"                            # syntactic green
    shown = page.eval_on_selector_all(
        "#att tr.row", "rs => rs.map(r => [...r.querySelectorAll('td.w')]"
                       ".map(td => parseFloat(td.dataset.w)))")
    want = data["weights"][2]["encoder"][0][1]
    assert shown == want and len(shown) == len(data["sentences"][2]["src"])
    labels = page.eval_on_selector_all("#att tr.row th.q", "ths => ths.map(t => t.textContent)")
    assert labels == data["sentences"][2]["src"]
    page.select_option("#stack", "decoder_cross")
    shown = page.eval_on_selector_all(
        "#att tr.row", "rs => rs.map(r => r.querySelectorAll('td.w').length)")
    assert shown == [len(data["sentences"][2]["src"])] * len(data["sentences"][2]["tgt"])
    browser.close()


class _PlantedModel:
  """A one-layer encoder whose four heads are planted by hand, run through the real
  attention function: head 0 attends to the previous token, head 1 to the sentence's
  rarest token, head 2 to the gold dependency head, head 3 uniformly."""

  def __init__(self, task, workdir, split):
    self.task = task
    with open(os.path.join(workdir, "data", "train_freqs.json")) as f:
      freqs = json.load(f)
    self.rarity = {w: -np.log(freqs.get(w, 0) + 1.0) for s in task.words[split][0] for w in s}
    self.split = split

  def __getattr__(self, name):
    return getattr(self.task, name)

  def eval_batches(self, split, batch_size):
    row = 0
    for batch, weight in self.task.eval_batches(split, batch_size):
      yield dict(batch, x=self._features(batch["src"], row)), weight
      row += len(weight)

  def _features(self, src, row0):
    """[one-hot position (S) | one-hot gold head position (S) | rarity | 1] per token."""
    b, s = src.shape
    x = np.zeros((b, s, 2 * s + 2), np.float32)
    sents = self.task.words[self.split][0]
    for r in range(b):
      idx = min(row0 + r, len(sents) - 1)
      words, arcs = sents[idx], self.task.arcs[self.split][idx]
      for i in range(s):
        x[r, i, i] = 1.0
        x[r, i, -1] = 1.0
        if i < len(words):
          head = arcs["heads"][i]
          x[r, i, s + (head if head >= 0 else i)] = 1.0
          x[r, i, 2 * s] = self.rarity[words[i]]
    return x

  def apply(self, params, batch, *, key=None, hook=None):
    from mha_jax import attention
    src, x = batch["src"], batch["x"]
    b, s = src.shape
    d = x.shape[-1]
    big = 30.0
    wq = np.zeros((d, 4, d), np.float32)
    wk = np.zeros((d, 4, d), np.float32)
    wq[np.arange(1, s), 0, np.arange(s - 1)] = big           # query i -> key position i-1
    wk[np.arange(s), 0, np.arange(s)] = 1.0
    wq[-1, 1, 0] = big                                        # key score = its rarity
    wk[2 * s, 1, 0] = 1.0
    wq[s + np.arange(s), 2, np.arange(s)] = big               # query's gold head position
    wk[np.arange(s), 2, np.arange(s)] = 1.0                   # head 3: zero scores, uniform
    scale = np.sqrt(d)                                        # undo the 1/sqrt(d_k)
    p = {"wq": jnp.asarray(wq * scale), "wk": jnp.asarray(wk), "wv": jnp.asarray(wk),
         "wo": jnp.zeros((4, d, d))}
    mask = ((src != 0) & (src != 2))[:, None, None, :]
    # The sites a model names (interventions): capture reads them.
    r = attention.multi_head_attention(p, x, mask=mask,
                                       site=interventions.scope(hook, "encoder.0.attn"))
    interventions.at(hook, "encoder.0.attn_out", r)
    t = batch["tgt"].shape[1] - 1
    dec = attention.multi_head_attention(
        {"wq": jnp.zeros((d, 1, 1)), "wk": jnp.zeros((d, 1, 1)), "wv": jnp.zeros((d, 1, 1)),
         "wo": jnp.zeros((1, 1, d))}, jnp.zeros((b, t, d)), causal=True,
        site=interventions.scope(hook, "decoder_self.0.attn"))
    interventions.at(hook, "decoder_self.0.attn_out", dec)


def test_planted_model_heads_are_classified_exactly(loaded):
  planted = mha_jax.Loaded(loaded.config, _PlantedModel(loaded.task, loaded.workdir, "valid"),
                           {}, loaded.step, loaded.workdir)
  rows = [r for r in head_roles.translation_roles(planted, "valid") if r["stack"] == "encoder"]
  assert [r["role"] for r in rows] == ["positional", "rare", "syntactic", "other"]
  assert rows[0]["positional_offset"] == -1
  assert rows[1]["rare_share"] > 0.95 > rows[3]["rare_share"]
  assert rows[2]["syntactic_margin"] >= 0.10
  assert rows[3]["confidence"] < 0.3


@pytest.mark.slow     # trains the full quickstart model (minutes on 2 cores)
def test_quickstart_model_has_positional_and_syntactic_encoder_heads(tmp_path, capsys):
  """The quickstart model itself (configs/translation.py:quickstart, ~2 minutes on two
  cores), analysed from its workdir: Voita et al.'s positional and syntactic encoder heads
  must be there."""
  from collections import Counter

  from mha_jax import quickstart
  wd = str(tmp_path / "qs")
  quickstart.quickstart(wd, ["--config.train.progress=false"], log=lambda s: None, analyze=False,
                 prune=False)
  loaded = mha_jax.load(wd)
  enc = [r for r in head_roles.translation_roles(loaded, "test") if r["stack"] == "encoder"]
  counts = Counter(r["role"] for r in enc)
  positional = [r for r in enc if r["role"] == "positional"]
  rare = max(enc, key=lambda r: r["rare_share"])
  with capsys.disabled():
    print(f"\nquickstart encoder roles {dict(counts)}; positional "
          + ", ".join(f"{r['head']} ({r['positional_share']:.2f} at {r['positional_offset']:+d})"
                      for r in positional)
          + f"; best rare-token head {rare['head']} {rare['rare_share']:.2f} "
          f"(chance {rare['rare_chance']:.2f})")
  assert counts["positional"] >= 1 and counts["syntactic"] >= 1
  assert all(abs(r["positional_offset"]) <= 1 for r in positional)   # self or a neighbour
  assert any(abs(r["positional_offset"]) == 1 for r in positional)   # Voita's kind: +-1
  assert len(enc) == 48
