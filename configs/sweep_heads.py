"""Sweep the number of heads h at fixed d_model, down to d_k = 1.

  mha-jax sweep --config configs/sweep_heads.py --workdir runs/sweep
  mha-jax sweep --config configs/sweep_heads.py:heads=1,4,8,64,d_model=64 \
      --workdir runs/sweep --config.train.steps=600
  mha-jax sweep ... --print-commands     # one train command per run, for TPU VMs

Arguments: heads (comma-separated), d_model, base (a config file next to this one),
base_arg (extra arguments for it).
"""

import ml_collections

from mha_jax import config as mc


def get_config(arg=None):
  a = mc.parse_arg(arg, heads="1,2,4,8,16,32,64", d_model=64, base="translation.py",
                   base_arg="")
  heads = [int(h) for h in a.heads.split(",") if h]
  cfg = ml_collections.ConfigDict()
  cfg.base = a.base
  cfg.base_arg = ",".join(x for x in (f"d_model={a.d_model}", a.base_arg) if x)
  cfg.runs = [{"name": f"h{h}", "overrides": {"model.num_heads": h}} for h in heads]
  return cfg
