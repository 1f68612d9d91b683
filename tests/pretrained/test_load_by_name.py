"""`mha_jax.load(name_or_path)`: a known model's name, a GGUF file or an HF folder is
imported once into the model cache, and reused by later calls and other processes."""

import os
import pathlib
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

import mha_jax
from hf_models import tiny_llama_hf, write_tiny_gguf
from mha_jax.errors import UserError
from mha_jax.pretrained import KNOWN

ROOT = pathlib.Path(__file__).resolve().parents[2]


def same_params(a, b):
  return all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def test_a_folder_is_imported_once_and_reused(tiny_hf_folder, tmp_path):
  said = []
  first = mha_jax.load(tiny_hf_folder, cache=str(tmp_path), log=said.append)
  second = mha_jax.load(tiny_hf_folder, cache=str(tmp_path), log=said.append)
  assert [s for s in said if s.startswith("importing")] == [
      f"importing {tiny_hf_folder} into {first.workdir} (once)"]
  assert first.workdir == second.workdir and first.workdir.startswith(str(tmp_path))
  assert sorted(os.listdir(tmp_path)) == [os.path.basename(first.workdir)]  # no lock, no tmp
  assert same_params(first.params, second.params)
  assert first.task.name == "pretrained_lm"
  # a workdir is loaded as it is (nothing imported)
  again = mha_jax.load(first.workdir, cache=str(tmp_path), log=said.append)
  assert again.workdir == first.workdir and len(said) == 1


def test_two_processes_racing_import_once(tiny_hf_folder, tmp_path):
  go = tmp_path / "go"
  code = ("import os, sys, time; import mha_jax; from mha_jax import loader, pretrained\n"
          "open(sys.argv[1] + str(os.getpid()), 'w').close()\n"
          "while not os.path.exists(sys.argv[1]): time.sleep(0.01)\n"
          "r = mha_jax.load(sys.argv[2], cache=sys.argv[3], log=print)\n"
          "print('workdir', r.workdir)\n")
  env = {**os.environ, "PYTHONPATH": str(ROOT)}
  cache = tmp_path / "cache"
  procs = [subprocess.Popen([sys.executable, "-c", code, str(go), tiny_hf_folder, str(cache)],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
           for _ in range(2)]
  deadline = time.time() + 120
  while len(list(tmp_path.glob("go*"))) < 2 and time.time() < deadline:
    time.sleep(0.05)     # both have imported the library and wait for the start
  go.write_text("")
  outs = [p.communicate(timeout=240) for p in procs]
  assert all(p.returncode == 0 for p in procs), [o[1][-2000:] for o in outs]
  lines = [line for out, _ in outs for line in out.splitlines()]
  assert sum(line.startswith("importing") for line in lines) == 1, lines
  workdirs = {line.split()[1] for line in lines if line.startswith("workdir")}
  assert len(workdirs) == 1 and sorted(os.listdir(cache)) == [os.path.basename(*workdirs)]


def test_a_gguf_file_is_imported_once(tmp_path):
  w, cfg = tiny_llama_hf(np.random.default_rng(0))
  path = str(tmp_path / "tiny.gguf")
  write_tiny_gguf(path, w, cfg)
  said = []
  a = mha_jax.load(path, cache=str(tmp_path / "cache"), log=said.append)
  b = mha_jax.load(path, cache=str(tmp_path / "cache"), log=said.append)
  assert len(said) == 1 and a.workdir == b.workdir
  assert a.config.source.path == os.path.abspath(path)


def test_a_bad_name_is_refused_with_the_names(tmp_path, monkeypatch):
  with pytest.raises(UserError) as e:
    mha_jax.load("smollm3-135m", cache=str(tmp_path))
  for name in KNOWN:
    assert name in str(e.value)
  assert not os.listdir(tmp_path)
  with pytest.raises(UserError, match="has no config.json"):
    mha_jax.load(str(tmp_path / "nothing"))
  (tmp_path / "smollm2-135m").mkdir()      # a folder named like a known model is a folder
  monkeypatch.chdir(tmp_path)
  with pytest.raises(UserError, match="'smollm2-135m' has no config.json"):
    mha_jax.load("smollm2-135m", cache=str(tmp_path / "cache"))


@pytest.mark.slow
def test_smollm2_by_name_is_imported_once(tmp_path):
  said = []
  a = mha_jax.load("smollm2-135m", cache=str(tmp_path), log=said.append)
  b = mha_jax.load("smollm2-135m", cache=str(tmp_path), log=said.append)
  assert len([s for s in said if s.startswith("importing")]) == 1
  assert a.workdir == b.workdir and same_params(a.params, b.params)
  assert a.config.source.path.endswith(KNOWN["smollm2-135m"].relpath)
