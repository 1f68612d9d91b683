"""Studies on the real imported models (SmolLM2-135M, all 30 layers, and all-MiniLM-L6-v2,
each imported and loaded once by conftest), through the same commands and modules as
models trained here."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mha_jax
from mha_jax import config as mc
from mha_jax import tasks
from mha_jax.analysis import attention_explorer
from mha_jax.roles import head_roles
from mha_jax.toolkit import importance
from mha_jax.toolkit import composition as scores
from mha_jax.models import common
from mha_jax.toolkit import head_masks
from mha_jax.pruning import methods
from mha_jax.pruning import prune as prune_lib

pytestmark = pytest.mark.xdist_group("pretrained")
LAYERS = 30


def _small_eval(loaded, eval_cfg: dict):
  """A real model loaded once (conftest), with its task rebuilt for small eval batches:
  the same params and workdir (read only), no second copy or restore."""
  cfg = mc.from_dict({**mc.to_dict(loaded.config), "eval": eval_cfg})
  return dataclasses.replace(loaded, config=cfg,
                             task=tasks.build(cfg, loaded.workdir, read_only=True))


@pytest.fixture(scope="session")
def smol(smol_run):
  """SmolLM2-135M, all 30 layers (270 query heads, 90 kv heads), on short windows: a
  prefix of its layers would not predict tokens (its strongest induction heads sit in
  layers 17-23)."""
  return _small_eval(smol_run, {"batch_size": 2, "seq_len": 32, "windows": 4})


@pytest.fixture(scope="session")
def minilm(minilm_run):
  return _small_eval(minilm_run, {"batch_size": 8, "seq_len": 48, "windows": 16})


@pytest.fixture(scope="session")
def smol_rows(smol):
  return head_roles.real_lm_roles(smol, "test", batches=1, batch_size=4, half_len=16,
                              text_windows=4)


@pytest.mark.slow  # default run: test_families.py::test_roles_and_export_pruned_on_gqa_and_mqa
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


@pytest.mark.slow
def test_top_induction_head_costs_more_repeat_loss_than_random_heads_of_its_layer(
    smol, smol_rows):
  top = max(smol_rows, key=lambda r: r["induction"])
  base = importance.repeated_loss(smol, batch=4, half_len=16)["loss_repeat"]
  def cost(name):
    g = importance.gates_without(smol.params, importance.parse_heads(smol.params, [name]))
    return importance.repeated_loss(smol, hook=tasks.gates_hook(smol.task, g), batch=4,
                                    half_len=16)["loss_repeat"] - base
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


@pytest.mark.slow    # the default run exports tiny GQA and MQA families, uneven groups
# included (tests/pretrained/test_families.py::test_roles_and_export_pruned_on_gqa_and_mqa)
# and Gemma 3 (test_gemma3_studies_roles_and_mqa_export)
def test_gqa_export_removes_kv_heads_and_matches_the_masked_model(smol):
  mask = {"lm": [np.ones(9, np.float32) for _ in range(LAYERS)]}
  mask["lm"][0][[0, 1, 2]] = 0      # all of kv group 0: the kv head goes
  mask["lm"][1][[0, 4]] = 0         # uneven groups: padded with zero-output heads
  mask["lm"][2][:] = 0              # the whole layer
  masked = head_masks.mask_params(smol.params, mask)
  pruned = head_masks.export_pruned(masked, mask)
  counts = [int(p["wq"].shape[1]) for _, _, p in common.attention_blocks(pruned)]
  kv = [int(p["wk"].shape[1]) for _, _, p in common.attention_blocks(pruned)]
  assert counts[:3] == [6, 9, 0] and kv[:3] == [2, 3, 0]
  # layer 1 keeps groups {1, 2}, {3, 5}, {6, 7, 8}: heads 0 and 4 stay as padding
  assert [list(x) for x in head_masks.exported_head_mask(masked, mask)["lm"][:2]] == [
      [1] * 6, [1, 1, 0, 1, 1, 0, 1, 1, 1]]
  batch = {"tokens": smol.task.windows("test")[:2]}
  a = np.asarray(smol.task.apply(masked, batch))
  b = np.asarray(smol.task.apply(pruned, batch))
  np.testing.assert_allclose(a, b, atol=2e-3, rtol=1e-4)
  gated = np.asarray(smol.task.apply(smol.params, batch, hook=mha_jax.tasks.gates_hook(
      smol.task, head_masks.full_head_gates(smol.params, mask))))
  np.testing.assert_allclose(a, gated, atol=2e-3, rtol=1e-4)


@pytest.mark.slow    # the gate step compiles a backward pass of all 30 layers (minutes)
def test_prune_and_export_an_imported_lm(smol, tmp_path):
  out = str(tmp_path / "random")
  info = prune_lib.prune(smol, out, prune_lib.PruneOptions(method="random", keep=20,
                                                          stacks=("lm",)), log=lambda s: None)
  assert info["kept"] == 20 and info["after"]["loss"] > info["base"]["loss"]
  ex = prune_lib.export_pruned(mha_jax.load(out), str(tmp_path / "exported"),
                               log=lambda s: None)
  # auto runs the masked layers (9 heads) on the blocked kernel and the exported ones (0-2
  # heads) on the reference kernel: float32 sums in another order, 1e-2 of logits up to
  # 36 after 30 layers (both on the reference kernel: 0.0; docs/guide/pruning.md)
  assert ex["relative_diff_vs_masked"] < 5e-3
  assert sum(ex["head_counts"]["lm"]) >= 20 and ex["forward_speed"]["speedup"] > 0
  # L0 gates train on the built-in text's train split, the model frozen
  la, params, hist = methods.train_gates(smol, 0.05, stacks=["lm"], steps=2,
                                         log=lambda s: None)
  assert np.isfinite(hist[-1]["loss"])
  np.testing.assert_array_equal(params["lm"]["layer_0"]["attn"]["wq"],
                                smol.params["lm"]["layer_0"]["attn"]["wq"])   # frozen
  assert not np.allclose(np.asarray(la["lm"][0]), 2.0)


@pytest.mark.slow
def test_bert_roles_importance_and_cosine_pruning(minilm, tmp_path):
  rows = head_roles.embedding_roles(minilm, "test")
  assert len(rows) == 72
  for r in rows:
    assert 0 <= r["cls_share"] <= 1 + 1e-6 and 0 <= r["sep_share"] <= 1 + 1e-6
    if r["role"] == "sep":
      assert r["sep_share"] >= 0.5
  roles = {r["role"] for r in rows}
  assert "positional" in roles and roles & {"cls", "sep"}
  minilm.task.set_reference(minilm.params)
  imp = importance.michel_importance(minilm, "valid", limit=8)
  assert len(imp["raw"]) == 72 and min(imp["raw"].values()) >= 0
  assert np.mean(list(imp["raw"].values())) > 0     # the cosine loss alone would give 0s
  full = minilm.task.evaluate(minilm.params, "test")
  assert full["cosine_to_full"] == pytest.approx(1.0, abs=1e-5)
  info = prune_lib.prune(minilm, str(tmp_path / "p"),
                         prune_lib.PruneOptions(method="random", keep=24, stacks=("encoder",)),
                         log=lambda s: None)
  assert 0.0 < info["after"]["cosine_to_full"] < 0.999


@pytest.mark.slow
def test_explorer_model_and_head_view_in_a_real_browser(smol, smol_rows, tmp_path):
  from browser import open_page
  path = str(tmp_path / "explorer.html")
  data = attention_explorer.write(smol, smol_rows, path)
  text = open(path).read()
  assert "http" not in text.replace("http-equiv", "")          # no network at all
  assert len(text) < 5e6
  assert len(data["weights"][0]["lm"]) == LAYERS and len(data["sentences"]) == 3
  playwright = pytest.importorskip("playwright.sync_api")
  with playwright.sync_playwright() as p:
    browser, page, errors, requests = open_page(p, path)
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


# Two hand-made sentences in CoNLL-U (UD v2): "tokenizers" (3 wordpieces) heads an amod,
# "unbelievably" (5 wordpieces) depends on "quickly", "embeddings" (4) on "analyzed".
CONLLU = "".join(
    "\n".join("\t".join([str(i + 1), w, "_", "_", "_", "_", str(h), r, "_", "_"])
              for i, (w, h, r) in enumerate(sent)) + "\n\n"
    for sent in [
        [("Complicated", 2, "amod"), ("tokenizers", 3, "nsubj"), ("confuse", 0, "root"),
         ("researchers", 3, "obj"), (".", 3, "punct")],
        [("Researchers", 4, "nsubj"), ("unbelievably", 3, "advmod"), ("quickly", 4, "advmod"),
         ("analyzed", 0, "root"), ("embeddings", 4, "obj:x"), (".", 4, "punct")]])


def _planted(word_ids, arcs):
  """(3, T, T) wordpiece attention: head 0 follows the arcs only once pieces are joined
  (a dependent's pieces put 0.72 on the pieces of its head word, split evenly, and 0.28 on
  [SEP], so a 3-piece head word loses to [SEP] piece by piece; the first piece of a
  >= 4-piece dependent looks at [CLS] instead); head 1 attends to the previous
  wordpiece; head 2 to [CLS]."""
  t = len(word_ids)
  w = np.zeros((3, t, t))
  pieces = {}
  for i, wid in enumerate(word_ids):
    if wid is not None:
      pieces.setdefault(wid, []).append(i)
  for q, wid in enumerate(word_ids):
    head = arcs["heads"][wid] if wid is not None else -1
    if head < 0:
      w[0, q, q] = 1.0
    elif len(pieces[wid]) >= 4 and q == pieces[wid][0]:
      w[0, q, 0] = 1.0
    else:
      w[0, q, pieces[head]] = 0.72 / len(pieces[head])
      w[0, q, t - 1] = 0.28
    w[1, q, max(q - 1, 0)] = 1.0
  w[2, :, 0] = 1.0
  return w


def test_conllu_words_align_to_wordpieces_and_a_head_along_the_arcs_scores_1(
    minilm, tmp_path):
  from mha_jax.roles import role_scores
  from mha_jax.roles import syntax
  from mha_jax.data import parallel
  path = tmp_path / "s.conllu"
  path.write_text(CONLLU)
  sentences, arcs = parallel.read_conllu(str(path), None, "--conllu")
  assert sentences[1][1] == "unbelievably" and arcs[1]["rels"][4] == "obj"
  encoded = [syntax.encode_words(minilm.task.tokenizer, s, "--conllu") for s in sentences]
  ids, word_ids = encoded[1]
  groups, unit_of = syntax.word_groups(word_ids)
  assert len(groups) == 6 + 2 and groups[0] == [0] and groups[-1] == [len(ids) - 1]
  assert groups[unit_of[1]] == [2, 3, 4, 5, 6]                   # un ##bel ##ie ##va ##bly
  assert minilm.task.tokenizer.decode(ids[groups[unit_of[1]]]).replace(" ", "").replace(
      "##", "") == "unbelievably"
  assert len(groups[unit_of[4]]) == 4                             # em ##bed ##ding ##s
  # received attention summed over a word's pieces, paid attention averaged over them
  w = np.random.default_rng(0).dirichlet(np.ones(len(ids)), size=(2, len(ids)))
  wa = syntax.word_attention(w, groups)
  np.testing.assert_allclose(wa.sum(-1), 1.0, atol=1e-12)
  u, v = unit_of[1], unit_of[2]
  want = np.mean([sum(w[1, a, b] for b in groups[v]) for a in groups[u]])
  assert wa[1, u, v] == pytest.approx(want, abs=1e-12)

  planted = [[_planted(wi, a)] for (_, wi), a in zip(encoded, arcs)]
  # piece by piece the arc-following head would miss an arc: joining pieces is needed
  t0 = planted[0][0][0]
  assert t0[encoded[0][1].index(0)].argmax() == len(encoded[0][0]) - 1   # [SEP]
  syn = syntax.score_sentences(
      ((p, wi, a) for p, (_, wi), a in zip(planted, encoded, arcs)),
      max_units=max(len(syntax.word_groups(wi)[0]) for _, wi in encoded),
      relations=["advmod", "amod", "dobj", "nsubj", "punct"])
  arc, prev, cls = (syn[f"encoder.0.{h}"] for h in range(3))
  for rel in ("nsubj", "dobj", "amod", "advmod", "punct"):
    assert arc[f"syn_{rel}_dh"] == 1.0, rel
    assert prev[f"syn_{rel}_dh"] < 1.0 and cls[f"syn_{rel}_dh"] == 0.0, rel
  # nsubj sits 1 and 3 words before its verb: the best fixed offset gets half of them
  assert arc["syn_nsubj_dh_baseline"] == 0.5
  assert arc["syntactic_margin"] >= 0.5 > max(prev["syntactic_margin"],
                                             cls["syntactic_margin"])
  row = {**arc, "positional_share": 0.0, "rare_share": 0.0}
  assert role_scores.assign_role(row) == "syntactic"
  assert role_scores.assign_role({**prev, "positional_share": 0.0, "rare_share": 0.0}) == "other"


@pytest.mark.slow  # default run: test_conllu_words_align_to_wordpieces_and_a_head_along_the_arcs_scores_1
def test_bert_syntactic_roles_from_a_conllu_file(minilm, tmp_path, capsys):
  from mha_jax import cli
  path = tmp_path / "s.conllu"
  path.write_text(CONLLU)
  rows = head_roles.embedding_roles(minilm, "test", limit=8, conllu=str(path))
  assert len(rows) == 72
  for r in rows:          # every relation the file uses is scored, for every head
    for rel in ("nsubj_dh", "dobj_hd", "amod_dh", "advmod_hd", "punct_dh"):
      assert 0.0 <= r[f"syn_{rel}"] <= 1.0
    assert (r["role"] == "syntactic") == (r["positional_share"] < 0.9 and
                                          r["syntactic_margin"] >= 0.1)
  bad = tmp_path / "bad.conllu"
  bad.write_text("1\tdog\t_\t_\t_\t_\t7\tnsubj\t_\t_\n\n")
  with pytest.raises(ValueError, match="head 7 is not a token"):
    head_roles.embedding_roles(minilm, "test", limit=8, conllu=str(bad))
  assert cli.main(["analyze", "--workdir", minilm.workdir, "--conllu",
                   str(tmp_path / "missing.conllu"), "--out", str(tmp_path / "a")]) == 2
  assert "no such file" in capsys.readouterr().err


def _shapes_in(jaxpr) -> set:
  """Shapes of every value a jaxpr (and the jaxprs inside it) computes."""
  out = set()
  for eqn in jaxpr.eqns:
    out |= {tuple(v.aval.shape) for v in eqn.outvars if hasattr(v.aval, "shape")}
    for p in eqn.params.values():
      for sub in (p if isinstance(p, (list, tuple)) else [p]):
        inner = getattr(sub, "jaxpr", None)
        if inner is not None:
          out |= _shapes_in(getattr(inner, "jaxpr", inner))
  return out


@pytest.mark.slow
def test_frozen_gate_step_forms_no_weight_gradient_and_cosine_loss_needs_a_cut(minilm):
  # the cosine-distance loss: 0 with every head, > 0 once heads are gone
  minilm.task.set_reference(minilm.params)
  batch = jax.tree.map(jnp.asarray, minilm.task.train_batch(0))
  ones = head_masks.ones_head_mask(minilm.params, ["encoder"])
  full, _ = minilm.task.loss(minilm.params, batch, hook=tasks.gates_hook(
      minilm.task, head_masks.full_head_gates(minilm.params, ones)))
  cut = {"encoder": [m.copy() for m in ones["encoder"]]}
  cut["encoder"][0][:6] = 0.0
  less, _ = minilm.task.loss(minilm.params, batch, hook=tasks.gates_hook(
      minilm.task, head_masks.full_head_gates(minilm.params, cut)))
  assert abs(float(full)) < 1e-5 and float(less) > 1e-3
  # L0 gate training with the model frozen: the step differentiates log_alpha alone, so
  # no value shaped like a weight matrix (the embedding, W_Q, the MLP) is ever computed
  la, params, hist = methods.train_gates(minilm, 0.01, stacks=["encoder"], steps=2,
                                         log=lambda s: None)
  assert params is minilm.params and np.isfinite(hist[-1]["loss_mean"])
  step = next(v for k, v in tasks.jitted_programs(minilm.task).items()
              if k.startswith("gate_step/"))
  import optax
  fixed = {"encoder": [jnp.ones(12) for _ in range(6)]}
  jaxpr = jax.make_jaxpr(step)(la, optax.adam(0.05).init(la), minilm.params, batch,
                               jax.random.PRNGKey(0), jnp.float32(0.01), fixed)
  shapes = _shapes_in(jaxpr.jaxpr)
  weights = {tuple(np.shape(x)) for x in jax.tree.leaves(minilm.params) if np.ndim(x) >= 2}
  assert (30522, 384) in weights and (384, 1536) in weights
  assert not shapes & weights, shapes & weights
