"""`mha-jax claims`: run the claims' experiments, judge each by its rule, and write
DIR/REPORT.md, DIR/claims.json, one PNG per figure and DIR/primer.html."""

from __future__ import annotations

import time
from typing import Callable, Sequence

from mha_jax import storage
from mha_jax.errors import UserError
from mha_jax.claims import experiments as E
from mha_jax.claims import rules as R
from mha_jax.claims import studies as S

# name: (the claim as the seeds state it, experiment, rule, the numbers shown in the
# report's table; the rest are in claims.json)
CLAIMS = {
    "one_head_compromises": (
        "One head asked for two tokens at once compromises: h=1 loses to h=2, 4 at equal "
        "params, and its weight splits between the targets",
        E.claim_one_head_compromises, R.one_head_compromises,
        ("loss_h1", "loss_h2", "loss_h4", "h1_weight_previous", "h1_weight_partner",
         "h2_best_weight_previous", "h2_best_weight_partner")),
    "mixture_dip": (
        "Mixing a positional and a syntactic score pattern in one head: the peak weight "
        "dips lowest near the 50/50 mix", E.claim_mixture_dip, R.mixture_dip,
        ("peak_at_0", "peak_at_half", "peak_at_1", "argmin_mix")),
    "whole_token": (
        "Every head reads the whole token: its projection uses all d_model inputs",
        E.claim_whole_token, R.whole_token,
        ("min_share_of_features_read",)),
    "divisor": (
        "Each head divides by its own sqrt(d_k): flat with the right divisor, flattening "
        "as d_k shrinks with sqrt(d_model)", E.claim_divisor, R.divisor,
        ("d_k", "peak")),
    "divisor_real_widths": (
        "The same at real widths (d_model 768, h = 8..96) at initialisation",
        E.claim_divisor_real_widths, R.divisor_real_widths,
        ("heads", "entropy")),
    "cost": (
        "Params and FLOPs do not depend on h; the score memory does (d_model 768 = "
        "GPT-2 small)", E.claim_cost, R.cost,
        ("heads", "params", "flops_xla", "flops_formula", "score_bytes",
         "gpt2_small_params", "gpt2_small_published")),
    "dk1": (
        "At d_k = 1 only two directions remain: each query's argmax is the largest or "
        "smallest scalar key; the loss suffers", E.claim_dk1, R.dk1,
        ("argmax_at_extreme_share", "loss_by_h", "loss_dk1", "best_loss")),
    "wo_mixes": (
        "W_O mixes the heads: it is not block-diagonal in a trained layer",
        E.claim_wo_mixes, R.wo_mixes,
        ("share_outside_slot", "mean_share_outside_slot", "slider_other_share")),
    "pruning": (
        "Specialised heads survive pruning: keeping 10 of 48 encoder heads costs little "
        "and keeps positional/syntactic/rare heads", S.claim_pruning, R.pruning,
        ("bleu_all", "bleu_kept", "kept", "kept_roles", "specialised_share_all",
         "specialised_share_kept", "last_heads", "last_heads_roles")),
    "worked_example": (
        "The QKV document's worked example: scores (4, 0, 3), weights (4/7, 0, 3/7), "
        "output (20/7, 20/7, 10/7)", E.claim_worked_example, R.worked_example,
        ("scores", "weights", "output", "seed_prints", "softmax_weights", "d_k_of_widths")),
    "induction_k_composition": (
        "Induction heads form by K-composition with a previous-token head",
        S.claim_induction_k_composition, R.induction_k_composition,
        ("previous_token_head", "previous_token_score", "previous_token_sharp_up_to",
         "positions", "induction_head", "prefix_matching", "k_partner",
         "k_partner_score", "k_row", "k_row_median")),
    "positivity_corner": (
        "Induction heads sit alone where OV (copying) and K-composition (matching) "
        "eigenvalue positivity are both positive", S.claim_positivity_corner,
        R.positivity_corner,
        ("induction_heads", "corner_heads", "positivity")),
    "composition_sparse": (
        "Composition is sparse: most composition scores sit near the random baseline",
        S.claim_composition_sparse, R.composition_sparse,
        ("pairs", "share_near_baseline", "max_over_baseline", "median_abs_over_baseline")),
    "term_importance": (
        "Most of the effect is in single-head terms, little in virtual heads",
        S.claim_term_importance, R.term_importance,
        ("loss_direct", "loss_direct_single", "loss_full")),
    "rests_on_first_token": (
        "An induction head rests on the first token when the current token has not "
        "appeared before", S.claim_rests_on_first_token, R.rests_on_first_token,
        ("induction_head", "weight_on_bos", "max_weight_elsewhere")),
}

def parse_only(only: str | Sequence[str] | None) -> list[str]:
  if not only:
    return list(CLAIMS)
  names = [n.strip() for n in (only.split(",") if isinstance(only, str) else only)
           if n.strip()]
  bad = [n for n in names if n not in CLAIMS]
  if bad:
    raise UserError(f"--only: unknown claim {bad[0]!r}; known: {', '.join(CLAIMS)}")
  return names


def run_claims(out: str, *, only=None, workdir: str | None = None,
               induction_workdir: str | None = None, sweep_workdir: str | None = None,
               primer: bool = True, log: Callable[[str], None] = print) -> dict:
  names = parse_only(only)
  for flag, wd in (("--workdir", workdir), ("--induction-workdir", induction_workdir),
                   ("--sweep-workdir", sweep_workdir)):
    if wd is not None and not storage.isdir(wd):
      raise UserError(f"{flag} {wd!r} is not a directory")
  if storage.exists(out) and not storage.isdir(out):
    raise UserError(f"--out {out!r} exists and is not a directory")
  storage.makedirs(out)
  ctx = E.Context(out=out, workdir=workdir, induction_workdir=induction_workdir,
                  sweep_workdir=sweep_workdir, log=log)
  t0 = time.time()
  results = []
  for name in names:
    text, fn, rule, _ = CLAIMS[name]
    log(f"[{name}]")
    t = time.time()
    r = fn(ctx)
    verdict = rule(r["numbers"])
    results.append({"name": name, "claim": text, "numbers": _jsonable(r["numbers"]),
                    "rule": rule.text, "verdict": verdict, "figures": r["figures"],
                    "seconds": round(time.time() - t, 1)})
    log(f"  {verdict}  ({results[-1]['seconds']} s)")
  report = {"claims": results, "seconds": round(time.time() - t0, 1),
            "workdir": ctx.workdir, "induction_workdir": ctx.induction_workdir}
  if primer:
    from mha_jax.claims import primer as P
    P.write(ctx, storage.join(out, "primer.html"))
    report["primer"] = "primer.html"
  report["seconds"] = round(time.time() - t0, 1)
  storage.write_json(storage.join(out, "claims.json"), report)
  storage.write_text(storage.join(out, "REPORT.md"), format_report(report))
  return report


def _jsonable(x):
  import numpy as np
  if isinstance(x, dict):
    return {str(k): _jsonable(v) for k, v in x.items()}
  if isinstance(x, (list, tuple)):
    return [_jsonable(v) for v in x]
  if isinstance(x, (np.floating, np.integer)):
    return x.item()
  if isinstance(x, np.ndarray):
    return x.tolist()
  return x


def _fmt(v) -> str:
  if isinstance(v, float):
    return f"{v:.4g}"
  if isinstance(v, list) and len(v) > 8:
    return "[" + ", ".join(_fmt(x) for x in v[:4]) + ", ..., " + _fmt(v[-1]) + "]"
  if isinstance(v, list):
    return "[" + ", ".join(_fmt(x) for x in v) + "]"
  if isinstance(v, dict):
    return "{" + ", ".join(f"{k}: {_fmt(x)}" for k, x in list(v.items())[:8]) + \
        (", ..." if len(v) > 8 else "") + "}"
  return str(v)


def format_report(report: dict) -> str:
  lines = ["# The seeds' claims, measured", "",
           f"`mha-jax claims`, {report['seconds']:.0f} s. Verdicts are computed from the "
           "numbers by the rule shown; every number is in claims.json.", "",
           "| claim | numbers | rule | verdict |", "|---|---|---|---|"]
  for r in report["claims"]:
    keys = CLAIMS[r["name"]][3] if r["name"] in CLAIMS else tuple(r["numbers"])[:6]
    nums = "; ".join(f"{k} = {_fmt(r['numbers'][k])}" for k in keys if k in r["numbers"])
    nums = nums.replace("|", "/")
    lines.append(f"| **{r['name']}**: {r['claim']} | {nums} | {r['rule']} | "
                 f"**{r['verdict']}** |")
  figs = [(r["name"], f) for r in report["claims"] for f in r["figures"]]
  if figs:
    lines += ["", "## Figures", ""]
    lines += [f"- {name}: ![{f}]({f})" for name, f in figs]
  if report.get("primer"):
    lines += ["", f"Interactive primer: [{report['primer']}]({report['primer']}) "
              "(self-contained, offline)."]
  return "\n".join(lines) + "\n"
