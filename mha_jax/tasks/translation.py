"""Encoder-decoder translation on the synthetic pair or the user's parallel text.

The first `train` writes the run's data into `workdir/data/` ({split}.src/.tgt,
{split}.arcs.jsonl, train_freqs.json, vocab.json); loading a synthetic run reads those
files, so the grammar runs only when a run is created. Parallel text is read from the
files the config names, and checked against the run's vocabulary.
"""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np

from mha_jax import storage
from mha_jax.data import packing, parallel, synthetic_translation
from mha_jax.data import vocab
from mha_jax.errors import UserError
from mha_jax.models import seq2seq
from mha_jax.tasks import base
from mha_jax.tasks.base import SPLITS


def read_run_data(data_dir: str) -> tuple[dict, dict] | None:
  """(words {split: (src, tgt)}, arcs {split: arcs}) from a run's data/ folder, or None
  when the folder does not hold every split (a run made before its data was exported)."""
  names = [storage.join(data_dir, f"{s}.{side}") for s in SPLITS for side in ("src", "tgt")]
  if not all(storage.exists(p) for p in names):
    return None
  words, arcs = {}, {}
  for s in SPLITS:
    words[s] = (parallel.read_lines(storage.join(data_dir, f"{s}.src"), f"data/{s}.src"),
                parallel.read_lines(storage.join(data_dir, f"{s}.tgt"), f"data/{s}.tgt"))
    path = storage.join(data_dir, f"{s}.arcs.jsonl")
    if storage.exists(path):
      arcs[s] = [json.loads(line) for line in storage.read_text(path).splitlines() if line]
  return words, arcs


class TranslationTask:
  """Encoder-decoder translation; BLEU with sacrebleu."""

  name = "translation"
  stacks = seq2seq.STACKS
  trainable = True
  decoder_only = False
  reports_bleu = True
  role_family = "translation"
  compares_to_dense = False
  packs = True

  def __init__(self, cfg, workdir: str | None, *, read_only: bool = False):
    self.cfg = cfg
    d = cfg.data
    self.data_dir = storage.join(workdir, "data") if workdir else None
    self.arcs: dict[str, list] = {}
    writes = []   # files to write, after every check
    saved = None
    if (read_only and d.kind == "synthetic" and self.data_dir
        and storage.exists(storage.join(self.data_dir, "vocab.json"))):
      saved = read_run_data(self.data_dir)
    if saved is not None:           # loading a run: its own files, never the grammar
      self.words, self.arcs = saved
      self.vocab = vocab.Vocab.load(storage.join(self.data_dir, "vocab.json"))
      self._check_words_in_vocab()
    elif d.kind == "synthetic":
      gcfg = synthetic_translation.GrammarConfig(**dict(d.grammar))
      grammar, splits = synthetic_translation.build_splits(
          {"train": d.train_size, "valid": d.valid_size, "test": d.test_size}, d.seed, gcfg)
      self.words = {s: ([x.src for x in splits[s]], [x.tgt for x in splits[s]]) for s in SPLITS}
      self.arcs = {s: [{"heads": x.heads, "rels": x.rels} for x in splits[s]] for s in SPLITS}
      self.vocab = vocab.Vocab(grammar.lex.source_types() + grammar.lex.target_types())
      if (self.data_dir and not read_only and
          not storage.exists(storage.join(self.data_dir, "train.src"))):
        writes.append(lambda: synthetic_translation.export(self.data_dir, grammar, splits))
    elif d.kind == "parallel":
      self.words = {}
      for s in SPLITS:
        src = parallel.read_lines(d[f"{s}_src"], f"data.{s}_src")
        tgt = parallel.read_lines(d[f"{s}_tgt"], f"data.{s}_tgt")
        if len(src) != len(tgt):
          raise UserError(f"data.{s}_src has {len(src)} lines but data.{s}_tgt has "
                          f"{len(tgt)}")
        self.words[s] = (src, tgt)
        if d.conllu[s]:
          self.arcs[s] = parallel.read_conllu_arcs(d.conllu[s], src, f"data.conllu.{s}")
      self.vocab = vocab.Vocab(w for side in self.words["train"] for sent in side for w in sent)
      if self.data_dir and not read_only:
        writes.append(self._write_parallel_files)
    else:
      raise UserError(f"data.kind must be 'synthetic' or 'parallel' for translation; "
                      f"got {d.kind!r}")
    if saved is None:
      self.vocab = self._run_vocab(self.vocab, read_only, writes)
    self.arrays = {}
    for s in SPLITS:
      src_w, tgt_w = self.words[s]
      src = vocab.pad_ids([self.vocab.encode(w) for w in src_w], d.max_len, bos=False, eos=True,
                      what=f"data {s} source")
      tgt = vocab.pad_ids([self.vocab.encode(w) for w in tgt_w], d.max_len + 1, bos=True,
                      eos=True, what=f"data {s} target")
      self.arrays[s] = {"src": src, "tgt": tgt}
    self.vocab_size = len(self.vocab)
    self.spec = base.model_spec(cfg)
    for write in writes:      # the run's data files, once every check above has passed
      write()

  def _write_parallel_files(self):
    """The user's parallel text stays where the config names it (and its vocabulary is
    checked against the run's at every load); the run keeps its arcs and frequencies."""
    storage.makedirs(self.data_dir)
    for s, arcs in self.arcs.items():
      storage.write_text(storage.join(self.data_dir, f"{s}.arcs.jsonl"),
                         "".join(json.dumps(a) + "\n" for a in arcs))
    freqs: dict[str, int] = {}
    for sent in self.words["train"][0]:
      for w in sent:
        freqs[w] = freqs.get(w, 0) + 1
    storage.write_json(storage.join(self.data_dir, "train_freqs.json"), freqs, indent=None)

  def _check_words_in_vocab(self):
    """The run's data files must be spelled in its vocabulary (edited files are refused)."""
    index = self.vocab.index
    for s in SPLITS:
      for side, rows in zip(("src", "tgt"), self.words[s]):
        new = sorted({w for row in rows for w in row if w not in index})
        if new:
          raise UserError(
              f"{storage.join(self.data_dir, f'{s}.{side}')}: the data no longer matches the "
              f"run's vocabulary {storage.join(self.data_dir, 'vocab.json')} ({len(new)} new "
              f"words, e.g. {new[:5]}). The data changed after training; restore it")

  def _run_vocab(self, built: vocab.Vocab, read_only: bool, writes: list) -> vocab.Vocab:
    """The run's vocabulary is part of the run: read from workdir/data/vocab.json when
    it exists (written once, by the first `train`), never rebuilt over it. Data whose
    vocabulary differs from it is refused."""
    if not self.data_dir:
      return built
    path = storage.join(self.data_dir, "vocab.json")
    if not storage.exists(path):
      if not read_only:
        writes.append(lambda: (storage.makedirs(self.data_dir), built.save(path)))
      return built
    saved = vocab.Vocab.load(path)
    if saved.tokens != built.tokens:
      new = [t for t in built.tokens if t not in saved.index]
      gone = [t for t in saved.tokens if t not in built.index]
      what = ("data.train_src/data.train_tgt" if self.cfg.data.kind == "parallel"
              else "data (synthetic)")
      raise UserError(
          f"{what}: the training data no longer matches the run's vocabulary {path} "
          f"({len(saved)} tokens; the data gives {len(built)}: {len(new)} new, e.g. "
          f"{new[:5]}, {len(gone)} missing, e.g. {gone[:5]}). The data changed after "
          f"training; restore it or train a new run")
    return saved

  # ---------------------------------------------------------------- model
  def init_params(self, key):
    return base.init_model(self.cfg, key, self.vocab_size)

  def apply(self, params, batch, *, key=None, hook=None):
    base.check_batch_ids(self, batch)
    packed = None
    if "src_seg" in batch:     # a packed batch (data/packing.py)
      packed = {"src_seg": batch["src_seg"], "src_pos": batch["src_pos"],
                "tgt_seg": batch["tgt_seg"][:, :-1], "tgt_pos": batch["tgt_pos"][:, :-1]}
    return seq2seq.apply(params, self.spec, batch["src"], batch["tgt"][:, :-1], key=key,
                         packed=packed, hook=hook)

  # ---------------------------------------------------------------- data
  def train_batch(self, step: int, process_index: int = 0, process_count: int = 1):
    b = self.cfg.train.batch_size
    idx = base.epoch_indices(base.train_order_seed(self.cfg),
                             len(self.arrays["train"]["src"]), step * b, b)
    idx = idx[base.local_rows(b, process_index, process_count)]
    return {k: v[idx] for k, v in self.arrays["train"].items()}

  def train_rows_needed(self, step: int) -> int:
    """Rows the packed form of training batch `step` needs (data/packing.py)."""
    return packing.rows_needed(self.train_batch(step), vocab.PAD_ID)

  def packed_train_batch(self, step: int, rows: int | tuple[int, ...]
                         ) -> dict[str, np.ndarray]:
    """The whole training batch `step` packed into `rows` rows, or into the smallest
    rung of a ladder that holds it (data/packing.py)."""
    return packing.pack(self.train_batch(step), rows, vocab.PAD_ID)

  def eval_batches(self, split: str, batch_size: int):
    arr = self.arrays[base.check_split(split)]
    for idx, weight in base.padded_rows(len(arr["src"]), batch_size):
      yield {k: v[idx] for k, v in arr.items()}, weight

  # ---------------------------------------------------------------- loss
  def loss(self, params, batch, *, key=None, hook=None, label_smoothing=0.0,
           example_weight=None):
    """(objective, metrics sums) for one batch. Metrics are sums, to be divided by
    metrics["tokens"]."""
    logits = self.apply(params, batch, key=key, hook=hook)
    targets = batch["tgt"][:, 1:]
    mask = targets != vocab.PAD_ID
    if "tgt_seg" in batch:     # packed: no target across two pairs' boundary
      mask = mask & (batch["tgt_seg"][:, 1:] == batch["tgt_seg"][:, :-1])
    mask = mask.astype(jnp.float32)
    if example_weight is not None:
      mask = mask * example_weight[:, None]
    nll, obj, correct = base.token_losses(logits, targets, label_smoothing)
    return base.weighted_mean(obj, mask), base.token_metrics(nll, correct, mask, batch)

  # ---------------------------------------------------------------- evaluation
  def translate(self, params, split: str, limit: int = 0, batch_size: int = 128,
                hook=None):
    """Greedy translations of the first `limit` (0 = all) sentences of a split, with
    `hook`'s edits (`base.hook_edits`) in the encoder and at every decoding step."""
    edits = base.hook_edits(hook)
    decode = base.jitted(self, "greedy", lambda p, src, e: seq2seq.greedy_decode(
        p, self.spec, src, self.cfg.data.max_len + 1, vocab.BOS_ID, vocab.EOS_ID, edits=e))
    src = self.arrays[base.check_split(split)]["src"]
    n = len(src) if limit <= 0 else min(limit, len(src))
    batch_size = min(batch_size, n)
    hyps = []
    for start in range(0, n, batch_size):
      chunk = src[start:start + batch_size]
      pad = batch_size - len(chunk)
      if pad:
        chunk = np.concatenate([chunk, np.repeat(chunk[-1:], pad, 0)])
      out = np.asarray(decode(params, jnp.asarray(chunk), edits))
      hyps += [self.vocab.decode(row) for row in out[: batch_size - pad]]
    return hyps

  def bleu(self, params, split: str, limit: int = 0, hook=None) -> float:
    import sacrebleu
    hyps = self.translate(params, split, limit, hook=hook)
    refs = self.words[split][1][: len(hyps)]
    return sacrebleu.corpus_bleu([" ".join(h) for h in hyps],
                                 [[" ".join(r) for r in refs]]).score

  def copy_baseline_bleu(self, split: str) -> float:
    """BLEU of the source sentence taken as its own translation."""
    import sacrebleu
    src, tgt = self.words[base.check_split(split)]
    return sacrebleu.corpus_bleu([" ".join(s) for s in src], [[" ".join(t) for t in tgt]]).score

  def evaluate(self, params, split: str, *, bleu: bool | None = None, hook=None,
               bleu_limit: int | None = None) -> dict[str, float]:
    """Loss and accuracy over the split; BLEU (unless bleu=False) over all of test, or
    over eval.bleu_examples sentences of other splits (bleu_limit overrides; 0 = all)."""
    e = self.cfg.eval
    out = base.per_token(base.sum_metrics(self, params, base.check_split(split),
                                          e.batch_size, hook))
    if bleu is None or bleu:
      limit = bleu_limit if bleu_limit is not None else (
          e.bleu_examples if split != "test" else 0)
      out["bleu"] = self.bleu(params, split, limit, hook=hook)
    return out
