"""Repeated random tokens with BOS, for induction heads: [BOS] r_1..r_n r_1..r_n."""

from __future__ import annotations

import numpy as np

BOS_ID = 0


def repeated_tokens(seed: int, index: int, batch: int, half_len: int,
                    vocab_size: int) -> np.ndarray:
  """Batch number `index` of the stream given by `seed`: (batch, 1 + 2 * half_len) int32.

  Random tokens are uniform over 1..vocab_size-1 (0 is BOS). Deterministic in
  (seed, index), so a resumed run sees exactly the batches it would have seen.
  """
  if vocab_size < 3:
    raise ValueError(f"data.vocab_size must be >= 3; got {vocab_size}")
  if half_len < 1:
    raise ValueError(f"data.half_len must be >= 1; got {half_len}")
  rng = np.random.default_rng([seed, index])
  r = rng.integers(1, vocab_size, size=(batch, half_len), dtype=np.int32)
  bos = np.full((batch, 1), BOS_ID, np.int32)
  return np.concatenate([bos, r, r], axis=1)
