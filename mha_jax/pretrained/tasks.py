"""Tasks of imported models, what `mha_jax.load(workdir)` hands to every study.

`pretrained_lm` (LLaMA family): `apply(params, {"tokens": ids_BT})` returns next-token
  logits for ids[:, :-1] (B, T-1, V), exactly like runs trained here (the last token is
  only a target); `logits(params, ids_BT)` gives all T positions; `generate` decodes
  greedily with the KV cache; `evaluate` is perplexity on the built-in text (Python's
  bundled docs), tokenized with the model's own tokenizer.
`embedding` (BERT): `apply(params, {"tokens", "mask", "token_types"})` returns the last
  hidden states (B, T, D); `embed(params, texts)` the mean-pooled sentence embeddings.
"""

from __future__ import annotations


import jax
import jax.numpy as jnp
import numpy as np
import optax

from mha_jax.errors import UserError
from mha_jax import storage
from mha_jax.data import text as text_data
from mha_jax.models import bert, decoder
from mha_jax.models import common as C
from mha_jax.pretrained.tokenizer import PretrainedTokenizer

SPLITS = ("train", "valid", "test")


def _tokenizer(workdir, add_special_tokens: bool):
  if not workdir:
    return None
  path = storage.join(workdir, "tokenizer.json")
  if not storage.isfile(path):
    raise UserError(f"--workdir {workdir!r} has no tokenizer.json")
  return PretrainedTokenizer.load(path, add_special_tokens)


def _gate_batch(cfg):
  """The batch head-gate training draws: config section "prune" ({batch_size, seq_len})
  when the workdir's config.json has one, else "eval"."""
  return cfg.prune if "prune" in cfg else cfg.eval


class _NotTrainable:
  def train_batch(self, *args, **kwargs):
    raise UserError(f"task {self.cfg.task!r} is an imported model; it is not trained here")

  def init_params(self, key):
    raise UserError(f"task {self.cfg.task!r} is an imported model: its params come from "
                     f"its checkpoint, not from init")


class PretrainedLMTask(_NotTrainable):
  """A decoder LM (any family of mha_jax.pretrained.adapters) imported from GGUF or
  safetensors; its forward is mha_jax.models.decoder's."""

  def __init__(self, cfg, workdir: str | None):
    self.cfg = cfg
    m = cfg.model
    self.spec = decoder.spec_from_config(m, impl=m.impl)
    self.tokenizer = _tokenizer(workdir, add_special_tokens=False)
    self.vocab_size = m.vocab_size
    self._streams = None

  # ---------------------------------------------------------------- model
  def apply(self, params, batch, *, gates=None, capture=False, key=None, hook=None):
    """Logits (B, T-1, V) predicting tokens[:, 1:] (like the LM task of runs trained here).
    batch["mask"] (B, T), if given, is True for real tokens (padding masked as keys);
    batch["logits_at"] (B,), if given: logits only at those positions, (B, 1, V).
    hook: an interventions.Hook."""
    del key
    C.check_token_ids(batch["tokens"], self.vocab_size, "batch['tokens']")
    mask = batch.get("mask")
    return decoder.apply(params, self.spec, batch["tokens"][:, :-1],
                       mask_BT=None if mask is None else mask[:, :-1], gates=gates,
                       capture=capture, hook=hook, logits_at=batch.get("logits_at"))

  def logits(self, params, tokens_BT, mask_BT=None, gates=None):
    """Logits (B, T, V) for every position (the next token after each); compiled once
    per shape."""
    from mha_jax.tasks import jitted
    C.check_token_ids(tokens_BT, self.vocab_size, "tokens_BT")
    fn = jitted(self, "logits", lambda p, t, m, g: decoder.apply(p, self.spec, t, mask_BT=m,
                                                               gates=g))
    return fn(params, jnp.asarray(tokens_BT), None if mask_BT is None else
              jnp.asarray(mask_BT), gates)

  def loss(self, params, batch, *, key=None, gates=None, label_smoothing=0.0,
           example_weight=None):
    del label_smoothing
    logits = self.apply(params, batch, gates=gates, key=key).astype(jnp.float32)
    targets = batch["tokens"][:, 1:]
    nll = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
    w = jnp.ones_like(nll)
    if "mask" in batch:
      w = w * batch["mask"][:, 1:].astype(w.dtype)
    if example_weight is not None:
      w = w * example_weight[:, None]
    metrics = {"loss": (nll * w).sum(), "accuracy": ((logits.argmax(-1) == targets) * w).sum(),
               "tokens": w.sum()}
    for name in ("first", "repeat"):      # repeated-token batches (see repeated_tokens)
      if f"mask_{name}" in batch:
        m = batch[f"mask_{name}"]
        metrics[f"loss_{name}"] = (nll * w * m).sum()
        metrics[f"tokens_{name}"] = (w * m).sum()
    return (nll * w).sum() / jnp.maximum(w.sum(), 1.0), metrics

  # ---------------------------------------------------------------- studies
  def train_batch(self, step: int, process_index: int = 0, process_count: int = 1) -> dict:
    """Batch `step` of random windows (batch_size x seq_len + 1 tokens; the config's
    "prune" section, else its "eval" one) of the built-in text's train split: what
    head-gate training (pruning) fits on; the model's own weights are never trained here."""
    del process_index, process_count
    e = _gate_batch(self.cfg)
    s = self.stream("train")
    rng = np.random.default_rng([int(self.cfg.get("seed", 0)), 17, step])
    starts = rng.integers(0, len(s) - e.seq_len - 1, size=e.batch_size)
    return {"tokens": np.stack([s[a:a + e.seq_len + 1] for a in starts]).astype(np.int32)}

  def special_ids(self) -> np.ndarray:
    """Ids of the tokenizer's special (added) tokens."""
    if self.tokenizer is None:
      return np.asarray([self.cfg.tokenizer.bos_id, self.cfg.tokenizer.eos_id])
    return np.asarray(sorted(self.tokenizer.tok.get_added_tokens_decoder()), np.int64)

  def repeated_tokens(self, seed: int, batch: int, half_len: int, min_half_len: int = 0):
    """(tokens (B, 1 + 2n), copy lengths m (B,)): [BOS] r_1..r_m r_1..r_m [fresh tail], the
    random tokens uniform over the vocabulary's ordinary (non-special) tokens, BOS the
    model's own (as data.repeated_tokens, over this tokenizer)."""
    from mha_jax.data import repeated_tokens as rt
    ordinary = np.setdiff1d(np.arange(self.vocab_size), self.special_ids())
    idx, m = rt.repeated_tokens(seed, 0, batch, half_len, len(ordinary) + 1, min_half_len,
                                return_lengths=True)
    tokens = ordinary[np.maximum(idx - 1, 0)].astype(np.int32)  # 1..n -> ordinary ids
    bos = self.cfg.tokenizer.bos_id
    tokens[:, 0] = bos if bos >= 0 else ordinary[0]
    return tokens, m

  # ---------------------------------------------------------------- data
  def stream(self, split: str) -> np.ndarray:
    """The built-in text (Python's bundled docs) in the model's tokens, split 90/5/5."""
    if split not in SPLITS:
      raise UserError(f"split must be one of {SPLITS}; got {split!r}")
    if self._streams is None:
      if self.tokenizer is None:
        raise UserError("this task was built without a workdir: no tokenizer")
      corpus = text_data.read_corpus(list(self.cfg.data.text_files))
      ids = self.tokenizer.encode(corpus)
      C.check_token_ids(ids, self.vocab_size, "the workdir's tokenizer.json")
      self._streams = text_data.split_stream(ids)
    return self._streams[split]

  def windows(self, split: str) -> np.ndarray:
    """(N, seq_len + 1) consecutive windows; the N * seq_len targets do not overlap."""
    e = self.cfg.eval
    s = self.stream(split)
    n = min(e.windows, (len(s) - 1) // e.seq_len)
    if n < 1:
      raise UserError(f"the {split} split has {len(s)} tokens, fewer than eval.seq_len + 1 = "
                       f"{e.seq_len + 1}")
    return np.stack([s[i * e.seq_len: i * e.seq_len + e.seq_len + 1] for i in range(n)])

  def eval_batches(self, split: str, batch_size: int):
    w = self.windows(split)
    for start in range(0, len(w), batch_size):
      idx = np.arange(start, start + batch_size)
      weight = (idx < len(w)).astype(np.float32)
      yield {"tokens": w[np.minimum(idx, len(w) - 1)]}, weight

  def evaluate(self, params, split: str = "test", *, bleu: bool = False, gates=None,
               bleu_limit: int | None = None) -> dict:
    """Loss, accuracy and perplexity on eval.windows windows of eval.seq_len + 1 tokens."""
    del bleu, bleu_limit
    from mha_jax.tasks import _sum_metrics
    t = _sum_metrics(self, params, split, self.cfg.eval.batch_size, gates)
    loss = t["loss"] / t["tokens"]
    return {"loss": loss, "accuracy": t["accuracy"] / t["tokens"],
            "perplexity": float(np.exp(loss)), "tokens": int(t["tokens"]),
            "windows": len(self.windows(split)), "seq_len": int(self.cfg.eval.seq_len)}

  # ---------------------------------------------------------------- generation
  def chat_prompt(self, user: str) -> str:
    """The ChatML turn SmolLM2-Instruct was tuned on (its GGUF chat template, no system
    turn), ending where the assistant's reply starts."""
    return f"<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n"

  def generate(self, params, prompt: str, max_new_tokens: int = 16, *, chat: bool = False,
               stop_at_eos: bool = True) -> dict:
    """Greedy continuation of `prompt` with the KV cache: {"text", "tokens", "prompt_tokens"}."""
    if self.tokenizer is None:
      raise UserError("this task was built without a workdir: no tokenizer")
    text = self.chat_prompt(prompt) if chat else prompt
    ids = self.tokenizer.encode(text)
    if self.cfg.tokenizer.add_bos and self.cfg.tokenizer.bos_id >= 0:
      ids = np.concatenate([[self.cfg.tokenizer.bos_id], ids]).astype(np.int32)
    if len(ids) == 0:
      raise UserError("--prompt is empty: nothing to continue")
    C.check_token_ids(ids, self.vocab_size, "the prompt (tokenizer.json)")
    context = int(self.cfg.model.get("max_len", 0) or 0)
    if context and len(ids) + max_new_tokens > context:
      raise UserError(f"the prompt's {len(ids)} tokens plus --max-new-tokens "
                      f"{max_new_tokens} make {len(ids) + max_new_tokens}, more than the "
                      f"model's context of {context} tokens (model.max_len)")
    eos = [int(self.cfg.tokenizer.eos_id)] if stop_at_eos and self.cfg.tokenizer.eos_id >= 0 \
        else []
    new = decoder.generate(params, self.spec, ids[None], max_new_tokens,
                         eos_id=eos[0] if eos else None)[0]
    keep = list(new)
    if eos and eos[0] in keep:
      keep = keep[:keep.index(eos[0])]
    return {"text": self.tokenizer.decode(keep, skip_special_tokens=True),
            "tokens": [int(i) for i in new], "prompt_tokens": [int(i) for i in ids]}


class EmbeddingTask(_NotTrainable):
  """A BERT encoder imported from safetensors (sentence embeddings by mean pooling)."""

  def __init__(self, cfg, workdir: str | None):
    self.cfg = cfg
    self.spec = bert.BertSpec(norm_eps=cfg.model.norm_eps, impl=cfg.model.impl)
    self.tokenizer = _tokenizer(workdir, add_special_tokens=True)
    self.vocab_size = cfg.model.vocab_size
    self._paragraphs = None

  def apply(self, params, batch, *, gates=None, capture=False, key=None, hook=None):
    """Last hidden states (B, T, D) of batch["tokens"]; batch["mask"] (True = real token)
    and batch["token_types"] are optional. hook: an interventions.Hook."""
    del key
    C.check_token_ids(batch["tokens"], self.vocab_size, "batch['tokens']")
    return bert.apply(params, self.spec, batch["tokens"], mask_BT=batch.get("mask"),
                      token_types_BT=batch.get("token_types"), gates=gates, capture=capture,
                      hook=hook)

  # ---------------------------------------------------------------- studies
  def pooled(self, params, batch, gates=None):
    """Mean-pooled, L2-normalised sentence embeddings (B, D) of a batch (traceable)."""
    return bert.mean_pool(self.apply(params, batch, gates=gates), batch["mask"],
                          normalize=True)

  def loss(self, params, batch, *, key=None, gates=None, label_smoothing=0.0,
           example_weight=None):
    """A loss without a task head: the cosine distance 1 - cos(e, e_ref) between the
    (gated) model's sentence embedding and the reference: batch["reference"] (the dense
    model's embeddings, see with_reference) or else the same params without gates."""
    del key, label_smoothing
    e = self.pooled(params, batch, gates)
    ref = batch["reference"] if "reference" in batch else jax.lax.stop_gradient(
        self.pooled(params, batch))
    ref = ref / jnp.maximum(jnp.linalg.norm(ref, axis=-1, keepdims=True), 1e-12)
    dist = 1.0 - (e * ref).sum(-1)                                  # (B,)
    w = jnp.ones_like(dist) if example_weight is None else example_weight
    metrics = {"loss": (dist * w).sum(), "tokens": w.sum()}
    return (dist * w).sum() / jnp.maximum(w.sum(), 1.0), metrics

  def importance_outputs(self, params, batch, gates=None):
    """(B, 8) projections of the embedding on 8 fixed random unit directions. The cosine
    loss is flat at the dense model (its gate gradients are 0 there), so Michel et al.'s
    importance E|dL/dxi_h| is taken over these instead: E_x sum_k |r_k . de/dxi_h|, which
    is proportional to the embedding's sensitivity |de/dxi_h| for isotropic r_k."""
    e = self.pooled(params, batch, gates)
    r = jax.random.normal(jax.random.PRNGKey(0), (8, e.shape[-1]), e.dtype)
    return e @ (r / jnp.linalg.norm(r, axis=-1, keepdims=True)).T

  def set_reference(self, params) -> None:
    """Dense params whose embeddings the loss compares against (added to every batch)."""
    self._reference = params
    self._reference_cache = {}

  def with_reference(self, batch: dict) -> dict:
    ref = getattr(self, "_reference", None)
    if ref is None:
      return batch
    from mha_jax.tasks import jitted
    key = hash(np.asarray(batch["tokens"]).tobytes())   # the same batches recur: cache
    cache = self.__dict__.setdefault("_reference_cache", {})
    if key not in cache:
      fn = jitted(self, "pooled", self.pooled)
      cache[key] = fn(ref, {k: jnp.asarray(v) for k, v in batch.items()}, None)
    return dict(batch, reference=cache[key])

  def train_batch(self, step: int, process_index: int = 0, process_count: int = 1) -> dict:
    """Batch `step`: batch_size random paragraphs (<= seq_len wordpieces; the config's
    "prune" section, else "eval") of the built-in text's train split (for head-gate
    training; the model's weights are never trained here)."""
    del process_index, process_count
    e = _gate_batch(self.cfg)
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
      C.check_token_ids(i, self.vocab_size, "the workdir's tokenizer.json")
    if max_len:
      ids = [i[:max_len] for i in ids]
    t = max_len if pad and max_len else max(len(i) for i in ids)
    tokens = np.full((len(ids), t), self.cfg.tokenizer.pad_id, np.int32)
    mask = np.zeros((len(ids), t), bool)
    for r, i in enumerate(ids):
      tokens[r, :len(i)] = i
      mask[r, :len(i)] = True
    return {"tokens": tokens, "mask": mask, "token_types": np.zeros_like(tokens)}

  def embed(self, params, texts, *, normalize: bool | None = None, gates=None) -> np.ndarray:
    """Sentence embeddings (N, D): mask-aware mean of the last hidden states, L2-normalised
    when the model's sentence-transformers pipeline does (default) or normalize=True."""
    from mha_jax.tasks import jitted
    b = self.batch(texts)
    norm = self.cfg.tokenizer.get("normalize", False) if normalize is None else normalize
    fn = jitted(self, f"embed_{bool(norm)}", lambda p, bt, g: bert.mean_pool(
        self.apply(p, bt, gates=g), bt["mask"], normalize=bool(norm)))
    return np.asarray(fn(params, jax.tree.map(jnp.asarray, b), gates))

  def eval_batches(self, split: str, batch_size: int):
    """Paragraphs of the built-in text, eval.seq_len tokens at most, right-padded."""
    if split not in SPLITS:
      raise UserError(f"split must be one of {SPLITS}; got {split!r}")
    paras = self.paragraphs()[split][: self.cfg.eval.windows]
    for start in range(0, len(paras), batch_size):
      chunk = paras[start:start + batch_size]
      weight = np.zeros(batch_size, np.float32)
      weight[:len(chunk)] = 1.0
      chunk = chunk + [chunk[-1]] * (batch_size - len(chunk))
      yield self.batch(chunk, self.cfg.eval.seq_len, pad=True), weight

  def evaluate(self, params, split: str = "test", *, bleu: bool = False, gates=None,
               bleu_limit: int | None = None) -> dict:
    """No loss for an encoder without a head: reports the embeddings' spread instead
    (mean cosine similarity between different paragraphs of the split)."""
    del bleu, bleu_limit
    from mha_jax.tasks import jitted
    fn = jitted(self, "pooled", self.pooled)
    embs, cos = [], []
    for b, w in self.eval_batches(split, self.cfg.eval.batch_size):
      b = self.with_reference(b)
      e = np.asarray(fn(params, jax.tree.map(jnp.asarray, b), gates))
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


def build(cfg, workdir: str | None):
  if cfg.task == "pretrained_lm":
    return PretrainedLMTask(cfg, workdir)
  if cfg.task == "embedding":
    return EmbeddingTask(cfg, workdir)
  raise UserError(f"task {cfg.task!r} is not an imported-model task")
