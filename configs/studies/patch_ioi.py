"""`mha-jax patch`: the three patching methods on built-in IOI pairs (an imported LM,
e.g. smollm2-135m); path patching's receivers are the top two heads.

  mha-jax patch --workdir W --out P --config configs/studies/patch_ioi.py:n_pairs=16
"""

import ml_collections

from mha_jax import config as mc


def get_config(arg=None):
  a = mc.parse_arg(arg, n_pairs=8)
  return ml_collections.ConfigDict(dict(task="ioi", method="activation,path,attribution",
                                        n_pairs=a.n_pairs, seed=0, receivers=2,
                                        per_position=False))
