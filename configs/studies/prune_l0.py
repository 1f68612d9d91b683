"""`mha-jax prune --method l0`: Hard Concrete gates (Voita et al.) trained with an L0
penalty, then the top `keep` gates kept.

  mha-jax prune --workdir W --out P --config configs/studies/prune_l0.py:keep=12
"""

import ml_collections

from mha_jax import config as mc


def get_config(arg=None):
  a = mc.parse_arg(arg, keep=12, steps=300)
  return ml_collections.ConfigDict(dict(
      method="l0", keep=a.keep, stacks="encoder", l0_lambda=0.05, steps=a.steps, lr=0.05,
      beta=1 / 3, init_log_alpha=2.0, binarize="nonzero", finetune=False, seed=0))
