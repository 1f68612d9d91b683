"""The pruning curve: BLEU (or loss) against heads kept, for L0, Michel and random, at the
same head counts, joined with the heads' roles from the dense model's analysis."""

from __future__ import annotations

import time
from typing import Callable, Sequence

import numpy as np

from mha_jax import storage
from mha_jax.errors import UserError
from mha_jax.toolkit import head_roles
from mha_jax.loader import load, set_dense_reference
from mha_jax.pruning import gates as gates_lib
from mha_jax.toolkit import masks as masks_lib
from mha_jax.pruning import methods
from mha_jax.pruning import prune as prune_lib
from mha_jax.train import lock as lock_lib
from mha_jax.toolkit import plots


def pruning_curve(workdir: str, out_dir: str, *, counts: Sequence[int],
                  stacks: Sequence[str] = ("encoder",), lam: float = 0.05, steps: int = 200,
                  bleu_limit: int = 0, seed: int = 0, hc: gates_lib.HardConcrete = gates_lib.HardConcrete(),
                  random_draws: int = 1, save_workdirs: Sequence[int] = (),
                  log: Callable[[str], None] = print) -> list[dict]:
  """Test metrics of the masks of the three methods at each head count. Random pruning is
  averaged over `random_draws` orders (seeds seed..seed+n-1; its kept heads and roles are
  the first draw's). For each K in `save_workdirs`, OUT/{method}_k{K} is written as a
  pruned workdir (as `mha-jax prune` writes it: ready for export-pruned)."""
  lock_lib.check_out(out_dir, workdir)
  if storage.exists(out_dir) and not storage.isdir(out_dir):   # refused now, not after
    raise UserError(f"--out {out_dir!r} is a file, not a folder")
  loaded = load(workdir)
  storage.makedirs(out_dir)
  set_dense_reference(loaded)       # embeddings: compare with the dense model
  total = masks_lib.count(masks_lib.ones_mask(loaded.params, stacks))
  for k in counts:
    if not 0 <= k <= total:
      raise UserError(f"--counts: {k} is outside 0..{total} heads in {list(stacks)}")
  for k in save_workdirs:
    if k not in counts:
      raise UserError(f"--save-workdirs: {k} is not one of --counts {list(counts)}")
  if random_draws < 1:
    raise UserError(f"--random-draws must be >= 1; got {random_draws}")
  for k in save_workdirs:       # refused now, not after the work
    for method in ("l0", "michel", "random"):
      d = storage.join(out_dir, f"{method}_k{k}")
      if storage.exists(d) and storage.listdir(d):
        raise UserError(f"--save-workdirs: {d!r} exists and is not empty; refusing to "
                        f"overwrite it")
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
      kept = masks_lib.kept_names(mask)
      role_counts: dict[str, int] = {}
      for h in kept:
        role_counts[roles.get(h, "other")] = role_counts.get(roles.get(h, "other"), 0) + 1
      rows.append({"method": method, "kept": k, **res, "roles": role_counts,
                   "kept_heads": kept})
      log(f"{method:>6} K={k:>3}: " + " ".join(f"{m} {v:.4g}" for m, v in res.items()
                                              if isinstance(v, float)))
      if k in save_workdirs:
        prune_lib.write_workdir(loaded, storage.join(out_dir, f"{method}_k{k}"),
                              masks_lib.mask_params(loaded.params, mask),
                              {"source": storage.abspath(workdir), "stacks": list(stacks),
                               "method": method, "keep": k, "mask": masks_lib.mask_to_json(mask),
                               "kept": masks_lib.count(mask), "kept_heads": kept, "after": first,
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
  return loaded.task.evaluate(loaded.params, "test", bleu=is_tr, bleu_limit=bleu_limit,
                            gates=masks_lib.full_gates(loaded.params, mask))


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


