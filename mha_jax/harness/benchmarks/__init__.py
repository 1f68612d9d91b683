"""The benchmarks of `mha-jax bench NAME` (beside `bench attention` and `bench train`,
mha_jax/harness/bench.py and bench_train.py). Each module `bench_NAME.py` here declares one
`*Options` dataclass of `mha_jax.settings.setting` fields, from which the verb's flags are
generated, and `run(opts) -> exit status`, which prints a table and writes JSON (`--out`).
Its docstring's first paragraph is the verb's help. A module that sets `OVERRIDES = True`
also takes a training config's `--config.KEY=VALUE` overrides: `run(opts, overrides)`.
A benchmark that starts `mha-jax` as a fresh process runs this checkout's package
(`child_env`), never one found elsewhere. Adding one: a module here and its name in NAMES;
its test runs it through `mha_jax.cli.main` at tiny sizes."""

from __future__ import annotations

import dataclasses
import importlib
import os

# `mha-jax bench NAME` -> mha_jax.harness.benchmarks.bench_NAME (NAME with "_" for "-")
NAMES = ("ab-attention", "attention-parts", "bf16-drift", "circuit", "compile-cache",
         "eap-peer", "import-peak", "mib-circuit", "models", "moe-import", "notebook",
         "patching", "plan-heads", "pruned", "scale-1b", "seeds", "window")

# The folder holding this checkout's `mha_jax` (a benchmark's fresh processes import it).
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))))


def child_env(**extra) -> dict:
  """This process's environment for a fresh `python -m mha_jax.cli` (or `-c`) process,
  with this checkout's package first on its PYTHONPATH, and `extra` set."""
  path = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH", "")) if p)
  return {**os.environ, "PYTHONPATH": path, **extra}


def options_of(module) -> type:
  """The one `*Options` dataclass a benchmark module declares."""
  found = [v for k, v in vars(module).items() if k.endswith("Options")
           and dataclasses.is_dataclass(v) and v.__module__ == module.__name__]
  if len(found) != 1:
    raise TypeError(f"{module.__name__} declares {len(found)} *Options classes; one expected")
  return found[0]


def verb(name: str):
  """The `bench NAME` verb: flags from the module's options, its call the module's run."""
  from mha_jax.cli import Verb    # not at import: a benchmark's subprocess stays light
  module = importlib.import_module(f"{__name__}.bench_{name.replace('-', '_')}")
  help = " ".join(module.__doc__.strip().split("\n\n")[0].split())   # its first paragraph
  if getattr(module, "OVERRIDES", False):
    return Verb(help, lambda args, opts: module.run(opts, args.extra), options_of(module),
                config="training")
  return Verb(help, lambda args, opts: module.run(opts), options_of(module), config=None)


def verbs() -> dict:
  return {name: verb(name) for name in NAMES}
