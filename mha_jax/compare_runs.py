"""`mha-jax compare-runs DIR...`: one row per run of a sweep (h x attention variant), on
the project's own studies, and figures against h with one line per variant.

    mha-jax sweep --config configs/sweep_variants.py --workdir runs/variants
    mha-jax compare-runs runs/variants --out runs/variants/compare

A DIR is a sweep workdir (one workdir per point, VARIANT_hH), a multi-seed workdir
(seeds.json: one row per seed) or one run's workdir. Every number comes from the study
that owns it: the loss (and BLEU) from the task's `evaluate`, the first-token share and
entropy from `roles.head_roles.sink_and_entropy`, the head roles from
`roles.head_roles.head_roles`, induction heads and K-composition from
`circuits.induction_circuits.circuit_scores`, the phase change from `circuits.induction_circuits.over_checkpoints`
and the pruning from the L0 gates of `pruning.methods.train_gates` ranked by
`pruning.methods.top_k_mask`. The taxonomy's causal head checks are not on this branch:
`CompareOptions` has no field for them yet, and the table leaves them out. A
translation run has loss, BLEU, roles and the pruning of its encoder heads (at
`bleu_tolerance`); the attention and circuit columns are for decoders.

Writes OUT/compare.json (the rows, the settings, the machine record with its date),
OUT/compare.md and OUT/compare.png, and each run's row as OUT/runs/NAME.json: a rerun
with the same settings reuses the rows of runs whose last checkpoint has not changed.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

import numpy as np

from mha_jax import loader, settings as settings_lib, storage, tasks
from mha_jax.errors import UserError
from mha_jax.machine import machine
from mha_jax.settings import setting
from mha_jax.toolkit import plots, stability


@dataclasses.dataclass(frozen=True, kw_only=True)
class CompareOptions:
  """The settings of `compare-runs`: what it measures and how."""
  loss_tolerance: float = setting(0.05, lo=0, help="LM: heads kept = the fewest whose "
                                  "test loss is <= the full model's + this (nats)")
  bleu_tolerance: float = setting(1.0, lo=0, help="translation: the fewest heads within "
                                  "this many BLEU")
  prune_steps: int = setting(100, lo=1, help="L0 gate training steps "
                             "(pruning.methods.train_gates)")
  prune_lambda: float = setting(0.05, lo=0, help="the L0 penalty of those gates")
  windows: int = setting(32, lo=1, help="text windows for the first-token share and "
                         "entropy")
  composition_samples: int = setting(50, lo=1, help="random matrices of the composition "
                                     "baseline")
  phase_threshold: float = setting(0.3, lo=0, hi=1, lo_open=True, help="the phase "
                                   "change: the first checkpoint from which the best "
                                   "prefix matching stays >= this")
  track: bool = setting(True, help="follow the checkpoints for the phase change "
                        "(decoders; --no-track skips it)")


def _is_run(d: str) -> bool:
  return storage.isfile(storage.join(d, "config.json"))


def expand(dirs: Sequence[str]) -> list[tuple[str, int | None, str]]:
  """[(name, seed, workdir)]: each point of a sweep workdir (its sub-workdirs, sorted),
  each seed of a multi-seed workdir, or the run itself."""
  from mha_jax.train import seeds as seeds_lib
  if not dirs:
    raise UserError("dirs: compare-runs needs at least one DIR", setting="dirs")
  out = []
  for d in dirs:
    if not storage.isdir(d):
      raise UserError(f"dirs: {d!r} is not a directory", setting="dirs")
    if seeds_lib.is_multi_seed(d):
      out += [(storage.basename(d.rstrip("/")), s, wd) for s, wd in seeds_lib.seed_workdirs(d)]
    elif _is_run(d):
      out.append((storage.basename(d.rstrip("/")), None, d))
    else:
      subs = sorted(s for s in storage.listdir(d) if storage.isdir(storage.join(d, s)))
      found = [s for s in subs if _is_run(storage.join(d, s)) or
               seeds_lib.is_multi_seed(storage.join(d, s))]
      if not found:
        raise UserError(f"dirs: {d!r} holds no run (config.json) and no sweep point",
                        setting="dirs")
      out += expand([storage.join(d, s) for s in found])
  return out


def phase_change_step(over_steps: list[dict], threshold: float) -> int | None:
  """The step from which the best prefix matching (over_checkpoints' rows) stays >=
  threshold at every later checkpoint, the last included; None if the last is below it
  (a transient, e.g. near initialisation, is no phase change)."""
  return stability.appears_at([(r["step"], r["max_prefix_matching"]) for r in over_steps],
                              threshold)


def heads_kept(loaded, base: float, metric: str, tolerance: float, settings: CompareOptions,
               stacks: Sequence[str], log: Callable[[str], None] = lambda s: None) -> dict:
  """L0 gates trained on the run (pruning.methods.train_gates), heads ranked by them
  (top_k_mask); the fewest heads K whose test `metric` stays within `tolerance` of
  `base` (loss: <= base + tol; bleu: >= base - tol), with the metric at every K tried."""
  from mha_jax.pruning import methods
  from mha_jax.tasks import gates_hook
  from mha_jax.toolkit import head_masks
  log_alpha, _, _ = methods.train_gates(loaded, settings.prune_lambda, stacks=stacks,
                                        steps=settings.prune_steps, log=log)
  total = head_masks.count(head_masks.ones_head_mask(loaded.params, stacks))
  is_bleu = metric == "bleu"
  by_k = {}
  for k in range(1, total + 1):
    mask = methods.top_k_mask(log_alpha, k)
    hook = gates_hook(loaded.task, head_masks.full_head_gates(loaded.params, mask))
    m = loaded.task.evaluate(loaded.params, "test", bleu=is_bleu, hook=hook)[metric]
    by_k[k] = float(m)
    if (m >= base - tolerance) if is_bleu else (m <= base + tolerance):
      return {"kept": k, "total": total, "kept_heads": head_masks.kept_names(mask),
              "metric": metric, "by_k": by_k}
  return {"kept": total, "total": total, "metric": metric, "by_k": by_k,
          "kept_heads": head_masks.kept_names(head_masks.ones_head_mask(loaded.params, stacks))}


def run_row(name: str, seed, wd: str, settings: CompareOptions,
            log: Callable[[str], None] = print, load_fn: Callable | None = None) -> dict:
  """The studies' numbers of one run; load_fn(wd): mha_jax.load by default (a caller that
  keeps the loaded runs passes its own, so their compiled functions are reused)."""
  from mha_jax.loader import load
  from mha_jax.roles import head_roles
  loaded = (load_fn or load)(wd)
  m = loaded.config.model
  row = {"run": name, "seed": seed, "workdir": wd, "task": loaded.task.name,
         "variant": m.get("attention", "softmax"), "heads": int(m.num_heads),
         "step": loaded.step,
         # what was trained: the setting as the run's own config records it
         "config": {"d_model": int(m.d_model), "layers": int(m.get("num_layers") or
                                                          m.get("enc_layers") or 0),
                    "max_len": int(m.get("max_len", 0)), "pos": m.get("pos"),
                    "attn_only": bool(m.get("attn_only", False)),
                    "steps": int(loaded.config.train.steps),
                    "batch_size": int(loaded.config.train.batch_size),
                    "lr": float(loaded.config.train.lr), "seed": int(loaded.config.seed),
                    "vocab_size": int(loaded.config.data.get("vocab_size") or 0),
                    "text_files": [storage.basename(f) for f in
                                   loaded.config.data.get("text_files") or ()]}}
  is_tr = loaded.task.role_family == "translation"
  test = loaded.task.evaluate(loaded.params, "test", bleu=is_tr)
  row["loss"] = float(test["loss"])
  row["bleu"] = float(test["bleu"]) if is_tr else None
  roles = head_roles.role_of(head_roles.head_roles(loaded, "test"))
  row["roles"] = {r: list(roles.values()).count(r) for r in sorted(set(roles.values()))}
  if loaded.task.decoder_only:
    log(f"  [{name}] first-token share, entropy ...")
    text = head_roles.sink_and_entropy(loaded, "test", windows=settings.windows)
    per = {f"lm.{l}.{h}": {k: float(v[h]) for k, v in t.items()}
           for l, t in sorted(text.items()) for h in range(len(t["sink_share"]))}
    row["first_token_share"] = float(np.mean([v["sink_share"] for v in per.values()]))
    row["first_token_share_max"] = max(v["sink_share"] for v in per.values())
    row["entropy"] = float(np.mean([v["entropy"] for v in per.values()]))
    row["weight_off_keys"] = float(np.mean([v["off_keys"] for v in per.values()]))
    row["per_head"] = per
    row.update(_circuits(loaded, settings, log, name))
    stacks, metric, base, tol = ("lm",), "loss", row["loss"], settings.loss_tolerance
  else:
    stacks, metric, base, tol = ("encoder",), "bleu", row["bleu"], settings.bleu_tolerance
  log(f"  [{name}] L0 pruning ...")
  row["pruning"] = heads_kept(loaded, base, metric, tol, settings, stacks)
  row["heads_kept"], row["heads_total"] = row["pruning"]["kept"], row["pruning"]["total"]
  return row


def _circuits(loaded, settings: CompareOptions, log, name) -> dict:
  from mha_jax.roles import behaviour
  from mha_jax.circuits import induction_circuits as circuits
  log(f"  [{name}] circuit scores ...")
  tokens, lengths = behaviour.eval_tokens(loaded)
  res = circuits.circuit_scores(loaded, tokens, samples=settings.composition_samples,
                                log=lambda s: None)
  ind = res["induction_heads"]
  k = res["composition"]["k"]
  out = {"induction_heads": [r["head"] for r in ind],
         "best_prefix_matching": max((v["prefix_matching"] for v in res["heads"].values()),
                                     default=None),
         "previous_token_head": res["previous_token_head"],
         # the best induction head's K-composition with its strongest partner
         # (baseline subtracted), and the largest K-composition score of the model
         "k_composition": ind[0]["k_partner_score"] if ind else None,
         "k_composition_max": max(k.values()) if k else None}
  if settings.track:
    log(f"  [{name}] phase change over checkpoints ...")
    steps = circuits.over_checkpoints(loaded, tokens, lengths, lambda s: None)
    out["over_steps"] = [{k2: r[k2] for k2 in ("step", "icl_score", "max_prefix_matching",
                                               "max_previous_token")} for r in steps]
    out["phase_change_step"] = phase_change_step(steps, settings.phase_threshold)
  return out


COLUMNS = (("variant", "variant", None), ("h", "heads", None), ("seed", "seed", None),
           ("loss", "loss", 3), ("BLEU", "bleu", 1),
           ("first-token share", "first_token_share", 3),
           ("max head", "first_token_share_max", 3), ("entropy", "entropy", 2),
           ("induction heads", "induction_heads", None),
           ("phase change step", "phase_change_step", None),
           ("K-comp", "k_composition", 3), ("heads kept", "heads_kept", None),
           ("roles", "roles", None))


def _cell(v, digits) -> str:
  if v is None:
    return "-"
  if isinstance(v, list):
    return str(len(v))
  if isinstance(v, dict):
    return ", ".join(f"{k} {n}" for k, n in v.items() if k != "other") or "-"
  return f"{v:.{digits}f}" if digits is not None else str(v)


def format_table(rows: list[dict]) -> str:
  cols = [c for c in COLUMNS if any(r.get(c[1]) is not None for r in rows)]
  out = ["| " + " | ".join(c[0] for c in cols) + " |",
         "|" + "|".join("---" if c[2] is None and c[1] in ("variant", "roles") else "---:"
                        for c in cols) + "|"]
  for r in rows:
    cells = [_cell(r.get(k), d) for _, k, d in cols]
    if "heads_kept" in r:
      cells[[c[1] for c in cols].index("heads_kept")] = f"{r['heads_kept']}/{r['heads_total']}"
    out.append("| " + " | ".join(cells) + " |")
  return "\n".join(out)


def compare_runs(dirs: Sequence[str], out: str, settings: CompareOptions = CompareOptions(),
                 *, setting_text: str = "", log: Callable[[str], None] = print,
                 load_fn: Callable | None = None) -> dict:
  """Tables every run under `dirs` (expand) into OUT/compare.json, compare.md, compare.png."""
  settings_lib.check(settings)
  if storage.exists(out) and not storage.isdir(out):
    raise UserError(f"out {out!r} exists and is not a directory", setting="out")
  runs = expand(dirs)
  for _, _, wd in runs:       # every run checked before any is measured
    if not tasks.REGISTRY[loader.load_config(wd).task].trainable:
      loader.refuse("compare-runs", wd, "runs trained here (a sweep's points: their "
                    "training settings, checkpoints and studies)", name="DIR")
  storage.makedirs(storage.join(out, "runs"))
  rows = []
  for name, seed, wd in runs:
    label = name if seed is None else f"{name}_seed_{seed}"
    cached = storage.join(out, "runs", f"{label}.json")   # one row per run: a rerun resumes
    if storage.exists(cached):
      row = storage.read_json(cached)
      if row["workdir"] == wd and row["settings"] == dataclasses.asdict(settings) and \
          row["step"] == _latest_step(wd):
        log(f"[{label}] measured already: {cached}")
        rows.append(row)
        continue
    log(f"[{label}] {wd}")
    row = {**run_row(name, seed, wd, settings, log, load_fn),
           "settings": dataclasses.asdict(settings)}
    storage.write_json(cached, row)
    rows.append(row)
  rows.sort(key=lambda r: (r["variant"], r["heads"], r["seed"] or 0))
  result = {"rows": rows, "settings": dataclasses.asdict(settings), "setting": setting_text,
            "dirs": list(dirs), "machine": machine()}
  storage.write_json(storage.join(out, "compare.json"), result)
  table = format_table(rows)
  storage.write_text(storage.join(out, "compare.md"), table + "\n")
  tol = (f" (<= {settings.loss_tolerance} nats lost)" if any(r["bleu"] is None for r in rows)
         else f" (<= {settings.bleu_tolerance} BLEU lost)")
  plots.against_heads(rows, storage.join(out, "compare.png"), tol)
  log(table)
  return result


def _latest_step(wd: str):
  from mha_jax.train import checkpoint as ckpt_lib
  c = ckpt_lib.Checkpoints(wd, read_only=True)
  try:
    return c.latest_step()
  finally:
    c.close()
