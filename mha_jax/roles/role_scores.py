"""Role statistics per head (Voita et al. 2019), reduced batch by batch.

For self-attention over source sentences (query and key positions are tokens):
  confidence   mean over tokens of the head's maximum weight (EOS and padding excluded)
  positional   share of tokens whose argmax falls on the head's most common relative
               offset (among tokens where that offset is inside the sentence);
               positional if that share >= 0.9
  syntactic    per relation and direction, how often the argmax lands on the gold
               dependency partner, against always taking the relation's most frequent
               offset; syntactic if it beats that baseline by >= 10 points
  rare         share of sentences whose most attended token (summed over queries) is
               the sentence's least frequent token (training-split frequencies), against
               chance (1 / length)
For language models: previous-token, duplicate-token and induction scores, the attention
mass on the matching positions (as TransformerLens's head detector defines them).
"""

from __future__ import annotations

import dataclasses
from typing import Mapping, Sequence

import numpy as np

SYNTAX_RELATIONS = ("nsubj", "dobj", "amod", "advmod")   # the ones a head is judged on

# The role names, one list for every report, table and page.
LM_ROLES = ("previous_token", "induction", "duplicate_token")   # scored per head
# Roles shown in tables first, in this order (others follow alphabetically).
ROLE_ORDER = ("positional", "syntactic", "rare", *LM_ROLES, "attention_sink", "cls", "sep",
              "other")
# The roles a stack's table always shows, found or not.
STACK_ROLES = {"encoder": ("positional", "syntactic", "rare"), "decoder_self": ("positional",),
               "lm": LM_ROLES}
ROLE_COLORS = {"positional": "#1f77b4", "syntactic": "#2ca02c", "rare": "#d62728",
               "other": "#c7c7c7", "previous_token": "#1f77b4", "induction": "#9467bd",
               "duplicate_token": "#ff7f0e", "attention_sink": "#8c564b", "cls": "#e377c2",
               "sep": "#17becf", "n/a": "#999999",
               # roles.head_taxonomy's roles
               "name_mover": "#e41a1c", "negative_name_mover": "#000000",
               "s_inhibition": "#4daf4a", "successor": "#984ea3",
               "copy_suppression": "#bcbd22", "retrieval": "#f781bf"}
ALIASES = {"obj": "dobj"}          # Universal Dependencies v2 calls the object "obj"


@dataclasses.dataclass
class Thresholds:
  positional: float = 0.9
  syntactic_margin: float = 0.10
  rare: float = 0.5


def relation(rel: str) -> str:
  """The relation without its subtype, UD v2 names as above (obj:x -> dobj)."""
  r = rel.split(":")[0]
  return ALIASES.get(r, r)


def _partners(heads: Sequence[int], rels: Sequence[str],
              relations: Sequence[str] = SYNTAX_RELATIONS):
  """{(relation, direction): [(query, {targets})]} for one sentence."""
  out: dict[tuple[str, str], list] = {}
  deps: dict[tuple[int, str], set] = {}
  for i, (h, r) in enumerate(zip(heads, rels)):
    r = relation(r)
    if r in relations and h >= 0:
      out.setdefault((r, "dep->head"), []).append((i, {h}))
      deps.setdefault((h, r), set()).add(i)
  for (h, r), ds in deps.items():
    out.setdefault((r, "head->dep"), []).append((h, ds))
  return out


class RoleStats:
  """Accumulates the statistics for every head of one self-attention stack (the
  encoder's, or the decoder's without arcs and rarest).

  Feed `update(weights_LBHSS, lengths_B, arcs, rarest_B)` per batch, where lengths
  count the tokens without EOS and padding, `arcs` are the batch's sentences' gold arcs
  ({"heads", "rels"}), and rarest_B the index of each sentence's least frequent token.
  `relations`: the relations whose accuracy is reported (default SYNTAX_RELATIONS); a
  head is syntactic by SYNTAX_RELATIONS alone either way.
  """

  def __init__(self, num_layers: int, num_heads: Sequence[int], max_len: int,
               relations: Sequence[str] | None = None):
    self.relations = tuple(relations) if relations else SYNTAX_RELATIONS
    self.L = num_layers
    self.H = list(num_heads)
    self.max_len = max_len
    w = 2 * max_len + 1
    self.conf = [np.zeros(h) for h in self.H]
    self.tokens = 0
    self.offsets = [np.zeros((h, w)) for h in self.H]
    self.possible = np.zeros(w)      # tokens for which each offset lands in the sentence
    self.syn_hits = [dict() for _ in self.H]
    self.syn_total: dict = {}
    self.base_offsets: dict = {}
    self.rare_hits = [np.zeros(h) for h in self.H]
    self.sentences = 0
    self.rare_chance = 0.0

  def update(self, weights: Sequence[np.ndarray], lengths: np.ndarray,
             arcs: Sequence[Mapping] | None, rarest: np.ndarray | None) -> None:
    b = len(lengths)
    for n in range(b):
      ln = int(lengths[n])
      if ln <= 0:
        continue
      self.tokens += ln
      self.sentences += 1
      ks = np.arange(-(ln - 1), ln)
      self.possible[ks + self.max_len] += ln - np.abs(ks)
      self.rare_chance += 1.0 / ln
      partners = (_partners(arcs[n]["heads"], arcs[n]["rels"], self.relations)
                  if arcs is not None else {})
      for key, pairs in partners.items():
        self.syn_total[key] = self.syn_total.get(key, 0) + len(pairs)
        hist = self.base_offsets.setdefault(key, {})
        for q, targets in pairs:   # "always offset k" is right when q + k is a target
          for t in targets:
            hist[t - q] = hist.get(t - q, 0) + 1
      for layer in range(self.L):
        w = np.asarray(weights[layer][n])[:, :ln, :ln]         # (H, T, S) real tokens
        if w.shape[0] == 0:
          continue
        top = w.argmax(-1)                                     # (H, T)
        self.conf[layer] += w.max(-1).sum(-1)
        off = top - np.arange(ln)[None, :] + self.max_len
        for h in range(w.shape[0]):
          self.offsets[layer][h] += np.bincount(off[h], minlength=self.offsets[layer].shape[1])
        for key, pairs in partners.items():
          hits = self.syn_hits[layer].setdefault(key, np.zeros(w.shape[0]))
          for q, targets in pairs:
            hits += np.isin(top[:, q], list(targets))
        if rarest is not None:
          most = w.sum(1).argmax(-1)                           # (H,) most attended key
          self.rare_hits[layer] += most == int(rarest[n])

  def _baseline(self, key) -> tuple[int, float]:
    hist = self.base_offsets.get(key, {})
    if not hist:
      return 0, 0.0
    best = max(hist, key=hist.get)
    return best, hist[best] / self.syn_total[key]

  def results(self, stack: str, th: Thresholds = Thresholds()) -> list[dict]:
    rows = []
    for layer in range(self.L):
      for h in range(self.H[layer]):
        offs = self.offsets[layer][h]
        best = int(offs.argmax())                 # the most common offset
        share = float(offs[best] / max(self.possible[best], 1))
        row = {"head": f"{stack}.{layer}.{h}", "stack": stack, "layer": layer, "index": h,
               "confidence": float(self.conf[layer][h] / max(self.tokens, 1)),
               "positional_offset": best - self.max_len, "positional_share": share,
               "rare_share": float(self.rare_hits[layer][h] / max(self.sentences, 1)),
               "rare_chance": float(self.rare_chance / max(self.sentences, 1))}
        best_margin, best_key = -1.0, None
        for key in sorted(self.syn_total):
          acc = float(self.syn_hits[layer].get(key, np.zeros(1 + h))[h] / self.syn_total[key])
          _, base = self._baseline(key)
          name = f"{key[0]}_{'dh' if key[1] == 'dep->head' else 'hd'}"
          row[f"syn_{name}"] = acc
          row[f"syn_{name}_baseline"] = base
          if key[0] in SYNTAX_RELATIONS and acc - base > best_margin:
            best_margin, best_key = acc - base, name
        row["syntactic_best"] = best_key
        row["syntactic_margin"] = best_margin if best_key else 0.0
        row["role"] = assign_role(row, th)
        rows.append(row)
    return rows


def assign_role(row: Mapping, th: Thresholds = Thresholds()) -> str:
  """positional > syntactic > rare > other, by the thresholds above."""
  if row["positional_share"] >= th.positional:
    return "positional"
  if row.get("syntactic_best") and row["syntactic_margin"] >= th.syntactic_margin:
    return "syntactic"
  if row["rare_share"] >= th.rare:
    return "rare"
  return "other"


def lm_scores(weights_BHTT: np.ndarray, tokens_BT: np.ndarray) -> dict[str, np.ndarray]:
  """Previous-token, duplicate-token and induction scores per head, (H,) each.

  Each is the mean over query positions (that have at least one matching position) of
  the attention mass on the matching positions:
    previous-token: key t-1;  duplicate: earlier keys with the same token;
    induction: keys j whose previous token equals the query's token (j-1 < t).
  """
  w = np.asarray(weights_BHTT, np.float64)
  tok = np.asarray(tokens_BT)
  b, h, t, _ = w.shape
  prev = np.zeros((b, t, t), bool)
  prev[:, np.arange(1, t), np.arange(t - 1)] = True
  same = tok[:, :, None] == tok[:, None, :]
  earlier = np.tril(np.ones((t, t), bool), -1)[None]
  dup = same & earlier
  ind = np.zeros((b, t, t), bool)
  ind[:, :, 1:] = same[:, :, :-1]                              # tok[j-1] == tok[t]
  ind &= np.tril(np.ones((t, t), bool), 0)[None] & ~np.eye(t, dtype=bool)[None]
  ind[:, :, 0] = False
  out = {}
  for name, pat in (("previous_token", prev), ("duplicate_token", dup), ("induction", ind)):
    mass = (w * pat[:, None]).sum(-1)                          # (B, H, T)
    has = pat.any(-1)                                          # (B, T)
    out[name] = (mass * has[:, None]).sum((0, 2)) / max(has.sum(), 1)
  return out


def first_token_share(weights_BHTT: np.ndarray, valid_BT: np.ndarray | None = None
                      ) -> np.ndarray:
  """(H,) mean attention on key 0 (the attention sink) over queries 1.. (query 0 can
  only attend to itself); valid_BT (True = real token) restricts the queries."""
  w = np.asarray(weights_BHTT, np.float64)
  q = np.ones((w.shape[0], w.shape[2]), bool) if valid_BT is None else \
      np.asarray(valid_BT, bool)[:, :w.shape[2]].copy()
  q[:, 0] = False
  return (w[..., 0] * q[:, None]).sum((0, 2)) / max(q.sum(), 1)


def entropy(weights_BHTT: np.ndarray, valid_BT: np.ndarray | None = None) -> np.ndarray:
  """(H,) mean entropy (nats) of the attention rows of real query tokens."""
  w = np.asarray(weights_BHTT, np.float64)
  ent = -(w * np.log(np.where(w > 0, w, 1.0))).sum(-1)          # (B, H, T)
  q = np.ones((w.shape[0], w.shape[2]), bool) if valid_BT is None else \
      np.asarray(valid_BT, bool)[:, :w.shape[2]]
  return (ent * q[:, None]).sum((0, 2)) / max(q.sum(), 1)


def special_token_shares(weights_BHTT: np.ndarray, lengths_B: np.ndarray
                         ) -> dict[str, np.ndarray]:
  """(H,) mean attention of real queries on the first token ([CLS]) and on the last real
  token ([SEP]) of each sequence (BERT inputs: `[CLS] ... [SEP] [PAD]...`)."""
  w = np.asarray(weights_BHTT, np.float64)
  b, h, t, _ = w.shape
  ln = np.asarray(lengths_B)
  q = np.arange(t)[None, :] < ln[:, None]                          # (B, T)
  cls = (w[..., 0] * q[:, None]).sum((0, 2))
  sep = (np.take_along_axis(w, (ln - 1)[:, None, None, None].repeat(h, 1).repeat(t, 2),
                            -1)[..., 0] * q[:, None]).sum((0, 2))
  n = max(q.sum(), 1)
  return {"cls_share": cls / n, "sep_share": sep / n}
