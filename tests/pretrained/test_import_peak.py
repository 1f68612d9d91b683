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


@pytest.mark.slow  # default run: test_a_params_save_copies_at_most_host_bytes_to_the_host_at_once
def test_an_import_holds_the_model_once(tmp_path):
  """A small random model (sharded bf16, 2 layers, vocab 32,768; 0.16 GB in float32)
  imported in float32 by a fresh process, after a tiny import there (modules and thread
  pools, loaded once): the import adds less than 1.5 x the model's bytes to the peak
  resident memory, which holding the model twice (reading it whole, a device copy
  kept, the writer's copy) exceeds."""
  ip = _script()
  folder, warm = str(tmp_path / "hf"), str(tmp_path / "warm")
  ip.write_folder(folder, "small", tokenizer_json(), shard_bytes=16 << 20)
  ip.write_folder(warm, "tiny", tokenizer_json())
  r = ip.measure(folder, str(tmp_path / "wd"), "float32", warm=warm)
  model = 4 * sum(int(np.prod(s)) for _, s in ip.tensors(ip.SHAPES["small"]))
  assert 0 < r["peak_rss"] - r["base_rss"] <= 1.5 * model, (r, model)


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


def test_a_params_save_copies_at_most_host_bytes_to_the_host_at_once(tmp_path, monkeypatch):
  """Checkpoints(host_bytes=...) (what the import uses, with its largest array): orbax
  copies the arrays from the device to the host in batches of at most host_bytes (counted
  at orbax's transfer call), not all at once, and the checkpoint restores the same
  arrays."""
  import jax
  from orbax.checkpoint._src.serialization import jax_array_handlers
  from mha_jax.train import checkpoint as ckpt_lib
  batches = []
  transfer = jax_array_handlers.replica_slices.transfer_arrays_to_host

  def counting(arrays, *a, **k):
    batches.append(sum(int(x.nbytes) for x in arrays))
    return transfer(arrays, *a, **k)
  monkeypatch.setattr(jax_array_handlers.replica_slices, "transfer_arrays_to_host", counting)
  rng = np.random.default_rng(0)
  params = {f"w{i}": jax.device_put(rng.standard_normal((256, 256 + 8 * i), np.float32))
            for i in range(8)}
  big = max(int(x.nbytes) for x in params.values())
  c = ckpt_lib.Checkpoints(str(tmp_path / "run"), max_to_keep=1, host_bytes=big)
  c.save_params(0, params, {})
  c.close()
  assert sum(batches) == sum(int(x.nbytes) for x in params.values())
  assert len(batches) >= 8 and max(batches) <= big + 1
  got, _ = ckpt_lib.Checkpoints(str(tmp_path / "run"), read_only=True).restore_params(0)
  for k, v in params.items():
    np.testing.assert_array_equal(np.asarray(got[k]), np.asarray(v))
  # without the limit, orbax copies every array in one batch (what the import did)
  batches.clear()
  c = ckpt_lib.Checkpoints(str(tmp_path / "run2"), max_to_keep=1)
  c.save_params(0, params, {})
  c.close()
  assert len(batches) == 1
