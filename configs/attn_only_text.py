"""Two-layer attention-only LM of natural text, in the papers' shape (Elhage et al. 2021,
Olsson et al. 2022): 12 heads per layer, no MLP, no LayerNorm, positions entering Q and K
only, BPE over text that every Python installation has: every .py file of the standard
library (corpus=stdlib_all, the default: 31.5 MB, about 10 M tokens, so 2,000 steps of
32 x 256 are 1.6 epochs), its 168 top-level modules only (corpus=stdlib, 4.7 MB: 3,000
steps are 16 epochs and the valid loss rises after step 2,000), or your own files with
corpus=FILE,FILE.

  mha-jax train --config configs/attn_only_text.py --workdir runs/attn_only_text
  mha-jax train --config configs/attn_only_text.py --workdir runs/text3 --config.train.seeds=3

Positions: pos=qk_sinusoidal (default; Shortformer's position-infused attention:
sinusoids added to the inputs of Q and K only), qk (a learned table there), rope (rotary
queries and keys) or relative (a learned per-head offset bias); bias=true adds biases to
the projections; attention=gated (or another variant of mha_jax.attention.VARIANTS)
changes every attention layer. What each gave on 2 cores is in docs/guide/circuits.md. A constant
learning rate after 100 warmup steps, so a run resumes to more steps with the same
schedule; decay=N makes the last N steps decay linearly to 0 (schedule wsd). A
checkpoint every 100 steps, so `mha-jax circuits` can follow the induction phase change.
"""

import glob
import os
import sysconfig

import ml_collections

from mha_jax import config as mc


def _utf8(path: str) -> bool:
  try:
    with open(path, encoding="utf-8") as f:
      return bool(f.read().strip())
  except UnicodeDecodeError:
    return False


def stdlib_files(corpus: str) -> list[str]:
  """corpus=stdlib: the standard library's top-level modules (168 files, 4.7 MB);
  stdlib_all: every UTF-8 .py file under it that is not empty, tests included (1,758
  files, 31.5 MB in Python 3.11); else []."""
  root = sysconfig.get_paths()["stdlib"]
  if corpus == "stdlib":
    return sorted(glob.glob(os.path.join(root, "*.py")))
  if corpus == "stdlib_all":
    return [f for f in sorted(glob.glob(os.path.join(root, "**", "*.py"), recursive=True))
            if "site-packages" not in f and os.path.getsize(f) and _utf8(f)]
  return []


def get_config(arg=None):
  a = mc.parse_arg(arg, heads=12, d_model=256, head_dim=32, layers=2, vocab=2048,
                   max_len=256, steps=2000, batch=32, lr=3e-3, seed=0, corpus="stdlib_all",
                   pos="qk_sinusoidal", max_rel=16, bias=False, decay=0,
                   attention="softmax")
  cfg = ml_collections.ConfigDict()
  cfg.task = "lm"
  cfg.seed = a.seed
  files = stdlib_files(a.corpus) or [f for f in a.corpus.split(",") if f]
  cfg.data = dict(kind="text", seed=0, text_files=tuple(files), tokenizer="bpe",
                  vocab_size=a.vocab,
                  half_len=0)
  cfg.model = dict(
      d_model=a.d_model, num_heads=a.heads, head_dim=a.head_dim, num_layers=a.layers,
      d_ff=0, max_len=a.max_len, dropout=0.0, layer_norm=False, attn_only=True,
      use_bias=a.bias, pos=a.pos, max_rel=a.max_rel, impl="auto",
      attention=a.attention)
  cfg.train = mc.train_defaults(steps=a.steps, batch_size=a.batch, lr=a.lr, warmup=100,
                                schedule="constant", weight_decay=0.0, eval_every=500,
                                checkpoint_every=100, log_every=50, keep=100)
  if a.decay:    # the last `decay` steps decay linearly to 0 (schedule wsd)
    cfg.train.schedule, cfg.train.decay_steps = "wsd", a.decay
  cfg.eval = mc.eval_defaults(batch_size=32, lm_batches=4)
  return cfg
