"""Configs are data: Python files with get_config(arg) -> ml_collections.ConfigDict.

    mha-jax train --config configs/translation.py:heads=16 --config.train.steps=2000

The part after ":" is handed to get_config; `parse_arg` turns "heads=16,d_model=128" into
typed values. `--config.a.b=value` overrides a field, typed like the field. Configs are
locked: an unknown key fails with a message that names it.
"""

from __future__ import annotations

import ast
import difflib
import importlib.util
import json
import os
import re
from typing import Any, Sequence

import ml_collections

from mha_jax.errors import UserError
from mha_jax.settings import check_range  # noqa: F401 - the one range check

# Fields that may change when a run resumes in an existing workdir.
RESUMABLE_FIELDS = ("train.steps", "train.eval_every", "train.log_every",
                    "train.checkpoint_every", "train.progress", "train.keep",
                    "train.max_loss_factor", "train.pack", "eval", "mesh")


def parse_arg(arg: str | None, **defaults) -> ml_collections.ConfigDict:
  """big_vision-style argument: "heads=16,small" -> {heads: 16, small: True}.

  Values are typed like the defaults. A value may itself hold commas
  ("heads=1,4,8,steps=300" gives heads="1,4,8"). Unknown keys raise UserError.
  """
  out = ml_collections.ConfigDict(defaults)
  if not arg:
    return out
  for part in re.split(r",(?=[A-Za-z_]\w*(?:=|,|$))", arg):
    if not part:
      continue
    key, eq, value = part.partition("=")
    if key not in defaults:
      raise UserError(f"config argument {key!r} is unknown; known: {sorted(defaults)}")
    out[key] = _cast(value if eq else "true", defaults[key], f"config argument {key!r}")
  return out


def _cast(text: str, like: Any, what: str) -> Any:
  try:
    if isinstance(like, bool):
      low = text.lower()
      if low not in ("true", "false", "1", "0", "yes", "no"):
        raise UserError
      return low in ("true", "1", "yes")
    if isinstance(like, int):
      return int(text)
    if isinstance(like, float):
      return float(text)
    if isinstance(like, (tuple, list)):
      v = ast.literal_eval(text) if text.strip()[:1] in "([" else [
          _cast(t, like[0] if like else "", what) for t in text.split(",") if t]
      return type(like)(v if isinstance(v, (list, tuple)) else [v])
    return text
  except (ValueError, SyntaxError):
    raise UserError(f"{what}: cannot read {text!r} as {type(like).__name__}") from None


REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def resolve(spec: str, *near: str) -> str:
  """"path.py[:arg]" with the path as given, or next to any of `near` (files), or relative
  to the repository holding this package (where `configs/` lives); unchanged if none
  exists, so load_config reports it."""
  path, colon, arg = spec.partition(":")
  for cand in [path] + [os.path.join(os.path.dirname(n), path) for n in near] + [
      os.path.join(REPO_ROOT, path)]:
    if os.path.isfile(cand):
      return cand + colon + arg
  return spec


def load_config(spec: str, *, training: bool = True) -> ml_collections.ConfigDict:
  """Loads "path/to/config.py[:arg]" and locks it (see `resolve` for where it looks).

  training=False: a study's config (the flags of a verb, `mha-jax prune --config`), taken
  as written; a training config gets the default `mesh` group when it has none."""
  path, _, arg = resolve(spec).partition(":")
  if not os.path.isfile(path):
    raise UserError(f"--config: no such file {path!r}")
  mod_spec = importlib.util.spec_from_file_location(
      "mha_jax_config_" + os.path.splitext(os.path.basename(path))[0], path)
  module = importlib.util.module_from_spec(mod_spec)
  try:
    mod_spec.loader.exec_module(module)
  except SyntaxError as e:
    raise UserError(f"--config: {path!r} line {e.lineno}: {e.msg}") from None
  if not hasattr(module, "get_config"):
    raise UserError(f"--config: {path!r} has no get_config(arg)")
  cfg = module.get_config(arg or None)
  if training and "mesh" not in cfg:   # a config need not say how it is laid out on devices
    cfg.mesh = mesh_defaults()
  cfg.lock()
  return cfg


def mesh_defaults(**overrides) -> ml_collections.ConfigDict:
  """The `mesh` group: a (data, model) device mesh; data=0 takes every device left
  after the model axis. Heads and MLP units are split over `model`."""
  m = ml_collections.ConfigDict(dict(data=0, model=1))
  m.update(overrides)
  return m


def _all_keys(cfg, prefix=""):
  for k, v in cfg.items():
    yield prefix + k
    if isinstance(v, ml_collections.ConfigDict):
      yield from _all_keys(v, prefix + k + ".")


def override(cfg: ml_collections.ConfigDict, key: str, text: str) -> None:
  """Sets dotted `key` from its text, typed like the current value."""
  parts = key.split(".")
  node = cfg
  for i, p in enumerate(parts):
    if not isinstance(node, ml_collections.ConfigDict) or p not in node:
      close = difflib.get_close_matches(key, list(_all_keys(cfg)), n=3)
      hint = f"; did you mean {close}?" if close else ""
      raise UserError(f"config key {key!r} is unknown{hint}")
    if i < len(parts) - 1:
      node = node[p]
  current = node[parts[-1]]
  if isinstance(current, ml_collections.ConfigDict):
    raise UserError(f"config key {key!r} is a group; set one of its fields")
  with node.unlocked():
    node[parts[-1]] = _cast(text, current, f"--config.{key}")


def apply_overrides(cfg: ml_collections.ConfigDict, args: Sequence[str]) -> list[str]:
  """Applies `--config.a.b=v` / `--config.a.b v` from args; returns the other args."""
  rest, i = [], 0
  while i < len(args):
    a = args[i]
    if a.startswith("--config."):
      key, eq, value = a[len("--config."):].partition("=")
      if not eq:
        if i + 1 >= len(args):
          raise UserError(f"--config.{key} needs a value")
        value, i = args[i + 1], i + 1
      override(cfg, key, value)
    else:
      rest.append(a)
    i += 1
  return rest


def to_dict(cfg) -> dict:
  return json.loads(cfg.to_json_best_effort())


# Fields added after runs were already being written, with the value those runs used.
ADDED_FIELDS = {"translation": {"model.pos": "sinusoidal", "model.max_rel": 16,
                                "mesh.data": 0, "mesh.model": 1, "train.max_loss_factor": 4.0,
                                "train.seeds": "1", "train.shuffle_seed": -1,
                                "train.pack": False},
                "lm": {"mesh.data": 0, "mesh.model": 1, "train.max_loss_factor": 4.0,
                       "train.seeds": "1", "train.shuffle_seed": -1, "model.max_rel": 16}}


def upgrade(d: dict) -> dict:
  """A saved config dict with the fields it predates filled in (a new dict)."""
  d = json.loads(json.dumps(d))
  for key, value in ADDED_FIELDS.get(d.get("task"), {}).items():
    *path, last = key.split(".")
    node = d
    for part in path:
      node = node.setdefault(part, {})
    node.setdefault(last, value)
  return d


def from_dict(d: dict) -> ml_collections.ConfigDict:
  """A locked config from a saved dict (upgraded: see ADDED_FIELDS)."""
  cfg = ml_collections.ConfigDict(upgrade(d))
  cfg.lock()
  return cfg


def flatten(d: dict, prefix: str = "") -> dict[str, Any]:
  out = {}
  for k, v in d.items():
    if isinstance(v, dict):
      out.update(flatten(v, prefix + k + "."))
    else:
      out[prefix + k] = v
  return out


def incompatible_fields(saved: dict, new: dict) -> list[str]:
  """Fields that differ between two configs and may not change on resume (a field one
  of them predates counts with the value it had: ADDED_FIELDS)."""
  a, b = flatten(upgrade(saved)), flatten(upgrade(new))
  out = []
  for k in sorted(set(a) | set(b)):
    if a.get(k) != b.get(k) and not any(k == f or k.startswith(f + ".")
                                        for f in RESUMABLE_FIELDS):
      out.append(k)
  return out


def _check_range(cfg, key: str, lo=None, hi=None, *, lo_open=False, hi_open=False,
                 note: str = "") -> None:
  """cfg[key] within [lo, hi] (see check_range); a field the config lacks is skipped. The
  error names the config key as it is (`train.batch_size`, set by
  --config.train.batch_size=N), never as a flag of its own."""
  node = cfg
  for part in key.split("."):
    if not isinstance(node, ml_collections.ConfigDict) or part not in node:
      return
    node = node[part]
  try:
    check_range(key, node, lo, hi, lo_open=lo_open, hi_open=hi_open, note=note)
  except UserError as e:   # a config key (train.batch_size), not a flag of the verb
    raise UserError(str(e)) from None


def check_impl(cfg) -> None:
  """model.impl names a kernel (kernels/dispatch.py)."""
  from mha_jax.kernels.dispatch import IMPLS
  impl = cfg.model.get("impl", "auto") if "model" in cfg else "auto"
  if impl not in IMPLS:
    raise UserError(f"model.impl must be one of {', '.join(IMPLS)}; got {impl!r}")
  from mha_jax.kernels.dispatch import VARIANT_KERNELS
  variant = cfg.model.get("attention", "softmax") if "model" in cfg else "softmax"
  if variant not in VARIANT_KERNELS:
    raise UserError(f"model.attention must be one of {', '.join(VARIANT_KERNELS)}; got "
                    f"{variant!r}")
  if impl != "auto" and impl not in VARIANT_KERNELS[variant]:
    raise UserError(f"model.impl={impl!r} does not serve model.attention={variant!r}; use "
                    f"one of {', '.join(VARIANT_KERNELS[variant])} or auto")


# Numeric fields and their ranges: (key, lo, hi, lo_open, hi_open, note).
RANGES = (
    ("seed", 0, None, False, False, ""),
    ("model.d_model", 1, None, False, False, ""),
    ("model.num_heads", 1, None, False, False, ""),
    ("model.head_dim", 0, None, False, False, " (0 = d_model / num_heads)"),
    ("model.d_ff", 0, None, False, False, ""),
    ("model.enc_layers", 1, None, False, False, ""),
    ("model.dec_layers", 1, None, False, False, ""),
    ("model.num_layers", 1, None, False, False, ""),
    ("model.max_len", 1, None, False, False, ""),
    ("model.dropout", 0, 1, False, True, ""),
    ("data.seed", 0, None, False, False, ""),
    ("data.max_len", 1, None, False, False, ""),
    ("data.train_size", 1, None, False, False, ""),
    ("data.valid_size", 1, None, False, False, ""),
    ("data.test_size", 1, None, False, False, ""),
    ("data.vocab_size", 3, None, False, False, ""),
    ("data.half_len", 0, None, False, False, ""),
    ("data.min_half_len", 0, None, False, False, ""),
    ("train.steps", 1, None, False, False, ""),
    ("train.batch_size", 1, None, False, False, ""),
    ("train.lr", 0, None, True, False, ""),
    ("train.warmup", 0, None, False, False, ""),
    ("train.weight_decay", 0, None, False, False, ""),
    ("train.b2", 0, 1, False, True, ""),
    ("train.clip", 0, None, False, False, " (global-norm clipping; 0 = none)"),
    ("train.label_smoothing", 0, 1, False, True, ""),
    ("train.eval_every", 1, None, False, False, ""),
    ("train.log_every", 1, None, False, False, ""),
    ("train.checkpoint_every", 1, None, False, False, ""),
    ("train.keep", 1, None, False, False, " (checkpoints kept on disk)"),
    ("train.max_loss_factor", 0, None, False, False,
     " (stop when the loss exceeds this multiple of the starting loss; 0 = never)"),
    ("train.shuffle_seed", -1, None, False, False, " (-1 = data.seed)"),
    ("eval.batch_size", 1, None, False, False, ""),
    ("eval.bleu_examples", 0, None, False, False, " (0 = all)"),
    ("eval.lm_batches", 1, None, False, False, ""),
)


def validate(cfg: ml_collections.ConfigDict) -> None:
  """Checks every value the code relies on (types, ranges, choices); errors name the
  field and the value."""
  if cfg.get("task") in PRETRAINED_TASKS:
    return validate_pretrained(cfg)
  if cfg.get("task") not in ("translation", "lm"):
    raise UserError(f"task must be 'translation' or 'lm'; got {cfg.get('task')!r}")
  for key, lo, hi, lo_open, hi_open, note in RANGES:
    _check_range(cfg, key, lo, hi, lo_open=lo_open, hi_open=hi_open, note=note)
  check_impl(cfg)
  m, t = cfg.model, cfg.train
  if m.head_dim == 0 and m.d_model % m.num_heads:
    raise UserError(f"model.num_heads={m.num_heads} does not divide "
                    f"model.d_model={m.d_model} (or set model.head_dim)")
  if not m.get("attn_only", False) and m.get("d_ff", 1) < 1:
    raise UserError(f"model.d_ff must be >= 1 unless model.attn_only; got {m.d_ff}")
  if 0 < t.get("max_loss_factor", 0) <= 1:
    raise UserError(f"train.max_loss_factor must be > 1 (or 0 = never stop); got "
                    f"{t.max_loss_factor}")
  if m.get("ln_position", "pre") not in ("pre", "post"):
    raise UserError(f"model.ln_position must be 'pre' or 'post'; got {m.ln_position!r}")
  if cfg.task == "lm" and m.pos not in ("learned", "sinusoidal", "qk", "qk_sinusoidal",
                                        "relative", "rope"):
    raise UserError(f"model.pos must be learned, sinusoidal, qk, qk_sinusoidal, relative or "
                    f"rope; "
                    f"got {m.pos!r}")
  if cfg.task == "lm" and m.pos == "relative" and m.get("max_rel", 16) < 1:
    raise UserError(f"model.max_rel (relative offsets are clipped to max_rel) must be >= 1; "
                    f"got {m.max_rel}")
  if cfg.task == "translation":
    if not isinstance(t.get("pack", False), bool):
      raise UserError(f"train.pack must be true or false; got {t.pack!r}")
    if m.pos not in ("sinusoidal", "relative"):
      raise UserError(f"model.pos must be sinusoidal or relative for translation; got "
                      f"{m.pos!r}")
    if m.max_rel < 1:
      raise UserError(f"model.max_rel (relative offsets are clipped to +-max_rel) must "
                      f"be >= 1; got {m.max_rel}")
  seed_list(cfg)   # train.seeds must parse
  if t.schedule not in ("inverse_sqrt", "cosine", "constant", "wsd"):
    raise UserError(f"train.schedule must be inverse_sqrt, cosine, constant or wsd; got "
                    f"{t.schedule!r}")
  if t.schedule == "wsd":
    d = t.get("decay_steps")
    if not isinstance(d, int) or not max(1, t.warmup) <= t.steps - d < t.steps:
      raise UserError(f"train.decay_steps (schedule wsd: the last steps, decaying to 0) must "
                      f"be between 1 and train.steps - train.warmup = "
                      f"{t.steps - max(1, t.warmup)}; got {d!r}")


# Tasks of imported models (mha-jax import): no training fields.
PRETRAINED_TASKS = ("pretrained_lm", "embedding")


def validate_pretrained(cfg: ml_collections.ConfigDict) -> None:
  """Checks an imported model's config (written by mha_jax.pretrained)."""
  m = cfg.model
  check_impl(cfg)
  for key in ("d_model", "num_heads", "head_dim", "num_layers", "d_ff", "vocab_size"):
    if m[key] < 1:
      raise UserError(f"model.{key} must be >= 1; got {m[key]}")
  if cfg.task == "pretrained_lm" and m.num_heads % m.num_kv_heads:
    raise UserError(f"model.num_kv_heads={m.num_kv_heads} must divide "
                     f"model.num_heads={m.num_heads}")
  for key in ("batch_size", "seq_len", "windows"):
    if cfg.eval[key] < 1:
      raise UserError(f"eval.{key} must be >= 1; got {cfg.eval[key]}")


def train_defaults(**overrides) -> ml_collections.ConfigDict:
  """The `train` group shared by the configs."""
  t = ml_collections.ConfigDict(dict(
      steps=2000, batch_size=64, lr=1e-3, warmup=200, schedule="inverse_sqrt",
      weight_decay=0.01, b2=0.98, clip=1.0, label_smoothing=0.0,
      eval_every=500, log_every=50, checkpoint_every=500, keep=3, progress=True,
      max_loss_factor=4.0, seeds="1", shuffle_seed=-1))
  t.update(overrides)
  return t


def seed_list(cfg) -> list[int]:
  """The seeds train.seeds asks for: "N" (or the int N) = seed, seed + 1, ..., seed + N - 1;
  "A-B" = A..B inclusive; "A,B,C" = those seeds. "1" (the default) = [seed], one run."""
  text = str(cfg.train.get("seeds", "1") if "train" in cfg else "1").replace(" ", "")
  bad = UserError(f"train.seeds must be a count N >= 1, a range A-B or a list A,B,C of "
                  f"seeds >= 0; got {text!r}")
  if re.fullmatch(r"\d+", text):
    n = int(text)
    if n < 1:
      raise bad
    return [int(cfg.seed) + i for i in range(n)]
  m = re.fullmatch(r"(\d+)-(\d+)", text)
  if m:
    lo, hi = int(m.group(1)), int(m.group(2))
    if hi < lo:
      raise bad
    return list(range(lo, hi + 1))
  if re.fullmatch(r"\d+(,\d+)+,?", text):
    out = [int(x) for x in text.split(",") if x]
    if len(set(out)) != len(out):
      raise UserError(f"train.seeds lists a seed twice: {text!r}")
    return out
  raise bad


def eval_defaults(**overrides) -> ml_collections.ConfigDict:
  """The `eval` group: batch size, BLEU sentences on valid (0 = all), LM eval batches."""
  e = ml_collections.ConfigDict(dict(batch_size=128, bleu_examples=200, lm_batches=4))
  e.update(overrides)
  return e
