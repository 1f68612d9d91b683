"""Repeated random tokens with BOS, for induction heads: [BOS] r_1..r_m r_1..r_m [tail].

With min_half_len < half_len, each sequence draws its own m in [min_half_len, half_len]
and fills the rest with fresh random tokens, so the repeat distance varies and no head can
find the earlier copy by position alone.
"""

from __future__ import annotations

import numpy as np

from mha_jax.data.vocab import LM_BOS_ID as BOS_ID
from mha_jax.errors import UserError


def repeated_tokens(seed: int, index: int, batch: int, half_len: int, vocab_size: int,
                    min_half_len: int = 0, return_lengths: bool = False,
                    random_start: bool = False):
  """Batch number `index` of the stream given by `seed`: (batch, 1 + 2 * half_len) int32
  (and the per-row copy length m when return_lengths; with random_start, also the
  per-row start p of the first copy: (tokens, m, p)).

  Random tokens are uniform over 1..vocab_size-1 (0 is BOS). With random_start, each
  row's first copy starts after p random tokens, p uniform in 0..2 (half_len - m), so
  first copies (the keys an induction head must find) lie anywhere in positions
  1..2 half_len - m, not only at the start.
  Deterministic in (seed, index), so a resumed run sees exactly the batches it would
  have seen.
  """
  if vocab_size < 3:
    raise UserError(f"data.vocab_size must be >= 3; got {vocab_size}")
  if half_len < 1:
    raise UserError(f"data.half_len must be >= 1; got {half_len}")
  lo = min_half_len or half_len
  if not 1 <= lo <= half_len:
    raise UserError(f"data.min_half_len must be in 1..data.half_len={half_len}; got "
                     f"{min_half_len}")
  rng = np.random.default_rng([seed, index])
  out = rng.integers(1, vocab_size, size=(batch, 1 + 2 * half_len), dtype=np.int32)
  out[:, 0] = BOS_ID
  m = rng.integers(lo, half_len + 1, size=batch) if lo < half_len else np.full(batch, half_len)
  p = (rng.integers(0, 2 * (half_len - m) + 1) if random_start
       else np.zeros(batch, np.int64))
  for b in range(batch):
    start = 1 + p[b]
    out[b, start + m[b]:start + 2 * m[b]] = out[b, start:start + m[b]]
  if random_start:
    return (out, m, p) if return_lengths else out
  return (out, m) if return_lengths else out


def position_masks(m: np.ndarray, length: int, start=None) -> dict[str, np.ndarray]:
  """(B, length) masks over predicted positions p (p predicts token p + 1): "first" =
  tokens 2..m of the first copy, "repeat" = tokens 2..m of the second copy (the first
  token of each copy is random and cannot be predicted). `start` (B,): random tokens
  before each row's first copy (random_start)."""
  target = np.arange(length)[None, :] + 1
  if start is not None:
    target = target - np.asarray(start)[:, None]
  m = np.asarray(m)[:, None]
  first = (target >= 2) & (target <= m)
  repeat = (target >= m + 2) & (target <= 2 * m)
  return {"first": first.astype(np.float32), "repeat": repeat.astype(np.float32)}
