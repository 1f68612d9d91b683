"""`loaded.run(prompts, capture=..., edits=...)`: a Trace of the model's own forward."""

import types

import numpy as np
import pytest

from mha_jax import interventions, tasks, traces
from mha_jax.errors import UserError
from mha_jax.toolkit import activation_patching
from mha_jax.toolkit.capture import captured
from mha_jax.toolkit.pairs import Pairs

PROMPTS = ["t5 t9 t3 t7 t5 t9", "t1 t2 t3"]


def test_a_trace_of_strings(tiny_hf_run):
  tr = tiny_hf_run.run(PROMPTS, capture=["attn.pattern", "attn.z", "resid_post"])
  want = [traces.prompt_ids(tiny_hf_run.task, p) for p in PROMPTS]
  assert [list(r[:n]) for r, n in zip(tr.ids, tr.lengths)] == want
  assert tr.tokens == [p.split() for p in PROMPTS]      # WordLevel: one word, one token
  b, t = 2, 6
  assert tr["attn.pattern", 1].shape == (b, 4, t, t)
  assert tr["lm.1.attn.z"].shape == (b, t, 4, 16)
  assert tr["resid_post", 0].shape == (b, t, 64)
  assert tr.logits.shape == (b, t, tiny_hf_run.task.vocab_size)
  assert tr.layers() == 2 and ("attn.pattern", 1) in tr and ("attn.pattern", 2) not in tr
  # the padded row's real positions are those of the prompt run alone
  alone = tiny_hf_run.run(PROMPTS[1], capture=["attn.pattern"])
  np.testing.assert_allclose(tr["attn.pattern", 1][1, :, :3, :3], alone["attn.pattern", 1][0],
                             atol=1e-6)
  np.testing.assert_allclose(tr.logits[1, :3], alone.logits[0], atol=1e-5)
  assert np.allclose(tr["attn.pattern", 0].sum(-1)[0], 1.0, atol=1e-5)


def test_strings_are_tokenised_as_the_model_expects(tiny_hf_run):
  task = tiny_hf_run.task
  plain = [int(i) for i in task.tokenizer.encode(PROMPTS[0])]
  assert plain == [5, 9, 3, 7, 5, 9] and not task.adds_bos
  assert traces.prompt_ids(task, PROMPTS[0]) == plain
  with_bos = types.SimpleNamespace(tokenizer=task.tokenizer, adds_bos=True, bos_id=1)
  assert traces.prompt_ids(with_bos, PROMPTS[0]) == [1] + plain
  with pytest.raises(UserError, match="no tokenizer"):
    traces.prompt_ids(types.SimpleNamespace(), "x")


def test_a_trace_equals_captured_bit_for_bit(tiny_hf_run):
  rng = np.random.default_rng(1)
  ids = rng.integers(0, 96, (3, 7)).astype(np.int32)
  tr = tiny_hf_run.run(ids, capture=["attn.pattern", "attn.z", "attn_out"])
  batch = {"tokens": np.concatenate([ids, ids[:, -1:]], axis=1)}
  cap = captured(tiny_hf_run.task, tiny_hf_run.params, batch)["lm"]
  for i, r in enumerate(cap):
    assert np.array_equal(tr["attn.pattern", i], r.weights)
    assert np.array_equal(tr["attn.z", i], r.heads)
    assert np.array_equal(tr["attn_out", i], r.out)
  logits = tiny_hf_run.task.apply(tiny_hf_run.params, batch)
  np.testing.assert_allclose(tr.logits, np.asarray(logits), atol=1e-5)


def test_an_edit_through_run_equals_the_study_api(tiny_hf_run):
  rng = np.random.default_rng(2)
  clean = rng.integers(0, 96, (2, 6)).astype(np.int32)
  corrupt = clean.copy()
  corrupt[:, 2] = rng.integers(0, 96, 2)
  pairs = Pairs(clean, corrupt, np.asarray([3, 8]), np.asarray([4, 9]), np.asarray([6, 6]),
                [{}] * 2)
  study = activation_patching.Study(tiny_hf_run.task, tiny_hf_run.params, pairs)
  clean_z = study.values("clean", ["lm.1.attn.z"])["lm.1.attn.z"]
  edits = {"lm.1.attn.z": interventions.replace(clean_z, heads=2)}
  want = study.edited("corrupt", edits)["ld"]
  tr = tiny_hf_run.run(corrupt, capture=["attn.z"], edits=edits)
  ld = tr.logits[[0, 1], 5, [3, 8]] - tr.logits[[0, 1], 5, [4, 9]]
  np.testing.assert_allclose(ld, want, atol=1e-5)
  assert np.array_equal(tr["attn.z", 1][:, :, 2], np.asarray(clean_z)[:, :, 2])
  plain = tiny_hf_run.run(corrupt, capture=["attn.z"])
  assert not np.allclose(plain.logits, tr.logits)


def test_one_program_per_shape(tiny_hf_run):
  task = tiny_hf_run.task
  rng = np.random.default_rng(3)
  sizes = []
  for _ in range(3):       # other tokens, other edit values: the same program
    ids = rng.integers(0, 96, (2, 5)).astype(np.int32)
    z = rng.normal(size=(2, 5, 4, 16)).astype(np.float32)
    tiny_hf_run.run(ids, capture=["attn.z"], edits={"lm.0.attn.z": interventions.add(z)})
    sizes.append(tasks.jitted_programs(task)["trace:lm.*.attn.z"]._cache_size())
  assert sizes[0] == sizes[1] == sizes[2]
  tiny_hf_run.run(rng.integers(0, 96, (2, 4)), capture=["attn.z"],
                  edits={"lm.0.attn.z": interventions.add(z[:, :4])})
  assert tasks.jitted_programs(task)["trace:lm.*.attn.z"]._cache_size() == sizes[0] + 1


def test_bad_input_is_refused(tiny_hf_run):
  with pytest.raises(UserError, match="capture: 'lm.\\*.attn.nothing' names no site"):
    tiny_hf_run.run(PROMPTS, capture=["attn.nothing"])
  with pytest.raises(UserError, match="prompts must be"):
    tiny_hf_run.run(3.5)
  with pytest.raises(ValueError, match="edits name sites this forward does not have"):
    tiny_hf_run.run(PROMPTS, edits={"lm.7.attn.z": interventions.scale(0.0)})
  tr = tiny_hf_run.run(PROMPTS)
  with pytest.raises(KeyError, match="was not captured"):
    tr["attn.z", 0]
