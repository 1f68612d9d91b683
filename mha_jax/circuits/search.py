"""Circuit search and faithfulness over circuit sizes.

  prune(graph, keep)       the kept edges that still connect the input to the logits: an
                           edge u -> e stays when u is reached from the embedding by kept
                           edges and e's node reaches the logits by kept edges (the fixed
                           point of MIB's pruning: what its evaluate_graph evaluates)
  prune_once(graph, keep)  MIB's first pruning pass (EAP-IG 7af394a's Graph.prune after
                           apply_topn stops there): the edge count MIB reports
  order(scores, signed)    the ranking: by |score|, or signed (the edges that help the
                           metric first: the most negative here, where a score is the
                           change of the metric when the edge is ablated; MIB's scores
                           have the opposite sign, it attributes the loss -mean(LD))
  top_n(graph, edges, scores, n, signed)   the first n edges of the ranking, pruned
  sizes(total)             19 circuit sizes from 0.1 % of the edges to all of them: MIB's
                           ten fractions k (MIB_FRACTIONS) and the geometric mean of each
                           neighbouring pair, n = int(k * total) edges requested
  curve(es, scores)        faithfulness f = (m(C) - m(empty)) / (m(M) - m(empty)) of the
                           top-n circuit at every size, one batched program
  curve_areas(points)      trapezoid areas of f and |1 - f| over a curve's MIB fractions
  mib(es, scores)          MIB's evaluation (Mueller et al. 2025; MIB_circuit_track's
                           evaluate_area_under_curve, print_results.py): "curve_signed"
                           and "curve_absolute" at MIB's ten fractions k, n = int(k * E)
                           edges each, top n then pruned, and CPR = integral of f(k) dk
                           over the signed ranking (can exceed 1), CMD = integral of
                           |1 - f(k)| dk over the |score| ranking, trapezoids linear in k
  greedy(es, threshold)    ACDC-style: edges visited from the logits backwards, each
                           removed when the metric moves by less than threshold *
                           |m(M) - m(empty)| (exact patching, one forward per edge)
  fewest_heads(...)        MIB's node track: the fewest heads, ranked by their edges'
                           scores, whose node view reaches the target
  node_view(...)           the heads a circuit touches and faithfulness_nodes: the clean
                           run with every other head's z (every position) from the paired
                           corrupt run, MLPs and embeddings recomputing, as
                           (LD_set - LD_none) / (LD_clean - LD_none), LD_none with every
                           head patched
"""

from __future__ import annotations

import numpy as np

from mha_jax import interventions
from mha_jax.errors import UserError


def prune(graph, keep) -> np.ndarray:
  """keep (N_nodes, N_ends) bool with the edges that do not connect input to logits
  dropped."""
  keep = np.asarray(keep, bool) & graph.mask()
  n_nodes, n_ends = keep.shape
  _, node_ends = _feeds(graph)
  reached = np.zeros(n_nodes, bool)
  reached[0] = True
  for v in range(1, n_nodes):          # node order is topological
    reached[v] = any(keep[reached, e].any() for e in node_ends[v])
  keep &= reached[:, None]
  useful = np.zeros(n_nodes, bool)
  end_useful = np.zeros(n_ends, bool)
  end_useful[-1] = True                # logits
  for v in range(n_nodes - 1, -1, -1):
    useful[v] = bool((keep[v] & end_useful).any())
    if useful[v]:
      end_useful[node_ends[v]] = True
  return keep & end_useful[None, :]


def _feeds(graph) -> tuple[list[list[int]], list[list[int]]]:
  """(the nodes each end feeds, the ends of each node)."""
  feeds = [graph.end_node(e) for e in range(len(graph.ends))]
  node_ends: list[list[int]] = [[] for _ in graph.nodes]
  for e, ns in enumerate(feeds):
    for n in ns:
      node_ends[n].append(e)
  return feeds, node_ends


def prune_once(graph, keep) -> np.ndarray:
  """MIB's first pruning pass: a node stays when it sends a kept edge and receives one
  (the input always receives), then an edge stays when its sender and a node its end
  feeds stay (the logits always). Not a fixed point: prune() is."""
  keep = np.asarray(keep, bool) & graph.mask()
  feeds, node_ends = _feeds(graph)
  sends = keep.any(1)
  into = keep.any(0)
  receives = np.asarray([v == 0 or bool(into[node_ends[v]].any())
                         for v in range(len(graph.nodes))])
  alive = sends & receives
  end_alive = np.asarray([bool(alive[f].any()) if f else True for f in feeds])
  return keep & alive[:, None] & end_alive[None, :]


def order(scores, signed: bool = False) -> np.ndarray:
  """Edge rows ranked: by |score| descending, or signed (most negative first: the
  edges whose ablation lowers the metric most, MIB's most positive). Stable."""
  s = np.asarray(scores, np.float64)
  return np.argsort(s if signed else -np.abs(s), kind="stable")


def top_n(graph, edges, scores, n: int, signed: bool = False,
          pruned: bool = True) -> np.ndarray:
  """(N_nodes, N_ends) bool: the first n edges (rows of `edges`) of order(scores,
  signed), pruned (or only MIB's first pass, pruned=False)."""
  rows = order(scores, signed)[:int(n)]
  keep = np.zeros(graph.mask().shape, bool)
  keep[edges[rows, 0], edges[rows, 1]] = True
  return prune(graph, keep) if pruned else prune_once(graph, keep)


MIB_FRACTIONS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0)


def fractions() -> list[float]:
  """MIB's fractions of edges and the geometric mean of each neighbouring pair (19)."""
  out = [MIB_FRACTIONS[0]]
  for a, b in zip(MIB_FRACTIONS, MIB_FRACTIONS[1:]):
    out += [float(np.sqrt(a * b)), b]
  return out


def sizes(total: int) -> list[int]:
  """The edge counts of fractions(): int(k * total) as MIB takes them (0: the empty
  circuit)."""
  return [int(k * total) for k in fractions()]


def faithfulness_of(es, keeps) -> tuple[np.ndarray, np.ndarray]:
  """(faithfulness (S,), metric (S,)) of circuits keeps (S, N_nodes, N_ends), each
  distinct circuit run once, all in one batched program; the empty circuit and the whole
  graph are m(empty) and m(M) by definition (not run)."""
  keeps = np.asarray(keeps, bool)
  flat = keeps.reshape(len(keeps), -1)
  uniq, inv = np.unique(flat, axis=0, return_inverse=True)
  inv = inv.reshape(-1)
  full = es.mask.reshape(-1).astype(bool)
  known = {i: es.m_full if np.array_equal(u, full) else es.m_empty
           for i, u in enumerate(uniq) if not u.any() or np.array_equal(u, full)}
  run = [i for i in range(len(uniq)) if i not in known]
  m_u = np.zeros(len(uniq))
  for i, v in known.items():
    m_u[i] = v
  if run:
    m_u[run] = es.curve(uniq[run].reshape((-1,) + keeps.shape[1:]).astype(np.float32))
  m = m_u[inv]
  return es.faithfulness(m), m


def _curve_keeps(es, scores, counts=None, with_mib: bool = False):
  """(ks, counts, keeps (S, N_nodes, N_ends), mib_keeps' triple or None): the circuits
  of curve() before they run."""
  total = len(es.edges)
  if counts is None:
    ks, counts = fractions(), sizes(total)
  else:
    counts = list(counts)
    ks = [n / total for n in counts]
  keeps = np.stack([top_n(es.graph, es.edges, scores, n) for n in counts])
  return ks, counts, keeps, (mib_keeps(es.graph, es.edges, scores) if with_mib else None)


def _curve_doc(es, built, f, m):
  """curve()'s return value from _curve_keeps' circuits and their faithfulness f and
  metric m (S,) (the curve's circuits, then mib_keeps')."""
  ks, counts, keeps, extra = built
  total = len(es.edges)
  points = [{"edges": int(n), "requested": float(k), "kept": int(kp.sum()),
             "fraction": float(kp.sum() / total), "faithfulness": float(fi),
             "metric": float(mi), "nodes": len(touched(es.graph, kp)["nodes"])}
            for n, k, kp, fi, mi in zip(counts, ks, keeps, f, m)]
  if extra is None:
    return points, keeps
  return points, keeps, mib_curves(f[len(keeps):], extra[1], extra[2])


def curve(es, scores, counts=None, with_mib: bool = False):
  """([{"edges": requested n, "requested": the fraction k it stands for, "kept": edges
  left after pruning, "fraction": kept / total, "faithfulness", "metric", "nodes": nodes
  touched}], keeps (S, N_nodes, N_ends)) of the top-n circuits by |scores|; by default
  at sizes(total). with_mib: also mib()'s document, the circuits of both in one
  program (a third element)."""
  return curves(es, {"x": scores}, counts, with_mib)["x"]


def curves(es, scored: dict, counts=None, with_mib: bool = False) -> dict:
  """{name: curve(es, scores, counts, with_mib)} of several methods' scores, every
  method's circuits in one batched program (a circuit two methods share runs once)."""
  built = {name: _curve_keeps(es, sc, counts, with_mib) for name, sc in scored.items()}
  parts = [np.concatenate([b[2]] + ([b[3][0]] if b[3] is not None else []))
           for b in built.values()]
  f, m = faithfulness_of(es, np.concatenate(parts))
  out, at = {}, 0
  for (name, b), part in zip(built.items(), parts):
    out[name] = _curve_doc(es, b, f[at:at + len(part)], m[at:at + len(part)])
    at += len(part)
  return out


def areas(ks, faith) -> dict[str, float]:
  """{"cpr", "cmd"}: trapezoid areas of f and |1 - f| over the points (k, f) as given,
  linear in k (no points added)."""
  x, y = np.asarray(ks, np.float64), np.asarray(faith, np.float64)
  order = np.argsort(x, kind="stable")
  x, y = x[order], y[order]
  return {"cpr": float(np.trapezoid(y, x)), "cmd": float(np.trapezoid(np.abs(1 - y), x))}


def curve_areas(points: list[dict]) -> dict[str, float]:
  """MIB's CPR and CMD of a curve: areas() over its points at MIB_FRACTIONS (all its
  points when it has fewer than two of them: a curve of chosen counts)."""
  mib = [p for p in points if np.isclose(p["requested"], MIB_FRACTIONS).any()]
  use = mib if len(mib) >= 2 else points
  return areas([p["requested"] for p in use], [p["faithfulness"] for p in use])


def mib_counts(total: int) -> list[int]:
  """n = int(k * total) for MIB's ten fractions k (0: the empty circuit)."""
  return [int(k * total) for k in MIB_FRACTIONS]


def mib_keeps(graph, edges, scores) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """(keeps (20, N_nodes, N_ends): the signed ranking's ten circuits then the absolute
  ranking's, fully pruned; their edge counts after MIB's first pass (20,); after the
  full prune (20,))."""
  keeps, first = [], []
  for signed in (True, False):
    for n in mib_counts(len(edges)):
      once = top_n(graph, edges, scores, n, signed, pruned=False)
      first.append(int(once.sum()))
      keeps.append(prune(graph, once))
  keeps = np.stack(keeps)
  return keeps, np.asarray(first), keeps.sum(axis=(1, 2))


def mib_curves(faith, first, full) -> dict:
  """{"curve_signed", "curve_absolute": [{"fraction", "edges" (MIB's count: after its
  first pruning pass), "edges_pruned" (after the full prune, the circuit evaluated),
  "faithfulness"}], "cpr", "cmd"} from the 20 circuits of mib_keeps."""
  out = {}
  for j, name in enumerate(("curve_signed", "curve_absolute")):
    sl = slice(10 * j, 10 * j + 10)
    out[name] = [{"fraction": k, "edges": int(a), "edges_pruned": int(b),
                  "faithfulness": float(f)}
                 for k, a, b, f in zip(MIB_FRACTIONS, first[sl], full[sl], faith[sl])]
  out["cpr"] = trapezoid(MIB_FRACTIONS, [p["faithfulness"] for p in out["curve_signed"]])
  out["cmd"] = trapezoid(MIB_FRACTIONS, [abs(1 - p["faithfulness"])
                                         for p in out["curve_absolute"]])
  return out


def trapezoid(xs, ys) -> float:
  """sum over neighbours of (x2 - x1) (y1 + y2) / 2 (MIB's sum, in its order)."""
  return float(sum((b - a) * (ya + yb) / 2 for a, b, ya, yb in zip(xs, xs[1:], ys, ys[1:])))


def mib(es, scores) -> dict:
  """MIB's evaluation of edge scores (see the module docstring), the 20 circuits in one
  batched program."""
  keeps, first, full = mib_keeps(es.graph, es.edges, scores)
  return mib_curves(faithfulness_of(es, keeps)[0], first, full)


def smallest_reaching(points: list[dict], target: float) -> int | None:
  """The index of the first curve point whose faithfulness reaches target (None)."""
  for i, p in enumerate(points):
    if p["faithfulness"] >= target:
      return i
  return None


def touched(graph, keep) -> dict:
  """{"nodes": names, "heads": [...], "mlps": [...]} that a circuit's edges touch (as
  sender or receiver; the embedding and the logits left out)."""
  keep = np.asarray(keep, bool)
  names = graph.nodes
  used = set(np.nonzero(keep.any(1))[0].tolist())        # senders
  for e in np.nonzero(keep.any(0))[0]:
    fed = graph.end_node(int(e))
    if len(fed) == 1:          # a query or MLP end (a kv end counts its senders only)
      used.update(fed)
  used.discard(0)
  nodes = [names[i] for i in sorted(used)]
  return {"nodes": nodes, "heads": [n for n in nodes if not n.endswith(".mlp")],
          "mlps": [n for n in nodes if n.endswith(".mlp")]}


def greedy(es, threshold: float = 0.01, max_edges: int = 5000, log=None) -> np.ndarray:
  """ACDC-style pruning with exact patching: (N_nodes, N_ends) bool circuit."""
  if not 0 < threshold < 1:
    raise UserError(f"threshold must be in (0, 1); got {threshold}", setting="threshold")
  if len(es.edges) > max_edges:
    raise UserError(f"greedy pruning runs one forward per edge: this graph has "
                    f"{len(es.edges)} edges (> {max_edges}); use method eap or eap-ig",
                    setting="method")
  keep = es.mask.astype(np.float32)
  scale = abs(es.m_full - es.m_empty)
  current = es.m_full
  order = sorted(range(len(es.edges)), key=lambda r: (-es.edges[r][1], -es.edges[r][0]))
  for r in order:          # from the logits' inputs back to the first layer's
    u, e = es.edges[r]
    trial = keep.copy()
    trial[u, e] = 0.0
    m = es.metric(trial)
    if abs(m - current) < threshold * scale:
      keep, current = trial, m
  if log:
    log(f"greedy: {int(keep.sum())} of {len(es.edges)} edges kept")
  return prune(es.graph, keep > 0)


def node_faithfulness(study):
  """heads (names lm.l.h) -> node_view's document, the corrupt z and LD_none computed
  once."""
  zc = study.values("corrupt", tuple(f"lm.{i}.attn.z" for i in range(study.layers)))

  def edits(kept):
    return {f"lm.{i}.attn.z": interventions.replace(zc[f"lm.{i}.attn.z"], heads=np.asarray(
        [(i, h) not in kept for h in range(study.heads[i])])) for i in range(study.layers)}

  ld_none = float(np.mean(study.edited("clean", edits(set()))["ld"]))
  ld_clean = float(np.mean(study.ld_clean))

  def of(heads):
    keep = {(int(a), int(b)) for a, b in (n.split(".")[1:] for n in heads)}
    ld_set = float(np.mean(study.edited("clean", edits(keep))["ld"]))
    return {"ld_set": ld_set, "ld_none": ld_none, "ld_clean": ld_clean,
            "faithfulness_nodes": (ld_set - ld_none) / (ld_clean - ld_none)}
  return of


def node_view(study, heads: list[str]) -> dict:
  """faithfulness_nodes of a head set (names lm.l.h), through the patching Study."""
  return node_faithfulness(study)(heads)


def head_scores(graph, edges, scores) -> dict[str, float]:
  """{head: the sum of its outgoing edges' scores} (this library's sign: negative where
  ablating the head's edges lowers the metric)."""
  out = np.zeros(len(graph.nodes))
  np.add.at(out, edges[:, 0], np.asarray(scores, np.float64))
  return {n: float(out[i]) for i, n in enumerate(graph.nodes)
          if n != "embed" and not n.endswith(".mlp")}


def fewest_heads(study, graph, edges, scores, target: float, of=None) -> dict:
  """The fewest heads whose node view reaches target: heads ranked by head_scores,
  signed (the most helpful first, as MIB's node track ranks), the smallest k whose top k
  reach faithfulness_nodes >= target (a bisection, then down while k - 1 still reaches;
  one forward per k tried). {"heads", "count", "faithfulness_nodes", "reached", "tried":
  {k: faithfulness}}. of: node_faithfulness(study) when already made (its corrupt z and
  LD_none are not run again)."""
  hs = head_scores(graph, edges, scores)
  ranked = sorted(hs, key=lambda n: hs[n])
  of = of or node_faithfulness(study)
  tried: dict[int, float] = {}

  def f(k):
    if k not in tried:
      tried[k] = of(ranked[:k])["faithfulness_nodes"]
    return tried[k]

  lo, hi = 0, len(ranked)
  if f(hi) < target:
    return {"heads": ranked, "count": hi, "faithfulness_nodes": f(hi), "reached": False,
            "tried": tried}
  while hi - lo > 1:
    mid = (lo + hi) // 2
    lo, hi = (lo, mid) if f(mid) >= target else (mid, hi)
  while hi > 1 and f(hi - 1) >= target:
    hi -= 1
  return {"heads": ranked[:hi], "count": hi, "faithfulness_nodes": f(hi), "reached": True,
          "tried": {int(k): v for k, v in sorted(tried.items())}}
