"""`mha-jax circuit`: the circuit of one behaviour, found by edge scores and checked (not
`mha-jax circuits`, induction_circuits.py: a decoder's induction circuits).

  DIR/circuit.json   "graph" (node and edge counts), "edges" (ranked {"from", "to",
                     "score"}: the change of the pair-mean metric when the edge is
                     ablated), "curve" (per size, |score| ranking: edges, faithfulness,
                     nodes), MIB's evaluation: "curve_signed" and "curve_absolute"
                     ({"fraction", "edges" (MIB's count, after its first pruning pass),
                     "edges_pruned" (the circuit evaluated), "faithfulness"} at MIB's
                     ten fractions), "cpr" (signed ranking), "cmd" (|score| ranking),
                     "cpr_absolute_ranking", "agreement" (EAP and EAP-IG against exact
                     patching on a sample of edges), "nodes" ({"heads", "mlps", "faithfulness_nodes"}
                     of the smallest circuit on the curve reaching the target),
                     "seconds" (wall) and "cpu_seconds" (this process's CPU time, all
                     threads) per step, and the pairs (those left out: "failing")
  DIR/mib_graph.json     with --export mib: the chosen scores (and the target circuit as
                         in_graph) in the EAP-IG library's graph JSON (circuits.mib_graph)
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

import dataclasses
import html
import time

import jax
import numpy as np

from mha_jax import loader, settings, storage
from mha_jax.circuits import edges as edges_lib
from mha_jax.circuits import graph as graph_lib
from mha_jax.circuits import mib_graph
from mha_jax.circuits import search, circuit_behaviours
from mha_jax.errors import UserError
from mha_jax.settings import setting
from mha_jax.train import sharding
from mha_jax.toolkit import activation_patching
from mha_jax.toolkit import ablations
from mha_jax.toolkit import memory
from mha_jax.toolkit import plots

METHODS = ("auto", "eap", "eap-ig", "exact", "greedy")
# --method auto also scores every edge by exact patching (one forward each) up to this
# many edges (a tiny model's graph; SmolLM2 has 70,651, Gemma 3 270M 5,644)
AUTO_EXACT_EDGES = 2000


@dataclasses.dataclass(frozen=True, kw_only=True)
class CircuitOptions:
  """The settings of `circuit`; `methods=` marks those only some methods read."""
  task: str | None = setting(None, choices=circuit_behaviours.BEHAVIOURS,
                             help="a built-in behaviour (or give pairs)")
  pairs: str | None = setting(None, path=True, help="a JSONL file, one {clean, corrupt, "
                              "answer, wrong[, metric]} a line (metric: logit_diff or "
                              "prob_diff)")
  method: str = setting("auto", choices=METHODS,
                        help="edge scores: auto (default: the most faithful of eap, eap-ig "
                             "and, on small graphs, exact, by CPR), eap, eap-ig, exact "
                             "patching, or greedy (ACDC-style pruning with exact "
                             "patching; small graphs)")
  graph: str = setting("grouped", choices=graph_lib.GRAPHS,
                       help="grouped (default: one key and one value end per key/value "
                            "head) or mib (ends per query head, as the EAP-IG library and "
                            "MIB build it; the same on MHA models)")
  ablation: str = setting("corrupt", choices=ablations.KINDS,
                          help="what an edge outside the circuit carries")
  target: float = setting(0.8, lo=0, hi=1, lo_open=True,
                          help="faithfulness of the node view's circuit, in (0, 1]")
  steps: int = setting(5, lo=1, help="EAP-IG's interpolation steps (EAP-IG is also run "
                       "for the agreement report)")
  ig_on: str = setting("inputs", choices=edges_lib.IG_ON, help="EAP-IG interpolates the input "
                       "embedding or every edge together")
  ig_points: str = setting("left", choices=edges_lib.IG_POINTS, help="EAP-IG's points: "
                           "left k/steps, k = 0..steps-1 (the EAP-IG library's and MIB's), "
                           "or midpoint (k + 1/2)/steps")
  sample: int = setting(200, lo=1, help="edges exact patching checks EAP and EAP-IG on")
  export: str | None = setting(None, choices=("mib",), help="also write DIR/mib_graph.json: "
                               "the scores in the EAP-IG library's graph JSON (MIB's "
                               "leaderboard format; needs --graph mib on GQA models)")
  evaluate: str | None = setting(None, path=True, help="score a graph another tool found "
                                 "(the EAP-IG library's graph JSON) with this evaluation "
                                 "instead of scoring edges (on the mib graph)")
  roles: str | None = setting(None, path=True, help="a roles.json (mha-jax analyze --roles) "
                             "whose assigned roles colour the circuit view's heads")
  keep_failing: bool = setting(False, help="keep pairs whose clean prompt the model gets "
                               "wrong")
  memory_budget: str | None = memory.budget_setting(
      "EAP's and EAP-IG's gradient programs", "the ends per gradient chunk are")
  dtype: str | None = memory.dtype_setting()
  mesh: str | None = memory.mesh_setting()
  n_pairs: int = setting(8, lo=1, help="built-in behaviours: pairs drawn")
  seed: int = setting(0, lo=0, help="the random seed (default: 0)")
  threshold: float = setting(0.01, lo=0, hi=1, lo_open=True, hi_open=True,
                             methods=("greedy",),
                             help="an edge goes when the metric moves by less than this "
                                  "share of m(full) - m(empty)")


def _clean_metric(s: activation_patching.Study, metric) -> np.ndarray:
  fn = jax.jit(lambda p, tok: metric(s._forward(p, tok)[0]))
  return np.asarray(fn(s.params, s.tokens["clean"]), np.float64)


def prepare(loaded, behaviour, pairs_file, n_pairs, seed, keep_failing, log=print,
            graph: str = "grouped", memory_budget: int = 2 << 30, dtype: str | None = None,
            mesh=None):
  """(Study, metric fn, metric spec, pairs doc, failing doc): the pairs with those the
  model fails on the clean prompt (metric <= 0) left out unless keep_failing; graph
  "mib": the study's params ungrouped (graph.ungroup); dtype: the params cast
  (memory.cast); mesh: the Study's (sharding.study_mesh; None: one device)."""
  if graph not in graph_lib.GRAPHS:
    raise UserError(f"graph must be one of {graph_lib.GRAPHS}; got {graph!r}", setting="graph")
  params = graph_lib.ungroup(loaded.params) if graph == "mib" else loaded.params
  params = memory.cast(params, dtype)
  pairs, spec = circuit_behaviours.make(loaded, behaviour, pairs_file, n_pairs, seed)
  s = activation_patching.Study(loaded.task, params, pairs, memory_budget=memory_budget,
                                  mesh=mesh)
  m_clean = _clean_metric(s, circuit_behaviours.metric_of(pairs, spec))
  bad = np.nonzero(m_clean <= 0)[0]
  failing = [{**pairs.to_json()[i], "metric_clean": float(m_clean[i])} for i in bad]
  if len(bad):
    log(f"{len(bad)} of {len(pairs)} pairs fail on the clean prompt (metric <= 0)"
        + ("; kept (--keep-failing)" if keep_failing else "; left out"))
  if len(bad) and not keep_failing:
    good = np.nonzero(m_clean > 0)[0]
    if not len(good):
      raise UserError("the model fails every clean prompt (metric <= 0): no circuit to find")
    pairs, spec = pairs.subset(good), circuit_behaviours.subset_metric(spec, good)
    s = activation_patching.Study(loaded.task, params, pairs, memory_budget=memory_budget,
                                  mesh=mesh)
    m_clean = m_clean[good]
  return s, circuit_behaviours.metric_of(pairs, spec), spec, failing


def circuit(loaded, out: str, opts: CircuitOptions = CircuitOptions(), *,
            log=print) -> dict:
  """Scores every edge, draws the faithfulness curve, picks the target circuit; writes
  DIR/circuit.json, faithfulness.png, circuit.png and returns the document."""
  settings.check(opts)
  if not loaded.task.decoder_only:
    loader.refuse("circuit", loaded.workdir, "a decoder LM (prompt pairs compared by their "
                  "next-token logits)")
  behaviour, pairs_file, method, ablation = opts.task, opts.pairs, opts.method, \
      opts.ablation
  target, n_pairs, seed, steps, ig_on = opts.target, opts.n_pairs, opts.seed, opts.steps, \
      opts.ig_on
  t0, c0 = time.perf_counter(), time.process_time()
  graph = "mib" if opts.evaluate else opts.graph     # the library's graph is MIB's
  mesh = sharding.study_mesh(opts.mesh)
  held = jax.eval_shape(graph_lib.ungroup, loaded.params) if graph == "mib" else loaded.params
  budget, budget_from = memory.budget(opts.memory_budget,
                                      memory.params_bytes(held, opts.dtype, mesh))
  s, metric, spec, failing = prepare(loaded, behaviour, pairs_file, n_pairs, seed,
                                     opts.keep_failing, log, graph, budget, opts.dtype, mesh)
  es = edges_lib.EdgeStudy(s, metric=metric, ablation=ablation)
  if opts.export:
    mib_graph.edge_names(es.graph, es.edges[:0])      # refused before the work
  roles = read_roles(opts.roles, es.graph)
  seconds, cpu = {}, {}
  log(f"graph: {es.graph.size()}; metric full {es.m_full:.4f}, empty {es.m_empty:.4f}")
  timed = _timer(seconds, cpu, log)
  estimates, candidates = _scores(es, opts, timed, log)
  agreement = timed("agreement", lambda: es.agreements(estimates, sample=opts.sample, seed=seed))
  log("agreement's exact patching: {edges} edges in {groups} groups of {per_group}, "
      "{layer_rows} layer-rows run ({layer_rows_needed} needed)".format(**es.last_exact))
  drawn = timed("curves", lambda: search.curves(es, candidates, with_mib=True))
  tried = {name: _circuit_at(candidates[name], drawn[name], target) for name in candidates}
  chosen = max(tried, key=lambda n: (tried[n]["cpr"], -tried[n]["cmd"]))
  if len(tried) > 1:
    log("auto: " + ", ".join(f"{n} CPR {t['cpr']:.4f}" for n, t in tried.items())
        + f"; kept {chosen}")
  scores, points, best, at = (tried[chosen][k] for k in ("scores", "points", "keep", "at"))
  area = {k: tried[chosen][k] for k in ("cpr", "cmd", "cpr_absolute_ranking")}
  view = search.touched(es.graph, best)
  of = search.node_faithfulness(s)       # the node view's function: both steps use it
  nodes = {"heads": view["heads"], "mlps": view["mlps"], "edges": int(best.sum()),
           "faithfulness": points[at if at is not None else -1]["faithfulness"],
           "reached_target": at is not None, **timed("nodes", lambda: of(view["heads"]))}
  nodes["fewest_heads"] = timed("fewest_heads", lambda: search.fewest_heads(
      s, es.graph, es.edges, scores, target, of=of))
  names = es.graph.nodes, es.graph.ends
  order = np.argsort(-np.abs(scores), kind="stable")
  doc = {"workdir": loaded.workdir, "task": behaviour or pairs_file, "method": method,
         "chosen": chosen, "methods": {n: {k: t[k] for k in (
             "cpr", "cmd", "cpr_absolute_ranking", "edges", "faithfulness", "reached")}
             for n, t in tried.items()},
         "ablation": ablation, "target": target, "steps": steps, "ig_on": ig_on,
         "ig_points": opts.ig_points, "graph_kind": graph, "evaluated": opts.evaluate,
         "metric": spec["name"] if isinstance(spec, dict) else spec,
         "metric_full": es.m_full, "metric_empty": es.m_empty,
         "graph": es.graph.size(),
         "edges": [{"from": names[0][es.edges[r, 0]], "to": names[1][es.edges[r, 1]],
                    "score": round(float(scores[r]), 7)} for r in order],
         "curve": points, **area, "curve_signed": tried[chosen]["curve_signed"],
         "curve_absolute": tried[chosen]["curve_absolute"], "agreement": agreement, "nodes": nodes,
         "pairs": len(s.pairs), "failing": failing, "failing_kept": opts.keep_failing,
         "seconds": seconds, "cpu_seconds": cpu,
         "memory_budget": _memory_doc(es, budget, budget_from, ig_on)}
  doc["seconds"]["total"] = round(time.perf_counter() - t0, 3)
  doc["cpu_seconds"]["total"] = round(time.process_time() - c0, 3)
  storage.makedirs(out)
  storage.write_json(storage.join(out, "circuit.json"), doc)
  plots.faithfulness_curve(points, target, storage.join(out, "faithfulness.png"),
                           f"{doc['task']}: {chosen}" + (" (auto)" if method == "auto" else "")
                           + f", {ablation} ablation")
  plots.circuit_graph(es.graph, best, scores, es.edges, storage.join(out, "circuit.png"))
  write_explorer(out, doc, es, best, scores, s, loaded.task,
                 curve=(tried[chosen]["keeps"], points, at), roles=roles)
  if opts.export:
    mib_graph.write(storage.join(out, "mib_graph.json"), es.graph, es.edges, scores,
                    len(s.pairs), s.d_model, best)
  return doc


def _timer(seconds: dict, cpu: dict, log):
  """timed(name, fn) -> fn(): its wall seconds into seconds[name] and this process's
  CPU seconds (all threads) into cpu[name], logged."""
  def timed(name, fn):
    t, c = time.perf_counter(), time.process_time()
    v = fn()
    seconds[name] = round(time.perf_counter() - t, 3)
    cpu[name] = round(time.process_time() - c, 3)
    log(f"{name}: {seconds[name]:.1f} s ({cpu[name]:.1f} s CPU)")
    return v
  return timed


def _memory_doc(es, budget: int, budget_from: str, ig_on: str) -> dict:
  """circuit.json's "memory_budget": the budget, both gradient programs' plans and the
  mesh axes the node values are split over."""
  return {"bytes": budget, "from": budget_from, "eap": dataclasses.asdict(es.plan("eap")),
          "eap_ig": dataclasses.asdict(es.plan("ig" if ig_on == "inputs" else "activations")),
          "node_values_split": dict(zip(("data", "model"), es.node_axes()))}


def read_roles(path: str | None, graph) -> dict:
  """{head name: role} of a roles.json's "assigned" for the graph's heads ({} without a
  path); a file without "assigned" or naming none of the graph's heads is refused."""
  if path is None:
    return {}
  try:
    doc = storage.read_json(path)
  except (OSError, ValueError) as e:
    raise UserError(f"roles: cannot read {path!r} as JSON ({e})", setting="roles") from e
  got = doc.get("assigned") if isinstance(doc, dict) else None
  heads = set(graph.nodes)
  if not isinstance(got, dict) or not heads & set(got):
    raise UserError(f"roles: {path!r} holds no \"assigned\" roles of this model's heads "
                    f"(lm.LAYER.HEAD; the roles.json of mha-jax analyze --roles)",
                    setting="roles")
  return {n: str(r) for n, r in got.items() if n in heads}


def _scores(es, opts, timed, log) -> tuple[dict, dict]:
  """({name: scores} checked against exact patching, {name: scores} whose curves are
  drawn): EAP and EAP-IG (and exact, greedy as --method asks), or --evaluate's."""
  if opts.evaluate:
    got = timed("import", lambda: mib_graph.read(opts.evaluate, es.graph, es.edges,
                                                 len(es.s.pairs)))
    return {"imported": got}, {"imported": got}
  method = opts.method
  eap = timed("eap", es.eap)
  ig = timed("eap_ig", lambda: es.eap_ig(opts.steps, opts.ig_on, opts.ig_points))
  scored = {"eap": eap, "eap-ig": ig}
  if method == "exact" or (method == "auto" and len(es.edges) <= AUTO_EXACT_EDGES):
    scored["exact"] = timed("exact", es.exact)
  if method == "greedy":
    keep = timed("greedy", lambda: search.greedy(es, opts.threshold, log=log))
    return scored, {"greedy": np.where(keep[es.edges[:, 0], es.edges[:, 1]],
                                       -np.abs(eap) - 1e-9, 0.0)}  # kept: first in both rankings
  return ({"eap": eap, "eap-ig": ig},
          scored if method == "auto" else {method: scored[method]})


def _circuit_at(scores, drawn, target) -> dict:
  """One method's curve (|score| ranking), MIB's evaluation (search.mib: the signed
  and absolute curves, CPR and CMD), as search.curves drew them, and its smallest
  circuit reaching target (else the whole graph's)."""
  points, keeps, mib = drawn
  area = {"cpr": mib["cpr"], "cmd": mib["cmd"],
          "cpr_absolute_ranking": search.curve_areas(points)["cpr"]}
  at = search.smallest_reaching(points, target)
  keep = keeps[at] if at is not None else keeps[-1]
  return {"scores": scores, "points": points, "keep": keep, "at": at, "keeps": keeps, **area,
          "curve_signed": mib["curve_signed"], "curve_absolute": mib["curve_absolute"],
          "edges": int(keep.sum()), "reached": at is not None,
          "faithfulness": points[at if at is not None else -1]["faithfulness"]}


VIEW_MAX_EDGES = 5000     # the size slider's largest circuit (more is drawn as a hairball)


def _edge_rows(graph, keep, score) -> list[dict]:
  """The edges of a circuit keep, by |score|: {"from", "to", "score", "into": the nodes
  the end feeds (["logits"] for the logits)}."""
  nodes, ends = graph.nodes, graph.ends
  rows = sorted(zip(*np.nonzero(keep)), key=lambda ue: -abs(score.get((int(ue[0]), int(ue[1])), 0.0)))
  return [{"from": nodes[u], "to": ends[e], "score": round(score.get((int(u), int(e)), 0.0), 7),
           "into": [nodes[n] for n in graph.end_node(int(e))] or ["logits"]} for u, e in rows]


def view_sizes(graph, keeps, points, score) -> tuple[list[dict], list[dict]]:
  """The size slider's data: (ranked: the edges of every curve circuit of at most
  VIEW_MAX_EDGES edges, as _edge_rows, by |score|; sizes: per such curve point
  {"edges", "kept", "fraction", "faithfulness", "point": its index in the curve, "rows":
  indices into ranked of its kept edges})."""
  use = [i for i, p in enumerate(points) if p["kept"] <= VIEW_MAX_EDGES]
  union = np.zeros(graph.mask().shape, bool)
  for i in use:
    union |= np.asarray(keeps[i], bool)
  ranked = _edge_rows(graph, union, score)
  index = {(r["from"], r["to"]): j for j, r in enumerate(ranked)}
  nodes, ends = graph.nodes, graph.ends
  sizes = [{**{k: points[i][k] for k in ("edges", "kept", "fraction", "faithfulness")},
            "point": i, "rows": sorted(index[(nodes[u], ends[e])]
                                       for u, e in zip(*np.nonzero(keeps[i])))}
           for i in use]
  return ranked, sizes


def circuit_view(doc: dict, graph, keep, scores, edges, curve=None,
                 roles: dict | None = None) -> dict:
  """The explorer's circuit data: the graph's shape, the target circuit's edges
  (_edge_rows), the summary; with curve (keeps (S, N_nodes, N_ends), points, at: the
  target's index in points or None), the size slider's "ranked" and "sizes" (view_sizes)
  and "at" (the target's index in sizes; None when it is larger than VIEW_MAX_EDGES or
  did not reach the target); roles {head name: role} colour the heads (ROLE_COLORS)."""
  from mha_jax.roles.role_scores import ROLE_COLORS
  score = {(int(u), int(e)): float(v) for (u, e), v in zip(edges, scores)}
  n = doc["nodes"]
  keys = ("task", "workdir", "pairs", "ablation", "method", "chosen", "target", "cpr", "cmd")
  out = {"graph": {"layers": graph.layers, "heads": list(graph.heads),
                   "kv_heads": list(graph.kv_heads), "mlp": [bool(m) for m in graph.mlp],
                   "edges_total": doc["graph"]["edges"]},
         "edges": _edge_rows(graph, keep, score), "heads": n["heads"], "mlps": n["mlps"],
         "summary": {**{k: doc[k] for k in keys}, "faithfulness": n["faithfulness"],
                     "faithfulness_nodes": n.get("faithfulness_nodes")},
         "roles": dict(roles or {}), "colors": ROLE_COLORS if roles else {}}
  if curve is not None:
    keeps, points, at = curve
    out["ranked"], out["sizes"] = view_sizes(graph, keeps, points, score)
    out["at"] = next((j for j, sz in enumerate(out["sizes"]) if sz["point"] == at), None)
  return out


VIEW_FILE = "circuit_view.json"


def write_explorer(out, doc, es, keep, scores, study, task, pairs: int = 2, curve=None,
                   roles: dict | None = None) -> str:
  """DIR/explorer.html: the circuit view and the attention of the first `pairs` pairs
  (clean and corrupt) from the study's own forward; its data also as DIR/VIEW_FILE (what
  `mha_jax.show(DIR)` draws without the model)."""
  from mha_jax import assets
  data = {**activation_patching.attention_data(study, task, pairs),
          "circuit": activation_patching.json_finite(
              circuit_view(doc, es.graph, keep, scores, es.edges, curve, roles))}
  data["roles"] = dict(roles or {})
  storage.write_json(storage.join(out, VIEW_FILE), data)
  path = storage.join(out, "explorer.html")
  storage.write_text(path, assets.page("explorer", data, title=html.escape(
      f"circuit of {doc['task']} on {doc['workdir']}")))
  return path


def format_summary(doc: dict) -> str:
  n = doc["nodes"]
  a = doc["agreement"]
  fate = "kept" if doc.get("failing_kept") else "left out"
  lines = [f"graph {doc['graph']}; {doc['pairs']} pairs ({len(doc['failing'])} failing "
           f"{fate}); metric full {doc['metric_full']:.4f}, empty {doc['metric_empty']:.4f}",
           f"circuit at target {doc['target']}: {n['edges']} edges, {len(n['heads'])} heads, "
           f"{len(n['mlps'])} MLPs, faithfulness {n['faithfulness']:.3f}, "
           f"faithfulness_nodes {n['faithfulness_nodes']:.3f}",
           f"CPR {doc['cpr']:.3f}, CMD {doc['cmd']:.3f}"]
  fh = n.get("fewest_heads")
  if fh:
    lines.append(f"fewest heads reaching {doc['target']}: {fh['count']} "
                 f"(faithfulness_nodes {fh['faithfulness_nodes']:.3f})"
                 + ("" if fh["reached"] else ", not reached"))
  for k, v in a.items():
    lines.append(f"{k} vs exact on {v['n']} edges: Pearson {v['pearson']:.3f}, Spearman "
                 f"{v['spearman']:.3f}, top-20 overlap {v.get('top20_overlap', float('nan')):.2f}")
  return "\n".join(lines)
