"""Sentence packing for translation training: several sentence pairs per row.

A training batch of B sentence pairs padded to the data's max_len wastes most of its
positions (the quickstart's sources average 8 of 24). Packing places whole pairs side
by side in R <= B rows; segment ids (1, 2, ... per row, 0 = padding) keep them apart:
attention only within a pair (encoder, decoder, cross), positions restart per pair, and
the loss skips the position where one pair's target ends and the next begins. Same
pairs, same maths as the padded batch, fewer positions (tests/data/test_packing.py checks the
loss and gradients against the padded batch).

Shapes stay static under jit: R comes from a short ladder chosen before training
(`rows_ladder`), so a run compiles its step once, or twice if a batch ever needs more
rows than the first rung.
"""

from __future__ import annotations

import math

import numpy as np

from mha_jax.errors import UserError


def assign_rows(src_len: np.ndarray, tgt_len: np.ndarray, src_width: int,
                tgt_width: int) -> list[list[int]]:
  """First-fit decreasing: rows as lists of pair indices, each row's sources within
  src_width and targets within tgt_width. Pairs keep their batch order inside a row."""
  order = sorted(range(len(src_len)), key=lambda i: (-max(src_len[i] / src_width,
                                                          tgt_len[i] / tgt_width), i))
  rows: list[list[int]] = []
  used: list[list[int]] = []
  for i in order:
    s, t = int(src_len[i]), int(tgt_len[i])
    if s > src_width or t > tgt_width:
      raise ValueError(f"pair {i} (source {s}, target {t} tokens) does not fit a row of "
                       f"widths ({src_width}, {tgt_width})")
    for r, (us, ut) in enumerate(used):
      if us + s <= src_width and ut + t <= tgt_width:
        rows[r].append(i)
        used[r] = [us + s, ut + t]
        break
    else:
      rows.append([i])
      used.append([s, t])
  return [sorted(r) for r in rows]


def _lengths(ids: np.ndarray, pad_id: int) -> np.ndarray:
  return (ids != pad_id).sum(axis=1)


def rows_needed(batch: dict[str, np.ndarray], pad_id: int) -> int:
  """Rows the packed form of a padded batch {"src" (B, S), "tgt" (B, T)} needs."""
  src, tgt = batch["src"], batch["tgt"]
  return len(assign_rows(_lengths(src, pad_id), _lengths(tgt, pad_id), src.shape[1],
                         tgt.shape[1]))


def pack(batch: dict[str, np.ndarray], rows: int | tuple[int, ...],
         pad_id: int) -> dict[str, np.ndarray]:
  """The packed batch, R rows of the padded batch's widths.

  Args:
    batch: {"src": (B, S), "tgt": (B, T)} int arrays, each pair left-aligned and padded
      with pad_id ("tgt" = [BOS, y_1, ..., EOS]).
    rows: R, at least rows_needed(batch); or a ladder (rows_ladder), R being its
      smallest rung that holds the batch.

  Returns:
    {"src", "tgt": (R, S), (R, T) tokens; "src_seg", "tgt_seg": int32 segment ids
     (k for the k-th pair of the row, 0 padding); "src_pos", "tgt_pos": int32 positions
     within each pair}.
  """
  src, tgt = np.asarray(batch["src"]), np.asarray(batch["tgt"])
  if src.ndim != 2 or tgt.ndim != 2 or len(src) != len(tgt):
    raise ValueError(f"batch must hold src (B, S) and tgt (B, T) with one B; got shapes "
                     f"{src.shape} and {tgt.shape}")
  sl, tl = _lengths(src, pad_id), _lengths(tgt, pad_id)
  assignment = assign_rows(sl, tl, src.shape[1], tgt.shape[1])
  if isinstance(rows, tuple):
    rows = rung(rows, len(assignment))
  if rows < len(assignment):
    raise ValueError(f"rows={rows} is fewer than the {len(assignment)} rows this batch "
                     f"needs")
  out = {"src": np.full((rows, src.shape[1]), pad_id, src.dtype),
         "tgt": np.full((rows, tgt.shape[1]), pad_id, tgt.dtype)}
  for name in ("src", "tgt"):
    out[f"{name}_seg"] = np.zeros(out[name].shape, np.int32)
    out[f"{name}_pos"] = np.zeros(out[name].shape, np.int32)
  for r, members in enumerate(assignment):
    for name, arr, lens in (("src", src, sl), ("tgt", tgt, tl)):
      at = 0
      for seg, i in enumerate(members, start=1):
        n = int(lens[i])
        out[name][r, at:at + n] = arr[i, :n]
        out[f"{name}_seg"][r, at:at + n] = seg
        out[f"{name}_pos"][r, at:at + n] = np.arange(n)
        at += n
  return out


def rows_ladder(sample_rows: list[int], batch_size: int, multiple: int) -> tuple[int, ...]:
  """Row counts a run packs into: the most a sample of its batches needed plus 10 %,
  then batch_size (always enough); each rounded up to `multiple` (the data-parallel
  devices times processes)."""
  if not sample_rows:
    raise ValueError("sample_rows is empty")
  up = lambda n: int(math.ceil(n / multiple) * multiple)
  first = min(up(math.ceil(max(sample_rows) * 1.1)), up(batch_size))
  return tuple(sorted({first, up(batch_size)}))


def rung(ladder: tuple[int, ...], needed: int) -> int:
  """The smallest row count in the ladder that holds `needed` rows."""
  for r in ladder:
    if r >= needed:
      return r
  raise UserError(f"a batch needs {needed} packed rows, more than the ladder {ladder}")
