"""The computational graph of a decoder LM and edge interventions in its one forward.

Nodes, in forward order (the upstream ones; "logits" is the sink):
  embed          the input embedding (with positions added to the stream), lm.0.resid_pre
  lm.{i}.{h}     attention head h of layer i: what it adds to the residual stream, its
                 result (after W_O), through the layer's post-attention norm where there
                 is one (Gemma 2/3, OLMo 2: the norm's 1/rms and weight of this run)
  lm.{i}.mlp     the MLP of layer i (its output after any post-norm), lm.{i}.mlp_out
Ends (a downstream node's inputs, each the residual stream as that input reads it):
  lm.{i}.{h}.q   query head h's query input
  lm.{i}.{g}.k   key/value head g's key input (GQA/MQA: read by query heads
  lm.{i}.{g}.v   g * H/G .. (g + 1) * H/G - 1; on MHA models g is the head)
  lm.{i}.mlp     the MLP's input (before its norm)
  logits         the final residual (before the final norm)
Edges: every upstream node -> every end it feeds (embed and the nodes of earlier
layers; an MLP also reads its own layer's heads, except with a parallel block), named
"lm.3.2 -> lm.5.1.k".

An edge intervention: end e's input is `sum_u (keep_ue a_u + (1 - keep_ue) A_u) + biases`,
a_u this run's output of u, A_u its ablated value (toolkit.ablations). In the forward
that is an `add` at the end's site (lm.{i}.attn.in_q / in_k / in_v, lm.{i}.mlp_in, the
last layer's resid_post) of sum_u (1 - keep_ue) (A_u - a_u), a value computed from this
run's node outputs as the forward reaches the end (interventions: callable values).
With `base` given, a_u is replaced by those fixed values (gradients at another point:
EAP-IG on the inputs). keep is an (N_nodes, N_ends) float array (1 kept, 0 ablated;
entries that are not edges are ignored), so the metric's gradient with respect to keep
at 1 is minus EAP's score of every edge, in one backward.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from mha_jax import interventions
from mha_jax.errors import UserError


@dataclasses.dataclass(frozen=True)
class Graph:
  """Nodes, ends and edges of a decoder LM with `heads[i]` query heads and
  `kv_heads[i]` key/value heads per layer, MLPs where `mlp[i]`, parallel blocks."""
  heads: tuple
  kv_heads: tuple
  mlp: tuple
  parallel: bool = False

  @property
  def layers(self) -> int:
    return len(self.heads)

  @property
  def nodes(self) -> list[str]:
    out = ["embed"]
    for i in range(self.layers):
      out += [f"lm.{i}.{h}" for h in range(self.heads[i])]
      out += [f"lm.{i}.mlp"] if self.mlp[i] else []
    return out

  @property
  def ends(self) -> list[str]:
    out = []
    for i in range(self.layers):
      out += [f"lm.{i}.{h}.q" for h in range(self.heads[i])]
      out += [f"lm.{i}.{g}.{c}" for c in "kv" for g in range(self.kv_heads[i])]
      out += [f"lm.{i}.mlp"] if self.mlp[i] else []
    return out + ["logits"]

  def node_offsets(self) -> list[int]:
    """The index of layer i's first node (the embedding is node 0); entry L = N."""
    off = [1]
    for i in range(self.layers):
      off.append(off[-1] + self.heads[i] + int(self.mlp[i]))
    return off

  def end_groups(self) -> list[dict]:
    """Per layer {"q": (lo, hi), "k", "v", "mlp": end index ranges} and "logits"."""
    out, at = [], 0
    for i in range(self.layers):
      g = {}
      for c, n in (("q", self.heads[i]), ("k", self.kv_heads[i]), ("v", self.kv_heads[i]),
                   ("mlp", int(self.mlp[i]))):
        g[c] = (at, at + n)
        at += n
      out.append(g)
    return out

  def upstream_count(self, layer: int, kind: str) -> int:
    """How many nodes (a prefix of `nodes`) feed an end of `kind` at `layer`."""
    off = self.node_offsets()
    if kind == "logits":
      return off[-1]
    if kind == "mlp" and not self.parallel:
      return off[layer] + self.heads[layer]
    return off[layer]

  def mask(self) -> np.ndarray:
    """(N_nodes, N_ends) bool: True where upstream node -> end is an edge."""
    m = np.zeros((len(self.nodes), len(self.ends)), bool)
    for i, g in enumerate(self.end_groups()):
      for kind, (lo, hi) in g.items():
        m[:self.upstream_count(i, kind), lo:hi] = True
    m[:, -1] = True
    return m

  def edges(self) -> list[tuple[int, int]]:
    """(node index, end index) of every edge, in the order of mask()'s nonzeros."""
    return [tuple(int(v) for v in e) for e in np.argwhere(self.mask())]

  def edge_names(self) -> list[str]:
    n, e = self.nodes, self.ends
    return [f"{n[a]} -> {e[b]}" for a, b in self.edges()]

  def size(self) -> dict:
    return {"nodes": len(self.nodes) + 1, "heads": int(sum(self.heads)),
            "mlps": int(sum(self.mlp)), "ends": len(self.ends), "edges": int(self.mask().sum())}

  def end_node(self, end: int) -> list[int]:
    """The node indices an end feeds (a kv end: every query head reading it; logits:
    none)."""
    off = self.node_offsets()
    for i, g in enumerate(self.end_groups()):
      for kind, (lo, hi) in g.items():
        if lo <= end < hi:
          j = end - lo
          if kind == "q":
            return [off[i] + j]
          if kind == "mlp":
            return [off[i] + self.heads[i]]
          r = self.heads[i] // self.kv_heads[i]
          return [off[i] + h for h in range(j * r, (j + 1) * r)]
    return []


GRAPHS = ("grouped", "mib")


def ungroup(params):
  """params whose every query head has its own key/value head (GQA/MQA: wk, wv, bk, bv
  and a per-head k_norm repeated H/G times; query head h reads copy h of its group's):
  the same model, whose graph has key and value ends per query head, as the EAP-IG
  library builds it (TransformerLens' ungroup_grouped_query_attention, MIB's graph).
  MHA params come back as they are."""
  layers = dict(params["lm"])
  for name, lp in params["lm"].items():
    a = lp.get("attn") if isinstance(lp, dict) else None
    if a is None:
      continue
    if "wk_rest" in a:
      raise UserError("--graph mib: this model's key heads were pruned (wk_rest); "
                      "ungroup the dense model")
    h, g = a["wq"].shape[1], a["wk"].shape[1]
    if h == g:
      continue
    r = h // g
    new = dict(a)
    for k, axis in (("wk", 1), ("wv", 1), ("bk", 0), ("bv", 0)):
      if k in a:
        new[k] = jnp.repeat(a[k], r, axis=axis)
    if "k_norm" in a and jnp.ndim(a["k_norm"]) == 2:
      new["k_norm"] = jnp.repeat(a["k_norm"], r, axis=0)
    layers[name] = {**lp, "attn": new}
  return {**params, "lm": layers}


def graph_of(study, params) -> Graph:
  """The Graph of a patching Study's model; refuses a model whose forward lacks the
  edge-end sites."""
  shapes = jax.eval_shape(lambda p: study._forward(
      p, study.tokens["clean"], read=("lm.*.attn.in_q", "lm.*.mlp_out")), params)[1]
  if not any(n.endswith(".attn.in_q") for n in shapes):
    raise UserError("this model's forward has no edge-end sites (lm.{i}.attn.in_q): "
                    "circuits need a decoder LM of mha_jax.models.decoder or lm")
  mlp = tuple(f"lm.{i}.mlp_out" in shapes for i in range(study.layers))
  parallel = bool(getattr(getattr(study.task, "spec", None), "parallel", False))
  return Graph(tuple(study.heads), tuple(study.kv_heads), mlp, parallel)


def output_sites(graph: Graph, params) -> tuple[str, ...]:
  """The sites a run reads to know every node's output."""
  out = ["lm.0.resid_pre"]
  for i in range(graph.layers):
    out.append(f"lm.{i}.attn.result")
    if "ln1_post" in params["lm"][f"layer_{i}"]:
      out.append(f"lm.{i}.ln1_post.scale")
    if graph.mlp[i]:
      out.append(f"lm.{i}.mlp_out")
  return tuple(out)


def node_outputs(graph: Graph, params, vals, n_up: int | None = None) -> jax.Array:
  """(B, T, N, D) the outputs of the first n_up nodes (default all) in node order, from a
  run's `vals` of output_sites (a head's result through its layer's post-norm where
  there is one)."""
  n_up = len(graph.nodes) if n_up is None else n_up
  cols, count = [vals["lm.0.resid_pre"][:, :, None]], 1
  for i in range(graph.layers):
    if count >= n_up:
      break
    r = vals[f"lm.{i}.attn.result"]                       # (B, T, H, D)
    post = params["lm"][f"layer_{i}"].get("ln1_post")
    if post is not None:
      r = r * vals[f"lm.{i}.ln1_post.scale"][..., None] * post["scale"].astype(r.dtype)
    cols.append(r)
    count += graph.heads[i]
    if graph.mlp[i] and count < n_up:
      cols.append(vals[f"lm.{i}.mlp_out"][:, :, None])
      count += 1
  return jnp.concatenate(cols, axis=2)[:, :, :n_up]


def edge_edits(graph: Graph, params, keep_NE, ablated_BTND, base_BTND=None) -> dict:
  """{site: Edit}: every end's input with its edges' `1 - keep` share of the ablated
  values (see the module docstring). ablated (B, T, N, D); base: fixed a_u (B, T, N, D)
  or None (this run's). Each layer's upstream differences (B, T, n, D) are formed once,
  at its first end, for all of its ends (what a backward keeps: one per layer)."""
  off = graph.node_offsets()
  groups = graph.end_groups()
  drop = 1.0 - jnp.asarray(keep_NE, ablated_BTND.dtype)
  cache: dict = {}

  def diff(vals, lo, hi):
    cur = (node_outputs(graph, params, vals, hi)[:, :, lo:] if base_BTND is None
           else base_BTND[:, :, lo:hi])
    return ablated_BTND[:, :, lo:hi] - cur

  def layer_delta(i, vals):
    """(B, T, E_i, D) for every end of layer i from the nodes of earlier layers."""
    if i not in cache:
      lo, hi = groups[i]["q"][0], groups[i]["mlp"][1]
      cache[i] = jnp.einsum("btnd,ne->bted", diff(vals, 0, off[i]), drop[:off[i], lo:hi])
    return cache[i]

  def attn_end(i, kind):
    base, (lo, hi) = groups[i]["q"][0], groups[i][kind]
    return lambda vals: layer_delta(i, vals)[:, :, lo - base:hi - base]

  def mlp_end(i):
    base, (lo, _) = groups[i]["q"][0], groups[i]["mlp"]

    def fn(vals):
      d = layer_delta(i, vals)[:, :, lo - base]
      n_up = graph.upstream_count(i, "mlp")
      if n_up > off[i]:      # its own layer's heads
        d = d + jnp.einsum("btnd,n->btd", diff(vals, off[i], n_up), drop[off[i]:n_up, lo])
      return d
    return fn

  edits = {}
  for i in range(graph.layers):
    for kind in ("q", "k", "v"):
      edits[f"lm.{i}.attn.in_{kind}"] = interventions.add(attn_end(i, kind))
    if graph.mlp[i]:
      edits[f"lm.{i}.mlp_in"] = interventions.add(mlp_end(i))
  n = off[-1]
  edits[f"lm.{graph.layers - 1}.resid_post"] = interventions.add(lambda vals: jnp.einsum(
      "btnd,n->btd", diff(vals, 0, n), drop[:n, -1]))
  return edits
