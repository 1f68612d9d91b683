"""`mha-jax bench patching`'s peers (TransformerLens, nnsight) on a tiny random HF LLaMA:
their head-output patching tables equal mha-jax's (values only; `pip install .[bench]`)."""

import os

import numpy as np
import pytest

from mha_jax import cli, load
from mha_jax.toolkit import activation_patching
from mha_jax.toolkit.pairs import Pairs
from hf_models import build_hf, save_folder

pytestmark = pytest.mark.slow


def _bench():
  from mha_jax.harness.benchmarks import bench_patching
  return bench_patching


def test_the_peers_tables_equal_ours(tmp_path):
  pytest.importorskip("transformer_lens")
  pytest.importorskip("nnsight")
  import transformers
  hf = build_hf("llama")
  folder = save_folder(hf, str(tmp_path / "hf"))
  wd = str(tmp_path / "wd")
  assert cli.main(["import", "--file", folder, "--workdir", wd]) == 0
  loaded = load(wd)
  rng = np.random.default_rng(0)
  v = hf.config.vocab_size
  clean = rng.integers(0, v, (3, 7)).astype(np.int32)
  corrupt = clean.copy()
  corrupt[:, 2:4] = rng.integers(0, v, (3, 2))
  pairs = Pairs(clean, corrupt, np.asarray([3, 8, 11]), np.asarray([4, 9, 20]),
                np.asarray([7, 5, 7]), [{}] * 3)      # row 1 is right-padded
  ours = activation_patching.Study(loaded.task, loaded.params, pairs).patch("z")["recovery"]
  assert np.isfinite(ours).all() and np.abs(ours).max() > 1e-3

  bench = _bench()
  tok = transformers.PreTrainedTokenizerFast(tokenizer_file=os.path.join(folder,
                                                                          "tokenizer.json"))
  peers = bench.load_peers(hf=hf, tokenizer=tok)
  tl = bench.tl_sweep(peers["tl"], pairs)
  nn = bench.nnsight_sweep(peers["nnsight"], hf, pairs, heads_per_trace=3)
  assert tl.shape == nn.shape == ours.shape
  np.testing.assert_allclose(tl, ours, atol=1e-4)
  np.testing.assert_allclose(nn, ours, atol=1e-4)
  for part in (bench.tl_sweep(peers["tl"], pairs, layers=1),
               bench.nnsight_sweep(peers["nnsight"], hf, pairs, layers=1)):
    np.testing.assert_allclose(part[:1], ours[:1], atol=1e-4)   # the first layer's heads
    assert np.isnan(part[1:]).all()
