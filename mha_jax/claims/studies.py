"""Claims measured on trained workdirs: pruning (the quickstart translation model) and
circuits (the two-layer induction model). Both start from `mha_jax.load` and reuse the
pruning, analysis and circuits modules; a workdir is trained here only when none is
given."""

from __future__ import annotations


import numpy as np

from mha_jax import storage
from mha_jax.errors import UserError
from mha_jax.claims.experiments import Context

SPECIALISED = ("positional", "syntactic", "rare")


# ---------------------------------------------------------------- pruning


def quickstart_workdir(ctx: Context) -> str:
  if ctx.workdir:
    return ctx.workdir
  wd = storage.join(ctx.work, "quickstart")
  from mha_jax import quickstart
  from mha_jax.train import checkpoint as ckpt_lib
  done = False
  if storage.isdir(storage.join(wd, "checkpoints")):
    c = ckpt_lib.Checkpoints(wd, read_only=True)
    done = bool(c.all_steps())
    c.close()
  if not done or not storage.exists(storage.join(wd, "quickstart.json")):
    ctx.log(f"  training the quickstart model in {wd} (no --workdir given) ...")
    quickstart.run(wd, log=lambda s: None, analyze=False, prune=False)
  ctx.workdir = wd
  return wd


def claim_pruning(ctx: Context, keep: int = 10, last: int = 3) -> dict:
  from mha_jax.loader import load
  from mha_jax.pruning import run as prune_run
  wd = quickstart_workdir(ctx)
  run = load(wd)
  if run.task.role_family != "translation":
    raise UserError(f"--workdir {wd!r} is not a translation (quickstart) run")
  from mha_jax.analysis import report
  roles = report.role_of(report.saved_or_head_roles(run, "test", log=lambda m: None))
  out = storage.join(ctx.work, f"pruned_keep{keep}")
  if storage.exists(storage.join(out, "pruning.json")):       # reuse, never overwrite
    info = storage.read_json(storage.join(out, "pruning.json"))
  else:
    ctx.log(f"  pruning to {keep} encoder heads with L0 gates ...")
    qs = storage.join(wd, "quickstart.json")
    base = None
    if storage.exists(qs):
      base = storage.read_json(qs).get("test")
    info = prune_run.prune(wd, out, method="l0", lam=0.05, keep=keep, steps=100,
                           log=lambda s: None, loaded=run, base=base)
    info = storage.read_json(storage.join(out, "pruning.json"))
  la = info["log_alpha"]["encoder"]
  ranked = sorted(((v, f"encoder.{l}.{h}") for l, row in enumerate(la)
                   for h, v in enumerate(row)), reverse=True)
  last_heads = [name for _, name in ranked[:last]]
  enc = [h for h in roles if h.startswith("encoder.")]
  spec_all = sum(roles[h] in SPECIALISED for h in enc) / len(enc)
  kept = info["kept_heads"]
  spec_kept = sum(roles.get(h) in SPECIALISED for h in kept) / max(len(kept), 1)
  counts = {}
  for h in kept:
    counts[roles.get(h, "other")] = counts.get(roles.get(h, "other"), 0) + 1
  n = {"workdir": wd, "encoder_heads": len(enc), "kept": len(kept), "kept_heads": kept,
       "kept_roles": counts, "bleu_all": info["base"]["bleu"],
       "bleu_kept": info["after"]["bleu"], "specialised_share_all": spec_all,
       "specialised_share_kept": spec_kept, "last_heads": last_heads,
       "last_heads_roles": [roles.get(h, "other") for h in last_heads]}
  return {"numbers": n, "figures": []}


# ---------------------------------------------------------------- circuits


def induction_workdir(ctx: Context) -> str:
  if ctx.induction_workdir:
    return ctx.induction_workdir
  wd = storage.join(ctx.work, "induction")
  from mha_jax import config as mc
  from mha_jax.train import loop
  cfg = mc.load_config("configs/induction.py")
  mc.apply_overrides(cfg, ["--config.train.progress=false"])
  ctx.log(f"  training the induction model in {wd} (no --induction-workdir given) ...")
  loop.train(cfg, wd, log=lambda s: None)     # resumes or returns at once if finished
  ctx.induction_workdir = wd
  return wd


def circuits_result(ctx: Context) -> dict:
  if "circuits" not in ctx.cache:
    from mha_jax.circuits import report
    from mha_jax.loader import load
    wd = induction_workdir(ctx)
    ctx.log("  circuits analysis ...")
    res = report.circuits(wd, storage.join(ctx.out, "circuits"), track=False,
                          log=lambda s: None)
    run = load(wd)
    ctx.cache["circuits"] = res
    ctx.cache["circuits_run"] = run
  return ctx.cache["circuits"]


def _layer(name: str) -> int:
  return int(name.split(".")[1])


def best_induction_head(res: dict) -> str:
  later = [n for n in res["heads"] if _layer(n) > 0]
  return max(later, key=lambda n: res["heads"][n]["prefix_matching"])


def claim_induction_k_composition(ctx: Context) -> dict:
  res = circuits_result(ctx)
  heads = res["heads"]
  ind = best_induction_head(res)
  prev = res["previous_token_head"]
  row = {e: v for pair, v in res["composition"]["k"].items()
         for e, l in [pair.split("->")] if l == ind}
  partner = max(row, key=row.get)
  from mha_jax.analysis import capture
  from mha_jax.circuits import behaviour
  run = ctx.cache["circuits_run"]
  tokens, _ = behaviour.eval_tokens(run)
  pl, ph = (int(v) for v in prev.split(".")[1:])
  w = np.asarray(capture.captured(run.task, run.params, {"tokens": tokens})["lm"][pl]
                 .weights)[:, ph]
  by_pos = [float(w[:, t, t - 1].mean()) for t in range(1, w.shape[1])]
  sharp = next((t for t, v in enumerate(by_pos, 1) if v < 0.9), len(by_pos) + 1) - 1
  n = {"workdir": res["workdir"], "induction_head": ind,
       "previous_token_by_position": by_pos, "previous_token_sharp_up_to": sharp,
       "positions": len(by_pos),
       "prefix_matching": heads[ind]["prefix_matching"], "copying": heads[ind]["copying"],
       "previous_token_head": prev, "previous_token_score": heads[prev]["previous_token"],
       "k_partner": partner, "k_partner_score": row[partner],
       "k_row": row, "k_row_median": float(np.median(list(row.values()))),
       "k_composition_matrix": res["composition"]["k"],
       "baseline": res["composition_baseline"]["k"],
       "scores": {h: {k: round(v, 4) for k, v in s.items()} for h, s in heads.items()}}
  figs = []
  for f in ("composition.png", "positivity.png"):
    if storage.exists(storage.join(ctx.out, "circuits", f)):
      figs.append(f"circuits/{f}")
  return {"numbers": n, "figures": figs}


def claim_positivity_corner(ctx: Context) -> dict:
  res = circuits_result(ctx)
  heads = res["heads"]
  corner = [n for n, s in heads.items() if "k_comp_positivity" in s and
            s["ov_positivity"] > 0.5 and s["k_comp_positivity"] > 0.5]
  n = {"previous_token_head": res["previous_token_head"],
       "induction_heads": [r["head"] for r in res["induction_heads"]],
       "corner_heads": corner,
       "positivity": {h: [round(s["ov_positivity"], 3),
                          round(s["k_comp_positivity"], 3)]
                      for h, s in heads.items() if "k_comp_positivity" in s}}
  return {"numbers": n, "figures": ["circuits/positivity.png"]}


def claim_composition_sparse(ctx: Context) -> dict:
  res = circuits_result(ctx)
  vals = np.asarray([v for m in res["composition"].values() for v in m.values()])
  n = {"pairs": int(vals.size), "share_near_baseline": float((np.abs(vals) < 0.05).mean()),
       "max_over_baseline": float(vals.max()),
       "median_abs_over_baseline": float(np.median(np.abs(vals))),
       "baseline": res["composition_baseline"]}
  return {"numbers": n, "figures": ["circuits/composition.png"]}


def claim_term_importance(ctx: Context) -> dict:
  res = circuits_result(ctx)
  rows = res.get("term_importance")
  if not rows:
    raise UserError("term importance needs an attention-only model without LayerNorm "
                     "or biases (configs/induction.py)")
  n = {"loss_direct": rows[0]["loss"], "loss_direct_single": rows[1]["loss"],
       "loss_full": rows[-1]["loss"],
       "path_expansion_max_error": res["path_expansion_max_error"]}
  return {"numbers": n, "figures": []}


def claim_rests_on_first_token(ctx: Context) -> dict:
  from mha_jax.analysis import capture
  from mha_jax.circuits import behaviour
  res = circuits_result(ctx)
  run = ctx.cache["circuits_run"]
  ind = best_induction_head(res)
  layer, head = (int(v) for v in ind.split(".")[1:])
  tokens, _ = behaviour.eval_tokens(run)
  w = np.asarray(capture.captured(run.task, run.params, {"tokens": tokens})["lm"][layer]
                 .weights)[:, head]                                  # (B, T, T)
  x = tokens[:, :-1]
  on_bos, elsewhere = [], []
  for b in range(x.shape[0]):
    seen = set()
    for t in range(1, x.shape[1]):
      if x[b, t] not in seen:
        on_bos.append(w[b, t, 0])
        elsewhere.append(w[b, t, 1:t + 1].max())
      seen.add(int(x[b, t]))
  n = {"induction_head": ind, "positions": len(on_bos),
       "weight_on_bos": float(np.mean(on_bos)),
       "max_weight_elsewhere": float(np.mean(elsewhere))}
  return {"numbers": n, "figures": []}
