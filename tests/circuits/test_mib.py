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
