"""Attention-only 2-layer model on repeated random tokens: induction heads.

  mha-jax train --config configs/induction.py --workdir runs/induction

Sequences are [BOS] r_1..r_n r_1..r_n with r uniform over the vocabulary. The loss on
the repeated half can only fall below ln(V) through in-context copying. Positions enter
Q and K only (pos=qk, Shortformer style, as in the papers) unless pos=learned; every
250th step is kept, so `mha-jax circuits` can follow the phase change. Each sequence
copies m tokens, m drawn from [half_len / 2, half_len]: the repeat distance varies, so no
head can find the earlier copy by position alone. With random_start (default) the first
copy starts after p random tokens, p in 0..2 (half_len - m), so the previous-token head is
needed at more positions than 1..m (it then attends to t-1 up to position 35 of 47, not
23; docs/guide/circuits.md). lr 1e-2: at 3e-3 the heads stayed soft.
"""

import ml_collections

from mha_jax import config as mc


def get_config(arg=None):
  a = mc.parse_arg(arg, heads=4, d_model=64, layers=2, vocab=64, half_len=24,
                   layer_norm=False, pos="qk", random_start=True,
                   min_half_len=0)
  cfg = ml_collections.ConfigDict()
  cfg.task = "lm"
  cfg.seed = 0
  cfg.data = dict(kind="repeated", seed=0, vocab_size=a.vocab, half_len=a.half_len,
                  min_half_len=a.min_half_len or a.half_len // 2,
                  random_start=a.random_start, text_files=(), tokenizer="bpe")
  cfg.model = dict(
      d_model=a.d_model, num_heads=a.heads, head_dim=0, num_layers=a.layers, d_ff=0,
      max_len=2 * a.half_len + 1, dropout=0.0, layer_norm=a.layer_norm, attn_only=True,
      use_bias=False, pos=a.pos, impl="auto")
  cfg.train = mc.train_defaults(steps=4000, batch_size=32, lr=1e-2, warmup=100,
                                schedule="constant", weight_decay=0.0, eval_every=250,
                                checkpoint_every=250, log_every=50, keep=100)
  cfg.eval = mc.eval_defaults(batch_size=64, lm_batches=4)
  return cfg
