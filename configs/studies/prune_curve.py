"""`mha-jax prune-curve`: the test metric against heads kept for l0, michel and random
(random as the mean of three orders); the pruned models at 12 heads kept on disk.

  mha-jax prune-curve --workdir W --config configs/studies/prune_curve.py
"""

import ml_collections


def get_config(arg=None):
  del arg
  return ml_collections.ConfigDict(dict(counts=(48, 24, 12, 6, 0), stacks="encoder",
                                        random_draws=3, save_workdirs=(12,),
                                        l0_lambda=0.05, steps=200))
