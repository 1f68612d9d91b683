"""The typed task interface: the studies use only its members; token ids beyond the
vocabulary are refused where they enter."""

import os

import numpy as np
import pytest

import mha_jax
from mha_jax.errors import UserError
from builders import QUIET, ROOT

# On the worker that trains conftest's ind_run and parallel_run (setup.cfg: --dist loadgroup).
pytestmark = pytest.mark.xdist_group("trained_runs")


def _task_members(proto):
  return {n for c in proto.__mro__ if c.__module__.startswith("mha_jax.tasks")
          for n in list(vars(c)) + list(getattr(c, "__annotations__", {}))
          if not n.startswith("_")}


def test_studies_use_only_the_typed_task_interface(ind_run, parallel_run):
  import ast
  import glob
  from mha_jax import tasks
  allowed = (_task_members(tasks.TranslationData) | _task_members(tasks.PretrainedLMData)
             | _task_members(tasks.EmbeddingData))
  assert {"apply", "loss", "evaluate", "eval_batches", "train_batch", "vocab_size",
          "vocab", "words", "arcs", "trainable", "decoder_only", "reports_bleu",
          "role_family", "compares_to_dense", "repeated_eval_tokens"} <= allowed
  used = {}
  root = os.path.join(ROOT, "mha_jax")
  # The studies and the toolkit they share; the prompt pairs, the patching Study (from
  # patching/, never checked here) and the taxonomy's detectors still read the tokenizer's
  # config (task.cfg: its BOS id, the model's window).
  for path in sorted(p for d in ("toolkit", "analysis", "pruning", "circuits")
                     for p in glob.glob(os.path.join(root, d, "*.py"))
                     if os.path.basename(p) not in ("pairs.py", "activation_patching.py",
                                                    "detectors.py")):
    tree = ast.parse(open(path).read())
    task_names = {"task"} | {  # names bound to loaded.task (task = loaded.task, ...)
        t.id for node in ast.walk(tree) if isinstance(node, ast.Assign)
        for t, v in ([(node.targets[0], node.value)] if not isinstance(node.targets[0], ast.Tuple)
                     else zip(node.targets[0].elts, getattr(node.value, "elts", [])))
        if isinstance(t, ast.Name) and ast.unparse(v) in ("loaded.task",)}
    for node in ast.walk(tree):
      if isinstance(node, ast.Attribute):
        base = ast.unparse(node.value)
        if base in ("loaded.task",) or base in task_names:
          used.setdefault(node.attr, set()).add(os.path.basename(path))
  assert used and set(used) <= allowed, {k: v for k, v in used.items() if k not in allowed}
  assert isinstance(mha_jax.load(ind_run, **QUIET).task, tasks.LMData)
  assert isinstance(mha_jax.load(parallel_run[0]).task, tasks.TranslationData)
  assert mha_jax.Loaded.__annotations__["task"] in ("tasks.Task", tasks.Task)


def test_token_ids_beyond_the_vocabulary_are_refused_where_they_enter(ind_run):
  loaded = mha_jax.load(ind_run, **QUIET)
  v = loaded.task.vocab_size
  tokens = np.zeros((2, 9), np.int32)
  assert np.isfinite(np.asarray(loaded.task.apply(loaded.params, {"tokens": tokens}))).all()
  tokens[1, 3] = v + 5
  with pytest.raises(UserError, match=rf"token id {v + 5} is not in the vocabulary of {v} "
                                      rf"tokens \(ids 0..{v - 1}\)"):
    loaded.task.apply(loaded.params, {"tokens": tokens})
  tokens[1, 3] = -1
  with pytest.raises(UserError, match=r"token id -1 is negative"):
    loaded.task.loss(loaded.params, {"tokens": tokens})
