"""`mha-jax prune --method michel`: drop the heads of least gradient importance (Michel et
al.), one at a time, until `keep` remain; never empty a layer.

  mha-jax prune --workdir W --out P --config configs/studies/prune_michel.py:keep=6
"""

import ml_collections

from mha_jax import config as mc


def get_config(arg=None):
  a = mc.parse_arg(arg, keep=12)
  return ml_collections.ConfigDict(dict(method="michel", keep=a.keep, stacks="encoder",
                                        keep_one_per_layer=True, bleu_limit=0))
