"""patching/: every result against explicit substitution in a float64 NumPy forward."""

import json
import os
import re

import jax
import numpy as np
import pytest

from mha_jax import cli
from mha_jax.loader import load
from mha_jax.errors import UserError
from mha_jax.models import common
from mha_jax.models import lm as lm_model
from mha_jax.toolkit import activation_patching, pairs as pairs_lib
from mha_jax.toolkit.pairs import Pairs
import oracles
from oracles import G, H, L, SPEC, LlamaTask, numpy_llama, tiny_llama_pairs


class CountingLlamaTask(LlamaTask):
  """LlamaTask counting its traced forwards (a compiled program's call traces none)."""
  traced = 0

  def apply(self, params, batch, **kw):
    CountingLlamaTask.traced += 1
    return super().apply(params, batch, **kw)


@pytest.fixture(scope="module")
def setup():
  params, pairs = tiny_llama_pairs(slice(1, 3), [7, 6, 7])    # row 1 is right-padded
  return activation_patching.Study(CountingLlamaTask(), params, pairs), params, pairs


def ld_np(logits, pairs):
  rows = np.arange(len(pairs))
  last = logits[rows, pairs.length - 1]
  return last[rows, pairs.answer] - last[rows, pairs.wrong]


def logp_np(logits, pairs):
  rows = np.arange(len(pairs))
  last = logits[rows, pairs.length - 1]
  last = last - last.max(-1, keepdims=True)
  return last[rows, pairs.answer] - np.log(np.exp(last).sum(-1))


def _sub(src, h=None, p=None):
  def f(x):
    x = x.copy()
    idx = (slice(None), slice(None) if p is None else p) + (() if h is None else (h,))
    x[idx] = src[idx]
    return x
  return f


def test_baseline_and_metrics_match_numpy(setup):
  s, params, pairs = setup
  lc, _ = numpy_llama(params, pairs.clean)
  lx, _ = numpy_llama(params, pairs.corrupt)
  np.testing.assert_allclose(s.ld_clean, ld_np(lc, pairs), atol=1e-4)
  np.testing.assert_allclose(s.ld_corrupt, ld_np(lx, pairs), atol=1e-4)
  m = activation_patching.metrics(ld_np(lc, pairs), logp_np(lc, pairs), s.ld_clean, s.ld_corrupt)
  assert abs(m["recovery"] - 1.0) < 1e-4
  np.testing.assert_allclose(m["prob"], np.exp(logp_np(lc, pairs)).mean(), rtol=1e-6)
  np.testing.assert_allclose(m["loss"], -logp_np(lc, pairs).mean(), rtol=1e-6)


@pytest.mark.parametrize("site,n", [("z", H), ("q", H), ("k_q", H), ("v_q", H), ("k", G),
                                    ("v", G)])
def test_activation_patching_equals_numpy_substitution(setup, site, n):
  s, params, pairs = setup
  _, seen = numpy_llama(params, pairs.clean)
  res = s.patch(site)
  assert res["ld"].shape == (L, n, 3)
  for l in range(L):
    for h in range(n):
      want, _ = numpy_llama(params, pairs.corrupt, {(l, site): _sub(seen[(l, site)], h)})
      np.testing.assert_allclose(res["ld"][l, h], ld_np(want, pairs), atol=1e-4,
                                 err_msg=f"{site} {l} {h}")
  c, x = np.mean(s.ld_clean, dtype=np.float64), np.mean(s.ld_corrupt, dtype=np.float64)
  np.testing.assert_allclose(res["recovery"], (res["ld"].mean(-1) - x) / (c - x), rtol=1e-9)


def test_per_position_and_residual_patching_equal_numpy(setup):
  s, params, pairs = setup
  _, seen = numpy_llama(params, pairs.clean)
  z = s.patch("z", per_position=True)
  r = s.patch("resid_pre", per_position=True)
  assert z["ld"].shape == (L, H, 7, 3) and r["ld"].shape == (L, 7, 3)
  for l, h, p in ((0, 1, 2), (1, 3, 6), (1, 0, 1)):
    want, _ = numpy_llama(params, pairs.corrupt, {(l, "z"): _sub(seen[(l, "z")], h, p)})
    np.testing.assert_allclose(z["ld"][l, h, p], ld_np(want, pairs), atol=1e-4)
  for l, p in ((0, 1), (1, 2), (1, 5)):
    want, _ = numpy_llama(params, pairs.corrupt,
                          {(l, "resid_pre"): _sub(seen[(l, "resid_pre")], None, p)})
    np.testing.assert_allclose(r["ld"][l, p], ld_np(want, pairs), atol=1e-4)
  # the whole residual stream of layer 0 from the clean run is the clean run
  full = s.patch("resid_pre")
  np.testing.assert_allclose(full["ld"][0], s.ld_clean, atol=1e-5)
  assert abs(full["recovery"][0] - 1) < 1e-5
  noise = s.patch("resid_pre", direction="noise")
  np.testing.assert_allclose(noise["ld"][0], s.ld_corrupt, atol=1e-5)


@pytest.mark.slow  # default run: test_activation_patching_equals_numpy_substitution
def test_batched_sweep_equals_one_at_a_time(setup):
  s, _, _ = setup
  for site, n in (("z", H), ("k", G)):
    for chunk in (None, 3):
      res = s.patch(site, chunk=chunk)
      for l in range(L):
        for h in range(n):
          one = s.patch_one(site, l, h)
          np.testing.assert_allclose(res["recovery"][l, h], one["recovery"], atol=1e-5)
          np.testing.assert_allclose(res["prob"][l, h], one["prob"], rtol=1e-5)
  part = s.patch("z", layers=[1])
  assert np.isnan(part["recovery"][0]).all()
  np.testing.assert_allclose(part["recovery"][1], s.patch("z")["recovery"][1], atol=1e-6)
  src = s.values("clean", ["lm.1.attn.z"])["lm.1.attn.z"]
  from mha_jax import interventions
  out = s.edited("corrupt", {"lm.1.attn.z": interventions.replace(src, heads=2)})
  np.testing.assert_allclose(out["ld"], part["ld"][1, 2], atol=1e-5)
  with pytest.raises(UserError, match="layers"):
    s.patch("z", layers=[5])
  z = s.patch("z", per_position=True, direction="noise")
  one = s.patch_one("z", 1, 2, position=6, direction="noise")
  np.testing.assert_allclose(z["logit_diff"][1, 2, 6], one["logit_diff"], atol=1e-5)


class CachedLlamaTask(oracles.CachedLlamaTask):
  """With a prefix cache, as PretrainedLMTask: the sweeps share the common prefix."""

  starts = []         # the start of every forward traced with one (depth sharing)

  def apply(self, params, batch, *, key=None, hook=None, **kw):
    if "start" in batch:
      self.starts.append(batch["start"])
    return super().apply(params, batch, key=key, hook=hook, **kw)


@pytest.mark.slow
def test_a_shared_prefix_computed_once_changes_no_result(setup):
  _, params, pairs = setup
  corrupt = pairs.clean.copy()
  corrupt[:, 3] = (corrupt[:, 3] + 5) % 37
  p = Pairs(pairs.clean, corrupt, pairs.answer, pairs.wrong, pairs.length, pairs.text)
  full = activation_patching.Study(LlamaTask(), params, p)
  shared = activation_patching.Study(CachedLlamaTask(), params, p, share_depth=False)
  assert full.prefix == 0 and shared.prefix == 3
  np.testing.assert_allclose(shared.ld_clean, full.ld_clean, atol=1e-5)
  for site, pp in (("z", False), ("z", True), ("k", True), ("resid_pre", True), ("v_q", False)):
    a, b = shared.patch(site, per_position=pp), full.patch(site, per_position=pp)
    np.testing.assert_allclose(a["ld"], b["ld"], atol=2e-5, err_msg=f"{site} {pp}")
  a, b = shared.path_patch([(1, 1)], "k"), full.path_patch([(1, 1)], "k")
  np.testing.assert_allclose(a["ld"], b["ld"], atol=2e-5)


@pytest.mark.slow  # default run: test_activation_patching_equals_numpy_substitution
def test_sweeps_that_start_each_intervention_at_its_layer_change_no_result(setup):
  """share_depth: each group of one layer's interventions resumes at that layer from
  the base run's stream; every table equals the full forward's, in groups of any size
  (a short group padded), on chosen layers, several sweeps in one program."""
  _, params, pairs = setup
  corrupt = pairs.clean.copy()
  corrupt[:, 3] = (corrupt[:, 3] + 5) % 37
  p = Pairs(pairs.clean, corrupt, pairs.answer, pairs.wrong, pairs.length, pairs.text)
  full = activation_patching.Study(LlamaTask(), params, p)
  task = CachedLlamaTask()
  deep = activation_patching.Study(task, params, p)
  assert deep.share_depth and not full.share_depth     # full: a task without prefix_cache
  sweeps = [("z", False), ("k", True), ("resid_pre", False), ("v_q", True)]
  want = full.patch_many(sweeps)
  for chunk in (None, 3):       # 29 interventions a layer: one group, or 10 of 3 (padded)
    del task.starts[:]
    got = deep.patch_many(sweeps, chunk=chunk)
    assert task.starts, "no forward resumed at a layer"
    for site, _ in sweeps:
      np.testing.assert_allclose(got[site]["ld"], want[site]["ld"], atol=2e-5,
                                 err_msg=f"{site} chunk={chunk}")
  part = deep.patch("z", layers=[1])
  assert np.isnan(part["ld"][0]).all()
  np.testing.assert_allclose(part["ld"][1], want["z"]["ld"][1], atol=2e-5)


def test_path_patching_equals_two_step_numpy_substitution(setup):
  s, params, pairs = setup
  _, cs = numpy_llama(params, pairs.clean)
  _, xs = numpy_llama(params, pairs.corrupt)
  res = s.path_patch([(1, 2), (1, 0)], "q")
  assert res["receivers"] == ["lm.1.2", "lm.1.0"]
  for h in range(H):
    for r, rh in enumerate((2, 0)):
      def z0(x, h=h):
        out = xs[(0, "z")].copy()
        out[:, :, h] = cs[(0, "z")][:, :, h]
        return out
      _, rec = numpy_llama(params, pairs.corrupt, {(0, "z"): z0, (1, "z"): lambda x: xs[(1, "z")]})
      want, _ = numpy_llama(params, pairs.corrupt, {(1, "q"): _sub(rec[(1, "q")], rh)})
      np.testing.assert_allclose(res["ld"][0, h, r], ld_np(want, pairs), atol=1e-4)
    # a sender in the receiver's own layer reaches nothing
    np.testing.assert_allclose(res["ld"][1, h, 0], s.ld_corrupt, atol=1e-5)
  # to the logits: senders of the last layer have exactly their activation-patching effect
  logits = s.path_patch("logits")
  act = s.patch("z")
  np.testing.assert_allclose(logits["ld"][L - 1, :, 0], act["ld"][L - 1], atol=1e-5)
  for ch in ("k", "v"):
    assert np.isfinite(s.path_patch([(1, 1)], ch)["recovery"][0]).all()


def test_noising_path_patching_of_chosen_sender_layers_equals_numpy(setup):
  """direction noise: base clean, the sender's z from corrupt; sender_layers=[0] scores
  only layer 0's heads (layer 1's rows NaN); a layer outside the model is refused."""
  s, params, pairs = setup
  _, cs = numpy_llama(params, pairs.clean)
  _, xs = numpy_llama(params, pairs.corrupt)
  res = s.path_patch([(1, 1)], "k", direction="noise", sender_layers=[0])
  assert np.isnan(res["ld"][1]).all()
  for h in range(H):
    def z0(x, h=h):
      out = cs[(0, "z")].copy()
      out[:, :, h] = xs[(0, "z")][:, :, h]
      return out
    _, rec = numpy_llama(params, pairs.clean, {(0, "z"): z0, (1, "z"): lambda x: cs[(1, "z")]})
    want, _ = numpy_llama(params, pairs.clean, {(1, "k_q"): _sub(rec[(1, "k_q")], 1)})
    np.testing.assert_allclose(res["ld"][0, h, 0], ld_np(want, pairs), atol=1e-4)
  with pytest.raises(UserError, match="sender_layers: 5"):
    s.path_patch([(1, 1)], "k", sender_layers=[5])


def test_dla_matches_numpy_and_sums_to_the_logit_difference(setup):
  s, params, pairs = setup
  _, seen = numpy_llama(params, pairs.clean)
  d = s.dla()
  p = jax.tree.map(lambda a: np.asarray(a, np.float64), params)
  rows = np.arange(3)
  t = pairs.length - 1
  u = p["embed"][pairs.answer] - p["embed"][pairs.wrong]                # (N, D)
  g = seen["final_scale"][rows, t] * p["lm"]["ln_final"]["scale"] * u   # (N, D)
  for l in range(L):
    wo = p["lm"][f"layer_{l}"]["attn"]["wo"]
    for h in range(H):
      res = seen[(l, "z")][rows, t, h] @ wo[h]
      np.testing.assert_allclose(d["heads"][l, h], (res * g).sum(-1).mean(), atol=1e-5)
    np.testing.assert_allclose(d["mlp"][l], (seen[(l, "mlp_out")][rows, t] * g).sum(-1).mean(),
                               atol=1e-5)
  np.testing.assert_allclose(d["ld_frozen_sum"], s.ld_clean.mean(), atol=1e-5)
  np.testing.assert_allclose(d["ld"], s.ld_clean.mean(), atol=1e-6)


def test_logit_lens_matches_numpy(setup):
  s, params, pairs = setup
  _, seen = numpy_llama(params, pairs.clean)
  lens = s.logit_lens()
  p = jax.tree.map(lambda a: np.asarray(a, np.float64), params)
  resid = [seen[(0, "resid_pre")]] + [seen[(l, "resid_post")] for l in range(L)]
  for i, x in enumerate(resid):
    x = x / np.sqrt((x * x).mean(-1, keepdims=True) + SPEC.norm_eps) * p["lm"]["ln_final"]["scale"]
    np.testing.assert_allclose(lens["ld"][i], ld_np(x @ p["embed"].T, pairs), atol=1e-4)
  np.testing.assert_allclose(lens["ld"][-1], s.ld_clean, atol=1e-5)


class LinearTask:
  """An attention-only LM without LayerNorm: the logits are linear in the last layer's z."""
  vocab_size = 20
  spec = common.ModelSpec(kind="lm", layer_norm=False, attn_only=True)

  def apply(self, params, batch, *, key=None, hook=None):
    return lm_model.apply(params, self.spec, batch["tokens"][:, :-1], hook=hook,
                          logits_at=batch.get("logits_at"))


def test_attribution_equals_exact_patching_where_the_metric_is_linear():
  params = lm_model.init(jax.random.PRNGKey(2), vocab_size=20, d_model=12, num_heads=3,
                         num_layers=2, d_ff=8, max_len=8, layer_norm=False, attn_only=True)
  rng = np.random.default_rng(1)
  clean = rng.integers(1, 20, (4, 6)).astype(np.int32)
  corrupt = rng.integers(1, 20, (4, 6)).astype(np.int32)
  pairs = Pairs(clean, corrupt, np.asarray([1, 2, 3, 4]), np.asarray([5, 6, 7, 8]),
                np.full(4, 6), [{}] * 4)
  s = activation_patching.Study(LinearTask(), params, pairs)
  atp = s.attribution(("z", "resid_pre"))
  exact = s.patch("z")
  per = s.patch("z", per_position=True)
  np.testing.assert_allclose(atp["z"]["heads"][1], exact["recovery"][1], atol=1e-4)
  np.testing.assert_allclose(atp["z"]["per_position"][1], per["recovery"][1], atol=1e-4)
  # the residual of layer 0 is not linear in the metric (layer 1 attends): only close
  assert atp["resid_pre"]["per_position"].shape == (2, 6)
  ag = activation_patching.agreement(atp["z"]["heads"], exact["recovery"], top=3)
  assert ag["n"] == 6 and -1 <= ag["pearson"] <= 1 and 0 <= ag["top3_overlap"] <= 1


def test_agreement_hand_values():
  a = np.asarray([[1.0, 2.0], [3.0, np.nan]])
  b = np.asarray([[2.0, 4.0], [6.0, 1.0]])
  ag = activation_patching.agreement(a, b, top=2)
  assert ag["n"] == 3 and abs(ag["pearson"] - 1) < 1e-12 and ag["spearman"] == 1.0
  assert ag["top2_overlap"] == 1.0
  assert activation_patching.agreement([1, 2, 3, 4], [4, 3, 2, 1], top=2)["top2_overlap"] == 0.0


# ---------------------------------------------------------------------- pairs


class WordTokenizer:
  """Words with their leading space are tokens; ids grow as words are first seen."""

  def __init__(self):
    self.ids = {}

  def encode(self, text):
    return np.asarray([self.ids.setdefault(w, len(self.ids) + 1)
                       for w in re.findall(r" ?\w+| ?[^\w\s]", text)], np.int32)


class WordTask:
  vocab_size = 500
  bos_id, adds_bos = 0, False          # as a run trained here (the LMData members)

  def __init__(self):
    self.tokenizer = WordTokenizer()


def test_ioi_pairs_swap_the_subject():
  task = WordTask()
  p = pairs_lib.ioi_pairs(task, 6, seed=1)
  assert len(p) == 6 and p.clean.shape == p.corrupt.shape
  for i, t in enumerate(p.text):
    a, b = t["answer"].strip(), t["wrong"].strip()
    assert t["clean"].count(b) == 2 and t["corrupt"].count(a) == 2
    assert p.answer[i] == task.tokenizer.encode(" " + a)[0]
    n = p.length[i]
    diff = np.nonzero(p.clean[i, :n] != p.corrupt[i, :n])[0]
    assert len(diff) == 1                       # one token differs: the second subject
  assert len(set(p.length.tolist())) > 1        # templates of different lengths, padded


def test_induction_pairs():
  task = WordTask()
  p = pairs_lib.induction_pairs(task, 4, half_len=5, seed=0)
  assert p.clean.shape == (4, 10)
  np.testing.assert_array_equal(p.clean[:, 1:5], p.clean[:, 6:10])
  np.testing.assert_array_equal(p.answer, p.clean[:, 5])
  np.testing.assert_array_equal(p.corrupt[:, 6:], p.clean[:, 6:])
  assert (p.corrupt[:, 1:6] != p.clean[:, 1:6]).all()


@pytest.mark.parametrize("lines,msg", [
    (['{"clean": "a b", "corrupt": "a c", "answer": " d", "wrong": " e"}',
      '{"clean": "a b", "corrupt": "a c c", "answer": " d", "wrong": " e"}'],
     "line 2: clean and corrupt prompts must tokenize to the same length"),
    (['', '{"clean": "a b", "corrupt": "a c", "answer": " big dog", "wrong": " e"}'],
     "line 2: answer ' big dog' must be one token"),
    (['{"clean": "a b", "corrupt": "a c", "answer": " d"}'], r"line 1: missing field\(s\) \['wrong'\]"),
    (['{"clean": "a b", "corrupt": "a c", "answer": " d", "wrong": 3}'], "line 1: field 'wrong'"),
    (['{"clean": "a b",'], "line 1: not valid JSON"),
    (['["a"]'], "line 1: expected an object"),
])
def test_bad_pairs_files_are_refused_with_the_line(tmp_path, lines, msg):
  f = tmp_path / "pairs.jsonl"
  f.write_text("\n".join(lines) + "\n")
  with pytest.raises(UserError, match=msg):
    pairs_lib.read_pairs(WordTask(), str(f))


def test_good_pairs_file(tmp_path):
  f = tmp_path / "pairs.jsonl"
  f.write_text('{"clean": "the cat sat on", "corrupt": "the dog sat on", "answer": " mat", '
               '"wrong": " rug"}\n\n{"clean": "a b", "corrupt": "a c", "answer": " d", '
               '"wrong": " e"}\n')
  task = WordTask()
  p = pairs_lib.read_pairs(task, str(f))
  assert p.clean.shape == (2, 4) and p.length.tolist() == [4, 2]
  assert p.clean[1, 2:].tolist() == [p.clean[1, 1]] * 2      # right-padded with its last token


# ---------------------------------------------------------------------- the command


@pytest.fixture(scope="module")
def patched(tiny_attn_lm, tmp_path_factory):
  """(workdir, out, config): `mha-jax patch` (all methods) on a 2-step attention-only LM."""
  wd, cfg = tiny_attn_lm
  tmp = tmp_path_factory.mktemp("patched")
  out = str(tmp / "patch")
  assert cli.main(["patch", "--workdir", wd, "--task", "induction", "--n-pairs", "3",
                   "--method", "activation,path,attribution", "--keep-failing",
                   "--sites", "head_out,q,k,v,kv,resid",
                   "--outputs", "dla,logit_lens,explorer", "--out", out]) == 0
  return wd, out, cfg


def test_patch_command_on_a_trained_lm(patched, tmp_path):
  wd, out, cfg = patched
  doc = json.load(open(os.path.join(out, "patching.json")))
  heads = cfg.model.num_heads
  assert set(doc["scores"]) == {"head_out", "q", "k", "v"}         # MHA: no kv tables
  assert len(doc["scores"]["head_out"]) == 2 * heads and "lm.1.0" in doc["scores"]["head_out"]
  assert len(doc["pairs"]) == 3 and {"ld_clean", "ld_corrupt"} <= set(doc["pairs"][0])
  assert len(doc["resid"]["lm.0"]) == 20 and len(doc["logit_lens"]["logit_diff"]) == 3
  dla = json.load(open(os.path.join(out, "dla.json")))
  assert len(dla["heads"]) == 2 * heads
  atp = json.load(open(os.path.join(out, "attribution.json")))
  assert {"pearson", "spearman", "top10_overlap"} <= set(atp["agreement"]["head_out"])
  path = json.load(open(os.path.join(out, "path.json")))
  assert len(path["to_logits"]) == 2 * heads and path["edges"]
  for f in ("patching_head_out.png", "dla_heads.png", "attribution_head_out.png",
            "path_logits.png"):
    assert os.path.getsize(os.path.join(out, f)) > 500
  bad = tmp_path / "bad.jsonl"
  bad.write_text('{"clean": "ab", "corrupt": "abc", "answer": "d", "wrong": "e"}\n')
  assert cli.main(["patch", "--workdir", wd, "--pairs", str(bad), "--out", out]) == 2
  assert cli.main(["patch", "--workdir", wd, "--task", "ioi", "--out", out]) == 2


@pytest.mark.parametrize("sites", ["q", "resid,v", pytest.param("kv", marks=pytest.mark.slow)])
def test_patch_sites_write_exactly_their_tables(patched, tmp_path, sites):
  wd, full_out, _ = patched
  out = str(tmp_path / "p")
  assert cli.main(["patch", "--workdir", wd, "--task", "induction", "--n-pairs", "3",
                   "--method", "activation", "--keep-failing", "--sites", sites,
                   "--out", out]) == 0
  doc = json.load(open(os.path.join(out, "patching.json")))
  full = json.load(open(os.path.join(full_out, "patching.json")))
  asked = set(sites.split(","))
  assert set(doc["scores"]) == asked - {"resid", "kv"}       # MHA: kv has no tables
  assert ("resid" in doc) == ("resid" in asked)
  pngs = {f for f in os.listdir(out) if f.startswith("patching_")}
  assert pngs == {f"patching_{'resid_pre' if a == 'resid' else a}.png" for a in asked - {"kv"}}
  # no --outputs: none of DLA, the logit lens and the explorer page
  assert not {"dla.json", "dla_heads.png", "explorer.html"} & set(os.listdir(out))
  assert "logit_lens" not in doc
  for name, table in doc["scores"].items():
    assert table.keys() == full["scores"][name].keys()
    np.testing.assert_allclose(list(table.values()), list(full["scores"][name].values()),
                               atol=2e-6)
  if "resid" in doc:
    for layer, row in doc["resid"].items():
      np.testing.assert_allclose(row, full["resid"][layer], atol=2e-6)


def test_patch_many_equals_each_sweep_alone(setup):
  s, _, _ = setup
  sweeps = [("z", False), ("q", False), ("k_q", False), ("v_q", False), ("k", False),
            ("v", False), ("resid_pre", True)]
  many = s.patch_many(sweeps)
  assert set(many) == {x for x, _ in sweeps}
  for site, pp in sweeps:
    one = s.patch(site, per_position=pp)
    assert many[site]["ld"].shape == one["ld"].shape
    np.testing.assert_allclose(many[site]["ld"], one["ld"], atol=1e-5, equal_nan=True)
  assert s.patch_many([("k", False)])["k"]["ld"].shape[1] == G      # per key/value head
  with pytest.raises(UserError, match="each site once"):
    s.patch_many([("z", False), ("z", True)])


def test_a_subset_study_keeps_its_rows_of_the_baseline(setup):
  s, params, pairs = setup
  sub = s.subset([1])
  fresh = activation_patching.Study(LlamaTask(), params, pairs.subset([1]))
  for run in ("clean", "corrupt"):
    for k in ("ld", "logp"):
      np.testing.assert_allclose(sub.baseline()[run][k], fresh.baseline()[run][k], atol=1e-5)
      assert sub.baseline()[run][k].tolist() == [s.baseline()[run][k][1]]
  np.testing.assert_allclose(sub.patch("z")["recovery"], fresh.patch("z")["recovery"],
                             atol=1e-5)
  with pytest.raises(ValueError, match="baseline must hold"):
    activation_patching.Study(LlamaTask(), params, pairs, baseline=sub.baseline())


def test_pairs_the_model_fails_are_left_out_unless_kept(patched, tmp_path):
  wd, full_out, _ = patched
  kept = json.load(open(os.path.join(full_out, "patching.json")))["pairs"]
  failing = [i for i, p in enumerate(kept) if p["ld_clean"] < 0]
  out = str(tmp_path / "p")
  rc = cli.main(["patch", "--workdir", wd, "--task", "induction", "--n-pairs", "3",
                 "--method", "attribution", "--out", out])
  if len(failing) == len(kept):
    assert rc == 2
    return
  assert rc == 0
  doc = json.load(open(os.path.join(out, "patching.json")))
  assert [f["index"] for f in doc["left_out"]] == failing
  assert [f["ld_clean"] for f in doc["left_out"]] == [kept[i]["ld_clean"] for i in failing]
  rest = [p for i, p in enumerate(kept) if i not in failing]
  assert [p["clean"] for p in doc["pairs"]] == [p["clean"] for p in rest]
  np.testing.assert_allclose([p["ld_clean"] for p in doc["pairs"]],
                             [p["ld_clean"] for p in rest], atol=1e-5)


def test_failing_pairs_are_named_and_all_failing_is_refused():
  from mha_jax.patching import patch as patch_lib

  class S:
    ld_clean, ld_corrupt = np.asarray([1.0, -2.0, 0.5]), np.asarray([0.0, 0.1, 0.2])
  pairs = Pairs(*([np.zeros(3)] * 5), [{"clean": c} for c in "abc"])
  bad = patch_lib.failing_pairs(S(), pairs)
  assert bad == [{"index": 1, "ld_clean": -2.0, "ld_corrupt": 0.1, "clean": "b"}]
  S.ld_clean = -np.abs(S.ld_clean)
  with pytest.raises(UserError, match="every clean prompt wrong.*keep_failing"):
    patch_lib.failing_pairs(S(), pairs)


# ---------------------------------------------------------------------- the explorer page


def _cells(page):
  """{name: value} of the heatmap's cells as the page holds them."""
  got = page.eval_on_selector_all("#pgrid td.cell",
                                  "ts => ts.map(t => [t.dataset.name, +t.dataset.value])")
  return dict(got)


def test_the_explorer_shows_what_patch_wrote(patched):
  from browser import open_page
  _, out, cfg = patched
  path = os.path.join(out, "explorer.html")
  assert "http" not in open(path).read().replace("http-equiv", "")
  doc = json.load(open(os.path.join(out, "patching.json")))
  dla = json.load(open(os.path.join(out, "dla.json")))
  atp = json.load(open(os.path.join(out, "attribution.json")))
  paths = json.load(open(os.path.join(out, "path.json")))
  want = {**{f"patch.{k}": v for k, v in doc["scores"].items()}, "dla.heads": dla["heads"],
          "atp.head_out": atp["scores"]["head_out"], "path.to_logits": paths["to_logits"],
          "patch.resid": {f"{n} position {j}": v for n, row in doc["resid"].items()
                          for j, v in enumerate(row)}}
  playwright = pytest.importorskip("playwright.sync_api")
  with playwright.sync_playwright() as p:
    browser, page, errors, requests = open_page(p, path)
    for table, values in want.items():
      page.select_option("#ptable", table)
      assert _cells(page) == values, table
    page.select_option("#ptable", "patch.head_out")
    assert not page.is_visible("#ppos")         # no --per-position: no position table
    head_out = doc["scores"]["head_out"]
    name = max(head_out, key=lambda n: abs(head_out[n]))
    page.hover(f"#pgrid td.cell[data-name='{name}']")
    assert page.inner_text("#phover") == f"{name} head_out = {head_out[name]:+.3f}"
    top = page.eval_on_selector_all("#ptop tr.top", "rs => rs.map(r => r.dataset.name)")
    assert top == sorted(head_out, key=lambda n: -abs(head_out[n]))[:10]
    assert page.locator("#pscatter circle").count() == 2 * cfg.model.num_heads
    assert page.locator("#pedges tr.edge").count() == len(paths["edges"])
    assert page.locator("#ppairs tr.pair").count() == len(doc["pairs"]) == 3
    assert page.locator("#plens tr.lens").count() == len(doc["logit_lens"]["layers"])
    # A head's cell opens its attention pattern on the first pair's clean prompt: causal
    # rows that sum to 1 (to the page's 2 decimals), one row per token of the prompt.
    page.click("#pgrid td.cell[data-name='lm.1.0']")
    assert page.is_visible("#attn-view") and not page.is_visible("#patch-view")
    assert page.inner_text("#info").startswith("lm.1.0 role: ")
    rows = page.eval_on_selector_all("#att tr.row", "rs => rs.map(r => [...r.querySelectorAll("
                                     "'td.w')].map(td => +td.dataset.w))")
    w = np.asarray(rows)
    assert w.shape == (doc["pairs"][0]["length"],) * 2
    np.testing.assert_allclose(w.sum(-1), 1.0, atol=0.03)
    assert np.triu(w, 1).max() == 0.0
    assert errors == [] and requests == []
    browser.close()


def test_a_written_result_gets_its_attention_view_from_the_same_run_only(patched, tmp_path):
  import shutil
  from mha_jax.patching import patch_explorer
  wd, out, _ = patched
  copy = str(tmp_path / "copy")
  shutil.copytree(out, copy)
  os.remove(os.path.join(copy, "explorer.html"))
  assert cli.main(["patch-explorer", "--out", copy, "--workdir", wd,
                   "--attention-pairs", "1"]) == 0
  def page_json(d):
    text = open(os.path.join(d, "explorer.html")).read()
    return json.loads(text.split('<script id="data" type="application/json">', 1)[1]
                      .split("</script>", 1)[0])
  again, first = page_json(copy), page_json(out)
  assert again["weights"] == first["weights"][:2]     # pair 0's clean and corrupt prompts
  assert again["patching"] == first["patching"]
  os.remove(os.path.join(copy, "explorer.html"))     # written again without the model:
  assert cli.main(["patch-explorer", "--out", copy]) == 0   # the kept attention_view.json
  assert page_json(copy) == again
  doc = json.load(open(os.path.join(copy, "patching.json")))
  doc["pairs"][1]["ld_clean"] += 5.0                  # another model would give another LD
  with open(os.path.join(copy, "patching.json"), "w") as f:
    json.dump(doc, f)
  with pytest.raises(UserError, match="other logit differences"):
    patch_explorer.rewrite(load(wd), copy)


def test_the_explorer_of_a_committed_gqa_result_has_its_key_value_head_tables(tmp_path):
  from mha_jax.patching import patch_explorer
  from browser import open_page
  src = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "results", "patching", "ioi")
  out = str(tmp_path / "ioi")
  os.makedirs(out)
  for f in ("patching.json", "dla.json", "attribution.json", "path.json"):
    with open(os.path.join(src, f)) as a, open(os.path.join(out, f), "w") as b:
      b.write(a.read())
  # --per-position's table, planted (the committed run has none): one value per position.
  doc = json.load(open(os.path.join(out, "patching.json")))
  rng = np.random.default_rng(0)
  doc["head_out_per_position"] = {n: [round(float(v), 6) for v in rng.normal(size=15)]
                                  for n in doc["scores"]["head_out"]}
  doc["scores"]["q"]["lm.0.0"] = float("nan")       # a NaN the JSON may hold: a blank cell
  with open(os.path.join(out, "patching.json"), "w") as f:
    json.dump(doc, f)
  path = patch_explorer.write(out)
  playwright = pytest.importorskip("playwright.sync_api")
  with playwright.sync_playwright() as p:
    browser, page, errors, requests = open_page(p, path)
    assert page.locator("#views button").count() == 0        # no model: no attention view
    for k in ("k_kv", "v_kv"):
      page.select_option("#ptable", f"patch.{k}")
      assert _cells(page) == doc["scores"][k] and len(doc["scores"][k]) == 30 * 3
    page.select_option("#ptable", "patch.q")
    q = {n: v for n, v in doc["scores"]["q"].items() if n != "lm.0.0"}
    assert _cells(page) == q and page.locator("#pgrid td.none").count() == 1
    page.select_option("#ptable", "patch.head_out_per_position")
    for j in (0, 14):
      page.select_option("#ppos", str(j))
      assert _cells(page) == {n: v[j] for n, v in doc["head_out_per_position"].items()}
    page.select_option("#ptable", "dla.mlp")
    assert _cells(page) == json.load(open(os.path.join(out, "dla.json")))["mlp"]
    assert errors == [] and requests == []
    browser.close()
  with pytest.raises(UserError, match="has no patching.json or dla.json"):
    patch_explorer.write(str(tmp_path))


def test_more_attention_pairs_than_the_result_has_are_said_not_clamped_silently(
    patched, tmp_path, capsys):
  import shutil
  wd, out, _ = patched
  copy = str(tmp_path / "copy")
  shutil.copytree(out, copy)
  capsys.readouterr()
  assert cli.main(["patch-explorer", "--out", copy, "--workdir", wd,
                   "--attention-pairs", "99"]) == 0
  said = capsys.readouterr().out
  assert "--attention-pairs 99: the result has 3 pair(s); the attention view shows all 3" \
      in said, said


def test_both_directions_share_each_compiled_program(setup):
  """The direction only swaps the prompts a program is given: noising after denoising
  traces (so compiles) nothing new for activation, path and attribution patching."""
  s, _, _ = setup
  for direction in ("denoise", "noise"):
    s.patch("z", direction=direction)
    s.path_patch([(1, 1)], "k", direction=direction)
    s.attribution(("z",), direction=direction)
    if direction == "denoise":
      after_denoise = CountingLlamaTask.traced
  assert CountingLlamaTask.traced == after_denoise > 0
  one = s.patch_one("z", 1, 2, direction="noise")
  np.testing.assert_allclose(s.patch("z", direction="noise")["recovery"][1, 2],
                             one["recovery"], atol=1e-5)
