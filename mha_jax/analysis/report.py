"""`mha-jax analyze`: roles, importance and ablations for a checkpoint, with plots.

Writes DIR/analysis/heads.json and heads.csv (one row per head), roles.png,
importance.png, ablation.png and explorer.html, and returns a summary.
"""

from __future__ import annotations

import csv
import io
from typing import Callable

import numpy as np

from mha_jax import storage
from mha_jax.analysis import capture as capture_lib
from mha_jax.analysis import explorer, importance, roles, syntax
from mha_jax.data import vocab as V
from mha_jax.errors import UserError


def _rarest(words: list[str], freqs: dict[str, int]) -> int:
  return int(np.argmin([freqs.get(w, 0) for w in words]))


def translation_roles(run, split: str, limit: int = 0,
                      th: roles.Thresholds = roles.Thresholds()) -> list[dict]:
  """Role statistics of the encoder's and the decoder's self-attention heads."""
  task = run.task
  freqs_path = storage.join(run.workdir, "data", "train_freqs.json")
  freqs = storage.read_json(freqs_path)
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
  for batch, cap, _weight in capture_lib.iter_captures(run, split, stacks=("lm",), limit=limit):
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
      best = max(roles.LM_ROLES, key=lambda k: row[k])
      row["role"] = best if row[best] >= threshold else "other"
      rows.append(row)
  return rows


def real_lm_roles(run, split: str = "test", *, batches: int = 2, batch_size: int = 8,
                  half_len: int = 32, text_windows: int = 8, threshold: float = 0.4,
                  sink: float = 0.8, seed: int = 7_000_003) -> list[dict]:
  """Roles of every head of an LM over a real tokenizer (mha_jax.load of an imported
  model). On `batches` x `batch_size` sequences of repeated random tokens over the model's
  own vocabulary with its BOS ([BOS] r_1..r_n r_1..r_n, n = half_len): previous-token,
  duplicate-token and induction scores (lm_scores). On `text_windows` windows of the
  built-in text (split): the attention-sink share (weight on the first token) and the
  mean entropy. Role: the largest of the three scores if >= threshold, else
  "attention_sink" if the sink share >= sink, else "other"."""
  sums, n = {}, 0
  for i in range(batches):
    tokens, _ = run.task.repeated_tokens(seed + i, batch_size, half_len)
    cap = capture_lib.captured(run.task, run.params, {"tokens": tokens})
    for layer, r in enumerate(cap["lm"]):
      acc = sums.setdefault(layer, {})
      for k, v in roles.lm_scores(np.asarray(r.weights), tokens[:, :-1]).items():
        acc[k] = acc.get(k, 0) + v
    n += 1
  text = {}
  for batch, cap, weight in capture_lib.iter_captures(
      run, split, stacks=("lm",), batch_size=run.config.eval.batch_size, limit=text_windows):
    valid = np.broadcast_to(weight[:, None] > 0, np.asarray(batch["tokens"])[:, :-1].shape)
    for layer, r in cap["lm"].items():
      acc = text.setdefault(layer, {"sink": 0, "entropy": 0, "n": 0})
      w = np.asarray(r.weights)
      acc["sink"] = acc["sink"] + roles.first_token_share(w, valid) * valid[:, 1:].sum()
      acc["entropy"] = acc["entropy"] + roles.entropy(w, valid) * valid.sum()
      acc["n"] += valid.sum()
  rows = []
  for layer in sorted(sums):
    t = text[layer]
    for h in range(len(sums[layer]["induction"])):
      row = {"head": f"lm.{layer}.{h}", "stack": "lm", "layer": layer, "index": h,
             **{k: float(v[h] / n) for k, v in sums[layer].items()},
             "sink_share": float(t["sink"][h] / max(t["n"] - text_windows, 1)),
             "entropy": float(t["entropy"][h] / max(t["n"], 1))}
      best = max(roles.LM_ROLES, key=lambda k: row[k])
      row["role"] = (best if row[best] >= threshold else
                     "attention_sink" if row["sink_share"] >= sink else "other")
      rows.append(row)
  return rows


def embedding_roles(run, split: str = "test", limit: int = 0,
                    th: roles.Thresholds = roles.Thresholds(), special: float = 0.5,
                    conllu: str | None = None) -> list[dict]:
  """Roles of every encoder head of a BERT encoder on paragraphs of the built-in text:
  Voita et al.'s positional (90 % rule) and rare-token statistics over the real tokens
  ([CLS] and [SEP] included as positions; the rarest token is the least frequent
  wordpiece of the train split, [CLS]/[SEP] excluded), and the attention on [CLS] and on
  [SEP]. Role: positional > syntactic > cls > sep > rare > other ("cls"/"sep" when that
  share >= `special`). Syntactic needs arcs: with `conllu` (a CoNLL-U file of input
  sentences) each head's dependency accuracy is measured on those sentences, words
  aligned to wordpieces (analysis.syntax), and a head is syntactic by the translation
  models' rule; without it no head is syntactic."""
  syn = syntax.conllu_syntax(run, conllu, th) if conllu else {}
  task = run.task
  freqs = np.zeros(task.vocab_size, np.int64)
  for ids in task.tokenizer.encode_batch(task.paragraphs()["train"]):
    np.add.at(freqs, ids, 1)
  stats, special_sums, n_q = None, {}, 0
  for batch, cap, weight in capture_lib.iter_captures(run, split, stacks=("encoder",),
                                                      limit=limit):
    n = int(weight.sum())
    lengths = np.asarray(batch["mask"]).sum(1)[:n]
    tok = np.asarray(batch["tokens"])[:n]
    rarest = np.array([1 + int(np.argmin(freqs[tok[b, 1:max(lengths[b] - 1, 2)]]))
                       for b in range(n)])
    enc = cap["encoder"]
    if stats is None:
      heads = [np.asarray(enc[l].weights).shape[1] for l in sorted(enc)]
      stats = roles.RoleStats(len(heads), heads, int(run.config.eval.seq_len))
    ws = [np.asarray(enc[l].weights)[:n] for l in sorted(enc)]
    stats.update(ws, lengths, None, rarest)
    q = int(lengths.sum())
    for l, w in enumerate(ws):
      for k, v in roles.special_token_shares(w, lengths).items():
        special_sums.setdefault(l, {}).setdefault(k, 0)
        special_sums[l][k] = special_sums[l][k] + v * q
    n_q += q
  rows = stats.results("encoder", th)
  for r in rows:
    if syn:
      r.update(syn[r["head"]])
      r["role"] = roles.assign_role(r, th)
    for k in ("cls_share", "sep_share"):
      r[k] = float(special_sums[r["layer"]][k][r["index"]] / max(n_q, 1))
    if r["role"] in ("rare", "other"):
      if r["cls_share"] >= special:
        r["role"] = "cls"
      elif r["sep_share"] >= special:
        r["role"] = "sep"
  return rows


GRID_SCORES = {"lm": ("previous_token", "duplicate_token", "induction", "sink_share",
                      "entropy", "importance"),
               "encoder": ("positional_share", "cls_share", "sep_share", "rare_share",
                           "confidence", "importance")}


def head_roles(run, split: str = "test", limit: int = 0, *, conllu: str | None = None
               ) -> list[dict]:
  """Every head's role statistics and role, by the run's task (the one dispatch)."""
  family = run.task.role_family
  if family == "translation":
    return translation_roles(run, split, limit)
  if family == "embedding":
    return embedding_roles(run, split, limit, conllu=conllu)
  if family == "real_lm":
    return real_lm_roles(run, split)
  return lm_roles(run, split)


def saved_or_head_roles(run, split: str = "test", log: Callable[[str], None] = print
                        ) -> list[dict]:
  """The rows of the run's analysis/heads.json when `analyze` wrote one, else
  head_roles(run, split) computed now."""
  path = storage.join(run.workdir, "analysis", "heads.json")
  if storage.exists(path):
    return storage.read_json(path)
  log("roles: analysing the dense model first ...")
  return head_roles(run, split)


def role_of(rows: list[dict]) -> dict[str, str]:
  """head name -> role ("other" where a row has none)."""
  return {r["head"]: r.get("role", "other") for r in rows}


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


def analyze(run, *, split: str = "test", out_dir: str | None = None, role_limit: int = 0,
            importance_limit: int = 512, loo: bool = True, loo_bleu_limit: int = 64,
            conllu: str | None = None, log: Callable[[str], None] = print,
            taxonomy_roles: str | None = None) -> dict:
  """Roles, importance and single-head ablations for a loaded run; writes the report.
  `conllu`: a CoNLL-U file of input sentences for the syntactic roles of an encoder
  without its own arcs (an imported BERT; translation runs take data.conllu).
  Imported LMs (and LMs given `taxonomy_roles`, "a,b"): analysis.taxonomy's roles,
  checked causally, into roles.json and taxonomy.png; the rows take its roles."""
  if conllu and run.task.role_family != "embedding":
    raise UserError(f"--conllu is for imported encoders (task embedding); this run has "
                    f"task {run.task.name!r} (translation runs read data.conllu.<split> "
                    f"from their config)")
  out_dir = out_dir or storage.join(run.workdir, "analysis")
  storage.makedirs(out_dir)
  is_tr = run.task.reports_bleu
  if run.task.compares_to_dense:   # the loss: a distance to the dense model's outputs
    from mha_jax.pruning import run as prune_run
    prune_run.set_dense_reference(run)
  if not run.task.trainable:       # imported models: 270 / 72 heads
    importance_limit = min(importance_limit, run.config.eval.batch_size * 2)
    if run.task.decoder_only and loo:
      log("leave-one-out skipped for an imported LM (270 evaluations); run "
          "`mha-jax ablate --each` for it")
      loo = False
  log("roles ...")
  rows = head_roles(run, split, role_limit, conllu=conllu)
  if run.task.decoder_only and (run.task.role_family == "real_lm" or taxonomy_roles):
    from mha_jax.analysis import taxonomy
    doc = taxonomy.taxonomy(run, rows, taxonomy.Settings(
        roles=taxonomy.parse_roles(taxonomy_roles)), log)
    taxonomy.write(doc, out_dir, f"head roles, {run.workdir}")
    for r in rows:
      r["role"] = doc["assigned"].get(r["head"], r["role"])
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
  _plot_grid([r for r in rows if r.get("role") != "n/a"], storage.join(out_dir, "roles.png"),
             f"head roles, {run.workdir}")
  stack0 = rows[0]["stack"] if rows else None
  if stack0 in GRID_SCORES:
    plot_score_grids([r for r in rows if r["stack"] == stack0],
                     storage.join(out_dir, "scores.png"), GRID_SCORES[stack0],
                     f"per-head scores, {run.workdir}")
  names = [r["head"] for r in rows]
  _plot_bars(names, [r.get("importance", 0.0) for r in rows],
             storage.join(out_dir, "importance.png"), "importance (normalised per layer)")
  key = "delta_bleu" if is_tr and loo else "delta_loss"
  if loo:
    _plot_bars(names, [r.get(key, 0.0) for r in rows], storage.join(out_dir, "ablation.png"),
               f"{key} when ablated alone")
  explorer.write(run, rows, storage.join(out_dir, "explorer.html"), split=split)
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
