"""A BERT encoder imported from safetensors (`mha-jax import`): sentence embeddings.

`apply(params, {"tokens", "mask", "token_types"})` returns the last hidden states
(B, T, D); `embed(params, texts)` the mean-pooled sentence embeddings. Without a task
head, its loss is the cosine distance to the dense model's embeddings (set_reference).
"""

from __future__ import annotations

import collections

import jax
import jax.numpy as jnp
import numpy as np

from mha_jax.data import text as text_data
from mha_jax.errors import UserError
from mha_jax.models import bert
from mha_jax.models import common
from mha_jax.tasks import base
from mha_jax.tasks.imported import Imported, gate_batch, tokenizer_of

# Reference embeddings kept per batch: the batches of one study recur (evaluation, gate
# training by step); beyond this many the oldest go.
REFERENCE_CACHE_SIZE = 256


class EmbeddingTask(Imported):
  """A BERT encoder imported from safetensors (sentence embeddings by mean pooling)."""

  name = "embedding"
  stacks = ("encoder",)
  decoder_only = False
  role_family = "embedding"
  compares_to_dense = True

  def __init__(self, cfg, workdir: str | None):
    self.cfg = cfg
    self.spec = bert.BertSpec(norm_eps=cfg.model.norm_eps, impl=cfg.model.impl)
    self.tokenizer = tokenizer_of(workdir, add_special_tokens=True)
    self.vocab_size = cfg.model.vocab_size
    self._paragraphs = None

  def apply(self, params, batch, *, key=None, hook=None):
    """Last hidden states (B, T, D) of batch["tokens"]; batch["mask"] (True = real token)
    and batch["token_types"] are optional. hook: an interventions.Hook."""
    del key
    common.check_token_ids(batch["tokens"], self.vocab_size, "batch['tokens']")
    return bert.apply(params, self.spec, batch["tokens"], mask_BT=batch.get("mask"),
                      token_types_BT=batch.get("token_types"), hook=hook)

  # ---------------------------------------------------------------- studies
  def pooled(self, params, batch, hook=None):
    """Mean-pooled, L2-normalised sentence embeddings (B, D) of a batch (traceable)."""
    return bert.mean_pool(self.apply(params, batch, hook=hook), batch["mask"], normalize=True)

  def loss(self, params, batch, *, key=None, hook=None, label_smoothing=0.0,
           example_weight=None):
    """A loss without a task head: the cosine distance 1 - cos(e, e_ref) between the
    (gated) model's sentence embedding and the reference: batch["reference"] (the dense
    model's embeddings, see with_reference) or else the same params without the hook."""
    del key, label_smoothing
    e = self.pooled(params, batch, hook)
    ref = batch["reference"] if "reference" in batch else jax.lax.stop_gradient(
        self.pooled(params, batch))
    ref = ref / jnp.maximum(jnp.linalg.norm(ref, axis=-1, keepdims=True), 1e-12)
    dist = 1.0 - (e * ref).sum(-1)                                  # (B,)
    w = jnp.ones_like(dist) if example_weight is None else example_weight
    metrics = {"loss": (dist * w).sum(), "tokens": w.sum()}
    return base.weighted_mean(dist, w), metrics

  def importance_outputs(self, params, batch, hook=None):
    """(B, 8) projections of the embedding on 8 fixed random unit directions. The cosine
    loss is flat at the dense model (its gate gradients are 0 there), so Michel et al.'s
    importance E|dL/dxi_h| is taken over these instead: E_x sum_k |r_k . de/dxi_h|, which
    is proportional to the embedding's sensitivity |de/dxi_h| for isotropic r_k."""
    e = self.pooled(params, batch, hook)
    r = jax.random.normal(jax.random.PRNGKey(0), (8, e.shape[-1]), e.dtype)
    return e @ (r / jnp.linalg.norm(r, axis=-1, keepdims=True)).T

  def set_reference(self, params) -> None:
    """Dense params whose embeddings the loss compares against (added to every batch)."""
    self._reference = params
    self._reference_cache = collections.OrderedDict()

  def with_reference(self, batch: dict) -> dict:
    ref = getattr(self, "_reference", None)
    if ref is None:
      return batch
    key = np.asarray(batch["tokens"]).tobytes()     # the same batches recur: cache
    cache = self.__dict__.setdefault("_reference_cache", collections.OrderedDict())
    if key in cache:
      cache.move_to_end(key)
    else:
      fn = base.jitted(self, "pooled", lambda p, b, e: self.pooled(p, b, base.edits_hook(e)))
      cache[key] = fn(ref, {k: jnp.asarray(v) for k, v in batch.items()}, None)
      while len(cache) > REFERENCE_CACHE_SIZE:
        cache.popitem(last=False)
    return dict(batch, reference=cache[key])

  def train_batch(self, step: int, process_index: int = 0, process_count: int = 1) -> dict:
    """Batch `step`: batch_size random paragraphs (<= seq_len wordpieces; the config's
    "prune" section, else "eval") of the built-in text's train split (for head-gate
    training; the model's weights are never trained here)."""
    del process_index, process_count
    e = gate_batch(self.cfg)
    paras = self.paragraphs()["train"]
    rng = np.random.default_rng([int(self.cfg.get("seed", 0)), 19, step])
    idx = rng.integers(0, len(paras), size=e.batch_size)
    return self.with_reference(self.batch([paras[i] for i in idx], e.seq_len, pad=True))

  def paragraphs(self) -> dict:
    """{split: paragraphs of the built-in text} (90 / 5 / 5 %)."""
    if self._paragraphs is None:
      corpus = text_data.read_corpus(list(self.cfg.data.text_files))
      paras = [p.strip() for p in corpus.split("\n\n") if len(p.strip()) > 40]
      n = len(paras)
      cut = {"train": (0, int(0.9 * n)), "valid": (int(0.9 * n), int(0.95 * n)),
             "test": (int(0.95 * n), n)}
      self._paragraphs = {s: paras[a:b] for s, (a, b) in cut.items()}
    return self._paragraphs

  def batch(self, texts, max_len: int | None = None, pad: bool = False) -> dict:
    """{"tokens", "mask", "token_types"} (B, T), right-padded with the pad id: to the
    longest text, or with pad=True to max_len (one shape for every batch: one compile)."""
    if self.tokenizer is None:
      raise UserError("this task was built without a workdir: no tokenizer")
    if isinstance(texts, str):
      raise UserError("texts must be a list of strings; got one string")
    ids = self.tokenizer.encode_batch(texts)
    for i in ids:
      common.check_token_ids(i, self.vocab_size, "the workdir's tokenizer.json")
    if max_len:
      ids = [i[:max_len] for i in ids]
    t = max_len if pad and max_len else max(len(i) for i in ids)
    tokens = np.full((len(ids), t), self.cfg.tokenizer.pad_id, np.int32)
    mask = np.zeros((len(ids), t), bool)
    for r, i in enumerate(ids):
      tokens[r, :len(i)] = i
      mask[r, :len(i)] = True
    return {"tokens": tokens, "mask": mask, "token_types": np.zeros_like(tokens)}

  def embed(self, params, texts, *, normalize: bool | None = None) -> np.ndarray:
    """Sentence embeddings (N, D): mask-aware mean of the last hidden states, L2-normalised
    when the model's sentence-transformers pipeline does (default) or normalize=True."""
    b = self.batch(texts)
    norm = self.cfg.tokenizer.get("normalize", False) if normalize is None else normalize
    fn = base.jitted(self, f"embed_{bool(norm)}", lambda p, bt: bert.mean_pool(
        self.apply(p, bt), bt["mask"], normalize=bool(norm)))
    return np.asarray(fn(params, jax.tree.map(jnp.asarray, b)))

  def eval_batches(self, split: str, batch_size: int):
    """Paragraphs of the built-in text, eval.seq_len tokens at most, right-padded."""
    paras = self.paragraphs()[base.check_split(split)][: self.cfg.eval.windows]
    for idx, weight in base.padded_rows(len(paras), batch_size):
      yield self.batch([paras[i] for i in idx], self.cfg.eval.seq_len, pad=True), weight

  def evaluate(self, params, split: str = "test", *, bleu: bool | None = None, hook=None,
               bleu_limit: int | None = None) -> dict:
    """No loss for an encoder without a head: reports the embeddings' spread instead
    (mean cosine similarity between different paragraphs of the split)."""
    del bleu, bleu_limit
    edits = base.hook_edits(hook)
    fn = base.jitted(self, "pooled", lambda p, b, e: self.pooled(p, b, base.edits_hook(e)))
    embs, cos = [], []
    for b, w in self.eval_batches(split, self.cfg.eval.batch_size):
      b = self.with_reference(b)
      e = np.asarray(fn(params, jax.tree.map(jnp.asarray, b), edits))
      embs.append(e[w > 0])
      if "reference" in b:        # a dense reference is set (pruning): compare with it
        r = np.asarray(b["reference"])[w > 0]
        cos.append((e[w > 0] * r).sum(-1) / np.maximum(np.linalg.norm(r, axis=-1), 1e-12))
    e = np.concatenate(embs)
    sim = e @ e.T
    n = len(e)
    off = (sim.sum() - np.trace(sim)) / max(n * (n - 1), 1)
    out = {"paragraphs": n, "mean_cosine_between_paragraphs": float(off)}
    if cos:
      out["cosine_to_full"] = float(np.concatenate(cos).mean())
      out["loss"] = 1.0 - out["cosine_to_full"]
    return out
