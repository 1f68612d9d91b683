"""Importing a GGUF file: a full disk is one line and leaves nothing; generating past the
context is refused naming both numbers."""

import json
import os

import numpy as np
import pytest

import mha_jax
from mha_jax import cli as cli_mod
from mha_jax.errors import UserError
from builders import QUIET


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
  """A tiny LLaMA GGUF (context 128, vocabulary 256) and its imported workdir."""
  from mha_jax.pretrained import importer
  from hf_models import tiny_llama_hf, write_tiny_gguf
  base = tmp_path_factory.mktemp("tiny_llama")
  w, cfg = tiny_llama_hf(np.random.default_rng(0))
  path = base / "tiny.gguf"
  write_tiny_gguf(path, w, cfg)
  wd = str(base / "wd")
  importer.import_model(wd, file=str(path))
  return str(path), wd


def test_generate_beyond_the_context_is_refused_naming_both_numbers(tiny_llama, capsys):
  _, wd = tiny_llama
  assert cli_mod.main(["generate", "--workdir", wd, "--prompt", "abc",
                       "--max-new-tokens", "9000"]) == 2
  err = capsys.readouterr().err
  assert "the prompt's 3 tokens plus --max-new-tokens 9000 make 9003, more than the " \
         "model's context of 128 tokens" in err, err
  assert cli_mod.main(["generate", "--workdir", wd, "--prompt", "abc",
                       "--max-new-tokens", "2"]) == 0
  printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
  loaded = mha_jax.load(wd, **QUIET)
  want = loaded.task.generate(loaded.params, "abc", 2)
  assert printed["continuation"] == want["text"], printed
  with pytest.raises(UserError, match=r"token id 300 is not in the vocabulary of 256"):
    loaded.task.logits(loaded.params, np.full((1, 4), 300, np.int32))


def test_a_full_disk_during_import_is_one_line_and_leaves_nothing(tiny_llama, tmp_path,
                                                                  monkeypatch, capsys):
  import orbax.checkpoint as ocp
  path, _ = tiny_llama
  real = ocp.CheckpointManager.save

  def fill_up(self, step, *a, **k):
    # as the real save does first: wait for orbax's start-up sweep of old tmp folders
    # (a thread that would otherwise race the half-written folder made here)
    getattr(self, "_maybe_await_cleanup_tmp_directory", lambda: None)()
    os.makedirs(os.path.join(str(self.directory), f"{step}.orbax-checkpoint-tmp-7", "params"))
    raise ValueError("RESOURCE_EXHAUSTED: Error writing local file: No space left on device")
  monkeypatch.setattr(ocp.CheckpointManager, "save", fill_up)
  out = tmp_path / "imports"
  out.mkdir()
  assert cli_mod.main(["import", "--file", path, "--workdir", str(out / "wd")]) == 2
  err = capsys.readouterr().err
  assert err.count("\n") == 1 and "the disk is full" in err, err
  assert os.listdir(out) == []                        # no .import-* folder left behind
  monkeypatch.setattr(ocp.CheckpointManager, "save", real)
