"""Plain text from UTF-8 files (default: Python's bundled documentation), as BPE or bytes."""

from __future__ import annotations

from typing import Sequence

import numpy as np

from mha_jax.data.vocab import LM_BOS_ID as BOS_ID
from mha_jax.errors import UserError
from mha_jax import storage

_SPECIALS = ["<s>", "<unk>"]     # BPE ids 0 and 1


def read_corpus(paths: Sequence[str] | None) -> str:
  """The text of `paths` joined by blank lines; no paths: `pydoc_data.topics`."""
  if not paths:
    from pydoc_data.topics import topics
    return "\n\n".join(topics[k] for k in sorted(topics))
  parts = []
  for p in paths:
    if not storage.isfile(p):
      raise UserError(f"data.text_files: no such file {p!r}")
    try:
      text = storage.read_text(p)
    except UnicodeDecodeError as e:
      raise UserError(f"data.text_files: {p!r} is not UTF-8 text (byte {e.start}: "
                      f"{e.reason})") from None
    if not text.strip():
      raise UserError(f"data.text_files: file {p!r} is empty")
    parts.append(text)
  return "\n\n".join(parts)


class TextTokenizer:
  """BPE (trained with `tokenizers`) or raw bytes. Id 0 is BOS in both."""

  def __init__(self, kind: str, tokenizer=None):
    if kind not in ("bpe", "bytes"):
      raise UserError(f"data.tokenizer must be 'bpe' or 'bytes'; got {kind!r}")
    self.kind = kind
    self.tok = tokenizer

  @classmethod
  def train(cls, kind: str, text: str, vocab_size: int) -> "TextTokenizer":
    if kind == "bytes":
      return cls("bytes")
    if kind != "bpe":
      raise UserError(f"data.tokenizer must be 'bpe' or 'bytes'; got {kind!r}")
    if vocab_size < 260:
      raise UserError(f"data.vocab_size must be >= 260 for BPE; got {vocab_size}")
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=_SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(text.split("\n\n"), trainer=trainer)
    return cls("bpe", tok)

  @classmethod
  def load(cls, path: str) -> "TextTokenizer":
    if path.endswith("bytes"):
      return cls("bytes")
    from tokenizers import Tokenizer
    return cls("bpe", Tokenizer.from_str(storage.read_text(path)))

  def save(self, directory: str) -> str:
    if self.kind == "bytes":
      path = storage.join(directory, "tokenizer.bytes")
      storage.write_text(path, "")
    else:
      path = storage.join(directory, "tokenizer.json")
      storage.write_text(path, self.tok.to_str(pretty=True))   # as tok.save wrote it
    return path

  @property
  def vocab_size(self) -> int:
    return 257 if self.kind == "bytes" else self.tok.get_vocab_size()

  def encode(self, text: str) -> np.ndarray:
    if self.kind == "bytes":
      return np.frombuffer(text.encode("utf-8"), np.uint8).astype(np.int32) + 1
    return np.asarray(self.tok.encode(text).ids, np.int32)

  def decode(self, ids) -> str:
    ids = [int(i) for i in ids if int(i) != BOS_ID]
    if self.kind == "bytes":
      return bytes(i - 1 for i in ids).decode("utf-8", errors="replace")
    return self.tok.decode(ids)


def split_stream(ids: np.ndarray, fractions=(0.9, 0.05, 0.05)) -> dict[str, np.ndarray]:
  """Contiguous train/valid/test slices of one token stream."""
  n = len(ids)
  a, b = int(n * fractions[0]), int(n * (fractions[0] + fractions[1]))
  return {"train": ids[:a], "valid": ids[a:b], "test": ids[b:]}


def windows(stream: np.ndarray, seed: int, index: int, batch: int, seq_len: int
            ) -> np.ndarray:
  """Batch `index`: (batch, seq_len) rows [BOS] + a random window of seq_len-1 tokens."""
  if len(stream) < seq_len:
    raise UserError(f"the text split has {len(stream)} tokens, fewer than "
                     f"model.max_len={seq_len}")
  rng = np.random.default_rng([seed, index])
  starts = rng.integers(0, len(stream) - seq_len + 2, size=batch)
  rows = np.stack([stream[s:s + seq_len - 1] for s in starts])
  return np.concatenate([np.full((batch, 1), BOS_ID, np.int32), rows], axis=1)
