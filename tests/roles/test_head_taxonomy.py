"""Head-role detectors and the taxonomy (roles.detectors, roles.head_taxonomy) on
planted tiny LLaMAs: weights that make layer 1's head 0 a successor head, head 1 a
copy-suppression head and head 2 a sink head; each detector finds exactly that head,
and the same model without them finds none. Scores against their definitions by hand."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from oracles import assert_f32_close
from mha_jax import interventions
from mha_jax.roles import detectors
from mha_jax.roles import role_scores
from mha_jax.roles import head_taxonomy
from mha_jax.errors import UserError
from mha_jax.models import llama

V, DM, H, K = 12, 16, 3, 16
SEQ = [1, 2, 3, 4, 5, 6]             # the planted ordinal sequence
SPEC = llama.llama_spec(rope_base=1e9)  # the last RoPE pair barely turns (the sink's q, k)


class Task:
  """The slice of the task protocol the detectors use."""
  vocab_size = V
  bos_id = -1               # no BOS: the detectors' prompts begin with their own tokens

  def apply(self, params, batch, *, gates=None, capture=False, key=None, hook=None):
    return llama.apply(params, SPEC, batch["tokens"][:, :-1], hook=hook,
                       logits_at=batch.get("logits_at"))


def planted(successor=True, copy=True, sink=True):
  p = llama.init(jax.random.PRNGKey(0), vocab_size=V, d_model=DM, num_heads=H,
                 num_kv_heads=H, head_dim=K, num_layers=2, d_ff=8)
  p = jax.tree.map(lambda a: np.zeros_like(np.asarray(a)) if a.ndim >= 2 else np.asarray(a), p)
  e = np.zeros((V, DM))
  e[np.arange(V), np.arange(V)] = 1.0      # one-hot tokens
  e[:, 12] = 1.0                           # a constant direction (the sink's query)
  e[0, 13] = 1.0                           # BOS's marker (the sink's key)
  p["embed"] = e
  a = p["lm"]["layer_1"]["attn"]
  a["wv"] = np.repeat(np.eye(DM)[:, None, :], H, 1)          # v = x for every head
  if successor:                            # OV: e_i -> e_{i+1} along SEQ
    for i, j in zip(SEQ[:-1], SEQ[1:]):
      a["wo"][0, i, j] = 3.0
  if copy:                                 # OV: -3 I on the tokens
    a["wo"][1, np.arange(V), np.arange(V)] = -3.0
  if sink:                                 # every query on key 0, output 0
    a["wq"][12, 2, K // 2 - 1] = 6.0
    a["wk"][13, 2, K // 2 - 1] = 6.0
  return jax.tree.map(jnp.asarray, p)


def text(seed=0, b=3, t=10):
  """[BOS] then tokens outside SEQ's successors (7..11): the successor head writes 0."""
  rng = np.random.default_rng(seed)
  return np.concatenate([np.zeros((b, 1), np.int32), rng.integers(7, V, (b, t))], 1)


def found(arr, threshold, below=False):
  l, h = np.nonzero(arr <= threshold if below else arr >= threshold)
  return sorted(f"lm.{a}.{b}" for a, b in zip(l, h))


@pytest.mark.parametrize("plant", [True, False])
def test_each_detector_finds_exactly_the_planted_head(plant):
  task, p = Task(), planted(plant, plant, plant)
  x = detectors.effective_embeddings(task, p, SEQ)
  np.testing.assert_allclose(x, np.asarray(p["embed"])[SEQ], atol=1e-6)  # layer 0 is empty
  succ = detectors.succession_scores(p, {"s": x}, {"s": SEQ})
  cs = detectors.copy_suppression_text(task, p, text(), np.arange(1, V))
  ov = detectors.ov_self_scores(p, detectors.effective_embeddings(task, p, range(1, V)), np.arange(1, V))
  sink = detectors.sink_scores(task, p, text())
  want = (lambda h: [h]) if plant else (lambda h: [])
  assert found(succ, 0.5) == want("lm.1.0")
  assert found(np.where(ov < 0, cs, -np.inf), 1.0) == want("lm.1.1")
  assert found(sink, 0.8) == want("lm.1.2")
  if plant:
    assert succ[1, 0] == 1.0 and sink[1, 2] > 0.99 and ov[1, 1] < -3


def random_params(seed=1):
  p = llama.init(jax.random.PRNGKey(seed), vocab_size=V, d_model=DM, num_heads=H,
                 num_kv_heads=H, head_dim=K, num_layers=2, d_ff=8)
  return jax.tree.map(lambda a: a * 3.0 if a.ndim == 3 else a, p)


def test_succession_score_equals_its_definition_by_hand():
  p = random_params()
  x = np.random.default_rng(2).normal(size=(len(SEQ), DM))
  got = detectors.succession_scores(p, {"s": x}, {"s": SEQ})
  e = np.asarray(p["embed"], np.float64)
  for l in range(2):
    lp = p["lm"][f"layer_{l}"]
    g1 = np.asarray(lp["ln1"]["scale"], np.float64)
    for h in range(H):
      hits = 0
      for i in range(len(SEQ) - 1):
        xi = x[i] / np.sqrt((x[i] ** 2).mean()) * g1
        out = xi @ np.asarray(lp["attn"]["wv"][:, h]) @ np.asarray(lp["attn"]["wo"][h])
        logits = [out @ e[j] for j in SEQ]
        hits += int(np.argmax(logits) == i + 1)
      assert got[l, h] == pytest.approx(hits / (len(SEQ) - 1))


def test_copy_suppression_and_sink_scores_equal_their_definitions_by_hand():
  task, p = Task(), random_params(4)
  tok = text(3, b=2, t=7)
  sample = np.arange(1, V)
  got = detectors.copy_suppression_text(task, p, tok, sample)
  sink = detectors.sink_scores(task, p, tok)
  read = [f"lm.{i}.attn.{s}" for i in range(2) for s in ("pattern", "result")]
  _, vals = interventions.run_with_hook(lambda hook: task.apply(p, {"tokens": jnp.asarray(tok)}, hook=hook), read=read)
  e = np.asarray(p["embed"], np.float64)
  inp = tok[:, :-1]
  for l in range(2):
    w = np.asarray(vals[f"lm.{l}.attn.pattern"], np.float64)
    r = np.asarray(vals[f"lm.{l}.attn.result"], np.float64)
    assert_f32_close(sink[l], role_scores.first_token_share(w), what=f"sink {l}")  # 2 programs
    for h in range(H):
      num = den = 0.0
      for b in range(tok.shape[0]):
        for t in range(2, inp.shape[1]):
          j = 1 + int(np.argmax(w[b, h, t, 1:t]))
          eff = r[b, t, h] @ e.T                        # the head's direct logits (V,)
          z = (eff[inp[b, j]] - eff[sample].mean()) / eff[sample].std()
          num += w[b, h, t, j] * z
          den += w[b, h, t, j]
      assert got[l, h] == pytest.approx(-num / den, rel=1e-3, abs=1e-4)


def test_random_draws_never_include_the_tested_heads():
  heads = [f"lm.{l}.{h}" for l in range(3) for h in range(4)]
  top = ["lm.0.1", "lm.0.2", "lm.2.3"]
  draws = head_taxonomy.random_draws(top, heads, draws=20, seed=3)
  assert len(draws) == 20
  for d in draws:
    assert len(d) == 3 and len(set(d)) == 3 and not set(d) & set(top)
    assert [x.split(".")[1] for x in d] == ["0", "0", "2"]      # the top heads' layers
  # a layer with no head left: drawn from the others, still never a top head
  d = head_taxonomy.random_draws(["lm.0.0", "lm.0.1", "lm.0.2", "lm.0.3", "lm.1.0"], heads, 10)
  assert all(not set(x) & {"lm.0.0", "lm.0.1", "lm.0.2", "lm.0.3", "lm.1.0"} for x in d)
  with pytest.raises(UserError, match="top_k 3"):
    head_taxonomy.random_draws(top, top + ["lm.1.1"], 1)


@pytest.mark.slow  # default run: test_copy_suppression_and_sink_scores_equal_their_definitions_by_hand
def test_mean_and_sink_edits_touch_only_the_chosen_heads():
  task, p = Task(), planted()
  tok = jnp.asarray(text())
  read = ("lm.1.attn.z", "lm.1.attn.pattern")
  _, base = interventions.run_with_hook(lambda hk: task.apply(p, {"tokens": tok}, hook=hk), read=read)
  means = [np.full((H, K), 0.5), np.full((H, K), 0.25)]
  _, got = interventions.run_with_hook(lambda hk: task.apply(p, {"tokens": tok}, hook=hk),
                 head_taxonomy.mean_edits(p, ["lm.1.1"], means), read)
  z, z0 = np.asarray(got["lm.1.attn.z"]), np.asarray(base["lm.1.attn.z"])
  np.testing.assert_allclose(z[:, :, 1], 0.25)
  np.testing.assert_allclose(z[:, :, [0, 2]], z0[:, :, [0, 2]], atol=1e-6)
  _, got = interventions.run_with_hook(lambda hk: task.apply(p, {"tokens": tok}, hook=hk),
                 head_taxonomy.sink_edits(p, ["lm.1.2"]), read)
  w, w0 = np.asarray(got["lm.1.attn.pattern"]), np.asarray(base["lm.1.attn.pattern"])
  assert np.all(w[:, 2, :, 0] == 0) and w0[:, 2, 1:, 0].min() > 0.99
  np.testing.assert_allclose(w[:, :2], w0[:, :2], atol=1e-6)


def test_assign_takes_the_first_qualifying_role():
  got = head_taxonomy.assign(["lm.0.0", "lm.0.1", "lm.0.2"],
                 {"induction": ["lm.0.0", "lm.0.1"], "name_mover": ["lm.0.1"]})
  assert got == {"lm.0.0": "induction", "lm.0.1": "name_mover", "lm.0.2": "other"}


class _CharTokenizer:
  """Every character two tokens: no name (nor any ordinal item) is a single token."""

  def encode(self, text):
    return [t for c in text for t in (ord(c) % 49 + 1, 0)]


class _TextTask:
  name = "fake"
  bos_id, adds_bos, window = -1, False, 64      # the typed interface's LMData members
  tokenizer = _CharTokenizer()
  vocab_size = 50


def test_roles_that_cannot_exist_are_refused_by_name():
  with pytest.raises(UserError, match="role retrieval: the haystack of 384 tokens is longer "
                                      "than this model's window \\(64 tokens\\)"):
    detectors.check_window(_TextTask(), 384)
  with pytest.raises(UserError, match="role name_mover: the IOI task needs two names"):
    head_taxonomy.role_ioi_pairs(_TextTask(), 4, 0, "name_mover")
  with pytest.raises(UserError, match="role successor: no ordinal sequence"):
    detectors.ordinal_ids(_TextTask())


def test_settings_are_checked_by_name():
  assert head_taxonomy.ClassifyOptions().roles == head_taxonomy.DEFAULT_ROLES and "retrieval" not in head_taxonomy.DEFAULT_ROLES
  assert head_taxonomy.ClassifyOptions(roles=head_taxonomy.parse_roles("sink,induction".replace("sink", "attention_sink"))
                    ).roles == ("attention_sink", "induction")
  with pytest.raises(UserError, match="roles must be a non-empty subset.*got bogus"):
    head_taxonomy.ClassifyOptions(roles=("bogus",))
  with pytest.raises(UserError, match="top_k must be >= 1; got 0"):
    head_taxonomy.ClassifyOptions(top_k=0)
  with pytest.raises(UserError, match="depths must be fractions"):
    head_taxonomy.ClassifyOptions(depths=(1.5,))


def test_needle_inputs_place_the_needle_and_the_answer():
  stream = np.arange(100, 200)
  tok, start, ans = detectors.needle_inputs(_TextTask(), stream, 40, (0.0, 0.5, 1.0), [1, 2, 3], [9, 9])
  assert tok.shape == (3, 40)
  for row, s, a in zip(tok, start, ans):
    assert list(row[s:s + 3]) == [1, 2, 3] and list(row[a:a + 3]) == [1, 2, 3]
    assert list(row[a - 2:a]) == [9, 9]
  assert start[0] == 0 and start[2] == 40 - 2 * 3 - 2


@pytest.mark.slow  # default run: test_taxonomy.py's test_the_taxonomy_verb_writes_scores_equal_to_their_recomputation
def test_analyze_writes_roles_json_with_causal_checks(ind_run, tmp_path):
  import json
  import mha_jax
  from mha_jax.analysis import analyze
  loaded = mha_jax.load(ind_run)
  out = str(tmp_path / "analysis")
  analyze.analyze(loaded, out, analyze.AnalyzeOptions(
      ablations=False, roles="attention_sink,copy_suppression"), log=lambda m: None)
  doc = json.load(open(f"{out}/roles.json"))
  heads = [r["head"] for r in json.load(open(f"{out}/heads.json"))]
  assert set(doc["lm_roles"]) == {"attention_sink", "copy_suppression"}
  assert sorted(doc["assigned"]) == sorted(heads)
  assert set(doc["thresholds"]) == {"attention_sink", "copy_suppression"}
  for c in doc["causal"].values():
    assert len(c["top"]) == 3 and len(c["random"]) == 5
    assert all(not set(d) & set(c["top"]) for d in c["random_heads"])
    assert c["verdict"] == ("holds" if c["effect"] > max(0, *c["random"]) else "fails")
  rows = {r["head"]: r["role"] for r in json.load(open(f"{out}/heads.json"))}
  assert rows == doc["assigned"]                       # the explorer's colours
  assert (tmp_path / "analysis" / "taxonomy.png").exists()
  with pytest.raises(UserError, match="roles must be a non-empty subset"):
    analyze.analyze(loaded, out, analyze.AnalyzeOptions(ablations=False, roles="sinks"),
                   log=lambda m: None)


@pytest.mark.slow  # default run: test_s_inhibition_receivers_are_the_name_movers_only
def test_path_patching_of_chosen_senders_equals_the_full_sweep():
  from oracles import LlamaTask, tiny_llama_pairs
  from mha_jax.toolkit import activation_patching
  params, pairs = tiny_llama_pairs(slice(1, 3), [7, 6, 7])
  s = activation_patching.Study(LlamaTask(), params, pairs)
  full = s.path_patch([(1, 2)], "q")["recovery"]
  some = s.path_patch([(1, 2)], "q", senders=[(0, 1), (0, 3)])["recovery"]
  np.testing.assert_allclose(some[[0, 0], [1, 3]], full[[0, 0], [1, 3]], rtol=1e-5, atol=1e-6)
  assert np.isnan(some[0, 0]).all() and np.isnan(some[1]).all()


@pytest.mark.slow  # default run: test_each_detector_finds_exactly_the_planted_head
def test_each_behaviour_reads_its_own_inputs():
  import types
  task, p = Task(), random_params(5)
  rep = np.random.default_rng(6).integers(1, V, (2, 9)).astype(np.int32)
  mask = np.zeros((2, 8), np.float32)
  mask[:, 5:] = 1.0
  txt = text(7, b=3, t=6)
  fns = head_taxonomy.behaviours(types.SimpleNamespace(task=task, params=p), head_taxonomy.ClassifyOptions(),
                     {"repeat": (rep, mask), "text": txt})

  def nll(tok):
    lg = np.asarray(task.apply(p, {"tokens": jnp.asarray(tok)}), np.float64)
    lp = lg - np.log(np.exp(lg).sum(-1, keepdims=True))
    return -np.take_along_axis(lp, tok[:, 1:, None], -1)[..., 0]
  assert fns["repeat_loss"]({}) == pytest.approx((nll(rep) * mask).sum() / mask.sum(), rel=1e-4)
  assert fns["text_loss"]({}) == pytest.approx(nll(txt).mean(), rel=1e-4)


def test_s_inhibition_receivers_are_the_name_movers_only():
  # Few heads attend to the IO more than to S: lm.1.0 (DLA 0.3), lm.1.1 (DLA -0.5: a
  # negative name mover) and lm.0.2 (0.05, under the threshold); lm.1.2 has the largest
  # DLA but attends to S. Ranking every head by DLA where attention passes (else -inf)
  # and taking the top 3 would have taken lm.1.1 and a head that fails attention.
  dla = np.array([[0.02, -0.1, 0.05], [0.3, -0.5, 0.9]])
  attn_io = np.array([[0.1, 0.1, 0.6], [0.7, 0.8, 0.1]])
  attn_s = np.array([[0.2, 0.3, 0.1], [0.1, 0.1, 0.6]])
  assert head_taxonomy.receivers(dla, attn_io, attn_s, 0.1, 3) == [(1, 0)]
  assert head_taxonomy.receivers(dla, attn_io, attn_s, 0.0, 3) == [(1, 0), (0, 2)]
  np.testing.assert_array_equal(head_taxonomy.name_movers(dla, attn_io, attn_s, 0.1, -1),
                                [[False, False, False], [False, True, False]])
  assert head_taxonomy.receivers(dla, attn_io, attn_s, 0.5, 3) == []        # no name mover
  assert head_taxonomy.receivers(np.where(dla > 0.2, np.nan, dla), attn_io, attn_s, 0.0, 3) == [(0, 2)]


@pytest.mark.slow      # four compiled Study programs: ~35 s on 2 loaded cores
def test_ioi_scores_path_patch_only_into_name_movers():
  import types
  from oracles import LlamaTask, tiny_llama_pairs
  from mha_jax.toolkit.pairs import Pairs
  params, _ = tiny_llama_pairs(slice(1, 3), [7, 6, 7])
  clean = np.random.default_rng(1).integers(12, 37, (3, 7)).astype(np.int32)
  ans, wrong = np.array([3, 5, 7]), np.array([4, 6, 8])
  clean[:, 1], clean[:, 2], clean[:, 4] = ans, wrong, wrong          # IO, S, S
  corrupt = clean.copy()
  corrupt[:, [1, 2, 4]] = [9, 10, 10]
  pairs = Pairs(clean, corrupt, ans, wrong, np.full(3, 7), [{}] * 3)
  run = types.SimpleNamespace(task=LlamaTask(), params=params)
  got = head_taxonomy.ioi_scores(run, head_taxonomy.ClassifyOptions(top_k=3), pairs, log=lambda m: None)
  dla, io, s = got["dla_share"], got["attn_io"], got["attn_s"]
  by_hand = sorted(((dla[l, h], f"lm.{l}.{h}") for l in range(2) for h in range(4)
                    if dla[l, h] >= 0.1 and io[l, h] > s[l, h]), reverse=True)
  assert got["receivers"] == [n for _, n in by_hand][:3]
  assert 0 < len(got["receivers"]) < 3          # fewer name movers than top_k: no padding
  top = max(int(n.split(".")[1]) for n in got["receivers"])
  assert np.isfinite(got["s_inhibition"][:top]).any() and np.isnan(got["s_inhibition"][top:]).all()
  none = head_taxonomy.ioi_scores(run, head_taxonomy.ClassifyOptions(name_mover_threshold=50.0), pairs,
                             log=lambda m: None)
  assert none["receivers"] == [] and np.isnan(none["s_inhibition"]).all()


def test_retrieval_score_and_recall_equal_their_definitions_by_hand():
  task, p = Task(), random_params(1)
  stream = np.random.default_rng(1).integers(1, V, 200)
  needle, question = [3, 7, 5], [9, 2]
  tok, start, ans = detectors.needle_inputs(task, stream, 24, (0.1, 0.3, 0.5, 0.7, 0.9),
                                            needle, question)
  got, recall = detectors.retrieval_scores(task, p, tok, start, ans, len(needle))
  read = [f"lm.{i}.attn.pattern" for i in range(2)]
  at = ans[:, None] - 1 + np.arange(3)                               # logits_at (B, n)
  (lg, vals), lg_at = jax.jit(lambda p, t, at: (interventions.run_with_hook(
      lambda hook: task.apply(p, {"tokens": t}, hook=hook), read=read),
      task.apply(p, {"tokens": t, "logits_at": at})))(p, jnp.asarray(tok), jnp.asarray(at))
  lg = np.asarray(lg)
  np.testing.assert_allclose(lg_at, np.take_along_axis(lg, at[..., None], 1), atol=1e-5)
  hits, gen, total = np.zeros((2, H)), 0, 0
  for r in range(len(tok)):
    for k in range(len(needle)):
      q = ans[r] - 1 + k                         # predicts needle token k of the answer
      g = lg[r, q].argmax() == tok[r, q + 1]
      gen, total = gen + g, total + 1
      for l in range(2):
        top = np.asarray(vals[read[l]])[r, :, q].argmax(-1)         # (H,)
        hits[l] += g & (top == start[r] + k)
  assert 0 < gen < total and hits.max() > 0       # the input exercises both outcomes
  assert recall == pytest.approx(gen / total)
  np.testing.assert_allclose(got, hits / total, atol=1e-6)


def test_merge_adds_a_role_and_assigns_every_head_again():
  heads = ["lm.0.0", "lm.0.1", "lm.0.2"]
  doc = {"roles": ["induction"], "lm_roles": {"induction": {h: 0.5 for h in heads}},
         "thresholds": {"induction": 0.4}, "qualifies": {"induction": ["lm.0.0", "lm.0.1"]},
         "assigned": head_taxonomy.assign(heads, {"induction": ["lm.0.0", "lm.0.1"]}),
         "extra": {}, "seconds": {"detectors": {}, "causal": 2.0},
         "causal": {"induction": {"verdict": "holds"}}, "settings": {"retrieval_len": 384}}
  new = {"roles": ["retrieval"], "lm_roles": {"retrieval": {"lm.0.1": 0.3, "lm.0.2": 0.2}},
         "thresholds": {"retrieval": 0.1}, "qualifies": {"retrieval": ["lm.0.1", "lm.0.2"]},
         "extra": {"needle_recall": 0.9}, "seconds": {"detectors": {"retrieval": 5.0},
                                                     "causal": 3.0},
         "causal": {"retrieval": {"verdict": "fails"}}, "settings": {"retrieval_len": 1024},
         "machine": {}}
  got = head_taxonomy.merge(doc, new)
  assert "bootstrap" not in got
  boot = {"windows": [0, 3], "roles": {"attention_sink": {"qualifies": ["lm.0.2"]}}}
  sink = {**new, "roles": ["attention_sink"], "lm_roles": {"attention_sink": {"lm.0.2": 0.9}},
          "thresholds": {"attention_sink": 0.8}, "qualifies": {"attention_sink": ["lm.0.2"]},
          "bootstrap": boot}
  assert head_taxonomy.merge(got, sink)["bootstrap"] == boot
  assert head_taxonomy.merge(got, sink)["assigned"]["lm.0.0"] == "induction"
  assert got["roles"] == ["retrieval", "induction"]           # ROLES' order
  assert got["assigned"] == {"lm.0.0": "induction", "lm.0.1": "retrieval",
                             "lm.0.2": "retrieval"}
  assert got["counts"] == {"induction": 1, "retrieval": 2}
  assert set(got["causal"]) == {"induction", "retrieval"} and got["seconds"]["causal"] == 5.0
  assert got["settings"]["retrieval_len"] == 384
  assert got["merged"][0]["settings"]["retrieval_len"] == 1024
  assert doc["assigned"]["lm.0.1"] == "induction"              # doc itself is unchanged
