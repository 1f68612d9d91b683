"""Multi-seed workdirs: N runs of one config (train.seeds) trained as one vmapped program.

Layout of a multi-seed workdir DIR:
  DIR/seeds.json         the manifest: the seeds, their workdirs, the config as given
  DIR/seed_<s>/          an ordinary workdir per seed s (config.json with seed=s,
                         train.seeds="1" and that seed's data order; checkpoints, metrics)

Each DIR/seed_<s> is a plain run: `mha_jax.load` and every command take it as it is, and
training its config.json alone gives the same params as the vmapped run (to float
rounding). Commands that understand a multi-seed workdir (analyze, prune-curve) run
their per-seed work in each seed's workdir and write a report across seeds into DIR.
"""

from __future__ import annotations

import json

import ml_collections

from mha_jax import config as mc
from mha_jax import storage
from mha_jax.errors import UserError

MANIFEST = "seeds.json"


def seed_config(cfg: ml_collections.ConfigDict, seed: int) -> ml_collections.ConfigDict:
  """The config of one seed of a multi-seed run: seed=s, train.seeds="1", and its own
  data order (train.shuffle_seed=s, unless the config fixed one for every seed)."""
  out = mc.from_dict(mc.to_dict(cfg))
  with out.unlocked():
    out.seed = seed
    out.train.seeds = "1"
    if out.train.get("shuffle_seed", -1) < 0:
      out.train.shuffle_seed = seed
  return out


def seed_dir(workdir: str, seed: int) -> str:
  return storage.join(workdir, f"seed_{seed}")


def is_multi_seed(workdir: str) -> bool:
  return storage.isfile(storage.join(workdir, MANIFEST))


def read_manifest(workdir: str) -> dict:
  path = storage.join(workdir, MANIFEST)
  try:
    man = storage.read_json(path)
  except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
    raise UserError(f"{path} is not a readable multi-seed manifest ({e})") from None
  if not isinstance(man, dict) or not isinstance(man.get("seeds"), list):
    raise UserError(f"{path} has no list of seeds; not a multi-seed manifest")
  return man


def seed_workdirs(workdir: str) -> list[tuple[int, str]]:
  """[(seed, its workdir)] of a multi-seed workdir, in the manifest's order."""
  man = read_manifest(workdir)
  return [(int(s), storage.join(workdir, d)) for s, d in zip(man["seeds"], man["workdirs"])]


def plan(cfg, workdir: str) -> list[tuple[ml_collections.ConfigDict, str]]:
  """Checks `workdir` for a multi-seed run of cfg; returns [(seed config, seed workdir)].
  Writes nothing (write_manifest does, once every check has passed).

  Refuses (UserError, nothing touched) a workdir that holds a single run, or a
  multi-seed run of other seeds or of another config."""
  seeds = mc.seed_list(cfg)
  if storage.exists(storage.join(workdir, "config.json")):
    raise UserError(f"workdir {workdir!r} holds a single run (config.json); a multi-seed "
                    f"run (train.seeds={cfg.train.seeds!r}) needs a new workdir", setting="workdir")
  new = mc.to_dict(cfg)
  if is_multi_seed(workdir):
    man = read_manifest(workdir)
    if man["seeds"] != seeds:
      raise UserError(f"workdir {workdir!r} holds seeds {man['seeds']}; train.seeds="
                      f"{cfg.train.seeds!r} asks for {seeds}. Use a new workdir", setting="workdir")
    bad = mc.incompatible_fields(mc.upgrade(man.get("config", {})), new)
    if bad:
      raise UserError(f"workdir {workdir!r} holds a multi-seed run of another config "
                      f"(fields {bad[:6]}); refusing to touch it. Use a new workdir",
                      setting="workdir")
  return runs(cfg, workdir)


def runs(cfg, workdir: str) -> list[tuple[ml_collections.ConfigDict, str]]:
  """[(seed config, seed workdir)] of a multi-seed run of cfg (reads nothing)."""
  return [(seed_config(cfg, s), seed_dir(workdir, s)) for s in mc.seed_list(cfg)]


def write_manifest(cfg, workdir: str) -> None:
  """DIR/seeds.json (process 0 writes; the others skip)."""
  seeds = mc.seed_list(cfg)
  storage.makedirs(workdir)
  storage.write_json(storage.join(workdir, MANIFEST),
                     {"seeds": seeds, "workdirs": [f"seed_{s}" for s in seeds],
                      "config": mc.to_dict(cfg)}, atomic=True)


def refuse_single(workdir: str) -> None:
  """A single-seed train into a multi-seed workdir is refused."""
  if is_multi_seed(workdir):
    seeds = read_manifest(workdir)["seeds"]
    raise UserError(f"workdir {workdir!r} holds a multi-seed run (seeds {seeds}); resume "
                    f"it with the same train.seeds, or train one seed in "
                    f"{seed_dir(workdir, seeds[0])!r}")
