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

# Fields that may change when a run resumes in an existing workdir.
RESUMABLE_FIELDS = ("train.steps", "train.eval_every", "train.log_every",
                    "train.checkpoint_every", "train.progress", "train.keep", "eval", "mesh")


def parse_arg(arg: str | None, **defaults) -> ml_collections.ConfigDict:
  """big_vision-style argument: "heads=16,small" -> {heads: 16, small: True}.

  Values are typed like the defaults. A value may itself hold commas
  ("heads=1,4,8,steps=300" gives heads="1,4,8"). Unknown keys raise ValueError.
  """
  out = ml_collections.ConfigDict(defaults)
  if not arg:
    return out
  for part in re.split(r",(?=[A-Za-z_]\w*(?:=|,|$))", arg):
    if not part:
      continue
    key, eq, value = part.partition("=")
    if key not in defaults:
      raise ValueError(f"config argument {key!r} is unknown; known: {sorted(defaults)}")
    out[key] = _cast(value if eq else "true", defaults[key], f"config argument {key!r}")
  return out


def _cast(text: str, like: Any, what: str) -> Any:
  try:
    if isinstance(like, bool):
      low = text.lower()
      if low not in ("true", "false", "1", "0", "yes", "no"):
        raise ValueError
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
    raise ValueError(f"{what}: cannot read {text!r} as {type(like).__name__}") from None


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


def load_config(spec: str) -> ml_collections.ConfigDict:
  """Loads "path/to/config.py[:arg]" and locks it (see `resolve` for where it looks)."""
  path, _, arg = resolve(spec).partition(":")
  if not os.path.isfile(path):
    raise ValueError(f"--config: no such file {path!r}")
  mod_spec = importlib.util.spec_from_file_location(
      "mha_jax_config_" + os.path.splitext(os.path.basename(path))[0], path)
  module = importlib.util.module_from_spec(mod_spec)
  mod_spec.loader.exec_module(module)
  if not hasattr(module, "get_config"):
    raise ValueError(f"--config: {path!r} has no get_config(arg)")
  cfg = module.get_config(arg or None)
  if "mesh" not in cfg:   # a config need not say how it is laid out on devices
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
      raise ValueError(f"config key {key!r} is unknown{hint}")
    if i < len(parts) - 1:
      node = node[p]
  current = node[parts[-1]]
  if isinstance(current, ml_collections.ConfigDict):
    raise ValueError(f"config key {key!r} is a group; set one of its fields")
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
          raise ValueError(f"--config.{key} needs a value")
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
                                 "mesh.data": 0, "mesh.model": 1},
                "lm": {"mesh.data": 0, "mesh.model": 1}}


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
  """Fields that differ between two configs and may not change on resume."""
  a, b = flatten(saved), flatten(new)
  out = []
  for k in sorted(set(a) | set(b)):
    if a.get(k) != b.get(k) and not any(k == f or k.startswith(f + ".")
                                        for f in RESUMABLE_FIELDS):
      out.append(k)
  return out


def validate(cfg: ml_collections.ConfigDict) -> None:
  """Checks values the code relies on; errors name the field."""
  if cfg.task in PRETRAINED_TASKS:
    return validate_pretrained(cfg)
  m, t = cfg.model, cfg.train
  for key in ("d_model", "num_heads"):
    if m[key] < 1:
      raise ValueError(f"model.{key} must be >= 1; got {m[key]}")
  if m.head_dim == 0 and m.d_model % m.num_heads:
    raise ValueError(f"model.num_heads={m.num_heads} does not divide "
                     f"model.d_model={m.d_model} (or set model.head_dim)")
  if m.head_dim < 0:
    raise ValueError(f"model.head_dim must be >= 0 (0 = d_model / num_heads); got {m.head_dim}")
  if m.get("ln_position", "pre") not in ("pre", "post"):
    raise ValueError(f"model.ln_position must be 'pre' or 'post'; got {m.ln_position!r}")
  if cfg.task == "lm" and m.pos not in ("learned", "sinusoidal", "qk"):
    raise ValueError(f"model.pos must be learned, sinusoidal or qk; got {m.pos!r}")
  if cfg.task == "translation":
    if m.pos not in ("sinusoidal", "relative"):
      raise ValueError(f"model.pos must be sinusoidal or relative for translation; got "
                       f"{m.pos!r}")
    if m.max_rel < 1:
      raise ValueError(f"model.max_rel (relative offsets are clipped to +-max_rel) must "
                       f"be >= 1; got {m.max_rel}")
  if t.steps < 1:
    raise ValueError(f"train.steps must be >= 1; got {t.steps}")
  if t.batch_size < 1:
    raise ValueError(f"train.batch_size must be >= 1; got {t.batch_size}")
  if t.lr <= 0:
    raise ValueError(f"train.lr must be > 0; got {t.lr}")
  if t.schedule not in ("inverse_sqrt", "cosine", "constant"):
    raise ValueError(f"train.schedule must be inverse_sqrt, cosine or constant; got "
                     f"{t.schedule!r}")
  for key in ("eval_every", "log_every", "checkpoint_every"):
    if t[key] < 1:
      raise ValueError(f"train.{key} must be >= 1; got {t[key]}")
  if cfg.task not in ("translation", "lm"):
    raise ValueError(f"task must be 'translation' or 'lm'; got {cfg.task!r}")


# Tasks of imported models (mha-jax import): no training fields.
PRETRAINED_TASKS = ("pretrained_lm", "embedding")


def validate_pretrained(cfg: ml_collections.ConfigDict) -> None:
  """Checks an imported model's config (written by mha_jax.pretrained)."""
  m = cfg.model
  for key in ("d_model", "num_heads", "head_dim", "num_layers", "d_ff", "vocab_size"):
    if m[key] < 1:
      raise ValueError(f"model.{key} must be >= 1; got {m[key]}")
  if cfg.task == "pretrained_lm" and m.num_heads % m.num_kv_heads:
    raise ValueError(f"model.num_kv_heads={m.num_kv_heads} must divide "
                     f"model.num_heads={m.num_heads}")
  for key in ("batch_size", "seq_len", "windows"):
    if cfg.eval[key] < 1:
      raise ValueError(f"eval.{key} must be >= 1; got {cfg.eval[key]}")


def train_defaults(**overrides) -> ml_collections.ConfigDict:
  """The `train` group shared by the configs."""
  t = ml_collections.ConfigDict(dict(
      steps=2000, batch_size=64, lr=1e-3, warmup=200, schedule="inverse_sqrt",
      weight_decay=0.01, b2=0.98, clip=1.0, label_smoothing=0.0,
      eval_every=500, log_every=50, checkpoint_every=500, keep=3, progress=True))
  t.update(overrides)
  return t


def eval_defaults(**overrides) -> ml_collections.ConfigDict:
  """The `eval` group: batch size, BLEU sentences on valid (0 = all), LM eval batches."""
  e = ml_collections.ConfigDict(dict(batch_size=128, bleu_examples=200, lm_batches=4))
  e.update(overrides)
  return e
