"""`loaded.run(prompts, capture=[...], edits={...})`: one forward of the model's own task
with the named sites of `mha_jax.interventions` read (and edited), as a Trace.

    tr = loaded.run(["When Mary and John went to the store, John gave a drink to"],
                    capture=["attn.pattern", "attn.z", "resid_post"])
    tr["attn.pattern", 9]        # (B, H, T, S): lm.9.attn.pattern
    tr.tokens[0]                 # the string of each position of prompt 0
    tr.logits                    # (B, T, V): the next token after each position

Prompts are strings (tokenised with the model's own tokenizer, its BOS first where it
adds one) or token ids (B, T). Shorter prompts are padded on the right and masked. The
forward is compiled once per (sites read, edited sites, shape) and cached on the task.
"""

from __future__ import annotations

import dataclasses
import fnmatch
from typing import Any, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from mha_jax import interventions
from mha_jax.errors import UserError
from mha_jax.tasks import base


def prompt_ids(task, text: str) -> list[int]:
  """The model's token ids of a prompt: its own tokenizer, its BOS first when the
  tokenizer adds one (an imported LM's `adds_bos`)."""
  tok = getattr(task, "tokenizer", None)
  if tok is None:
    raise UserError("prompts: this model has no tokenizer (a run on random tokens); pass "
                    "token ids (B, T) instead of strings", setting="prompts")
  bos = [int(task.bos_id)] if getattr(task, "adds_bos", False) else []
  return bos + [int(i) for i in tok.encode(text)]


def token_strings(task, ids) -> list[str]:
  """The string of each token id (the tokenizer's; the id itself without one)."""
  tok = getattr(task, "tokenizer", None)
  if tok is None:
    return [str(int(i)) for i in ids]
  return [tok.decode([int(i)]) or f"<{int(i)}>" for i in ids]


def token_batch(task, prompts) -> tuple[np.ndarray, np.ndarray]:
  """(ids (B, T) int32, lengths (B,)) of strings or of token ids (one row or B rows;
  a ragged list is padded on the right with 0)."""
  if isinstance(prompts, str):
    prompts = [prompts]
  if isinstance(prompts, (list, tuple)) and prompts and all(isinstance(p, str) for p in prompts):
    rows = [prompt_ids(task, p) for p in prompts]
  elif isinstance(prompts, (list, tuple)) and prompts and all(
      isinstance(p, (list, tuple, np.ndarray)) for p in prompts):
    rows = [[int(i) for i in p] for p in prompts]
  else:
    a = np.asarray(prompts)
    if a.ndim not in (1, 2) or a.size == 0 or not np.issubdtype(a.dtype, np.integer):
      raise UserError(f"prompts must be a string, a list of strings or token ids (T,) or "
                      f"(B, T); got {type(prompts).__name__} {getattr(a, 'shape', '')}",
                      setting="prompts")
    rows = [list(r) for r in np.atleast_2d(a)]
  lengths = np.asarray([len(r) for r in rows])
  if lengths.min() < 1:
    raise UserError("prompts: a prompt has no token", setting="prompts")
  ids = np.zeros((len(rows), int(lengths.max())), np.int32)
  for b, r in enumerate(rows):
    ids[b, :len(r)] = r
  return ids, lengths


def site_patterns(task, capture: Sequence[str]) -> tuple[str, ...]:
  """Full site names or fnmatch patterns: "attn.pattern" is `{stack}.*.attn.pattern` of
  each of the task's stacks; names that start with a stack are kept as they are."""
  if isinstance(capture, str):
    capture = [capture]
  out = []
  for c in capture:
    if not isinstance(c, str) or not c:
      raise UserError(f"capture: site names are strings such as 'attn.pattern' or "
                      f"'lm.9.attn.z'; got {c!r}", setting="capture")
    if c.split(".")[0] in task.stacks or c == "lm.ln_final.scale":
      out.append(c)
    else:
      out += [f"{s}.*.{c}" for s in task.stacks]
  return tuple(out)


@dataclasses.dataclass
class Trace:
  """One forward's record. ids (B, T) and lengths (B,): the prompts' tokens (row b's real
  tokens are ids[b, :lengths[b]]); tokens: the string of each real position per row;
  logits (B, T, V) (an encoder: its last hidden states (B, T, D)); values: {site name:
  array} of every site read; stacks: the model's stacks."""
  ids: np.ndarray
  lengths: np.ndarray
  tokens: list
  logits: np.ndarray
  values: dict
  stacks: tuple

  def name(self, key) -> str:
    """The full site name of `key`: a name, or (site, layer) such as ("attn.pattern", 9)."""
    if isinstance(key, tuple):
      if len(key) != 2:
        raise KeyError(f"a trace is indexed by a site name or (site, layer); got {key!r}")
      site, layer = key
      for s in self.stacks:
        if f"{s}.{int(layer)}.{site}" in self.values:
          return f"{s}.{int(layer)}.{site}"
      key = f"{self.stacks[0]}.{int(layer)}.{site}"
    if key not in self.values:
      raise KeyError(f"{key!r} was not captured; this trace holds {self.sites()[:6]}"
                     f"{' ...' if len(self.values) > 6 else ''} (run with capture=[...])")
    return key

  def __getitem__(self, key) -> np.ndarray:
    return self.values[self.name(key)]

  def __contains__(self, key) -> bool:
    try:
      self.name(key)
    except KeyError:
      return False
    return True

  def sites(self) -> list[str]:
    return list(self.values)

  def layers(self, site: str = "attn.pattern", stack: str | None = None) -> int:
    """How many layers of `stack` (the first) the trace holds `site` of."""
    stack = stack or self.stacks[0]
    return sum(1 for k in self.values if k.startswith(f"{stack}.") and k.endswith(f".{site}")
               and k.count(".") == site.count(".") + 2)

  def __repr__(self):
    b, t = self.ids.shape
    return f"Trace({b} prompts x {t} tokens, {len(self.values)} sites, logits {self.logits.shape})"

  def _repr_html_(self) -> str:
    from mha_jax import views
    return views.attention_html(views.trace_data(self)).html


def run(loaded, prompts, capture: Sequence[str] = ("attn.pattern",),
        edits: Mapping[str, Any] | None = None) -> Trace:
  """The Trace of `prompts` through `loaded`'s task with `edits` ({site: Edit or
  [Edit]}, interventions.replace / add / scale; values arrays) applied and `capture`'s
  sites read (see the module docstring)."""
  task = loaded.task
  if not (task.decoder_only or task.stacks == ("encoder",)):
    raise UserError(f"run needs a decoder-only LM or an encoder; task {task.name!r} has "
                    f"stacks {task.stacks}", setting="loaded")
  ids, lengths = token_batch(task, prompts)
  read = site_patterns(task, capture)
  hook_edits = base.hook_edits(interventions.Hook(edits)) or {}
  ragged = bool((lengths != ids.shape[1]).any())
  batch = {"tokens": ids}
  if ragged or not task.decoder_only:
    batch["mask"] = np.arange(ids.shape[1])[None, :] < lengths[:, None]
  if task.decoder_only:     # apply predicts tokens[:, 1:]: one more column, never read
    batch = {k: np.concatenate([v, v[:, -1:]], axis=1) for k, v in batch.items()}

  def forward(p, b, e):
    return interventions.run_with_hook(lambda hook: task.apply(p, b, hook=hook), e, read)
  fn = base.jitted(task, f"trace:{','.join(read)}", forward)
  logits, values = jax.device_get(fn(loaded.params, jax.tree.map(jnp.asarray, batch),
                                     hook_edits))
  unread = [r for r in read if not any(k == r or fnmatch.fnmatchcase(k, r) for k in values)]
  if unread:
    raise UserError(f"capture: {unread[0]!r} names no site of this model; its sites look "
                    f"like {interventions.site_names(loaded.params)[:12]}", setting="capture")
  tokens = [token_strings(task, ids[b, :n]) for b, n in enumerate(lengths)]
  return Trace(ids, lengths, tokens, np.asarray(logits), dict(values), tuple(task.stacks))
