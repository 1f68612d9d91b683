"""Causal head studies on prompt pairs, through the model's own forward and its sites.

A `Study` holds a task (what `mha_jax.load` returns), its params and `Pairs`. Every
method is one jit-compiled program (cached on the study) that runs the forward with
`interventions` edits: a sweep over many interventions is a vmap over them, chunked
to a memory budget with `jax.lax.map(..., batch_size=chunk)`, never a Python loop of
forwards.

  activation   patch one site (head outputs z, q, k, v per query head, k, v per kv
               head, the residual stream) from the source run into the base run, for
               every layer and head (and position); denoising = clean into corrupt,
               noising = corrupt into clean.
  path         sender head -> receivers' q, k or v (or the logits): the sender
               patched, every other head frozen at the base run, the receivers'
               inputs recorded, then patched into the base run (Wang et al. 2022).
  attribution  (a_source - a_base) . dM/da at the base run for every head and
               position, from one forward and one backward (Nanda 2023).
  dla          each head's and MLP's direct contribution to logit(answer) -
               logit(wrong), the final norm's scale frozen from the clean run.
  logit_lens   each layer's residual through the final norm and the unembedding.

Metrics from the logits at each prompt's last position: the logit difference LD =
logit(answer) - logit(wrong), the normalised recovery (LD - LD_corrupt) /
(LD_clean - LD_corrupt) of the pair-mean LDs, the answer's probability and its loss
(-log p).
"""

from __future__ import annotations

import time
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from mha_jax import interventions
from mha_jax.traces import token_strings
from mha_jax.errors import UserError
from mha_jax.toolkit import memory
from mha_jax.toolkit.pairs import Pairs
from mha_jax.roles.role_scores import ROLE_COLORS

HEAD_SITES = ("z", "q", "k_q", "v_q", "result")     # per query head
KV_SITES = ("k", "v")                                # per key/value head
STREAM_SITES = ("resid_pre", "resid_mid", "resid_post", "attn_out", "mlp_out")
DIRECTIONS = ("denoise", "noise")
CHANNELS = ("q", "k", "v", "logits")
_CHANNEL_SITE = {"q": "q", "k": "k_q", "v": "v_q"}
_SHAPE_SITES = ("lm.*.attn.z", "lm.*.attn.k", "lm.0.resid_pre")   # the Study's shapes


def _tile(a, repeat: int, axis: int = 0):
  """a repeated `repeat` times along axis (row r * n + i: copy r of row i); a itself at 1."""
  if repeat == 1:
    return a
  a = jnp.asarray(a)
  rep = jnp.broadcast_to(jnp.expand_dims(a, axis), a.shape[:axis] + (repeat,) + a.shape[axis:])
  return rep.reshape(a.shape[:axis] + (repeat * a.shape[axis],) + a.shape[axis + 1:])


def _site(layer: int, site: str) -> str:
  if site in HEAD_SITES or site in KV_SITES or site == "pattern":
    return f"lm.{layer}.attn.{site}"
  if site in STREAM_SITES:
    return f"lm.{layer}.{site}"
  raise UserError(f"site must be one of {HEAD_SITES + KV_SITES + STREAM_SITES}; got {site!r}")


def metrics(ld_MN, logp_MN, ld_clean_N, ld_corrupt_N) -> dict[str, np.ndarray]:
  """Pair means of (…, N) logit differences and answer log-probs: logit_diff, recovery,
  prob, loss, each of shape (…)."""
  ld, lp = np.asarray(ld_MN, np.float64), np.asarray(logp_MN, np.float64)
  c, x = float(np.mean(ld_clean_N, dtype=np.float64)), float(np.mean(ld_corrupt_N, dtype=np.float64))
  denom = c - x if abs(c - x) > 1e-12 else np.nan
  return {"logit_diff": ld.mean(-1), "recovery": (ld.mean(-1) - x) / denom,
          "prob": np.exp(lp).mean(-1), "loss": -lp.mean(-1)}


def agreement(estimate, exact, top: int = 10) -> dict[str, float]:
  """Pearson and Spearman correlation of two score tables (NaNs dropped) and the overlap
  of their top-`top` entries by absolute value (a fraction of `top`)."""
  from scipy import stats
  a, b = np.ravel(np.asarray(estimate, np.float64)), np.ravel(np.asarray(exact, np.float64))
  ok = np.isfinite(a) & np.isfinite(b)
  a, b = a[ok], b[ok]
  k = min(top, len(a))
  ta = set(np.argsort(-np.abs(a))[:k])
  tb = set(np.argsort(-np.abs(b))[:k])
  return {"pearson": float(stats.pearsonr(a, b)[0]),
          "spearman": float(stats.spearmanr(a, b)[0]),
          f"top{top}_overlap": len(ta & tb) / max(k, 1), "n": int(len(a))}


class Study:
  """Clean/corrupt pairs on one model: every method below is one compiled program.

  task: the Task `mha_jax.load` returns (an LM: `apply(params, batch, hook=...)` with
    batch {"tokens", "logits_at"}); params: its params; pairs: Pairs.
  memory_budget: bytes one program of a sweep may hold (default 2 GiB): the chunk sizes
    (interventions per group, pairs per batch) follow from it (`plan`, toolkit/memory.py).
  share_prefix: the positions before the first token where any clean and corrupt
    prompt differ are the same in every run, patched or not (causal attention): when
    the task has `prefix_cache` (imported LMs), the sweeps compute them once and run
    only the rest from that KV cache (exact; IOI's prompts share ~2/3 of their tokens).
  share_depth: an intervention at layer l leaves layers < l as in the base run: with a
    task that has `prefix_cache` (its apply resumes at a layer), the patching sweeps run
    each intervention from its layer on, from the base run's residual stream there
    (exact; about half of the layers' work over a sweep of every layer).
  baseline: the unpatched runs as `baseline()` returns them, when already known (`subset`
    passes its rows of them); None runs them.
  mesh: a jax Mesh with axes "data" and "model" (train.sharding.make_mesh): the params
    placed as training places them (heads and MLP units over "model") and every
    program's rows (the pairs, with a sweep's interventions folded into them) over
    "data" where they divide it; the tables are the single-device ones.
  """

  def __init__(self, task, params, pairs: Pairs, *, memory_budget: int = 2 << 30,
               share_prefix: bool = True, share_depth: bool = True,
               baseline: dict | None = None, mesh=None):
    self.mesh = mesh
    if mesh is not None:      # heads (and MLP units) over "model", as training places them
      from mha_jax.train import sharding
      params = jax.device_put(params, sharding.shardings(params, mesh))
    self.task, self.params, self.pairs = task, params, pairs
    self.memory_budget, self.share_prefix = int(memory_budget), share_prefix
    self.share_depth = bool(share_depth) and hasattr(task, "prefix_cache")
    n, t = pairs.clean.shape
    extra = lambda a: np.concatenate([a, a[:, -1:]], axis=1)  # noqa: E731 apply shifts by 1
    self.tokens = {"clean": self._rows(jnp.asarray(extra(pairs.clean))),
                   "corrupt": self._rows(jnp.asarray(extra(pairs.corrupt)))}
    self.at = jnp.asarray(pairs.length - 1, jnp.int32)
    self.answer = jnp.asarray(pairs.answer)
    self.wrong = jnp.asarray(pairs.wrong)
    self.n, self.t = n, t
    differ = (pairs.clean != pairs.corrupt).any(axis=0)
    p0 = min(int(np.argmax(differ)) if differ.any() else t, int(pairs.length.min()) - 1)
    self.prefix = p0 if share_prefix and hasattr(task, "prefix_cache") and p0 >= 1 else 0
    self._jit: dict = {}
    self.last_plan: memory.Plan | None = None     # the last sweep's chunk sizes
    # the shapes from the trace the baseline runs then reuse (one trace, not two)
    vals = self._edited_fn(_SHAPE_SITES).eval_shape(params, self.tokens["clean"], {})[1]
    self.vocab = int(task.vocab_size)
    self.layers = sum(1 for k in vals if k.endswith(".attn.z"))
    if self.layers == 0:
      raise UserError("this model has no lm.{i}.attn sites: patching studies need a "
                      "decoder-only LM")
    self.heads = [vals[f"lm.{i}.attn.z"].shape[2] for i in range(self.layers)]
    self.kv_heads = [vals[f"lm.{i}.attn.k"].shape[2] for i in range(self.layers)]
    self.head_dim = [vals[f"lm.{i}.attn.z"].shape[3] for i in range(self.layers)]
    self.d_model = vals["lm.0.resid_pre"].shape[-1]
    if baseline is not None and any(np.shape(baseline.get(r, {}).get(k)) != (n,)
                                    for r in ("clean", "corrupt") for k in ("ld", "logp")):
      raise ValueError(f"baseline must hold clean and corrupt ld and logp of shape ({n},); "
                       f"got {baseline!r}")
    self._base = baseline or self._baseline_runs()
    self.ld_clean, self.ld_corrupt = self._base["clean"]["ld"], self._base["corrupt"]["ld"]

  def subset(self, keep) -> "Study":
    """This study on the pairs `keep` (indices), their unpatched runs taken from this
    study's (no forward runs again)."""
    keep = np.asarray(keep)
    base = {r: {k: v[keep] for k, v in self._base[r].items()} for r in self._base}
    return Study(self.task, self.params, self.pairs.subset(keep),
                 memory_budget=self.memory_budget, share_prefix=self.share_prefix,
                 share_depth=self.share_depth, baseline=base, mesh=self.mesh)

  def _rows(self, a):
    """a (R, ...) with its rows over the mesh's "data" axis where they divide it (a
    sweep's interventions and pairs are folded into the rows); a itself without a mesh."""
    if self.mesh is None or a.shape[0] % self.mesh.shape["data"]:
      return a
    from jax.sharding import NamedSharding, PartitionSpec
    spec = NamedSharding(self.mesh, PartitionSpec("data"))
    if isinstance(a, jax.core.Tracer):
      return jax.lax.with_sharding_constraint(a, spec)
    return jax.device_put(a, spec)

  # ------------------------------------------------------------------ forward
  def _forward(self, params, tokens, edits=None, read=(), cache=None, start=None,
               stream=None):
    """(logits (R * N, V) float32 at each prompt's last position, values read), tokens
    (R * N, T + 1): R sets of the N prompts, row r * N + n (folded batches; the cache
    and stream are tiled to match). With the shared prefix's cache, only positions
    self.prefix.. run (and are the sites'); with start and stream (L, N, T', D), only
    layers start.. (share_depth)."""
    repeat = tokens.shape[0] // self.n
    at = _tile(self.at, repeat)
    tokens = self._rows(tokens)
    batch = {"tokens": tokens, "logits_at": at}
    if cache is not None:
      cache = jax.tree.map(lambda a: _tile(a, repeat) if jnp.ndim(a) else a, cache)
      batch = {"tokens": tokens[:, self.prefix:], "logits_at": at - self.prefix,
               "cache": cache}
    if start is not None:
      batch.update(start=start, stream=_tile(stream, repeat, 1))
    out, vals = interventions.run_with_hook(lambda hook: self.task.apply(params, batch, hook=hook), edits, read)
    return out[:, 0].astype(jnp.float32), vals

  def _score(self, logits_NV):
    """(LD (N,), log p(answer) (N,)); of R sets' logits (R * N, V), (R * N,)."""
    rows = jnp.arange(logits_NV.shape[0])
    repeat = logits_NV.shape[0] // self.n
    answer, wrong = _tile(self.answer, repeat), _tile(self.wrong, repeat)
    ld = logits_NV[rows, answer] - logits_NV[rows, wrong]
    logp = jax.nn.log_softmax(logits_NV, axis=-1)[rows, answer]
    return ld, logp

  def _cached(self, key, build):
    if key not in self._jit:
      self._jit[key] = jax.jit(build())
    return self._jit[key]

  def _prefix_cache(self, params):
    """The KV cache of the shared prefix (None when the sweeps run every position)."""
    if not self.prefix:
      return None
    return self.task.prefix_cache(params, self.tokens["clean"][:, :self.prefix], self.t)

  def shapes(self, sites: int = 1, pairs: int | None = None) -> memory.PatchShapes:
    """The shapes a sweep's memory depends on (memory.PatchShapes) for `sites` sites."""
    return memory.PatchShapes(
        layers=self.layers, heads=max(self.heads), kv_heads=max(self.kv_heads),
        head_dim=max(self.head_dim), d_model=self.d_model,
        d_mlp=memory.mlp_width(self.params, self.d_model), vocab=self.vocab,
        t=self.t - self.prefix, t_keys=self.t, pairs=self.n if pairs is None else pairs,
        dtype_bytes=memory.dtype_bytes(self.params), sites=sites)

  def plan(self, interventions: int, sites: int = 1) -> memory.Plan:
    """The chunk sizes of a sweep of `interventions` over `sites` sites in
    memory_budget (memory.patch_plan): chosen before anything compiles."""
    return memory.patch_plan(self.shapes(sites), interventions, self.memory_budget)

  def _chunk(self, m: int, factor: float = 1.0) -> int:
    """Interventions per group on all N pairs (factor: programs that run `factor`
    forwards per intervention)."""
    sh = self.shapes()
    free = self.memory_budget - self.n * sh.per_pair()
    return int(max(1, min(m, free // max(1, int(self.n * sh.per_row() * factor)))))

  def _runs(self, direction):
    if direction not in DIRECTIONS:
      raise UserError(f"direction must be one of {DIRECTIONS}; got {direction!r}")
    return ("corrupt", "clean") if direction == "denoise" else ("clean", "corrupt")

  def baseline(self) -> dict:
    """{"clean", "corrupt": {"ld", "logp": (N,)}} of the unpatched runs (computed once,
    when the study is made)."""
    return {r: dict(v) for r, v in self._base.items()}

  def _baseline_runs(self) -> dict:
    # one compiled forward (the one `edited` runs without edits), called on each prompt set
    runs = {r: self.edited(r, read=_SHAPE_SITES) for r in ("clean", "corrupt")}
    return {r: {"ld": v["ld"], "logp": v["logp"]} for r, v in runs.items()}

  def values(self, prompts: str, read: Sequence[str]) -> dict:
    """{site: value} on the clean or corrupt prompts (one compiled forward per read set)."""
    read = tuple(read)
    fn = self._cached(("values", read), lambda: lambda p, tok: self._forward(p, tok,
                                                                              read=read)[1])
    return fn(self.params, self.tokens[prompts])

  def edited(self, prompts: str, edits=None, read: Sequence[str] = ()) -> dict:
    """One forward of the clean or corrupt prompts with `edits` ({site: Edit}, sites
    over all T positions): {"ld": (N,), "logp": (N,), "values": {site: value read}}."""
    (ld, logp), vals = self._edited_fn(tuple(read))(self.params, self.tokens[prompts],
                                                   edits or {})
    return {"ld": np.asarray(ld), "logp": np.asarray(logp), "values": vals}

  def _edited_fn(self, read: tuple):
    def build():
      def fn(p, tok, edits):
        logits, vals = self._forward(p, tok, edits, read)
        return self._score(logits), vals
      return fn
    return self._cached(("edited", read), build)

  # ------------------------------------------------------------------ activation patching
  def patch(self, site: str = "z", *, per_position: bool = False,
            direction: str = "denoise", layers: Sequence[int] | None = None,
            chunk: int | None = None) -> dict:
    """Activation patching of `site` for every layer and head (per query head on
    z/q/k_q/v_q/result, per kv head on k/v, none on the stream sites) and, with
    per_position, every position; all in one program. layers: only these layers'
    interventions (the others' entries stay NaN).

    Returns metrics(...) arrays of shape (L, H_max[, T]) (or (L[, T]) for stream
    sites), NaN where a layer has fewer heads, plus "ld" (…, N) per pair.
    """
    return self.patch_many(((site, per_position),), direction=direction, layers=layers,
                           chunk=chunk)[site]

  def patch_many(self, sweeps: Sequence[tuple[str, bool]], *, direction: str = "denoise",
                 layers: Sequence[int] | None = None, chunk: int | None = None,
                 pairs_per_batch: int | None = None) -> dict:
    """Several activation-patching sweeps, each (site, per_position) as in `patch`, in
    one compiled program: the interventions of every sweep are one batch over a site
    axis (each intervention edits one site of one layer and head, the other edits are
    the identity). chunk (interventions per group) and pairs_per_batch: from `plan`
    unless given; batches of pairs run one after another (the same program) and their
    per-pair results are joined. Returns {site: what `patch(site, per_position=...)`
    returns}."""
    n_idx, n_sites = self._sweep_size(sweeps, layers)
    plan = self.last_plan = self.plan(n_idx, n_sites)
    chunk = chunk or plan.interventions_per_group
    pairs_per_batch = pairs_per_batch or plan.pairs_per_batch
    if pairs_per_batch < self.n:
      return self._by_pairs(pairs_per_batch, lambda sub: sub.patch_many(
          sweeps, direction=direction, layers=layers, chunk=chunk,
          pairs_per_batch=sub.n))
    prog = self.sweep_program(sweeps, direction=direction, layers=layers, chunk=chunk)
    ld, logp = self._cached(prog["key"], lambda: prog["fn"])(*prog["args"])
    idx, n = prog["idx"], self.n
    ld = np.asarray(ld).reshape(-1, n)[prog["where"]]   # idx's order, padding left out
    logp = np.asarray(logp).reshape(-1, n)[prog["where"]]
    out = {}
    for j, (s, pp) in enumerate(prog["sweeps"]):
      rows = [r for r, ix in enumerate(idx) if ix[0] == j]
      out[s] = self._table([idx[r][1:] for r in rows], ld[rows], logp[rows],
                           max(prog["counts"][j]), prog["per_head"][j], pp,
                           prog["base_run"])
    return out

  def _sweep_size(self, sweeps, layers) -> tuple[int, int]:
    """(interventions, sites) of a sweep, as sweep_program counts them."""
    pre = self.prefix
    chosen = range(self.layers) if layers is None else sorted({int(l) for l in layers})
    bad = [l for l in chosen if not 0 <= l < self.layers]
    if bad:
      raise UserError(f"layers: {bad} are not layers of this model (0..{self.layers - 1})")
    total = 0
    for s, pp in sweeps:
      ph = s in HEAD_SITES or s in KV_SITES
      per_layer = (self.kv_heads if s in KV_SITES else self.heads) if ph else [1] * self.layers
      total += sum(per_layer[l] for l in chosen) * (
          (self.t - pre) if pp else 1)
    return total, len(sweeps)

  def sweep_program(self, sweeps: Sequence[tuple[str, bool]], *, direction: str = "denoise",
                    layers: Sequence[int] | None = None, chunk: int | None = None) -> dict:
    """The program `patch_many` runs, not run: {"fn" (not jitted), "args" (its
    arguments, self.params first), "key" (its cache key), "chunk" (interventions per
    group C), "groups" (G), "idx", "where", "counts", "per_head", "sweeps", "base_run"}.
    `mha-jax plan` compiles fn from the args' shapes."""
    base_run, src_run = self._runs(direction)
    sweeps = tuple((s, bool(pp)) for s, pp in sweeps)
    sites = [s for s, _ in sweeps]
    if not sweeps or len(set(sites)) != len(sites):
      raise UserError(f"sweeps must name each site once; got {sites}")
    for s in sites:
      _site(0, s)
    pre = self.prefix      # positions before it are the same in every run: no effect
    chosen = range(self.layers) if layers is None else sorted({int(l) for l in layers})
    bad = [l for l in chosen if not 0 <= l < self.layers]
    if bad:
      raise UserError(f"layers: {bad} are not layers of this model (0..{self.layers - 1})")
    per_head = [s in HEAD_SITES or s in KV_SITES for s in sites]
    counts = [(self.kv_heads if s in KV_SITES else self.heads) if ph else [1] * self.layers
              for s, ph in zip(sites, per_head)]
    idx = [(k, l, h, p) for k, (_, pp) in enumerate(sweeps) for l in chosen
           for h in range(counts[k][l]) for p in (range(pre, self.t) if pp else (-1,))]
    names = {s: tuple(_site(i, s) for i in range(self.layers)) for s in sites}
    flat = tuple(n for s in sites for n in names[s])
    chunk = chunk or self.plan(len(idx), len(sites)).interventions_per_group
    starts, rows, where = self._groups(idx, chosen, chunk, self.share_depth)
    cols = tuple(jnp.asarray(np.asarray(c, np.int32)[rows]) for c in zip(*idx))  # (G, C)
    c, n = rows.shape[1], self.n

    def build():
      def fn(params, base_tok, src_tok, starts, ks, ls, hs, ps):
        cache = self._prefix_cache(params)
        if starts is None:
          src = self._forward(params, src_tok, read=flat, cache=cache)[1]
        else:     # one forward of both runs: the source's sites, the base's stream
          src, stream = self._source_and_stream(params, src_tok, base_tok, flat, cache)
        base_tok = _tile(base_tok, c)

        def group(g):
          # C interventions folded into the rows (row c * N + n: intervention c, pair n),
          # each edit's `where` picks its own layer, head and position per row
          start, k, l, h, p = g
          edits = {}
          for j, s in enumerate(sites):
            # k_q, v_q (after the cache) span the whole cache; every other site the rest
            ar_t = jnp.arange(0 if s in ("k_q", "v_q") else pre, self.t)
            pos_CT = (ar_t[None] == p[:, None]) | (p[:, None] < 0)
            for i, name in enumerate(names[s]):
              m = pos_CT & ((l == i) & (k == j))[:, None]
              if per_head[j]:
                m = m[:, :, None] & (jnp.arange(counts[j][i])[None, None] == h[:, None, None])
              # tiled here, in the loop, so that XLA fuses it into the edit's select
              edits[name] = interventions.replace(_tile(src[name], c),
                                                  where=jnp.repeat(m[..., None], n, 0))
          logits = self._forward(params, base_tok, edits, cache=cache,
                                 start=None if starts is None else start,
                                 stream=None if starts is None else stream)[0]
          return jax.tree.map(lambda a: a.reshape(c, n), self._score(logits))

        return jax.lax.map(group, (starts, ks, ls, hs, ps))
      return fn

    args = (self.params, self.tokens[base_run], self.tokens[src_run],
            None if starts is None else jnp.asarray(starts), *cols)
    return {"fn": build(), "args": args, "chunk": c, "groups": rows.shape[0],
            "key": ("patch", sweeps, rows.shape, starts is None),  # direction: the prompts
            "idx": idx, "where": where, "counts": counts, "per_head": per_head,
            "sweeps": sweeps, "base_run": base_run}

  def _by_pairs(self, size: int, run) -> dict:
    """run(sub-study) on batches of <= size pairs, the per-pair "ld" and "logp" (last
    axis) joined and the metrics taken over all pairs."""
    parts = [run(self.subset(np.arange(i, min(i + size, self.n))))
             for i in range(0, self.n, size)]
    out = {}
    for site in parts[0]:
      ld = np.concatenate([p[site]["ld"] for p in parts], axis=-1)
      lp = np.concatenate([p[site]["logp"] for p in parts], axis=-1)
      out[site] = {**metrics(ld, lp, self.ld_clean, self.ld_corrupt), "ld": ld, "logp": lp}
    return out

  @staticmethod
  def _groups(idx, chosen, chunk: int, by_layer: bool):
    """A sweep's batches: (starts (G,) or None, rows (G, C) into idx, where (len(idx),)).
    by_layer (depth sharing): a group's interventions are of one layer, its start; else
    they run in idx's order. C <= chunk, as even as the split into groups allows; a
    short group repeats its last row (computed, then dropped); where[r] is row r's place
    in rows.reshape(-1)."""
    even = lambda m: -(-m // -(-m // chunk))     # noqa: E731 ceil(m / groups of <= chunk)
    of = ([[r for r, ix in enumerate(idx) if ix[1] == l] for l in chosen] if by_layer
          else [list(range(len(idx)))])
    size = max(even(len(g)) for g in of)
    parts = [(l, g[j:j + size]) for l, g in zip(chosen if by_layer else [None], of)
             for j in range(0, len(g), size)]
    rows = np.asarray([g + [g[-1]] * (size - len(g)) for _, g in parts], np.int64)
    where = np.empty(len(idx), np.int64)
    for gi, (_, g) in enumerate(parts):
      where[g] = gi * size + np.arange(len(g))
    starts = np.asarray([l for l, _ in parts], np.int32) if by_layer else None
    return starts, rows, where

  # a group's fixed cost per layer (its weights read, the edits' masks, one step of the
  # map) in rows: about 3-8 on SmolLM2's exact check (2 CPU cores)
  GROUP_ROWS = 4.0

  @staticmethod
  def _depth_groups(layers, chunk: int, n_layers: int):
    """_groups' triple for interventions at uneven depths, layers (R,) int: sorted by
    layer and cut into G groups of C <= chunk consecutive ones, each run from its first
    row's layer (rows of deeper layers pass the layers between unedited: the same
    stream). C minimises the layers run, sum over groups of (C + GROUP_ROWS) x (n_layers -
    start); only the last (deepest) group is padded, repeating its last row."""
    layers = np.asarray(layers, np.int64)
    order = np.argsort(layers, kind="stable")
    r = len(order)

    def cost(c):
      firsts = layers[order[::c]]
      return float(((c + Study.GROUP_ROWS) * (n_layers - firsts)).sum())
    size = min(range(1, max(1, min(chunk, r)) + 1), key=cost)
    pad = np.concatenate([order, np.repeat(order[-1:], -r % size)])
    rows = pad.reshape(-1, size)
    where = np.empty(r, np.int64)
    where[order] = np.arange(r)
    return layers[rows[:, 0]].astype(np.int32), rows, where

  def _source_and_stream(self, params, src_tok, base_tok, read, cache):
    """({site: value} of `read` on the source prompts, the residual stream entering each
    layer (L, N, T', D) on the base prompts), from one forward of both."""
    names = tuple(f"lm.{i}.resid_pre" for i in range(self.layers))
    vals = self._forward(params, jnp.concatenate([src_tok, base_tok]), read=read + names,
                         cache=cache)[1]
    n = self.n
    return ({k: vals[k][:n] for k in read},
            jnp.stack([vals[k][n:] for k in names]))

  def _table(self, idx, ld, logp, hmax, per_head, per_position, base_run):
    shape = (self.layers,) + ((hmax,) if per_head else ()) + ((self.t,) if per_position else ())
    full_ld = np.full(shape + (self.n,), np.nan)
    full_lp = np.full(shape + (self.n,), np.nan)
    if per_position and self.prefix:   # the shared prefix: patching there is the base run
      base = self.baseline()[base_run]
      for l, h, _ in idx:
        key = (l,) + ((h,) if per_head else ())
        full_ld[key][:self.prefix], full_lp[key][:self.prefix] = base["ld"], base["logp"]
    for row, (l, h, p) in enumerate(idx):
      key = (l,) + ((h,) if per_head else ()) + ((p,) if per_position else ())
      full_ld[key], full_lp[key] = ld[row], logp[row]
    out = metrics(full_ld, full_lp, self.ld_clean, self.ld_corrupt)
    out["ld"], out["logp"] = full_ld, full_lp
    return out

  def patch_one(self, site: str, layer: int, head: int | None = None,
                position: int | None = None, direction: str = "denoise") -> dict:
    """One intervention, one forward (the reference the batched sweep must equal)."""
    base_run, src_run = self._runs(direction)
    name = _site(layer, site)
    src = self.values(src_run, (name,))[name]
    sel = {}
    if head is not None:
      sel["heads"] = head
    if position is not None:
      sel["positions"] = position
    fn = self._cached("one", lambda: lambda p, tok, edits: self._score(
        self._forward(p, tok, edits)[0]))
    ld, logp = fn(self.params, self.tokens[base_run], {name: interventions.replace(src, **sel)})
    return metrics(np.asarray(ld), np.asarray(logp), self.ld_clean, self.ld_corrupt)

  # ------------------------------------------------------------------ attribution patching
  def attribution(self, sites: Sequence[str] = ("z",), direction: str = "denoise") -> dict:
    """AtP: for each site, (a_source - a_base) . d mean-LD / da at the base run, summed
    over the head width, in the recovery normalisation (divided by LD_clean -
    LD_corrupt). One forward of the source run, one forward+backward of the base run.

    Returns {site: {"per_position": (L, H_max, T), "heads": (L, H_max)}} (stream sites:
    (L, T) and (L,)).
    """
    base_run, src_run = self._runs(direction)
    sites = tuple(sites)
    names = {s: tuple(_site(i, s) for i in range(self.layers)) for s in sites}
    flat = tuple(n for s in sites for n in names[s])

    def build():
      def fn(params, base_tok, src_tok):
        src = self._forward(params, src_tok, read=flat)[1]
        base = self._forward(params, base_tok, read=flat)[1]
        zeros = {n: jnp.zeros_like(base[n]) for n in flat}

        def mean_ld(deltas):
          logits, _ = self._forward(params, base_tok, {n: interventions.add(d) for n, d in deltas.items()})
          return self._score(logits)[0].mean()

        grads = jax.grad(mean_ld)(zeros)
        return {n: (src[n] - base[n]) * grads[n] for n in flat}
      return fn

    fn = self._cached(("atp", sites), build)        # the direction only swaps the prompts
    prod = fn(self.params, self.tokens[base_run], self.tokens[src_run])
    denom = float(np.mean(self.ld_clean) - np.mean(self.ld_corrupt))
    out = {}
    for s in sites:
      per = []
      for n in names[s]:
        v = np.asarray(prod[n], np.float64) * self.n / denom   # grad carries 1/N
        if s in HEAD_SITES or s in KV_SITES:
          per.append(v.sum(axis=3).mean(0).T)                   # (H, T)
        else:
          per.append(v.sum(axis=2).mean(0))                     # (T,)
      if s in HEAD_SITES or s in KV_SITES:
        hmax = max(p.shape[0] for p in per)
        arr = np.full((self.layers, hmax, self.t), np.nan)
        for i, p in enumerate(per):
          arr[i, :p.shape[0]] = p
        out[s] = {"per_position": arr, "heads": arr.sum(-1)}
      else:
        arr = np.stack(per)
        out[s] = {"per_position": arr, "heads": arr.sum(-1)}
    return out

  def forward_backward_seconds(self, rounds: int = 3) -> float:
    """Median seconds of one forward+backward of the mean LD on the corrupt run (the
    unit AtP's cost is quoted in)."""
    fn = self._cached("fwdbwd", lambda: jax.grad(
        lambda p, tok: self._score(self._forward(p, tok)[0])[0].mean()))
    jax.block_until_ready(fn(self.params, self.tokens["corrupt"]))
    times = []
    for _ in range(rounds):
      t0 = time.perf_counter()
      jax.block_until_ready(fn(self.params, self.tokens["corrupt"]))
      times.append(time.perf_counter() - t0)
    return float(np.median(times))

  # ------------------------------------------------------------------ path patching
  def path_patch(self, receivers: Sequence[tuple[int, int]] | str = "logits",
                 channel: str = "q", direction: str = "denoise",
                 chunk: int | None = None,
                 sender_layers: Sequence[int] | None = None,
                 senders: Sequence[tuple[int, int]] | None = None) -> dict:
    """Path patching from every sender head to each receiver head through its `channel`
    input ("q", "k", "v": as that query head reads it), or to the logits
    (receivers="logits" or channel="logits"). sender_layers: only the heads of these
    layers are senders (default every layer; the others' rows are NaN).

    Step 1 (base run): the sender's z from the source run, every other head's z frozen
    at the base run (MLPs recompute); the receiver's channel is recorded. Step 2 (base
    run): the receiver's channel replaced by the recording. For the logits, step 1's
    logits are the result. All (sender, receiver) pairs in one program.

    senders: only these (layer, head) senders (instead of sender_layers' heads; the
    others' entries stay NaN).

    Returns metrics arrays of shape (L, H_max, R) (R = 1 for the logits) and
    "receivers".
    """
    base_run, src_run = self._runs(direction)
    to_logits = receivers == "logits" or channel == "logits"
    if not to_logits and channel not in _CHANNEL_SITE:
      raise UserError(f"channel must be one of {CHANNELS}; got {channel!r}")
    recv = [(-1, -1)] if to_logits else [(int(a), int(b)) for a, b in receivers]
    for a, b in recv:
      if not to_logits and not (0 <= a < self.layers and 0 <= b < self.heads[a]):
        raise UserError(f"receiver lm.{a}.{b} is not a head of this model")
    layers = range(self.layers) if sender_layers is None else sorted(set(sender_layers))
    for l in layers:
      if not 0 <= l < self.layers:
        raise UserError(f"sender_layers: {l} is not a layer of this model (0 to "
                        f"{self.layers - 1})")
    pool = ([(l, h) for l in layers for h in range(self.heads[l])]
            if senders is None else [(int(a), int(b)) for a, b in senders])
    idx = [(l, h, r) for r in range(len(recv)) for l, h in pool]
    ls, hs, rs = (jnp.asarray(np.asarray(c, np.int32)) for c in zip(*idx))
    rl = jnp.asarray([a for a, _ in recv], jnp.int32)
    rh = jnp.asarray([b for _, b in recv], jnp.int32)
    zn = tuple(_site(i, "z") for i in range(self.layers))
    cn = () if to_logits else tuple(_site(i, _CHANNEL_SITE[channel])
                                    for i in range(self.layers))
    chunk = chunk or self._chunk(len(idx), factor=2.0)

    def build():
      def fn(params, base_tok, src_tok, ls, hs, rs, rl, rh):
        cache = self._prefix_cache(params)
        src = self._forward(params, src_tok, read=zn, cache=cache)[1]
        base = self._forward(params, base_tok, read=zn, cache=cache)[1]

        def one(ix):
          l, h, r = ix
          frozen = {}
          for i, n in enumerate(zn):
            sender = (jnp.arange(self.heads[i]) == h) & (i == l)
            frozen[n] = [interventions.replace(base[n]), interventions.replace(src[n], heads=sender)]
          logits, rec = self._forward(params, base_tok, frozen, read=cn, cache=cache)
          if to_logits:
            return self._score(logits)
          edits = {n: interventions.replace(rec[n], heads=(jnp.arange(self.heads[i]) == rh[r])
                                & (i == rl[r])) for i, n in enumerate(cn)}
          return self._score(self._forward(params, base_tok, edits, cache=cache)[0])

        return jax.lax.map(one, (ls, hs, rs), batch_size=chunk)
      return fn

    key = ("path", to_logits, channel, len(idx), chunk)   # direction: the prompts passed
    fn = self._cached(key, build)
    ld, logp = fn(self.params, self.tokens[base_run], self.tokens[src_run], ls, hs, rs, rl, rh)
    ld, logp = np.asarray(ld), np.asarray(logp)
    hmax = max(self.heads)
    full_ld = np.full((self.layers, hmax, len(recv), self.n), np.nan)
    full_lp = np.full_like(full_ld, np.nan)
    for row, (l, h, r) in enumerate(idx):
      full_ld[l, h, r], full_lp[l, h, r] = ld[row], logp[row]
    out = metrics(full_ld, full_lp, self.ld_clean, self.ld_corrupt)
    out["ld"] = full_ld
    out["receivers"] = ["logits"] if to_logits else [f"lm.{a}.{b}" for a, b in recv]
    return out

  # ------------------------------------------------------------------ DLA and logit lens
  def dla(self, prompts: str = "clean") -> dict:
    """Direct logit attribution on the `prompts` ("clean" or "corrupt"): each head's
    result and each MLP's output at the last position, dotted with the direction of
    d LD / d (final residual) with the final norm's scale frozen at these prompts' value
    (LD is then affine in the residual); a head's result first through its layer's
    post-attention norm where there is one (Gemma), its scale frozen too.

    Returns {"heads": (L, H_max), "mlp": (L,), "embed": float, "ld": mean LD,
    "ld_frozen_sum": heads + MLPs + embeddings (+ biases: the rest)} as pair means.
    """
    last = f"lm.{self.layers - 1}.resid_post"
    rn = tuple(_site(i, "result") for i in range(self.layers))
    mn = tuple(_site(i, "mlp_out") for i in range(self.layers))
    pre = tuple(_site(i, "resid_pre") for i in range(self.layers))
    an = tuple(_site(i, "attn_out") for i in range(self.layers))
    post = tuple(f"lm.{i}.ln1_post.scale" for i in range(self.layers))  # Gemma's
    read = rn + mn + pre + post + ("lm.ln_final.scale", last)

    def build():
      def fn(params, tok):
        _, vals = self._forward(params, tok, read=read)
        # the final norm's scale frozen (a model without one: LD is already affine)
        freeze = {n: interventions.replace(jax.lax.stop_gradient(vals[n]))
                  for n in ("lm.ln_final.scale",) if n in vals}

        def ld_of(delta):
          logits, _ = self._forward(params, tok, {**freeze, last: interventions.add(delta)})
          return self._score(logits)[0].sum()

        g = jax.grad(ld_of)(jnp.zeros_like(vals[last]))      # (N, T, D)
        # Each head's result through its layer's output map (a post-attention norm with
        # its scale frozen; the identity elsewhere): the gradient of g . attn_out with
        # every layer's input replaced by its own value without gradient (no path
        # through later layers).
        frozen = {n: interventions.replace(jax.lax.stop_gradient(vals[n])) for n in pre + post
                  if n in vals}

        def direct(deltas):
          _, out = self._forward(params, tok, {**frozen, **{n: interventions.add(d) for n, d in
                                                            deltas.items()}}, read=an)
          return sum(jnp.sum(out[n] * g) for n in an)

        gr = jax.grad(direct)({n: jnp.zeros_like(vals[n]) for n in rn})
        heads = [jnp.einsum("nthd,nthd->nh", vals[n], gr[n]) for n in rn]
        mlp = jnp.stack([jnp.einsum("ntd,ntd->n", vals[n], g) if n in vals   # attn-only
                         else jnp.zeros(g.shape[:1]) for n in mn])
        embed = jnp.einsum("ntd,ntd->n", vals["lm.0.resid_pre"], g)
        return heads, mlp, embed
      return fn

    fn = self._cached(("dla", prompts), build)
    heads, mlp, embed = fn(self.params, self.tokens[prompts])
    hmax = max(self.heads)
    arr = np.full((self.layers, hmax), np.nan)
    for i, hd in enumerate(heads):
      arr[i, :hd.shape[1]] = np.asarray(hd, np.float64).mean(0)
    mlp = np.asarray(mlp, np.float64).mean(1)
    embed = float(np.asarray(embed, np.float64).mean())
    ld = float(np.mean(self.ld_clean if prompts == "clean" else self.ld_corrupt))
    return {"heads": arr, "mlp": mlp, "embed": embed, "ld": ld,
            "ld_frozen_sum": float(np.nansum(arr) + mlp.sum() + embed)}

  def logit_lens(self, prompts: str = "clean") -> dict:
    """Each layer's residual (the embeddings, then after every layer) read through the
    final norm and the unembedding. Returns metrics arrays of shape (L + 1,)."""
    last = f"lm.{self.layers - 1}.resid_post"
    read = ("lm.0.resid_pre",) + tuple(_site(i, "resid_post") for i in range(self.layers))

    def build():
      def fn(params, tok):
        vals = self._forward(params, tok, read=read)[1]
        stack = jnp.stack([vals[n] for n in read])
        return jax.lax.map(lambda r: self._score(self._forward(
            params, tok, {last: interventions.replace(r)})[0]), stack)
      return fn

    fn = self._cached(("lens", prompts), build)
    ld, logp = fn(self.params, self.tokens[prompts])
    out = metrics(np.asarray(ld), np.asarray(logp), self.ld_clean, self.ld_corrupt)
    out["ld"] = np.asarray(ld)
    return out


def head_table(arr_LH, counts: Sequence[int] | None = None, kv: bool = False) -> dict:
  """{"lm.l.h": value} of an (L, H) table (NaN entries skipped); kv names kv heads the
  same way (their table says which)."""
  out = {}
  for l, row in enumerate(np.asarray(arr_LH)):
    for h, v in enumerate(row):
      if counts is not None and h >= counts[l]:
        continue
      if np.isfinite(v):
        out[f"lm.{l}.{h}"] = round(float(v), 6)
  return out


def top(table: dict, k: int = 10, by_abs: bool = False) -> list[tuple[str, float]]:
  """The k largest entries of a {name: value} table (by absolute value when asked)."""
  key = (lambda kv: -abs(kv[1])) if by_abs else (lambda kv: -kv[1])
  return sorted(table.items(), key=key)[:k]


# ------------------------------------------------------------------ the explorer's data

def json_finite(x):
  """NaN and infinities as None (JSON.parse refuses them)."""
  if isinstance(x, float):
    return x if np.isfinite(x) else None
  if isinstance(x, dict):
    return {k: json_finite(v) for k, v in x.items()}
  if isinstance(x, list):
    return [json_finite(v) for v in x]
  return x


def attention_data(study, task, pairs: int = 2, digits: int = 2) -> dict:
  """The attention view's JSON for the first `pairs` pairs, clean and corrupt prompts:
  `weights[sentence]["lm"][layer][head][query][key]` from the study's own forward
  (the `lm.{i}.attn.pattern` sites)."""
  n = min(pairs, study.n)
  read = [f"lm.{i}.attn.pattern" for i in range(study.layers)]
  sents, weights = [], []
  for prompts in ("clean", "corrupt"):
    vals = study.values(prompts, read)
    ids = np.asarray(study.pairs.clean if prompts == "clean" else study.pairs.corrupt)
    for b in range(n):
      t = int(study.pairs.length[b])
      sents.append({"tokens": token_strings(task, ids[b, :t]), "label": f"pair {b} {prompts}"})
      weights.append({"lm": [np.round(np.asarray(vals[s][b], np.float64)[:, :t, :t],
                                      digits).tolist() for s in read]})
  order = [i for b in range(n) for i in (b, n + b)]     # pair 0 clean, pair 0 corrupt, ...
  return {"sentences": [sents[i] for i in order], "weights": [weights[i] for i in order],
          "stacks": ["lm"], "roles": {}, "colors": ROLE_COLORS}
