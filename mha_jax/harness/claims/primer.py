"""DIR/primer.html: the first seed document's figures, interactive and offline.

Every number on the page is computed here by the project's own code (the attention
function and its building blocks, the accounting, the trained toy models of the claims
run) and embedded as JSON; the page's script only draws and looks up precomputed grids
as sliders move. No network request: inline script and style, no external resource.
The page itself is mha_jax/harness/claims/primer_assets/primer.{html,css,js}.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np

from mha_jax import assets, storage
from mha_jax import accounting
from mha_jax import attention
from mha_jax.harness.claims import measure
from mha_jax.errors import UserError


def _r(x, nd: int = 4):
  return np.round(np.asarray(x, np.float64), nd).tolist()


def page_data(ctx: measure.Context, *, pruning_workdir: str | None = None,
              pruned: str | None = None, text_workdir: str | None = None) -> dict:
  """The page's JSON. pruning_workdir: a translation run with a prune result (`pruned`,
  default the claims run's or the quickstart's, see find_pruned) for Voita's figure;
  default the claims run's quickstart workdir when it pruned one. text_workdir: the
  two-layer natural-text model (configs/attn_only_text.py) for its circuit; without
  one that section says so."""
  params, x, r, names = measure.sentence_layer()
  w = np.asarray(r.weights)[0]                                       # (H, T, S)
  heads = np.asarray(r.heads)[0]                                     # (T, H, K)
  wo = np.asarray(params["wo"])
  data = {"sentence": list(measure.SENTENCE), "head_names": names, "weights": _r(w),
          "head_outputs": _r(heads), "signal": measure.SIGNAL}
  mix = measure.mixture_curve()
  grid = np.linspace(0, 1, 21)
  rows_by_query = []
  for q in range(len(measure.SENTENCE)):
    rows_by_query.append(_r(measure.mixture_curve(q, grid)["rows"]))
  data["mixture"] = {"ratios": _r(mix["ratios"]), "peak": _r(mix["peak"]),
                     "rows_by_query": rows_by_query}
  d = 8
  cuts = {}
  xq = jax.random.normal(jax.random.PRNGKey(3), (d,))
  wq = measure.init_params(jax.random.PRNGKey(1), d, 1)["wq"]
  for h in (1, 2, 4, 8):
    shapes = attention.param_shapes(d, h, d // h)
    cuts[str(h)] = {"d_k": d // h, "shapes": {k: list(v) for k, v in shapes.items()},
                    "params": accounting.attention_params(d, h),
                    "reads": _r(measure.q_jacobian({"wq": wq.reshape(d, h, d // h)}, xq) > 0, 0)}               # (D, H)
  data["cuts"] = {"d_model": d, "by_h": cuts}
  data["divisor"] = _r_tree(ctx.cache.get("divisor_curves") or measure.divisor_curves())
  slider = measure.wo_slider(heads[4], wo, head=0)
  data["wo"] = {"token": measure.SENTENCE[4], "trained": ctx.cache.get("wo_slider") is not None,
                "sentence": _r_tree(slider)}
  if ctx.cache.get("wo_slider"):
    data["wo"]["trained_layer"] = _r_tree(ctx.cache["wo_slider"])
  cost = ctx.cache.get("cost_table")
  if cost is None:                                    # formulas + pytrees, no compile
    hs = list(measure.COST_HEADS)
    cost = {"d_model": 768, "seq_len": 256, "heads": hs,
            "params": [accounting.attention_params(768, h) for h in hs],
            "flops_xla": None,
            "flops_formula": accounting.attention_flops(768, 256)["total"],
            "score_bytes": [accounting.score_memory_bytes(1, h, 256) for h in hs]}
  data["cost"] = _r_tree(cost)
  if ctx.cache.get("compromise_example") is not None:
    data["compromise"] = _r_tree(ctx.cache["compromise_example"])
  dk1 = ctx.cache.get("dk1_example")
  if dk1 is not None:
    data["dk1"] = _r_tree(dk1)
  data["matrices"] = four_matrices(measure.init_params(jax.random.PRNGKey(0), 8, len(names)))
  if "seven_lines_zoo" not in ctx.cache:
    ctx.cache["seven_lines_zoo"] = seven_lines_zoo()
  data["seven_lines"] = {"code": seven_lines_code(), "rows": ctx.cache["seven_lines_zoo"]}
  wd = pruning_workdir or ctx.workdir
  found = find_pruned(ctx, wd, pruned) if wd else None
  if pruning_workdir and not found:
    raise UserError(f"--pruning-workdir {pruning_workdir!r} has no prune result (its "
                    f"pruned_l0/, or give --pruned DIR)")
  if found:
    data["pruning"] = _r_tree(pruning_grid(wd, found))
  if text_workdir:
    data["text_circuit"] = _r_tree(text_circuit(text_workdir))
  return data


# ---------------------------------------------------------------- the four matrices


def four_matrices(params, cuts=(1, 2, 4, 8)) -> dict:
  """W_Q, W_K, W_V (stored (D, H, K)) and W_O (stored (H, K, D)) of one layer as the
  D x D matrices they are: a reshape, no copy of numbers. Head h owns columns
  h K .. (h + 1) K - 1 of W_Q, W_K, W_V and the same rows of W_O; `cuts` gives the
  block width d_k = D / h the same numbers would have with h heads."""
  d, h, k = (int(n) for n in params["wq"].shape)
  if h * k != d or tuple(params["wo"].shape) != (h, k, d):
    raise ValueError(f"params must be one standard layer (wq (D, H, D/H), wo (H, D/H, D));"
                     f" got wq {tuple(params['wq'].shape)}, wo {tuple(params['wo'].shape)}")
  mats = {f"W_{n.upper()}": np.asarray(params[f"w{n}"]).reshape(d, d) for n in "qkv"}
  mats["W_O"] = np.asarray(params["wo"]).reshape(d, d)
  return {"d_model": d, "heads": h, "d_k": k,
          "stored": {n: list(params[n].shape) for n in ("wq", "wk", "wv", "wo")},
          "matrices": {n: _r(m, 3) for n, m in mats.items()},
          "cuts": {str(c): d // c for c in cuts if d % c == 0}}


# ---------------------------------------------------------------- the seven lines


def seven_lines_code() -> list[str]:
  """The seven lines as attention.py's docstring writes them (the function runs them)."""
  return [ln.strip() for ln in attention.__doc__.splitlines()
          if re.match(r"\s+\w+_B\w+ = ", ln)]


def seven_lines_zoo(seq_len: int = 4, entries=accounting.ZOO) -> list[dict]:
  """The attention function, unchanged, at each zoo width on a (1, seq_len, D) input:
  the output's shape, the parameters' count and XLA's FLOPs of the compiled program
  that ran, beside accounting's formulas. The weights are zeros (the shapes are the
  point; drawing GPT-3's 0.6 G random numbers would take longer than running it)."""
  rows, rng = [], np.random.default_rng(0)
  fn = jax.jit(lambda p, x: attention.multi_head_attention(p, x, causal=True, impl="reference"))
  for e in entries:
    d, h, g, k = e.d_model, e.num_heads, e.kv_heads, e.head_dim
    wq = jnp.zeros((d, h, k), jnp.float32)
    kv = wq if g == h else jnp.zeros((d, g, k), jnp.float32)
    p = {"wq": wq, "wk": kv, "wv": kv, "wo": jnp.zeros((h, k, d), jnp.float32)}
    x = jnp.asarray(rng.standard_normal((1, seq_len, d)), jnp.float32)
    compiled = fn.lower(p, x).compile()
    y = jax.block_until_ready(compiled(p, x))
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    rows.append({"model": e.name, "d_model": d, "heads": h, "kv_heads": g, "d_k": k,
                 "stored": {n: list(a.shape) for n, a in p.items()},
                 "input_shape": list(x.shape), "output_shape": list(y.shape),
                 "params": int(sum(a.size for a in p.values())),
                 "params_formula": accounting.attention_params(d, h, num_kv_heads=g),
                 "flops": float(cost["flops"]),
                 "flops_formula": accounting.attention_flops(
                     d, seq_len, num_heads=h, num_kv_heads=g)["total"]})
    del p, wq, kv, y
  return rows


# ---------------------------------------------------------------- Voita's pruning figure


def find_pruned(ctx: measure.Context, workdir: str, pruned: str | None = None) -> str | None:
  """The prune result for `workdir`: `pruned` when given (it must hold pruning.json or
  curve.json), else the claims run's (work/pruned/toy[/seed_0]_keep10) when it pruned
  this workdir,
  else the quickstart's own (workdir/pruned_l0); None when there is none."""
  if pruned is not None:
    if not any(storage.exists(storage.join(pruned, f)) for f in ("pruning.json",
                                                                    "curve.json")):
      raise UserError(f"--pruned {pruned!r} has no pruning.json or curve.json (write one "
                      f"with mha-jax prune or prune-curve)")
    return pruned
  ours = [storage.join(ctx.work, "pruned", f"toy{s}_keep10") for s in ("", "/seed_0")]
  for cand in (*ours, storage.join(workdir, "pruned_l0")):
    f = storage.join(cand, "pruning.json")
    if storage.exists(f) and storage.abspath(storage.read_json(f).get("source", "")) == \
        storage.abspath(workdir):
      return cand
  return None


def _roles(workdir: str) -> dict:
  from mha_jax.roles import head_roles
  path = storage.join(workdir, "analysis", "heads.json")
  if storage.exists(path):
    return head_roles.role_of(storage.read_json(path))
  from mha_jax.loader import load
  return head_roles.role_of(head_roles.saved_or_head_roles(load(workdir), "test",
                                                   log=lambda m: None))


def pruning_grid(workdir: str, pruned: str, *, stack: str = "encoder", method: str = "l0",
                 keep: int = 10) -> dict:
  """Voita's figure from a translation run: each head of `stack` with its role (the
  run's analysis/heads.json, as `analyze` wrote it, or computed now), whether it was
  kept (with L0 gates, the kept listed strongest gate first), and when it was removed
  (1 = first).

  pruned: a `mha-jax prune` folder (pruning.json: its kept heads; with L0 gates the
  removal order is the gates' log_alpha, lowest first, as the top-K mask keeps the
  highest) or a `prune-curve` folder (curve.json: `method`'s kept heads at each count;
  kept = those at `keep`, a head's rank = the step of the curve at which it left)."""
  roles = _roles(workdir)
  names = [n for n in roles if n.startswith(stack + ".")]
  if not names:
    raise UserError(f"--workdir {workdir!r} has no {stack} heads with roles")
  layers = 1 + max(int(n.split(".")[1]) for n in names)
  heads = 1 + max(int(n.split(".")[2]) for n in names)
  rank: dict[str, int] = {}
  if storage.exists(storage.join(pruned, "pruning.json")):
    info = storage.read_json(storage.join(pruned, "pruning.json"))
    kept = [n for n in info["kept_heads"] if n.startswith(stack + ".")]
    la = info.get("log_alpha", {}).get(stack)
    if la is not None:
      gates = {f"{stack}.{l}.{h}": v for l, row in enumerate(la) for h, v in enumerate(row)}
      gone = sorted((v, n) for n, v in gates.items() if n not in kept)
      rank = {n: i + 1 for i, (_, n) in enumerate(gone)}
      kept = sorted(kept, key=lambda n: -gates[n])         # the strongest gate first
    how = info.get("method", "?")
    bleu = (info.get("base", {}).get("bleu"), info.get("after", {}).get("bleu"))
  else:
    curve = storage.read_json(storage.join(pruned, "curve.json"))
    rows = sorted((r for r in curve["rows"] if r["method"] == method),
                  key=lambda r: -r["kept"])
    at = [r for r in rows if r["kept"] == keep]
    if not at:
      raise UserError(f"curve.json has no {method} row keeping {keep} heads; counts: "
                      f"{[r['kept'] for r in rows]}")
    kept = [n for n in at[0]["kept_heads"] if n.startswith(stack + ".")]
    prev, step = set(names), 0
    for r in (r for r in rows if r["kept"] >= keep):
      now = set(r["kept_heads"])
      step += bool(prev - now)
      for n in prev - now:
        rank[n] = step
      prev = now
    how = method
    bleu = (None, at[0].get("bleu"))
  spec = ("positional", "syntactic", "rare")
  share = lambda hs: sum(roles.get(n) in spec for n in hs) / max(len(hs), 1)  # noqa: E731
  order = sorted(rank, key=lambda n: (rank[n], n))
  counts = lambda hs: {r: sum(roles.get(n) == r for n in hs)  # noqa: E731
                       for r in sorted({roles.get(n, "other") for n in names})}
  from mha_jax.roles import role_scores as roles_lib
  return {"workdir": workdir, "pruned": pruned, "method": how, "stack": stack,
          "layers": layers, "heads": heads, "roles": {n: roles[n] for n in names},
          "kept": kept, "removed_rank": {n: rank[n] for n in order},
          "colors": roles_lib.ROLE_COLORS, "roles_all": counts(names),
          "roles_kept": counts(kept), "specialised_share_all": share(names),
          "specialised_share_kept": share(kept),
          "first_removed_roles": counts(order[:len(kept)]),
          "bleu_all": bleu[0], "bleu_kept": bleu[1]}


# ---------------------------------------------------------------- the text model's circuit


def text_circuit(workdir: str, *, half_len: int = 8, batch: int = 16, samples: int = 50,
                 seed: int = 7_000_003) -> dict:
  """The natural-text model's previous-token head -> induction head: their scores on
  held-out repeated random tokens (roles.behaviour), their attention patterns on one
  short [BOS] r r sequence, and the K-composition row of the induction head (every
  earlier head, the random baseline subtracted)."""
  from mha_jax.toolkit import capture
  from mha_jax.roles import behaviour
  from mha_jax.toolkit import composition as scores
  from mha_jax.data import repeated_tokens
  from mha_jax.loader import load
  run = load(workdir)
  if not run.task.decoder_only or not run.task.trainable:
    raise UserError(f"--text-workdir {workdir!r} must be an own decoder-only LM (task lm); "
                    f"got task {run.task.name!r}")
  tokens, _ = behaviour.eval_tokens(run, batch)
  sc = behaviour.head_scores(run, tokens)
  layer = lambda n: int(n.split(".")[1])  # noqa: E731
  if max(layer(n) for n in sc) < 1:
    raise UserError(f"--text-workdir {workdir!r} has one layer: no composition")
  prev = max((n for n in sc if layer(n) == 0), key=lambda n: sc[n]["previous_token"])
  ind = max((n for n in sc if layer(n) >= 1), key=lambda n: sc[n]["prefix_matching"])
  il, ih = (int(v) for v in ind.split(".")[1:])
  wq = run.params["lm"][f"layer_{il}"]["attn"]["wq"]
  d, k = int(wq.shape[0]), int(wq.shape[2])
  base = scores.random_baseline("k", d, k, k, samples)
  row = scores.k_composition_partners(run.params, (il, ih), baseline=base)
  seq = repeated_tokens.repeated_tokens(seed, 0, 1, half_len, run.task.vocab_size)
  cap = capture.captured(run.task, run.params, {"tokens": seq})
  ids = seq[0, :-1]
  tok = getattr(run.task, "tokenizer", None)
  labels = [(tok.decode([int(i)]) if tok is not None else "") or f"<{int(i)}>" for i in ids]
  pattern = lambda n: np.asarray(cap["lm"][layer(n)].weights)[0, int(n.split(".")[2])]  # noqa: E731
  vals = sorted(row.values())
  return {"workdir": workdir, "step": int(run.step), "previous_token_head": prev,
          "induction_head": ind, "scores": {n: sc[n] for n in (prev, ind)},
          "previous_token_all": {n: v["previous_token"] for n, v in sc.items()},
          "prefix_matching_all": {n: v["prefix_matching"] for n, v in sc.items()},
          "tokens": labels, "token_ids": [int(i) for i in ids],
          "patterns": {prev: _r(pattern(prev), 3), ind: _r(pattern(ind), 3)},
          "k_composition": row, "k_composition_baseline": base,
          "k_composition_median": float(np.median(vals)),
          "strongest_partner": max(row, key=row.get)}


def _r_tree(x):
  if isinstance(x, dict):
    return {k: _r_tree(v) for k, v in x.items()}
  if isinstance(x, (list, tuple, np.ndarray)):
    return [_r_tree(v) for v in x]
  if isinstance(x, (float, np.floating)):
    return round(float(x), 5)
  if isinstance(x, np.integer):
    return int(x)
  return x


ASSETS = "mha_jax.harness.claims.primer_assets"   # primer.html, .css, .js (package data)


def write(ctx: measure.Context, path: str, **inputs) -> dict:
  """Writes the page to `path`; `inputs` are page_data's (pruning_workdir, pruned,
  text_workdir)."""
  data = page_data(ctx, **inputs)
  storage.write_text(path, assets.page("primer", data, package=ASSETS))
  return data


def standalone(out: str, *, pruning_workdir: str | None = None, pruned: str | None = None,
               text_workdir: str | None = None) -> str:
  """The primer page alone (the claims run writes it with its claims): OUT/primer.html,
  never over an existing one (`mha-jax primer`). Returns its path."""
  storage.makedirs(out)
  path = storage.join(out, "primer.html")
  if storage.exists(path):
    raise UserError(f"--out {out!r} already has primer.html; refusing to overwrite it")
  write(measure.Context(out=out), path, pruning_workdir=pruning_workdir, pruned=pruned,
        text_workdir=text_workdir)
  return path
