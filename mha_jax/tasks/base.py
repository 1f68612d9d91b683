"""The Task protocol and what every task shares: losses, accuracy, padded evaluation.

A task is data + model + loss + evaluation for one config. `mha_jax.load` hands one to
every study, which uses the protocol's members and nothing else: the capability
members (`trainable`, `decoder_only`, `reports_bleu`, `role_family`, ...) say what a
task can do, so a study asks the task instead of testing which task it holds.
"""

from __future__ import annotations

import dataclasses
from typing import Iterator, Protocol, runtime_checkable

import jax
import jax.numpy as jnp
import numpy as np

from mha_jax import interventions
from mha_jax.errors import UserError
from mha_jax.data import vocab as vocab_lib
from mha_jax.models import common as common_lib
from mha_jax.settings import setting

SPLITS = ("train", "valid", "test")


def check_split(split: str, what: str = "split") -> str:
  """`split` if it is one of SPLITS, else a UserError naming it."""
  if split not in SPLITS:
    raise UserError(f"{what} must be one of {', '.join(SPLITS)}; got {split!r}")
  return split


@dataclasses.dataclass(frozen=True, kw_only=True)
class EvalOptions:
  """The settings of `eval` (a task's `evaluate`)."""
  split: str = setting("test", choices=SPLITS, help="the data split (default: test)")



def gates_hook(task, gates, hook=None):
  """The hook that scales head outputs by `gates` {stack: [(H,) | (B, H) per layer]} on
  task's forward, before `hook`'s own edits: what a study passes as `hook=` to a task's
  apply, loss or evaluate. None without gates or hook."""
  return interventions.model_hook(hook, gates, stacks=task.stacks)


def hook_edits(hook) -> dict | None:
  """{site: [Edit]} of `hook` (an interventions.Hook that only edits), as an argument of a
  compiled evaluation, which applies them to every batch through `edits_hook`: how
  evaluate takes one hook for a whole split. None without a hook. A hook that reads
  sites, or whose edits compute their value from other sites, is refused: its reads
  would be one batch's, and a computed value is not an array to compile over."""
  if hook is None:
    return None
  if not isinstance(hook, interventions.Hook):
    raise UserError(f"hook must be an interventions.Hook; got {type(hook).__name__}",
                    setting="hook")
  if hook.read:
    raise UserError(f"hook: an evaluation applies the hook's edits to every batch and "
                    f"cannot read sites; got read={list(hook.read)} (read them with "
                    f"interventions.run_with_hook on a batch)", setting="hook")
  computed = sorted(n for n, es in hook.edits.items() if any(callable(e.value) for e in es))
  if computed:
    raise UserError(f"hook: an evaluation needs edits whose values are arrays; the edits "
                    f"of {computed} compute theirs from other sites", setting="hook")
  return {name: list(es) for name, es in hook.edits.items()}


def edits_hook(edits) -> interventions.Hook | None:
  """A fresh interventions.Hook of `edits` {site: [Edit]} (from `hook_edits`), built
  inside the compiled function that runs the forward; None without edits."""
  return interventions.Hook(edits) if edits else None


@runtime_checkable
class Task(Protocol):
  """What `mha_jax.load` hands to every study (analysis, ablation, pruning, circuits):
  the studies use these members and nothing else of a task. Batches are dicts of int32
  arrays ("src"/"tgt" for translation, "tokens" for an LM); every intervention (head
  gates, ablations, capture) is an interventions.Hook passed as `hook=`; metrics are
  sums to divide by metrics["tokens"]."""

  name: str              # the registry's key, the config's `task`
  vocab_size: int
  trainable: bool        # trained here; False: imported, params only from its checkpoint
  decoder_only: bool     # one causal stack "lm": LM head scores, circuits, induction
  reports_bleu: bool     # evaluate gives BLEU; words, arcs and vocab (TranslationData)
  role_family: str       # the role detectors that apply: translation, lm, real_lm, embedding
  compares_to_dense: bool  # the loss is a distance to the dense model's outputs: call
  #                          set_reference first; importance from importance_outputs
  packs: bool            # training batches can be packed (packed_train_batch)
  stacks: tuple          # the model's attention stacks, in forward order ("lm", ...)

  def apply(self, params, batch, *, key=None, hook=None):
    """Logits (B, T, V). hook: an interventions.Hook (named sites of the model's one
    forward); head gates are a use of it (`gates_hook`), and so is capture
    (`toolkit.capture.captured`). An LM's batch may hold "logits_at" (B,) or (B, n)
    int positions: logits only there, (B, 1, V) or (B, n, V)."""

  def loss(self, params, batch, *, key=None, hook=None, label_smoothing=0.0,
           example_weight=None):
    """(objective, metric sums) for one batch; hook: as apply's (head gates through
    `gates_hook`, ablations as its edits)."""

  def evaluate(self, params, split: str, *, bleu: bool | None = None, hook=None,
               bleu_limit: int | None = None) -> dict[str, float]:
    """Loss and accuracy (and BLEU where reports_bleu, unless bleu=False) over a split.
    hook: an interventions.Hook that only edits (`gates_hook`, ablations' edits), applied
    to every batch (and every decoding step) of the split (`hook_edits`)."""

  def train_batch(self, step: int, process_index: int = 0, process_count: int = 1
                  ) -> dict[str, np.ndarray]:
    """Training batch number `step` (deterministic)."""

  def eval_batches(self, split: str, batch_size: int
                   ) -> Iterator[tuple[dict[str, np.ndarray], np.ndarray]]:
    """(batch, example weights (B,)) over a split; padding rows have weight 0."""


@runtime_checkable
class TranslationData(Task, Protocol):
  """A translation task's extra members, used by the role analysis and the explorer."""

  vocab: vocab_lib.Vocab                                   # word vocabulary of the run
  words: dict[str, tuple[list[list[str]], list[list[str]]]]   # split -> (src, tgt) words
  arcs: dict[str, list[dict]]                      # split -> gold arcs (when known)

  def copy_baseline_bleu(self, split: str) -> float:
    """BLEU of the source sentence taken as its own translation."""


@runtime_checkable
class LMData(Task, Protocol):
  """A decoder-only task's extra members (trained here or imported)."""

  bos_id: int            # the model's BOS token id (runs trained here: 0), -1 if none
  adds_bos: bool         # its tokenizer puts bos_id before every prompt it encodes
  window: int            # the context window in tokens (config model.max_len)

  def repeated_eval_tokens(self, batch: int, seed_offset: int = 7_000_003):
    """(tokens (B, 1 + 2n), copy lengths (B,)): held-out [BOS] r r sequences over the
    task's own vocabulary, for induction scores and circuits."""

  def text_windows(self, split: str, batch: int):
    """(B, T + 1) windows of the task's own natural text, or None (trained on repeated
    random tokens): for Olsson et al.'s in-context learning score."""


@runtime_checkable
class PretrainedLMData(LMData, Protocol):
  """An imported language model's extra members, used by its studies."""

  tokenizer: object                                # the model's own tokenizer

  def repeated_tokens(self, seed: int, batch: int, half_len: int, min_half_len: int = 0):
    """(tokens (B, 1 + 2n), copy lengths (B,)): [BOS] r r, r over ordinary tokens."""

  def special_ids(self):
    """(n,) ids of the tokenizer's special (added) tokens."""

  def stream(self, split: str):
    """(N,) the built-in text of a split in the model's tokens."""

  def prefix_cache(self, params, tokens_BT, max_len: int):
    """The KV cache after tokens_BT (B, P) with room for max_len tokens: apply's
    batch["cache"] continues from it (prompts that share a prefix). A task with it also
    takes batch["start"], batch["stream"] in apply: resume at that layer from that
    residual stream (decoder.apply's; patching sweeps start each edit at its layer)."""


@runtime_checkable
class EmbeddingData(Task, Protocol):
  """An imported sentence encoder's extra members: a loss against the dense model's
  embeddings (set_reference), and outputs for Michel importance."""

  tokenizer: object

  def paragraphs(self) -> dict:
    """{split: paragraphs of the built-in text}."""

  def set_reference(self, params) -> None:
    """Dense params whose embeddings the loss compares against."""

  def importance_outputs(self, params, batch, hook=None):
    """(B, n) outputs whose gate gradients give Michel importance (the gates through
    `gates_hook`)."""


# ------------------------------------------------------------------ shared helpers

def jitted(task, name: str, fn):
  """`fn` jitted once per task and cached on it, so repeated evaluations, captures and
  gradient passes compile once per shape instead of once per call. Params, gates, edits
  and batches must be arguments of `fn`, never constants it closes over."""
  cache = task.__dict__.setdefault("_jit_cache", {})
  if name not in cache:
    cache[name] = jax.jit(fn)
  return cache[name]


def jitted_programs(task) -> dict:
  """{name: compiled function} of what `jitted` has cached on `task` so far (to look into
  one, e.g. its jaxpr)."""
  return dict(task.__dict__.get("_jit_cache", {}))


def sum_metrics(task, params, split, batch_size, hook=None) -> dict[str, float]:
  """Sums of the loss metrics over a split's evaluation batches (one compile per task),
  with `hook`'s edits (`hook_edits`) on every batch."""
  check_split(split)
  edits = hook_edits(hook)
  fn = jitted(task, "eval_metrics", lambda p, b, w, e: task.loss(
      p, b, example_weight=w, hook=edits_hook(e))[1])
  totals = None                      # summed on the device; one transfer at the end
  for batch, weight in task.eval_batches(split, batch_size):
    check_batch_ids(task, batch, f"{split} batch")
    m = fn(params, batch, jnp.asarray(weight), edits)
    totals = m if totals is None else jax.tree.map(jnp.add, totals, m)
  return {k: float(v) for k, v in jax.device_get(totals or {}).items()}


def per_token(totals: dict[str, float]) -> dict[str, float]:
  """Loss and accuracy per token from summed metrics, and loss_first / loss_repeat per
  token of each kind where the batches had them. A split without a token is an error."""
  if not totals.get("tokens"):
    raise UserError("the split has no target token to evaluate")
  out = {"loss": totals["loss"] / totals["tokens"]}
  if "accuracy" in totals:
    out["accuracy"] = totals["accuracy"] / totals["tokens"]
  for name in ("first", "repeat"):
    if totals.get(f"tokens_{name}"):
      out[f"loss_{name}"] = totals[f"loss_{name}"] / totals[f"tokens_{name}"]
  return out


def weighted_mean(x, w):
  """sum(x w) / sum(w), 0 when every weight is 0 (a batch of padding), never NaN."""
  return (x * w).sum() / jnp.maximum(w.sum(), 1.0)


def token_losses(logits_BTV, targets_BT, label_smoothing: float = 0.0):
  """Per-token (nll, objective, correct) from one float32 log-sum-exp over the vocabulary.

  The objective is the cross-entropy against labels smoothed as optax.smooth_labels does
  ((1 - e) one-hot + e / V), written as (1 - e) nll - e mean_v log p_v, so neither a
  one-hot nor a log-probability tensor is built. `correct` is 1 where the target is the
  row's argmax (the first maximum, as jnp.argmax: a tie counts for one token only); this
  is the one definition of accuracy of every task.
  """
  logits = logits_BTV.astype(jnp.float32)
  top = jnp.max(logits, axis=-1, keepdims=True)
  shifted = logits - jax.lax.stop_gradient(top)
  lse = jnp.log(jnp.sum(jnp.exp(shifted), axis=-1))
  target_shifted = jnp.take_along_axis(shifted, targets_BT[..., None], axis=-1)[..., 0]
  nll = lse - target_shifted
  obj = nll
  if label_smoothing:
    obj = (1.0 - label_smoothing) * nll - label_smoothing * (shifted.mean(-1) - lse)
  correct = (jnp.argmax(logits, axis=-1) == targets_BT).astype(jnp.float32)
  return nll, obj, correct


def token_metrics(nll, correct, w, batch) -> dict:
  """Metric sums of next-token prediction: loss, accuracy and tokens under weights w
  (B, T), and loss_/tokens_first and _repeat where the batch has those position masks
  (repeated tokens, data/repeated_tokens.py)."""
  metrics = {"loss": (nll * w).sum(), "accuracy": (correct * w).sum(), "tokens": w.sum()}
  for name in ("first", "repeat"):
    if f"mask_{name}" in batch:
      m = batch[f"mask_{name}"]
      metrics[f"loss_{name}"] = (nll * w * m).sum()
      metrics[f"tokens_{name}"] = (w * m).sum()
  return metrics


def padded_rows(n: int, batch_size: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
  """(row indices (batch_size,), weights (batch_size,)) covering rows 0..n-1 in order;
  the last batch is filled up with copies of row n-1 at weight 0, so every batch has
  one shape (one compile)."""
  if n < 1:
    raise UserError("nothing to evaluate: the split is empty")
  for start in range(0, n, batch_size):
    idx = np.arange(start, start + batch_size)
    yield np.minimum(idx, n - 1), (idx < n).astype(np.float32)


def epoch_indices(seed: int, n: int, start: int, count: int) -> np.ndarray:
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


def check_ids(ids, vocab_size: int, what: str) -> None:
  """Token ids within 0..vocab_size-1 (models/common.check_token_ids)."""
  common_lib.check_token_ids(ids, vocab_size, what)


def check_batch_ids(task, batch: dict, what: str = "batch") -> None:
  """Every token-id array of a batch within the task's vocabulary."""
  for key in ("tokens", "src", "tgt"):
    if key in batch:
      check_ids(batch[key], task.vocab_size, f"{what}[{key!r}]")


def model_spec(cfg) -> common_lib.ModelSpec:
  """The ModelSpec of a run trained here (translation: seq2seq; lm: lm)."""
  m = cfg.model
  return common_lib.ModelSpec(kind="seq2seq" if cfg.task == "translation" else "lm",
                     layer_norm=m.layer_norm, attn_only=m.attn_only, dropout=m.dropout,
                     impl=m.impl, pos=m.pos,
                     ln_position=m.get("ln_position", "pre"),
                     attention=m.get("attention", "softmax"))


def init_model(cfg, key, vocab_size: int) -> dict:
  """Fresh params of cfg.model: the one place a config becomes a model's init."""
  from mha_jax.models import lm as lm_model
  from mha_jax.models import seq2seq
  m = cfg.model
  common = dict(vocab_size=vocab_size, d_model=m.d_model, num_heads=m.num_heads,
                head_dim=m.head_dim, d_ff=m.d_ff, layer_norm=m.layer_norm,
                attn_only=m.attn_only, use_bias=m.use_bias,
                variant=m.get("attention", "softmax"))
  if cfg.task == "translation":
    return seq2seq.init(key, enc_layers=m.enc_layers, dec_layers=m.dec_layers,
                        ln_position=m.ln_position, pos=m.pos, max_rel=m.max_rel, **common)
  return lm_model.init(key, num_layers=m.num_layers, max_len=m.max_len, pos=m.pos,
                       max_rel=m.get("max_rel", 16), **common)
