"""Two-layer attention-only LM of natural text, in the papers' shape (Elhage et al. 2021,
Olsson et al. 2022): 12 heads per layer, no MLP, no LayerNorm, positions entering Q and K
only (pos=qk, Shortformer style), BPE over text that every Python installation has:
the standard library's top-level modules (about 4.7 MB of code and docstrings; Python's
bundled documentation alone, 0.5 MB, is memorised by 12 heads within 500 steps), or
your own files with corpus=FILE,FILE.

  mha-jax train --config configs/attn_only_text.py --workdir runs/attn_only_text

A checkpoint every 250 steps, so `mha-jax circuits` can follow the induction phase
change.
"""

import glob
import os
import sysconfig

import ml_collections

from mha_jax import config as mc


def get_config(arg=None):
  a = mc.parse_arg(arg, heads=12, d_model=256, head_dim=32, layers=2, vocab=2048,
                   max_len=256, steps=6000, batch=32, lr=1e-3, seed=0, corpus="stdlib",
                   pos="qk", max_rel=32)
  cfg = ml_collections.ConfigDict()
  cfg.task = "lm"
  cfg.seed = a.seed
  files = (sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py")))
           if a.corpus == "stdlib" else [f for f in a.corpus.split(",") if f])
  cfg.data = dict(kind="text", seed=0, text_files=tuple(files), tokenizer="bpe",
                  vocab_size=a.vocab,
                  half_len=0)
  cfg.model = dict(
      d_model=a.d_model, num_heads=a.heads, head_dim=a.head_dim, num_layers=a.layers,
      d_ff=0, max_len=a.max_len, dropout=0.0, layer_norm=False, attn_only=True,
      use_bias=False, pos=a.pos, max_rel=a.max_rel, impl="auto")
  cfg.train = mc.train_defaults(steps=a.steps, batch_size=a.batch, lr=a.lr, warmup=200,
                                schedule="cosine", weight_decay=0.0, eval_every=250,
                                checkpoint_every=250, log_every=50, keep=100)
  cfg.eval = mc.eval_defaults(batch_size=32, lm_batches=4)
  return cfg
