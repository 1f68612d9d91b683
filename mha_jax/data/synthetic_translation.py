"""A synthetic language pair from a probabilistic grammar, deterministic from a seed.

Source (SVO, English-like):   [det] adj* noun | name   verb   [object NP]   [adverb]
                              clauses may be joined by "and".
Target (SOV, agreement):      noun_t adj_t* det_t | name   [object NP_t]   [adverb_t]  verb_t
  - target nouns carry a lexical gender and a number suffix;
  - target adjectives agree with their noun's gender and number (amod);
  - target verbs agree with their subject's gender and number (nsubj);
  - adverbs move before the verb (advmod), objects before the verb (dobj);
  - names (a long Zipf tail of rare words) are copied unchanged.
So translating needs the subject, the object and each modifier's head.

Every source sentence comes with gold dependency arcs (head index, relation) for
nsubj, dobj, amod, advmod, det, cc and conj. Word types are Zipf-distributed within each
part of speech, so rare words exist.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Sequence

import numpy as np

from mha_jax.errors import UserError
from mha_jax import storage


_SRC_SYL = ("ba be bi bo bu da de di do du fa fe fi fo ga ge gi go ka ke ki ko la le li "
            "lo lu ma me mi mo mu na ne ni no pa pe pi po ra re ri ro sa se si so ta te "
            "ti to va ve vi wa we wi").split()
_TGT_SYL = ("zan zor kul kir mek mot pug pix rav rhu sel syk tov tyr wex wum yal yor "
            "qin qom jas jel hyp hoz cav cix dru dyn fal fyt").split()
_NAME_SYL = ("al an ar el en er il in ol on or ul un ur am em").split()


@dataclasses.dataclass(frozen=True)
class GrammarConfig:
  num_nouns: int = 300
  num_verbs: int = 120            # the first 2/3 are transitive
  num_adjectives: int = 120
  num_adverbs: int = 60
  num_names: int = 200
  zipf_exponent: float = 1.1
  name_prob: float = 0.15         # an NP is a name
  plural_prob: float = 0.3
  adj_probs: tuple = (0.5, 0.35, 0.15)   # P(0, 1, 2 adjectives)
  adverb_prob: float = 0.3
  conj_prob: float = 0.25         # a second clause joined by "and"
  subwords: bool = False          # write content words as two pieces, "pe@@ rasel"

  def validate(self):
    for f in ("num_nouns", "num_verbs", "num_adjectives", "num_adverbs", "num_names"):
      if getattr(self, f) < 2:
        raise UserError(f"data.grammar.{f} must be >= 2; got {getattr(self, f)}")


@dataclasses.dataclass
class Sentence:
  src: list[str]
  tgt: list[str]
  heads: list[int]          # per source token, index of its head (-1 for the root)
  rels: list[str]           # per source token, relation to its head ("root" for the root)


class Lexicon:
  """Word forms of both languages, generated from the seed."""

  def __init__(self, cfg: GrammarConfig, seed: int):
    cfg.validate()
    self.cfg = cfg
    rng = np.random.default_rng([seed, 7])
    used: set[str] = set()

    def words(n, syl, parts, suffix=""):
      out = []
      while len(out) < n:
        w = "".join(rng.choice(syl, size=rng.integers(parts[0], parts[1] + 1))) + suffix
        if w not in used:
          used.add(w)
          out.append(w)
      return out

    self.nouns = words(cfg.num_nouns, _SRC_SYL, (2, 3))
    self.verbs = words(cfg.num_verbs, _SRC_SYL, (2, 3), "t")
    self.adjs = words(cfg.num_adjectives, _SRC_SYL, (2, 3), "l")
    self.advs = words(cfg.num_adverbs, _SRC_SYL, (2, 3), "ly")
    self.names = [w.capitalize() for w in words(cfg.num_names, _NAME_SYL, (2, 4))]
    self.t_nouns = words(cfg.num_nouns, _TGT_SYL, (1, 2))
    self.t_verbs = words(cfg.num_verbs, _TGT_SYL, (1, 2))
    self.t_adjs = words(cfg.num_adjectives, _TGT_SYL, (1, 2))
    self.t_advs = words(cfg.num_adverbs, _TGT_SYL, (1, 2), "u")
    self.gender = rng.integers(0, 2, size=cfg.num_nouns)      # target noun gender
    self.num_transitive = max(1, 2 * cfg.num_verbs // 3)

  # Surface forms.
  @staticmethod
  def src_noun(lemma, plural):
    return lemma + ("s" if plural else "")

  @staticmethod
  def tgt_noun(lemma, plural):
    return lemma + ("i" if plural else "")

  @staticmethod
  def tgt_agree(lemma, gender, plural):
    return lemma + ("ae", "ou")[gender] + ("n" if plural else "")

  def function_words(self) -> set[str]:
    """Words never split into pieces: determiners, "and", names."""
    return {"the", "a", "and", *self.names}

  def source_types(self) -> list[str]:
    words = (["the", "a", "and"] + [self.src_noun(n, p) for n in self.nouns for p in (0, 1)]
             + self.verbs + self.adjs + self.advs + self.names)
    if not self.cfg.subwords:
      return words
    keep = self.function_words()
    out = []
    for w in words:
      out += [w] if (w in keep or len(w) <= 3) else [w[:2] + "@@", w[2:]]
    return list(dict.fromkeys(out))

  def target_types(self) -> list[str]:
    out = ["ta", "na", "e"] + [self.tgt_noun(n, p) for n in self.t_nouns for p in (0, 1)]
    for lemmas in (self.t_verbs, self.t_adjs):
      out += [self.tgt_agree(l, g, p) for l in lemmas for g in (0, 1) for p in (0, 1)]
    return out + self.t_advs


def _zipf(n: int, a: float) -> np.ndarray:
  p = 1.0 / np.arange(1, n + 1) ** a
  return p / p.sum()


class Grammar:
  """Samples sentence pairs with gold source arcs."""

  def __init__(self, cfg: GrammarConfig = GrammarConfig(), seed: int = 0):
    self.cfg = cfg
    self.lex = Lexicon(cfg, seed)
    c = cfg
    self.p_noun = _zipf(c.num_nouns, c.zipf_exponent)
    self.p_tverb = _zipf(self.lex.num_transitive, c.zipf_exponent)
    self.p_iverb = _zipf(c.num_verbs - self.lex.num_transitive, c.zipf_exponent)
    self.p_adj = _zipf(c.num_adjectives, c.zipf_exponent)
    self.p_adv = _zipf(c.num_adverbs, c.zipf_exponent)
    self.p_name = _zipf(c.num_names, 1.0)

  def _np(self, rng, src, heads, rels, role, gov):
    """Appends a noun phrase; returns its head index, target words, gender, number."""
    lex, c = self.lex, self.cfg
    if rng.random() < c.name_prob:
      name = lex.names[rng.choice(c.num_names, p=self.p_name)]
      i = len(src)
      src.append(name); heads.append(gov); rels.append(role)
      return i, [name], 0, 0
    n = rng.choice(c.num_nouns, p=self.p_noun)
    plural = int(rng.random() < c.plural_prob)
    definite = rng.random() < 0.6
    n_adj = rng.choice(3, p=c.adj_probs)
    adjs = [rng.choice(c.num_adjectives, p=self.p_adj) for _ in range(n_adj)]
    start = len(src)
    noun_i = start + 1 + n_adj
    src.append("the" if definite else "a"); heads.append(noun_i); rels.append("det")
    for a in adjs:
      src.append(lex.adjs[a]); heads.append(noun_i); rels.append("amod")
    src.append(lex.src_noun(lex.nouns[n], plural)); heads.append(gov); rels.append(role)
    g = int(lex.gender[n])
    tgt = [lex.tgt_noun(lex.t_nouns[n], plural)]
    tgt += [lex.tgt_agree(lex.t_adjs[a], g, plural) for a in reversed(adjs)]
    tgt.append("ta" if definite else "na")
    return noun_i, tgt, g, plural

  def _clause(self, rng, src, heads, rels, gov, rel):
    lex, c = self.lex, self.cfg
    transitive = rng.random() < 0.7
    verb_i_placeholder = -2  # patched once the verb's index is known
    start = len(src)
    subj_i, subj_t, g, plural = self._np(rng, src, heads, rels, "nsubj", verb_i_placeholder)
    verb_i = len(src)
    if transitive:
      v = rng.choice(lex.num_transitive, p=self.p_tverb)
    else:
      v = lex.num_transitive + rng.choice(c.num_verbs - lex.num_transitive, p=self.p_iverb)
    src.append(lex.verbs[v]); heads.append(gov); rels.append(rel)
    obj_t = []
    if transitive:
      _, obj_t, _, _ = self._np(rng, src, heads, rels, "dobj", verb_i)
    adv_t = []
    if rng.random() < c.adverb_prob:
      a = rng.choice(c.num_adverbs, p=self.p_adv)
      src.append(lex.advs[a]); heads.append(verb_i); rels.append("advmod")
      adv_t = [lex.t_advs[a]]
    for i in range(start, verb_i):
      if heads[i] == verb_i_placeholder:
        heads[i] = verb_i
    return verb_i, subj_t + obj_t + adv_t + [lex.tgt_agree(lex.t_verbs[v], g, plural)]

  def sample(self, rng: np.random.Generator) -> Sentence:
    src, heads, rels = [], [], []
    root, tgt = self._clause(rng, src, heads, rels, -1, "root")
    if rng.random() < self.cfg.conj_prob:
      src.append("and"); heads.append(root); rels.append("cc")
      _, tgt2 = self._clause(rng, src, heads, rels, root, "conj")
      tgt = tgt + ["e"] + tgt2
    if self.cfg.subwords:
      return split_subwords(Sentence(src, tgt, heads, rels), self.lex.function_words())
    return Sentence(src, tgt, heads, rels)


def split_subwords(s: Sentence, keep: set[str]) -> Sentence:
  """Writes each content word as its first syllable + "@@" and the rest, as BPE would.

  Arcs move to the word's last piece; an earlier piece gets the relation "subword" to
  it. Pieces like "pe@@" are shared by many words, so a word's meaning needs its
  neighbour.
  """
  pieces, owner = [], []
  for i, w in enumerate(s.src):
    parts = [w] if (w in keep or len(w) <= 3) else [w[:2] + "@@", w[2:]]
    pieces += parts
    owner += [i] * len(parts)
  last = {i: max(j for j, o in enumerate(owner) if o == i) for i in range(len(s.src))}
  heads, rels = [], []
  for j, i in enumerate(owner):
    if j != last[i]:
      heads.append(last[i]); rels.append("subword")
    else:
      h = s.heads[i]
      heads.append(-1 if h < 0 else last[h]); rels.append(s.rels[i])
  return Sentence(pieces, s.tgt, heads, rels)


def build_splits(sizes: dict[str, int], seed: int, cfg: GrammarConfig = GrammarConfig()
                 ) -> tuple[Grammar, dict[str, list[Sentence]]]:
  """Train/valid/test splits drawn from one grammar, each from its own stream."""
  for name, n in sizes.items():
    if n < 1:
      raise UserError(f"data.{name}_size must be >= 1; got {n}")
  grammar = Grammar(cfg, seed)
  splits = {}
  for k, (name, n) in enumerate(sorted(sizes.items())):
    rng = np.random.default_rng([seed, 101 + k])
    splits[name] = [grammar.sample(rng) for _ in range(n)]
  return grammar, splits


def token_frequencies(sentences: Sequence[Sentence]) -> dict[str, int]:
  """Source token counts over the given sentences."""
  counts: dict[str, int] = {}
  for s in sentences:
    for w in s.src:
      counts[w] = counts.get(w, 0) + 1
  return counts


def export(directory: str, grammar: Grammar, splits: dict[str, list[Sentence]]) -> None:
  """Writes {split}.src/.tgt (one sentence a line), {split}.arcs.jsonl (gold arcs) and
  train_freqs.json (the training split's source token counts)."""
  storage.makedirs(directory)
  for name, sents in splits.items():
    storage.write_text(storage.join(directory, f"{name}.src"),
                       "".join(" ".join(s.src) + "\n" for s in sents))
    storage.write_text(storage.join(directory, f"{name}.tgt"),
                       "".join(" ".join(s.tgt) + "\n" for s in sents))
    storage.write_text(storage.join(directory, f"{name}.arcs.jsonl"),
                       "".join(json.dumps({"heads": s.heads, "rels": s.rels}) + "\n"
                               for s in sents))
  storage.write_json(storage.join(directory, "train_freqs.json"),
                     token_frequencies(splits["train"]), indent=None)
