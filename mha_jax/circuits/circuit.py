"""`mha-jax circuit`: the circuit of one behaviour, found by edge scores and checked.

  DIR/circuit.json   "graph" (node and edge counts), "edges" (ranked {"from", "to",
                     "score"}: the change of the pair-mean metric when the edge is
                     ablated), "curve" (per size: edges, faithfulness, nodes), "cpr",
                     "cmd", "agreement" (EAP and EAP-IG against exact patching on a
                     sample of edges), "nodes" ({"heads", "mlps", "faithfulness_nodes"}
                     of the smallest circuit on the curve reaching the target),
                     "seconds", and the pairs (those left out: "failing")
  DIR/faithfulness.png   the curve
  DIR/circuit.png        the target circuit, layer by layer
  DIR/explorer.html      the explorer's circuit view (the graph layer by layer; a click on
                         a head opens its attention on the first pairs) beside the attention
                         view (mha_jax/assets/explorer.*)

--method auto (the default) draws the curve of every method that fits (EAP, EAP-IG, and
exact patching up to AUTO_EXACT_EDGES edges) and keeps the most faithful one: the largest
CPR (ties: the smaller CMD); "methods" records each one's CPR, CMD and target circuit,
"chosen" the one kept.
"""

from __future__ import annotations

import html
import time

import jax
import numpy as np

from mha_jax import storage
from mha_jax.circuits import edges as E
from mha_jax.circuits import search, tasks
from mha_jax.errors import UserError
from mha_jax.patching import core
from mha_jax.toolkit import ablations

METHODS = ("auto", "eap", "eap-ig", "exact", "greedy")
# --method auto also scores every edge by exact patching (one forward each) up to this
# many edges (a tiny model's graph; SmolLM2 has 70,651, Gemma 3 270M 5,644)
AUTO_EXACT_EDGES = 2000


def check(method: str, ablation: str, target: float, steps: int) -> None:
  if method not in METHODS:
    raise UserError(f"--method must be one of {', '.join(METHODS)}; got {method!r}")
  ablations.check_kind(ablation)
  if not 0 < target <= 1:
    raise UserError(f"--target must be in (0, 1]; got {target}")
  if steps < 1:
    raise UserError(f"--steps must be >= 1; got {steps}")


def _clean_metric(s: core.Study, metric) -> np.ndarray:
  fn = jax.jit(lambda p, tok: metric(s._forward(p, tok)[0]))
  return np.asarray(fn(s.params, s.tokens["clean"]), np.float64)


def prepare(run, task, pairs_file, n_pairs, seed, keep_failing, log=print):
  """(Study, metric fn, metric spec, pairs doc, failing doc): the pairs with those the
  model fails on the clean prompt (metric <= 0) left out unless keep_failing."""
  pairs, spec = tasks.make(run, task, pairs_file, n_pairs, seed)
  s = core.Study(run.task, run.params, pairs, share_prefix=False)
  m_clean = _clean_metric(s, tasks.metric_of(pairs, spec))
  bad = np.nonzero(m_clean <= 0)[0]
  failing = [{**pairs.to_json()[i], "metric_clean": float(m_clean[i])} for i in bad]
  if len(bad):
    log(f"{len(bad)} of {len(pairs)} pairs fail on the clean prompt (metric <= 0)"
        + ("; kept (--keep-failing)" if keep_failing else "; left out"))
  if len(bad) and not keep_failing:
    good = np.nonzero(m_clean > 0)[0]
    if not len(good):
      raise UserError("the model fails every clean prompt (metric <= 0): no circuit to find")
    pairs, spec = pairs.subset(good), tasks.subset_metric(spec, good)
    s = core.Study(run.task, run.params, pairs, share_prefix=False)
    m_clean = m_clean[good]
  return s, tasks.metric_of(pairs, spec), spec, failing


def study(run, out: str, *, task=None, pairs_file=None, method: str = "auto",
          ablation: str = "corrupt", target: float = 0.8, n_pairs: int = 8, seed: int = 0,
          steps: int = 5, ig_on: str = "inputs", keep_failing: bool = False,
          sample: int = 200, threshold: float = 0.01, log=print) -> dict:
  """Scores every edge, draws the faithfulness curve, picks the target circuit; writes
  DIR/circuit.json, faithfulness.png, circuit.png and returns the document."""
  check(method, ablation, target, steps)
  t0 = time.perf_counter()
  s, metric, spec, failing = prepare(run, task, pairs_file, n_pairs, seed, keep_failing, log)
  es = E.EdgeStudy(s, metric=metric, ablation=ablation)
  seconds = {}
  log(f"graph: {es.graph.size()}; metric full {es.m_full:.4f}, empty {es.m_empty:.4f}")

  def timed(name, fn):
    t = time.perf_counter()
    v = fn()
    seconds[name] = round(time.perf_counter() - t, 3)
    log(f"{name}: {seconds[name]:.1f} s")
    return v

  eap = timed("eap", es.eap)
  ig = timed("eap_ig", lambda: es.eap_ig(steps, ig_on))
  scored = {"eap": eap, "eap-ig": ig}
  if method == "exact" or (method == "auto" and len(es.edges) <= AUTO_EXACT_EDGES):
    scored["exact"] = timed("exact", es.exact)
  if method == "greedy":
    keep = timed("greedy", lambda: search.greedy(es, threshold, log=log))
    candidates = {"greedy": np.where(keep[es.edges[:, 0], es.edges[:, 1]],
                                     np.abs(eap) + 1e-9, 0.0)}
  else:
    candidates = scored if method == "auto" else {method: scored[method]}
  agreement = {name: timed(f"agreement_{name}", lambda est=est: es.agreement(
      est, sample=sample, seed=seed)) for name, est in (("eap", eap), ("eap-ig", ig))}
  tried = {name: _circuit_at(es, sc, target, timed, name)
           for name, sc in candidates.items()}
  chosen = max(tried, key=lambda n: (tried[n]["cpr"], -tried[n]["cmd"]))
  if len(tried) > 1:
    log("auto: " + ", ".join(f"{n} CPR {t['cpr']:.4f}" for n, t in tried.items())
        + f"; kept {chosen}")
  scores, points, best, at = (tried[chosen][k] for k in ("scores", "points", "keep", "at"))
  area = {k: tried[chosen][k] for k in ("cpr", "cmd")}
  view = search.touched(es.graph, best)
  nodes = {"heads": view["heads"], "mlps": view["mlps"], "edges": int(best.sum()),
           "faithfulness": points[at if at is not None else -1]["faithfulness"],
           "reached_target": at is not None,
           **timed("nodes", lambda: search.node_view(s, view["heads"]))}
  names = es.graph.nodes, es.graph.ends
  order = np.argsort(-np.abs(scores), kind="stable")
  doc = {"workdir": run.workdir, "task": task or pairs_file, "method": method,
         "chosen": chosen, "methods": {n: {k: t[k] for k in ("cpr", "cmd", "edges",
                                                             "faithfulness", "reached")}
                                       for n, t in tried.items()},
         "ablation": ablation, "target": target, "steps": steps, "ig_on": ig_on,
         "metric": spec["name"] if isinstance(spec, dict) else spec,
         "metric_full": es.m_full, "metric_empty": es.m_empty,
         "graph": es.graph.size(),
         "edges": [{"from": names[0][es.edges[r, 0]], "to": names[1][es.edges[r, 1]],
                    "score": round(float(scores[r]), 7)} for r in order],
         "curve": points, **area, "agreement": agreement, "nodes": nodes,
         "pairs": len(s.pairs), "failing": failing, "seconds": seconds}
  doc["seconds"]["total"] = round(time.perf_counter() - t0, 3)
  storage.makedirs(out)
  storage.write_json(storage.join(out, "circuit.json"), doc)
  plot_curve(points, target, storage.join(out, "faithfulness.png"),
             f"{doc['task']}: {chosen}" + (" (auto)" if method == "auto" else "")
             + f", {ablation} ablation")
  plot_circuit(es.graph, best, scores, es.edges, storage.join(out, "circuit.png"))
  write_explorer(out, doc, es, best, scores, s, run.task)
  return doc


def _circuit_at(es, scores, target, timed, name) -> dict:
  """One method's curve, CPR / CMD and its smallest circuit reaching target (else the
  whole graph's)."""
  points, keeps = timed(f"curve_{name}", lambda: search.curve(es, scores))
  area = search.curve_areas(points)
  at = search.smallest_reaching(points, target)
  keep = keeps[at] if at is not None else keeps[-1]
  return {"scores": scores, "points": points, "keep": keep, "at": at, **area,
          "edges": int(keep.sum()), "reached": at is not None,
          "faithfulness": points[at if at is not None else -1]["faithfulness"]}


def circuit_view(doc: dict, graph, keep, scores, edges) -> dict:
  """The explorer's circuit data: the graph's shape, the target circuit's edges
  ({"from", "to", "score", "into": the nodes the end feeds}) and the summary."""
  score = {(int(u), int(e)): float(v) for (u, e), v in zip(edges, scores)}
  nodes, ends = graph.nodes, graph.ends
  rows = sorted(zip(*np.nonzero(keep)), key=lambda ue: -abs(score.get((int(ue[0]), int(ue[1])), 0.0)))
  out = [{"from": nodes[u], "to": ends[e], "score": round(score.get((int(u), int(e)), 0.0), 7),
          "into": [nodes[n] for n in graph.end_node(int(e))] or ["logits"]} for u, e in rows]
  n = doc["nodes"]
  keys = ("task", "workdir", "pairs", "ablation", "method", "chosen", "target", "cpr", "cmd")
  return {"graph": {"layers": graph.layers, "heads": list(graph.heads),
                    "kv_heads": list(graph.kv_heads), "mlp": [bool(m) for m in graph.mlp],
                    "edges_total": doc["graph"]["edges"]},
          "edges": out, "heads": n["heads"], "mlps": n["mlps"],
          "summary": {**{k: doc[k] for k in keys}, "faithfulness": n["faithfulness"],
                      "faithfulness_nodes": n.get("faithfulness_nodes")}}


def write_explorer(out, doc, es, keep, scores, study, task, pairs: int = 2) -> str:
  """DIR/explorer.html: the circuit view and the attention of the first `pairs` pairs
  (clean and corrupt) from the study's own forward."""
  from mha_jax import assets
  from mha_jax.patching import explorer
  data = {**explorer.attention_data(study, task, pairs),
          "circuit": explorer._finite(circuit_view(doc, es.graph, keep, scores, es.edges))}
  path = storage.join(out, "explorer.html")
  storage.write_text(path, assets.page("explorer", data, title=html.escape(
      f"circuit of {doc['task']} on {doc['workdir']}")))
  return path


def plot_curve(points, target, path, title) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, ax = plt.subplots(figsize=(5, 3.4))
  x = [max(p["fraction"], 1e-5) for p in points]
  ax.plot(x, [p["faithfulness"] for p in points], "o-", ms=3)
  ax.axhline(target, color="gray", ls=":", lw=1)
  ax.axhline(1.0, color="black", lw=0.5)
  ax.set_xscale("log")
  ax.set_xlabel("fraction of edges kept")
  ax.set_ylabel("faithfulness")
  ax.set_title(title, fontsize=9)
  fig.tight_layout()
  storage.savefig(fig, path, dpi=110)
  plt.close(fig)


def plot_circuit(graph, keep, scores, edges, path) -> None:
  """Nodes at (position in layer, layer): embed at the bottom, logits at the top; the
  kept edges, red where ablating them lowers the metric, blue where it raises it."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  L = graph.layers
  width = max(graph.heads) + 1
  pos = {0: ((width - 1) / 2, 0.0)}
  off = graph.node_offsets()
  for i in range(L):
    for h in range(graph.heads[i]):
      pos[off[i] + h] = (h, 1.0 + i)
    if graph.mlp[i]:
      pos[off[i] + graph.heads[i]] = (width - 0.3, 1.4 + i)
  top = (float(width - 1) / 2, L + 1.0)
  fig, ax = plt.subplots(figsize=(max(4, 0.5 * width + 2), max(4, 0.28 * L + 2)))
  score = {(int(u), int(e)): float(v) for (u, e), v in zip(edges, scores)}
  lim = max((abs(score[(u, e)]) for u, e in zip(*np.nonzero(keep))), default=1.0) or 1.0
  used = set()
  for u, e in zip(*np.nonzero(keep)):
    fed = graph.end_node(int(e))
    targets = [pos[n] for n in fed] if fed else [top]
    v = score.get((int(u), int(e)), 0.0)
    for tx, ty in targets:
      ax.plot([pos[u][0], tx], [pos[u][1], ty], color="tab:red" if v < 0 else "tab:blue",
              lw=0.3 + 2.5 * abs(v) / lim, alpha=0.6)
    used.add(int(u))
    used.update(fed)
  names = graph.nodes
  for n, (x, y) in pos.items():
    on = n in used
    ax.plot(x, y, "o", color="black" if on else "0.85", ms=5 if on else 2)
    if on and n:
      ax.annotate(names[n].split(".", 1)[1], (x, y), fontsize=6, xytext=(2, 2),
                  textcoords="offset points")
  ax.plot(*top, "s", color="black")
  ax.annotate("logits", top, fontsize=7, xytext=(4, 0), textcoords="offset points")
  ax.annotate("embed", pos[0], fontsize=7, xytext=(4, 0), textcoords="offset points")
  ax.set_xlabel("head (MLP on the right)")
  ax.set_ylabel("layer + 1")
  ax.set_title(f"circuit: {int(np.sum(keep))} edges", fontsize=9)
  fig.tight_layout()
  storage.savefig(fig, path, dpi=110)
  plt.close(fig)


def format_summary(doc: dict) -> str:
  n = doc["nodes"]
  a = doc["agreement"]
  lines = [f"graph {doc['graph']}; {doc['pairs']} pairs ({len(doc['failing'])} failing "
           f"left out); metric full {doc['metric_full']:.4f}, empty {doc['metric_empty']:.4f}",
           f"circuit at target {doc['target']}: {n['edges']} edges, {len(n['heads'])} heads, "
           f"{len(n['mlps'])} MLPs, faithfulness {n['faithfulness']:.3f}, "
           f"faithfulness_nodes {n['faithfulness_nodes']:.3f}",
           f"CPR {doc['cpr']:.3f}, CMD {doc['cmd']:.3f}"]
  for k, v in a.items():
    lines.append(f"{k} vs exact on {v['n']} edges: Pearson {v['pearson']:.3f}, Spearman "
                 f"{v['spearman']:.3f}, top-20 overlap {v.get('top20_overlap', float('nan')):.2f}")
  return "\n".join(lines)
