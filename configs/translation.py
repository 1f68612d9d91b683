"""Encoder-decoder translation, the setting of Voita et al. (2019).

  mha-jax train --config configs/translation.py --workdir runs/tr
  mha-jax train --config configs/translation.py:heads=16 --workdir runs/h16
  mha-jax train --config configs/translation.py:quickstart --workdir runs/qs

Arguments: heads, d_model (default 128; 64 with quickstart), layers (encoder and decoder
each), pos (relative or sinusoidal), steps, lr, seed, quickstart (a smaller, shorter run
at a higher peak learning rate: the README's first run), voita (Voita et al.'s setting
for the pruning claim: sinusoidal positions, 48 encoder heads, 4000 steps at lr 3e-3),
attention (the attention variant: softmax, gated, gated_head, differential, sigmoid,
sink, qk_norm; docs/guide/attention.md). Data: the built-in synthetic language pair, or
data.kind=parallel with data.{train,valid,test}_{src,tgt} files and optional
data.conllu.{train,valid,test} parses of the source side.

Training batches are packed (train.pack, default true): whole sentence pairs side by
side in rows with segment ids, the same maths as padded rows in fewer positions
(mha_jax/data/packing.py).

Positions: model.pos="relative" (default; a learned score bias per head and offset,
clipped at +-max_rel, Shaw et al. 2018) or "sinusoidal" (added to the embeddings, as in
Vaswani et al. and Voita et al.). Relative positions are the default because at the
quickstart size they are what lets encoder heads become positional (docs/guide/models.md
says what was seen).
"""

import ml_collections

from mha_jax import config as mc


def get_config(arg=None):
  a = mc.parse_arg(arg, heads=8, d_model=0, layers=6, quickstart=False, pos="",
                   steps=0, lr=0.0, seed=0, voita=False, attention="softmax")
  d_model = a.d_model or (64 if a.quickstart else 128)
  cfg = ml_collections.ConfigDict()
  cfg.task = "translation"
  cfg.seed = a.seed
  cfg.data = dict(
      kind="synthetic", seed=0, train_size=20000, valid_size=500, test_size=500, max_len=24,
      grammar=dict(num_nouns=300, num_verbs=120, num_adjectives=120, num_adverbs=60,
                   num_names=200, zipf_exponent=1.1, subwords=False),
      train_src="", train_tgt="", valid_src="", valid_tgt="", test_src="", test_tgt="",
      conllu=dict(train="", valid="", test=""))
  cfg.model = dict(
      d_model=d_model, num_heads=a.heads, head_dim=0, enc_layers=a.layers,
      dec_layers=a.layers, d_ff=4 * d_model, dropout=0.0, layer_norm=True, ln_position="pre",
      attn_only=False, use_bias=False, impl="auto", attention=a.attention,
      pos=a.pos or ("sinusoidal" if a.voita else "relative"), max_rel=16)
  cfg.train = mc.train_defaults(steps=3000, batch_size=64, lr=2e-3, warmup=300,
                                label_smoothing=0.1)
  cfg.train.pack = True             # sentence pairs packed into rows (data/packing.py)
  cfg.eval = mc.eval_defaults()
  if a.quickstart:
    cfg.train.steps = 500
    cfg.train.warmup = 100
    cfg.train.lr = 1e-2             # a short run: at 2e-3 no encoder head became positional
    cfg.train.eval_every = 500
    cfg.eval.bleu_examples = 100
    cfg.train.checkpoint_every = 250
    cfg.train.log_every = 50
  if a.voita:      # the setting of Voita et al.'s pruning finding (docs/guide/claims.md)
    cfg.train.steps, cfg.train.lr = 4000, 3e-3
    cfg.train.checkpoint_every, cfg.train.eval_every = 500, 1000
  cfg.train.steps = a.steps or cfg.train.steps
  cfg.train.lr = a.lr or cfg.train.lr
  return cfg
