"""argv -> the parsed command, a study's settings read from a config file first:

    mha-jax prune --workdir W --config configs/studies/prune_michel.py --config.keep=6

A config's keys are the settings' names; `--config.KEY=VALUE` overrides a key and a flag
on the command line overrides both. The config's settings become the flags they stand for,
so the parser checks each as it checks the command line."""

from __future__ import annotations

import argparse
import difflib
import sys
from typing import Sequence

import ml_collections

from mha_jax import config as mc
from mha_jax.cli import parser as parser_lib, table
from mha_jax.cli.verb import Verb
from mha_jax.errors import UserError


def methods_asked(verb: Verb, cfg, rest: Sequence[str]) -> tuple | None:
  """The methods whose flags the verb takes: the last --method on the command line, else
  the config's `method`, else the default (None); () for --help without one."""
  if not verb.methods:
    return None
  pre = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
  pre.add_argument("--method", default=None)
  pre.add_argument("-h", "--help", action="store_true")
  known, _ = pre.parse_known_args(list(rest))
  value = known.method
  if value is None and cfg is not None and cfg.get("method") is not None:
    value = cfg.method
  if value is None:
    return () if known.help else None
  names = value.split(",") if isinstance(value, str) else list(value)
  return tuple(m.strip() for m in names if m.strip() in verb.methods)


def config_argv(cfg, parser: argparse.ArgumentParser, spec: str, where: str) -> list[str]:
  """The config's settings as the flags they stand for (so the parser checks each);
  an unknown key is refused by its name. A positional's value becomes its default."""
  flags = parser.flags
  argv = []
  for key, value in cfg.items():
    if key not in flags:
      close = difflib.get_close_matches(key, list(flags), n=3)
      hint = f"; did you mean {', '.join(close)}?" if close else ""
      raise UserError(f"--config {spec}: key {key!r} is not a flag of {where}{hint} (its "
                      f"keys: {', '.join(sorted(flags))})")
    f = flags[key]
    if value is None:
      continue
    if isinstance(value, ml_collections.ConfigDict):
      raise UserError(f"--config {spec}: key {key!r} is a group; a study config is flat")
    if f.switch:     # --finetune, or --track / --no-track
      if not isinstance(value, bool):
        raise UserError(f"--config {spec}: key {key!r} must be true or false; got {value!r}")
      argv += list(f.names[:1] if value else f.names[1:2])
      continue
    text = ",".join(map(str, value)) if isinstance(value, (list, tuple)) else str(value)
    if f.positional:     # used when the command line gives none
      parser.set_defaults(**{key: tuple(f.kind(v) for v in text.split(",")) if f.many
                             else f.kind(text)})
    else:
      argv.append(f"{f.names[0]}={text}")   # "=": a value may start with "-"
  return argv


def verb_of(argv: Sequence[str]) -> tuple[list[str], Verb | None, list[str]]:
  """(its words, the verb, the rest of argv) of `mha-jax VERB ...` / `mha-jax bench NAME`."""
  table.harness()
  if argv and argv[0] == "bench" and len(argv) > 1 and argv[1] in table.BENCH:
    return ["bench", argv[1]], table.BENCH[argv[1]], list(argv[2:])
  name = argv[0] if argv else None
  return [name], table.VERBS.get(name), list(argv[1:])


def _study_config(rest: list[str]):
  """(the --config FILE, its config or None, rest with its --config.KEY=VALUE applied)."""
  pre = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
  pre.add_argument("--config", default=None)
  spec = pre.parse_known_args(rest)[0].config
  if not spec:
    given = [a for a in rest if a.startswith("--config.")]
    if given:
      raise UserError(f"{given[0]} overrides a key of --config FILE; none given")
    return spec, None, rest
  cfg = mc.load_config(spec, training=False)
  return spec, cfg, mc.apply_overrides(cfg, rest)


def parse_args(argv: Sequence[str] | None = None) -> tuple[argparse.Namespace, list[str]]:
  """argv -> (args, the --config.KEY=VALUE a training verb hands on, also args.extra);
  args.verb is the Verb. A study verb reads --config FILE (the loader `train` uses) and its
  --config.KEY=VALUE overrides first, then the command line's flags over them."""
  argv = list(sys.argv[1:] if argv is None else argv)
  head, verb, rest = verb_of(argv)
  if verb is None or verb.config != "study":
    parser = parser_lib.build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and (verb is None or verb.config != "training"
                  or any(not a.startswith("--config.") for a in extra)):
      parser.error(f"unrecognized arguments: {' '.join(extra)}")
    args.extra = extra
    return args, extra
  spec, cfg, rest = _study_config(rest)
  methods = methods_asked(verb, cfg, rest)
  key = " ".join(head)
  parser = parser_lib.build_parser({key: methods} if methods is not None else None)
  sub = parser.bench[head[1]] if head[0] == "bench" else parser.verbs[key]
  file_argv = []
  if cfg is not None:
    where = f"`mha-jax {key}" + (f" --method {','.join(methods)}`" if methods else "`")
    file_argv = config_argv(cfg, sub, spec, where)
  args, unknown = parser.parse_known_args([*head, *file_argv, *rest])
  if unknown:
    flags = {u.split("=")[0] for u in unknown}
    owners = sorted({m for s in verb.specs() if s.methods and s.flag in flags
                     for m in s.methods})
    hint = f" (flags of --method {' or '.join(owners)})" if owners else ""
    sub.error(f"unrecognized arguments: {' '.join(unknown)}{hint}")
  args.extra = []
  return args, []
