"""A decoder LM of any family imported from GGUF or safetensors (`mha-jax import`).

`apply(params, {"tokens": ids_BT})` returns next-token logits for ids[:, :-1]
(B, T-1, V), exactly like runs trained here (the last token is only a target);
`logits(params, ids_BT)` gives all T positions; `generate` decodes greedily with the KV
cache; `evaluate` is perplexity on the built-in text (Python's bundled docs), tokenized
with the model's own tokenizer.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from mha_jax.data import repeated_tokens as rt
from mha_jax.data import text as text_data
from mha_jax.errors import UserError
from mha_jax.models import common
from mha_jax.models import decoder
from mha_jax.tasks import base
from mha_jax.settings import setting
from mha_jax.tasks.imported import Imported, gate_batch, tokenizer_of


@dataclasses.dataclass(frozen=True, kw_only=True)
class GenerateOptions:
  """The settings of `generate` (`PretrainedLMTask.generate`)."""
  prompt: str = setting(help="the text to continue")
  max_new_tokens: int = setting(16, lo=1, help="tokens to generate")
  chat: bool = setting(False, help="wrap the prompt in the chat template")


class PretrainedLMTask(Imported):
  """A decoder LM (any family of mha_jax.pretrained.adapters) imported from GGUF or
  safetensors; its forward is mha_jax.models.decoder's."""

  name = "pretrained_lm"
  stacks = ("lm",)
  decoder_only = True
  role_family = "real_lm"
  compares_to_dense = False

  def __init__(self, cfg, workdir: str | None):
    self.cfg = cfg
    m = cfg.model
    self.spec = decoder.spec_from_config(m, impl=m.impl)
    self.tokenizer = tokenizer_of(workdir, add_special_tokens=False)
    self.vocab_size = m.vocab_size
    self._streams = None

  @property
  def bos_id(self) -> int:
    """The tokenizer's BOS id (config tokenizer.bos_id), -1 where it has none."""
    return int(self.cfg.tokenizer.get("bos_id", -1))

  @property
  def adds_bos(self) -> bool:
    """Whether the tokenizer puts BOS before a prompt (config tokenizer.add_bos)."""
    return bool(self.cfg.tokenizer.get("add_bos", False)) and self.bos_id >= 0

  @property
  def window(self) -> int:
    """The context window in tokens (model.max_len)."""
    return int(self.cfg.model.max_len)

  # ---------------------------------------------------------------- model
  def apply(self, params, batch, *, key=None, hook=None):
    """Logits (B, T-1, V) predicting tokens[:, 1:] (like the LM task of runs trained here).
    batch["mask"] (B, T), if given, is True for real tokens (padding masked as keys);
    batch["logits_at"] (B,) or (B, n), if given: logits only there, (B, 1, V) or (B, n, V);
    batch["cache"], if given: a prefix_cache the tokens continue (positions after it).
    batch["start"], batch["stream"], if given: resume at that layer from that residual
    stream (decoder.apply's start and stream: a patching sweep's depth sharing).
    hook: an interventions.Hook."""
    del key
    common.check_token_ids(batch["tokens"], self.vocab_size, "batch['tokens']")
    mask = batch.get("mask")
    kw = dict(hook=hook, logits_at=batch.get("logits_at"), start=batch.get("start"),
              stream=batch.get("stream"))
    if "cache" in batch:       # the tokens continue a prefix_cache (shared prompt prefix)
      return decoder.apply(params, self.spec, batch["tokens"][:, :-1], cache=batch["cache"],
                           **kw)[0]
    return decoder.apply(params, self.spec, batch["tokens"][:, :-1],
                         mask_BT=None if mask is None else mask[:, :-1], **kw)

  def prefix_cache(self, params, tokens_BT, max_len: int):
    """The KV cache after tokens_BT (B, P), with room for max_len tokens in all: apply's
    batch["cache"] continues from it (prompts that share a prefix compute it once)."""
    # in the embeddings' dtype: a float32 cache would turn bfloat16 runs float32
    cache = decoder.init_cache(params, tokens_BT.shape[0], max_len, params["embed"].dtype)
    return decoder.apply(params, self.spec, tokens_BT, cache=cache, last_only=True)[1]

  def logits(self, params, tokens_BT, mask_BT=None):
    """Logits (B, T, V) for every position (the next token after each); compiled once
    per shape."""
    common.check_token_ids(tokens_BT, self.vocab_size, "tokens_BT")
    fn = base.jitted(self, "logits", lambda p, t, m: decoder.apply(p, self.spec, t,
                                                                   mask_BT=m))
    return fn(params, jnp.asarray(tokens_BT), None if mask_BT is None else
              jnp.asarray(mask_BT))

  def loss(self, params, batch, *, key=None, hook=None, label_smoothing=0.0,
           example_weight=None):
    del label_smoothing
    logits = self.apply(params, batch, key=key, hook=hook)
    nll, _, correct = base.token_losses(logits, batch["tokens"][:, 1:])
    w = jnp.ones_like(nll)
    if "mask" in batch:
      w = w * batch["mask"][:, 1:].astype(w.dtype)
    if example_weight is not None:
      w = w * example_weight[:, None]
    return base.weighted_mean(nll, w), base.token_metrics(nll, correct, w, batch)

  # ---------------------------------------------------------------- studies
  def train_batch(self, step: int, process_index: int = 0, process_count: int = 1) -> dict:
    """Batch `step` of random windows (batch_size x seq_len + 1 tokens; the config's
    "prune" section, else its "eval" one) of the built-in text's train split: what
    head-gate training (pruning) fits on; the model's own weights are never trained here."""
    del process_index, process_count
    e = gate_batch(self.cfg)
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
    ordinary = np.setdiff1d(np.arange(self.vocab_size), self.special_ids())
    idx, m = rt.repeated_tokens(seed, 0, batch, half_len, len(ordinary) + 1, min_half_len,
                                return_lengths=True)
    tokens = ordinary[np.maximum(idx - 1, 0)].astype(np.int32)  # 1..n -> ordinary ids
    bos = self.cfg.tokenizer.bos_id
    tokens[:, 0] = bos if bos >= 0 else ordinary[0]
    return tokens, m

  def repeated_eval_tokens(self, batch: int, seed_offset: int = 7_000_003):
    """Held-out repeated tokens over the model's own ordinary tokens (2 x 32 + BOS)."""
    return self.repeated_tokens(seed_offset, batch, 32)

  # ---------------------------------------------------------------- data
  def stream(self, split: str) -> np.ndarray:
    """The built-in text (Python's bundled docs) in the model's tokens, split 90/5/5."""
    base.check_split(split)
    if self._streams is None:
      if self.tokenizer is None:
        raise UserError("this task was built without a workdir: no tokenizer")
      corpus = text_data.read_corpus(list(self.cfg.data.text_files))
      ids = self.tokenizer.encode(corpus)
      common.check_token_ids(ids, self.vocab_size, "the workdir's tokenizer.json")
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

  def text_windows(self, split: str, batch: int):
    """The first `batch` evaluation windows of the built-in text (eval.seq_len + 1)."""
    return self.windows(split)[:batch]

  def eval_batches(self, split: str, batch_size: int):
    w = self.windows(split)
    for idx, weight in base.padded_rows(len(w), batch_size):
      yield {"tokens": w[idx]}, weight

  def evaluate(self, params, split: str = "test", *, bleu: bool | None = None, hook=None,
               bleu_limit: int | None = None) -> dict:
    """Loss, accuracy and perplexity on eval.windows windows of eval.seq_len + 1 tokens."""
    del bleu, bleu_limit
    t = base.sum_metrics(self, params, split, self.cfg.eval.batch_size, hook)
    out = base.per_token(t)
    return {**out, "perplexity": float(np.exp(out["loss"])), "tokens": int(t["tokens"]),
            "windows": len(self.windows(split)), "seq_len": int(self.cfg.eval.seq_len)}

  # ---------------------------------------------------------------- generation
  def chat_prompt(self, user: str) -> str:
    """The user turn the model was tuned on, ending where its reply starts: Gemma's
    <start_of_turn> format for the Gemma families, else ChatML (SmolLM2-Instruct's GGUF
    chat template, no system turn)."""
    if str(self.cfg.model.get("family", "")).startswith("gemma"):
      return f"<start_of_turn>user\n{user}<end_of_turn>\n<start_of_turn>model\n"
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
      raise UserError("prompt is empty: nothing to continue", setting="prompt")
    common.check_token_ids(ids, self.vocab_size, "the prompt (tokenizer.json)")
    context = int(self.cfg.model.get("max_len", 0) or 0)
    if context and len(ids) + max_new_tokens > context:
      raise UserError(f"the prompt's {len(ids)} tokens plus max_new_tokens "
                      f"{max_new_tokens} make {len(ids) + max_new_tokens}, more than the "
                      f"model's context of {context} tokens (model.max_len)",
                      setting="max_new_tokens")
    eos = [int(self.cfg.tokenizer.eos_id)] if stop_at_eos and self.cfg.tokenizer.eos_id >= 0 \
        else []
    new = decoder.generate(params, self.spec, ids[None], max_new_tokens,
                         eos_id=eos[0] if eos else None)[0]
    keep = list(new)
    if eos and eos[0] in keep:
      keep = keep[:keep.index(eos[0])]
    return {"text": self.tokenizer.decode(keep, skip_special_tokens=True),
            "tokens": [int(i) for i in new], "prompt_tokens": [int(i) for i in ids]}
