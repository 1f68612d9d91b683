"""mha_jax/tasks/: the registry, the shared metrics, loading from the workdir, and the
review defects that lived in the tasks and the studies that ask them."""

import inspect
import os

import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

import mha_jax
from oracles import assert_f32_close
from mha_jax import interventions, tasks
from mha_jax.errors import UserError
from mha_jax.models import common
from mha_jax.tasks import base, embedding
from mha_jax.train import loop
from builders import TINY_TRANSLATION, tiny

# On the worker that trains conftest's ind_run for the CLI tests (one training, not two).
pytestmark = pytest.mark.xdist_group("trained_runs")

QUIET = dict(log=lambda s: None)


def test_build_names_every_task_of_the_registry():
  cfg = ml_collections.ConfigDict({"task": "bogus"})
  with pytest.raises(UserError) as e:
    tasks.build(cfg)
  for name in ("translation", "lm", "pretrained_lm", "embedding"):
    assert name in str(e.value)
  assert set(tasks.REGISTRY) == {"translation", "lm", "pretrained_lm", "embedding"}
  for name, cls in tasks.REGISTRY.items():   # every task says what it can do
    assert cls.name == name
    for member in ("trainable", "decoder_only", "reports_bleu", "role_family",
                   "compares_to_dense", "packs"):
      assert hasattr(cls, member), (name, member)


def test_accuracy_has_one_definition_the_argmax():
  logits = jnp.array([[[2.0, 2.0, 0.0], [0.0, 1.0, 3.0]]])   # a tie in the first row
  nll, obj, correct = base.token_losses(logits, jnp.array([[1, 2]]))
  np.testing.assert_array_equal(correct, [[0.0, 1.0]])       # the tie goes to token 0
  _, _, correct0 = base.token_losses(logits, jnp.array([[0, 2]]))
  np.testing.assert_array_equal(correct0, [[1.0, 1.0]])
  want = -np.log(np.exp(3.0) / np.exp([0.0, 1.0, 3.0]).sum())
  assert_f32_close(nll[0, 1], want)
  for cls in (tasks.TranslationTask, tasks.LMTask, tasks.PretrainedLMTask):
    src = inspect.getsource(cls.loss)
    assert "token_losses" in src and "argmax" not in src, cls


def test_lm_objective_with_zero_weights_is_zero_not_nan(ind_run):
  loaded = mha_jax.load(ind_run, **QUIET)
  batch, _ = next(loaded.task.eval_batches("valid", 4))
  batch = {k: jnp.asarray(v) for k, v in batch.items()}
  obj, metrics = loaded.task.loss(loaded.params, batch, example_weight=jnp.zeros(4))
  assert float(obj) == 0.0 and float(metrics["tokens"]) == 0.0
  obj1, _ = loaded.task.loss(loaded.params, batch, example_weight=jnp.ones(4))
  assert np.isfinite(float(obj1)) and float(obj1) > 0


def test_loss_and_evaluate_take_every_intervention_as_a_hook(ind_run):
  loaded = mha_jax.load(ind_run, **QUIET)
  task, params = loaded.task, loaded.params
  gates = common.ones_head_gates(params)
  gates["lm"][0] = gates["lm"][0].at[0].set(0.0)
  by_gates = task.evaluate(params, "valid", hook=tasks.gates_hook(task, gates))
  by_edit = task.evaluate(params, "valid", hook=interventions.Hook(
      {"lm.0.attn.z": interventions.scale(0.0, heads=0)}))
  assert_f32_close(by_gates["loss"], by_edit["loss"])     # two programs
  assert abs(by_gates["loss"] - task.evaluate(params, "valid")["loss"]) > 1e-4
  batch = {k: jnp.asarray(v) for k, v in next(task.eval_batches("valid", 4))[0].items()}
  assert "gates" not in inspect.signature(task.loss).parameters
  with pytest.raises(UserError, match=r"hook: an evaluation .* cannot read sites; got "
                                      r"read=\['lm.0.attn.z'\]"):
    task.evaluate(params, "valid", hook=interventions.Hook(read=["lm.0.attn.z"]))
  with pytest.raises(UserError, match=r"the edits of \['lm.1.attn.z'\] compute theirs"):
    task.evaluate(params, "valid", hook=interventions.Hook(
        {"lm.1.attn.z": interventions.replace(lambda values: 0.0)}))
  with pytest.raises(ValueError, match=r"gates: keys must be stacks of this model "
                                       r"\['lm'\]; got \['edits'\]"):
    task.loss(params, batch, hook=tasks.gates_hook(task, {**gates, "edits": {}}))


def test_padded_rows_cover_each_row_once_and_refuse_an_empty_split():
  rows = list(base.padded_rows(5, 2))
  assert [len(i) for i, _ in rows] == [2, 2, 2]
  np.testing.assert_array_equal(np.concatenate([i[w > 0] for i, w in rows]), np.arange(5))
  with pytest.raises(UserError, match="empty"):
    list(base.padded_rows(0, 2))
  with pytest.raises(UserError, match="split must be one of train, valid, test; got 'dev'"):
    base.check_split("dev")


def test_reference_embedding_cache_is_bounded(monkeypatch):
  monkeypatch.setattr(embedding, "REFERENCE_CACHE_SIZE", 4)
  task = embedding.EmbeddingTask.__new__(embedding.EmbeddingTask)
  task.pooled = lambda p, b, g: b["tokens"].sum(-1, keepdims=True) * p["w"]
  task.set_reference({"w": jnp.ones(1)})
  batches = [{"tokens": np.full((2, 3), i, np.int32)} for i in range(10)]
  refs = [task.with_reference(b)["reference"] for b in batches]
  for b, r in zip(batches, refs):
    np.testing.assert_allclose(r, [[3.0 * b["tokens"][0, 0]]] * 2)
  for i in (9, 8, 7, 6):           # the 4 latest batches: served from the cache
    assert task.with_reference(batches[i])["reference"] is refs[i], i
  again = task.with_reference(batches[5])["reference"]     # dropped: computed again
  assert again is not refs[5]
  np.testing.assert_allclose(again, refs[5])


def test_induction_vs_random_when_a_layer_has_no_other_head(ind_run):
  # Layer 1's four heads are all top heads, so their random partners must come from
  # layer 0 (it used to end in "ValueError: high <= 0"); configs/induction.py's 8 heads
  # with the default --top 5 leave too few other heads: refused, naming the limit.
  from mha_jax.toolkit import importance
  loaded = mha_jax.load(ind_run, **QUIET)
  scores = {f"lm.1.{h}": 1.0 - 0.1 * h for h in range(4)} | {"lm.0.0": 0.5, "lm.0.1": 0.1,
                                                            "lm.0.2": 0.0, "lm.0.3": 0.0}
  res = importance.induction_vs_random(loaded, scores, top=4, draws=2, log=lambda s: None)
  assert res["top_heads"] == ["lm.1.0", "lm.1.1", "lm.1.2", "lm.1.3"]
  for d in res["random_draws"]:
    assert len(set(d["heads"])) == 4 and {h.rsplit(".", 1)[0] for h in d["heads"]} == {"lm.0"}
    assert d["same_layer"] == [False] * 4
  res = importance.induction_vs_random(loaded, scores, top=2, draws=3, log=lambda s: None)
  assert all(d["same_layer"] == [True, True] for d in res["random_draws"])
  # 8 heads and a top 5: 3 others, too few to draw 5 random heads without repeating one.
  assert len(loaded.head_names) == 8
  with pytest.raises(UserError, match="top 5: the model has 3 heads besides the top 5.*"
                                      "use top 4 or less"):
    importance.induction_vs_random(loaded, scores, top=5, draws=1, log=lambda s: None)


def test_load_reads_the_run_data_and_never_runs_the_grammar(tmp_path, monkeypatch):
  from mha_jax.data import synthetic_translation
  cfg = tiny("configs/translation.py", TINY_TRANSLATION, "--config.train.steps=1")
  wd = str(tmp_path / "run")
  loop.train(cfg, wd, **QUIET)
  built = tasks.build(cfg)                      # the grammar's own output, for comparison

  def no_grammar(*a, **k):
    raise AssertionError("the grammar ran at load time")
  monkeypatch.setattr(synthetic_translation, "build_splits", no_grammar)
  loaded = mha_jax.load(wd, **QUIET)
  for s in tasks.SPLITS:
    for k in ("src", "tgt"):
      np.testing.assert_array_equal(loaded.task.arrays[s][k], built.arrays[s][k])
    assert loaded.task.words[s] == built.words[s] and loaded.task.arcs[s] == built.arcs[s]
  assert loaded.task.vocab.tokens == built.vocab.tokens
  with open(os.path.join(wd, "data", "test.src"), "a") as f:   # edited after training
    f.write("zzz qqq\n")
  with pytest.raises(UserError, match=r"test\.src: the data no longer matches the run's "
                                      r"vocabulary .*2 new words"):
    mha_jax.load(wd, **QUIET)


def test_loaded_holds_the_task(ind_run):
  loaded = mha_jax.load(ind_run, **QUIET)
  assert isinstance(loaded.task, tasks.LMData) and loaded.task.name == "lm"
  assert not hasattr(loaded, "model")   # the task is the one name for it
  cfg, task, params = loaded
  assert task is loaded.task and params is loaded.params
