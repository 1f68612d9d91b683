"""Edge scores in the EAP-IG library's graph JSON (Graph.to_json / from_json, the file
MIB's circuit track and leaderboard take), and back.

  {"cfg": {"n_layers", "n_heads", "parallel_attn_mlp", "d_model"},
   "nodes": {"input" | "a{l}.h{h}" | "m{l}" | "logits": {"in_graph"}},
   "edges": {"input->a3.h1<q>", "a0.h2->m4", "m5->logits", ...: {"score", "in_graph"}}}

The library's graph has key and value ends per query head (`--graph mib` here) and an
MLP in every layer. Its scores have the opposite sign to this library's (it attributes
the loss -mean(LD): an edge that helps the metric scores positive) and are divided by the
number of examples once more (its metric is a mean and it divides the summed scores by
the count): score_library = -score / N. Reading inverts that with this run's N (a
positive factor: rankings, and so MIB's evaluation, do not depend on it).
"""

from __future__ import annotations

import json

import numpy as np

from mha_jax import storage
from mha_jax.errors import UserError


def _node_name(name: str) -> str:
  if name == "embed":
    return "input"
  _, layer, unit = name.split(".")
  return f"m{layer}" if unit == "mlp" else f"a{layer}.h{unit}"


def _end_name(name: str) -> tuple[str, str | None]:
  if name == "logits":
    return "logits", None
  parts = name.split(".")
  if parts[2] == "mlp":
    return f"m{parts[1]}", None
  return f"a{parts[1]}.h{parts[2]}", parts[3]


def edge_names(graph, edges, what: str = "export mib") -> list[str]:
  """The library's name of every edge (rows of `edges`); refuses a graph it cannot
  hold."""
  if len(set(graph.heads)) != 1 or tuple(graph.kv_heads) != tuple(graph.heads):
    raise UserError(f"{what}: the EAP-IG library's graph has key and value ends per "
                    f"query head and one head count; this graph has heads {list(graph.heads)}, "
                    f"key/value heads {list(graph.kv_heads)} (use --graph mib)",
                    setting="graph")
  if not all(graph.mlp):
    raise UserError(f"{what}: the EAP-IG library's graph has an MLP in every layer; "
                    f"this model's layers have MLPs {list(graph.mlp)}")
  out = []
  for u, e in edges:
    child, qkv = _end_name(graph.ends[e])
    parent = _node_name(graph.nodes[u])
    out.append(f"{parent}->{child}" + (f"<{qkv}>" if qkv else ""))
  return out


def to_doc(graph, edges, scores, n_pairs: int, d_model: int, keep=None) -> dict:
  """The library's graph JSON of scores (E,) (this library's sign and units); keep
  (N_nodes, N_ends) bool: the circuit marked in_graph (default none)."""
  names = edge_names(graph, edges)
  keep = np.zeros(graph.mask().shape, bool) if keep is None else np.asarray(keep, bool)
  used = keep.any(1)
  for e in np.nonzero(keep.any(0))[0]:
    used[graph.end_node(int(e))] = True
  nodes = {_node_name(n): {"in_graph": bool(used[i])} for i, n in enumerate(graph.nodes)}
  nodes["logits"] = {"in_graph": True}
  lib = -np.asarray(scores, np.float64) / n_pairs
  return {"cfg": {"n_layers": graph.layers, "n_heads": int(graph.heads[0]),
                  "parallel_attn_mlp": bool(graph.parallel), "d_model": int(d_model)},
          "nodes": nodes,
          "edges": {n: {"score": float(v), "in_graph": bool(keep[u, e])}
                    for n, v, (u, e) in zip(names, lib, edges)}}


def write(path: str, graph, edges, scores, n_pairs: int, d_model: int, keep=None) -> str:
  storage.write_text(path, json.dumps(to_doc(graph, edges, scores, n_pairs, d_model, keep)))
  return path


def scores_of(doc: dict, graph, edges, n_pairs: int, what: str = "evaluate") -> np.ndarray:
  """(E,) this library's scores of a library graph document, in the order of `edges`;
  refuses one of another shape, naming what differs."""
  if not isinstance(doc, dict) or not {"cfg", "edges"} <= set(doc):
    raise UserError(f"{what}: not the EAP-IG library's graph JSON (keys cfg, nodes, edges); "
                    f"got keys {sorted(doc) if isinstance(doc, dict) else type(doc).__name__}",
                    setting=what)
  cfg = doc["cfg"]
  want = {"n_layers": graph.layers, "n_heads": int(graph.heads[0])}
  bad = {k: cfg.get(k) for k, v in want.items() if cfg.get(k) != v}
  if bad:
    raise UserError(f"{what}: the graph is of another model: {bad}, this one has {want}",
                    setting=what)
  names = edge_names(graph, edges, what)
  got = doc["edges"]
  missing = [n for n in names if n not in got]
  extra = sorted(set(got) - set(names))
  if missing or extra:
    raise UserError(f"{what}: the graph's edges differ from this model's: missing "
                    f"{missing[:3]} ({len(missing)}), unknown {extra[:3]} ({len(extra)})",
                    setting=what)
  return -np.asarray([float(got[n]["score"]) for n in names], np.float64) * n_pairs


def read(path: str, graph, edges, n_pairs: int) -> np.ndarray:
  try:
    doc = json.loads(storage.read_text(path))
  except json.JSONDecodeError as err:
    raise UserError(f"evaluate: {path} is not JSON ({err})", setting="evaluate") from err
  return scores_of(doc, graph, edges, n_pairs)
