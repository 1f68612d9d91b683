"""`mha-jax analyze`: roles, importance and ablations for a checkpoint, with plots.

Writes DIR/analysis/heads.json and heads.csv (one row per head), roles.png,
importance.png, ablation.png and attention_explorer.html, and returns a summary.
"""

from __future__ import annotations

import csv
import io
from typing import Callable

import numpy as np

from mha_jax import loader, storage
from mha_jax.analysis import attention_explorer
from mha_jax.errors import UserError
from mha_jax.toolkit import importance, roles
from mha_jax.toolkit.head_roles import head_roles


GRID_SCORES = {"lm": ("previous_token", "duplicate_token", "induction", "sink_share",
                      "entropy", "importance"),
               "encoder": ("positional_share", "cls_share", "sep_share", "rare_share",
                           "confidence", "importance")}


def plot_score_grids(rows, path, keys, title=""):
  """One layer x head heat map per score (missing values blank)."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  keys = [k for k in keys if any(k in r for r in rows)]
  if not rows or not keys:
    return no_heads_figure(path, title)
  n_l = max(r["layer"] for r in rows) + 1
  n_h = max(r["index"] for r in rows) + 1
  fig, axes = plt.subplots(1, len(keys), figsize=(1.0 + 0.32 * n_h * len(keys) + 1.2 *
                                                  len(keys), 1.0 + 0.16 * n_l + 1),
                           squeeze=False)
  for ax, k in zip(axes[0], keys):
    grid = np.full((n_l, n_h), np.nan)
    for r in rows:
      if k in r and r[k] is not None:
        grid[r["layer"], r["index"]] = r[k]
    im = ax.imshow(grid, aspect="auto", cmap="viridis", interpolation="nearest")
    ax.set_title(k, fontsize=9)
    ax.set_xlabel("head")
    ax.set_ylabel("layer")
    fig.colorbar(im, ax=ax, fraction=0.05)
  fig.suptitle(title, fontsize=9)
  fig.tight_layout()
  storage.savefig(fig, path, dpi=100)
  plt.close(fig)


def no_heads_figure(path, title: str = "") -> None:
  """The figure of a model without attention heads (every head pruned: an ablation
  baseline): a note in place of a plot."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, ax = plt.subplots(figsize=(4, 1.6))
  ax.axis("off")
  ax.text(0.5, 0.5, "no attention heads in this model", ha="center", va="center")
  if title:
    fig.suptitle(title, fontsize=9)
  storage.savefig(fig, path, dpi=100)
  plt.close(fig)


def _plot_grid(rows, path, title):
  if not rows:
    return no_heads_figure(path, title)
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  stacks = list(dict.fromkeys(r["stack"] for r in rows))
  fig, axes = plt.subplots(1, len(stacks), figsize=(3.2 * len(stacks), 3.2), squeeze=False)
  for ax, stack in zip(axes[0], stacks):
    rs = [r for r in rows if r["stack"] == stack]
    for r in rs:
      ax.add_patch(plt.Rectangle((r["index"], r["layer"]), 0.95, 0.95,
                                 color=roles.ROLE_COLORS.get(r["role"], "#c7c7c7")))
    ax.set_xlim(0, max(r["index"] for r in rs) + 1)
    ax.set_ylim(max(r["layer"] for r in rs) + 1, 0)
    ax.set_xlabel("head")
    ax.set_ylabel("layer")
    ax.set_title(stack)
  handles = [plt.Rectangle((0, 0), 1, 1, color=c) for r, c in roles.ROLE_COLORS.items()
             if any(x["role"] == r for x in rows)]
  labels = [r for r in roles.ROLE_COLORS if any(x["role"] == r for x in rows)]
  fig.legend(handles, labels, loc="lower center", ncol=len(labels), fontsize=8)
  fig.suptitle(title)
  fig.tight_layout(rect=(0, 0.08, 1, 1))
  storage.savefig(fig, path, dpi=110)
  plt.close(fig)


def _plot_bars(names, values, path, ylabel, top=20):
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  order = np.argsort(-np.abs(np.asarray(values)))[:top]
  fig, ax = plt.subplots(figsize=(8, 3.2))
  ax.bar(range(len(order)), [values[i] for i in order])
  ax.set_xticks(range(len(order)), [names[i] for i in order], rotation=70, fontsize=7)
  ax.set_ylabel(ylabel)
  fig.tight_layout()
  storage.savefig(fig, path, dpi=110)
  plt.close(fig)


def write_rows(rows: list[dict], directory: str) -> None:
  storage.write_json(storage.join(directory, "heads.json"), rows)
  keys = list(dict.fromkeys(k for r in rows for k in r))
  f = io.StringIO(newline="")
  w = csv.DictWriter(f, fieldnames=keys)
  w.writeheader()
  w.writerows(rows)
  storage.write_text(storage.join(directory, "heads.csv"), f.getvalue())


def analyze(loaded, *, split: str = "test", out_dir: str | None = None, role_limit: int = 0,
            importance_limit: int = 512, loo: bool = True, loo_bleu_limit: int = 64,
            conllu: str | None = None, log: Callable[[str], None] = print) -> dict:
  """Roles, importance and single-head ablations for a loaded run; writes the report.
  `conllu`: a CoNLL-U file of input sentences for the syntactic roles of an encoder
  without its own arcs (an imported BERT; translation runs take data.conllu)."""
  if conllu and loaded.task.role_family != "embedding":
    raise UserError(f"--conllu is for imported encoders (task embedding); this run has "
                    f"task {loaded.task.name!r} (translation runs read data.conllu.<split> "
                    f"from their config)")
  out_dir = out_dir or storage.join(loaded.workdir, "analysis")
  storage.makedirs(out_dir)
  is_tr = loaded.task.reports_bleu
  if loaded.task.compares_to_dense:   # the loss: a distance to the dense model's outputs
    loader.set_dense_reference(loaded)
  if not loaded.task.trainable:       # imported models: 270 / 72 heads
    importance_limit = min(importance_limit, loaded.config.eval.batch_size * 2)
    if loaded.task.decoder_only and loo:
      log("leave-one-out skipped for an imported LM (270 evaluations); run "
          "`mha-jax ablate --each` for it")
      loo = False
  log("roles ...")
  rows = head_roles(loaded, split, role_limit, conllu=conllu)
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
  _plot_grid([r for r in rows if r.get("role") != "n/a"], storage.join(out_dir, "roles.png"),
             f"head roles, {loaded.workdir}")
  stack0 = rows[0]["stack"] if rows else None
  if stack0 in GRID_SCORES:
    plot_score_grids([r for r in rows if r["stack"] == stack0],
                     storage.join(out_dir, "scores.png"), GRID_SCORES[stack0],
                     f"per-head scores, {loaded.workdir}")
  names = [r["head"] for r in rows]
  _plot_bars(names, [r.get("importance", 0.0) for r in rows],
             storage.join(out_dir, "importance.png"), "importance (normalised per layer)")
  key = "delta_bleu" if is_tr and loo else "delta_loss"
  if loo:
    _plot_bars(names, [r.get(key, 0.0) for r in rows], storage.join(out_dir, "ablation.png"),
               f"{key} when ablated alone")
  attention_explorer.write(loaded, rows, storage.join(out_dir, "attention_explorer.html"), split=split)
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
