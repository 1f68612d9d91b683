"""Decoder-only language model on plain text.

  mha-jax train --config configs/lm.py --workdir runs/lm
  mha-jax train --config configs/lm.py:attn_only,layers=2 --workdir runs/lm2
  mha-jax train --config configs/lm.py:attention=gated --workdir runs/lm_gated

attention: the attention variant (softmax, gated, gated_head, differential, sigmoid,
sink, qk_norm; docs/guide/attention.md), also --config.model.attention=...

The built-in text is Python's bundled documentation (pydoc_data.topics), BPE-tokenized
with `tokenizers`; data.text_files takes your own UTF-8 files, data.tokenizer=bytes
uses raw bytes.
"""

import ml_collections

from mha_jax import config as mc


def get_config(arg=None):
  a = mc.parse_arg(arg, heads=8, d_model=128, layers=4, attn_only=False, attention="softmax")
  cfg = ml_collections.ConfigDict()
  cfg.task = "lm"
  cfg.seed = 0
  cfg.data = dict(kind="text", seed=0, text_files=(), tokenizer="bpe", vocab_size=2048,
                  half_len=0)
  cfg.model = dict(
      d_model=a.d_model, num_heads=a.heads, head_dim=0, num_layers=a.layers,
      d_ff=4 * a.d_model, max_len=128, dropout=0.0, layer_norm=True,
      attn_only=a.attn_only, use_bias=False, pos="learned", impl="auto",
      attention=a.attention)
  cfg.train = mc.train_defaults(steps=2000, batch_size=32, lr=1e-3, warmup=200,
                                schedule="cosine")
  cfg.eval = mc.eval_defaults(batch_size=32)
  return cfg
