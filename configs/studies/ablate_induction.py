"""`mha-jax ablate`: the top induction heads together against random heads of the same
layers, mean-ablated (language models, e.g. a configs/induction.py run).

  mha-jax ablate --workdir W --config configs/studies/ablate_induction.py:top=3
"""

import ml_collections

from mha_jax import config as mc


def get_config(arg=None):
  a = mc.parse_arg(arg, top=5, draws=5)
  return ml_collections.ConfigDict(dict(induction_vs_random=True, top=a.top,
                                        draws=a.draws, mode="mean", split="test"))
