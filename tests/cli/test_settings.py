"""A study's settings (mha_jax.settings): declared once, checked by name, and the CLI's
flags, config keys and error messages made from them."""

import dataclasses

import pytest

from mha_jax import cli, settings
from mha_jax.errors import UserError
from mha_jax.settings import setting


@dataclasses.dataclass(frozen=True, kw_only=True)
class Toy:
  """A study's options, one setting of each kind."""
  target: float = setting(0.8, lo=0, hi=1, lo_open=True, help="in (0, 1]")
  bleu_limit: int = setting(0, lo=0, note=" (0 = all)", help="sentences (0 = all)")
  stacks: tuple[str, ...] = setting(("encoder",), choices=("encoder", "lm"), help="stacks")
  pairs: str | None = setting(None, path=True, help="a file")
  method: str = setting("a", choices=("a", "b"), help="the method")
  only_b: int = setting(3, lo=1, methods=("b",), help="read by method b only")
  track: bool = setting(True, help="a pass that may be skipped")


@pytest.mark.parametrize("values,msg", [
    (dict(target=1.5), "target must be in (0, 1]; got 1.5"),
    (dict(target=0.0), "target must be in (0, 1]; got 0.0"),
    (dict(target=float("nan")), "target must be a finite number; got nan"),
    (dict(bleu_limit=-1), "bleu_limit must be >= 0 (0 = all); got -1"),
    (dict(bleu_limit=2.5), "bleu_limit must be an integer; got 2.5"),
    (dict(stacks=("encoder", "deco")), "stacks must be one of encoder, lm; got 'deco'"),
    (dict(stacks="encoder"), "stacks must be a tuple; got 'encoder'"),
    (dict(pairs=" "), "pairs must name a folder or file; got ' '"),
    (dict(track="yes"), "track must be true or false; got 'yes'"),
])
def test_check_names_the_setting_and_the_value(values, msg):
  with pytest.raises(UserError) as e:
    settings.check(Toy(**values))
  assert str(e.value) == msg
  assert e.value.settings == (next(iter(values)),)
  settings.check(Toy(target=1.0, bleu_limit=0, stacks=("lm", "encoder")))   # in range


def test_specs_carry_type_default_range_and_methods():
  by = {s.name: s for s in settings.specs(Toy)}
  assert (by["stacks"].kind, by["stacks"].many, by["stacks"].default) == (str, True,
                                                                         ("encoder",))
  assert (by["pairs"].optional, by["pairs"].path, by["bleu_limit"].flag) == (
      True, True, "--bleu-limit")
  assert by["only_b"].methods == ("b",) and by["target"].methods is None

  @dataclasses.dataclass(frozen=True)
  class Undeclared:
    x: int = 1
  with pytest.raises(TypeError, match="Undeclared.x is not declared"):
    settings.specs(Undeclared)


def _parse(argv, methods=None):
  import argparse
  verb = cli.Verb("toy", lambda args, opts: 0, Toy)
  sub = argparse.ArgumentParser(prog="t").add_subparsers()
  p = cli.add_verb(sub, "toy", verb, methods)
  return cli.options(verb, p.parse_args(argv)), p


def test_flags_are_generated_from_the_settings(capsys):
  opts, p = _parse(["--bleu-limit", "4", "--stacks", "lm,encoder", "--no-track",
                    "--target", "0.5"])
  assert opts == Toy(bleu_limit=4, stacks=("lm", "encoder"), track=False, target=0.5)
  with pytest.raises(SystemExit):
    p.parse_args(["--stacks", "lm,x"])
  assert "argument --stacks: invalid choice: 'x'" in capsys.readouterr().err
  with pytest.raises(SystemExit):              # a setting of method b: not a flag of a
    p.parse_args(["--only-b", "2"])
  opts, _ = _parse(["--method", "b", "--only-b", "2"], methods=("b",))
  assert opts.only_b == 2
  with pytest.raises(UserError, match="only_b must be >= 1; got 0"):
    _parse(["--method", "b", "--only-b", "0"], methods=("b",))


def test_the_cli_shows_the_settings_an_error_names_as_flags():
  e = UserError("method l0 needs l0_lambda X, lambdas a,b,c or keep K",
                setting=("method", "l0_lambda", "lambdas", "keep"))
  assert cli.flagged(e) == "method l0 needs l0_lambda X, lambdas a,b,c or keep K".replace(
      "method", "--method").replace("l0_lambda", "--l0-lambda").replace(
      "lambdas", "--lambdas").replace("keep K", "--keep K")
  # a quoted value is never rewritten, even when it reads like a setting's name
  e = UserError("out 'out/keep' lies inside checkpoints/", setting="out")
  assert cli.flagged(e) == "--out 'out/keep' lies inside checkpoints/"
  # a message starting with one of the verb's settings, raised without setting=
  e = UserError("file '/x': no tokenizer.json")
  assert cli.flagged(e, cli.VERBS["import"]) == "--file '/x': no tokenizer.json"
  assert cli.flagged(e) == "file '/x': no tokenizer.json"
