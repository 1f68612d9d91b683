"""Sweep the number of heads h x the attention variant, one run per point.

  mha-jax sweep --config configs/sweep_variants.py --workdir runs/variants
  mha-jax sweep --config configs/sweep_variants.py:base=translation.py --workdir runs/vt
  mha-jax sweep --config configs/sweep_variants.py:heads=2,8,variants=softmax+gated \
      --workdir runs/v --config.train.steps=600

Arguments: heads (separated by commas) and variants (by "+"), base (a config
file next to this one: attn_only_text.py, the natural-text two-layer model, by default;
translation.py runs at its quickstart size) and base_arg (more arguments for it).
Widths stay fixed: d_k = d_model / h (attn_only_text with head_dim=0). Run names are
VARIANT_hH, e.g. gated_h8.
"""

import ml_collections

from mha_jax import attention_variants
from mha_jax import config as mc

VARIANTS = "+".join(attention_variants.NAMES)   # every registered variant
_BASE_ARGS = {"attn_only_text.py": "head_dim=0", "translation.py": "quickstart"}


def get_config(arg=None):
  a = mc.parse_arg(arg, heads="1+2+4+8+16", variants=VARIANTS, base="attn_only_text.py",
                   base_arg="")
  split = lambda s: [x for x in str(s).replace("+", ",").split(",") if x]
  heads = [int(h) for h in split(a.heads)]
  cfg = ml_collections.ConfigDict()
  cfg.base = a.base
  cfg.base_arg = ",".join(x for x in (_BASE_ARGS.get(a.base, ""), a.base_arg) if x)
  cfg.runs = [{"name": f"{v}_h{h}",
               "overrides": {"model.num_heads": h, "model.attention": v}}
              for v in split(a.variants) for h in heads]
  return cfg
