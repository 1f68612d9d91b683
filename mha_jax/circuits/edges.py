"""Edge scores and circuit faithfulness on prompt pairs: exact edge patching, EAP, EAP-IG.

An `EdgeStudy` holds a patching Study (the pairs, the model's one forward), its Graph and
the chosen ablation's value of every node (toolkit.ablations: the corrupt run's output,
the mean over the clean prompts, another row's, or 0). Everything is a compiled program
of the forward with graph.edge_edits:

  metric(keep)   the pair-mean metric with the edges where keep = 0 ablated
  exact(edges)   m(M without e) - m(M) for each chosen edge, batched (the ground truth)
  eap()          (A_u - a_u) . dm/d(input_e) at the clean run, every edge (one clean
                 forward for the node outputs, one ablation forward, one backward to a
                 zero `add` at every end's site, then one product; Syed et al. 2023).
                 It is minus the gradient of metric(keep) at keep = 1 (tested)
  eap_ig(m, on, points)  the gradient averaged over m points alpha between the ablated
                 (0) and clean (1) runs (Hanna et al. 2024): points "left" alpha = k/m,
                 k = 0..m-1 (the EAP-IG library's and MIB's), or "midpoint" (k + 1/2)/m;
                 on="inputs" interpolates the input embedding, the
                 scores keeping (A_u - a_u(clean)) fixed; on="activations" moves every
                 edge's keep from 0 to 1 together (integrated gradients of the edge mask:
                 the scores sum to m(M) - m(empty))
  curve(keeps)   the metric of many circuits (S, N, E), blocks of one shared program

Scores are in the metric's units: the change of the pair-mean metric when the edge is
ablated (negative where the edge carries the behaviour). The metric is a function of the
logits at each prompt's answer position, (N, V) -> (N,); the default is the logit
difference of the Study.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from mha_jax import interventions
from mha_jax.circuits import graph as graph_lib
from mha_jax.errors import UserError
from mha_jax.toolkit import activation_patching
from mha_jax.toolkit import ablations
from mha_jax.toolkit import memory

IG_ON = ("inputs", "activations")
IG_POINTS = ("left", "midpoint")
END_KINDS = ("q", "k", "v", "mlp", "logits")


def ig_alphas(steps: int, points: str = "left") -> np.ndarray:
  """(steps,) EAP-IG's interpolation points: left k/steps (the library's), or midpoint
  (k + 1/2)/steps."""
  if points not in IG_POINTS:
    raise UserError(f"ig_points must be one of {IG_POINTS}; got {points!r}",
                    setting="ig_points")
  return (np.arange(steps) + (0.5 if points == "midpoint" else 0.0)) / steps


class EdgeStudy:
  """Edge interventions on a patching Study's pairs.

  study: toolkit.activation_patching.Study; metric: (N, V) logits -> (N,) per pair (default: the
  Study's logit difference); ablation: toolkit.ablations KINDS; mean_per_position: the
  mean ablation's mean per position (else over positions). run=False: nothing runs (the
  study's params may be ShapeDtypeStructs; `mha-jax plan`): clean_out and ablated are
  shapes, m_full and m_empty None, and only the *_program methods serve. mesh (default:
  the study's): the node values (B, T, N_nodes, D) and their differences live split
  over it, the pairs over "data" and D over "model" where they divide (node_axes), so
  a device holds its share; the scores are the single-device ones.
  """

  def __init__(self, study: activation_patching.Study, *, metric: Callable | None = None,
               ablation: str = "corrupt", mean_per_position: bool = True, run: bool = True,
               mesh=None):
    ablations.check_kind(ablation)
    self.s, self.params = study, study.params
    self.mesh = mesh if mesh is not None else study.mesh
    self.graph = graph_lib.graph_of(study, study.params)
    self.sites = graph_lib.output_sites(self.graph, study.params)
    self.mask = self.graph.mask()
    self.edges = np.argwhere(self.mask)                      # (E, 2) node, end
    self.ablation = ablation
    self._metric = metric or (lambda logits: study._score(logits)[0])
    self._jit: dict = {}
    self.last_plan: memory.EapPlan | None = None   # the last gradient program's chunks
    self.last_exact: dict = {}    # the last exact(): edges, groups x per_group, layers run
    outs = self._cached("outputs", lambda: lambda p, tok: self.on_nodes(graph_lib.node_outputs(
        self.graph, p, self.s._forward(p, tok, read=self.sites)[1])))
    if not run:
      sharded = self.node_sharding()
      shape = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharded)  # noqa: E731
      self.clean_out = shape(outs.eval_shape(self.params, study.tokens["clean"]))
      self.ablated = shape(jax.eval_shape(lambda c: ablations.values(
          ablation, c, corrupt=c if ablation == "corrupt" else None,
          per_position=mean_per_position), self.clean_out))
      self.m_full = self.m_empty = None
      return
    self.clean_out = outs(self.params, study.tokens["clean"])
    corrupt = outs(self.params, study.tokens["corrupt"]) if ablation == "corrupt" else None
    self.ablated = self.on_nodes(ablations.values(ablation, self.clean_out, corrupt=corrupt,
                                                  per_position=mean_per_position))
    ones = np.ones((1,) + self.mask.shape, np.float32)
    self.m_full, self.m_empty = (float(v) for v in self.curve(np.concatenate([ones, 0 * ones])))

  def node_axes(self) -> tuple[int, int]:
    """(data, model): the mesh axes the node values are split over, the pairs over
    "data" and D over "model" (1 without a mesh, or where the axis does not divide)."""
    if self.mesh is None:
      return 1, 1
    data, model = self.mesh.shape["data"], self.mesh.shape["model"]
    return (data if self.s.n % data == 0 else 1, model if self.s.d_model % model == 0 else 1)

  def node_sharding(self):
    """The NamedSharding of (B, T, N_nodes, D) node values (node_axes); None without a
    mesh."""
    if self.mesh is None:
      return None
    from jax.sharding import NamedSharding, PartitionSpec
    data, model = self.node_axes()
    return NamedSharding(self.mesh, PartitionSpec("data" if data > 1 else None, None, None,
                                                  "model" if model > 1 else None))

  def on_nodes(self, a):
    """(B, T, N, D) node values placed (traced: constrained) as node_sharding; a itself
    without a mesh."""
    sh = self.node_sharding()
    if sh is None:
      return a
    if isinstance(a, jax.core.Tracer):
      return jax.lax.with_sharding_constraint(a, sh)
    return jax.device_put(a, sh)

  def _cached(self, key, build):
    if key not in self._jit:
      self._jit[key] = jax.jit(build())
    return self._jit[key]

  # ------------------------------------------------------------------ the forward
  def pairs_metric(self, params, keep, ablated, base=None, embed=None, cache=None):
    """(N,) the metric of each pair with the edges' keep; embed (N, T, D) replaces the
    input embedding; cache: the shared prefix's KV cache (Study._prefix_cache; ablated
    and base then hold the positions after the prefix alone)."""
    edits = graph_lib.edge_edits(self.graph, params, keep, ablated, base)
    if embed is not None:
      edits["lm.0.resid_pre"] = interventions.replace(embed)
    logits, _ = self.s._forward(params, self.s.tokens["clean"], edits, read=self.sites,
                                cache=cache)
    return self._metric(logits)

  def _prefixed_metric(self, p, k, a, pre: int):
    """pairs_metric's pair mean from the shared prefix's KV cache when pre > 0 (an edge
    cut changes nothing there: shared_prefix), else over every position."""
    cache = self.s._prefix_cache(p) if pre else None
    return self.pairs_metric(p, k, a[:, pre:], cache=cache).mean()

  def metric(self, keep) -> float:
    """The pair-mean metric with the edges where keep (N_nodes, N_ends) is 0 ablated."""
    pre = self.shared_prefix()
    fn = self._cached(("metric", pre), lambda: lambda p, k, a: self._prefixed_metric(
        p, k, a, pre))
    return float(fn(self.params, jnp.asarray(keep, jnp.float32), self.ablated))

  def faithfulness(self, m) -> np.ndarray:
    """(m - m(empty)) / (m(full) - m(empty))."""
    return (np.asarray(m, np.float64) - self.m_empty) / (self.m_full - self.m_empty)

  def _chunk(self, m: int) -> int:
    """Forwards per chunk: each holds its node outputs and one layer's upstream
    differences, (B, T, N, D) floats about three times over."""
    b, t, n, d = self.clean_out.shape
    per = 4 * b * t * d * (3 * n + 8 * max(self.s.heads))
    return int(max(1, min(m, self.s.memory_budget // per)))

  CURVE_BLOCK = 4     # circuits per call of curve()'s one program

  def curve(self, keeps) -> np.ndarray:
    """(S,) the pair-mean metric of S circuits keeps (S, N_nodes, N_ends): blocks of
    CURVE_BLOCK circuits (fewer where the study's memory budget says so; the last one
    padded), each a call of the same compiled program, so every curve, size and method
    shares one program; the positions after the shared prefix alone, from its KV cache
    (shared_prefix)."""
    keeps = np.asarray(keeps, np.float32)
    block = self._chunk(self.CURVE_BLOCK)
    n = keeps.shape[0]
    pad = np.concatenate([keeps, np.repeat(keeps[-1:], -n % block, 0)])

    pre = self.shared_prefix()

    def build():
      def fn(p, ks, a):      # the prefix's cache does not depend on k: computed once
        return jax.vmap(lambda k: self._prefixed_metric(p, k, a, pre))(ks)
      return fn
    fn = self._cached(("curve", block, pre), build)
    got = [fn(self.params, jnp.asarray(pad[i:i + block]), self.ablated)
           for i in range(0, len(pad), block)]
    return np.asarray(jnp.concatenate(got), np.float64)[:n]

  # ------------------------------------------------------------------ scores
  def exact(self, edge_rows=None) -> np.ndarray:
    """(len,) m(M without e) - m(M) for the edges self.edges[edge_rows] (default all),
    one batched program. Ablating one edge u -> e leaves every node upstream of e as in
    the clean run, so it is the clean run with A_u - a_u added to e's input alone: the
    edges are folded into the rows, sorted by e's layer and cut into groups
    (Study._depth_groups), each group run from its first edge's layer on from the clean
    residual stream (share_depth, as `patch` does) and, where every
    A_u - a_u vanishes on the prompts' shared prefix, from its KV cache."""
    rows = np.arange(len(self.edges)) if edge_rows is None else np.asarray(edge_rows)
    info = self._end_info()[self.edges[rows, 1]]            # (R, 3) layer, kind, slot
    by_layer = self.s.share_depth
    chunk = self.s._chunk(len(rows), 2.0)
    if by_layer:
      starts, groups, where = activation_patching.Study._depth_groups(
          info[:, 0], chunk, self.graph.layers)
    else:
      starts, groups, where = activation_patching.Study._groups(
          [(0, int(l), r) for r, l in enumerate(info[:, 0])], [0], chunk, False)
    pre = self.shared_prefix()
    firsts = np.zeros(len(groups)) if starts is None else starts
    self.last_exact = {"edges": len(rows), "groups": groups.shape[0],
                       "per_group": groups.shape[1], "prefix": pre,
                       "layer_rows": int(((self.graph.layers - firsts) * groups.shape[1]).sum()),
                       "layer_rows_needed": int((self.graph.layers - info[:, 0]).sum())}
    cols = [jnp.asarray(c[groups], jnp.int32) for c in
            (self.edges[rows, 0], info[:, 0], info[:, 1], info[:, 2])]
    key = ("exact", groups.shape, by_layer, pre)
    got = self._cached(key, lambda: self._exact_program(pre, by_layer))(
        self.params, self.ablated, self.clean_out,
        None if starts is None else jnp.asarray(starts), *cols)
    return np.asarray(got, np.float64).reshape(-1)[where] - self.m_full

  def _end_info(self) -> np.ndarray:
    """(N_ends, 3) int: each end's layer, kind (END_KINDS index) and head slot."""
    out = []
    for i, grp in enumerate(self.graph.end_groups()):
      for kind in END_KINDS[:4]:
        lo, hi = grp[kind]
        out += [(i, END_KINDS.index(kind), j) for j in range(hi - lo)]
    return np.asarray(out + [(self.graph.layers - 1, 4, 0)], np.int64)

  def shared_prefix(self) -> int:
    """The study's shared prefix when every node's ablated value equals its clean one
    there (corrupt, mean per position, resample: the same tokens), else 0."""
    p = self.s.prefix
    if p and np.array_equal(np.asarray(self.ablated[:, :p]), np.asarray(self.clean_out[:, :p])):
      return p
    return 0

  def _exact_program(self, pre: int, by_layer: bool):
    """fn(params, ablated, clean, starts (G,) or None, u, layer, kind, slot (G, C)) ->
    (G, C) pair-mean metric of each edge's ablation (see exact)."""
    g, s, n = self.graph, self.s, self.s.n

    def fn(p, abl, clean, starts, us, ls, ks, hs):
      cache = s._prefix_cache(p) if pre else None
      tok = s.tokens["clean"]
      stream = None
      if by_layer:
        names = tuple(f"lm.{i}.resid_pre" for i in range(g.layers))
        vals = s._forward(p, tok, read=names, cache=cache)[1]
        stream = jnp.stack([vals[k] for k in names])
      d = (abl - clean)[:, pre:]                                   # (N, T', N_nodes, D)

      def group(grp):
        start, u, l, k, h = grp
        c = u.shape[0]
        val = jnp.moveaxis(d[:, :, u], 2, 0).reshape((c * n,) + d.shape[1:2] + d.shape[3:])
        row = lambda a: jnp.repeat(a, n)          # noqa: E731 row c * N + n: edge c
        edits = {}
        for i in range(g.layers):
          on = row(l == i)
          for j, kind in enumerate("qkv"):
            heads = g.heads[i] if kind == "q" else g.kv_heads[i]
            m = (on & (row(k) == j))[:, None] & (jnp.arange(heads)[None] == row(h)[:, None])
            edits[f"lm.{i}.attn.in_{kind}"] = interventions.add(val[:, :, None],
                                                                where=m[:, None, :, None])
          if g.mlp[i]:
            edits[f"lm.{i}.mlp_in"] = interventions.add(val, where=(on & (row(k) == 3))[:, None,
                                                                                       None])
        edits[f"lm.{g.layers - 1}.resid_post"] = interventions.add(
            val, where=row(k == 4)[:, None, None])
        logits = s._forward(p, jnp.tile(tok, (c, 1)), edits, cache=cache,
                            start=start if by_layer else None,
                            stream=stream)[0]
        return jax.vmap(self._metric)(logits.reshape(c, n, -1)).mean(1)

      return jax.lax.map(group, (starts, us, ls, ks, hs))
    return fn

  def _grad_keep(self, params, keep, ablated, base=None, embed=None):
    def f(k):
      return self.pairs_metric(params, k, ablated, base, embed).mean()
    return jax.grad(f)(keep)

  def _end_grads(self, params, embed=None, ends=None):
    """(B, T, hi - lo, D) dm/d(input_e) at the clean run for the ends lo..hi-1 (ends
    (lo, hi); None: all), embed (B, T, D) replacing the input embedding: one backward
    through zero `add`s at those ends' sites (a site's other ends get none)."""
    parts = self._end_parts(ends)
    zeros = {n: jnp.zeros(sh[:2] + (b - a,) + sh[-1:], jnp.float32)
             for n, a, b, sh in parts}

    def f(deltas):
      edits = {}
      for n, a, b, sh in parts:
        d = deltas[n]
        edits[n] = interventions.add(jnp.pad(d, ((0, 0), (0, 0), (a, sh[2] - b), (0, 0)))
                                     if len(sh) == 4 else d[:, :, 0])
      if embed is not None:
        edits["lm.0.resid_pre"] = interventions.replace(embed)
      logits, _ = self.s._forward(params, self.s.tokens["clean"], edits)
      return self._metric(logits).mean()

    gr = jax.grad(f)(zeros)
    return jnp.concatenate([gr[n] for n, *_ in parts], axis=2)

  def _end_parts(self, ends=None) -> list:
    """[(site, a, b, site shape)]: the sites holding ends lo..hi-1, in end order, and the
    slots a..b-1 of each (a site without a head axis is one end)."""
    lo, hi = (0, len(self.graph.ends)) if ends is None else ends
    out, at = [], 0
    for n, sh in self._end_shapes().items():
      k = sh[2] if len(sh) == 4 else 1
      a, b = max(lo, at), min(hi, at + k)
      if a < b:
        out.append((n, a - at, b - at, sh))
      at += k
    return out

  def _end_shapes(self) -> dict:
    b, t, _, d = self.clean_out.shape
    g = self.graph
    out = {}
    for i in range(g.layers):
      out[f"lm.{i}.attn.in_q"] = (b, t, g.heads[i], d)
      out[f"lm.{i}.attn.in_k"] = out[f"lm.{i}.attn.in_v"] = (b, t, g.kv_heads[i], d)
      if g.mlp[i]:
        out[f"lm.{i}.mlp_in"] = (b, t, d)
    out[f"lm.{g.layers - 1}.resid_post"] = (b, t, d)
    return out

  # ------------------------------------------------------------------ memory
  def shapes(self, program: str = "eap") -> memory.EapShapes:
    """What a gradient program's memory depends on (memory.EapShapes)."""
    model = dataclasses.replace(self.s.shapes(), t=self.s.t, t_keys=self.s.t)  # no prefix
    data, axis = self.node_axes()
    return memory.EapShapes(model, len(self.graph.nodes), len(self.graph.ends), program,
                            data=data, model_axis=axis)

  def plan(self, program: str = "eap") -> memory.EapPlan:
    """Ends per gradient chunk of `program` ("eap", "ig", "activations") in the study's
    memory budget (memory.eap_plan), chosen from the shapes before anything compiles."""
    return memory.eap_plan(self.shapes(program), self.s.memory_budget)

  def _by_chunks(self, program: str, build, args) -> np.ndarray:
    """(N_nodes, N_ends) scores: build(ends) -> the chunk's program ((N_nodes, hi - lo)),
    one compiled program per chunk of the plan, run one after another."""
    plan = self.last_plan = self.plan(program)
    cols = [np.asarray(self._cached((program, args[0], ends), lambda e=ends: build(e))(
        *args[1:]), np.float64) for ends in plan.chunks]
    return np.concatenate(cols, axis=1)

  def eap(self) -> np.ndarray:
    """(E,) EAP's estimate of exact(): (A_u - a_u) . dm/d(input_e) at the clean run, from
    one backward per chunk of ends (the node outputs and ablated values are the
    study's; the chunks are the memory budget's, `plan`)."""
    g = self._by_chunks("eap", lambda ends: self.eap_program(ends)["fn"],
                        ("eap", self.params, self.ablated, self.clean_out))
    return g[self.edges[:, 0], self.edges[:, 1]]

  def eap_program(self, ends=None) -> dict:
    """eap()'s program for the ends (lo, hi) (None: the plan's first chunk), not run:
    {"fn" (not jitted), "args", "key", "ends"}."""
    ends = self.plan("eap").chunks[0] if ends is None else tuple(ends)

    def fn(p, abl, clean):
      return jnp.einsum("btnd,bted->ne", self.on_nodes(abl - clean),
                        self._end_grads(p, ends=ends))
    return {"fn": fn, "args": (self.params, self.ablated, self.clean_out),
            "key": ("eap", "eap", ends), "ends": ends}

  def eap_ig(self, steps: int = 5, on: str = "inputs", points: str = "left") -> np.ndarray:
    """(E,) EAP-IG's estimate: the gradient averaged over `steps` points alpha
    (ig_alphas) between the ablated run (alpha 0) and the clean run (alpha 1); on
    "inputs" or "activations" (see the module docstring). On the inputs, one program per
    chunk of ends (`plan`)."""
    prog = self.eap_ig_program(steps, on, points)
    if on == "activations":
      g = np.asarray(self._cached(prog["key"], lambda: prog["fn"])(*prog["args"]), np.float64)
    else:
      g = self._by_chunks("ig", lambda ends: self.eap_ig_program(steps, on, points,
                                                                 ends)["fn"],
                          (("ig", steps, points),) + prog["args"])
    return g[self.edges[:, 0], self.edges[:, 1]]

  def eap_ig_program(self, steps: int = 5, on: str = "inputs", points: str = "left",
                     ends=None) -> dict:
    """eap_ig()'s program, not run: {"fn" (not jitted), "args", "key", "ends"}; on the
    inputs, for the ends (lo, hi) (None: the plan's first chunk)."""
    if on not in IG_ON:
      raise UserError(f"ig_on must be one of {IG_ON}; got {on!r}", setting="ig_on")
    if steps < 1:
      raise UserError(f"steps must be >= 1; got {steps}", setting="steps")
    alphas = jnp.asarray(ig_alphas(steps, points), jnp.float32)
    ones = jnp.ones(self.mask.shape, jnp.float32)
    if on == "inputs":
      ends = self.plan("ig").chunks[0] if ends is None else tuple(ends)

    def build():
      def fn(p, alphas, abl, clean):
        clean_e, abl_e = clean[:, :, 0], abl[:, :, 0]
        if on == "inputs":    # the end gradients averaged, then one product
          def one(carry, a):
            return carry + self._end_grads(p, abl_e + a * (clean_e - abl_e), ends), None
          b, t, _, d = clean.shape
          total, _ = jax.lax.scan(one, jnp.zeros((b, t, ends[1] - ends[0], d)), alphas)
          return jnp.einsum("btnd,bted->ne", self.on_nodes(abl - clean), total / steps)

        def one(carry, a):
          return carry - self._grad_keep(p, ones * a, abl), None
        total, _ = jax.lax.scan(one, jnp.zeros_like(ones), alphas)
        return total / steps
      return fn
    return {"fn": build(), "args": (self.params, alphas, self.ablated, self.clean_out),
            "key": ("ig", on, steps, points, ends if on == "inputs" else None),
            "ends": ends if on == "inputs" else None}

  def agreement(self, estimate, *, sample: int = 200, top: int = 20, seed: int = 0) -> dict:
    """activation_patching.agreement of estimate (E,) with exact patching on a sample of edges: the
    `top` largest by |estimate| plus random others, `sample` in all."""
    return self.agreements({"x": estimate}, sample=sample, top=top, seed=seed)["x"]

  def agreements(self, estimates: dict, *, sample: int = 200, top: int = 20,
                 seed: int = 0) -> dict:
    """{name: agreement(estimate)} with the exact patching of every sample's edges in one
    program (each edge once): each estimate's `top` edges by |estimate| and the same
    uniformly drawn others, `sample` in all."""
    n = len(self.edges)
    top = min(top, sample)
    tops = {name: np.argsort(-np.abs(est), kind="stable")[:top]
            for name, est in estimates.items()}
    rng = np.random.default_rng(seed)
    pool = np.setdiff1d(np.arange(n), np.concatenate(list(tops.values())))
    rest = rng.permutation(pool)[:max(0, sample - top)]
    picks = {name: np.concatenate([t, rest]) for name, t in tops.items()}
    union = np.unique(np.concatenate(list(picks.values())))
    ex = dict(zip(union.tolist(), self.exact(union)))
    out = {}
    for name, rows in picks.items():
      out[name] = activation_patching.agreement(estimates[name][rows],
                                                np.asarray([ex[r] for r in rows]),
                                                top=min(top, len(rows)))
      out[name]["sampled_of"] = n
    return out

  def keep_of(self, edge_rows) -> np.ndarray:
    """(N_nodes, N_ends) float keep with only self.edges[edge_rows] kept."""
    k = np.zeros(self.mask.shape, np.float32)
    e = self.edges[np.asarray(edge_rows, np.int64)]
    k[e[:, 0], e[:, 1]] = 1.0
    return k
