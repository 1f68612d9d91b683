"""How stable head roles and pruning curves are across the seeds of a multi-seed run.

Heads are only defined up to a permutation within a layer, so stability is measured per
layer: for every (stack, layer, role), in how many seeds at least one head of that layer
has the role, and the mean and spread (sample std) over seeds of how many heads have it.
Pruning curves: for every method and head count, the mean, std, min and max over seeds
of the curve's metric (BLEU for translation), and the roles the L0 gates keep.

Inputs are the per-seed outputs of `mha-jax analyze` (heads.json) and `mha-jax
prune-curve` (curve.json); outputs: stability.json, stability.md, stability.png (roles)
and curve_stability.json, .md, .png (pruning).
"""

from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np

from mha_jax import storage
from mha_jax.roles.role_scores import ROLE_ORDER, STACK_ROLES
from mha_jax.toolkit import plots


def stats(values: Sequence[float]) -> dict:
  """Mean, std (ddof 1; 0 for one value), min and max over seeds."""
  v = np.asarray(values, np.float64)
  return {"mean": float(v.mean()), "std": float(v.std(ddof=1)) if len(v) > 1 else 0.0,
          "min": float(v.min()), "max": float(v.max())}


def appears_at(by_step: Sequence[tuple[int, float | None]], threshold: float) -> int | None:
  """The step from which a score stays >= threshold at every later checkpoint, the last
  included, over (step, score) pairs in step order; None if the last is below it (or
  None): a transient, e.g. near initialisation, is no appearance. The phase change
  (compare_runs) and the step at which a head role appears (roles.role_steps)."""
  step = None
  for s, v in by_step:
    ok = v is not None and v >= threshold
    step = (s if step is None else step) if ok else None
  return step


def _ordered(roles) -> list[str]:
  roles = set(roles)
  return [r for r in ROLE_ORDER if r in roles] + sorted(roles - set(ROLE_ORDER))


def role_stability(rows_by_seed: Mapping[int, list[dict]]) -> dict:
  """The stability report from {seed: heads.json rows}."""
  seeds = list(rows_by_seed)
  per_seed: dict[int, dict[tuple[str, int], dict[str, int]]] = {}
  layers: dict[str, set[int]] = {}
  roles = set()
  for s, rows in rows_by_seed.items():
    counts = per_seed.setdefault(s, {})
    for r in rows:
      role = r.get("role")
      if role in (None, "n/a"):
        continue
      roles.add(role)
      layers.setdefault(r["stack"], set()).add(int(r["layer"]))
      cell = counts.setdefault((r["stack"], int(r["layer"])), {})
      cell[role] = cell.get(role, 0) + 1
  for stack in layers:
    roles.update(STACK_ROLES.get(stack, ()))
  roles = _ordered(roles)
  table = []
  for stack, ls in layers.items():
    for layer in sorted(ls):
      for role in roles:
        heads = [per_seed[s].get((stack, layer), {}).get(role, 0) for s in seeds]
        table.append({"stack": stack, "layer": layer, "role": role,
                      "seeds_with_role": sum(h > 0 for h in heads),
                      "heads_per_seed": heads, **{f"heads_{k}": v for k, v in
                                                  stats(heads).items()}})
  totals = {}
  for stack in layers:
    for role in roles:
      per = [sum(c.get(role, 0) for (st, _), c in per_seed[s].items() if st == stack)
             for s in seeds]
      totals.setdefault(stack, {})[role] = {"per_seed": per, **stats(per),
                                            "seeds_with_role": sum(p > 0 for p in per)}
  return {"seeds": seeds, "n_seeds": len(seeds), "roles": roles, "layers": table,
          "totals": totals}


def format_roles(rep: dict, roles: Sequence[str] | None = None) -> str:
  """Markdown: one row per (stack, layer); per role "k/N seeds, mean ± std heads"."""
  roles = [r for r in (roles or rep["roles"]) if r in rep["roles"]]
  n = rep["n_seeds"]
  by = {(r["stack"], r["layer"], r["role"]): r for r in rep["layers"]}
  cells = lambda r: (f"{r['seeds_with_role']}/{n} ({r['heads_mean']:.1f} ± "
                     f"{r['heads_std']:.1f})")
  lines = [f"Seeds {rep['seeds']}. Each cell: seeds with at least one head of the role in "
           f"that layer / {n} (heads of the role per seed, mean ± std).", "",
           "| stack | layer | " + " | ".join(roles) + " |",
           "|---|---:|" + "---|" * len(roles)]
  keys = sorted({(r["stack"], r["layer"]) for r in rep["layers"]},
                key=lambda k: (list(rep["totals"]).index(k[0]), k[1]))
  for stack, layer in keys:
    lines.append(f"| {stack} | {layer} | " +
                 " | ".join(cells(by[(stack, layer, role)]) for role in roles) + " |")
  for stack, tot in rep["totals"].items():
    lines.append(f"| {stack} | all | " + " | ".join(
        f"{tot[role]['seeds_with_role']}/{n} ({tot[role]['mean']:.1f} ± "
        f"{tot[role]['std']:.1f})" for role in roles) + " |")
  return "\n".join(lines)


def _write_report(json_by_seed: Mapping[int, str], out_dir: str, name: str, build, fmt,
                  plot) -> dict:
  """Reads each seed's JSON, builds the report, writes name.{json,md,png} into out_dir."""
  rep = build({s: storage.read_json(path) for s, path in json_by_seed.items()})
  rep["sources"] = {str(s): p for s, p in json_by_seed.items()}
  storage.makedirs(out_dir)
  storage.write_json(storage.join(out_dir, f"{name}.json"), rep)
  storage.write_text(storage.join(out_dir, f"{name}.md"), fmt(rep) + "\n")
  plot(rep, storage.join(out_dir, f"{name}.png"))
  return rep


def write_role_stability(heads_json_by_seed: Mapping[int, str], out_dir: str) -> dict:
  """Reads each seed's heads.json, writes stability.{json,md,png} into out_dir."""
  return _write_report(heads_json_by_seed, out_dir, "stability", role_stability,
                       format_roles, plots.stability_roles)


# ------------------------------------------------------------------ pruning curves
def curve_stability(curves_by_seed: Mapping[int, dict], metric: str) -> dict:
  """From {seed: curve.json contents}: per (method, heads kept), the metric's mean, std,
  min, max over seeds, and the mean number of heads of each role that are kept."""
  seeds = list(curves_by_seed)
  cells: dict[tuple[str, int], list[dict]] = {}
  for s in seeds:
    for r in curves_by_seed[s]["rows"]:
      cells.setdefault((r["method"], int(r["kept"])), []).append(r)
  rows = []
  for (method, kept), rs in sorted(cells.items(), key=lambda kv: (kv[0][0], -kv[0][1])):
    roles = sorted({k for r in rs for k in r.get("roles", {})})
    rows.append({"method": method, "kept": kept, "n": len(rs),
                 "values": [r[metric] for r in rs], **stats([r[metric] for r in rs]),
                 "roles_kept_mean": {k: float(np.mean([r.get("roles", {}).get(k, 0)
                                                       for r in rs])) for k in roles}})
  return {"seeds": seeds, "n_seeds": len(seeds), "metric": metric, "rows": rows}


def format_curve(rep: dict) -> str:
  methods = list(dict.fromkeys(r["method"] for r in rep["rows"]))
  by = {(r["method"], r["kept"]): r for r in rep["rows"]}
  ks = sorted({r["kept"] for r in rep["rows"]}, reverse=True)
  lines = [f"Test {rep['metric']} over seeds {rep['seeds']}: mean ± std (min-max).", "",
           "| heads kept | " + " | ".join(methods) + " | roles kept by l0 (mean) |",
           "|---:|" + "---|" * (len(methods) + 1)]
  for k in ks:
    cell = lambda r: (f"{r['mean']:.4g} ± {r['std']:.2g} ({r['min']:.4g}-{r['max']:.4g})"
                      if r else "")
    roles = (by.get(("l0", k)) or {}).get("roles_kept_mean", {})
    lines.append(f"| {k} | " + " | ".join(cell(by.get((m, k))) for m in methods) + " | " +
                 ", ".join(f"{r} {v:.1f}" for r, v in sorted(roles.items())) + " |")
  return "\n".join(lines)


def write_curve_stability(curve_json_by_seed: Mapping[int, str], out_dir: str,
                          metric: str) -> dict:
  """Reads each seed's curve.json, writes curve_stability.{json,md,png} into out_dir."""
  return _write_report(curve_json_by_seed, out_dir, "curve_stability",
                       lambda curves: curve_stability(curves, metric), format_curve,
                       plots.stability_curve)
