"""Word-level vocabularies and padded id arrays."""

from __future__ import annotations

import json
from typing import Iterable, Sequence

import numpy as np

from mha_jax import storage
from mha_jax.errors import UserError

# The special ids of every vocabulary, defined here and only here.
# Word vocabularies (translation):
PAD, BOS, EOS, UNK = "<pad>", "<s>", "</s>", "<unk>"
PAD_ID, BOS_ID, EOS_ID, UNK_ID = 0, 1, 2, 3
# LM token streams (repeated random tokens; text through BPE or bytes): id 0 is BOS,
# there is no padding. Repeated-token probes of a text model rely on the two agreeing.
LM_BOS_ID = 0


class Vocab:
  """Token <-> id. Ids 0..3 are <pad>, <s>, </s>, <unk>."""

  def __init__(self, tokens: Iterable[str]):
    self.tokens = [PAD, BOS, EOS, UNK]
    seen = set(self.tokens)
    for t in tokens:
      if t not in seen:
        seen.add(t)
        self.tokens.append(t)
    self.index = {t: i for i, t in enumerate(self.tokens)}

  def __len__(self) -> int:
    return len(self.tokens)

  def encode(self, words: Sequence[str]) -> list[int]:
    return [self.index.get(w, UNK_ID) for w in words]

  def decode(self, ids: Iterable[int]) -> list[str]:
    """Tokens up to the first </s>, skipping <pad> and <s>."""
    out = []
    for i in ids:
      i = int(i)
      if i == EOS_ID:
        break
      if i in (PAD_ID, BOS_ID):
        continue
      out.append(self.tokens[i] if 0 <= i < len(self.tokens) else UNK)
    return out

  def save(self, path: str) -> None:
    storage.write_json(path, self.tokens, indent=None)

  @classmethod
  def load(cls, path: str) -> "Vocab":
    try:
      tokens = storage.read_json(path)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
      raise UserError(f"{path} is not a vocabulary written by mha_jax ({e})") from None
    if not isinstance(tokens, list) or tokens[:4] != [PAD, BOS, EOS, UNK]:
      raise UserError(f"{path} is not a vocabulary written by mha_jax")
    return cls(tokens[4:])


def pad_ids(rows: Sequence[Sequence[int]], max_len: int, *, bos: bool, eos: bool,
            what: str) -> np.ndarray:
  """(N, max_len) int32, each row [<s>] ids [</s>] then <pad>. Too long -> ValueError."""
  out = np.full((len(rows), max_len), PAD_ID, np.int32)
  for n, ids in enumerate(rows):
    row = ([BOS_ID] if bos else []) + list(ids) + ([EOS_ID] if eos else [])
    if len(row) > max_len:
      raise UserError(f"{what}: sentence {n} has {len(row)} tokens with markers, more "
                       f"than data.max_len={max_len}")
    out[n, :len(row)] = row
  return out
