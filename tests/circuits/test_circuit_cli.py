"""`mha-jax circuit` on a tiny trained LM: its files, its numbers, its refusals."""

import json
import os

import jax
import numpy as np
import pytest

from mha_jax import cli
from mha_jax import interventions
from mha_jax.circuits import circuit, edges as edges_lib, circuit_behaviours
from mha_jax.errors import UserError
from mha_jax.loader import load
from mha_jax.toolkit import activation_patching
from mha_jax.toolkit.pairs import Pairs


@pytest.fixture(scope="module")
def made(tiny_attn_lm, tmp_path_factory):
  wd, cfg = tiny_attn_lm
  tmp = tmp_path_factory.mktemp("circuit")
  out = str(tmp / "c")
  (tmp / "roles.json").write_text(json.dumps({"assigned": ROLES}))
  assert cli.main(["circuit", "--workdir", wd, "--task", "induction", "--n-pairs", "4",
                   "--method", "eap", "--keep-failing", "--sample", "12", "--steps", "1",
                   "--roles", str(tmp / "roles.json"), "--out", out]) == 0
  return wd, out, cfg


ROLES = {"lm.0.0": "previous_token", "lm.1.0": "induction", "lm.1.1": "other",
         "lm.9.9": "induction"}        # a head the model lacks: left out


def test_the_circuit_command_writes_its_files(made):
  wd, out, cfg = made
  doc = json.load(open(os.path.join(out, "circuit.json")))
  h = cfg.model.num_heads
  assert {"graph", "edges", "curve", "cpr", "cmd", "agreement", "nodes", "seconds"} <= set(doc)
  # two attention-only layers: ends h q, h k, h v per layer and the logits
  n_edges = 3 * h * 1 + 3 * h * (1 + h) + (1 + 2 * h)
  assert doc["graph"] == {"nodes": 2 + 2 * h, "heads": 2 * h, "mlps": 0, "ends": 6 * h + 1,
                          "edges": n_edges}
  assert len(doc["edges"]) == n_edges
  s = [abs(e["score"]) for e in doc["edges"]]
  assert s == sorted(s, reverse=True) and {"from", "to", "score"} == set(doc["edges"][0])
  last = doc["curve"][-1]
  assert last["kept"] == n_edges and abs(last["faithfulness"] - 1) < 1e-4
  assert doc["cmd"] >= 0 and set(doc["agreement"]) == {"eap", "eap-ig"}
  assert doc["agreement"]["eap"]["n"] == 12
  assert set(doc["nodes"]) >= {"heads", "mlps", "faithfulness_nodes", "edges"}
  assert all(n.startswith("lm.") for n in doc["nodes"]["heads"])
  for f in ("faithfulness.png", "circuit.png"):
    assert os.path.getsize(os.path.join(out, f)) > 1000
  # --keep-failing: the failing pairs are counted among the pairs, and said to be kept
  assert doc["failing_kept"] is True and doc["pairs"] == 4
  line = circuit.format_summary(doc).splitlines()[0]
  assert f"4 pairs ({len(doc['failing'])} failing kept)" in line
  assert "left out" in circuit.format_summary({**doc, "failing_kept": False})


def test_the_written_numbers_are_the_library_s(made):
  wd, out, _ = made
  doc = json.load(open(os.path.join(out, "circuit.json")))
  loaded = load(wd)
  s, metric, _, failing = circuit.prepare(loaded, "induction", None, 4, 0, True, log=lambda m: 0)
  es = edges_lib.EdgeStudy(s, metric=metric)
  assert abs(es.m_full - doc["metric_full"]) < 1e-5
  assert len(failing) == int((s.ld_clean <= 0).sum())
  eap = es.eap()
  names = es.graph.edge_names()
  got = {f"{e['from']} -> {e['to']}": e["score"] for e in doc["edges"]}
  for i in np.argsort(-np.abs(eap))[:5]:
    assert abs(got[names[i]] - eap[i]) < 1e-5


@pytest.mark.parametrize("argv,msg", [
    (["--method", "acdc"], "--method: invalid choice"),
    (["--ablation", "shuffle"], "--ablation: invalid choice"),
])
def test_unknown_method_or_ablation_is_named(tiny_attn_lm, tmp_path, capsys, argv, msg):
  wd, _ = tiny_attn_lm
  assert cli.main(["circuit", "--workdir", wd, "--task", "induction", "--out",
                   str(tmp_path / "o"), *argv]) == 2
  assert msg in capsys.readouterr().err


def test_bad_target_and_pairs_are_refused_by_name(tiny_attn_lm, tmp_path, capsys):
  wd, _ = tiny_attn_lm
  for t in ("0", "1.5"):
    assert cli.main(["circuit", "--workdir", wd, "--task", "induction", "--target", t,
                     "--out", str(tmp_path / "o")]) == 2
    assert f"--target must be in (0, 1]; got {float(t)}" in capsys.readouterr().err
  bad = tmp_path / "bad.jsonl"
  bad.write_text('{"clean": "ab", "corrupt": "ac", "answer": "d", "wrong": "e"}\n'
                 '{"clean": "ab", "corrupt": "abc", "answer": "d", "wrong": "e"}\n')
  assert cli.main(["circuit", "--workdir", wd, "--pairs", str(bad), "--out",
                   str(tmp_path / "o")]) == 2
  assert "line 2: clean and corrupt prompts must tokenize to the same length" in \
      capsys.readouterr().err
  bad.write_text('{"clean": "ab", "corrupt": "ac", "answer": "d", "wrong": "e", '
                 '"metric": "kl"}\n')
  with pytest.raises(UserError, match="line 1: metric must be one of"):
    circuit_behaviours.file_metric(str(bad))


def test_greater_than_pairs_and_metric(tiny_attn_lm):
  loaded = load(tiny_attn_lm[0])             # bytes: every digit is one token
  pairs, spec = circuit_behaviours.greater_than(loaded.task, 3, seed=1)
  assert pairs.text[0]["clean"].startswith("The war lasted from the year 17")
  assert pairs.text[0]["corrupt"] == "The war lasted from the year 1701 to the year 17"
  yy = [int(t["clean"].split(" to ")[0][-2:]) for t in pairs.text]
  digits = [loaded.task.tokenizer.encode(str(d))[0] for d in range(10)]
  assert list(spec["ids"]) == digits
  logits = np.random.default_rng(0).normal(size=(3, loaded.task.vocab_size)).astype(np.float32)
  got = np.asarray(circuit_behaviours.metric_of(pairs, spec)(logits))
  p = np.exp(logits - logits.max(1, keepdims=True))
  p /= p.sum(1, keepdims=True)
  for n, y in enumerate(yy):
    want = sum(p[n, digits[d]] for d in range(10) if d > y // 10) - \
        sum(p[n, digits[d]] for d in range(10) if d < y // 10)
    assert abs(got[n] - want) < 1e-5


def test_a_model_without_the_edge_sites_is_refused():
  class Bare:
    """A forward with head sites but no edge ends (no lm.{i}.attn.in_q)."""
    vocab_size = 5

    def apply(self, params, batch, *, key=None, hook=None):
      x = jax.numpy.ones(batch["tokens"][:, :-1].shape + (4,))
      x = interventions.at(hook, "lm.0.resid_pre", x)
      interventions.at(hook, "lm.0.attn.z", x[:, :, None])
      interventions.at(hook, "lm.0.attn.k", x[:, :, None])
      return jax.numpy.take_along_axis(x, batch["logits_at"][:, None, None], 1) + 0 * params

  tok = np.ones((2, 3), np.int32)
  pairs = Pairs(tok, tok, np.asarray([1, 1]), np.asarray([2, 2]), np.full(2, 3), [{}] * 2)
  s = activation_patching.Study(Bare(), jax.numpy.zeros(()), pairs)
  with pytest.raises(UserError, match="no edge-end sites"):
    edges_lib.EdgeStudy(s)


@pytest.mark.slow
def test_auto_keeps_the_most_faithful_method(tiny_attn_lm, tmp_path):
  """The default --method auto on a graph small enough for exact patching: every
  method's CPR and CMD are MIB's of its scores (recomputed here), and the one kept is
  the largest CPR."""
  from mha_jax.circuits import search
  wd, _ = tiny_attn_lm
  out = str(tmp_path / "auto")
  assert cli.main(["circuit", "--workdir", wd, "--task", "induction", "--n-pairs", "4",
                   "--keep-failing", "--sample", "8", "--steps", "2", "--out", out]) == 0
  doc = json.load(open(os.path.join(out, "circuit.json")))
  assert doc["method"] == "auto" and set(doc["methods"]) == {"eap", "eap-ig", "exact"}
  s, metric, _, _ = circuit.prepare(load(wd), "induction", None, 4, 0, True, log=lambda m: 0)
  es = edges_lib.EdgeStudy(s, metric=metric)
  for name, scores in (("eap", es.eap()), ("eap-ig", es.eap_ig(2)), ("exact", es.exact())):
    points, _ = search.curve(es, scores)
    want = search.mib(es, scores)       # MIB's: signed CPR, absolute CMD
    assert abs(doc["methods"][name]["cpr"] - want["cpr"]) < 1e-4, name
    assert abs(doc["methods"][name]["cmd"] - want["cmd"]) < 1e-4, name
    assert abs(doc["methods"][name]["cpr_absolute_ranking"]
               - search.curve_areas(points)["cpr"]) < 1e-4, name
  best = max(doc["methods"], key=lambda n: doc["methods"][n]["cpr"])
  assert doc["chosen"] == best and doc["cpr"] == doc["methods"][best]["cpr"]
  got = {f"{e['from']} -> {e['to']}": e["score"] for e in doc["edges"]}
  want = dict(zip(es.graph.edge_names(), {"eap": es.eap, "exact": es.exact}.get(
      best, lambda: es.eap_ig(2))()))
  assert all(abs(got[k] - v) < 1e-5 for k, v in want.items())


@pytest.mark.slow  # default run: test_the_circuit_view_s_size_slider_and_role_colours
def test_the_explorer_s_circuit_view_in_a_browser(made):
  """The circuit view holds every node of the graph, the target circuit's heads marked and
  its edges drawn; a click on a head opens that head's attention on pair 0's clean
  prompt, equal to the model's own pattern."""
  from browser import open_page
  from mha_jax.toolkit import capture
  wd, out, cfg = made
  doc = json.load(open(os.path.join(out, "circuit.json")))
  path = os.path.join(out, "explorer.html")
  assert "http" not in open(path).read().replace("http-equiv", "")
  playwright = pytest.importorskip("playwright.sync_api")
  with playwright.sync_playwright() as p:
    browser, page, errors, requests = open_page(p, path)
    assert page.is_visible("#circuit-view") and not page.is_visible("#attn-view")
    names = page.eval_on_selector_all("#cgraph circle.cnode", "cs => cs.map(c => c.dataset.name)")
    assert sorted(names) == sorted(f"lm.{l}.{h}" for l in range(cfg.model.num_layers)
                                   for h in range(cfg.model.num_heads))
    on = page.eval_on_selector_all("#cgraph circle.cnode.on", "cs => cs.map(c => c.dataset.name)")
    assert sorted(on) == sorted(doc["nodes"]["heads"])
    edges = page.eval_on_selector_all("#cgraph line.cedge", "ls => ls.map(l => l.dataset.from "
                                      "+ ' -> ' + l.dataset.to)")
    assert len(set(edges)) == doc["nodes"]["edges"]
    scores = {f"{e['from']} -> {e['to']}": e["score"] for e in doc["edges"]}
    assert set(edges) <= set(scores)
    assert f"{doc['nodes']['edges']} edges" in page.inner_text("#csummary")
    head = doc["nodes"]["heads"][0]
    page.click(f"#cgraph circle.cnode[data-name='{head}']")
    assert page.is_visible("#attn-view") and not page.is_visible("#circuit-view")
    assert page.inner_text("#info").startswith(f"{head} role: ")
    rows = page.eval_on_selector_all("#att tr.row", "rs => rs.map(r => [...r.querySelectorAll("
                                     "'td.w')].map(td => +td.dataset.w))")
    run = load(wd)
    s, _, _, _ = circuit.prepare(run, "induction", None, 4, 0, True, log=lambda m: 0)
    t = int(s.pairs.length[0])
    layer, h = (int(v) for v in head.split(".")[1:])
    tok = np.asarray(s.pairs.clean[:1, :t])
    w = np.asarray(capture.captured(run.task, run.params, {"tokens": np.concatenate(
        [tok, tok[:, -1:]], 1)})["lm"][layer].weights)[0, h]
    np.testing.assert_allclose(np.asarray(rows), w[:t, :t], atol=0.006)
    assert errors == [] and requests == []
    browser.close()


def test_the_circuit_view_s_size_slider_and_role_colours(made):
  """The slider starts at the target circuit and walks the curve: at each size the drawn
  edges are the top n by |score| of circuit.json, pruned (search.top_n over the file's
  own scores), and the large nodes those edges touch; heads with a role take its colour."""
  from browser import open_page
  from mha_jax.circuits import graph as graph_lib, search
  from mha_jax.roles.role_scores import ROLE_COLORS
  wd, out, _ = made
  doc = json.load(open(os.path.join(out, "circuit.json")))
  data = json.load(open(os.path.join(out, "circuit_view.json")))["circuit"]
  loaded = load(wd)
  s, _, _, _ = circuit.prepare(loaded, "induction", None, 4, 0, True, log=lambda m: 0)
  g = graph_lib.graph_of(s, s.params)
  names = g.edge_names()
  rows = np.argwhere(g.mask())
  score = {f"{e['from']} -> {e['to']}": e["score"] for e in doc["edges"]}
  scores = np.asarray([score[n] for n in names])
  playwright = pytest.importorskip("playwright.sync_api")
  with playwright.sync_playwright() as p:
    browser, page, errors, requests = open_page(p, os.path.join(out, "explorer.html"))
    start = data["at"] if data["at"] is not None else len(data["sizes"]) - 1
    assert page.eval_on_selector("#csize", "s => [+s.value, +s.max]") == [
        start, len(data["sizes"]) - 1]
    assert len(data["sizes"]) > 2 and doc["nodes"]["reached_target"] == (data["at"] is not None)
    for j, sz in enumerate(data["sizes"]):
      page.eval_on_selector("#csize", f"s => {{ s.value = {j}; s.dispatchEvent("
                            f"new Event('input')); }}")
      point = doc["curve"][sz["point"]]
      keep = search.top_n(g, rows, scores, point["edges"])
      want = {f"{g.nodes[u]} -> {g.ends[e]}" for u, e in zip(*np.nonzero(keep))}
      drawn = page.eval_on_selector_all("#cgraph line.cedge", "ls => ls.map(l => "
                                        "l.dataset.from + ' -> ' + l.dataset.to)")
      assert set(drawn) == want and point["kept"] == len(want)
      assert float(page.get_attribute("#csize", "data-faithfulness")) == pytest.approx(
          point["faithfulness"])
      on = page.eval_on_selector_all("#cgraph circle.cnode.on", "cs => cs.map(c => "
                                     "c.dataset.name)")
      assert sorted(on) == sorted(search.touched(g, keep)["heads"])
    fills = page.eval_on_selector_all("#cgraph circle.cnode[data-role]", "cs => cs.map(c => "
                                      "[c.dataset.name, c.dataset.role, getComputedStyle(c).fill])")
    want = {n: r for n, r in ROLES.items() if n in g.nodes}
    assert {n: r for n, r, _ in fills} == want
    rgb = lambda h: f"rgb({int(h[1:3], 16)}, {int(h[3:5], 16)}, {int(h[5:7], 16)})"  # noqa: E731
    assert all(f == rgb(ROLE_COLORS[r]) for _, r, f in fills)
    assert sorted(page.eval_on_selector_all("#clegend .crole", "ss => ss.map(s => "
                                            "s.dataset.role)")) == sorted(set(want.values()))
    assert errors == [] and requests == []
    browser.close()


def test_a_roles_file_without_roles_is_refused(tiny_attn_lm, tmp_path, capsys):
  bad = tmp_path / "roles.json"
  bad.write_text(json.dumps({"assigned": {"layer 0": "induction"}}))
  assert cli.main(["circuit", "--workdir", tiny_attn_lm[0], "--task", "induction",
                   "--roles", str(bad), "--out", str(tmp_path / "o")]) != 0
  assert "roles" in capsys.readouterr().err and not (tmp_path / "o").exists()


def test_show_draws_a_circuit_folder_from_its_json(made):
  """`mha_jax.show(out)`: the explorer page of circuit_view.json (the data explorer.html
  holds) and the faithfulness curve of circuit.json, point by point."""
  import re
  import mha_jax
  _, out, _ = made
  doc = json.load(open(os.path.join(out, "circuit.json")))
  view = mha_jax.show(out)
  data = json.load(open(os.path.join(out, "circuit_view.json")))
  assert data["circuit"]["heads"] == doc["nodes"]["heads"] and "weights" in data
  assert 'class="mha-jax-view"' in view.html and "cgraph" in view.html
  pts = re.findall(r'data-x="([^"]+)" data-value="([^"]+)"', view.html)
  assert [(float(x), float(y)) for x, y in pts] == [(p["edges"], p["faithfulness"])
                                                    for p in doc["curve"]]
