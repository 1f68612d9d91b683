"""A run's tokenizer.json (written by the importer from a GGUF file or an HF folder),
read with `tokenizers`: what an imported task encodes and decodes with."""

from __future__ import annotations

import numpy as np

from mha_jax.errors import UserError
from mha_jax import storage


def from_tokenizer_json(path: str, max_len: int | None = None):
  """An HF tokenizer.json, without its fixed padding; truncation at max_len if given."""
  from tokenizers import Tokenizer
  try:
    tok = Tokenizer.from_str(storage.read_text(path))
  except (KeyboardInterrupt, SystemExit, MemoryError):
    raise
  except BaseException as e:  # noqa: BLE001 - a plain Exception, or pyo3's PanicException
    raise UserError(f"tokenizer file {path!r} cannot be read: {e}") from None
  tok.no_padding()
  if max_len:
    tok.enable_truncation(max_length=max_len)
  return tok


class PretrainedTokenizer:
  """ids = encode(text) (np.int32), text = decode(ids); wraps the workdir's tokenizer.json."""

  def __init__(self, tok, add_special_tokens: bool):
    self.tok = tok
    self.add_special_tokens = add_special_tokens

  @classmethod
  def load(cls, path: str, add_special_tokens: bool) -> "PretrainedTokenizer":
    return cls(from_tokenizer_json(path), add_special_tokens)

  @property
  def vocab_size(self) -> int:
    return self.tok.get_vocab_size()

  def encode(self, text: str) -> np.ndarray:
    return np.asarray(self.tok.encode(text, add_special_tokens=self.add_special_tokens).ids,
                      np.int32)

  def encode_batch(self, texts) -> list[np.ndarray]:
    return [np.asarray(e.ids, np.int32) for e in
            self.tok.encode_batch(list(texts), add_special_tokens=self.add_special_tokens)]

  def decode(self, ids, skip_special_tokens: bool = False) -> str:
    return self.tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)
