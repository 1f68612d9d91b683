"""The one loader: every analysis starts from a workdir through `mha_jax.load`."""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from typing import Any, Callable, Iterator, Sequence

import ml_collections

from mha_jax.errors import BadCheckpoint, UserError
from mha_jax import config as mc
from mha_jax import storage
from mha_jax import tasks
from mha_jax import traces
from mha_jax.models import common
from mha_jax.train import checkpoint as ckpt_lib
from mha_jax.train import seeds as seeds_lib


@dataclasses.dataclass
class Loaded:
  """What a workdir holds.

  config: the resolved, locked config of the run.
  task: the run's task, typed by `tasks.Task` (apply, loss, evaluate, train_batch,
    eval_batches, vocab_size, and the capability members the studies ask): what the
    studies may use of the model and its data.
  params: the params pytree at `step` (on one device, in their saved shapes).
  """
  config: ml_collections.ConfigDict
  task: tasks.Task
  params: Any
  step: int
  workdir: str

  @property
  def head_names(self) -> list[str]:
    return common.head_names(self.params)

  def run(self, prompts, capture: Sequence[str] = ("attn.pattern",), edits=None):
    """A `traces.Trace` of `prompts` (strings or token ids) with `capture`'s sites read
    ("attn.pattern", "lm.9.attn.z", ...) and `edits` ({site: interventions.Edit})
    applied: `tr["attn.pattern", 9]`, `tr.tokens`, `tr.logits` (see mha_jax.traces)."""
    return traces.run(self, prompts, capture, edits)

  def _repr_html_(self) -> str:
    from mha_jax import views
    return views.params_html(self.params, title=self.workdir).html

  def __iter__(self):  # config, task, params = mha_jax.load(workdir)
    return iter((self.config, self.task, self.params))


def load_config(workdir: str) -> ml_collections.ConfigDict:
  path = storage.join(workdir, "config.json")
  if not storage.exists(path):
    if seeds_lib.is_multi_seed(workdir):
      raise UserError(f"workdir {workdir!r} is a multi-seed run (seeds.json): load one "
                      f"of its seeds, {workdir.rstrip('/')}/seed_<s>", setting="workdir")
    raise UserError(f"workdir {workdir!r} has no config.json: not a mha-jax run", setting="workdir")
  try:
    return mc.from_dict(storage.read_json(path))
  except (json.JSONDecodeError, UnicodeDecodeError) as e:
    raise UserError(f"{path} is not valid JSON ({e})") from None


def source_of(name_or_path: str) -> tuple[str, str]:
  """("workdir", path), ("name", known model) or ("file", GGUF file or HF folder) of what
  `load` was given (a file or folder that exists goes first: a workdir named like a
  known model is that workdir); anything else is refused with the known names."""
  from mha_jax.pretrained import registry
  if not isinstance(name_or_path, str) or not name_or_path:
    raise UserError(f"name_or_path must be a known model name ({sorted(registry.KNOWN)}), "
                    f"a workdir, a GGUF file or a Hugging Face folder; got {name_or_path!r}",
                    setting="name_or_path")
  p = name_or_path
  if name_or_path in registry.KNOWN and not storage.exists(p):
    return "name", name_or_path
  if storage.isfile(p):
    return "file", p
  if storage.isdir(p):
    cfg = storage.join(p, "config.json")
    hf = storage.exists(cfg) and "task" not in _json_or_empty(cfg)
    return ("file", p) if hf else ("workdir", p)
  if os.sep in p or "/" in p:          # a path: load_workdir names what is missing
    return "workdir", p
  raise UserError(f"{p!r} is not a known model (known: {', '.join(sorted(registry.KNOWN))}) "
                  f"and no workdir, GGUF file or Hugging Face folder of that name exists",
                  setting="name_or_path")


def _json_or_empty(path: str) -> dict:
  try:
    d = storage.read_json(path)
  except (ValueError, UnicodeDecodeError):
    return {}
  return d if isinstance(d, dict) else {}


def load(name_or_path: str, step: int | None = None, *,
         log: Callable[[str], None] | None = None, cache: str | None = None) -> Loaded:
  """Config, model and params of a run: `name_or_path` is a workdir, a known model's name
  (`mha_jax.pretrained.KNOWN`: "smollm2-135m", ...), a GGUF file or a Hugging Face folder.
  A name, file or folder is imported once into the model cache (`cache`, default
  `pretrained.importer.cache_root()`) and that workdir loaded; later calls, and other
  processes, reuse it. A workdir gives its newest good checkpoint by default (bad newer
  ones are reported through `log` and skipped; see checkpoint.py). `log` (default: to
  stderr) also hears of an import. Never writes to a workdir."""
  kind, src = source_of(name_or_path)
  if kind == "workdir":
    return load_workdir(src, step, log=log or ckpt_lib.warn)
  from mha_jax.pretrained import importer
  workdir = importer.cached_import(**{kind: src}, root=cache, log=log or _say)
  return load_workdir(workdir, step, log=log or ckpt_lib.warn)


def _say(message: str) -> None:
  print(f"mha-jax: {message}", file=sys.stderr)


def load_workdir(workdir: str, step: int | None = None, *,
                 log: Callable[[str], None] = ckpt_lib.warn) -> Loaded:
  """`load` of a workdir."""
  cfg = load_config(workdir)
  ckpts = ckpt_lib.Checkpoints(workdir, read_only=True)
  try:
    steps = ckpts.all_steps()
    if not steps:
      raise UserError(f"workdir {workdir!r} has no trained checkpoint yet", setting="workdir")
    if step is not None and step not in steps:
      raise UserError(f"step {step} is not in {workdir!r}; saved steps: {steps}")
    params, step = ckpts.restore_params(step, log=log)
    ckpt_lib.check_model_config(ckpts.meta, mc.to_dict(cfg), ckpts.step_dir(step),
                                storage.join(workdir, "config.json"))
  finally:
    ckpts.close()
  loaded = Loaded(cfg, tasks.build(cfg, workdir, read_only=True), params, step, workdir)
  set_dense_reference(loaded)      # once, here: no study has to remember it
  return loaded


KINDS = {"translation": "a translation run (an encoder-decoder, task 'translation')",
         "embedding": "an imported encoder (task 'embedding': no decoder, no next-token "
                      "logits)",
         "lm": "a decoder LM trained here (task 'lm')",
         "pretrained_lm": "an imported decoder LM (task 'pretrained_lm', family {family!r})"}


def kind(workdir: str) -> str:
  """What kind of run `workdir` holds, in the words a verb's refusal uses (from its
  config.json, nothing loaded): "a translation run (an encoder-decoder, task
  'translation')", "an imported decoder LM (task 'pretrained_lm', family 'llama')", "a
  multi-seed run (seeds.json)"; ", pruned by export-pruned" for an export."""
  if seeds_lib.is_multi_seed(workdir):
    return "a multi-seed run (seeds.json)"
  cfg = load_config(workdir)
  m = cfg.get("model") or {}
  what = KINDS.get(cfg.get("task"), f"a run of task {cfg.get('task')!r}").format(
      family=m.get("family", "?"))
  if cfg.get("task") == "lm" and m.get("attn_only"):
    what = "an attention-only " + what[2:]
  pruning = storage.join(workdir, "pruning.json")
  if storage.exists(pruning) and "exported_from" in storage.read_json(pruning):
    what += ", pruned by export-pruned"
  return what


def refuse(verb: str, workdir: str, needs: str, *, name: str = "workdir"):
  """Raises the one-line refusal of `verb` on a kind of run it does not take: the verb,
  what it needs and the run's kind (`kind`); `name`: what the command line calls the
  folder (the input `workdir`, shown as --workdir, or a positional DIR)."""
  raise UserError(f"{verb} needs {needs}; {name} {workdir!r} is {kind(workdir)}",
                  setting=name if name == "workdir" else None)


def each_checkpoint(loaded: Loaded, steps: Sequence[int] | None = None, *,
                    log: Callable[[str], None] = ckpt_lib.warn) -> Iterator[Loaded]:
  """`loaded` at every saved checkpoint of its workdir, oldest first (only `steps`, each
  of which must be saved, when given): the one checkpoint walker of the studies. Only
  the params are restored; the task (and the functions compiled on it) is `loaded`'s,
  so no step recompiles. A bad checkpoint is reported through `log` and skipped.
  Never writes to the workdir."""
  c = ckpt_lib.Checkpoints(loaded.workdir, read_only=True)
  try:
    saved = c.all_steps()
    if steps is not None:
      bad = [s for s in steps if s not in saved]
      if bad:
        raise UserError(f"steps: {bad[0]} is not a saved step of {loaded.workdir!r}; "
                        f"saved steps: {saved}", setting="steps")
      saved = sorted(set(int(s) for s in steps))
    for step in saved:
      try:
        params, _ = c.restore_params(step)
      except BadCheckpoint as e:
        log(f"{e}; skipped")
        continue
      yield dataclasses.replace(loaded, params=params, step=step)
  finally:
    c.close()


def set_dense_reference(loaded) -> None:
  """Embedding models: the loss and the metrics compare with the dense model's
  embeddings (the source run of a pruned workdir, else these params). `load` calls it
  on every run it loads."""
  if not loaded.task.compares_to_dense:
    return
  path = storage.join(loaded.workdir, "pruning.json")
  params = loaded.params
  if storage.exists(path):
    src = storage.read_json(path).get("source")
    if src and storage.exists(storage.join(src, "config.json")):
      params = load(src).params
  loaded.task.set_reference(params)
