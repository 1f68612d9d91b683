"""What the tasks of imported models share: the tokenizer, the gate-training batch size,
and the refusal to train or init them."""

from __future__ import annotations

from mha_jax import storage
from mha_jax.errors import UserError
from mha_jax.data.tokenizer_json import PretrainedTokenizer


def tokenizer_of(workdir, add_special_tokens: bool):
  """The model's own tokenizer from workdir/tokenizer.json (None without a workdir)."""
  if not workdir:
    return None
  path = storage.join(workdir, "tokenizer.json")
  if not storage.isfile(path):
    raise UserError(f"workdir {workdir!r} has no tokenizer.json", setting="workdir")
  return PretrainedTokenizer.load(path, add_special_tokens)


def gate_batch(cfg):
  """The batch head-gate training draws: config section "prune" ({batch_size, seq_len})
  when the workdir's config.json has one, else "eval"."""
  return cfg.prune if "prune" in cfg else cfg.eval


class Imported:
  """Capabilities every imported model shares; its weights are never trained here."""

  trainable = False
  reports_bleu = False
  packs = False

  def init_params(self, key):
    raise UserError(f"task {self.cfg.task!r} is an imported model: its params come from "
                    f"its checkpoint, not from init")
