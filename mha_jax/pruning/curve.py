"""The pruning curve: BLEU (or loss) against heads kept, for L0, Michel and random, at the
same head counts, joined with the heads' roles from the dense model's analysis."""

from __future__ import annotations

import json
import os
from typing import Callable, Sequence

from mha_jax import storage
from mha_jax.errors import UserError
from mha_jax.analysis import report
from mha_jax.loader import load
from mha_jax.pruning import gates as G
from mha_jax.pruning import masks as M
from mha_jax.pruning import methods


def _roles(run, split, log) -> dict[str, str]:
  path = storage.join(run.workdir, "analysis", "heads.json")
  if storage.exists(path):
    return {r["head"]: r.get("role", "other") for r in storage.read_json(path)}
  log("roles: analysing the dense model first ...")
  task = run.config.task
  rows = (report.translation_roles(run, split) if task == "translation" else
          report.embedding_roles(run, split) if task == "embedding" else
          report.lm_roles(run, split))
  return {r["head"]: r["role"] for r in rows}


def pruning_curve(workdir: str, out_dir: str, *, counts: Sequence[int],
                  stacks: Sequence[str] = ("encoder",), lam: float = 0.05, steps: int = 200,
                  bleu_limit: int = 0, seed: int = 0, hc: G.HardConcrete = G.HardConcrete(),
                  log: Callable[[str], None] = print) -> list[dict]:
  run = load(workdir)
  if hasattr(run.model, "set_reference"):   # embeddings: compare with the dense model
    run.model.set_reference(run.params)
  total = M.count(M.ones_mask(run.params, stacks))
  for k in counts:
    if not 0 <= k <= total:
      raise UserError(f"--counts: {k} is outside 0..{total} heads in {list(stacks)}")
  roles = _roles(run, "test", log)
  is_tr = run.config.task == "translation"
  masks: dict[str, dict[int, dict]] = {"random": methods.random_masks(
      run, stacks=stacks, counts=list(counts), seed=seed)}
  masks["michel"] = methods.michel_masks(run, stacks=stacks, counts=list(counts), log=log)
  # One gate training serves every K (same lambda and seed): keep the top-K log_alpha.
  log(f"l0: training gates ({steps} steps, lambda {lam})")
  la, _, history = methods.train_gates(run, lam, stacks=stacks, steps=steps, seed=seed,
                                       hc=hc, log=log)
  masks["l0"] = {k: methods.top_k_mask(la, k) for k in counts}
  rows = []
  for method in ("l0", "michel", "random"):
    for k in sorted(counts, reverse=True):
      mask = masks[method][k]
      res = run.model.evaluate(run.params, "test", bleu=is_tr, bleu_limit=bleu_limit,
                               gates=M.full_gates(run.params, mask))
      kept = M.kept_names(mask)
      role_counts: dict[str, int] = {}
      for h in kept:
        role_counts[roles.get(h, "other")] = role_counts.get(roles.get(h, "other"), 0) + 1
      rows.append({"method": method, "kept": k, **res, "roles": role_counts,
                   "kept_heads": kept})
      log(f"{method:>6} K={k:>3}: " + " ".join(f"{m} {v:.4g}" for m, v in res.items()
                                              if isinstance(v, float)))
  storage.makedirs(out_dir)
  storage.write_json(storage.join(out_dir, "curve.json"),
                     {"workdir": workdir, "stacks": list(stacks), "lambda": lam, "steps": steps,
                      "total": total, "l0_history": history, "rows": rows})
  storage.write_text(storage.join(out_dir, "curve.md"), format_curve(rows, is_tr) + "\n")
  _plot(rows, storage.join(out_dir, "curve.png"), curve_metric(rows, is_tr))
  return rows


def curve_metric(rows: list[dict], is_tr: bool) -> str:
  """BLEU (translation), cosine to the dense model (embeddings), perplexity (imported
  LMs) or loss."""
  if is_tr:
    return "bleu"
  for m in ("cosine_to_full", "perplexity"):
    if rows and m in rows[0]:
      return m
  return "loss"


def format_curve(rows: list[dict], is_tr: bool) -> str:
  metric = curve_metric(rows, is_tr)
  ks = sorted({r["kept"] for r in rows}, reverse=True)
  by = {(r["method"], r["kept"]): r for r in rows}
  lines = [f"| heads kept | " + " | ".join(f"{m} {metric}" for m in ("l0", "michel", "random"))
           + " | roles kept (l0) |", "|---:|---:|---:|---:|---|"]
  for k in ks:
    roles = by[("l0", k)]["roles"]
    lines.append(f"| {k} | " + " | ".join(f"{by[(m, k)][metric]:.4g}" for m in
                                         ("l0", "michel", "random")) + " | " +
                 ", ".join(f"{r} {n}" for r, n in sorted(roles.items())) + " |")
  return "\n".join(lines)


def _plot(rows, path, metric):
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, ax = plt.subplots(figsize=(5, 3.5))
  for method in ("l0", "michel", "random"):
    rs = sorted((r for r in rows if r["method"] == method), key=lambda r: r["kept"])
    ax.plot([r["kept"] for r in rs], [r[metric] for r in rs], "o-", label=method)
  ax.set_xlabel("heads kept")
  ax.set_ylabel(f"test {metric}")
  ax.legend()
  fig.tight_layout()
  storage.savefig(fig, path, dpi=120)
  plt.close(fig)
