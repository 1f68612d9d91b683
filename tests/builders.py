"""Builders the tests share: the tiny configs and runs, copies of workdirs, data files,
and the environment of a subprocess (`from builders import tiny, TINY_INDUCTION`).

Fixtures live in conftest.py; these are plain functions and constants. The NumPy
oracles are in oracles.py, the tiny Hugging Face models and GGUF files in hf_models.py,
the browser in browser.py.
"""

import errno
import json
import os
import shutil

import numpy as np

import mha_jax
from mha_jax import config as mc
from mha_jax.train import loop

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository

TINY_TRANSLATION = [
    "--config.data.train_size=300", "--config.data.valid_size=20", "--config.data.test_size=20",
    "--config.data.grammar.num_nouns=30", "--config.data.grammar.num_verbs=12",
    "--config.data.grammar.num_adjectives=10", "--config.data.grammar.num_adverbs=6",
    "--config.data.grammar.num_names=10", "--config.model.d_model=16", "--config.model.d_ff=32",
    "--config.model.enc_layers=1", "--config.model.dec_layers=1", "--config.train.batch_size=8",
    "--config.eval.bleu_examples=10", "--config.train.warmup=2", "--config.train.progress=false"]
TINY_INDUCTION = [
    "--config.model.d_model=16", "--config.data.vocab_size=12", "--config.data.half_len=6",
    "--config.data.min_half_len=3",
    "--config.model.max_len=13", "--config.train.batch_size=8", "--config.eval.lm_batches=1",
    "--config.eval.batch_size=8", "--config.train.warmup=2", "--config.train.progress=false"]


def tiny(spec, base, *extra):
  cfg = mc.load_config(os.path.join(ROOT, spec))
  mc.apply_overrides(cfg, list(base) + list(extra))
  return cfg


def trained_translation(tmp_path_factory, name, *extra):
  """A tiny translation run trained for 30 steps, loaded (shared by the analysis and
  pruning tests)."""
  wd = str(tmp_path_factory.mktemp(name) / "run")
  cfg = tiny("configs/translation.py", TINY_TRANSLATION, "--config.train.steps=30",
             "--config.train.eval_every=30", "--config.train.log_every=30",
             "--config.train.schedule=constant", "--config.train.lr=5e-3", *extra)
  loop.train(cfg, wd, log=lambda s: None)
  return mha_jax.load(wd)


# ------------------------------------------------------------------ workdirs: copies, trees, data files

QUIET = dict(log=lambda s: None)


def induction_cfg(*extra):
  return tiny("configs/induction.py", TINY_INDUCTION, "--config.train.checkpoint_every=4",
              "--config.train.eval_every=100", "--config.train.log_every=4",
              "--config.train.keep=10", *extra)


def copy_run(src, tmp_path, name="run"):
  dst = str(tmp_path / name)
  shutil.copytree(src, dst)
  return dst


def copy_with_own_data(wd, paths, tmp_path):
  """(a copy of the run, its config) whose data files are copies too, so a test may edit
  them; config.json points at the copies."""
  wd = copy_run(wd, tmp_path)
  data = copy_run(os.path.dirname(paths["train_src"]), tmp_path, "data")
  cfg = json.load(open(os.path.join(wd, "config.json")))
  for k in paths:
    cfg["data"][k] = os.path.join(data, os.path.basename(paths[k]))
  json.dump(cfg, open(os.path.join(wd, "config.json"), "w"))
  return wd, cfg


def largest_files(folder):
  """The params' data files (orbax keeps the same bytes under d/ and ocdbt.process_0/d/)."""
  files = [os.path.join(d, f) for d, _, fs in os.walk(folder) for f in fs]
  size = max(map(os.path.getsize, files))
  return [f for f in files if os.path.getsize(f) == size]


def file_tree(wd):
  """Every file under wd with its size and mtime (to show nothing was written)."""
  return {os.path.relpath(os.path.join(d, f), wd): (os.path.getsize(os.path.join(d, f)),
                                                     os.stat(os.path.join(d, f)).st_mtime_ns)
          for d, _, fs in os.walk(wd) for f in fs}


def parallel_files(d, n=40, seed=0):
  rng = np.random.default_rng(seed)
  words = [f"w{i}" for i in range(12)]
  paths = {}
  for split, count in (("train", n), ("valid", 6), ("test", 6)):
    src = [" ".join(rng.choice(words, rng.integers(2, 6))) for _ in range(count)]
    tgt = [" ".join(reversed(s.split())) for s in src]
    for side, lines in (("src", src), ("tgt", tgt)):
      p = os.path.join(d, f"{split}.{side}")
      open(p, "w").write("\n".join(lines) + "\n")
      paths[f"{split}_{side}"] = p
  return paths


def with_devices(n: int) -> dict:
  """os.environ for a subprocess with n host devices, the tests' XLA flags and the
  repository on its PYTHONPATH."""
  return {**os.environ,
          "XLA_FLAGS": f"{os.environ['XLA_FLAGS']} --xla_force_host_platform_device_count={n}",
          "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}


def read_only_under(monkeypatch, folder):
  """Every new file or folder under `folder` fails as on a read-only mount."""
  from mha_jax import storage
  gpath = type(storage.path(str(folder)))
  real_open, real_mkdir = os.open, gpath.mkdir

  def ro_open(p, flags, *a, **k):
    if str(p).startswith(str(folder)) and flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT):
      raise OSError(errno.EROFS, "Read-only file system", str(p))
    return real_open(p, flags, *a, **k)

  def ro_mkdir(self, *a, **k):
    if str(self).startswith(str(folder)) and not self.exists():
      raise OSError(errno.EROFS, "Read-only file system", str(self))
    return real_mkdir(self, *a, **k)
  monkeypatch.setattr(storage.os, "open", ro_open)
  monkeypatch.setattr(gpath, "mkdir", ro_mkdir)
