"""`mha-jax analyze`: head roles, importance and the leave-one-out pass on valid.

  mha-jax analyze --workdir W --config configs/studies/analyze.py
  mha-jax analyze --workdir W --config configs/studies/analyze.py:fast   # no ablations

A study config's keys are the verb's flags (--bleu-limit is bleu_limit); see
docs/guide/cli.md.
"""

import ml_collections

from mha_jax import config as mc


def get_config(arg=None):
  a = mc.parse_arg(arg, fast=False)
  return ml_collections.ConfigDict(dict(split="valid", ablations=not a.fast,
                                        bleu_limit=64))
