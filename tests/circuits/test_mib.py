"""MIB's evaluation (signed CPR, absolute CMD, its pruning and fractions), the IG points
and MIB's ungrouped graph, each against an independent NumPy recomputation."""

import numpy as np
import pytest

from mha_jax.circuits import search
from test_edges import es, ld_np, numpy_edges, setup  # noqa: F401 (fixtures)

FRACTIONS = (.001, .002, .005, .01, .02, .05, .1, .2, .5, 1)


def library_matrices(graph):
  """The EAP-IG library's view of a graph: (real edges (F, B) bool, forward_to_backward
  (F, B): node f's own input ends), from the graph's end -> node map."""
  real = graph.mask()
  f2b = np.zeros_like(real)
  for e in range(len(graph.ends)):
    for v in graph.end_node(e):
      f2b[v, e] = True
  return real, f2b


def library_prune(g, nodes, f2b):
  """One call of EAP-IG 7af394a's Graph.prune: (edges, nodes in graph)."""
  def alive(g):
    into = (g.any(0)[None, :] & f2b).any(1)
    into[0] = True                     # the input always receives
    return g.any(1) & into

  while True:
    new = alive(g)
    same = (new == nodes).all()
    nodes = new
    back = (nodes[:, None] & f2b).any(0)
    back[-1] = True                    # the logits always stay
    g = g & nodes[:, None] & back[None, :]
    if same:
      return g, nodes


def library_curve(graph, edges, mib_scores, metric, absolute: bool):
  """(faithfulness (10,), edge counts reported (10,)) as evaluate_area_under_curve
  computes them: topn of the scores (|.| if absolute) over int(pct * E) edges."""
  real, f2b = library_matrices(graph)
  s = np.full(real.shape, -np.inf)
  s[edges[:, 0], edges[:, 1]] = np.abs(mib_scores) if absolute else mib_scores
  flat = np.argsort(-s.reshape(-1), kind="stable")
  m_full, m_empty = metric(real), metric(np.zeros_like(real))
  faith, counts = [], []
  for pct in FRACTIONS:
    g = np.zeros(real.size, bool)
    g[flat[:int(pct * len(edges))]] = True
    g = g.reshape(real.shape)
    into = (g.any(0)[None, :] & f2b).any(1)
    into[0] = True
    g, nodes = library_prune(g, g.any(1) & into, f2b)    # apply_topn(prune=True)
    counts.append(int(g.sum()))                          # weighted_edge_count
    g, _ = library_prune(g, nodes, f2b)                  # evaluate_graph's prune
    faith.append((metric(g) - m_empty) / (m_full - m_empty))
  return np.asarray(faith), counts


def areas(faith_signed, faith_abs):
  cpr = cmd = 0.0
  for i in range(len(FRACTIONS) - 1):
    w = FRACTIONS[i + 1] - FRACTIONS[i]
    cpr += w * (faith_signed[i] + faith_signed[i + 1]) / 2
    cmd += w * (abs(1 - faith_abs[i]) + abs(1 - faith_abs[i + 1])) / 2
  return cpr, cmd


def test_mib_evaluation_equals_a_numpy_recomputation(setup, es):
  _, params, pairs = setup
  names = es.graph.edge_names()
  _, corrupt_out = numpy_edges(params, pairs.corrupt)
  rng = np.random.default_rng(3)
  scores = rng.normal(size=len(es.edges))       # ours: m(M without e) - m(M)

  def metric(keep):
    cut = [n for n, (u, e) in zip(names, es.edges) if not keep[u, e]]
    return ld_np(numpy_edges(params, pairs.clean, cut, corrupt_out)[0], pairs).mean()

  got = search.mib(es, scores)
  mib_scores = -scores                 # MIB attributes the loss -mean(LD)
  fs, cs = library_curve(es.graph, es.edges, mib_scores, metric, absolute=False)
  fa, ca = library_curve(es.graph, es.edges, mib_scores, metric, absolute=True)
  for name, f, c in (("curve_signed", fs, cs), ("curve_absolute", fa, ca)):
    pts = got[name]
    assert [p["fraction"] for p in pts] == list(FRACTIONS)
    assert [p["edges"] for p in pts] == c, name
    np.testing.assert_allclose([p["faithfulness"] for p in pts], f, atol=2e-4)
  cpr, cmd = areas(fs, fa)
  assert got["cpr"] == pytest.approx(cpr, abs=2e-4)
  assert got["cmd"] == pytest.approx(cmd, abs=2e-4)
  # the rankings differ (signed keeps the helpful edges), and one pass is not the fixpoint
  assert not np.allclose(fs, fa)
  assert any(p["edges"] > p["edges_pruned"] for p in got["curve_signed"] + got["curve_absolute"])


def test_signed_ranking_keeps_the_edges_that_help_the_metric(setup, es):
  scores = np.asarray([-3.0, 5.0, -1.0, 0.5])
  assert search.order(scores, signed=True).tolist() == [0, 2, 3, 1]
  assert search.order(scores).tolist() == [1, 0, 2, 3]
  assert search.trapezoid([0, 0.5, 1], [1, 0, 1]) == pytest.approx(0.5)
  assert search.mib_counts(1000) == [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000]


def test_cpr_and_cmd_of_planted_curves_equal_their_areas_by_hand():
  k = np.asarray(FRACTIONS)
  n = np.arange(20)
  # f(k) = k: CPR = integral of k over [0.001, 1] = (1 - 0.001^2) / 2 (trapezoids are
  # exact on a line); f(k) = 1 - k and 1 + k: CMD = the same integral of |1 - f| = k
  for signed, absolute, cpr, cmd in ((k, 1 - k, 0.4999995, 0.4999995),
                                     (k, 1 + k, 0.4999995, 0.4999995),
                                     (2 + 0 * k, 1 + 0 * k, 2 * 0.999, 0.0)):
    got = search.mib_curves(np.concatenate([signed, absolute]), n, n)
    assert got["cpr"] == pytest.approx(cpr, abs=1e-12)
    assert got["cmd"] == pytest.approx(cmd, abs=1e-12)
    assert [p["fraction"] for p in got["curve_absolute"]] == list(FRACTIONS)
  assert search.areas(k, k) == pytest.approx({"cpr": 0.4999995, "cmd": 0.999 - 0.4999995})


@pytest.mark.slow
def test_eap_ig_left_points_equal_a_float64_numpy_ig(setup, es):
  """EAP-IG on the inputs with alpha = k/steps (k = 0..steps-1): for each edge
  u -> e, (A_u - a_u) . mean_k d m / d input_e at the embedding corrupt + alpha_k
  (clean - corrupt), the derivative a float64 central difference of the NumPy forward."""
  _, params, pairs = setup
  names = es.graph.edge_names()
  steps = 3
  _, clean_out = numpy_edges(params, pairs.clean)
  _, corrupt_out = numpy_edges(params, pairs.corrupt)
  got = es.eap_ig(steps, on="inputs", points="left")
  rows = [0, 9, 21, 40, 61, len(names) - 1]
  eps = 1e-3
  for r in rows:
    u = names[r].split(" -> ")[0]
    d = corrupt_out[u] - clean_out[u]
    total = 0.0
    for k in range(steps):
      x = corrupt_out["embed"] + k / steps * (clean_out["embed"] - corrupt_out["embed"])
      _, out = numpy_edges(params, pairs.clean, embed=x)
      m = [ld_np(numpy_edges(params, pairs.clean, [names[r]], {u: out[u] + s * eps * d},
                             embed=x)[0], pairs).mean() for s in (1, -1)]
      total += (m[0] - m[1]) / (2 * eps)
    np.testing.assert_allclose(got[r], total / steps, atol=2e-4, rtol=1e-3)
  assert np.abs(got[rows]).max() > 1e-2
  mid = es.eap_ig(steps, on="inputs", points="midpoint")
  assert np.abs(mid - got).max() > 1e-3           # the points matter
  # on the edge mask: keep = alpha_k everywhere, the same points
  import jax
  ones = np.ones(es.mask.shape, np.float32)
  gs = [jax.grad(lambda k: es.pairs_metric(params, k, es.ablated).mean())(ones * k / steps)
        for k in range(steps)]
  want = -np.asarray(sum(gs) / steps)[es.edges[:, 0], es.edges[:, 1]]
  np.testing.assert_allclose(es.eap_ig(steps, on="activations"), want, atol=1e-5)


def test_the_mib_graph_has_key_and_value_ends_per_query_head(setup, es):
  """--graph mib on a GQA model (4 query heads, 2 key/value heads): the same model, 4
  key and 4 value ends per layer; an edge into query head h's key end changes head h
  alone, and a grouped key end's EAP score is the sum of its query heads' ends'."""
  import jax
  from mha_jax import interventions
  from mha_jax.circuits import edges as edges_lib
  from mha_jax.circuits import graph as graph_lib
  from mha_jax.toolkit import activation_patching
  from oracles import H, LlamaTask
  s, params, pairs = setup
  up = graph_lib.ungroup(params)
  su = activation_patching.Study(LlamaTask(), up, pairs)
  eu = edges_lib.EdgeStudy(su)
  g = eu.graph
  assert g.kv_heads == g.heads == (H, H) and es.graph.kv_heads == (2, 2)
  assert "lm.1.3.k" in g.ends and g.end_node(g.ends.index("lm.1.3.k")) == [
      g.nodes.index("lm.1.3")]
  np.testing.assert_allclose(eu.m_full, es.m_full, atol=1e-5)
  np.testing.assert_allclose(eu.m_empty, es.m_empty, atol=1e-5)
  names = g.edge_names()
  z_of = jax.jit(lambda keep: interventions.run_with_hook(
      lambda hook: su.task.apply(up, {"tokens": su.tokens["clean"]}, hook=hook),
      graph_lib.edge_edits(g, up, keep, eu.ablated),
      read=eu.sites + ("lm.1.attn.z",))[1]["lm.1.attn.z"])
  base = np.asarray(z_of(np.ones(eu.mask.shape, np.float32)))
  for h in range(H):
    for c in "kv":
      r = names.index(f"lm.0.1 -> lm.1.{h}.{c}")
      moved = np.abs(np.asarray(z_of(eu.keep_of([i for i in range(len(names)) if i != r])))
                     - base).max(axis=(0, 1, 3))
      assert [j for j in range(H) if moved[j] > 1e-3] == [h], (h, c, moved)
  # EAP is linear in the end's gradient: a grouped k end = the sum over its query heads
  eg, ev = dict(zip(es.graph.edge_names(), es.eap())), dict(zip(names, eu.eap()))
  for grp, heads in ((0, (0, 1)), (1, (2, 3))):
    want = sum(ev[f"embed -> lm.1.{h}.k"] for h in heads)
    np.testing.assert_allclose(eg[f"embed -> lm.1.{grp}.k"], want, rtol=1e-3, atol=1e-5)


@pytest.mark.slow  # default run: test_edges.py::test_eap_equals_exact_patching_where_the_metric_is_linear_in_the_edge
def test_exact_patching_from_the_edge_s_layer_and_theshared_prefix_changes_nothing(setup):
  """exact() runs each edge from its end's layer on, from the clean stream and the shared
  prefix's KV cache: equal to the full forward's and to the edge-mask forward's."""
  from mha_jax.circuits import edges as edges_lib
  from mha_jax.toolkit import activation_patching
  from mha_jax.toolkit.pairs import Pairs
  from oracles import CachedLlamaTask as Cached, LlamaTask

  _, params, pairs = setup
  corrupt = pairs.clean.copy()
  corrupt[:, 3] = (corrupt[:, 3] + 5) % 37
  p = Pairs(pairs.clean, corrupt, pairs.answer, pairs.wrong, pairs.length, pairs.text)
  plain = edges_lib.EdgeStudy(activation_patching.Study(LlamaTask(), params, p))
  fast = edges_lib.EdgeStudy(activation_patching.Study(Cached(), params, p))
  assert fast.s.share_depth and fast.s.prefix == 3 and not plain.s.share_depth
  assert fast.shared_prefix() == 3
  a, b = fast.exact(), plain.exact()
  np.testing.assert_allclose(a, b, atol=2e-5)
  assert np.abs(b).max() > 1e-2
  for r in (0, 9, 14, 30, 47, 60, len(b) - 1):     # q, k, v, MLP and logits ends
    keep = np.asarray(plain.mask, np.float32)
    keep[tuple(plain.edges[r])] = 0
    np.testing.assert_allclose(b[r], plain.metric(keep) - plain.m_full, atol=2e-5)
  ag = fast.agreements({"a": b, "b": -b}, sample=10, top=3)
  assert ag["a"]["pearson"] == pytest.approx(1, abs=1e-4) and ag["b"]["pearson"] < 0


def test_export_then_import_gives_the_same_scores_and_curve(setup):
  """The EAP-IG library's graph JSON of the ungrouped graph: its edge set is the
  library's (counted from its Graph.from_model), the scores carry its sign and units,
  and reading the file back gives the same scores and MIB curves."""
  import json
  from mha_jax.circuits import edges as edges_lib
  from mha_jax.circuits import graph as graph_lib
  from mha_jax.circuits import mib_graph
  from mha_jax.errors import UserError
  from mha_jax.toolkit import activation_patching
  from oracles import H, L, LlamaTask
  s, params, pairs = setup
  with pytest.raises(UserError, match="--graph mib"):
    mib_graph.edge_names(edges_lib.EdgeStudy(s).graph, np.zeros((0, 2), int))
  eu = edges_lib.EdgeStudy(activation_patching.Study(LlamaTask(), graph_lib.ungroup(params),
                                                     pairs))
  scores = eu.eap()
  keep = search.top_n(eu.graph, eu.edges, scores, 10)
  doc = json.loads(json.dumps(mib_graph.to_doc(eu.graph, eu.edges, scores, 3, 16, keep)))
  # the library's edges: every earlier node -> each head's q, k, v; -> the MLP (its own
  # layer's heads too); every node -> logits
  n = sum((1 + i * (H + 1)) * 3 * H + 1 + i * (H + 1) + H for i in range(L)) + 1 + L * (H + 1)
  assert len(doc["edges"]) == n and doc["cfg"] == {"n_layers": L, "n_heads": H,
                                                   "parallel_attn_mlp": False, "d_model": 16}
  names = mib_graph.edge_names(eu.graph, eu.edges)
  r = eu.graph.edge_names().index("lm.0.1 -> lm.1.3.k")
  assert names[r] == "a0.h1->a1.h3<k>" and doc["edges"][names[r]]["score"] == pytest.approx(
      -scores[r] / 3)
  assert {"input->a0.h0<q>", "a0.h2->m0", "m1->logits"} <= set(doc["edges"])
  assert sum(e["in_graph"] for e in doc["edges"].values()) == keep.sum()
  back = mib_graph.scores_of(doc, eu.graph, eu.edges, 3)
  np.testing.assert_allclose(back, scores, rtol=1e-12)
  assert search.mib(eu, back) == search.mib(eu, scores)
  bad = dict(doc, cfg=dict(doc["cfg"], n_layers=5))
  with pytest.raises(UserError, match="another model"):
    mib_graph.scores_of(bad, eu.graph, eu.edges, 3)
  del doc["edges"][names[0]]
  with pytest.raises(UserError, match="missing"):
    mib_graph.scores_of(doc, eu.graph, eu.edges, 3)


def test_fewest_heads_is_the_smallest_prefix_of_the_ranking_reaching_the_target(setup, es):
  s, _, _ = setup
  scores = es.eap()
  hs = search.head_scores(es.graph, es.edges, scores)
  names = es.graph.nodes
  want = {names[u]: 0.0 for u in range(len(names))}
  for (u, _), v in zip(es.edges, scores):
    want[names[u]] += v
  assert hs == pytest.approx({k: v for k, v in want.items() if k.count(".") == 2
                              and not k.endswith("mlp")})
  ranked = sorted(hs, key=hs.get)
  got = search.fewest_heads(s, es.graph, es.edges, scores, 0.5)
  k = got["count"]
  assert got["heads"] == ranked[:k] and got["reached"]
  assert search.node_view(s, ranked[:k])["faithfulness_nodes"] >= 0.5
  assert k == 1 or search.node_view(s, ranked[:k - 1])["faithfulness_nodes"] < 0.5


def test_several_methods_curves_in_one_call_equal_a_numpy_recomputation(setup, es):
  """search.curves runs every method's circuits in one batched call (a circuit two
  methods share once; the empty and whole graph not run): each method's MIB curves still
  equal the NumPy recomputation, and the whole graph's faithfulness is 1."""
  _, params, pairs = setup
  names = es.graph.edge_names()
  _, corrupt_out = numpy_edges(params, pairs.corrupt)
  rng = np.random.default_rng(5)
  scored = {"a": rng.normal(size=len(es.edges)), "b": rng.normal(size=len(es.edges))}

  def metric(keep):
    cut = [n for n, (u, e) in zip(names, es.edges) if not keep[u, e]]
    return ld_np(numpy_edges(params, pairs.clean, cut, corrupt_out)[0], pairs).mean()

  got = search.curves(es, scored, with_mib=True)
  assert set(got) == {"a", "b"}
  for name, scores in scored.items():
    points, keeps, mib = got[name]
    assert len(points) == len(keeps) == 19 and points[-1]["kept"] == len(es.edges)
    assert points[-1]["faithfulness"] == 1.0 and points[0]["edges"] == int(0.001 * len(es.edges))
    fs, _ = library_curve(es.graph, es.edges, -scores, metric, absolute=False)
    fa, _ = library_curve(es.graph, es.edges, -scores, metric, absolute=True)
    np.testing.assert_allclose([p["faithfulness"] for p in mib["curve_signed"]], fs, atol=2e-4)
    np.testing.assert_allclose([p["faithfulness"] for p in mib["curve_absolute"]], fa, atol=2e-4)


def test_the_agreement_s_batched_exact_patching_equals_each_edge_patched_alone(setup):
  """agreements() patches its sampled edges in one program (groups of edges of several
  layers, each group run from its first edge's layer on the clean stream and the shared
  prefix's cache): every value equals the edge ablated alone in the float64 NumPy
  forward, one forward per edge; the curve's circuits, also from the prefix's cache,
  equal it too."""
  from mha_jax.circuits import edges as edges_lib
  from mha_jax.toolkit import activation_patching
  from mha_jax.toolkit.pairs import Pairs
  from oracles import CachedLlamaTask

  _, params, pairs = setup
  corrupt = pairs.clean.copy()
  corrupt[:, 4] = (corrupt[:, 4] + 7) % 37
  p = Pairs(pairs.clean, corrupt, pairs.answer, pairs.wrong, pairs.length, pairs.text)
  es = edges_lib.EdgeStudy(activation_patching.Study(CachedLlamaTask(), params, p))
  assert es.s.share_depth and es.shared_prefix() == 4
  names = es.graph.edge_names()
  _, corrupt_out = numpy_edges(params, p.corrupt)
  base = ld_np(numpy_edges(params, p.clean)[0], p).mean()
  want = np.asarray([ld_np(numpy_edges(params, p.clean, [n], corrupt_out)[0], p).mean() - base
                     for n in names])
  assert np.abs(want).max() > 1e-2
  # uneven depths: 3 edges into layer 0, 5 into layer 1, 2 into the logits (one group
  # then spans layers 0 and 1)
  layer = [int(n.split(" -> ")[1].split(".")[1]) if "lm." in n.split(" -> ")[1] else 2
           for n in names]
  rows = ([i for i, l in enumerate(layer) if l == 0][:3] + [i for i, l in enumerate(layer)
                                                             if l == 1][::7][:5]
          + [i for i, l in enumerate(layer) if l == 2][-2:])
  assert len(rows) == 10
  np.testing.assert_allclose(es.exact(rows[::-1]), want[rows[::-1]], atol=2e-5)
  # fewer layer-rows than one group per layer padded to the fullest (7 x 2 + 7 x 1)
  assert es.last_exact["edges"] == 10 and es.last_exact["layer_rows"] < 21
  # the curve's circuits also run from the prefix's cache: a random circuit's metric
  rng = np.random.default_rng(2)
  cut = [n for n in names if rng.random() < 0.5]
  lg, _ = numpy_edges(params, p.clean, cut, corrupt_out)
  keep = es.keep_of([i for i, n in enumerate(names) if n not in cut])
  np.testing.assert_allclose(es.curve(keep[None])[0], ld_np(lg, p).mean(), atol=2e-5)
  np.testing.assert_allclose(es.metric(keep), ld_np(lg, p).mean(), atol=2e-5)
  ag = es.agreements({"x": want, "y": -want}, sample=12, top=4)
  assert ag["x"]["n"] == 12 and ag["x"]["pearson"] == pytest.approx(1, abs=1e-6)
  assert ag["x"]["spearman"] == pytest.approx(1, abs=1e-6)
  assert ag["y"]["pearson"] == pytest.approx(-1, abs=1e-6)
