"""The parser, its flags generated from the verbs' settings. Each verb's parser records
the flags it was given (`parser.flags`, dest -> Flag), and the top parser its verbs'
parsers (`parser.verbs`, `parser.bench`): the config files read these, never argparse's
own records."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Callable, Sequence

from mha_jax import settings
from mha_jax.cli.verb import Verb


@dataclasses.dataclass(frozen=True)
class Flag:
  """What a config file's key needs of its flag: its names (the first is the one to
  write; a switch's second, --no-X, turns it off), whether it is a switch, and a
  positional's item type and whether it takes several values."""
  names: tuple[str, ...]
  switch: bool = False
  kind: type = str
  many: bool = False

  @property
  def positional(self) -> bool:
    return not self.names[0].startswith("-")


def _items(kind: type, choices: Sequence | None, what: str) -> Callable[[str], tuple]:
  """An argparse type for comma-separated values of `kind`, each one of `choices` when
  given: "a,b" -> ("a", "b")."""
  def parse(text: str) -> tuple:
    try:
      values = tuple(kind(v.strip()) for v in text.split(",") if v.strip())
    except ValueError:
      raise argparse.ArgumentTypeError(f"expected comma-separated {what}; got {text!r}"
                                       ) from None
    if choices is not None:
      if not values:
        raise argparse.ArgumentTypeError(f"expected comma-separated {what}; got {text!r}")
      for v in values:
        if v not in choices:
          raise argparse.ArgumentTypeError(
              f"invalid choice: {v!r} (choose from {', '.join(map(repr, choices))})")
    return values
  return parse


_WHAT = {int: "integers", float: "numbers", str: "names"}


class _Tuple(argparse.Action):
  """Positional values (nargs="+") stored as the tuple a `tuple[...]` setting declares."""

  def __call__(self, parser, namespace, values, option_string=None):
    setattr(namespace, self.dest, tuple(values))


def flag_of(spec: settings.Spec) -> tuple[tuple, dict]:
  """add_argument's (names, keywords) for one setting."""
  kw: dict = {"help": spec.help, "default": spec.default}
  if spec.kind is bool:
    kw["action"] = argparse.BooleanOptionalAction if spec.default else "store_true"
  elif spec.many:
    kw["type"] = _items(spec.kind, spec.choices, _WHAT[spec.kind])
    kw["metavar"] = spec.metavar or spec.name.upper() + "[,...]"
  else:
    kw["type"] = spec.kind
    if spec.choices is not None:
      kw["choices"] = spec.choices
    if spec.metavar:
      kw["metavar"] = spec.metavar
  if spec.positional and spec.many:    # DIR...: one or more values, space-separated
    return (spec.name,), {**kw, "type": spec.kind, "nargs": "+", "action": _Tuple}
  if spec.positional:
    return (spec.name,), {**kw, "nargs": "?"}
  return (spec.flag,), {**kw, "dest": spec.name, "required": spec.required}


def record(spec: settings.Spec) -> Flag:
  """The Flag that `flag_of(spec)` adds."""
  if spec.kind is bool:
    names = (spec.flag,) + (("--no-" + spec.flag[2:],) if spec.default else ())
    return Flag(names, switch=True)
  return Flag((spec.name,) if spec.positional else (spec.flag,), kind=spec.kind,
              many=spec.many)


def _epilog(name: str, verb: Verb, methods: Sequence[str]) -> str | None:
  """The help's last words: which method's flags it lists, and the config file."""
  epilog = None
  if verb.methods and not methods:
    epilog = (f"Each method has its own flags: mha-jax {name} --method "
              f"{{{','.join(verb.methods)}}} --help.")
  elif verb.methods:
    epilog = f"The flags of --method {','.join(methods)}; other methods take others."
  if verb.config == "study":
    epilog = ((epilog + " ") if epilog else "") + (
        "--config FILE.py[:ARG]: these settings from a config file (keys: the settings' "
        "names, each flag with '_' for '-'); --config.KEY=VALUE overrides a key; a flag "
        "given here overrides both (docs/guide/cli.md).")
  return epilog


def add_verb(sub, name: str, verb: Verb, methods: Sequence[str] | None):
  """The sub-parser of `verb`, with the flags of `methods` (None: the verb's defaults;
  () with --help: none, and the help says how to see them). `parser.flags`: its
  settings' flags by name."""
  if verb.methods and methods is None:
    methods = verb.default_methods
  p = sub.add_parser(name, help=verb.help, description=verb.help,
                     epilog=_epilog(name, verb, methods), allow_abbrev=False)
  p.flags, groups = {}, {}
  for spec in verb.specs(methods if verb.methods else None):
    where = p
    if spec.methods is not None and verb.methods:
      m = next(m for m in methods if m in spec.methods)
      where = groups.setdefault(m, p.add_argument_group(f"--method {m}"))
    names, kwargs = flag_of(spec)
    where.add_argument(*names, **kwargs)
    p.flags[spec.name] = record(spec)
  p.set_defaults(**{s.name: s.default for s in verb.specs() if s.name not in p.flags})
  if verb.config == "study":
    p.add_argument("--config", default=None, metavar="FILE.py[:ARG]",
                   help="this verb's settings from a config file (configs/studies/)")
  p.add_argument("--compile-cache", default=None, metavar="DIR|off",
                 help="JAX's compilation cache (default: $MHA_JAX_COMPILE_CACHE, else "
                      "~/.cache/mha-jax/xla; docs/guide/performance.md)")
  p.set_defaults(verb=verb)
  return p


def build_parser(methods: dict[str, Sequence[str]] | None = None) -> argparse.ArgumentParser:
  """The `mha-jax` parser; `methods` names the methods whose flags a verb takes (the
  verb's --method default when not named). `parser.verbs` maps each verb to its parser,
  `parser.bench` each benchmark (`mha-jax bench NAME`) to its own."""
  from mha_jax.cli import table
  table.harness()
  p = argparse.ArgumentParser(prog="mha-jax", description=table.DESCRIPTION,
                              allow_abbrev=False)
  sub = p.add_subparsers(dest="command", required=True)
  p.verbs = {name: add_verb(sub, name, verb, (methods or {}).get(name))
             for name, verb in table.VERBS.items()}
  p.bench = {}
  if table.BENCH:
    b = sub.add_parser("bench", help="benchmarks")
    bsub = b.add_subparsers(dest="bench", required=True)
    p.bench = {name: add_verb(bsub, name, verb, (methods or {}).get(f"bench {name}"))
               for name, verb in table.BENCH.items()}
  return p
