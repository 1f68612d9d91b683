"""toolkit/memory.py: chunk sizes planned from shapes and a budget; the same tables at any
chunking; bfloat16 studies near float32."""

import json

import jax
import numpy as np
import pytest

from mha_jax import cli
from mha_jax.errors import UserError
from mha_jax.toolkit import activation_patching, memory
from oracles import LlamaTask, tiny_llama_pairs

SHAPES = [memory.PatchShapes(layers=16, heads=32, kv_heads=8, head_dim=64, d_model=2048,
                             d_mlp=8192, vocab=128256, t=20, pairs=4, dtype_bytes=2),
          memory.PatchShapes(layers=32, heads=32, kv_heads=8, head_dim=128, d_model=4096,
                             d_mlp=14336, vocab=128256, t=12, t_keys=20, pairs=64, sites=2),
          memory.PatchShapes(layers=2, heads=4, kv_heads=2, head_dim=8, d_model=32,
                             d_mlp=24, vocab=37, t=7, pairs=3)]


def bytes_by_hand(s: memory.PatchShapes, c: int, p: int) -> int:
  """The byte model written out term by term (memory.py's docstring)."""
  tk, b = s.t_keys or s.t, s.dtype_bytes
  site = s.sites * s.layers * s.t * s.heads * s.head_dim
  pair = b * (site + s.layers * s.t * s.d_model + 4 * s.layers * tk * s.kv_heads * s.head_dim)
  row = (16 * s.t * s.d_model + b * s.t * (2 * s.heads + 2 * s.kv_heads) * s.head_dim
         + 8 * s.heads * s.t * tk + 3 * b * s.t * s.d_mlp + 8 * s.vocab
         + b * (site + s.layers * s.t * s.d_model))
  return p * pair + c * p * row


@pytest.mark.parametrize("shapes", SHAPES)
@pytest.mark.parametrize("budget", [10**6, 10**8, 4 * 10**9, 10**12])
def test_the_chosen_chunks_fit_and_are_the_largest_that_do(shapes, budget):
  m = 3000
  one = bytes_by_hand(shapes, 1, 1)
  if budget < one:
    with pytest.raises(UserError, match=f"memory_budget.*at least {one:,} bytes"):
      memory.patch_plan(shapes, m, budget)
    return
  plan = memory.patch_plan(shapes, m, budget)
  c, p = plan.interventions_per_group, plan.pairs_per_batch
  assert 1 <= c <= m and 1 <= p <= shapes.pairs
  assert plan.bytes == bytes_by_hand(shapes, c, p) <= budget
  # no more pairs fit with one intervention, no more interventions with these pairs
  assert p == shapes.pairs or bytes_by_hand(shapes, 1, p + 1) > budget
  assert c == m or bytes_by_hand(shapes, c + 1, p) > budget


def test_a_budget_below_one_item_is_refused_with_the_minimum():
  s = SHAPES[0]
  need = bytes_by_hand(s, 1, 1)
  with pytest.raises(UserError, match=f"memory_budget of {need - 1:,} bytes.*at least "
                                      f"{need:,} bytes") as e:
    memory.patch_plan(s, 10, need - 1)
  assert e.value.settings == ("memory_budget",)
  assert memory.patch_plan(s, 10, need).interventions_per_group == 1


@pytest.mark.parametrize("text,want", [("4GB", 4 * 10**9), ("4GiB", 4 * 2**30),
                                       ("512MiB", 512 * 2**20), ("3e9", 3 * 10**9),
                                       ("1000", 1000), ("1.5 kb", 1500)])
def test_sizes(text, want):
  assert memory.parse_bytes(text) == want


@pytest.mark.parametrize("text", ["", "four", "-1GB", "0", "4 GX"])
def test_bad_sizes_are_refused_by_name(text):
  with pytest.raises(UserError, match="memory_budget must be"):
    memory.parse_bytes(text)


@pytest.fixture(scope="module")
def tiny():
  params, pairs = tiny_llama_pairs(slice(1, 3), [7, 6, 7])
  return params, pairs


def test_params_bytes_on_a_mesh_are_one_device_s_shard():
  """On a (data 2, model 2) mesh a device holds half of each attention projection (its
  heads) and of each MLP matrix (its hidden units), and the whole of everything else
  (embeddings, norms); in bfloat16 half of that again."""
  from jax.sharding import AbstractMesh
  params, _ = tiny_llama_pairs(slice(1, 3), [7, 6, 7])
  split = {"wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down"}
  whole = halved = 0
  for path, x in jax.tree_util.tree_leaves_with_path(params):
    n = x.size * x.dtype.itemsize
    whole += n
    halved += n // 2 if path[-1].key in split else n
  assert whole > halved > whole // 2
  mesh = AbstractMesh((2, 2), ("data", "model"))
  assert memory.params_bytes(params) == whole
  assert memory.params_bytes(params, mesh=mesh) == halved
  assert memory.params_bytes(params, "bfloat16", mesh) == halved // 2


@pytest.mark.parametrize("rows", [None, 1, 3, 7, 50])
def test_map_rows_runs_every_row_once_and_pads_with_weight_zero(rows):
  """7 rows, `rows` at a time: the weighted sums equal NumPy's over the 7 rows, the
  per-row outputs (stacked over groups) are the rows in order, the padding after them."""
  x = np.random.default_rng(0).normal(size=(7, 5)).astype(np.float32)
  total, per_row, weights = memory.map_rows(
      lambda c, w: ((c * w[:, None]).sum(0), 2 * c, w), (x,), rows)
  g = 1 if rows is None else -(-7 // min(rows, 7))
  assert per_row.shape[:1] == weights.shape[:1] == (g,)
  np.testing.assert_allclose(np.asarray(total).sum(0), x.sum(0), rtol=1e-6)
  np.testing.assert_allclose(np.asarray(per_row).reshape(-1, 5)[:7], 2 * x)
  assert np.asarray(weights).sum() == 7 and np.asarray(weights).ravel()[:7].all()


def test_tables_are_the_same_at_any_chunking(tiny):
  """One pair and one intervention per program (the smallest budget that fits) against
  every intervention and pair in one program."""
  params, pairs = tiny
  big = activation_patching.Study(LlamaTask(), params, pairs, memory_budget=2**30)
  sweeps = [("z", False), ("k", True), ("resid_pre", True)]
  need = memory.patch_bytes(big.shapes(len(sweeps)), 1, 1)
  small = activation_patching.Study(LlamaTask(), params, pairs, memory_budget=need)
  want = big.patch_many(sweeps)
  n_int = big.last_plan.interventions_per_group
  assert big.last_plan.pairs_per_batch == len(pairs) and n_int > 1
  got = small.patch_many(sweeps)
  assert (small.last_plan.interventions_per_group, small.last_plan.pairs_per_batch) == (1, 1)
  assert small.last_plan.bytes <= need
  for site, _ in sweeps:
    for k in ("ld", "logp", "recovery", "prob"):
      np.testing.assert_allclose(got[site][k], want[site][k], atol=2e-5, err_msg=f"{site} {k}")
  with pytest.raises(UserError, match="memory_budget"):
    activation_patching.Study(LlamaTask(), params, pairs, memory_budget=need - 1).patch_many(
        sweeps)


def test_bfloat16_studies_are_near_float32(tiny):
  """Weights in bfloat16 (softmax, norms, logits and metrics in float32): the head table
  within 0.05 of recovery, and the same top heads."""
  params, pairs = tiny
  f32 = activation_patching.Study(LlamaTask(), params, pairs).patch("z")
  bf = activation_patching.Study(LlamaTask(), memory.cast(params, "bfloat16"), pairs)
  assert bf.shapes().dtype_bytes == 2
  got = bf.patch("z")
  assert np.nanmax(np.abs(got["recovery"] - f32["recovery"])) < 0.05
  agree = activation_patching.agreement(got["recovery"], f32["recovery"], top=3)
  assert agree["top3_overlap"] >= 2 / 3
  with pytest.raises(UserError, match="dtype must be one of"):
    memory.cast(params, "float16")


def test_patch_command_takes_a_budget_and_a_dtype(tiny_attn_lm, tmp_path, capsys):
  wd, _ = tiny_attn_lm
  args = ["patch", "--workdir", wd, "--task", "induction", "--n-pairs", "3", "--keep-failing",
          "--method", "activation"]
  assert cli.main(args + ["--memory-budget", "4MiB", "--dtype", "bfloat16",
                          "--out", str(tmp_path / "a")]) == 0
  summary = json.loads((tmp_path / "a" / "summary.json").read_text())
  assert summary["memory_budget"]["bytes"] == 4 * 2**20
  assert summary["plan"]["bytes"] <= 4 * 2**20
  capsys.readouterr()
  assert cli.main(args + ["--memory-budget", "1KB", "--out", str(tmp_path / "b")]) != 0
  err = capsys.readouterr().err
  assert "memory-budget of 1,000 bytes" in err and "needs at least" in err


@pytest.mark.slow  # default run: test_bfloat16_studies_are_near_float32
def test_bfloat16_on_an_imported_model_with_a_shared_prefix_and_depth(tmp_path):
  """An imported LM (prefix cache, each intervention from its layer on): bf16 weights run
  (the cache and the stream stay bf16) and the table stays within 0.1 of float32's (a
  random model: a small clean-corrupt gap magnifies the recovery's error)."""
  import mha_jax
  from hf_models import build_hf, save_folder
  folder = save_folder(build_hf("llama"), tmp_path / "hf")
  wd = str(tmp_path / "wd")
  assert cli.main(["import", "--file", folder, "--workdir", wd]) == 0
  loaded = mha_jax.load(wd)
  rng = np.random.default_rng(0)
  clean = rng.integers(0, 200, (3, 8)).astype(np.int32)
  corrupt = clean.copy()
  corrupt[:, 4] = (corrupt[:, 4] + 7) % 200
  from mha_jax.toolkit.pairs import Pairs
  pairs = Pairs(clean, corrupt, np.asarray([3, 5, 7]), np.asarray([4, 6, 9]),
                np.asarray([8, 8, 8]), [{}] * 3)
  want = activation_patching.Study(loaded.task, loaded.params, pairs)
  got = activation_patching.Study(loaded.task, memory.cast(loaded.params, "bfloat16"), pairs)
  assert got.prefix == 4 and got.share_depth
  a, b = got.patch("z")["recovery"], want.patch("z")["recovery"]
  assert np.isfinite(a).all() and np.nanmax(np.abs(a - b)) < 0.1
