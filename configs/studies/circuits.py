"""`mha-jax circuits`: induction heads, composition scores, positivity and paths, here
without the pass over every checkpoint (set track=true, or --config.track=true).

  mha-jax circuits --workdir W --config configs/studies/circuits.py:track
"""

import ml_collections

from mha_jax import config as mc


def get_config(arg=None):
  a = mc.parse_arg(arg, track=False)
  return ml_collections.ConfigDict(dict(track=a.track))
