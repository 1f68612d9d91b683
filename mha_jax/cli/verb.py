"""A verb of `mha-jax`: its help, its call, its settings and its inputs; an error's
message with the settings it names shown as the verb's flags."""

from __future__ import annotations

import dataclasses
import re
from typing import Callable, Sequence

from mha_jax import settings
from mha_jax.errors import UserError


@dataclasses.dataclass(frozen=True)
class Verb:
  """A verb of `mha-jax`: its help, its call `call(args, opts) -> exit status`, its
  settings (`opts`, a dataclass of `settings.setting` fields; the options object `call`
  gets) and its inputs (`settings.Spec`s in `args`, not in `opts`: --workdir, --out).
  `config`: what `--config` is, "study" (this verb's settings file), "training" (a
  training config, `--config.KEY=VALUE` handed on to it) or None."""
  help: str
  call: Callable
  opts: type | None = None
  inputs: tuple = ()
  config: str | None = "study"

  def specs(self, methods: Sequence[str] | None = None) -> list[settings.Spec]:
    """The inputs, then the settings (only those of `methods` among method-bound ones;
    None: every method's)."""
    own = settings.specs(self.opts) if self.opts else []
    return list(self.inputs) + [s for s in own if methods is None or s.methods is None
                                or set(s.methods) & set(methods)]

  @property
  def methods(self) -> tuple[str, ...]:
    """The methods of its `method` setting when some settings are bound to methods."""
    own = settings.specs(self.opts) if self.opts else []
    if not any(s.methods for s in own):
      return ()
    return next(s.choices for s in own if s.name == "method")

  @property
  def default_methods(self) -> tuple[str, ...]:
    d = next(s.default for s in settings.specs(self.opts) if s.name == "method")
    return tuple(d) if isinstance(d, tuple) else (d,)


def input_spec(name: str, help: str, default=None, *, kind: type = str, path: bool = True,
               required: bool = False, many: bool = False, **kw) -> settings.Spec:
  """A verb's input as a setting (a folder, a step; `many`: one or more): checked like
  the settings."""
  return settings.Spec(name=name, kind=kind, many=many, optional=not required,
                       default=default, required=required, help=help, path=path, **kw)


WORKDIR = input_spec("workdir", "the run's folder", required=True)
STEP = input_spec("step", "the checkpoint (default: the latest)", kind=int, path=False, lo=0)


def out_spec(default: str | None) -> settings.Spec:
  """--out: required when `default` is None, else its default said in the help."""
  if default is None:
    return input_spec("out", "output folder", required=True)
  return input_spec("out", f"output folder (default: {default})")


def options(verb: Verb, args):
  """The verb's options object from the parsed `args`, checked."""
  if verb.opts is None:
    return None
  names = [f.name for f in dataclasses.fields(verb.opts)]
  return settings.check(verb.opts(**{n: getattr(args, n) for n in names}))


_QUOTED = re.compile(r"((?<!\w)'[^']*'|\"[^\"]*\")")


def flagged(e: UserError, verb: Verb | None = None) -> str:
  """The message of `e` with each setting it names (`e.settings`) shown as its flag
  (`bleu_limit` -> `--bleu-limit`), outside quoted values; the first mention each. A
  message that starts with the name of one of `verb`'s settings or inputs, followed by a
  space or a colon (`file '/x': no tokenizer.json`), shows that one as its flag too."""
  text = str(e)
  todo = list(e.settings)
  first = re.match(r"([a-z][a-z_]*)[ :]", text)
  if verb is not None and first and first.group(1) not in todo and any(
      s.name == first.group(1) and not s.positional for s in verb.specs()):
    todo.insert(0, first.group(1))
  parts = _QUOTED.split(text)
  for i in range(0, len(parts), 2):
    for name in list(todo):
      new, n = re.subn(rf"(?<![\w./-]){re.escape(name)}(?![\w/-])",
                       "--" + name.replace("_", "-"), parts[i], count=1)
      if n:
        parts[i] = new
        todo.remove(name)
  return "".join(parts)
