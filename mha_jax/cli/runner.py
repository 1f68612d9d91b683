"""The one runner of the study verbs: `study(loaded, out, opts)`, between a check of
--out before any work and the text printed after."""

from __future__ import annotations

import dataclasses
import sys
from typing import Callable

from mha_jax import over_seeds, storage
from mha_jax.cli import outputs
from mha_jax.cli.verb import Verb


def writable(workdir: str, out: str, opts) -> str:
  """The default check of --out: made now, writable, not inside the workdir's own files."""
  return outputs.writable_out(out, workdir)


@dataclasses.dataclass(frozen=True)
class Study:
  """How a study verb runs. `run(loaded, out, opts) -> result`, the study (looked up by
  its name when called, so a test can stand in for it); `show(result, out, opts) -> text`,
  printed after. `out`: the default --out, a folder in WORKDIR or `f(workdir, opts)`
  (None: --out is required). `check(workdir, out, opts) -> out` refuses a bad --out
  before the run is loaded. `seeds`: what the verb does with a multi-seed workdir (None:
  refused)."""
  run: Callable
  show: Callable
  out: str | Callable | None = None
  check: Callable = writable
  seeds: over_seeds.SeedStudy | None = None

  def default_out(self, workdir: str, opts) -> str | None:
    if self.out is None:
      return None
    if callable(self.out):
      return self.out(workdir, opts)
    return storage.join(workdir.rstrip("/"), self.out)


def run_study(study: Study, args, opts) -> int:
  """Runs `study` for the parsed `args` (over each seed of a multi-seed workdir when the
  study takes one); prints what it says."""
  out = study.check(args.workdir, args.out or study.default_out(args.workdir, opts), opts)
  if study.seeds is not None and outputs.is_multi_seed(args.workdir):
    print(over_seeds.over_seeds(study.seeds, args.workdir, out, opts, out_given=args.out,
                                step=getattr(args, "step", None),
                                log=lambda m: print(m, flush=True)))
    return 0
  fn = study.run
  fn = getattr(sys.modules[fn.__module__], fn.__name__)    # its current binding
  print(study.show(fn(outputs.load(args), out, opts), out, opts))
  return 0


def study_verb(help: str, study: Study, opts: type, inputs: tuple) -> Verb:
  """A study's verb: its flags from `opts`, its call `run_study(study, ...)`."""
  return Verb(help, lambda args, o: run_study(study, args, o), opts, inputs)
