"""How a study declares its settings, and the one check of them.

A study is `study(loaded, out, opts)`: `opts` is a frozen dataclass whose fields are
declared with `setting(...)`, which records what a field is beside its type and default:

    @dataclasses.dataclass(frozen=True, kw_only=True)
    class CircuitOptions:
      target: float = setting(0.8, lo=0, hi=1, lo_open=True,
                              help="faithfulness of the node view's circuit")
      ablation: str = setting("corrupt", choices=ablations.KINDS, help="...")

`check(opts)` refuses a value outside its range or choices, or an empty path, with an
error naming the setting and the value (`target must be in (0, 1]; got 1.5`). The CLI
builds each verb's flags, config-file keys and help from the same fields (`specs`), so
a setting has one name (`bleu_limit` is `--bleu-limit`) and one check.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from typing import Any, Sequence

from mha_jax.errors import UserError

# The dtypes a verb's `dtype` setting takes (a model's params, a benchmark's inputs).
DTYPES = ("float32", "bfloat16", "float16")

_KEY = "mha_jax.setting"


def setting(default: Any = dataclasses.MISSING, *, help: str, lo=None, hi=None,
            lo_open: bool = False, hi_open: bool = False, note: str = "",
            choices: Sequence[str] | None = None, path: bool = False,
            methods: Sequence[str] | None = None, metavar: str | None = None,
            positional: bool = False) -> Any:
  """A dataclass field that is a setting. `lo`/`hi`: its range (closed unless `lo_open`/
  `hi_open`; each item of a tuple setting); `note`: said after the range in the error;
  `choices`: its allowed values (each item of a tuple setting); `path`: a file or folder
  (never empty); `methods`: the methods of the study's `method` setting that read it
  (None: all); `metavar`, `positional`: how the CLI shows it. No default: required."""
  meta = {_KEY: dict(help=help, lo=lo, hi=hi, lo_open=lo_open, hi_open=hi_open, note=note,
                     choices=None if choices is None else tuple(choices), path=path,
                     methods=None if methods is None else tuple(methods),
                     metavar=metavar, positional=positional)}
  return dataclasses.field(default=default, metadata=meta)


@dataclasses.dataclass(frozen=True)
class Spec:
  """One setting as the CLI and `check` read it. `kind`: bool, int, float or str; `many`:
  a tuple of them (comma-separated on the command line); `optional`: None allowed."""
  name: str
  kind: type
  many: bool
  optional: bool
  default: Any
  required: bool
  help: str
  lo: Any = None
  hi: Any = None
  lo_open: bool = False
  hi_open: bool = False
  note: str = ""
  choices: tuple | None = None
  path: bool = False
  methods: tuple | None = None
  metavar: str | None = None
  positional: bool = False

  @property
  def flag(self) -> str:
    """The command-line flag: the name with `-` for `_` (a positional keeps its name)."""
    return self.name if self.positional else "--" + self.name.replace("_", "-")


def _kind(tp) -> tuple[type, bool, bool]:
  """(item type, is a tuple, None allowed) of a field's annotation."""
  args = typing.get_args(tp)
  optional = type(None) in args
  if optional:
    (tp,) = [a for a in args if a is not type(None)]
  if typing.get_origin(tp) is tuple:
    return typing.get_args(tp)[0], True, optional
  return tp, False, optional


def specs(cls) -> list[Spec]:
  """The settings of options class `cls`, in field order."""
  hints = typing.get_type_hints(cls)
  out = []
  for f in dataclasses.fields(cls):
    meta = f.metadata.get(_KEY)
    if meta is None:
      raise TypeError(f"{cls.__name__}.{f.name} is not declared with settings.setting")
    kind, many, optional = _kind(hints[f.name])
    required = f.default is dataclasses.MISSING
    out.append(Spec(name=f.name, kind=kind, many=many, optional=optional,
                    default=None if required else f.default, required=required, **meta))
  return out


def check_range(name: str, v, lo=None, hi=None, *, lo_open=False, hi_open=False,
                note: str = "") -> None:
  """v within [lo, hi] (open ends where asked), else a UserError naming `name` (a setting
  or a config field) and the value."""
  if isinstance(v, bool) or not isinstance(v, (int, float)):
    raise UserError(f"{name} must be a number; got {v!r}", setting=name)
  if isinstance(v, float) and not math.isfinite(v):
    raise UserError(f"{name} must be a finite number; got {v!r}", setting=name)
  ok = ((lo is None or (v > lo if lo_open else v >= lo)) and
        (hi is None or (v < hi if hi_open else v <= hi)))
  if not ok:
    left = "" if lo is None else ("(" if lo_open else "[") + f"{lo}, "
    right = "" if hi is None else f"{hi}" + (")" if hi_open else "]")
    want = (f"in {left}{right}" if lo is not None and hi is not None else
            f"{'>' if lo_open else '>='} {lo}" if lo is not None else
            f"{'<' if hi_open else '<='} {hi}")
    raise UserError(f"{name} must be {want}{note}; got {v!r}", setting=name)


def check_value(s: Spec, value) -> None:
  """`value` as setting `s` takes it (its type, range, choices; a path never empty); else
  a UserError naming the setting and the value."""
  if value is None:
    if s.optional or s.required:
      return
    raise UserError(f"{s.name} must be given; got None", setting=s.name)
  if s.many and not isinstance(value, tuple):
    raise UserError(f"{s.name} must be a tuple; got {value!r}", setting=s.name)
  for v in value if s.many else (value,):
    if s.kind is bool and not isinstance(v, bool):
      raise UserError(f"{s.name} must be true or false; got {v!r}", setting=s.name)
    if s.kind is int and (isinstance(v, bool) or not isinstance(v, int)):
      raise UserError(f"{s.name} must be an integer; got {v!r}", setting=s.name)
    if s.kind in (int, float):
      check_range(s.name, v, s.lo, s.hi, lo_open=s.lo_open, hi_open=s.hi_open, note=s.note)
    if s.kind is str and not isinstance(v, str):
      raise UserError(f"{s.name} must be a string; got {v!r}", setting=s.name)
    if s.choices is not None and v not in s.choices:
      raise UserError(f"{s.name} must be one of {', '.join(map(str, s.choices))}; got "
                      f"{v!r}", setting=s.name)
    if s.path and not v.strip():
      raise UserError(f"{s.name} must name a folder or file; got {v!r}", setting=s.name)


def check(opts):
  """`opts` with every setting within its range and choices and no empty path; else a
  UserError naming the setting and the value. Returns `opts`."""
  for s in specs(type(opts)):
    check_value(s, getattr(opts, s.name))
  return opts

