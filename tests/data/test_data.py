"""Built-in data: the synthetic language pair, repeated tokens, text, parallel files."""

import collections
import json

import numpy as np
import pytest

from mha_jax.data import parallel, repeated_tokens, synthetic_translation as st, text
from mha_jax.data import vocab


@pytest.fixture(scope="module")
def splits():
  return st.build_splits({"train": 3000, "valid": 200, "test": 200}, seed=0)


def test_deterministic_from_seed_and_splits_differ(splits):
  g2, again = st.build_splits({"train": 3000, "valid": 200, "test": 200}, seed=0)
  assert [s.src for s in again["train"]] == [s.src for s in splits[1]["train"]]
  _, other = st.build_splits({"train": 3000, "valid": 200, "test": 200}, seed=1)
  assert [s.src for s in other["train"][:50]] != [s.src for s in splits[1]["train"][:50]]
  assert [s.src for s in splits[1]["valid"][:50]] != [s.src for s in splits[1]["test"][:50]]


def test_vocabulary_is_zipfian_with_rare_words(splits):
  grammar, sp = splits
  assert len(set(grammar.lex.source_types())) >= 1000
  assert len(set(grammar.lex.target_types())) == len(grammar.lex.target_types())
  counts = collections.Counter(w for s in sp["train"] for w in s.src
                               if w in set(grammar.lex.nouns))
  ranked = [counts[n] for n in grammar.lex.nouns]       # lemma order = Zipf rank
  assert ranked[0] > 5 * ranked[9] > 0                   # head is heavy
  singular_tail = sum(1 for n in grammar.lex.nouns[100:] if counts[n] <= 2)
  assert singular_tail > 50                             # rare words exist


def test_gold_arcs_cover_every_token_with_the_relations(splits):
  _, sp = splits
  rels = collections.Counter()
  for s in sp["train"]:
    assert len(s.heads) == len(s.rels) == len(s.src)
    assert s.rels.count("root") == 1 and s.heads[s.rels.index("root")] == -1
    for i, (h, r) in enumerate(zip(s.heads, s.rels)):
      if r != "root":
        assert 0 <= h < len(s.src) and h != i
      rels[r] += 1
  for r in ("nsubj", "dobj", "amod", "advmod"):
    assert rels[r] > 100, r


def test_target_agreement_and_order_follow_the_syntax(splits):
  grammar, sp = splits
  lex = grammar.lex
  noun_index = {lex.src_noun(n, p): (i, p) for i, n in enumerate(lex.nouns) for p in (0, 1)}
  checked = 0
  for s in sp["train"][:500]:
    if "and" in s.src:
      continue
    root = s.rels.index("root")
    subj = next(i for i, (h, r) in enumerate(zip(s.heads, s.rels)) if r == "nsubj")
    verb = lex.verbs.index(s.src[root])
    if s.src[subj] in noun_index:
      n, plural = noun_index[s.src[subj]]
      gender = int(lex.gender[n])
    else:                                    # a name: masculine singular
      gender, plural = 0, 0
    # The verb is last and agrees with its subject's gender and number.
    assert s.tgt[-1] == lex.tgt_agree(lex.t_verbs[verb], gender, plural)
    # Every adjective agrees with its own noun.
    for i, r in enumerate(s.rels):
      if r == "amod":
        n, p = noun_index[s.src[s.heads[i]]]
        a = lex.adjs.index(s.src[i])
        assert lex.tgt_agree(lex.t_adjs[a], int(lex.gender[n]), p) in s.tgt
    checked += 1
  assert checked > 300


def test_rare_names_are_copied(splits):
  grammar, sp = splits
  names = set(grammar.lex.names)
  n = 0
  for s in sp["train"]:
    for w in s.src:
      if w in names:
        assert w in s.tgt
        n += 1
  assert n > 200


def test_export_writes_arcs_and_training_frequencies(tmp_path, splits):
  grammar, sp = splits
  st.export(str(tmp_path), grammar, sp)
  lines = (tmp_path / "train.src").read_text().splitlines()
  assert lines[0].split() == sp["train"][0].src
  arcs = [json.loads(l) for l in (tmp_path / "test.arcs.jsonl").read_text().splitlines()]
  assert arcs[3] == {"heads": sp["test"][3].heads, "rels": sp["test"][3].rels}
  freqs = json.loads((tmp_path / "train_freqs.json").read_text())
  assert freqs["the"] == sum(s.src.count("the") for s in sp["train"])


def test_vocab_round_trip_and_overlong_sentence():
  v = vocab.Vocab(["a", "b", "c"])
  ids = vocab.pad_ids([v.encode(["a", "c", "zzz"])], 6, bos=True, eos=True, what="t")
  assert ids.tolist() == [[vocab.BOS_ID, 4, 6, vocab.UNK_ID, vocab.EOS_ID, vocab.PAD_ID]]
  assert v.decode(ids[0]) == ["a", "c", "<unk>"]
  with pytest.raises(ValueError, match="sentence 0 has 5 tokens.*data.max_len=4"):
    vocab.pad_ids([[4, 5, 6]], 4, bos=True, eos=True, what="data train source")


def test_repeated_tokens_structure_and_determinism():
  x = repeated_tokens.repeated_tokens(3, 7, batch=5, half_len=10, vocab_size=50)
  assert x.shape == (5, 21) and (x[:, 0] == 0).all()
  np.testing.assert_array_equal(x[:, 1:11], x[:, 11:])
  assert x[:, 1:].min() >= 1 and x.max() < 50
  np.testing.assert_array_equal(x, repeated_tokens.repeated_tokens(3, 7, 5, 10, 50))
  assert not np.array_equal(x, repeated_tokens.repeated_tokens(3, 8, 5, 10, 50))
  with pytest.raises(ValueError, match="data.vocab_size must be >= 3; got 2"):
    repeated_tokens.repeated_tokens(0, 0, 1, 4, 2)


def test_text_default_is_python_docs_and_bpe_round_trips():
  corpus = text.read_corpus(None)
  assert len(corpus) > 300_000 and "The \"assert\" statement" in corpus
  tok = text.TextTokenizer.train("bpe", corpus[:200_000], vocab_size=512)
  assert tok.vocab_size == 512
  sample = "The for statement is used to iterate over the elements of a sequence."
  assert tok.decode(tok.encode(sample)) == sample
  assert len(tok.encode(sample)) < len(sample.encode()) / 2   # it merged something
  b = text.TextTokenizer.train("bytes", corpus, 0)
  assert b.decode(b.encode("héllo")) == "héllo" and b.vocab_size == 257
  w = text.windows(tok.encode(corpus[:20000]), 0, 0, 4, 16)
  assert w.shape == (4, 16) and (w[:, 0] == 0).all()


def test_text_file_errors_name_the_file(tmp_path):
  with pytest.raises(ValueError, match=r"data.text_files: no such file '.*nope.txt'"):
    text.read_corpus([str(tmp_path / "nope.txt")])
  (tmp_path / "empty.txt").write_text("  \n")
  with pytest.raises(ValueError, match=r"data.text_files: file '.*empty.txt' is empty"):
    text.read_corpus([str(tmp_path / "empty.txt")])


CONLLU = """# text = the dog sleeps
1	the	the	DET	_	_	2	det	_	_
2	dog	dog	NOUN	_	_	3	nsubj	_	_
3	sleeps	sleep	VERB	_	_	0	root	_	_

# text = Ana sees it
1	Ana	Ana	PROPN	_	_	2	nsubj:outer	_	_
2	sees	see	VERB	_	_	0	root	_	_
3	it	it	PRON	_	_	2	obj	_	_

"""


def test_parallel_text_with_conllu(tmp_path):
  (tmp_path / "s.txt").write_text("the dog sleeps\nAna sees it\n")
  (tmp_path / "p.conllu").write_text(CONLLU)
  src = parallel.read_lines(str(tmp_path / "s.txt"), "data.train_src")
  arcs = parallel.read_conllu_arcs(str(tmp_path / "p.conllu"), src, "data.conllu.train")
  assert arcs[0] == {"heads": [1, 2, -1], "rels": ["det", "nsubj", "root"]}
  assert arcs[1]["rels"] == ["nsubj", "root", "obj"]
  (tmp_path / "bad.txt").write_text("the cat sleeps\nAna sees it\n")
  with pytest.raises(ValueError, match="data.conllu.train: sentence 1"):
    parallel.read_conllu_arcs(str(tmp_path / "p.conllu"),
                              parallel.read_lines(str(tmp_path / "bad.txt"), "x"),
                              "data.conllu.train")
  (tmp_path / "empty.txt").write_text("")
  with pytest.raises(ValueError, match="data.valid_tgt: file .* is empty"):
    parallel.read_lines(str(tmp_path / "empty.txt"), "data.valid_tgt")
  with pytest.raises(ValueError, match="data.test_src: no such file"):
    parallel.read_lines(str(tmp_path / "missing.txt"), "data.test_src")


def test_subword_pieces_rejoin_to_words_and_keep_the_arcs():
  cfg = st.GrammarConfig(subwords=True)
  _, sp = st.build_splits({"train": 200, "valid": 5, "test": 5}, seed=0, cfg=cfg)
  _, plain = st.build_splits({"train": 200, "valid": 5, "test": 5}, seed=0)
  for s, w in zip(sp["train"], plain["train"]):
    assert " ".join(s.src).replace("@@ ", "") == " ".join(w.src)
    assert s.tgt == w.tgt
    words = [i for i, t in enumerate(s.src) if not t.endswith("@@")]   # a word's last piece
    assert [s.rels[i] for i in words] == w.rels
    for i, t in enumerate(s.src):
      if t.endswith("@@"):
        assert s.rels[i] == "subword" and s.heads[i] == i + 1
    for wi, i in enumerate(words):                    # word arcs move to last pieces
      h = w.heads[wi]
      assert s.heads[i] == (-1 if h < 0 else words[h])
  pieces = {p for s in sp["train"] for p in s.src}
  assert any(p.endswith("@@") for p in pieces)
