"""Behaviours for circuit search (a study's --task): prompt pairs and the metric each is
judged by.

  ioi, induction  toolkit.pairs' pairs; the metric is the logit difference
  greater-than    Hanna et al. 2023: "The war lasted from the year 1732 to the year 17";
                  the metric is P(years after the start) - P(years before it). Where the
                  vocabulary has every two-digit number as one token (GPT-2) the years
                  are those tokens; where digits are single tokens (SmolLM2, Gemma) the
                  next token is the tens digit, and the metric is P(tens digit above the
                  start's) - P(below). Corrupt: the start year's last two digits 01.
  mib-*           MIB's tasks (circuits.mib_tasks): mib-ioi, mib-mcqa,
                  mib-arithmetic-add, mib-arithmetic-sub, MIB's logit difference
  a JSONL file    patch's format, one {"clean", "corrupt", "answer", "wrong"} a line, with
                  an optional "metric": "logit_diff" (default) or "prob_diff"
                  (p(answer) - p(wrong)), the same on every line

A metric maps the logits at each prompt's answer position (N, V) to (N,) per pair.
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np

from mha_jax import storage
from mha_jax.circuits import mib_tasks
from mha_jax.errors import UserError
from mha_jax.toolkit import pairs as pairs_lib

FILE_METRICS = ("logit_diff", "prob_diff")
NOUNS = ("war", "expedition", "contract", "drought", "reign", "famine", "strike",
         "journey", "siege", "truce")


def logit_diff(answer, wrong):
  a, w = jnp.asarray(answer), jnp.asarray(wrong)
  return lambda logits: (logits[jnp.arange(a.shape[0]), a] - logits[jnp.arange(a.shape[0]), w])


def prob_diff(answer, wrong):
  a, w = jnp.asarray(answer), jnp.asarray(wrong)

  def fn(logits):
    p = jax.nn.softmax(logits, axis=-1)
    rows = jnp.arange(a.shape[0])
    return p[rows, a] - p[rows, w]
  return fn


def signed_prob(ids, sign_NC):
  """sum_c p(ids[c]) sign[n, c] per pair: P(above) - P(below)."""
  ids, sign = jnp.asarray(ids), jnp.asarray(sign_NC, jnp.float32)
  return lambda logits: (jax.nn.softmax(logits, axis=-1)[:, ids] * sign).sum(-1)


def _year_tokens(task):
  """(ids (C,), width): the 100 two-digit tokens "00".."99", else the digits 0..9."""
  two = [pairs_lib.single_token(task, f"{y:02d}") for y in range(100)]
  if all(t is not None for t in two) and len(set(two)) == 100:
    return np.asarray(two), 2
  one = [pairs_lib.single_token(task, str(d)) for d in range(10)]
  if any(t is None for t in one):
    raise UserError("task greater-than needs the digits (or every two-digit number) "
                    "as single tokens of this model's vocabulary", setting="task")
  return np.asarray(one), 1


def greater_than(task, n: int = 8, seed: int = 0):
  """(Pairs, metric): "The {noun} lasted from the year 17YY to the year 17" against the
  start 1701; the metric P(after) - P(before) (see the module docstring)."""
  if n < 1:
    raise UserError(f"n_pairs must be >= 1; got {n}", setting="n_pairs")
  ids, width = _year_tokens(task)
  rng = np.random.default_rng(seed)
  rows, signs = [], []
  tmpl = "The {noun} lasted from the year 17{yy:02d} to the year 17"
  for i in range(n):
    yy = int(rng.integers(12, 89))      # leaves years on both sides (and tens 1..8)
    noun = NOUNS[i % len(NOUNS)]
    clean, corrupt = tmpl.format(noun=noun, yy=yy), tmpl.format(noun=noun, yy=1)
    ci, xi = pairs_lib.encode(task, clean), pairs_lib.encode(task, corrupt)
    if len(ci) != len(xi):
      continue
    start = yy if width == 2 else yy // 10
    vals = np.arange(len(ids))
    signs.append(np.sign(vals - start).astype(np.float32))
    rows.append((ci, xi, int(ids[min(start + 1, len(ids) - 1)]), int(ids[max(start - 1, 0)]),
                 {"clean": clean, "corrupt": corrupt, "answer": f"after 17{yy:02d}",
                  "wrong": f"before 17{yy:02d}"}))
  if not rows:
    raise UserError("no greater-than pair tokenized to equal lengths for this tokenizer")
  pairs = pairs_lib.pack_pairs(rows)
  return pairs, {"name": "P(after) - P(before)", "ids": ids, "sign": np.stack(signs)}


def metric_of(pairs, spec) -> callable:
  """The (N, V) -> (N,) metric of a pairs' metric spec (a name or greater-than's)."""
  if isinstance(spec, dict):
    return signed_prob(spec["ids"], spec["sign"])
  if spec == "prob_diff":
    return prob_diff(pairs.answer, pairs.wrong)
  return logit_diff(pairs.answer, pairs.wrong)


def file_metric(path: str) -> str:
  """The "metric" field of a pairs file (default logit_diff), refused naming the line
  where it is unknown or differs from the first line's."""
  seen = None
  for no, line in enumerate(storage.read_text(path).splitlines(), 1):
    if not line.strip():
      continue
    try:
      obj = json.loads(line)
    except json.JSONDecodeError:
      continue           # read_pairs names it
    m = obj.get("metric", "logit_diff") if isinstance(obj, dict) else "logit_diff"
    if m not in FILE_METRICS:
      raise UserError(f"pairs {path}, line {no}: metric must be one of {FILE_METRICS}; "
                      f"got {m!r}", setting="pairs")
    if seen is not None and m != seen:
      raise UserError(f"pairs {path}, line {no}: metric {m!r} differs from the first "
                      f"line's {seen!r} (one metric per file)", setting="pairs")
    seen = m
  return seen or "logit_diff"


def _logit_diff(build):
  return lambda task, n, seed: (build(task, n, seed), "logit_diff")


# behaviour -> fn(task, n, seed) -> (Pairs, metric spec)
BUILDERS = {**{name: _logit_diff(build) for name, build in pairs_lib.BUILDERS.items()},
            "greater-than": greater_than,
            **{name: _logit_diff(lambda task, n, seed, name=name: mib_tasks.make(
                task, name, n, seed)) for name in mib_tasks.TASKS}}
BEHAVIOURS = tuple(BUILDERS)


def make(loaded, behaviour: str | None, pairs_file: str | None, n: int, seed: int):
  """(Pairs, metric spec) of a built-in behaviour or a pairs file (toolkit.pairs'
  select_pairs)."""
  got = pairs_lib.select_pairs(loaded.task, behaviour, pairs_file, n, seed, BUILDERS)
  return (got, file_metric(pairs_file)) if pairs_file is not None else got


def subset_metric(spec, rows):
  if isinstance(spec, dict):
    return {**spec, "sign": np.asarray(spec["sign"])[np.asarray(rows)]}
  return spec
