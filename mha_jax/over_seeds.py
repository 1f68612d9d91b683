"""A verb over a multi-seed workdir (`train.seeds`): the study on each seed, then what the
seeds share. `over_seeds(EVAL | ANALYZE | CURVE, workdir, ...)` serves `eval`, `analyze`
and `prune-curve`: one line of JSON per seed then their mean and std; each seed's report
then the role stability across seeds; each seed's curve then its mean and spread."""

from __future__ import annotations

import dataclasses
import json
from typing import Callable

from mha_jax import loader, storage
from mha_jax.analysis import analyze as analysis_report
from mha_jax.pruning import prune_curve as curve_lib
from mha_jax.tasks.base import EvalOptions
from mha_jax.roles import head_roles
from mha_jax.toolkit import stability
from mha_jax.train import seeds as seeds_lib


@dataclasses.dataclass(frozen=True)
class SeedStudy:
  """A study over seeds. `each(loaded, seed_out, opts, seed, log) -> result` runs it on
  one seed, `across({seed: result}, out, opts, seeds) -> text` writes (into `out`) and
  says what the seeds share. A seed's output is OUT/seed_<s> when --out is given, else
  `folder` in that seed's workdir."""
  each: Callable
  across: Callable
  folder: str | None = None


def over_seeds(study: SeedStudy, workdir: str, out: str | None, opts, *,
               out_given: str | None = None, step: int | None = None,
               log: Callable[[str], None] = print) -> str:
  """Runs `study` on each seed of multi-seed `workdir` (checkpoint `step`, default the
  latest), then across them into `out`; returns the text that says so."""
  seeds = seeds_lib.seed_workdirs(workdir)
  results = {}
  for s, wd in seeds:
    seed_out = (storage.join(out_given, f"seed_{s}") if out_given
                else storage.join(wd, study.folder) if study.folder else None)
    results[s] = study.each(loader.load_workdir(wd, step=step), seed_out, opts,
                            (s, wd), log)
  return study.across(results, out, opts, workdir)


def evaluate(loaded, opts: EvalOptions) -> dict:
  """The task's evaluation of `loaded` on `opts.split`."""
  return loaded.task.evaluate(loaded.params, opts.split)


def _eval_each(loaded, seed_out, opts: EvalOptions, seed, log) -> dict:
  res = evaluate(loaded, opts)
  log(json.dumps({"workdir": seed[1], "seed": seed[0], "step": loaded.step,
                  "split": opts.split, **res}))
  return res


def _eval_across(results: dict, out, opts: EvalOptions, workdir: str) -> str:
  rows = list(results.values())
  return json.dumps({"workdir": workdir, "seeds": list(results), "split": opts.split, **{
      f"{k}_{name}": v for k in rows[0]
      for name, v in stability.stats([r[k] for r in rows]).items()
      if name in ("mean", "std")}})


def _analyze_each(loaded, seed_out: str, opts, seed, log) -> str:
  log(f"seed {seed[0]}: analysing {seed[1]} into {seed_out} ...")
  if opts.roles_only:   # roles alone, beside (not over) a full report
    path = storage.join(seed_out, "roles_only.json")
    storage.makedirs(seed_out)
    storage.write_json(path, head_roles.head_roles(loaded, opts.split))
    return path
  analysis_report.analyze(loaded, seed_out, opts, log=lambda m: None)
  return storage.join(seed_out, "heads.json")


def _analyze_across(heads: dict, out: str, opts, workdir: str) -> str:
  rep = stability.write_role_stability(heads, out)
  return (f"{stability.format_roles(rep)}\nwrote {out}/ (stability.json, stability.md, "
          f"stability.png) and each seed's analysis")


def _curve_each(loaded, seed_out: str, opts, seed, log) -> tuple[str, str]:
  log(f"seed {seed[0]}: pruning curve of {seed[1]} into {seed_out} ...")
  rows = curve_lib.prune_curve(loaded, seed_out, opts, log=lambda m: None)
  return curve_lib.curve_metric(rows, "bleu" in rows[0]), storage.join(seed_out, "curve.json")


def _curve_across(curves: dict, out: str, opts, workdir: str) -> str:
  metric = list(curves.values())[-1][0]
  rep = stability.write_curve_stability({s: p for s, (_, p) in curves.items()}, out, metric)
  return (f"{stability.format_curve(rep)}\nwrote {out}/curve_stability.json, .md, .png and "
          f"each seed's curve")


EVAL = SeedStudy(_eval_each, _eval_across)
ANALYZE = SeedStudy(_analyze_each, _analyze_across, "analysis")
CURVE = SeedStudy(_curve_each, _curve_across, "pruning_curve")
