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
          "role_family", "compares_to_dense", "repeated_eval_tokens", "bos_id", "adds_bos",
          "window"} <= allowed
  used = {}
  root = os.path.join(ROOT, "mha_jax")
  # The studies and the toolkit they share, every module of them.
  for path in sorted(p for d in ("toolkit", "analysis", "pruning", "circuits", "patching")
                     for p in glob.glob(os.path.join(root, d, "*.py"))):
    tree = ast.parse(open(path).read())
    task_names = {"task"} | {  # names bound to loaded.task (task = loaded.task, ...)
        t.id for node in ast.walk(tree) if isinstance(node, ast.Assign)
        for t, v in ([(node.targets[0], node.value)] if not isinstance(node.targets[0], ast.Tuple)
                     else zip(node.targets[0].elts, getattr(node.value, "elts", [])))
        if isinstance(t, ast.Name) and ast.unparse(v) in ("loaded.task",)}
    for node in ast.walk(tree):
      if isinstance(node, ast.Attribute):
        base = ast.unparse(node.value)
        if base in ("loaded.task", "self.task") or base in task_names:
          used.setdefault(node.attr, set()).add(os.path.basename(path))
      if (isinstance(node, ast.Call) and ast.unparse(node.func) in ("hasattr", "getattr")
          and ast.unparse(node.args[0]) in task_names | {"loaded.task", "self.task"}
          and isinstance(node.args[1], ast.Constant)):      # hasattr(task, "member")
        used.setdefault(node.args[1].value, set()).add(os.path.basename(path))
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


def test_the_bos_and_the_window_come_from_the_typed_interface(ind_run):
  import ml_collections
  from mha_jax import tasks
  from mha_jax.roles import detectors
  from mha_jax.toolkit import pairs
  loaded = mha_jax.load(ind_run, **QUIET)
  trained = loaded.task                          # runs trained here: BOS id 0, never added
  assert (trained.bos_id, trained.adds_bos, trained.window) == (
      0, False, loaded.config.model.max_len)
  assert detectors.bos_of(trained) == [0] and detectors.window_of(trained) == trained.window
  assert (pairs.induction_pairs(trained, n=2, half_len=3).clean[:, 0] == 0).all()

  class Chars:
    def encode(self, text):
      return [ord(c) for c in text]

  imported = tasks.PretrainedLMTask.__new__(tasks.PretrainedLMTask)   # no checkpoint needed
  imported.cfg = ml_collections.ConfigDict({"tokenizer": {"bos_id": 2, "add_bos": True},
                                            "model": {"max_len": 512}})
  imported.tokenizer, imported.vocab_size = Chars(), 300
  imported.special_ids = lambda: np.asarray([2, 3])
  assert (imported.bos_id, imported.adds_bos, imported.window) == (2, True, 512)
  assert pairs.encode(imported, "ab") == [2, 97, 98] and detectors.bos_of(imported) == [2]
  assert (pairs.induction_pairs(imported, n=2, half_len=3).clean[:, 0] == 2).all()
  imported.cfg.tokenizer.add_bos = False         # a BOS the tokenizer does not add
  assert pairs.encode(imported, "ab") == [97, 98] and detectors.bos_of(imported) == [2]
  imported.cfg.tokenizer.bos_id = -1             # no BOS: the first ordinary token leads
  assert detectors.bos_of(imported) == [] and not imported.adds_bos
  assert (pairs.induction_pairs(imported, n=2, half_len=3).clean[:, 0] == 1).all()
  with pytest.raises(UserError, match=r"haystack of 600 tokens is longer than this "
                                      r"model's window \(512 tokens\)"):
    detectors.check_window(imported, 600)
