"""The experiment harness: the seed documents' claims (`claims/`: experiments, rules,
the primer page) and the benchmarks (`bench`, `bench_train`). It uses the library as a
user would; `mha_jax` never imports it, except the CLI's one hook (`verbs`), which adds
the harness's verbs `mha-jax claims`, `mha-jax primer` and `mha-jax bench ...`."""

import importlib.machinery
import importlib.util
import sys


def module_at(name: str, folder: str):
  """Module `name` from the file NAME.py in `folder` (a script, a test helper), imported
  once (kept in sys.modules), without putting `folder` on sys.path."""
  if name in sys.modules:
    return sys.modules[name]
  spec = importlib.machinery.PathFinder.find_spec(name, [folder])
  if spec is None:
    raise ModuleNotFoundError(f"no {name}.py in {folder}", name=name)
  module = importlib.util.module_from_spec(spec)
  sys.modules[name] = module
  spec.loader.exec_module(module)
  return module
