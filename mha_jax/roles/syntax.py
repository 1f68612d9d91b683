"""Syntactic heads of a wordpiece encoder (BERT) on the user's CoNLL-U sentences.

Attention between wordpieces becomes attention between words as Clark et al. (2019) do:
the attention a word receives is the sum over its pieces (columns added), the attention a
word pays is the mean over its pieces (rows averaged), so every word row still sums to 1.
[CLS] and [SEP] stay units of their own: a head whose argmax lands on them misses.
Then each head is scored per relation and direction (dependent -> head, head ->
dependent) by role_scores.RoleStats, against the relation's most frequent offset, and is
syntactic under the same rule as the translation models' encoders.
"""

from __future__ import annotations

from typing import Iterable, Sequence

import numpy as np

from mha_jax.toolkit import capture as capture_lib
from mha_jax.roles import role_scores
from mha_jax.data import parallel
from mha_jax.errors import UserError


def word_groups(word_ids: Sequence[int | None]) -> tuple[list[list[int]], list[int]]:
  """(groups, unit_of_word): the token positions of each unit in order (a special token,
  word_id None, is a unit of its own; a word's pieces form one unit), and for word i the
  index of its unit."""
  groups: list[list[int]] = []
  unit_of: dict[int, int] = {}
  for t, w in enumerate(word_ids):
    if w is None:
      groups.append([t])
    elif w in unit_of:
      if groups[unit_of[w]][-1] != t - 1:
        raise ValueError(f"word_ids: the pieces of word {w} are not contiguous: "
                         f"{list(word_ids)}")
      groups[unit_of[w]].append(t)
    else:
      unit_of[w] = len(groups)
      groups.append([t])
  n = len(unit_of)
  if sorted(unit_of) != list(range(n)):
    raise ValueError(f"word_ids: words must be numbered 0..{n - 1}; got {sorted(unit_of)}")
  return groups, [unit_of[i] for i in range(n)]


def word_attention(w_HTS: np.ndarray, groups: Sequence[Sequence[int]]) -> np.ndarray:
  """(H, U, U) attention between units from (H, T, T) between the tokens: received
  attention summed over a unit's pieces, paid attention averaged over them."""
  w = np.asarray(w_HTS, np.float64)
  cols = np.stack([w[..., list(g)].sum(-1) for g in groups], -1)       # (H, T, U)
  return np.stack([cols[:, list(g)].mean(1) for g in groups], 1)      # (H, U, U)


def unit_arcs(arcs: dict, unit_of: Sequence[int], n_units: int) -> dict:
  """A sentence's arcs over words re-indexed over units (special units have no head)."""
  heads, rels = [-1] * n_units, ["_"] * n_units
  for i, (h, r) in enumerate(zip(arcs["heads"], arcs["rels"])):
    heads[unit_of[i]] = unit_of[h] if h >= 0 else -1
    rels[unit_of[i]] = r
  return {"heads": heads, "rels": rels}


def encode_words(tokenizer, words: Sequence[str], what: str) -> tuple[np.ndarray, list]:
  """(ids (T,), word_ids) of a sentence given as words, with [CLS] and [SEP]."""
  enc = tokenizer.tok.encode(list(words), is_pretokenized=True, add_special_tokens=True)
  seen = {w for w in enc.word_ids if w is not None}
  if seen != set(range(len(words))):
    raise UserError(f"{what}: the sentence starting {' '.join(words[:6])!r} has "
                     f"{len(words)} words, of which {len(seen)} fit in the tokenizer's "
                     f"{len(enc.ids)} wordpieces (too long)")
  return np.asarray(enc.ids, np.int32), list(enc.word_ids)


def score_sentences(sentences: Iterable[tuple[Sequence[np.ndarray], Sequence, dict]],
                    max_units: int, relations: Sequence[str] | None = None,
                    th: role_scores.Thresholds = role_scores.Thresholds(), stack: str = "encoder"
                    ) -> dict[str, dict]:
  """{head name: {syn_<rel>_<dh|hd>: accuracy, ..._baseline, syntactic_best,
  syntactic_margin}} from (weights, word_ids, arcs) per sentence: weights[l] (H, T, T)
  over the sentence's T wordpieces in layer l, word_ids per wordpiece (None for special
  tokens), arcs {"heads", "rels"} over its words. max_units bounds the units per
  sentence; relations: those to report (default role_scores.SYNTAX_RELATIONS)."""
  stats = None
  for weights, word_ids, arcs in sentences:
    groups, unit_of = word_groups(word_ids)
    if stats is None:
      stats = role_scores.RoleStats(len(weights), [np.shape(w)[0] for w in weights], max_units,
                              relations=relations)
    ws = [word_attention(w, groups)[None] for w in weights]
    stats.update(ws, np.asarray([len(groups)]), [unit_arcs(arcs, unit_of, len(groups))],
                 None)
  if stats is None:
    raise UserError("conllu: no sentence to score", setting="conllu")
  return {r["head"]: {k: v for k, v in r.items() if k.startswith("syn")}
          for r in stats.results(stack, th)}


def conllu_syntax(loaded, path: str, th: role_scores.Thresholds = role_scores.Thresholds(),
                  batch_size: int = 16) -> dict[str, dict]:
  """score_sentences on the sentences of the CoNLL-U file at `path`, attention from the
  encoder's own forward (capture); accuracy is reported for every relation the file
  uses, the role judged on role_scores.SYNTAX_RELATIONS."""
  task = loaded.task
  sentences, arcs = parallel.read_conllu(path, None, "--conllu")
  encoded = [encode_words(task.tokenizer, s, "--conllu") for s in sentences]
  relations = sorted({role_scores.relation(r) for a in arcs for r, h in zip(a["rels"], a["heads"])
                      if h >= 0})

  t = max(len(ids) for ids, _ in encoded)
  rows = min(batch_size, len(encoded))

  def each():
    for start in range(0, len(encoded), rows):
      chunk = encoded[start:start + rows]
      # Every chunk (R, T), the last padded with empty rows: one compile.
      tokens = np.full((rows, t), loaded.config.tokenizer.pad_id, np.int32)
      mask = np.zeros((rows, t), bool)
      for b, (ids, _) in enumerate(chunk):
        tokens[b, :len(ids)], mask[b, :len(ids)] = ids, True
      cap = capture_lib.captured(task, loaded.params, {"tokens": tokens, "mask": mask,
                                                    "token_types": np.zeros_like(tokens)})
      for b, (ids, word_ids) in enumerate(chunk):
        n = len(ids)
        yield ([np.asarray(r.weights)[b, :, :n, :n] for r in cap["encoder"]], word_ids,
               arcs[start + b])

  max_units = max(len(word_groups(w)[0]) for _, w in encoded)
  return score_sentences(each(), max_units, relations, th)
