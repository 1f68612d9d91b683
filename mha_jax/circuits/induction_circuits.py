"""`mha-jax circuits --workdir DIR`: behavioural and weight-based circuit scores of a
decoder-only model, the phase change over its checkpoints, path expansion and term
importance. Writes DIR/circuits/circuits.json and composition.png, positivity.png,
icl.png (an imported model: circuits.json and induction.png). (`mha-jax circuit`,
circuit.py, is the edge circuit of one behaviour.)"""

from __future__ import annotations

import dataclasses
from typing import Callable

import numpy as np

from mha_jax import loader, settings, storage
from mha_jax.circuits import paths
from mha_jax.roles import behaviour
from mha_jax.toolkit import composition as scores
from mha_jax.loader import each_checkpoint
from mha_jax.machine import machine
from mha_jax.models import common
from mha_jax.settings import setting
from mha_jax.toolkit import capture, plots


def find_induction_heads(heads: dict, comp_k: dict, prefix: float = 0.3,
                         copying: float = 0.0) -> list[dict]:
  """Heads with prefix matching >= `prefix` and positive copying, each with its
  strongest K-composition partner (baseline-corrected) and that partner's
  previous-token score."""
  out = []
  for name, s in heads.items():
    if s["prefix_matching"] < prefix or s["copying"] <= copying:
      continue
    partners = {e: v for (e, l), v in comp_k.items() if l == name}
    best = max(partners, key=partners.get) if partners else None
    out.append({"head": name, **s, "k_partner": best,
                "k_partner_score": partners.get(best) if best else None,
                "k_partner_previous_token": heads[best]["previous_token"] if best else None})
  return sorted(out, key=lambda r: -r["prefix_matching"])


def over_checkpoints(loaded, tokens: np.ndarray, lengths: np.ndarray, log,
                     windows: np.ndarray | None = None) -> list[dict]:
  """Scores at every checkpoint of `run`'s workdir (with text `windows`, also the ICL
  score on text). Only the params are restored: the task (and its compiled functions) is
  `run`'s, so no step recompiles. Bad checkpoints are skipped with a warning."""
  rows = []
  for at in each_checkpoint(loaded):
    icl = behaviour.icl_score(at, tokens, lengths)
    if windows is not None:
      icl.update(behaviour.text_icl_score(at, windows))
    hs = behaviour.head_scores(at, tokens)
    rows.append({"step": at.step, **icl,   # None: a model without heads
                 "max_prefix_matching": max((v["prefix_matching"] for v in hs.values()),
                                            default=None),
                 "max_previous_token": max((v["previous_token"] for v in hs.values()),
                                           default=None)})
    best = rows[-1]["max_prefix_matching"]
    text = (f", on text {icl['text_icl_score']:.3f}" if windows is not None else "")
    log(f"  step {at.step}: ICL score {icl['icl_score']:.3f}{text}, max prefix matching "
        f"{'n/a' if best is None else f'{best:.2f}'}")
  return rows


def _layer_head(name: str) -> tuple[int, int]:
  return tuple(int(v) for v in name.split(".")[1:])


def circuit_scores(loaded, tokens: np.ndarray, *, samples: int = 200, dtype=np.float64,
                   log: Callable[[str], None] = print) -> dict:
  """The scores of every head of a decoder, own or imported, on `tokens` (repeated
  random tokens, behaviour.eval_tokens) and from its weights with the norm scales
  folded in (scores.fold_norms: for real LMs an attention-only approximation, MLPs and
  1/rms left out). Returns {"heads": {name: behavioural scores, ov_positivity and, for
  the heads above the previous-token head, k_comp_positivity}, "previous_token_head":
  the best previous-token head below the best induction head (the best prefix matching
  of layers >= 1; layer 0 in a two-layer model), "induction_heads" (prefix matching
  >= 0.3, copying > 0), "composition" / "composition_raw": {kind: {"early->late":
  score}} (baseline subtracted / raw), "composition_baseline": {kind: value}}."""
  log("behavioural scores ...")
  heads = behaviour.head_scores(loaded, tokens)
  folded = scores.fold_norms(loaded.params)
  log("composition scores ...")
  comp = scores.composition_scores(folded, samples=samples, dtype=dtype)
  grams = scores.token_grams(folded)
  for name in heads:
    heads[name]["ov_positivity"] = scores.ov_positivity(folded, "lm", *_layer_head(name),
                                                        grams=grams)
  later = [n for n in heads if _layer_head(n)[0] > 0]
  prev_head = None
  if later:         # a model without heads (every one pruned) has none to find
    top = max(later, key=lambda n: heads[n]["prefix_matching"])
    below = [n for n in heads if _layer_head(n)[0] < _layer_head(top)[0]]
    prev_head = max(below, key=lambda n: heads[n]["previous_token"])
    for name in heads:
      if _layer_head(name)[0] > _layer_head(prev_head)[0]:
        heads[name]["k_comp_positivity"] = scores.k_composition_positivity(
            folded, _layer_head(prev_head), _layer_head(name), grams=grams)
  return {"heads": heads, "previous_token_head": prev_head,
          "induction_heads": find_induction_heads(heads, comp["corrected"]["k"]),
          "composition": {kind: {f"{e}->{l}": v for (e, l), v in m.items()}
                          for kind, m in comp["corrected"].items()},
          "composition_raw": {kind: {f"{e}->{l}": v for (e, l), v in m.items()}
                              for kind, m in comp["raw"].items()},
          "composition_baseline": comp["baseline"]}


@dataclasses.dataclass(frozen=True, kw_only=True)
class CircuitsOptions:
  """The settings of `circuits`."""
  track: bool = setting(True, help="the ICL score over the checkpoints (--no-track "
                        "skips the pass)")
  samples: int = setting(200, lo=1, help="random matrices of the composition baseline")


def circuits(loaded, out: str | None = None, opts: CircuitsOptions = CircuitsOptions(), *,
             log: Callable[[str], None] = print) -> dict:
  """Induction heads, composition, positivity and paths of a loaded decoder-only run;
  writes OUT/circuits.json and its plots (default WORKDIR/circuits)."""
  settings.check(opts)
  workdir, samples, track = loaded.workdir, opts.samples, opts.track
  if not loaded.task.decoder_only:
    loader.refuse("circuits", loaded.workdir, "a decoder LM (one causal stack: induction heads, "
                  "composition)")
  if not loaded.task.trainable:        # an imported LM: GQA, RMSNorm, MLPs
    return real_lm_circuits(loaded, out or storage.join(workdir, "circuits"),
                            samples=samples, log=log)
  out_dir = out or storage.join(workdir, "circuits")
  storage.makedirs(out_dir)
  tokens, lengths = behaviour.eval_tokens(loaded)
  result = {"workdir": workdir, "step": loaded.step,
            **circuit_scores(loaded, tokens, samples=samples, log=log)}
  m = loaded.config.model
  if m.attn_only and not m.layer_norm and not m.use_bias:
    log("path expansion and term importance ...")
    windows = loaded.task.text_windows("valid", 16)     # a text model: on its own text
    seqs = tokens if windows is None else windows
    result["term_importance_on"] = "repeated random tokens" if windows is None else "text"
    cap = capture.captured(loaded.task, loaded.params, {"tokens": seqs})
    pats = [np.asarray(r.weights) for r in cap["lm"]]
    x = seqs[:, :-1]
    terms = paths.expand(loaded.params, x, pats, pos_in_residual=m.pos not in common.SCORE_POS)
    full = np.asarray(loaded.task.apply(loaded.params, {"tokens": seqs}))
    result["path_expansion_max_error"] = float(np.abs(sum(terms.values()) - full).max())
    result["term_importance"] = paths.term_importance(loaded.params, x, pats,
                                                      pos_in_residual=m.pos not in common.SCORE_POS)
  if track:
    log("ICL score over checkpoints ...")
    result["over_steps"] = over_checkpoints(loaded, tokens, lengths, log,
                                            loaded.task.text_windows("valid", 128))
  storage.write_json(storage.join(out_dir, "circuits.json"), result)
  plots.circuit_figures(result, out_dir)
  return result


def real_lm_circuits(loaded, out_dir: str, *, top: int = 10, batch: int = 8,
                     samples: int = 50, partners: int = 3,
                     log: Callable[[str], None] = print) -> dict:
  """Circuits of an imported LM (many layers, GQA, MLPs, RMSNorm): prefix matching,
  previous-token and copying scores of every head on repeated random tokens over the
  model's vocabulary; for the `top` heads by prefix matching, OV eigenvalue positivity
  through embedding and unembedding (its K x K factor), the earlier heads they K-compose
  with most (random baseline subtracted; factored; a query head reads its kv head's
  W_K) and whether those are previous-token heads. The weight-based scores read the
  params with the norm scales folded in (scores.fold_norms); the per-token 1/rms and
  the MLPs are left out, as in Elhage et al.'s attention-only analysis: for a real LM
  they describe the attention-only path through the residual stream, an approximation."""
  storage.makedirs(out_dir)
  tokens, lengths = behaviour.eval_tokens(loaded, batch)
  log("behavioural scores ...")
  heads = behaviour.head_scores(loaded, tokens)
  icl = behaviour.icl_score(loaded, tokens, lengths)
  prev_rank = sorted(heads, key=lambda n: -heads[n]["previous_token"])
  prev_set = {n for n in prev_rank if heads[n]["previous_token"] >= 0.4}
  folded = scores.fold_norms(loaded.params)
  grams = scores.token_grams(folded)
  d, k = (int(x) for x in loaded.params["lm"]["layer_0"]["attn"]["wq"].shape[::2])
  base = scores.random_baseline("k", d, k, k, samples)
  log(f"K-composition of the top {top} induction heads (baseline {base:.4f}) ...")
  rows = []
  for name in sorted(heads, key=lambda n: -heads[n]["prefix_matching"])[:top]:
    l, h = (int(v) for v in name.split(".")[1:])
    comp = scores.k_composition_partners(folded, (l, h), baseline=base)
    best = sorted(comp, key=lambda n: -comp[n])[:partners]
    rows.append({"head": name, **heads[name],
                 "ov_positivity": scores.ov_positivity(folded, "lm", l, h, grams=grams),
                 "k_partners": [{"head": b, "k_composition": comp[b],
                                 "previous_token": heads[b]["previous_token"],
                                 "is_previous_token_head": b in prev_set} for b in best]})
    heads[name]["ov_positivity"] = rows[-1]["ov_positivity"]
  result = {"workdir": loaded.workdir, "step": loaded.step, "heads": heads, **icl,
            "repeated_tokens": {"batch": int(tokens.shape[0]), "length": int(tokens.shape[1])},
            "previous_token_heads": [n for n in prev_rank if n in prev_set],
            "k_composition_baseline": base, "top_induction_heads": rows,
            "machine": machine()}
  storage.write_json(storage.join(out_dir, "circuits.json"), result)
  plots.real_model_induction(result, storage.join(out_dir, "induction.png"))
  return result


def format_real_summary(result) -> str:
  lines = [f"ICL score {result['icl_score']:.3f} (loss late {result['loss_late']:.3f} - "
           f"early {result['loss_early']:.3f})",
           "top heads by prefix matching (induction score):"]
  for r in result["top_induction_heads"]:
    ps = ", ".join(f"{p['head']} {p['k_composition']:+.4f}"
                   f"{' (prev-token)' if p['is_previous_token_head'] else ''}"
                   for p in r["k_partners"])
    lines.append(f"  {r['head']}: prefix {r['prefix_matching']:.3f} copying "
                 f"{r['copying']:.3f} OV positivity {r['ov_positivity']:+.3f}; K-comp: {ps}")
  return "\n".join(lines)


def format_summary(result) -> str:
  if "top_induction_heads" in result:
    return format_real_summary(result)
  lines = ["induction heads (prefix matching >= 0.3, copying > 0):"]
  for r in result["induction_heads"]:
    partner = ("none (first layer)" if r["k_partner"] is None else
               f"{r['k_partner']} ({r['k_partner_score']:.3f} over baseline; its "
               f"previous-token score {r['k_partner_previous_token']:.3f})")
    lines.append(f"  {r['head']}: prefix matching {r['prefix_matching']:.3f}, copying "
                 f"{r['copying']:.3f}, strongest K-composition {partner}")
  prev = result["previous_token_head"]
  lines.append(f"previous-token head of layer 0: {prev} "
               f"({result['heads'][prev]['previous_token']:.3f})" if prev is not None else
               "no attention heads in this model (every head pruned)")
  k = result["composition"]["k"]
  lines.append("K-composition (score - baseline), earlier -> later:")
  for pair, v in sorted(k.items()):
    lines.append(f"  {pair}: {v:+.3f}")
  if "term_importance" in result:
    lines.append("term importance (patterns frozen):")
    for r in result["term_importance"]:
      lines.append(f"  keep {r['orders_kept']:<40} loss {r['loss']:.3f} "
                   f"(+{r['loss_change_vs_full']:.3f})")
  return "\n".join(lines)
