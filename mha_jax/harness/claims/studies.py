"""Claims measured on trained or imported workdirs, in each setting where they apply:
pruning (the quickstart translation model; a Voita-setting model), circuits (the
two-layer induction model; the two-layer natural-text model; SmolLM2; Gemma 3) and
Michel's pruning of MiniLM. Every one starts from `mha_jax.load` and reuses the pruning,
analysis and circuits modules. The toy setting trains its workdirs here (one program
for its seeds, train.seeds) when none is given; the text and voita settings read theirs
from flags; the registry models are imported offline into OUT/work/pretrained/."""

from __future__ import annotations


import numpy as np

from mha_jax import storage
from mha_jax.errors import UserError
from mha_jax.harness.claims.measure import Context
from mha_jax.harness.claims import rules

SPECIALISED = ("positional", "syntactic", "rare")
REGISTRY = {"smollm2": "smollm2-135m", "gemma3": "gemma3-270m", "minilm": "minilm-l6"}


def runs_of(workdir: str) -> list[tuple[int | None, str]]:
  """[(seed, workdir)]: each seed of a multi-seed workdir (seeds.json, seed_<s>/), or the
  workdir itself as one run (seed None)."""
  from mha_jax.train import seeds as seeds_lib
  if seeds_lib.is_multi_seed(workdir):
    return seeds_lib.seed_workdirs(workdir)
  return [(None, workdir)]


def _train_toy(ctx: Context, config: str, name: str) -> list[tuple[int | None, str]]:
  """Trains `config` for the toy setting's seeds (one vmapped program when several) in
  OUT/work/NAME; resumes, or returns at once when it is done."""
  from mha_jax import config as mc
  from mha_jax.train import loop
  seeds = ",".join(str(s) for s in ctx.toy_seeds)
  wd = storage.join(ctx.work, name if len(ctx.toy_seeds) == 1 and ctx.toy_seeds[0] == 0
                    else f"{name}_seeds_{seeds.replace(',', '-')}")
  cfg = mc.load_config(config)
  mc.apply_overrides(cfg, ["--config.train.progress=false",
                           f"--config.seed={ctx.toy_seeds[0]}",
                           f"--config.train.seeds={seeds if len(ctx.toy_seeds) > 1 else 1}"])
  ctx.log(f"  training {config} (seeds {seeds}) in {wd} ...")
  loop.train(cfg, wd, log=lambda s: None)
  return runs_of(wd)


def imported_workdir(ctx: Context, setting: str) -> str:
  """The registry model of `setting` imported offline into OUT/work/pretrained/NAME once
  (reused by later runs with the same --out; never a cache in the home folder)."""
  from mha_jax.pretrained import importer
  wd = storage.join(ctx.work, "pretrained", REGISTRY[setting])
  if not storage.exists(storage.join(wd, "config.json")):
    ctx.log(f"  importing {REGISTRY[setting]} into {wd} ...")
    importer.import_model(wd, name=REGISTRY[setting])
  return wd


def translation_runs(ctx: Context, setting: str) -> list[tuple[int | None, str]]:
  if setting == "voita":
    return runs_of(ctx.voita_workdir)
  if ctx.workdir:
    return runs_of(ctx.workdir)
  from mha_jax import quickstart
  return _train_toy(ctx, quickstart.CONFIG, "quickstart")


def decoder_runs(ctx: Context, setting: str) -> list[tuple[int | None, str]]:
  if setting in ("smollm2", "gemma3"):
    return [(None, imported_workdir(ctx, setting))]
  if setting == "text":
    return runs_of(ctx.text_workdir)
  if ctx.induction_workdir:
    return runs_of(ctx.induction_workdir)
  return _train_toy(ctx, "configs/induction.py", "induction")


def label(setting: str, seed) -> str:
  return setting if seed is None else f"{setting}/seed_{seed}"


# ---------------------------------------------------------------- pruning


def claim_pruning(ctx: Context, setting: str, seed, wd: str, keep: int = 10,
                  last: int = 3) -> dict:
  from mha_jax.loader import load
  from mha_jax.pruning import prune as prune_run
  run = load(wd)
  if run.task.role_family != "translation":
    raise UserError(f"{wd!r} is not a translation run (the pruning claim's {setting} "
                    f"setting)")
  from mha_jax.roles import head_roles
  roles = head_roles.role_of(head_roles.saved_or_head_roles(run, "test", log=lambda m: None))
  out = storage.join(ctx.work, "pruned", f"{label(setting, seed)}_keep{keep}")
  info = None
  if storage.exists(storage.join(out, "pruning.json")):       # reuse, never overwrite
    info = storage.read_json(storage.join(out, "pruning.json"))
    if info.get("source") != storage.abspath(wd):
      raise UserError(f"{out!r} holds the pruning of {info.get('source')!r}, not of "
                      f"{wd!r}; use another --out")
  else:
    ctx.log(f"  pruning to {keep} encoder heads with L0 gates ...")
    qs = storage.join(wd, "quickstart.json")
    base = None
    if storage.exists(qs):
      base = storage.read_json(qs).get("test")
    opts = prune_run.PruneOptions(method="l0", l0_lambda=0.05, keep=keep, steps=100)
    info = prune_run.prune(run, out, opts, log=lambda s: None, base=base)
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
  pos = run.config.model.get("pos", "")
  n = {"workdir": wd, "positions": pos, "encoder_heads": len(enc), "kept": len(kept), "kept_heads": kept,
       "kept_roles": counts, "bleu_all": info["base"]["bleu"],
       "bleu_kept": info["after"]["bleu"], "specialised_share_all": spec_all,
       "specialised_share_kept": spec_kept, "last_heads": last_heads,
       "last_heads_roles": [roles.get(h, "other") for h in last_heads]}
  return {"numbers": n, "figures": []}


# ---------------------------------------------------------------- circuits


def _decoder_run(setting: str, wd: str):
  """(the loaded decoder-only run, its repeated-token eval tokens: the trained run's own
  batch, 8 sequences of an imported LM's); another task is refused by name."""
  from mha_jax.roles import behaviour
  from mha_jax.loader import load
  run = load(wd)
  if not run.task.decoder_only:
    raise UserError(f"{wd!r} holds task {run.task.name!r}; the {setting} setting's "
                    f"circuit claims need a decoder-only model")
  tokens, _ = behaviour.eval_tokens(run) if run.task.trainable else \
      behaviour.eval_tokens(run, 8)
  return run, tokens


def circuit_facts(ctx: Context, setting: str, seed, wd: str) -> dict:
  """The circuit scores of one run (circuits.induction_circuits.circuit_scores), computed once per
  run: a trained two-layer model through `circuits` (its figures and term importance in
  OUT/circuits/<setting>[/seed_<s>]), an imported LM on 8 sequences of repeated tokens,
  its composition in float32."""
  key = ("circuits", wd)
  if key not in ctx.cache:
    from mha_jax.circuits import induction_circuits
    run, tokens = _decoder_run(setting, wd)
    ctx.log(f"  circuit scores of {wd} ...")
    if run.task.trainable:
      res = induction_circuits.circuits(run, storage.join(ctx.out, "circuits", label(setting, seed)),
                                     induction_circuits.CircuitsOptions(track=False),
                                     log=lambda s: None)
    else:
      res = {"workdir": wd, "step": run.step,
             **induction_circuits.circuit_scores(run, tokens, samples=50, dtype=np.float32,
                                     log=lambda s: None)}
    layers = [v for k, v in run.params["lm"].items() if k.startswith("layer_")]
    approx = any(("ln1" in l or "mlp" in l) for l in layers)
    ctx.cache[key] = {"res": res, "run": run, "tokens": tokens,
                      "weight_scores": "approximate: norm scales folded, 1/rms and MLPs "
                      "left out" if approx else "exact: attention-only, no norms",
                      "figures": [f"circuits/{label(setting, seed)}/{f}"
                                  for f in ("composition.png", "positivity.png")
                                  if run.task.trainable and seed in (None, 0)]}
  return ctx.cache[key]


def head_facts(ctx: Context, setting: str, seed, wd: str) -> dict:
  """{"res": {"workdir", "heads": behaviour.head_scores}, "run"}: the circuit facts'
  head scores on the same repeated tokens, without the composition scores (minutes on
  SmolLM2): those of circuit_facts when it already ran for this run."""
  if ("circuits", wd) in ctx.cache:
    return ctx.cache[("circuits", wd)]
  key = ("heads", wd)
  if key not in ctx.cache:
    from mha_jax.roles import behaviour
    run, tokens = _decoder_run(setting, wd)
    ctx.cache[key] = {"res": {"workdir": wd, "heads": behaviour.head_scores(run, tokens)},
                      "run": run}
  return ctx.cache[key]


def _layer(name: str) -> int:
  return int(name.split(".")[1])


def best_induction_head(res: dict) -> str:
  later = [n for n in res["heads"] if _layer(n) > 0]
  return max(later, key=lambda n: res["heads"][n]["prefix_matching"])


def _weights(f, layer: int, head: int) -> np.ndarray:
  """(B, T, T) attention of one head on the facts' repeated tokens."""
  from mha_jax.toolkit import capture
  run = f["run"]
  return np.asarray(capture.captured(run.task, run.params, {"tokens": f["tokens"]})["lm"]
                    [layer].weights)[:, head]


def claim_induction_k_composition(ctx: Context, setting: str, seed, wd: str) -> dict:
  f = circuit_facts(ctx, setting, seed, wd)
  res = f["res"]
  heads = res["heads"]
  ind = best_induction_head(res)
  prev = res["previous_token_head"]
  row = {e: v for pair, v in res["composition"]["k"].items()
         for e, l in [pair.split("->")] if l == ind}
  partner = max(row, key=row.get)
  w = _weights(f, *(int(v) for v in prev.split(".")[1:]))
  by_pos = [float(w[:, t, t - 1].mean()) for t in range(1, w.shape[1])]
  sharp = next((t for t, v in enumerate(by_pos, 1) if v < 0.9), len(by_pos) + 1) - 1
  top = sorted((n for n in heads if _layer(n) > 0),
               key=lambda n: -heads[n]["prefix_matching"])[:5]
  ranked = sorted(row, key=lambda e: -row[e])
  prev_partner = next((e for e in ranked if heads[e]["previous_token"] >= 0.4), None)
  med = float(np.median(list(row.values())))
  n = {"workdir": res["workdir"], "induction_head": ind,
       "top_induction_heads": {h: round(heads[h]["prefix_matching"], 4) for h in top},
       "previous_token_by_position": by_pos, "previous_token_sharp_up_to": sharp,
       "positions": len(by_pos),
       "prefix_matching": heads[ind]["prefix_matching"], "copying": heads[ind]["copying"],
       "previous_token_head": prev, "previous_token_score": heads[prev]["previous_token"],
       "k_partner": partner, "k_partner_score": row[partner],
       "k_partner_previous_token": heads[partner]["previous_token"],
       "k_row_median": med,
       "k_partner_over_median": row[partner] / med if med > 0 else None,
       # the strongest partner among the previous-token heads (>= 0.4 on t-1)
       "k_previous_token_partner": prev_partner,
       "k_previous_token_partner_rank": ranked.index(prev_partner) + 1
       if prev_partner else None,
       "k_previous_token_partner_score": row[prev_partner] if prev_partner else None,
       "k_previous_token_partner_previous_token": heads[prev_partner]["previous_token"]
       if prev_partner else None,
       "k_row": row if len(row) <= 64 else
       dict(sorted(row.items(), key=lambda kv: -kv[1])[:16]),
       "k_row_size": len(row),
       "baseline": res["composition_baseline"]["k"], "weight_scores": f["weight_scores"]}
  if len(heads) <= 64:
    n["k_composition_matrix"] = res["composition"]["k"]
    n["scores"] = {h: {k: round(v, 4) for k, v in s.items()} for h, s in heads.items()}
  return {"numbers": n, "figures": f["figures"]}


def induction_candidates(res: dict, top: int = 3, floor: float = 0.3) -> list[str]:
  """The heads of layers >= 1 with the best prefix matching: the best one, then up to
  `top` in all of those at >= floor (where the induction role is shared)."""
  later = sorted((n for n in res["heads"] if _layer(n) > 0),
                 key=lambda n: -res["heads"][n]["prefix_matching"])
  return later[:1] + [n for n in later[1:top] if res["heads"][n]["prefix_matching"] >= floor]


def claim_induction_k_causal(ctx: Context, setting: str, seed, wd: str,
                             top: int = 3) -> dict:
  """Noising path patching (toolkit.activation_patching.Study.path_patch, channel k, direction
  "noise") on 8 induction pairs: in the clean run one sender head's z is taken from the
  corrupt run (a fresh first half), every other head frozen at clean (MLPs recompute);
  the key input that the receiver reads there is patched into the clean run. effect =
  1 - recovery: the share of the clean-corrupt logit difference lost. Receivers: the
  induction candidates (induction_candidates). For each, the previous-token head (the
  best previous-token score in the layers below it) against the other heads of its
  layer; the senders are the heads of the layers of the three best previous-token heads
  below it (the role may be spread over layers), and the judged receiver's row is in
  the numbers. Denoising would be the wrong way round here: a clean previous-token
  head in the corrupt run moves the keys to the corrupt copy's token, which is the
  logit difference's wrong answer."""
  from mha_jax.toolkit import activation_patching as core, pairs as pairs_lib
  f = head_facts(ctx, setting, seed, wd)
  res, run = f["res"], f["run"]
  heads = res["heads"]
  half = max(2, min(10, (run.task.vocab_size - 2) // 2))
  pairs = pairs_lib.induction_pairs(run.task, 8, half_len=half, seed=0 if seed is None else seed)
  s = core.Study(run.task, run.params, pairs)
  judged = []
  for ind in induction_candidates(res, top):
    li, hi = (int(v) for v in ind.split(".")[1:])
    below = sorted((n for n in heads if _layer(n) < li),
                   key=lambda n: -heads[n]["previous_token"])
    prev, lp = below[0], _layer(below[0])
    layers = sorted({_layer(n) for n in below[:3]})
    eff = 1.0 - s.path_patch([(li, hi)], "k", direction="noise",
                             sender_layers=layers)["recovery"][..., 0]
    row = {f"lm.{lp}.{j}": float(eff[lp, j]) for j in range(s.heads[lp])}
    others = {k: v for k, v in row.items() if k != prev}
    best = max(others, key=others.get) if others else None
    scanned = {f"lm.{l}.{j}": float(eff[l, j]) for l in layers for j in range(s.heads[l])}
    r = {"induction_head": ind, "prefix_matching": heads[ind]["prefix_matching"],
         "previous_token_head": prev, "previous_token_score": heads[prev]["previous_token"],
         "path_k_effect": row[prev], "best_other": best,
         "best_other_effect": others[best] if best else float("-inf"),
         "layer_row": row, "sender_layers": layers,
         "top_senders": sorted(scanned.items(), key=lambda kv: -kv[1])[:5]}
    r["verdict"] = rules.induction_k_causal_one(r)
    judged.append(r)
  n = {"workdir": res["workdir"], **{k: v for k, v in judged[0].items() if k != "verdict"},
       "receivers": judged, "receivers_holding": sum(r["verdict"] == rules.HOLDS for r in judged),
       "receivers_failing": sum(r["verdict"] == rules.FAILS for r in judged),
       "pairs": len(pairs), "ld_clean": float(np.mean(s.ld_clean)),
       "ld_corrupt": float(np.mean(s.ld_corrupt)),
       "method": "noising path patching: sender z from the corrupt run, other heads "
                 "frozen at clean (MLPs recompute), the induction head's k input "
                 "recorded then patched into the clean run; effect = 1 - recovery"}
  return {"numbers": n, "figures": []}


def claim_positivity_corner(ctx: Context, setting: str, seed, wd: str) -> dict:
  f = circuit_facts(ctx, setting, seed, wd)
  res = f["res"]
  heads = res["heads"]
  scored = {h: s for h, s in heads.items() if "k_comp_positivity" in s}
  corner = [n for n, s in scored.items()
            if s["ov_positivity"] > 0.5 and s["k_comp_positivity"] > 0.5]
  ind = [r["head"] for r in res["induction_heads"]]
  n = {"previous_token_head": res["previous_token_head"],
       "induction_heads": ind, "corner_heads": corner, "heads_scored": len(scored),
       "induction_in_corner": sorted(set(ind) & set(corner)),
       "positivity": {h: [round(s["ov_positivity"], 3), round(s["k_comp_positivity"], 3)]
                      for h, s in scored.items()
                      if len(scored) <= 64 or h in set(ind) | set(corner)}}
  return {"numbers": n, "figures": [x for x in f["figures"] if "positivity" in x]}


def claim_composition_sparse(ctx: Context, setting: str, seed, wd: str) -> dict:
  res = circuit_facts(ctx, setting, seed, wd)["res"]
  by = {k: np.asarray(list(m.values())) for k, m in res["composition"].items()}
  vals = np.concatenate(list(by.values()))
  n = {"pairs": int(vals.size), "share_near_baseline": float((np.abs(vals) < 0.05).mean()),
       "share_near_baseline_by_kind": {k: float((np.abs(v) < 0.05).mean())
                                       for k, v in by.items()},
       "max_over_baseline": float(vals.max()),
       "median_abs_over_baseline": float(np.median(np.abs(vals))),
       "baseline": res["composition_baseline"]}
  figs = circuit_facts(ctx, setting, seed, wd)["figures"]
  return {"numbers": n, "figures": [x for x in figs if "composition" in x]}


def claim_term_importance(ctx: Context, setting: str, seed, wd: str) -> dict:
  res = circuit_facts(ctx, setting, seed, wd)["res"]
  rows = res.get("term_importance")
  if not rows:
    raise UserError("term importance needs an attention-only model without LayerNorm "
                    "or biases (configs/induction.py, configs/attn_only_text.py)")
  n = {"loss_direct": rows[0]["loss"], "loss_direct_single": rows[1]["loss"],
       "loss_full": rows[-1]["loss"],
       "path_expansion_max_error": res["path_expansion_max_error"]}
  return {"numbers": n, "figures": []}


def claim_rests_on_first_token(ctx: Context, setting: str, seed, wd: str) -> dict:
  f = circuit_facts(ctx, setting, seed, wd)
  ind = best_induction_head(f["res"])
  w = _weights(f, *(int(v) for v in ind.split(".")[1:]))              # (B, T, T)
  x = f["tokens"][:, :-1]
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


# ---------------------------------------------------------------- Michel on MiniLM


def claim_michel(ctx: Context, setting: str, seed, wd: str,
                 levels=(0.99, 0.95)) -> dict:
  """Heads removed in Michel et al.'s importance order (I_h, computed once on the
  valid split with all heads on) one at a time, until the mean cosine similarity of the
  test paragraphs' embeddings to the full model's drops below the lowest level."""
  from mha_jax.toolkit import importance
  from mha_jax.loader import load
  from mha_jax.tasks import gates_hook
  from mha_jax.toolkit import head_masks
  run = load(wd)
  if not getattr(run.task, "compares_to_dense", False):
    raise UserError(f"{wd!r} holds task {run.task.name!r}; Michel's MiniLM claim needs a "
                    f"sentence-embedding model")
  ctx.log("  Michel importance and cosine to the full model, head by head ...")
  imp = importance.michel_importance(run, "valid")["normalized"]
  order = sorted(imp, key=imp.get)
  mask = head_masks.ones_head_mask(run.params, ("encoder",))
  total = head_masks.count(mask)
  cos = [1.0]
  for name in order:
    _, layer, head = name.split(".")
    mask["encoder"][int(layer)][int(head)] = 0.0
    hook = gates_hook(run.task, head_masks.full_head_gates(run.params, mask))
    cos.append(run.task.evaluate(run.params, "test", hook=hook)["cosine_to_full"])
    if cos[-1] < min(levels):
      break
  def share(level):
    above = next((i for i, c in enumerate(cos) if c < level), len(cos)) - 1
    return above / total
  n = {"heads": total, "removed_order": order[:len(cos) - 1], "cosine_by_removed": cos,
       **{f"share_at_{lv}": share(lv) for lv in levels},
       "paragraphs": int(run.config.eval.windows)}
  return {"numbers": n, "figures": []}
