"""Tasks: data + model + loss + evaluation for one config.

A task reads its data (generating it into `workdir/data/` the first time), builds the
model's init and apply, serves deterministic training batches by step, and evaluates.
`translation`: the encoder-decoder on the synthetic pair or the user's parallel text.
`lm`: the decoder-only model on repeated random tokens or plain text.
"""

from __future__ import annotations

import copy
import json
from typing import Iterator, Protocol, runtime_checkable

import jax
import jax.numpy as jnp
import numpy as np

from mha_jax.errors import UserError
from mha_jax import storage
from mha_jax.data import packing, parallel, repeated_tokens, synthetic_translation, text
from mha_jax.data import vocab as V
from mha_jax.models import common as C
from mha_jax.models import lm as lm_model
from mha_jax.models import seq2seq

SPLITS = ("train", "valid", "test")


def check_split(split) -> None:
  """A split name every task knows, else a UserError naming the valid ones."""
  if split not in SPLITS:
    raise UserError(f"split must be one of {', '.join(SPLITS)}; got {split!r}")


@runtime_checkable
class Task(Protocol):
  """What `mha_jax.load` hands to every study (analysis, ablation, pruning, circuits):
  the studies use these members and nothing else of a task. Batches are dicts of int32
  arrays ("src"/"tgt" for translation, "tokens" for an LM); gates are
  {stack: [(H_l,) per layer]}; metrics are sums to divide by metrics["tokens"]."""

  vocab_size: int

  def apply(self, params, batch, *, gates=None, capture=False, key=None, hook=None):
    """Logits (B, T, V); with capture=True, (logits, {stack: {layer: captured}}).
    hook: an interventions.Hook (named sites of the model's one forward). An LM's
    batch may hold "logits_at" (B,) int positions: logits only there, (B, 1, V)."""

  def loss(self, params, batch, *, key=None, gates=None, label_smoothing=0.0,
           example_weight=None):
    """(objective, metric sums) for one batch."""

  def evaluate(self, params, split: str, *, bleu: bool = False, gates=None,
               bleu_limit: int | None = None) -> dict[str, float]:
    """Loss and accuracy (and BLEU for translation) over a split."""

  def train_batch(self, step: int, process_index: int = 0, process_count: int = 1
                  ) -> dict[str, np.ndarray]:
    """Training batch number `step` (deterministic)."""

  def eval_batches(self, split: str, batch_size: int
                   ) -> Iterator[tuple[dict[str, np.ndarray], np.ndarray]]:
    """(batch, example weights (B,)) over a split; padding rows have weight 0."""


@runtime_checkable
class TranslationData(Task, Protocol):
  """A translation task's extra members, used by the role analysis and the explorer."""

  vocab: V.Vocab                                   # word vocabulary of the run
  words: dict[str, tuple[list[list[str]], list[list[str]]]]   # split -> (src, tgt) words
  arcs: dict[str, list[dict]]                      # split -> gold arcs (when known)

  def copy_baseline_bleu(self, split: str) -> float:
    """BLEU of the source sentence taken as its own translation."""


@runtime_checkable
class PretrainedLMData(Task, Protocol):
  """An imported language model's extra members, used by its studies."""

  tokenizer: object                                # the model's own tokenizer

  def repeated_tokens(self, seed: int, batch: int, half_len: int, min_half_len: int = 0):
    """(tokens (B, 1 + 2n), copy lengths (B,)): [BOS] r r, r over ordinary tokens."""


@runtime_checkable
class EmbeddingData(Task, Protocol):
  """An imported sentence encoder's extra members: a loss against the dense model's
  embeddings (set_reference), and outputs for Michel importance."""

  tokenizer: object

  def paragraphs(self) -> dict:
    """{split: paragraphs of the built-in text}."""

  def set_reference(self, params) -> None:
    """Dense params whose embeddings the loss compares against."""

  def importance_outputs(self, params, batch, gates=None):
    """(B, n) outputs whose gate gradients give Michel importance."""


def model_spec(cfg) -> C.ModelSpec:
  m = cfg.model
  return C.ModelSpec(kind="seq2seq" if cfg.task == "translation" else "lm",
                     layer_norm=m.layer_norm, attn_only=m.attn_only, dropout=m.dropout,
                     impl=m.impl, pos=m.pos,
                     ln_position=m.get("ln_position", "pre"))


def init_model(cfg, key, vocab_size: int) -> dict:
  """Fresh params of cfg.model: the one place a config becomes a model's init."""
  m = cfg.model
  common = dict(vocab_size=vocab_size, d_model=m.d_model, num_heads=m.num_heads,
                head_dim=m.head_dim, d_ff=m.d_ff, layer_norm=m.layer_norm,
                attn_only=m.attn_only, use_bias=m.use_bias)
  if cfg.task == "translation":
    return seq2seq.init(key, enc_layers=m.enc_layers, dec_layers=m.dec_layers,
                        ln_position=m.ln_position, pos=m.pos, max_rel=m.max_rel, **common)
  return lm_model.init(key, num_layers=m.num_layers, max_len=m.max_len, pos=m.pos, **common)


def _epoch_indices(seed: int, n: int, start: int, count: int) -> np.ndarray:
  """Examples start..start+count of the stream of shuffled epochs over n examples."""
  out = np.empty(count, np.int64)
  pos = 0
  while pos < count:
    epoch, offset = divmod(start + pos, n)
    perm = np.random.default_rng([seed, 1000 + epoch]).permutation(n)
    take = min(count - pos, n - offset)
    out[pos:pos + take] = perm[offset:offset + take]
    pos += take
  return out


def train_order_seed(cfg) -> int:
  """The seed of the training batches' order: train.shuffle_seed, or data.seed when it
  is -1 (the default; a multi-seed run gives each seed its own, train/seeds.py)."""
  shuffle = cfg.train.get("shuffle_seed", -1)
  return cfg.data.seed if shuffle < 0 else shuffle


def local_rows(batch: int, process_index: int, process_count: int) -> slice:
  """This process's share of a batch's B rows."""
  per = batch // process_count
  return slice(process_index * per, (process_index + 1) * per)


def _check_ids(ids, vocab_size: int, what: str) -> None:
  C.check_token_ids(ids, vocab_size, what)


def check_batch_ids(task, batch: dict, what: str = "batch") -> None:
  """Every token-id array of a batch within the task's vocabulary."""
  for key in ("tokens", "src", "tgt"):
    if key in batch:
      _check_ids(batch[key], task.vocab_size, f"{what}[{key!r}]")


def token_losses(logits_BTV, targets_BT, label_smoothing: float = 0.0):
  """Per-token (nll, objective, correct) from one float32 log-sum-exp over the vocabulary.

  The objective is the cross-entropy against labels smoothed as optax.smooth_labels does
  ((1 - e) one-hot + e / V), written as (1 - e) nll - e mean_v log p_v, so neither a
  one-hot nor a log-probability tensor is built. `correct` is 1 where the target's logit
  is the row's maximum.
  """
  logits = logits_BTV.astype(jnp.float32)
  top = jnp.max(logits, axis=-1, keepdims=True)
  shifted = logits - jax.lax.stop_gradient(top)
  lse = jnp.log(jnp.sum(jnp.exp(shifted), axis=-1))
  target_shifted = jnp.take_along_axis(shifted, targets_BT[..., None], axis=-1)[..., 0]
  target_logp = target_shifted - lse
  nll = -target_logp
  obj = nll
  if label_smoothing:
    obj = (1.0 - label_smoothing) * nll - label_smoothing * (shifted.mean(-1) - lse)
  correct = (target_shifted >= 0).astype(jnp.float32)   # the target's logit is the max
  return nll, obj, correct


class TranslationTask:
  """Encoder-decoder translation; BLEU with sacrebleu."""

  def __init__(self, cfg, workdir: str | None, *, read_only: bool = False):
    self.cfg = cfg
    d = cfg.data
    self.data_dir = storage.join(workdir, "data") if workdir else None
    self.arcs: dict[str, list] = {}
    writes = []   # files to write, after every check
    if d.kind == "synthetic":
      gcfg = synthetic_translation.GrammarConfig(**dict(d.grammar))
      grammar, splits = synthetic_translation.build_splits(
          {"train": d.train_size, "valid": d.valid_size, "test": d.test_size}, d.seed, gcfg)
      self.words = {s: ([x.src for x in splits[s]], [x.tgt for x in splits[s]]) for s in SPLITS}
      self.arcs = {s: [{"heads": x.heads, "rels": x.rels} for x in splits[s]] for s in SPLITS}
      self.vocab = V.Vocab(grammar.lex.source_types() + grammar.lex.target_types())
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
      self.vocab = V.Vocab(w for side in self.words["train"] for sent in side for w in sent)
      if self.data_dir and not read_only:
        writes.append(self._write_parallel_files)
    else:
      raise UserError(f"data.kind must be 'synthetic' or 'parallel' for translation; "
                       f"got {d.kind!r}")
    self.vocab = self._run_vocab(self.vocab, read_only, writes)
    self.arrays = {}
    for s in SPLITS:
      src_w, tgt_w = self.words[s]
      src = V.pad_ids([self.vocab.encode(w) for w in src_w], d.max_len, bos=False, eos=True,
                      what=f"data {s} source")
      tgt = V.pad_ids([self.vocab.encode(w) for w in tgt_w], d.max_len + 1, bos=True,
                      eos=True, what=f"data {s} target")
      self.arrays[s] = {"src": src, "tgt": tgt}
    self.vocab_size = len(self.vocab)
    self.spec = model_spec(cfg)
    for write in writes:      # the run's data files, once every check above has passed
      write()

  def _write_parallel_files(self) -> None:
    storage.makedirs(self.data_dir)
    for s, arcs in self.arcs.items():
      storage.write_text(storage.join(self.data_dir, f"{s}.arcs.jsonl"),
                         "".join(json.dumps(a) + "\n" for a in arcs))
    freqs: dict[str, int] = {}
    for sent in self.words["train"][0]:
      for w in sent:
        freqs[w] = freqs.get(w, 0) + 1
    storage.write_json(storage.join(self.data_dir, "train_freqs.json"), freqs, indent=None)

  def _run_vocab(self, built: V.Vocab, read_only: bool, writes: list) -> V.Vocab:
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
    saved = V.Vocab.load(path)
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
    return init_model(self.cfg, key, self.vocab_size)

  def apply(self, params, batch, *, gates=None, capture=False, key=None, hook=None):
    check_batch_ids(self, batch)
    packed = None
    if "src_seg" in batch:     # a packed batch (data/packing.py)
      packed = {"src_seg": batch["src_seg"], "src_pos": batch["src_pos"],
                "tgt_seg": batch["tgt_seg"][:, :-1], "tgt_pos": batch["tgt_pos"][:, :-1]}
    return seq2seq.apply(params, self.spec, batch["src"], batch["tgt"][:, :-1], gates=gates,
                         capture=capture, key=key, packed=packed, hook=hook)

  # ---------------------------------------------------------------- data
  def train_batch(self, step: int, process_index: int = 0, process_count: int = 1):
    b = self.cfg.train.batch_size
    idx = _epoch_indices(train_order_seed(self.cfg), len(self.arrays["train"]["src"]),
                         step * b, b)
    idx = idx[local_rows(b, process_index, process_count)]
    return {k: v[idx] for k, v in self.arrays["train"].items()}

  def train_rows_needed(self, step: int) -> int:
    """Rows the packed form of training batch `step` needs (data/packing.py)."""
    return packing.rows_needed(self.train_batch(step), V.PAD_ID)

  def packed_train_batch(self, step: int, rows: int | tuple[int, ...]
                         ) -> dict[str, np.ndarray]:
    """The whole training batch `step` packed into `rows` rows, or into the smallest
    rung of a ladder that holds it (data/packing.py)."""
    return packing.pack(self.train_batch(step), rows, V.PAD_ID)

  def eval_batches(self, split: str, batch_size: int):
    check_split(split)
    arr = self.arrays[split]
    n = len(arr["src"])
    for start in range(0, n, batch_size):
      idx = np.arange(start, start + batch_size)
      weight = (idx < n).astype(np.float32)
      idx = np.minimum(idx, n - 1)
      yield {k: v[idx] for k, v in arr.items()}, weight

  # ---------------------------------------------------------------- loss
  def loss(self, params, batch, *, key=None, gates=None, label_smoothing=0.0,
           example_weight=None):
    """(objective, metrics sums) for one batch. Metrics are sums, to be divided by
    metrics["tokens"]."""
    logits = self.apply(params, batch, gates=gates, key=key)
    targets = batch["tgt"][:, 1:]
    mask = targets != V.PAD_ID
    if "tgt_seg" in batch:     # packed: no target across two pairs' boundary
      mask = mask & (batch["tgt_seg"][:, 1:] == batch["tgt_seg"][:, :-1])
    mask = mask.astype(jnp.float32)
    if example_weight is not None:
      mask = mask * example_weight[:, None]
    nll, obj, correct = token_losses(logits, targets, label_smoothing)
    tokens = mask.sum()
    metrics = {"loss": (nll * mask).sum(), "accuracy": (correct * mask).sum(),
               "tokens": tokens}
    return (obj * mask).sum() / jnp.maximum(tokens, 1.0), metrics

  # ---------------------------------------------------------------- evaluation
  def translate(self, params, split: str, limit: int = 0, batch_size: int = 128,
                gates=None):
    """Greedy translations of the first `limit` (0 = all) sentences of a split."""
    decode = jitted(self, "greedy", lambda p, src, g: seq2seq.greedy_decode(
        p, self.spec, src, self.cfg.data.max_len + 1, V.BOS_ID, V.EOS_ID, gates=g))
    src = self.arrays[split]["src"]
    n = len(src) if limit <= 0 else min(limit, len(src))
    batch_size = min(batch_size, n)
    hyps = []
    for start in range(0, n, batch_size):
      chunk = src[start:start + batch_size]
      pad = batch_size - len(chunk)
      if pad:
        chunk = np.concatenate([chunk, np.repeat(chunk[-1:], pad, 0)])
      out = np.asarray(decode(params, jnp.asarray(chunk), gates))
      hyps += [self.vocab.decode(row) for row in out[: batch_size - pad]]
    return hyps

  def bleu(self, params, split: str, limit: int = 0, gates=None) -> float:
    import sacrebleu
    hyps = self.translate(params, split, limit, gates=gates)
    refs = self.words[split][1][: len(hyps)]
    return sacrebleu.corpus_bleu([" ".join(h) for h in hyps],
                                 [[" ".join(r) for r in refs]]).score

  def copy_baseline_bleu(self, split: str) -> float:
    """BLEU of the source sentence taken as its own translation."""
    import sacrebleu
    src, tgt = self.words[split]
    return sacrebleu.corpus_bleu([" ".join(s) for s in src], [[" ".join(t) for t in tgt]]).score

  def evaluate(self, params, split: str, *, bleu: bool = True, gates=None,
               bleu_limit: int | None = None) -> dict[str, float]:
    """Loss and accuracy over the split; BLEU over all of test, or over
    eval.bleu_examples sentences of other splits (bleu_limit overrides; 0 = all)."""
    e = self.cfg.eval
    totals = _sum_metrics(self, params, split, e.batch_size, gates)
    out = {"loss": totals["loss"] / totals["tokens"],
           "accuracy": totals["accuracy"] / totals["tokens"]}
    if bleu:
      limit = bleu_limit if bleu_limit is not None else (
          e.bleu_examples if split != "test" else 0)
      out["bleu"] = self.bleu(params, split, limit, gates=gates)
    return out


class LMTask:
  """Decoder-only LM on repeated random tokens or plain text."""

  def __init__(self, cfg, workdir: str | None, *, read_only: bool = False):
    self.cfg = cfg
    d = cfg.data
    self.data_dir = storage.join(workdir, "data") if workdir else None
    save_tokenizer = False
    if d.kind == "repeated":
      self.vocab_size = d.vocab_size
      self.seq_len = 1 + 2 * d.half_len
      repeated_tokens.repeated_tokens(d.seed, 0, 1, d.half_len, d.vocab_size)  # validates
    elif d.kind == "text":
      tok_path = None
      if self.data_dir:
        for name in ("tokenizer.json", "tokenizer.bytes"):
          if storage.exists(storage.join(self.data_dir, name)):
            tok_path = storage.join(self.data_dir, name)
      corpus = text.read_corpus(list(d.text_files))
      if tok_path:
        self.tokenizer = text.TextTokenizer.load(tok_path)
      else:
        self.tokenizer = text.TextTokenizer.train(d.tokenizer, corpus, d.vocab_size)
        if self.data_dir and not read_only:
          save_tokenizer = True
      self.streams = text.split_stream(self.tokenizer.encode(corpus))
      self.vocab_size = self.tokenizer.vocab_size
      self.seq_len = cfg.model.max_len
    else:
      raise UserError(f"data.kind must be 'repeated' or 'text' for lm; got {d.kind!r}")
    if self.seq_len > cfg.model.max_len:
      raise UserError(f"data.half_len={d.half_len} gives sequences of {self.seq_len} tokens, "
                       f"more than model.max_len={cfg.model.max_len}")
    self.spec = model_spec(cfg)
    if save_tokenizer:         # once every check above has passed
      storage.makedirs(self.data_dir)
      self.tokenizer.save(self.data_dir)

  def init_params(self, key):
    return init_model(self.cfg, key, self.vocab_size)

  def apply(self, params, batch, *, gates=None, capture=False, key=None, hook=None):
    check_batch_ids(self, batch)
    return lm_model.apply(params, self.spec, batch["tokens"][:, :-1], gates=gates,
                          capture=capture, key=key, hook=hook,
                          logits_at=batch.get("logits_at"))

  def _batch(self, split: str, index: int, batch: int) -> np.ndarray:
    d = self.cfg.data
    seed = {"train": train_order_seed(self.cfg), "valid": d.seed + 1_000_003,
            "test": d.seed + 2_000_003}[split]
    if d.kind == "repeated":
      return repeated_tokens.repeated_tokens(seed, index, batch, d.half_len, d.vocab_size,
                                             d.get("min_half_len", 0), return_lengths=True,
                                             random_start=d.get("random_start", False))
    return text.windows(self.streams[split], seed, index, batch, self.seq_len + 1), None

  def train_batch(self, step: int, process_index: int = 0, process_count: int = 1):
    b = self.cfg.train.batch_size
    batch = self._make(*self._batch("train", step, b))
    rows = local_rows(b, process_index, process_count)
    batch = {k: v[rows] for k, v in batch.items()}
    _check_ids(batch["tokens"], self.vocab_size, "training batch")
    return batch

  def _make(self, tokens, lengths, starts=None):
    """The batch dict; for repeated tokens with the first/repeat position masks."""
    if lengths is None:
      return {"tokens": tokens}
    masks = repeated_tokens.position_masks(lengths, tokens.shape[1] - 1, starts)
    return {"tokens": tokens, "mask_first": masks["first"], "mask_repeat": masks["repeat"]}

  def eval_batches(self, split: str, batch_size: int):
    check_split(split)
    for i in range(max(1, self.cfg.eval.lm_batches)):
      yield self._make(*self._batch(split, i, batch_size)), np.ones(batch_size, np.float32)

  def loss(self, params, batch, *, key=None, gates=None, label_smoothing=0.0,
           example_weight=None):
    tokens = batch["tokens"]
    logits = self.apply(params, batch, gates=gates, key=key)
    targets = tokens[:, 1:]
    nll, obj, correct = token_losses(logits, targets, label_smoothing)
    w = jnp.ones_like(nll) if example_weight is None else jnp.broadcast_to(
        example_weight[:, None], nll.shape)
    metrics = {"loss": (nll * w).sum(), "accuracy": (correct * w).sum(),
               "tokens": w.sum()}
    for name in ("first", "repeat"):
      if f"mask_{name}" in batch:
        m = batch[f"mask_{name}"]
        metrics[f"loss_{name}"] = (nll * w * m).sum()
        metrics[f"tokens_{name}"] = (w * m).sum()
    return (obj * w).sum() / w.sum(), metrics

  def evaluate(self, params, split: str, *, bleu: bool = False, gates=None,
               bleu_limit: int | None = None) -> dict[str, float]:
    del bleu, bleu_limit
    totals = _sum_metrics(self, params, split, self.cfg.eval.batch_size, gates)
    out = {"loss": totals["loss"] / totals["tokens"],
           "accuracy": totals["accuracy"] / totals["tokens"]}
    for name in ("first", "repeat"):
      if f"loss_{name}" in totals:
        out[f"loss_{name}"] = totals[f"loss_{name}"] / totals[f"tokens_{name}"]
    return out


def build_seeds(runs) -> list:
  """The tasks of a multi-seed run (train/seeds.py), one per (cfg, workdir): the data is
  built once, for the first seed. The seeds' configs differ only in seed and batch
  order, so the others share its arrays; each gets a copy of its data files, so that
  every seed folder stays an ordinary workdir."""
  first = build(*runs[0])
  out = [first]
  for cfg, workdir in runs[1:]:
    if cfg.data.to_dict() != first.cfg.data.to_dict() or cfg.model != first.cfg.model:
      out.append(build(cfg, workdir))      # not the same data: built on its own
      continue
    data_dir = storage.join(workdir, "data")
    if (first.data_dir and storage.exists(first.data_dir)
        and not storage.exists(data_dir)):
      storage.copytree(first.data_dir, data_dir)
    task = copy.copy(first)
    task.__dict__.pop("_jit_cache", None)
    task.cfg, task.data_dir = cfg, data_dir
    out.append(task)
  return out


def jitted(task, name: str, fn):
  """`fn` jitted once per task and cached on it, so repeated evaluations, captures and
  gradient passes compile once per shape instead of once per call. Params, gates and
  batches must be arguments of `fn`, never constants it closes over."""
  cache = task.__dict__.setdefault("_jit_cache", {})
  if name not in cache:
    cache[name] = jax.jit(fn)
  return cache[name]


def _sum_metrics(task, params, split, batch_size, gates=None) -> dict[str, float]:
  """Sums of the loss metrics over a split's evaluation batches (one compile per task)."""
  check_split(split)
  fn = jitted(task, "eval_metrics",
              lambda p, b, w, g: task.loss(p, b, example_weight=w, gates=g)[1])
  totals = None                      # summed on the device; one transfer at the end
  for batch, weight in task.eval_batches(split, batch_size):
    check_batch_ids(task, batch, f"{split} batch")
    m = fn(params, batch, jnp.asarray(weight), gates)
    totals = m if totals is None else jax.tree.map(jnp.add, totals, m)
  return {k: float(v) for k, v in jax.device_get(totals or {}).items()}


def build(cfg, workdir: str | None = None, *, read_only: bool = False):
  """The task object for a config. read_only: never write into `workdir` (loading a run);
  otherwise the first build writes the run's data files (vocabulary, tokenizer)."""
  if cfg.task == "translation":
    return TranslationTask(cfg, workdir, read_only=read_only)
  if cfg.task == "lm":
    return LMTask(cfg, workdir, read_only=read_only)
  if cfg.task in ("pretrained_lm", "embedding"):      # imported models (mha-jax import)
    from mha_jax.pretrained import tasks as pretrained_tasks
    return pretrained_tasks.build(cfg, workdir)
  raise UserError(f"task must be 'translation' or 'lm'; got {cfg.task!r}")
