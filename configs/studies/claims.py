"""`mha-jax claims`: the claims that need no trained run (seconds on a CPU).

  mha-jax claims --config configs/studies/claims.py --out claims_fast
"""

import ml_collections


def get_config(arg=None):
  del arg
  return ml_collections.ConfigDict(dict(only="worked_example,mixture_dip,whole_token"))
