"""`mha-jax analyze`: roles, importance and ablations for a checkpoint, with plots.

Writes DIR/analysis/heads.json and heads.csv (one row per head), roles.png,
importance.png, ablation.png and explorer.html, and returns a summary.
"""

from __future__ import annotations

import csv
import json
import os
from typing import Callable

import numpy as np

from mha_jax.analysis import capture as capture_lib
from mha_jax.analysis import explorer, importance, roles
from mha_jax.data import vocab as V
from mha_jax.models import common as C

ROLE_COLORS = {"positional": "#1f77b4", "syntactic": "#2ca02c", "rare": "#d62728",
               "other": "#c7c7c7", "previous_token": "#1f77b4", "induction": "#9467bd",
               "duplicate_token": "#ff7f0e"}


def _rarest(words: list[str], freqs: dict[str, int]) -> int:
  return int(np.argmin([freqs.get(w, 0) for w in words]))


def translation_roles(run, split: str, limit: int = 0,
                      th: roles.Thresholds = roles.Thresholds()) -> list[dict]:
  """Role statistics of the encoder's and the decoder's self-attention heads."""
  task = run.model
  freqs_path = os.path.join(run.workdir, "data", "train_freqs.json")
  with open(freqs_path) as f:
    freqs = json.load(f)
  max_len = run.config.data.max_len + 1
  stats = {}
  arcs_all = task.arcs.get(split)
  src_words = task.words[split][0]
  offset = 0
  for batch, cap, weight in capture_lib.iter_captures(
      run, split, stacks=("encoder", "decoder_self"), limit=limit):
    n = int(weight.sum())
    idx = range(offset, offset + n)
    src = np.asarray(batch["src"])[:n]
    lengths = ((src != V.PAD_ID) & (src != V.EOS_ID)).sum(1)
    arcs = [arcs_all[i] for i in idx] if arcs_all else None
    rarest = np.array([_rarest(src_words[i], freqs) for i in idx])
    for stack in ("encoder", "decoder_self"):
      if stack not in stats:   # head counts as captured (pruned layers may differ)
        heads = [np.asarray(cap[stack][l].weights).shape[1] for l in sorted(cap[stack])]
        stats[stack] = roles.RoleStats(len(heads), heads, max_len)
    enc = cap["encoder"]
    stats["encoder"].update([np.asarray(enc[l].weights)[:n] for l in sorted(enc)], lengths,
                            arcs, rarest)
    tgt = np.asarray(batch["tgt"])[:n, :-1]
    t_len = ((tgt != V.PAD_ID) & (tgt != V.EOS_ID)).sum(1)
    dec = cap["decoder_self"]
    stats["decoder_self"].update([np.asarray(dec[l].weights)[:n] for l in sorted(dec)],
                                 t_len, None, None)
    offset += n
  rows = stats["encoder"].results("encoder", th)
  for r in stats["decoder_self"].results("decoder_self", th):
    r["role"] = "positional" if r["positional_share"] >= th.positional else "other"
    rows.append(r)
  return rows


def lm_roles(run, split: str, limit: int = 256, threshold: float = 0.4) -> list[dict]:
  sums, n = {}, 0
  for batch, cap, weight in capture_lib.iter_captures(run, split, stacks=("lm",), limit=limit):
    tokens = np.asarray(batch["tokens"])[:, :-1]
    for layer, r in cap["lm"].items():
      s = roles.lm_scores(np.asarray(r.weights), tokens)
      acc = sums.setdefault(layer, {k: 0 for k in s})
      for k, v in s.items():
        acc[k] = acc[k] + v
    n += 1
  rows = []
  for layer in sorted(sums):
    for h in range(len(sums[layer]["induction"])):
      row = {"head": f"lm.{layer}.{h}", "stack": "lm", "layer": layer, "index": h,
             **{k: float(v[h] / n) for k, v in sums[layer].items()}}
      best = max(("previous_token", "induction", "duplicate_token"), key=lambda k: row[k])
      row["role"] = best if row[best] >= threshold else "other"
      rows.append(row)
  return rows


def _plot_grid(rows, path, title):
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  stacks = list(dict.fromkeys(r["stack"] for r in rows))
  fig, axes = plt.subplots(1, len(stacks), figsize=(3.2 * len(stacks), 3.2), squeeze=False)
  for ax, stack in zip(axes[0], stacks):
    rs = [r for r in rows if r["stack"] == stack]
    for r in rs:
      ax.add_patch(plt.Rectangle((r["index"], r["layer"]), 0.95, 0.95,
                                 color=ROLE_COLORS.get(r["role"], "#c7c7c7")))
    ax.set_xlim(0, max(r["index"] for r in rs) + 1)
    ax.set_ylim(max(r["layer"] for r in rs) + 1, 0)
    ax.set_xlabel("head")
    ax.set_ylabel("layer")
    ax.set_title(stack)
  handles = [plt.Rectangle((0, 0), 1, 1, color=c) for r, c in ROLE_COLORS.items()
             if any(x["role"] == r for x in rows)]
  labels = [r for r in ROLE_COLORS if any(x["role"] == r for x in rows)]
  fig.legend(handles, labels, loc="lower center", ncol=len(labels), fontsize=8)
  fig.suptitle(title)
  fig.tight_layout(rect=(0, 0.08, 1, 1))
  fig.savefig(path, dpi=110)
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
  fig.savefig(path, dpi=110)
  plt.close(fig)


def write_rows(rows: list[dict], directory: str) -> None:
  with open(os.path.join(directory, "heads.json"), "w") as f:
    json.dump(rows, f, indent=1)
  keys = list(dict.fromkeys(k for r in rows for k in r))
  with open(os.path.join(directory, "heads.csv"), "w", newline="") as f:
    w = csv.DictWriter(f, fieldnames=keys)
    w.writeheader()
    w.writerows(rows)


def analyze(run, *, split: str = "test", out_dir: str | None = None, role_limit: int = 0,
            importance_limit: int = 512, loo: bool = True, loo_bleu_limit: int = 64,
            log: Callable[[str], None] = print) -> dict:
  """Roles, importance and single-head ablations for a loaded run; writes the report."""
  out_dir = out_dir or os.path.join(run.workdir, "analysis")
  os.makedirs(out_dir, exist_ok=True)
  is_tr = run.config.task == "translation"
  log("roles ...")
  rows = translation_roles(run, split, role_limit) if is_tr else lm_roles(run, split)
  by_name = {r["head"]: r for r in rows}
  log("importance (Michel et al.) ...")
  imp = importance.michel_importance(run, "valid", limit=importance_limit)
  for name, v in imp["normalized"].items():
    by_name.setdefault(name, {"head": name, "stack": name.split(".")[0],
                              "layer": int(name.split(".")[1]),
                              "index": int(name.split(".")[2]), "role": "n/a"})
    by_name[name]["importance"] = v
    by_name[name]["importance_raw"] = imp["raw"][name]
  loo_rows = []
  if loo:
    log(f"leave-one-out ablations of {len(by_name)} heads ...")
    loo_rows = importance.leave_one_out(run, split=split, bleu_limit=loo_bleu_limit)
    for r in loo_rows:
      for k, v in r.items():
        if k.startswith("delta_"):
          by_name[r["head"]][k] = v
  rows = list(by_name.values())
  write_rows(rows, out_dir)
  _plot_grid([r for r in rows if r.get("role") != "n/a"], os.path.join(out_dir, "roles.png"),
             f"head roles, {run.workdir}")
  names = [r["head"] for r in rows]
  _plot_bars(names, [r.get("importance", 0.0) for r in rows],
             os.path.join(out_dir, "importance.png"), "importance (normalised per layer)")
  key = "delta_bleu" if is_tr and loo else "delta_loss"
  if loo:
    _plot_bars(names, [r.get(key, 0.0) for r in rows], os.path.join(out_dir, "ablation.png"),
               f"{key} when ablated alone")
  explorer.write(run, rows, os.path.join(out_dir, "explorer.html"), split=split)
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
  with open(os.path.join(out_dir, "summary.json"), "w") as f:
    json.dump(summary, f, indent=1)
  return summary
