"""Decoder-only LM trained here, on repeated random tokens or on plain text."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from mha_jax import storage
from mha_jax.data import repeated_tokens, text, vocab
from mha_jax.errors import UserError
from mha_jax.models import lm as lm_model
from mha_jax.tasks import base


class LMTask:
  """Decoder-only LM on repeated random tokens or plain text."""

  name = "lm"
  stacks = ("lm",)
  trainable = True
  decoder_only = True
  reports_bleu = False
  role_family = "lm"
  compares_to_dense = False
  packs = False

  def __init__(self, cfg, workdir: str | None, *, read_only: bool = False):
    self.cfg = cfg
    d = cfg.data
    self.data_dir = storage.join(workdir, "data") if workdir else None
    save_tokenizer = False
    if d.kind == "repeated":
      self.vocab_size = d.vocab_size
      self.seq_len = 1 + 2 * d.half_len
      repeated_tokens.repeated_tokens(d.seed, 0, 1, d.half_len, d.vocab_size)  # validates
    elif d.kind == "text":
      tok_path = None
      if self.data_dir:
        for name in ("tokenizer.json", "tokenizer.bytes"):
          if storage.exists(storage.join(self.data_dir, name)):
            tok_path = storage.join(self.data_dir, name)
      corpus = text.read_corpus(list(d.text_files))
      if tok_path:
        self.tokenizer = text.TextTokenizer.load(tok_path)
      else:
        self.tokenizer = text.TextTokenizer.train(d.tokenizer, corpus, d.vocab_size)
        if self.data_dir and not read_only:
          save_tokenizer = True
      self.streams = text.split_stream(self.tokenizer.encode(corpus))
      self.vocab_size = self.tokenizer.vocab_size
      self.seq_len = cfg.model.max_len
    else:
      raise UserError(f"data.kind must be 'repeated' or 'text' for lm; got {d.kind!r}")
    if self.seq_len > cfg.model.max_len:
      raise UserError(f"data.half_len={d.half_len} gives sequences of {self.seq_len} tokens, "
                      f"more than model.max_len={cfg.model.max_len}")
    self.spec = base.model_spec(cfg)
    if save_tokenizer:         # once every check above has passed
      storage.makedirs(self.data_dir)
      self.tokenizer.save(self.data_dir)

  bos_id = vocab.LM_BOS_ID      # every sequence begins with it (repeated tokens, text)
  adds_bos = False              # the text tokenizer's encode leaves it out

  @property
  def window(self) -> int:
    """The context window in tokens (model.max_len)."""
    return int(self.cfg.model.max_len)

  def init_params(self, key):
    return base.init_model(self.cfg, key, self.vocab_size)

  def apply(self, params, batch, *, key=None, hook=None):
    base.check_batch_ids(self, batch)
    return lm_model.apply(params, self.spec, batch["tokens"][:, :-1], key=key, hook=hook,
                          logits_at=batch.get("logits_at"))

  def _batch(self, split: str, index: int, batch: int) -> np.ndarray:
    d = self.cfg.data
    seed = {"train": base.train_order_seed(self.cfg), "valid": d.seed + 1_000_003,
            "test": d.seed + 2_000_003}[base.check_split(split)]
    if d.kind == "repeated":
      return repeated_tokens.repeated_tokens(seed, index, batch, d.half_len, d.vocab_size,
                                             d.get("min_half_len", 0), return_lengths=True,
                                             random_start=d.get("random_start", False))
    return text.windows(self.streams[split], seed, index, batch, self.seq_len + 1), None

  def train_batch(self, step: int, process_index: int = 0, process_count: int = 1):
    b = self.cfg.train.batch_size
    batch = self._make(*self._batch("train", step, b))
    rows = base.local_rows(b, process_index, process_count)
    batch = {k: v[rows] for k, v in batch.items()}
    base.check_ids(batch["tokens"], self.vocab_size, "training batch")
    return batch

  def _make(self, tokens, lengths, starts=None):
    """The batch dict; for repeated tokens with the first/repeat position masks."""
    if lengths is None:
      return {"tokens": tokens}
    masks = repeated_tokens.position_masks(lengths, tokens.shape[1] - 1, starts)
    return {"tokens": tokens, "mask_first": masks["first"], "mask_repeat": masks["repeat"]}

  def eval_batches(self, split: str, batch_size: int):
    base.check_split(split)
    for i in range(max(1, self.cfg.eval.lm_batches)):
      yield self._make(*self._batch(split, i, batch_size)), np.ones(batch_size, np.float32)

  def text_windows(self, split: str, batch: int):
    """(batch, max_len + 1) [BOS] + text windows of `split`; None for repeated tokens."""
    if self.cfg.data.kind != "text":
      return None
    return self._batch(split, 0, batch)[0]

  def repeated_tokens(self, seed: int, batch: int, half_len: int, min_half_len: int = 0):
    """(tokens (B, 1 + 2n), copy lengths m (B,)): [BOS] r_1..r_m r_1..r_m [fresh tail],
    r uniform over ids 1..V-1 of the run's own vocabulary (data.repeated_tokens; the
    imported LMs' member of the same name, which the head taxonomy reads)."""
    return repeated_tokens.repeated_tokens(seed, 0, batch, half_len, self.vocab_size,
                                           min_half_len, return_lengths=True)

  def special_ids(self) -> np.ndarray:
    """Ids of the special tokens: BOS (0), and BPE's <unk> (1) on text."""
    bpe = self.cfg.data.kind == "text" and self.tokenizer.kind == "bpe"
    return np.asarray([0, 1] if bpe else [0], np.int64)

  def repeated_eval_tokens(self, batch: int, seed_offset: int = 7_000_003):
    """Repeated random tokens held out from training. A model trained on text gets them
    over its own vocabulary (BOS is id 0 in both), with n as long as its context allows,
    as the papers evaluate text models."""
    d = self.cfg.data
    if d.kind == "repeated":
      return repeated_tokens.repeated_tokens(d.seed + seed_offset, 0, batch, d.half_len,
                                             d.vocab_size, d.get("min_half_len", 0),
                                             return_lengths=True)
    n = (self.cfg.model.max_len - 1) // 2
    return repeated_tokens.repeated_tokens(d.seed + seed_offset, 0, batch, n,
                                           self.vocab_size, max(1, n // 2),
                                           return_lengths=True)

  def loss(self, params, batch, *, key=None, hook=None, label_smoothing=0.0,
           example_weight=None):
    tokens = batch["tokens"]
    logits = self.apply(params, batch, key=key, hook=hook)
    nll, obj, correct = base.token_losses(logits, tokens[:, 1:], label_smoothing)
    w = jnp.ones_like(nll) if example_weight is None else jnp.broadcast_to(
        example_weight[:, None], nll.shape)
    return base.weighted_mean(obj, w), base.token_metrics(nll, correct, w, batch)

  def evaluate(self, params, split: str, *, bleu: bool | None = None, hook=None,
               bleu_limit: int | None = None) -> dict[str, float]:
    del bleu, bleu_limit
    return base.per_token(base.sum_metrics(self, params, split, self.cfg.eval.batch_size,
                                           hook))
