"""Tasks: data + model + loss + evaluation for one config, one module per task.

  base.py            the Task protocol (with the capability members the studies ask),
                     the shared loss, accuracy and padded-evaluation helpers, SPLITS
  translation.py     the encoder-decoder on the synthetic pair or parallel text
  trained_lm.py      the decoder-only model trained here, on repeated random tokens or text
  pretrained_lm.py   an imported LLaMA-family LM
  embedding.py       an imported BERT sentence encoder
  imported.py        what the imported models' tasks share (tokenizer, gate batches)

`build(cfg, workdir)` picks the task from REGISTRY by `cfg.task`.
"""

from __future__ import annotations

import copy

from mha_jax import storage
from mha_jax.errors import UserError
from mha_jax.tasks.base import (SPLITS, EmbeddingData, LMData, PretrainedLMData, Task,
                                TranslationData, check_batch_ids, check_ids, check_split,
                                edits_hook, epoch_indices, gates_hook, hook_edits, init_model, jitted,
                                jitted_programs, local_rows, model_spec, padded_rows,
                                per_token, sum_metrics, token_losses, token_metrics,
                                train_order_seed, weighted_mean)
from mha_jax.tasks.embedding import EmbeddingTask
from mha_jax.tasks.trained_lm import LMTask
from mha_jax.tasks.pretrained_lm import PretrainedLMTask
from mha_jax.tasks.translation import TranslationTask

# cfg.task -> the task class; imported models take no read_only (they never write).
REGISTRY = {"translation": TranslationTask, "lm": LMTask,
            "pretrained_lm": PretrainedLMTask, "embedding": EmbeddingTask}


def build(cfg, workdir: str | None = None, *, read_only: bool = False):
  """The task object for a config. read_only: never write into `workdir` (loading a run);
  otherwise the first build writes the run's data files (vocabulary, tokenizer)."""
  cls = REGISTRY.get(cfg.task)
  if cls is None:
    raise UserError(f"task must be one of {', '.join(REGISTRY)}; got {cfg.task!r}")
  if cls.trainable:
    return cls(cfg, workdir, read_only=read_only)
  return cls(cfg, workdir)


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


__all__ = ["SPLITS", "REGISTRY", "Task", "TranslationData", "LMData", "PretrainedLMData",
           "EmbeddingData", "TranslationTask", "LMTask", "PretrainedLMTask", "EmbeddingTask",
           "build", "build_seeds", "check_batch_ids", "check_ids", "check_split", "edits_hook",
           "epoch_indices", "gates_hook", "hook_edits", "init_model", "jitted", "jitted_programs", "local_rows", "model_spec", "padded_rows", "per_token",
           "sum_metrics", "token_losses", "token_metrics", "train_order_seed",
           "weighted_mean"]
