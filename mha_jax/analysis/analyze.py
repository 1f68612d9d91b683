"""`mha-jax analyze`: roles, importance and ablations for a checkpoint, with plots.

Writes DIR/analysis/heads.json and heads.csv (one row per head), roles.png,
importance.png, ablation.png and explorer.html, and returns a summary.
"""

from __future__ import annotations

import csv
import dataclasses
import io
from typing import Callable


from mha_jax import loader, settings, storage
from mha_jax.analysis import attention_explorer
from mha_jax.errors import UserError
from mha_jax.settings import setting
from mha_jax.tasks.base import SPLITS
from mha_jax.toolkit import importance
from mha_jax.roles.head_roles import head_roles
from mha_jax.toolkit import plots


GRID_SCORES = {"lm": ("previous_token", "duplicate_token", "induction", "sink_share",
                      "entropy", "importance"),
               "encoder": ("positional_share", "cls_share", "sep_share", "rare_share",
                           "confidence", "importance")}


def write_rows(rows: list[dict], directory: str) -> None:
  storage.write_json(storage.join(directory, "heads.json"), rows)
  keys = list(dict.fromkeys(k for r in rows for k in r))
  f = io.StringIO(newline="")
  w = csv.DictWriter(f, fieldnames=keys)
  w.writeheader()
  w.writerows(rows)
  storage.write_text(storage.join(directory, "heads.csv"), f.getvalue())


@dataclasses.dataclass(frozen=True, kw_only=True)
class AnalyzeOptions:
  """The settings of `analyze`."""
  split: str = setting("test", choices=SPLITS, help="the data split (default: test)")
  ablations: bool = setting(True, help="the leave-one-out pass (--no-ablations skips it)")
  bleu_limit: int = setting(64, lo=0, note=" (0 = all)",
                            help="sentences for BLEU in the leave-one-out pass (0 = all)")
  conllu: str | None = setting(None, path=True, help="imported encoders: a CoNLL-U file "
                               "of sentences for syntactic roles")
  roles_only: bool = setting(False, help="multi-seed workdir: each seed's head roles "
                             "only (roles_only.json), then their stability; no "
                             "importance, ablations or explorer")
  role_limit: int = setting(0, lo=0, help="sentences for the roles (0 = all)")
  importance_limit: int = setting(512, lo=1, help="valid sentences for the importance")
  roles: str | None = setting(None, help="LMs: only these head roles, a,b "
                              "(roles.head_taxonomy.ROLES; default all but retrieval); "
                              "writes roles.json and head_taxonomy.png")
  retrieval_len: int = setting(384, lo=16, help="LMs, role retrieval: tokens of each "
                               "needle-in-a-haystack input (at most the model's window)")
  memory_budget: str | None = setting(None, metavar="BYTES",
                                      help="LMs: bytes each causal check of the head "
                                           "taxonomy may hold, e.g. 4GB: its rows per "
                                           "batch are chosen from it before compiling "
                                           "(default: half the device's free memory)")


def _check_roles(loaded, opts: AnalyzeOptions) -> None:
  """--roles and --retrieval-len only where they are read: a decoder LM's taxonomy, and
  its role retrieval; refused by name elsewhere (they were ignored without a word)."""
  if opts.roles and not loaded.task.decoder_only:
    loader.refuse("analyze --roles", loaded.workdir, "a decoder LM (the head taxonomy's "
                  "roles)")
  default = next(f.default for f in dataclasses.fields(opts) if f.name == "retrieval_len")
  if opts.retrieval_len != default and "retrieval" not in (opts.roles or ""):
    raise UserError(f"retrieval_len is read by role retrieval only; give roles with "
                    f"retrieval (got roles {opts.roles!r})",
                    setting=("retrieval_len", "roles"))


def _taxonomy_settings(loaded, opts: AnalyzeOptions):
  """The classifier's options of `analyze`'s options (its budget: memory.budget's)."""
  from mha_jax.roles import head_taxonomy
  from mha_jax.toolkit import memory
  budget = memory.budget(opts.memory_budget, memory.params_bytes(loaded.params))[0]
  return head_taxonomy.ClassifyOptions(roles=head_taxonomy.parse_roles(opts.roles),
                                       retrieval_len=opts.retrieval_len, memory_budget=budget)


def analyze(loaded, out: str | None = None, opts: AnalyzeOptions = AnalyzeOptions(), *,
            log: Callable[[str], None] = print) -> dict:
  """Roles, importance and single-head ablations for a loaded run; writes the report in
  `out` (default WORKDIR/analysis). `opts.conllu`: a CoNLL-U file of input sentences
  for the syntactic roles of an encoder without its own arcs (an imported BERT;
  translation runs take data.conllu). Imported LMs (and LMs given `opts.roles`, "a,b"):
  roles.head_taxonomy's roles, checked causally, into roles.json and head_taxonomy.png; the
  rows take its roles."""
  settings.check(opts)
  split, conllu = opts.split, opts.conllu
  loo, loo_bleu_limit = opts.ablations, opts.bleu_limit
  role_limit, importance_limit = opts.role_limit, opts.importance_limit
  _check_roles(loaded, opts)
  if conllu and loaded.task.role_family != "embedding":
    raise UserError(f"conllu is for imported encoders (task embedding); this run has "
                    f"task {loaded.task.name!r} (translation runs read data.conllu.<split> "
                    f"from their config)", setting="conllu")
  out_dir = out or storage.join(loaded.workdir, "analysis")
  storage.makedirs(out_dir)
  is_tr = loaded.task.reports_bleu
  if not loaded.task.trainable:       # imported models: 270 / 72 heads
    importance_limit = min(importance_limit, loaded.config.eval.batch_size * 2)
    if loaded.task.decoder_only and loo:
      log("leave-one-out skipped for an imported LM (270 evaluations); run "
          "`mha-jax ablate --each` for it")
      loo = False
  log("roles ...")
  rows = head_roles(loaded, split, role_limit, conllu=conllu)
  if loaded.task.decoder_only and (loaded.task.role_family == "real_lm" or opts.roles):
    from mha_jax.roles import head_taxonomy
    doc = head_taxonomy.classify(loaded, rows, _taxonomy_settings(loaded, opts), log)
    head_taxonomy.write(doc, out_dir, f"head roles, {loaded.workdir}")
    for r in rows:
      r["role"] = doc["assigned"].get(r["head"], r["role"])
  by_name = {r["head"]: r for r in rows}
  log("importance (Michel et al.) ...")
  imp = importance.michel_importance(loaded, "valid", limit=importance_limit)
  for name, v in imp["normalized"].items():
    by_name.setdefault(name, {"head": name, "stack": name.split(".")[0],
                              "layer": int(name.split(".")[1]),
                              "index": int(name.split(".")[2]), "role": "n/a"})
    by_name[name]["importance"] = v
    by_name[name]["importance_raw"] = imp["raw"][name]
  loo_rows = []
  if loo:
    log(f"leave-one-out ablations of {len(by_name)} heads ...")
    loo_rows = importance.leave_one_out(loaded, split=split, bleu_limit=loo_bleu_limit)
    for r in loo_rows:
      for k, v in r.items():
        if k.startswith("delta_"):
          by_name[r["head"]][k] = v
  rows = list(by_name.values())
  write_rows(rows, out_dir)
  plots.role_grid([r for r in rows if r.get("role") != "n/a"], storage.join(out_dir, "roles.png"),
                  f"head roles, {loaded.workdir}")
  stack0 = rows[0]["stack"] if rows else None
  if stack0 in GRID_SCORES:
    plots.score_grids([r for r in rows if r["stack"] == stack0],
                      storage.join(out_dir, "scores.png"), GRID_SCORES[stack0],
                      f"per-head scores, {loaded.workdir}")
  names = [r["head"] for r in rows]
  plots.bars(names, [r.get("importance", 0.0) for r in rows],
             storage.join(out_dir, "importance.png"), "importance (normalised per layer)")
  key = "delta_bleu" if is_tr and loo else "delta_loss"
  if loo:
    plots.bars(names, [r.get(key, 0.0) for r in rows], storage.join(out_dir, "ablation.png"),
               f"{key} when ablated alone")
  attention_explorer.write(loaded, rows, storage.join(out_dir, "explorer.html"), split=split)
  counts: dict[str, dict[str, int]] = {}
  for r in rows:
    if r.get("role") not in (None, "n/a"):
      counts.setdefault(r["stack"], {}).setdefault(r["role"], 0)
      counts[r["stack"]][r["role"]] += 1
  top = sorted(rows, key=lambda r: -r.get("importance_raw", 0.0))[:5]
  summary = {"role_counts": counts,
             "top_importance": [(r["head"], r.get("importance_raw")) for r in top]}
  if loo:
    worst = sorted(loo_rows, key=lambda r: r[key] if key == "delta_bleu" else -r[key])[:5]
    summary["largest_ablation_deltas"] = [
        {k: r[k] for k in r if k == "head" or k.startswith("delta_")} for r in worst]
  storage.write_json(storage.join(out_dir, "summary.json"), summary)
  return summary
