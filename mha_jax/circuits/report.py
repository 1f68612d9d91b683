"""`mha-jax circuits --workdir DIR`: behavioural and weight-based circuit scores of a
decoder-only model, the phase change over its checkpoints, path expansion and term
importance. Writes DIR/circuits/circuits.json and composition.png, positivity.png,
icl.png."""

from __future__ import annotations

import dataclasses
from typing import Callable

import numpy as np

from mha_jax import settings, storage
from mha_jax.circuits import behaviour, paths, scores
from mha_jax.errors import BadCheckpoint, UserError
from mha_jax.models import common as C
from mha_jax.settings import setting
from mha_jax.train import checkpoint as ckpt_lib


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


def over_checkpoints(run, tokens: np.ndarray, lengths: np.ndarray, log,
                     windows: np.ndarray | None = None) -> list[dict]:
  """Scores at every checkpoint of `run`'s workdir (with text `windows`, also the ICL
  score on text). Only the params are restored: the task (and its compiled functions) is
  `run`'s, so no step recompiles. Bad checkpoints are skipped with a warning."""
  c = ckpt_lib.Checkpoints(run.workdir, read_only=True)
  rows = []
  try:
    for step in c.all_steps():
      try:
        params, _ = c.restore_params(step)
      except BadCheckpoint as e:
        ckpt_lib.warn(f"{e}; skipped")
        continue
      at = dataclasses.replace(run, params=params, step=step)
      icl = behaviour.icl_score(at, tokens, lengths)
      if windows is not None:
        icl.update(behaviour.text_icl_score(at, windows))
      hs = behaviour.head_scores(at, tokens)
      rows.append({"step": step, **icl,   # None: a model without heads
                   "max_prefix_matching": max((v["prefix_matching"] for v in hs.values()),
                                              default=None),
                   "max_previous_token": max((v["previous_token"] for v in hs.values()),
                                             default=None)})
      best = rows[-1]["max_prefix_matching"]
      text = (f", on text {icl['text_icl_score']:.3f}" if windows is not None else "")
      log(f"  step {step}: ICL score {icl['icl_score']:.3f}{text}, max prefix matching "
          f"{'n/a' if best is None else f'{best:.2f}'}")
  finally:
    c.close()
  return rows


def _layer_head(name: str) -> tuple[int, int]:
  return tuple(int(v) for v in name.split(".")[1:])


def circuit_scores(run, tokens: np.ndarray, *, samples: int = 200, dtype=np.float64,
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
  heads = behaviour.head_scores(run, tokens)
  folded = scores.fold_norms(run.params)
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
  run, workdir, samples, track = loaded, loaded.workdir, opts.samples, opts.track
  if not run.task.decoder_only:
    raise UserError(f"circuits needs a decoder-only model (task lm or pretrained_lm); "
                    f"{workdir!r} has task {run.task.name!r}")
  if not run.task.trainable:        # an imported LM: GQA, RMSNorm, MLPs
    return real_lm_circuits(run, out or storage.join(workdir, "circuits"),
                            samples=samples, log=log)
  out_dir = out or storage.join(workdir, "circuits")
  storage.makedirs(out_dir)
  tokens, lengths = behaviour.eval_tokens(run)
  result = {"workdir": workdir, "step": run.step,
            **circuit_scores(run, tokens, samples=samples, log=log)}
  m = run.config.model
  if m.attn_only and not m.layer_norm and not m.use_bias:
    log("path expansion and term importance ...")
    windows = run.task.text_windows("valid", 16)     # a text model: on its own text
    seqs = tokens if windows is None else windows
    result["term_importance_on"] = "repeated random tokens" if windows is None else "text"
    _, cap = run.task.apply(run.params, {"tokens": seqs}, capture=True)
    pats = [np.asarray(r.weights) for r in cap["lm"]]
    x = seqs[:, :-1]
    terms = paths.expand(run.params, x, pats, pos_in_residual=m.pos not in C.SCORE_POS)
    full = np.asarray(run.task.apply(run.params, {"tokens": seqs}))
    result["path_expansion_max_error"] = float(np.abs(sum(terms.values()) - full).max())
    result["term_importance"] = paths.term_importance(run.params, x, pats,
                                                      pos_in_residual=m.pos not in C.SCORE_POS)
  if track:
    log("ICL score over checkpoints ...")
    result["over_steps"] = over_checkpoints(run, tokens, lengths, log,
                                            run.task.text_windows("valid", 128))
  storage.write_json(storage.join(out_dir, "circuits.json"), result)
  _plots(result, out_dir)
  return result


def real_lm_circuits(run, out_dir: str, *, top: int = 10, batch: int = 8,
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
  tokens, lengths = behaviour.eval_tokens(run, batch)
  log("behavioural scores ...")
  heads = behaviour.head_scores(run, tokens)
  icl = behaviour.icl_score(run, tokens, lengths)
  prev_rank = sorted(heads, key=lambda n: -heads[n]["previous_token"])
  prev_set = {n for n in prev_rank if heads[n]["previous_token"] >= 0.4}
  folded = scores.fold_norms(run.params)
  grams = scores.token_grams(folded)
  d, k = (int(x) for x in run.params["lm"]["layer_0"]["attn"]["wq"].shape[::2])
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
  result = {"workdir": run.workdir, "step": run.step, "heads": heads, **icl,
            "repeated_tokens": {"batch": int(tokens.shape[0]), "length": int(tokens.shape[1])},
            "previous_token_heads": [n for n in prev_rank if n in prev_set],
            "k_composition_baseline": base, "top_induction_heads": rows}
  storage.write_json(storage.join(out_dir, "circuits.json"), result)
  _real_plot(result, storage.join(out_dir, "induction.png"))
  return result


def _real_plot(result, path):
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  heads = result["heads"]
  fig, ax = plt.subplots(figsize=(5, 4))
  x = [v["previous_token"] for v in heads.values()]
  y = [v["prefix_matching"] for v in heads.values()]
  ax.scatter(x, y, s=10, color="C7")
  for r in result["top_induction_heads"]:
    ax.annotate(r["head"][3:], (r["previous_token"], r["prefix_matching"]), fontsize=7)
  ax.set_xlabel("previous-token score")
  ax.set_ylabel("prefix matching (induction) score")
  ax.set_title("heads on repeated random tokens", fontsize=9)
  fig.tight_layout()
  storage.savefig(fig, path, dpi=110)
  plt.close(fig)


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


def _plots(result, out_dir):
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  heads = result["heads"]
  names = sorted(heads, key=lambda n: tuple(int(v) for v in n.split(".")[1:]))
  pos = {n: (int(n.split(".")[2]), -int(n.split(".")[1])) for n in names}
  fig, ax = plt.subplots(figsize=(5, 3.5))
  colors = {"q": "C0", "k": "C3", "v": "C2"}
  for kind, m in result["composition"].items():
    for pair, v in m.items():
      e, l = pair.split("->")
      if v > 0:
        ax.plot([pos[e][0], pos[l][0]], [pos[e][1], pos[l][1]], color=colors[kind],
                lw=12 * v, alpha=0.6)
  for n in names:
    ax.scatter(*pos[n], s=200, color="white", edgecolor="black", zorder=3)
    ax.annotate(n.split(".", 1)[1], pos[n], ha="center", va="center", fontsize=7, zorder=4)
  ax.set_title("composition (line width = score - random baseline)\nQ blue, K red, V green",
               fontsize=9)
  ax.axis("off")
  fig.tight_layout()
  storage.savefig(fig, storage.join(out_dir, "composition.png"), dpi=120)
  plt.close(fig)
  fig, ax = plt.subplots(figsize=(4.5, 4))
  ind = {r["head"] for r in result["induction_heads"]}
  for n in names:
    if "k_comp_positivity" in heads[n]:
      ax.scatter(heads[n]["ov_positivity"], heads[n]["k_comp_positivity"],
                 color="C3" if n in ind else "C7", s=40)
      ax.annotate(n, (heads[n]["ov_positivity"], heads[n]["k_comp_positivity"]), fontsize=7)
  ax.set_xlim(-1.05, 1.05)
  ax.set_ylim(-1.05, 1.05)
  ax.axhline(0, color="k", lw=0.5)
  ax.axvline(0, color="k", lw=0.5)
  ax.set_xlabel("OV circuit eigenvalue positivity (copying)")
  ax.set_ylabel(f"K-composition QK positivity with {result['previous_token_head']}")
  ax.set_title("induction heads in red", fontsize=9)
  fig.tight_layout()
  storage.savefig(fig, storage.join(out_dir, "positivity.png"), dpi=120)
  plt.close(fig)
  if result.get("over_steps"):    # the phase change: ICL score and the best heads
    rows = result["over_steps"]
    steps = [r["step"] for r in rows]
    fig, (a0, a1) = plt.subplots(1, 2, figsize=(9, 3.2))
    a0.plot(steps, [r["icl_score"] for r in rows], "o-", label="repeated random tokens")
    if "text_icl_score" in rows[0]:
      r0 = rows[0]
      a0.plot(steps, [r["text_icl_score"] for r in rows], "s-",
              label=f"text: token {r0['text_late_token']} - token {r0['text_early_token']}")
    a0.axhline(0, color="k", lw=0.5)
    a0.set_xlabel("training step")
    a0.set_ylabel("ICL score (late - early loss, nats)")
    a0.legend(fontsize=7)
    for key, label in (("max_prefix_matching", "best prefix matching"),
                       ("max_previous_token", "best previous-token")):
      a1.plot(steps, [np.nan if r[key] is None else r[key] for r in rows], "o-",
              label=label)
    a1.set_ylim(0, 1)
    a1.set_xlabel("training step")
    a1.set_ylabel("attention share")
    a1.legend(fontsize=7)
    fig.tight_layout()
    storage.savefig(fig, storage.join(out_dir, "icl.png"), dpi=120)
    plt.close(fig)


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
