"""toolkit/pairs.py: the one selection of prompt pairs (a behaviour or a file, exactly
one), packing rows of different lengths, and the refusals, on a character tokenizer."""

import json

import numpy as np
import pytest

from mha_jax.errors import UserError
from mha_jax.toolkit import pairs as pairs_lib


class Chars:
  """One token per character: 'a' -> 1, 'b' -> 2, ..., ' ' -> 27."""

  def encode(self, text: str) -> list[int]:
    return [27 if c == " " else ord(c) - ord("a") + 1 for c in text]


class CharTask:
  tokenizer = Chars()


def test_pack_pairs_pads_each_row_with_its_last_token():
  rows = [([1, 2, 3], [1, 5, 3], 7, 8, {"i": 0}), ([4], [6], 9, 10, {"i": 1})]
  p = pairs_lib.pack_pairs(rows)
  np.testing.assert_array_equal(p.clean, [[1, 2, 3], [4, 4, 4]])
  np.testing.assert_array_equal(p.corrupt, [[1, 5, 3], [6, 6, 6]])
  np.testing.assert_array_equal(p.length, [3, 1])
  assert p.answer.tolist() == [7, 9] and p.wrong.tolist() == [8, 10] and len(p) == 2
  assert p.subset([1]).text == [{"i": 1}]


def test_select_pairs_takes_exactly_one_of_a_behaviour_and_a_file(tmp_path):
  path = tmp_path / "pairs.jsonl"
  path.write_text(json.dumps({"clean": "ab", "corrupt": "cb", "answer": "d", "wrong": "e"}))
  got = pairs_lib.select_pairs(CharTask(), None, str(path), 4, 0)
  np.testing.assert_array_equal(got.clean, [[1, 2]])
  np.testing.assert_array_equal(got.corrupt, [[3, 2]])
  assert got.answer.tolist() == [4] and got.wrong.tolist() == [5]
  for behaviour, file in ((None, None), ("ioi", str(path))):
    with pytest.raises(UserError, match="exactly one of task") as e:
      pairs_lib.select_pairs(CharTask(), behaviour, file, 4, 0)
    assert e.value.settings == ("task", "pairs")


def test_select_pairs_calls_the_behaviours_builder_and_names_unknown_ones():
  seen = []
  builders = {"mine": lambda task, n, seed: seen.append((task, n, seed)) or "built"}
  task = CharTask()
  assert pairs_lib.select_pairs(task, "mine", None, 3, 9, builders) == "built"
  assert seen == [(task, 3, 9)]
  with pytest.raises(UserError, match=r"task must be one of \('mine',\); got 'ioi'"):
    pairs_lib.select_pairs(task, "ioi", None, 3, 9, builders)
  assert pairs_lib.BEHAVIOURS == ("ioi", "induction")


def test_a_model_without_a_tokenizer_is_refused_naming_task():
  with pytest.raises(UserError, match="no tokenizer") as e:
    pairs_lib.task_tokenizer(object())
  assert e.value.settings == ("task",)
  assert pairs_lib.single_token(CharTask(), "c") == 3
  assert pairs_lib.single_token(CharTask(), "cd") is None
