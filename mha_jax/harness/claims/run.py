"""`mha-jax claims`: run the claims' experiments, judge each by its rule, and write
DIR/REPORT.md, DIR/claims.json, one PNG per figure and DIR/primer.html."""

from __future__ import annotations

import time
from typing import Callable, Sequence

from mha_jax import storage
from mha_jax.errors import UserError
from mha_jax.machine import machine
from mha_jax.harness.claims import measure
from mha_jax.harness.claims import rules
from mha_jax.harness.claims import studies
from mha_jax.harness.claims import variants as variant_claims

SETTINGS = {
    "toy": "the built-in toys: one-layer two-target models (d_model 32), the quickstart "
           "translation model (learned relative position biases), configs/induction.py "
           "(2 attention-only layers x 4 heads, repeated random tokens)",
    "text": "the two-layer attention-only model of natural text (configs/attn_only_text.py"
            ", 12 heads per layer; --text-workdir)",
    "smollm2": "SmolLM2-135M (30 layers, 9 query heads over 3 key/value heads, RMSNorm, "
               "MLPs), imported offline",
    "gemma3": "Gemma 3 270M (18 layers, 4 query heads over 1 key/value head, q/k norms, "
              "MLPs), imported offline",
    "voita": "a translation model with sinusoidal positions, Voita et al.'s setting "
             "(--voita-workdir)",
    "minilm": "all-MiniLM-L6-v2 (6 layers x 12 heads, sentence embeddings), imported "
              "offline",
    "variants": "two-layer attention-only models of natural text (configs/attn_only_text"
                ".py through configs/sweep_variants.py) with softmax, gated, differential "
                "and sink attention at the same h, each over its seeds "
                "(--variants-workdir)",
}
DECODERS = ("toy", "text", "smollm2", "gemma3")


def _at(fn):
  """An experiment of one fixed setup (no seed, no workdir)."""
  return lambda ctx, setting, seed, handle: fn(ctx)


def _seeded(fn):
  """An experiment on the toy setting's trained two-target models, one seed."""
  return lambda ctx, setting, seed, handle: fn(ctx, seed)


# name: (the claim as the seeds state it, experiment, rule, the numbers shown in the
# report's table (the rest are in claims.json), the settings where it applies, where its
# runs come from: None (one fixed setup), "toy_seeds" (the two-target models, one per
# seed), or a function (ctx, setting) -> [(seed, workdir)], and the papers' setting)
CLAIMS = {
    "one_head_compromises": (
        "One head asked for two tokens at once compromises: h=1 loses to h=2, 4 at equal "
        "params, and its weight splits between the targets",
        _seeded(measure.claim_one_head_compromises), rules.one_head_compromises,
        ("loss_h1", "loss_h2", "h1_weight_previous", "h1_weight_partner"), ("toy",),
        "toy_seeds", "the primer's thought experiment"),
    "mixture_dip": (
        "Mixing a positional and a syntactic score pattern in one head: the peak weight "
        "dips lowest near the 50/50 mix", _at(measure.claim_mixture_dip), rules.mixture_dip,
        ("peak_at_0", "peak_at_half", "peak_at_1", "argmin_mix"), ("toy",), None, ""),
    "whole_token": (
        "Every head reads the whole token: its projection uses all d_model inputs",
        _at(measure.claim_whole_token), rules.whole_token,
        ("min_share_of_features_read",), ("toy",), None, ""),
    "divisor": (
        "Each head divides by its own sqrt(d_k): flat with the right divisor, flattening "
        "as d_k shrinks with sqrt(d_model)", _at(measure.claim_divisor), rules.divisor,
        ("d_k", "peak"), ("toy",), None, ""),
    "divisor_real_widths": (
        "The same at real widths (d_model 768, h = 8..96) at initialisation",
        _at(measure.claim_divisor_real_widths), rules.divisor_real_widths,
        ("heads", "entropy"), ("toy",), None, ""),
    "cost": (
        "Params and FLOPs do not depend on h; the score memory does (d_model 768 = "
        "GPT-2 small)", _at(measure.claim_cost), rules.cost,
        ("params", "score_bytes", "gpt2_small_params"), ("toy",), None, ""),
    "dk1": (
        "At d_k = 1 only two directions remain: each query's argmax is the largest or "
        "smallest scalar key; the loss suffers", _seeded(measure.claim_dk1), rules.dk1,
        ("argmax_at_extreme_share", "loss_dk1", "best_loss"), ("toy",), "toy_seeds", ""),
    "wo_mixes": (
        "W_O mixes the heads: it is not block-diagonal in a trained layer",
        _seeded(measure.claim_wo_mixes), rules.wo_mixes,
        ("mean_share_outside_slot",), ("toy",), "toy_seeds", ""),
    "pruning": (
        "Specialised heads survive pruning: keeping 10 of 48 encoder heads costs little "
        "and keeps positional/syntactic/rare heads", studies.claim_pruning, rules.pruning,
        ("bleu_all", "bleu_kept", "specialised_share_all", "specialised_share_kept",
         "last_heads_roles"), ("toy", "voita"), studies.translation_runs,
        "Voita et al. 2019: a 6-layer Transformer-base encoder (48 heads) with sinusoidal "
        "positions on WMT EN-RU; positional, syntactic and rare-token heads are the last "
        "to go"),
    "worked_example": (
        "The QKV document's worked example: scores (4, 0, 3), weights (4/7, 0, 3/7), "
        "output (20/7, 20/7, 10/7)", _at(measure.claim_worked_example), rules.worked_example,
        ("scores", "weights", "output"), ("toy",), None, ""),
    "induction_k_composition": (
        "Induction heads form by K-composition with a previous-token head",
        studies.claim_induction_k_composition, rules.induction_k_composition,
        ("induction_head", "prefix_matching", "k_partner", "k_partner_previous_token",
         "k_partner_score", "k_row_median"), DECODERS, studies.decoder_runs,
        "Elhage et al. 2021, Olsson et al. 2022: two-layer attention-only models with 12 "
        "heads per layer trained on natural text; a previous-token head (>= 0.9 on t-1), "
        "an induction head (prefix matching >= 0.8) K-composing with it"),
    "induction_k_causal": (
        "Causally, the previous-token head moves the induction head's keys more than "
        "the other heads of its layer do", studies.claim_induction_k_causal, rules.induction_k_causal,
        ("induction_head", "previous_token_head", "path_k_effect", "best_other",
         "best_other_effect", "receivers_holding"), DECODERS, studies.decoder_runs,
        "Olsson et al. 2022: the K-composition circuit, judged here by path patching into "
        "the induction head's key input instead of the weights"),
    "positivity_corner": (
        "Induction heads sit alone where OV (copying) and K-composition (matching) "
        "eigenvalue positivity are both positive", studies.claim_positivity_corner,
        rules.positivity_corner, ("induction_heads", "corner_heads", "heads_scored"),
        DECODERS, studies.decoder_runs,
        "Elhage et al. 2021: the two-layer attention-only model of natural text, whose "
        "layer-1 heads other than the induction heads do not copy"),
    "composition_sparse": (
        "Composition is sparse: most composition scores sit near the random baseline",
        studies.claim_composition_sparse, rules.composition_sparse,
        ("pairs", "share_near_baseline", "max_over_baseline"), DECODERS, studies.decoder_runs,
        "Elhage et al. 2021: the two-layer attention-only model of natural text"),
    "term_importance": (
        "Most of the effect is in single-head terms, little in virtual heads",
        studies.claim_term_importance, rules.term_importance,
        ("loss_direct", "loss_direct_single", "loss_full"), ("toy", "text"),
        studies.decoder_runs, "Elhage et al. 2021: the two-layer attention-only model of "
        "natural text (path expansion is exact only without norms and MLPs)"),
    "rests_on_first_token": (
        "An induction head rests on the first token when the current token has not "
        "appeared before", studies.claim_rests_on_first_token, rules.rests_on_first_token,
        ("induction_head", "weight_on_bos", "max_weight_elsewhere"), DECODERS,
        studies.decoder_runs, "Elhage et al. 2021, Olsson et al. 2022"),
    "michel": (
        "Many heads can go: a large share of a trained model's heads can be removed "
        "(Michel's importance order) at little cost", studies.claim_michel, rules.michel,
        ("share_at_0.99", "share_at_0.95"), ("minilm",),
        lambda ctx, setting: [(None, studies.imported_workdir(ctx, setting))],
        "Michel et al. 2019: BERT fine-tuned on MNLI and WMT Transformer-large; 20-40 % "
        "of the heads pruned with a small drop in accuracy / BLEU"),
    "gating_removes_sink": (
        "Gating removes the first-token sink: its share falls at least 5-fold",
        variant_claims.claim_gating_removes_sink, rules.gating_removes_sink,
        ("h", "softmax_first_token_share", "gated_first_token_share", "fold"),
        ("variants",), variant_claims.variant_runs,
        "Qiu et al. 2025 (Gated Attention for LLMs): 1.7B dense and 15B MoE models with "
        "MLPs trained on up to 3.5 T tokens; a sigmoid gate after each head's attention "
        "(elementwise, before W_O) brings the first token's attention share from 46.7 % "
        "to 4.8 %"),
    "differential_less_sink": (
        "Differential attention cancels common-mode attention noise: the effective map "
        "puts less weight on the first token", variant_claims.claim_differential_less_sink,
        rules.differential_less_sink,
        ("h", "softmax_first_token_share", "differential_effective_first_token_share",
         "ratio"), ("variants",), variant_claims.variant_runs,
        "Ye et al. 2025 (Differential Transformer): 3B-13B LMs with MLPs; the difference "
        "of two softmax maps cancels the attention noise spread over irrelevant context "
        "and gives sparser patterns (measured here as the weight on the first token, "
        "which carries no content)"),
    "sink_takes_first_token": (
        "A sink logit takes the weight the first token took", variant_claims.claim_sink_takes_first_token,
        rules.sink_takes_first_token,
        ("h", "softmax_first_token_share", "sink_first_token_share", "sink_logit_weight"),
        ("variants",), variant_claims.variant_runs,
        "gpt-oss (OpenAI 2025) and 'softmax + 1' (Miller 2023); Xiao et al. 2024 "
        "(StreamingLLM): a learned sink absorbs the attention that softmax models dump "
        "on the first token"),
}

NEEDS = {"variants": ("variants_workdir", "--variants-workdir"),
         "text": ("text_workdir", "--text-workdir"),
         "voita": ("voita_workdir", "--voita-workdir")}


def parse_only(only: str | Sequence[str] | None) -> list[str]:
  if not only:
    return list(CLAIMS)
  names = [n.strip() for n in (only.split(",") if isinstance(only, str) else only)
           if n.strip()]
  bad = [n for n in names if n not in CLAIMS]
  if bad:
    raise UserError(f"--only: unknown claim {bad[0]!r}; known: {', '.join(CLAIMS)}")
  return names


def parse_settings(settings: str | Sequence[str] | None, given: Sequence[str] = ()
                   ) -> list[str]:
  """The settings asked for; by default the toy setting and those whose workdir is
  given (`given`): the real LMs (minutes each on 2 cores) only when named."""
  if not settings:
    return [n for n in SETTINGS if n == "toy" or n in given]
  names = [n.strip() for n in (settings.split(",") if isinstance(settings, str)
                               else settings) if n.strip()]
  bad = [n for n in names if n not in SETTINGS]
  if bad or not names:
    raise UserError(f"--settings: unknown setting {(bad or [''])[0]!r}; known: "
                    f"{', '.join(SETTINGS)}")
  return [n for n in SETTINGS if n in names]


def parse_seeds(seeds: str | Sequence[int]) -> tuple[int, ...]:
  try:
    out = tuple(int(s) for s in (seeds.split(",") if isinstance(seeds, str) else seeds))
  except ValueError:
    out = ()
  if not out or min(out) < 0 or len(set(out)) != len(out):
    raise UserError(f"--toy-seeds must list distinct seeds >= 0 (0,1,2); got {seeds!r}")
  return out


def aggregate(units: list[dict], keys: Sequence[str], seeded: bool) -> dict:
  """One setting's cell from its runs' numbers and verdicts: the verdict (with "k of n
  seeds" for trained runs), each verdict's count, and the spread [min, max] of every
  number that is a scalar in every run."""
  verdicts = [u["verdict"] for u in units]
  counts = {v: verdicts.count(v) for v in (rules.HOLDS, rules.FAILS, rules.INCONCLUSIVE)
            if v in verdicts}
  n = len(units)
  if not seeded:
    verdict = verdicts[0] if n == 1 else f"holds in {counts.get(rules.HOLDS, 0)} of {n} runs"
  elif len(counts) == 1:
    verdict = f"{verdicts[0]} in {n} of {n} seed{'s' if n > 1 else ''}"
  else:
    rest = ", ".join(f"{v} in {c}" for v, c in counts.items() if v != rules.HOLDS)
    verdict = f"holds in {counts.get(rules.HOLDS, 0)} of {n} seeds ({rest})"
  spread = {}
  for k in units[0]["numbers"]:
    vals = [u["numbers"].get(k) for u in units]
    if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in vals):
      spread[k] = [min(vals), max(vals)]
  return {"verdict": verdict, "counts": counts, "runs": n, "spread": spread,
          "seeds": [u["seed"] for u in units], "numbers": units[0]["numbers"],
          "per_seed": units, "key_numbers": list(keys)}


def primer_inputs(ctx) -> dict:
  """The primer's Voita figure from the voita setting's first run and the pruning this
  claims run made of it; its circuit from the text setting's first run."""
  inputs = {}
  if ctx.voita_workdir:
    seed, wd = studies.runs_of(ctx.voita_workdir)[0]
    inputs["pruning_workdir"] = wd
    done = storage.join(ctx.work, "pruned", f"{studies.label('voita', seed)}_keep10")
    if storage.exists(storage.join(done, "pruning.json")):
      inputs["pruned"] = done
  if ctx.text_workdir:
    inputs["text_workdir"] = studies.runs_of(ctx.text_workdir)[0][1]
  return inputs


def run_claims(out: str, *, only=None, settings=None, workdir: str | None = None,
               induction_workdir: str | None = None, sweep_workdir: str | None = None,
               text_workdir: str | None = None, voita_workdir: str | None = None,
               variants_workdir: str | None = None, toy_seeds=measure.TOY_SEEDS, primer: bool = True,
               log: Callable[[str], None] = print) -> dict:
  names = parse_only(only)
  chosen = parse_settings(settings, [s for s, wd in (("text", text_workdir),
                                                      ("voita", voita_workdir),
                                                      ("variants", variants_workdir)) if wd])
  seeds = parse_seeds(toy_seeds)
  for flag, wd in (("--workdir", workdir), ("--induction-workdir", induction_workdir),
                   ("--sweep-workdir", sweep_workdir), ("--text-workdir", text_workdir),
                   ("--voita-workdir", voita_workdir),
                   ("--variants-workdir", variants_workdir)):
    if wd is not None and not storage.isdir(wd):
      raise UserError(f"{flag} {wd!r} is not a directory")
  if storage.exists(out) and not storage.isdir(out):
    raise UserError(f"--out {out!r} exists and is not a directory")
  storage.makedirs(out)
  ctx = measure.Context(out=out, workdir=workdir, induction_workdir=induction_workdir,
                  sweep_workdir=sweep_workdir, text_workdir=text_workdir,
                  voita_workdir=voita_workdir, variants_workdir=variants_workdir,
                  toy_seeds=seeds, log=log)
  t0 = time.time()
  results = []
  for name in names:
    text, fn, rule, keys, where, source, paper = CLAIMS[name]
    log(f"[{name}]")
    cells = {}
    for setting in chosen:
      if setting not in where:
        cells[setting] = {"verdict": "n/a"}
        continue
      attr, flag = NEEDS.get(setting, (None, None))
      if attr and getattr(ctx, attr) is None:
        cells[setting] = {"verdict": "not run", "reason": f"no {flag} given"}
        continue
      t = time.time()
      if source is None:
        runs = [(None, None)]
      elif source == "toy_seeds":
        runs = [(s, None) for s in ctx.toy_seeds]
      else:
        runs = source(ctx, setting)
      units = []
      for seed, handle in runs:
        r = fn(ctx, setting, seed, handle)
        units.append({"seed": seed, "numbers": _jsonable(r["numbers"]),
                      "verdict": rule(r["numbers"]), "figures": r["figures"]})
      cells[setting] = aggregate(units, keys, seeded=source is not None and (
          setting in ("toy", "text", "voita", "variants")))
      cells[setting]["seconds"] = round(time.time() - t, 1)
      log(f"  {setting}: {cells[setting]['verdict']}  ({cells[setting]['seconds']} s)")
    ran = [c for c in cells.values() if "per_seed" in c]
    summary = "; ".join(f"{s}: {c['verdict']}" for s, c in cells.items()
                        if "per_seed" in c)
    results.append({"name": name, "claim": text, "rule": rule.text, "paper": paper,
                    "settings": cells, "verdict": summary or "not run",
                    "numbers": ran[0]["numbers"] if ran else {},
                    "figures": [f for c in ran for u in c["per_seed"] for f in u["figures"]],
                    "seconds": round(sum(c.get("seconds", 0) for c in cells.values()), 1)})
  report = {"claims": results, "seconds": round(time.time() - t0, 1),
            "settings": {s: SETTINGS[s] for s in chosen}, "toy_seeds": list(seeds),
            "workdirs": {"toy_translation": ctx.workdir,
                         "toy_induction": ctx.induction_workdir,
                         "text": ctx.text_workdir, "voita": ctx.voita_workdir,
                         "variants": ctx.variants_workdir}}
  if primer:
    from mha_jax.harness.claims import primer as primer_lib
    primer_lib.write(ctx, storage.join(out, "primer.html"), **primer_inputs(ctx))
    report["primer"] = "primer.html"
  report["seconds"] = round(time.time() - t0, 1)
  report["machine"] = machine()
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


def verdict_cell(c: dict, keys) -> str:
  """One claim's cell of the report's table in one setting: its verdict, and for a
  per-seed claim the spread min..max (or the value) of each of its `keys`."""
  if "per_seed" not in c:
    return c["verdict"] + (f" ({c['reason']})" if c.get("reason") else "")
  parts = []
  for k in keys:
    if k in c["spread"] and c["runs"] > 1:
      lo, hi = c["spread"][k]
      parts.append(f"{k} {_fmt(lo)}" if lo == hi else f"{k} {_fmt(lo)}..{_fmt(hi)}")
    elif k in c["numbers"]:
      parts.append(f"{k} {_fmt(c['numbers'][k])}")
  return f"**{c['verdict']}**<br>" + "; ".join(parts).replace("|", "/")


def format_report(report: dict) -> str:
  settings = list(report["settings"])
  lines = ["# The seeds' claims, measured", "",
           f"`mha-jax claims`, {report['seconds']:.0f} s. Each claim is judged in every "
           "setting where it applies by the same rule (below the table); a trained "
           f"setting is judged per seed (toy seeds {report['toy_seeds']}) and reported "
           "as \"holds in k of n seeds\" with the spread min..max of its numbers. Every "
           "number, per setting and per seed, is in claims.json.", "",
           "Settings: " + "; ".join(f"**{s}**: {d}" for s, d in report["settings"].items())
           + ".", "",
           "| claim | " + " | ".join(settings) + " |",
           "|---|" + "---|" * len(settings)]
  for r in report["claims"]:
    keys = CLAIMS[r["name"]][3] if r["name"] in CLAIMS else ()
    lines.append(f"| **{r['name']}**: {r['claim']} | " +
                 " | ".join(verdict_cell(r["settings"].get(s, {"verdict": "n/a"}), keys)
                            for s in settings) + " |")
  lines += ["", "## Rules", ""]
  lines += [f"- **{r['name']}**: {r['rule']}" for r in report["claims"]]
  short = []
  for r in report["claims"]:
    bad = [(s, c) for s, c in r["settings"].items() if "per_seed" in c and
           c["counts"].get(rules.HOLDS, 0) < c["runs"]]
    if not bad:
      continue
    rule_fn = CLAIMS[r["name"]][2] if r["name"] in CLAIMS else None
    text = [f"**{r['name']}**" + (f" (the papers: {r['paper']})" if r.get("paper") else "")
            + "."]
    for s, c in bad:
      whys = []
      for u in c["per_seed"]:
        if u["verdict"] == rules.HOLDS:
          continue
        w = rules.why(rule_fn, u["numbers"]) if rule_fn else ""
        who = "" if u["seed"] is None else f"seed {u['seed']}: "
        whys.append(who + (w or u["verdict"]))
      text.append(f"In **{s}** ({c['verdict']}): " + "; ".join(whys) + ".")
    short.append(" ".join(text))
  if short:
    lines += ["", "## Where a claim does not hold", ""]
    lines += [p + "\n" for p in short]
  figs = [(r["name"], f) for r in report["claims"] for f in r["figures"]]
  if figs:
    lines += ["", "## Figures", ""]
    lines += [f"- {name}: ![{f}]({f})" for name, f in figs]
  if report.get("primer"):
    lines += ["", f"Interactive primer: [{report['primer']}]({report['primer']}) "
              "(self-contained, offline)."]
  return "\n".join(lines) + "\n"
