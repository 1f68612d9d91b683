"""toolkit/head_masks.py on a hand-made two-layer LM's attention params: the head mask's
count and names, W_O rows zeroed, heads removed for real, gates filled with ones, and the
JSON form, each against NumPy written out here."""

import numpy as np

from mha_jax.toolkit import head_masks

D, K, HEADS = 6, 2, (3, 2)


def params(seed: int = 0) -> dict:
  rng = np.random.default_rng(seed)
  layers = {}
  for i, h in enumerate(HEADS):
    layers[f"layer_{i}"] = {"attn": {
        "wq": rng.normal(size=(D, h, K)).astype(np.float32),
        "wk": rng.normal(size=(D, h, K)).astype(np.float32),
        "wv": rng.normal(size=(D, h, K)).astype(np.float32),
        "wo": rng.normal(size=(h, K, D)).astype(np.float32)}}
  return {"lm": layers}


MASK = {"lm": [np.array([1, 0, 1], np.float32), np.array([0, 1], np.float32)]}


def test_ones_count_and_names():
  ones = head_masks.ones_head_mask(params())
  assert [m.tolist() for m in ones["lm"]] == [[1, 1, 1], [1, 1]]
  assert head_masks.count(ones) == 5 and head_masks.count(MASK) == 3
  assert head_masks.kept_names(MASK) == ["lm.0.0", "lm.0.2", "lm.1.1"]
  assert head_masks.ones_head_mask(params(), stacks=("encoder",)) == {}


def test_mask_params_zeroes_the_masked_heads_rows_of_w_o_only():
  p = params()
  out = head_masks.mask_params(p, MASK)
  for i, m in enumerate(MASK["lm"]):
    blk, new = p["lm"][f"layer_{i}"]["attn"], out["lm"][f"layer_{i}"]["attn"]
    np.testing.assert_array_equal(np.asarray(new["wo"]), blk["wo"] * m[:, None, None])
    for name in ("wq", "wk", "wv"):
      np.testing.assert_array_equal(np.asarray(new[name]), blk[name])
  assert np.any(p["lm"]["layer_0"]["attn"]["wo"][1] != 0)      # the input is not edited


def test_export_pruned_keeps_the_kept_heads_slices():
  p = params()
  out = head_masks.export_pruned(p, MASK)
  for i, m in enumerate(MASK["lm"]):
    kept = np.flatnonzero(m)
    blk, new = p["lm"][f"layer_{i}"]["attn"], out["lm"][f"layer_{i}"]["attn"]
    for name in ("wq", "wk", "wv"):
      np.testing.assert_array_equal(np.asarray(new[name]), blk[name][:, kept])
    np.testing.assert_array_equal(np.asarray(new["wo"]), blk["wo"][kept])
  assert [m.tolist() for m in head_masks.exported_head_mask(p, MASK)["lm"]] == [[1, 1], [1]]


def test_full_head_gates_and_json():
  # a stack given keeps its gates; a stack left out gets ones
  ones = head_masks.full_head_gates(params(), {})
  assert [np.asarray(g).tolist() for g in ones["lm"]] == [[1, 1, 1], [1, 1]]
  given = head_masks.full_head_gates(params(), {"lm": [np.array([0.5, 0, 1]), np.zeros(2)]})
  assert [np.asarray(g).tolist() for g in given["lm"]] == [[0.5, 0, 1], [0, 0]]
  assert head_masks.head_mask_to_json(MASK) == {"lm": [[1, 0, 1], [0, 1]]}
  assert head_masks.jsonable({"a": np.float32(0.5), "b": [np.arange(2)]}) == \
      {"a": 0.5, "b": [[0, 1]]}
