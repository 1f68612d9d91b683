"""The attention variants' papers' claims, measured on runs of the variants setting: a
sweep workdir (configs/sweep_variants.py) whose points VARIANT_hH are multi-seed runs
(`--config.train.seeds=3`), given as `--variants-workdir`. Each claim compares a variant
with softmax at the same h and seed; every number comes from
`roles.head_roles.sink_and_entropy` (first-token share, weight on no key) or, for the
differential map, from the one interventions mechanism reading `attn.pattern` and
`attn.pattern2` and `attention.diff_lambda`."""

from __future__ import annotations

import numpy as np

from mha_jax import storage
from mha_jax.errors import UserError

VARIANT_WINDOWS = 32              # text windows each run's attention is measured on


def uniform_first_token_share(t: int) -> float:
  """The first-token share of causal attention spread evenly: mean over queries 1..T-1
  of 1 / (t + 1), what a head with no sink puts on key 0."""
  return float(np.mean([1.0 / (q + 1) for q in range(1, t)]))


def variant_runs(ctx, setting: str) -> list[tuple[int, dict]]:
  """[(seed, {"h": h, variant: that seed's workdir, ...})] for every h of the variants
  workdir that has a softmax point and every seed of it."""
  from mha_jax.harness.claims.studies import runs_of
  wd = ctx.variants_workdir
  points = {}
  for name in sorted(storage.listdir(wd)):
    variant, _, h = name.rpartition("_h")
    if variant and h.isdigit() and storage.isdir(storage.join(wd, name)):
      points.setdefault(int(h), {})[variant] = runs_of(storage.join(wd, name))
  out = []
  for h, by in sorted(points.items()):
    if "softmax" not in by:
      continue
    for seed, swd in by["softmax"]:
      unit = {"h": h, "softmax": swd}
      for v, runs in by.items():
        same = [w for s, w in runs if s == seed]
        if same:
          unit[v] = same[0]
      out.append((seed, unit))
  if not out:
    raise UserError(f"--variants-workdir {wd!r} has no softmax_hH point (a "
                    f"configs/sweep_variants.py workdir)")
  return out


def attention_facts(ctx, wd: str) -> dict:
  """Mean over heads of the first-token share, the weight on no key (the sink logit's)
  and, for a differential loaded, the first-token share of the effective map pattern -
  lambda_h pattern2; computed once per workdir."""
  key = ("variant_facts", wd)
  if key in ctx.cache:
    return ctx.cache[key]
  from mha_jax.loader import load
  from mha_jax.roles import head_roles
  loaded = load(wd)
  text = head_roles.sink_and_entropy(loaded, "test", windows=VARIANT_WINDOWS)
  mean = lambda k: float(np.mean(np.concatenate([t[k] for t in text.values()])))
  facts = {"variant": loaded.config.model.get("attention", "softmax"),
           "heads": int(loaded.config.model.num_heads),
           "first_token_share": mean("sink_share"), "weight_off_keys": mean("off_keys"),
           "entropy": mean("entropy"),
           "uniform_share": uniform_first_token_share(int(loaded.config.model.max_len))}
  if facts["variant"] == "differential":
    facts["effective_first_token_share"] = differential_first_token_share(loaded)
  ctx.cache[key] = facts
  return facts


def differential_first_token_share(loaded, windows: int = VARIANT_WINDOWS) -> float:
  """Mean over heads and real queries 1.. of the effective map's weight on the first
  token: (pattern - lambda_h pattern2)[..., 0], the sites attn.pattern and
  attn.pattern2 read through interventions.run_with_hook, lambda_h from attention.diff_lambda."""
  import jax
  from mha_jax import attention, interventions
  from mha_jax.roles import role_scores
  task = loaded.task
  layers = [k for k in loaded.params["lm"] if k.startswith("layer_")]
  names = [f"lm.{i}.attn.{s}" for i in range(len(layers)) for s in ("pattern", "pattern2")]
  fwd = jax.jit(lambda p, b: interventions.run_with_hook(lambda hook: task.apply(p, b, hook=hook), read=names)[1])
  lam = [np.asarray(attention.diff_lambda(loaded.params["lm"][f"layer_{i}"]["attn"],
                                  attention.diff_lambda_init(i))) for i in range(len(layers))]
  shares, seen = [], 0
  for batch, weight in task.eval_batches("test", loaded.config.eval.batch_size):
    keep = np.flatnonzero(weight > 0)[:max(windows - seen, 0)]
    got = jax.device_get(fwd(loaded.params, batch))
    for i, lam_H in enumerate(lam):
      eff = got[f"lm.{i}.attn.pattern"] - lam_H[None, :, None, None] * \
          got[f"lm.{i}.attn.pattern2"]                              # (B, H, T, S)
      shares.append((role_scores.first_token_share(eff[keep]), len(keep)))
    seen += len(keep)
    if seen >= windows:
      break
  rows = sum(r for _, r in shares) / len(lam)
  return float(sum(sh.mean() * r for sh, r in shares) / max(rows * len(lam), 1))


def _pair(ctx, unit: dict, variant: str) -> dict:
  if variant not in unit:
    raise UserError(f"--variants-workdir has no {variant}_h{unit['h']} point for this "
                    f"seed (train it with configs/sweep_variants.py:variants=...)")
  s, v = attention_facts(ctx, unit["softmax"]), attention_facts(ctx, unit[variant])
  return {"h": unit["h"], "softmax_first_token_share": s["first_token_share"],
          f"{variant}_first_token_share": v["first_token_share"],
          "uniform_share": s["uniform_share"], "softmax_workdir": unit["softmax"],
          f"{variant}_workdir": unit[variant], "_v": v}


def claim_gating_removes_sink(ctx, setting, seed, unit) -> dict:
  n = _pair(ctx, unit, "gated")
  n.pop("_v")
  n["fold"] = n["softmax_first_token_share"] / max(n["gated_first_token_share"], 1e-12)
  return {"numbers": n, "figures": []}


def claim_differential_less_sink(ctx, setting, seed, unit) -> dict:
  n = _pair(ctx, unit, "differential")
  v = n.pop("_v")
  n["differential_effective_first_token_share"] = v["effective_first_token_share"]
  n["ratio"] = v["effective_first_token_share"] / max(n["softmax_first_token_share"], 1e-12)
  return {"numbers": n, "figures": []}


def claim_sink_takes_first_token(ctx, setting, seed, unit) -> dict:
  n = _pair(ctx, unit, "sink")
  v = n.pop("_v")
  n["sink_logit_weight"] = v["weight_off_keys"]
  return {"numbers": n, "figures": []}
