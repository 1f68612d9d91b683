"""One small experiment per claim of the seed documents.

Each `claim_*` function takes the run's Context and returns {"numbers": ..., "figures":
[png names]}; the verdict comes from the rule of the same name in `rules.py`. Every
number goes through the project's own code: the attention function and its building
blocks, the models, `mha_jax.load`, the accounting, pruning and circuits modules.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from mha_jax import storage
from mha_jax import accounting
from mha_jax import attention
from mha_jax.harness.claims import toy

# The first seed's sentence and its heads. Partner = the query's dependency partner
# (it -> ran: its verb, one ahead; ate -> cat: its subject, one behind).
SENTENCE = ("the", "cat", "ate", "and", "it", "ran")
PARTNER = (1, 2, 1, 5, 5, 2)
RAREST = 1                    # "cat"
SIGNAL = 4.0                  # score of a head's target key (others 0)
TOY = dict(d_model=32, vocab=16, length=12, steps=250)


TOY_SEEDS = (0, 1, 2)


@dataclasses.dataclass
class Context:
  """Where a `claims` run writes, what it may reuse, and what its claims share. A
  workdir may hold one run or a multi-seed run (seeds.json, seed_<s>/)."""
  out: str
  workdir: str | None = None            # a quickstart workdir (translation, toy setting)
  induction_workdir: str | None = None  # a trained configs/induction.py workdir
  sweep_workdir: str | None = None      # a `mha-jax sweep` workdir (sweep.json)
  text_workdir: str | None = None       # configs/attn_only_text.py (text setting)
  voita_workdir: str | None = None      # translation, sinusoidal positions (voita)
  variants_workdir: str | None = None   # configs/sweep_variants.py, multi-seed points
  toy_seeds: tuple = TOY_SEEDS          # the seeds of what the toy setting trains
  log: Callable[[str], None] = print
  cache: dict = dataclasses.field(default_factory=dict)

  @property
  def work(self) -> str:
    return storage.join(self.out, "work")


def _plt():
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  return plt


def _save(fig, ctx, name) -> str:
  fig.tight_layout()
  storage.savefig(fig, storage.join(ctx.out, name), dpi=110)
  _plt().close(fig)
  return name


# ---------------------------------------------------------------- the seed's heads


def head_patterns() -> dict[str, np.ndarray]:
  """(T, S) score patterns of the four head types on SENTENCE: SIGNAL on the target."""
  t = len(SENTENCE)
  pats = {name: np.zeros((t, t), np.float32)
          for name in ("positional", "syntactic", "rare", "unfocused")}
  for i in range(t):
    pats["positional"][i, max(i - 1, 0)] = SIGNAL
    pats["syntactic"][i, PARTNER[i]] = SIGNAL
    pats["rare"][i, RAREST] = SIGNAL
  return pats


def sentence_layer(seed: int = 0, d_model: int = 8):
  """The four head types as one real layer: params (W_Q = W_K = 0, so each head's
  scores are its pattern, given as the attention function's score bias), token
  vectors x (1, T, D), and the layer's AttentionOutput."""
  pats = head_patterns()
  params = init_params(jax.random.PRNGKey(seed), d_model, len(pats))
  params["wq"] = jnp.zeros_like(params["wq"])
  params["wk"] = jnp.zeros_like(params["wk"])
  x = jax.random.normal(jax.random.PRNGKey(seed + 1), (1, len(SENTENCE), d_model))
  bias = jnp.asarray(np.stack(list(pats.values())))[None]          # (1, H, T, S)
  r = attention.multi_head_attention(params, x, bias=bias, return_weights=True)
  return params, x, r, list(pats)


def mixture_curve(query: int = 4, ratios=None) -> dict:
  """Peak weight of one head whose scores mix the positional and the syntactic pattern,
  (1 - m) positional + m syntactic, at the query, for each mix ratio m."""
  ratios = np.linspace(0, 1, 21) if ratios is None else np.asarray(ratios)
  p = head_patterns()
  s = np.stack([(1 - m) * p["positional"] + m * p["syntactic"] for m in ratios])
  w = np.asarray(attention.attention_weights(jnp.asarray(s)[:, None]))[:, 0]   # (M, T, S)
  return {"ratios": ratios.tolist(), "rows": w[:, query].tolist(),
          "peak": w[:, query].max(-1).tolist()}


# ---------------------------------------------------------------- toy models


def toy_model(ctx: Context, heads: int, seed: int = 0) -> dict:
  key = ("toy", heads, seed)
  if key not in ctx.cache:
    ctx.log(f"  training the two-target toy model, h={heads}, seed {seed} ...")
    ctx.cache[key] = toy.train(heads=heads, seed=seed, **TOY)
  return ctx.cache[key]


def _first_seed(ctx: Context, seed: int) -> bool:
  """The primer's figures and the PNGs show the first seed's models."""
  return seed == ctx.toy_seeds[0]


def claim_one_head_compromises(ctx: Context, seed: int = 0) -> dict:
  runs = {h: toy_model(ctx, h, seed) for h in (1, 2, 4)}
  test = toy.held_out(TOY["vocab"], TOY["length"])
  tw = {h: toy.target_weights(toy.weights(r["params"], test["tokens"]), test["partner"])
        for h, r in runs.items()}
  n = {f"loss_h{h}": r["loss"] for h, r in runs.items()}
  n.update(chance_loss=2 * math.log(TOY["vocab"]),
           h1_weight_previous=float(tw[1]["previous"][0]),
           h1_weight_partner=float(tw[1]["partner"][0]),
           h1_peak=float(tw[1]["peak"][0]),
           h2_best_weight_previous=float(tw[2]["previous"].max()),
           h2_best_weight_partner=float(tw[2]["partner"].max()),
           h4_best_weight_previous=float(tw[4]["previous"].max()),
           h4_best_weight_partner=float(tw[4]["partner"].max()),
           attention_params=[int(sum(x.size for x in jax.tree.leaves(r["params"]["lm"])))
                             for r in runs.values()],
           setup=f"1 attention-only layer, d_model {TOY['d_model']}, V {TOY['vocab']}, "
                 f"T {TOY['length']}, {TOY['steps']} steps, seed {seed}")
  if not _first_seed(ctx, seed):
    return {"numbers": n, "figures": []}
  ctx.cache["compromise_example"] = {
      "tokens": test["tokens"][0].tolist(), "partner": test["partner"][0].tolist(),
      "h1": toy.weights(runs[1]["params"], test["tokens"][:1])[0].tolist(),
      "h2": toy.weights(runs[2]["params"], test["tokens"][:1])[0].tolist(),
      "loss": {str(h): r["loss"] for h, r in runs.items()}}
  plt = _plt()
  fig, ax = plt.subplots(1, 2, figsize=(8, 3))
  ax[0].bar([f"h={h}" for h in runs], [n[f"loss_h{h}"] for h in runs], color="C0")
  ax[0].set_ylabel("held-out loss (both targets, nats)")
  ax[0].set_title("equal parameters", fontsize=9)
  hs = list(runs)
  for i, what in enumerate(("previous", "partner")):
    ax[1].bar(np.arange(3) + 0.35 * i, [float(tw[h][what].max()) for h in hs], 0.35,
              label=f"on {what}")
  ax[1].set_xticks(np.arange(3) + 0.17, [f"h={h}" for h in hs])
  ax[1].set_ylabel("mean weight (best head)")
  ax[1].legend(fontsize=8)
  return {"numbers": n, "figures": [_save(fig, ctx, "one_head_compromises.png")]}


def claim_mixture_dip(ctx: Context) -> dict:
  c = mixture_curve()
  peak = np.asarray(c["peak"])
  r = np.asarray(c["ratios"])
  n = {"peak_at_0": float(peak[0]), "peak_at_half": float(peak[np.argmin(abs(r - 0.5))]),
       "peak_at_1": float(peak[-1]), "argmin_mix": float(r[peak.argmin()]),
       "query": SENTENCE[4], "signal": SIGNAL}
  plt = _plt()
  fig, ax = plt.subplots(figsize=(4.5, 3))
  ax.plot(r, peak, "o-")
  ax.set_xlabel("mix ratio (0 = positional, 1 = syntactic)")
  ax.set_ylabel(f"peak weight at '{SENTENCE[4]}'")
  return {"numbers": n, "figures": [_save(fig, ctx, "mixture_dip.png")]}


def q_jacobian(params, x_1D: jax.Array) -> np.ndarray:
  """|d q_h / d x| summed over each head's d_k outputs: (D, H). q is the attention
  function's projection: split_heads(x @ W_Q viewed as (D, H*K))."""
  d, h, k = params["wq"].shape
  def q(x):
    return attention.split_heads((x @ params["wq"].reshape(d, h * k))[None, None], h)[0, 0]
  jac = jax.jacobian(q)(x_1D)                                     # (H, K, D)
  return np.asarray(jnp.abs(jac).sum(1)).T


def claim_whole_token(ctx: Context, d_model: int = 8) -> dict:
  """W_Q from init_attention_params at h = 1, viewed as (D, h, D / h) for each h: the
  (D, H, K) layout is a reshape of (D, H*K), so every h cuts the same matrix."""
  x = jax.random.normal(jax.random.PRNGKey(3), (d_model,))
  wq = init_params(jax.random.PRNGKey(1), d_model, 1)["wq"]
  share = {}
  for h in [h for h in range(1, d_model + 1) if d_model % h == 0]:
    g = q_jacobian({"wq": wq.reshape(d_model, h, d_model // h)}, x)
    share[str(h)] = float(((g > 1e-9 * g.max()).sum(0) / d_model).min())
  return {"numbers": {"d_model": d_model, "min_share_of_features_read": share},
          "figures": []}


DK_GRID = (1, 2, 4, 8, 16, 32, 64, 128)
DIVISORS = ("1/sqrt(d_k)", "1/sqrt(d_model)", "1")


@jax.jit
def _peak_entropy(q_BTHK, k_BSHK, scale):
  """Mean peak weight and entropy of attention_weights(attention_scores(q, k, scale))."""
  w = attention.attention_weights(attention.attention_scores(q_BTHK, k_BSHK, scale))
  return w.max(-1).mean(), (-(w * jnp.log(jnp.maximum(w, 1e-30))).sum(-1)).mean()


def init_params(key, d_model: int, heads: int) -> dict:
  """init_attention_params, compiled once per shape (eager init is slow on CPU)."""
  return dict(jax.jit(attention.init_attention_params, static_argnums=(1, 2))(key, d_model, heads))


def divisor_curves(d_model: int = 128, keys: int = 16, queries: int = 2048, seed: int = 0,
                   dk_grid=DK_GRID) -> dict:
  """Mean peak weight and entropy of one head whose queries and keys have unit-variance
  components, for each d_k and each divisor (scores by attention_scores, weights by
  attention_weights). Queries and keys are zero beyond their d_k features, so one
  compiled shape serves every d_k with the same dot products."""
  peak = {d: [] for d in DIVISORS}
  ent = {d: [] for d in DIVISORS}
  width = max(dk_grid)
  for dk in dk_grid:
    kq, kk = jax.random.split(jax.random.PRNGKey(seed + dk))
    keep = (jnp.arange(width) < dk).astype(jnp.float32)
    q = jax.random.normal(kq, (queries, 1, 1, width)) * keep
    k = jax.random.normal(kk, (queries, keys, 1, width)) * keep
    for name, scale in zip(DIVISORS, (1 / math.sqrt(dk), 1 / math.sqrt(d_model), 1.0)):
      p, e = _peak_entropy(q, k, jnp.float32(scale))
      peak[name].append(float(p))
      ent[name].append(float(e))
  return {"d_k": list(dk_grid), "d_model": d_model, "keys": keys, "peak": peak,
          "entropy": ent, "uniform_entropy": math.log(keys)}


def claim_divisor(ctx: Context) -> dict:
  c = ctx.cache["divisor_curves"] = divisor_curves()
  plt = _plt()
  fig, ax = plt.subplots(1, 2, figsize=(8, 3))
  for name in DIVISORS:
    ax[0].plot(c["d_k"], c["peak"][name], "o-", label=name)
    ax[1].plot(c["d_k"], c["entropy"][name], "o-", label=name)
  for a, lab in zip(ax, ("mean peak weight", "mean entropy (nats)")):
    a.set_xscale("log", base=2)
    a.set_xlabel("d_k")
    a.set_ylabel(lab)
  ax[1].axhline(c["uniform_entropy"], color="k", lw=0.5)
  ax[0].legend(fontsize=8)
  return {"numbers": c, "figures": [_save(fig, ctx, "divisor.png")]}


REAL_HEADS = (8, 12, 16, 24, 32, 48, 64, 96)


def claim_divisor_real_widths(ctx: Context, d_model: int = 768, t: int = 64) -> dict:
  """At initialisation: unit-variance tokens through init_attention_params and the
  attention function. Dividing by sqrt(d_model) instead of sqrt(d_k) is the same as
  scaling W_Q by sqrt(d_k / d_model) (a param edit, not another attention)."""
  x = jax.random.normal(jax.random.PRNGKey(0), (1, t, d_model))
  ent = {d: [] for d in DIVISORS[:2]}
  peak = {d: [] for d in DIVISORS[:2]}
  fn = jax.jit(lambda p, x: attention.multi_head_attention(p, x, causal=True,
                                                   return_weights=True).weights)
  for h in REAL_HEADS:
    p = init_params(jax.random.PRNGKey(h), d_model, h)
    for name, f in zip(DIVISORS[:2], (1.0, math.sqrt((d_model // h) / d_model))):
      w = fn({**p, "wq": p["wq"] * f}, x)[0, :, t // 2:]     # queries with >= 64 keys
      ent[name].append(float((-(w * jnp.log(jnp.maximum(w, 1e-30))).sum(-1)).mean()))
      peak[name].append(float(w.max(-1).mean()))
  n = {"d_model": d_model, "heads": list(REAL_HEADS), "entropy": ent, "peak": peak,
       "queries": f"positions {t // 2}..{t - 1} of {t} (causal)"}
  plt = _plt()
  fig, ax = plt.subplots(figsize=(4.5, 3))
  for name in ent:
    ax.plot(REAL_HEADS, ent[name], "o-", label=name)
  ax.set_xscale("log", base=2)
  ax.set_xlabel("h at d_model 768")
  ax.set_ylabel("mean entropy at init (nats)")
  ax.legend(fontsize=8)
  return {"numbers": n, "figures": [_save(fig, ctx, "divisor_real_widths.png")]}


COST_HEADS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96)


def _xla_flops(fn, *args) -> float:
  cost = jax.jit(fn).lower(*args).compile().cost_analysis()
  if isinstance(cost, (list, tuple)):
    cost = cost[0]
  return float(cost["flops"])


def cost_table(d_model: int = 768, seq_len: int = 256, heads=COST_HEADS) -> dict:
  """Params from the pytrees, FLOPs from XLA's cost analysis of the attention function,
  score bytes from the shape of its weights, against accounting's formulas."""
  x = jax.ShapeDtypeStruct((1, seq_len, d_model), jnp.float32)
  params, flops, mem = [], [], []
  for h in heads:
    p = jax.eval_shape(lambda k: attention.init_attention_params(k, d_model, h),
                       jax.random.PRNGKey(0))
    params.append(int(sum(int(np.prod(a.shape)) for a in jax.tree.leaves(p))))
    flops.append(_xla_flops(lambda p, x: attention.multi_head_attention(p, x, impl="reference"),
                            p, x))
    w = jax.eval_shape(lambda p, x: attention.multi_head_attention(p, x, return_weights=True)
                       .weights, p, x)
    mem.append(int(np.prod(w.shape)) * jnp.dtype(w.dtype).itemsize)
  return {"d_model": d_model, "seq_len": seq_len, "heads": list(heads), "params": params,
          "params_formula": accounting.attention_params(d_model, 1),
          "flops_xla": flops,
          "flops_formula": accounting.attention_flops(d_model, seq_len)["total"],
          "score_bytes": mem,
          "score_bytes_formula": [accounting.score_memory_bytes(1, h, seq_len)
                                  for h in heads]}


def claim_cost(ctx: Context) -> dict:
  n = cost_table()
  ctx.cache["cost_table"] = n
  gpt2 = next(r for r in accounting.zoo_rows() if r["d_model"] == 768)
  # GPT-2 small's published attention weights per layer: c_attn 768 x 2304 plus
  # c_proj 768 x 768 (biases 2304 + 768 besides).
  n.update(gpt2_small_params=gpt2["params"], gpt2_small_published=768 * 2304 + 768 * 768,
           gpt2_small_params_with_bias=accounting.attention_params(768, 12, use_bias=True),
           gpt2_small_published_with_bias=768 * 2304 + 768 * 768 + 2304 + 768,
           gpt2_small_gflops_t2048=gpt2["gflops"])
  plt = _plt()
  fig, ax = plt.subplots(1, 2, figsize=(8, 3))
  hs = n["heads"]
  ax[0].plot(hs, np.asarray(n["params"]) / 1e6, "o-", label="params (M)")
  ax[0].plot(hs, np.asarray(n["flops_xla"]) / 1e9, "s-", label="XLA GFLOP")
  ax[0].axhline(n["flops_formula"] / 1e9, color="k", lw=0.5)
  ax[1].plot(hs, np.asarray(n["score_bytes"]) / 2**20, "o-", color="C3")
  ax[1].set_ylabel(f"score MiB (T={n['seq_len']})")
  for a in ax:
    a.set_xscale("log", base=2)
    a.set_xlabel("h at d_model 768")
  ax[0].legend(fontsize=8)
  return {"numbers": n, "figures": [_save(fig, ctx, "cost.png")]}


SWEEP_HEADS = (1, 2, 4, 8, 16, 32)


def dk1_argmax_share(params, tokens) -> float:
  """Share of (sequence, head, query) rows of a d_k=1 layer whose argmax weight is on the
  largest (q > 0) or smallest (q < 0) scalar key among the keys it may see. The layer's
  input is the model's x0 (circuits.paths), its weights the model's capture."""
  from mha_jax.circuits import paths
  w = toy.weights(params, tokens)                                     # (B, H, T, T)
  x0 = paths.residual_input(params, np.asarray(tokens), pos_in_residual=True)    # (B, T, D)
  attn = params["lm"]["layer_0"]["attn"]
  q = np.einsum("btd,dh->bht", x0, np.asarray(attn["wq"], np.float64)[..., 0])
  k = np.einsum("btd,dh->bht", x0, np.asarray(attn["wk"], np.float64)[..., 0])
  b, h, t, _ = w.shape
  hits = total = 0
  for i in range(1, t):
    top = w[:, :, i, :i + 1].argmax(-1)
    ext = np.where(q[:, :, i] > 0, k[:, :, :i + 1].argmax(-1), k[:, :, :i + 1].argmin(-1))
    hits += int((top == ext).sum())
    total += top.size
  return hits / total


def dk1_example(params, tokens_1T, share, loss_by_h, head: int = 0) -> dict:
  """One sequence, one head of the d_k=1 model: scalar keys, queries, weights."""
  from mha_jax.circuits import paths
  w = toy.weights(params, tokens_1T)[0, head]
  x0 = paths.residual_input(params, np.asarray(tokens_1T), pos_in_residual=True)[0]
  attn = params["lm"]["layer_0"]["attn"]
  return {"keys": (x0 @ np.asarray(attn["wk"], np.float64)[:, head, 0]).tolist(),
          "queries": (x0 @ np.asarray(attn["wq"], np.float64)[:, head, 0]).tolist(),
          "weights": w.tolist(), "share": share, "loss_by_h": loss_by_h,
          "d_model": int(attn["wq"].shape[0])}


def claim_dk1(ctx: Context, seed: int = 0) -> dict:
  runs = {h: toy_model(ctx, h, seed) for h in SWEEP_HEADS}
  test = toy.held_out(TOY["vocab"], TOY["length"])
  d = TOY["d_model"]
  share = dk1_argmax_share(runs[d]["params"], test["tokens"])
  if _first_seed(ctx, seed):
    ctx.cache["dk1_example"] = dk1_example(runs[d]["params"], test["tokens"][:1], share,
                                           {str(h): r["loss"] for h, r in runs.items()})
  n = {"d_model": d, "argmax_at_extreme_share": share,
       "sweep": "the two-target toy task (one layer, equal params), h = " +
                ",".join(map(str, SWEEP_HEADS)),
       "loss_by_h": {str(h): r["loss"] for h, r in runs.items()},
       "loss_dk1": runs[d]["loss"], "best_loss": min(r["loss"] for r in runs.values())}
  if ctx.sweep_workdir:             # a real `mha-jax sweep` run: its loss at d_k = 1
    rows = storage.read_json(storage.join(ctx.sweep_workdir, "sweep.json"))
    n["translation_sweep"] = [{k: r[k] for k in ("heads", "d_k", "valid_loss",
                                                 "valid_bleu")} for r in rows]
    done = [r for r in rows if r["valid_loss"] is not None]
    if any(r["d_k"] == 1 for r in done):
      n["sweep"] = f"`mha-jax sweep` in {ctx.sweep_workdir}"
      n["loss_dk1"] = next(r["valid_loss"] for r in done if r["d_k"] == 1)
      n["best_loss"] = min(r["valid_loss"] for r in done)
  if not _first_seed(ctx, seed):
    return {"numbers": n, "figures": []}
  plt = _plt()
  fig, ax = plt.subplots(figsize=(4.5, 3))
  ax.plot(list(runs), [r["loss"] for r in runs.values()], "o-")
  ax.set_xscale("log", base=2)
  ax.set_xticks(list(runs), [f"{h}\n(d_k={d // h})" for h in runs], fontsize=7)
  ax.set_ylabel("held-out loss")
  ax.set_xlabel("h (toy task, d_model 32)")
  return {"numbers": n, "figures": [_save(fig, ctx, "dk1_sweep.png")]}


def wo_outside_share(heads_BTHK: np.ndarray, wo_HKD: np.ndarray) -> np.ndarray:
  """(H,) share of each head's contribution heads_h @ W_O[h] (its squared norm) that
  lands outside the head's own slot [h K, (h+1) K) of the output."""
  hd, k, d = wo_HKD.shape
  out = []
  for h in range(hd):
    c = np.asarray(heads_BTHK)[:, :, h] @ np.asarray(wo_HKD)[h]          # (B, T, D)
    own = np.zeros(d, bool)
    own[h * k:(h + 1) * k] = True
    tot = (c ** 2).sum()
    out.append(float((c[..., ~own] ** 2).sum() / tot) if tot > 0 else 0.0)
  return np.asarray(out)


def wo_slider(heads_TK: np.ndarray, wo_HKD: np.ndarray, head: int = 0,
              alphas=None) -> dict:
  """W_O(a) = its block-diagonal part + a x the rest: the output y (D,) of one token
  and the share of `head`'s slot that comes from the other heads, per a."""
  alphas = np.linspace(0, 1, 11) if alphas is None else np.asarray(alphas)
  hd, k, d = wo_HKD.shape
  block = np.zeros_like(wo_HKD)
  for h in range(hd):
    block[h, :, h * k:(h + 1) * k] = wo_HKD[h, :, h * k:(h + 1) * k]
  rest = wo_HKD - block
  ys, shares = [], []
  for a in alphas:
    w = block + a * rest
    per = np.einsum("hk,hkd->hd", heads_TK, w)                 # each head's share of y
    slot = slice(head * k, (head + 1) * k)
    own = np.abs(per[head, slot]).sum()
    other = np.abs(np.delete(per, head, 0)[:, slot]).sum()
    ys.append(per.tolist())
    shares.append(float(other / (own + other)) if own + other > 0 else 0.0)
  return {"alphas": alphas.tolist(), "per_head": ys, "other_share": shares,
          "head": head, "d_k": k}


def claim_wo_mixes(ctx: Context, seed: int = 0) -> dict:
  r = toy_model(ctx, 4, seed)
  test = toy.held_out(TOY["vocab"], TOY["length"])
  from mha_jax.models import lm as lm_model
  _, cap = lm_model.apply(r["params"], toy.spec(), jnp.asarray(test["tokens"]),
                          capture=True)
  heads = np.asarray(cap["lm"][0].heads)
  wo = np.asarray(r["params"]["lm"]["layer_0"]["attn"]["wo"])
  share = wo_outside_share(heads, wo)
  s = wo_slider(heads[0, -1], wo)
  n = {"model": f"the trained two-target toy layer (h=4, d_model {TOY['d_model']})",
       "share_outside_slot": share.tolist(), "mean_share_outside_slot": float(share.mean()),
       "block_diagonal_would_give": 0.0,
       "slider_other_share": dict(zip([f"{a:.1f}" for a in s["alphas"]],
                                      s["other_share"]))}
  if not _first_seed(ctx, seed):
    return {"numbers": n, "figures": []}
  ctx.cache["wo_slider"] = s
  plt = _plt()
  fig, ax = plt.subplots(figsize=(4.5, 3))
  ax.plot(s["alphas"], s["other_share"], "o-")
  ax.set_xlabel("W_O mixing (0 = block-diagonal, 1 = trained W_O)")
  ax.set_ylabel("share of head 0's slot from other heads")
  return {"numbers": n, "figures": [_save(fig, ctx, "wo_mixing.png")]}


def claim_worked_example(ctx: Context) -> dict:
  """The QKV seed's toy sentence through the building blocks (B = H = 1, K = 3)."""
  q = jnp.asarray([[[[1.0, 0.0, 2.0]]]])                          # (1, 1, 1, 3)
  k = jnp.asarray([[2.0, 1.0, 1.0], [0.0, 3.0, 0.0], [1.0, 1.0, 1.0]])[None, :, None]
  v = jnp.asarray([[2.0, 5.0, 1.0], [0.0, 1.0, 3.0], [4.0, 0.0, 2.0]])[None, :, None]
  s = attention.attention_scores(q, k, scale=1.0)                          # (1, 1, 1, 3)
  w = s / s.sum(-1, keepdims=True)              # the article's plain division
  out = attention.mix_values(w, v)[0, 0, 0]
  w_soft = attention.attention_weights(s)
  out_soft = attention.mix_values(w_soft, v)[0, 0, 0]
  llama = {f"{e.d_model}/{e.num_heads}": e.head_dim for e in accounting.ZOO
           if e.name.startswith(("LLaMA", "Transformer-base"))}
  n = {"scores": np.asarray(s).ravel().tolist(), "scores_expected": [4.0, 0.0, 3.0],
       "weights": np.asarray(w).ravel().tolist(), "weights_expected": [4 / 7, 0.0, 3 / 7],
       "output": np.asarray(out).tolist(),
       "output_expected": [20 / 7, 20 / 7, 10 / 7],
       "seed_prints": [2.86, 2.85, 1.43],
       "softmax_weights": np.asarray(w_soft).ravel().tolist(),
       "softmax_output": np.asarray(out_soft).tolist(), "d_k_of_widths": llama}
  return {"numbers": n, "figures": []}
