"""The pruning curve: BLEU (or loss) against heads kept, for L0, Michel and random, at the
same head counts, joined with the heads' roles from the dense model's analysis."""

from __future__ import annotations

import dataclasses
import time
from typing import Callable

import numpy as np

from mha_jax import settings, storage
from mha_jax.errors import UserError
from mha_jax.roles import head_roles
from mha_jax.models import common
from mha_jax.pruning import hard_concrete
from mha_jax.toolkit import head_masks
from mha_jax.pruning import methods
from mha_jax.pruning import prune as prune_lib
from mha_jax.settings import setting
from mha_jax.tasks import gates_hook
from mha_jax.train import lock as lock_lib
from mha_jax.toolkit import plots


@dataclasses.dataclass(frozen=True, kw_only=True)
class CurveOptions:
  """The settings of `prune_curve`."""
  counts: tuple[int, ...] = setting((48, 36, 24, 12, 6, 3, 0), lo=0,
                                    help="the head counts of the curve")
  stacks: tuple[str, ...] = setting(("encoder",), choices=tuple(common.STACKS),
                                    metavar="STACK[,STACK...]",
                                    help=f"attention stacks, of {', '.join(common.STACKS)} "
                                         f"(default: encoder)")
  bleu_limit: int = setting(0, lo=0, note=" (0 = all)", help="test BLEU sentences (0 = all)")
  random_draws: int = setting(1, lo=1, help="random pruning: the mean over this many "
                              "random orders")
  save_workdirs: tuple[int, ...] = setting((), lo=0, help="head counts (of counts) at "
                                           "which each method's pruned model is written "
                                           "as OUT/{method}_k{K}, ready for export-pruned")
  l0_lambda: float = setting(0.05, lo=0, help="l0 gates: the L0 penalty")
  steps: int = setting(200, lo=1, help="l0 gates: training steps")
  seed: int = setting(0, lo=0, help="the random seed (default: 0)")


def check_out(workdir: str, out: str) -> None:
  """`out` may take the curve: outside the workdir's managed folders, not a file."""
  lock_lib.check_out(out, workdir)
  if storage.exists(out) and not storage.isdir(out):   # refused now, not after the work
    raise UserError(f"out {out!r} is a file, not a folder", setting="out")


def prune_curve(loaded, out: str, opts: CurveOptions = CurveOptions(), *,
                  log: Callable[[str], None] = print) -> list[dict]:
  """Test metrics of the masks of the three methods at each head count. Random pruning is
  averaged over `random_draws` orders (seeds seed..seed+n-1; its kept heads and roles are
  the first draw's). For each K in `save_workdirs`, OUT/{method}_k{K} is written as a
  pruned workdir (as `mha-jax prune` writes it: ready for export-pruned)."""
  settings.check(opts)
  workdir, out_dir = loaded.workdir, out
  counts, stacks, lam, steps = opts.counts, opts.stacks, opts.l0_lambda, opts.steps
  bleu_limit, seed, random_draws = opts.bleu_limit, opts.seed, opts.random_draws
  save_workdirs, hc = opts.save_workdirs, hard_concrete.HardConcrete()
  check_out(workdir, out_dir)
  prune_lib.check_stacks(loaded.params, stacks)
  storage.makedirs(out_dir)
  total = head_masks.count(head_masks.ones_head_mask(loaded.params, stacks))
  for k in counts:
    if not 0 <= k <= total:
      raise UserError(f"counts: {k} is outside 0..{total} heads in {list(stacks)}",
                      setting="counts")
  for k in save_workdirs:
    if k not in counts:
      raise UserError(f"save_workdirs: {k} is not one of counts {list(counts)}",
                      setting=("save_workdirs", "counts"))
  for k in save_workdirs:       # refused now, not after the work
    for method in ("l0", "michel", "random"):
      d = storage.join(out_dir, f"{method}_k{k}")
      if storage.exists(d) and storage.listdir(d):
        raise UserError(f"save_workdirs: {d!r} exists and is not empty; refusing to "
                        f"overwrite it", setting="save_workdirs")
  roles = head_roles.role_of(head_roles.saved_or_head_roles(loaded, "test", log))
  is_tr = loaded.task.reports_bleu
  seconds = {}
  t0 = time.perf_counter()
  draws = [methods.random_masks(loaded, stacks=stacks, counts=list(counts), seed=seed + d)
           for d in range(random_draws)]
  masks: dict[str, dict[int, dict]] = {"random": draws[0]}
  masks["michel"] = methods.michel_masks(loaded, stacks=stacks, counts=list(counts), log=log)
  seconds["michel"] = time.perf_counter() - t0
  # One gate training serves every K (same lambda and seed): keep the top-K log_alpha.
  log(f"l0: training gates ({steps} steps, lambda {lam})")
  t0 = time.perf_counter()
  la, _, history = methods.train_gates(loaded, lam, stacks=stacks, steps=steps, seed=seed,
                                       hc=hc, log=log)
  seconds["l0_gate_training"] = time.perf_counter() - t0
  masks["l0"] = {k: methods.top_k_mask(la, k) for k in counts}
  gate_batch = {k: np.shape(v) for k, v in loaded.task.train_batch(0).items()
                if k in ("tokens", "src")}
  rows = []
  t0 = time.perf_counter()
  for method in ("l0", "michel", "random"):
    for k in sorted(counts, reverse=True):
      mask = masks[method][k]
      res = first = _evaluate(loaded, mask, is_tr, bleu_limit)
      if method == "random" and random_draws > 1:
        each = [res] + [_evaluate(loaded, d[k], is_tr, bleu_limit) for d in draws[1:]]
        res = {m: (float(np.mean([e[m] for e in each])) if isinstance(v, float) else v)
               for m, v in res.items()}
        res["draws"] = [{m: v for m, v in e.items() if isinstance(v, float)} for e in each]
      kept = head_masks.kept_names(mask)
      role_counts: dict[str, int] = {}
      for h in kept:
        role_counts[roles.get(h, "other")] = role_counts.get(roles.get(h, "other"), 0) + 1
      rows.append({"method": method, "kept": k, **res, "roles": role_counts,
                   "kept_heads": kept})
      log(f"{method:>6} K={k:>3}: " + " ".join(f"{m} {v:.4g}" for m, v in res.items()
                                              if isinstance(v, float)))
      if k in save_workdirs:
        prune_lib.write_workdir(loaded, storage.join(out_dir, f"{method}_k{k}"),
                              head_masks.mask_params(loaded.params, mask),
                              {"source": storage.abspath(workdir), "stacks": list(stacks),
                               "method": method, "keep": k, "mask": head_masks.head_mask_to_json(mask),
                               "kept": head_masks.count(mask), "kept_heads": kept, "after": first,
                               "from_curve": storage.abspath(out_dir)})
  seconds["evaluations"] = time.perf_counter() - t0
  storage.makedirs(out_dir)
  storage.write_json(storage.join(out_dir, "curve.json"),
                     {"workdir": workdir, "stacks": list(stacks), "lambda": lam, "steps": steps,
                      "gate_batch_shape": gate_batch, "random_draws": random_draws,
                      "seconds": seconds, "total": total, "l0_history": history, "rows": rows})
  storage.write_text(storage.join(out_dir, "curve.md"), format_curve(rows, is_tr) + "\n")
  plots.pruning_curve(rows, storage.join(out_dir, "curve.png"), curve_metric(rows, is_tr))
  return rows


def _evaluate(loaded, mask, is_tr, bleu_limit) -> dict:
  hook = gates_hook(loaded.task, head_masks.full_head_gates(loaded.params, mask))
  return loaded.task.evaluate(loaded.params, "test", bleu=is_tr, bleu_limit=bleu_limit,
                              hook=hook)


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
  """A markdown table: the metric of each method at each head count, and the roles of the
  heads each method keeps ("other" left out)."""
  metric = curve_metric(rows, is_tr)
  ks = sorted({r["kept"] for r in rows}, reverse=True)
  by = {(r["method"], r["kept"]): r for r in rows}
  names = ("l0", "michel", "random")
  lines = ["| heads kept | " + " | ".join(f"{m} {metric}" for m in names) + " | " +
           " | ".join(f"roles kept ({m})" for m in names) + " |",
           "|---:|---:|---:|---:|---|---|---|"]
  for k in ks:
    roles = [", ".join(f"{r} {n}" for r, n in sorted(by[(m, k)]["roles"].items())
                       if r != "other") or "-" for m in names]
    lines.append(f"| {k} | " + " | ".join(f"{by[(m, k)][metric]:.4g}" for m in names) +
                 " | " + " | ".join(roles) + " |")
  return "\n".join(lines)


