"""Import streams: a sharded bf16 safetensors folder is read one tensor at a time from the
file (no memory map) and the host holds the model once (`mha-jax bench import-peak`)."""

import os

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import load_file

from hf_models import tokenizer_json
from mha_jax.harness.benchmarks import bench_import_peak
from mha_jax.pretrained import hf_folder


def _script():
  return bench_import_peak


def test_the_reader_returns_the_files_tensors(tmp_path):
  """Weights (file reads at each tensor's offset) against safetensors' own reader, over
  several shards, in bf16."""
  ip = _script()
  folder = str(tmp_path / "hf")
  ip.write_folder(folder, "tiny", tokenizer_json(), shard_bytes=40_000)
  files = hf_folder.weight_files(folder)
  assert len(files) > 2
  w = hf_folder.Weights(files)
  n = 0
  for f in files:
    for name, want in load_file(f).items():
      got = w(name)
      assert got.dtype == np.dtype(ml_dtypes.bfloat16) and got.shape == want.shape
      np.testing.assert_array_equal(got.view(np.uint16), want.view(np.uint16))
      n += 1
  assert n == len(ip.tensors(ip.SHAPES["tiny"]))


@pytest.mark.slow
def test_an_8b_wide_import_holds_the_model_once(tmp_path):
  """A random 2-layer model at Llama-3.1-8B's width (hidden 4096, 32/8 heads, MLP 14336,
  vocab 128256; 3.0 GB in bf16): the import adds at most 1.3 x the largest shard + the
  model once to the process's peak resident memory."""
  ip = _script()
  folder = str(tmp_path / "hf")
  ip.write_folder(folder, "llama31_8b_2layers", tokenizer_json())
  shards = [os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder)
            if f.endswith(".safetensors")]
  r = ip.measure(folder, str(tmp_path / "wd"), "bfloat16")
  model = 2 * sum(int(np.prod(s)) for _, s in ip.tensors(ip.SHAPES["llama31_8b_2layers"]))
  assert model <= sum(shards)
  assert r["peak_rss"] - r["base_rss"] <= 1.3 * max(shards) + model
