"""Fixtures shared by the test modules (the real-model imports, the tiny trained runs) and
the test run's settings (XLA's fast compile, one compilation cache, float32 at full
precision). Plain helpers are modules beside it: builders, oracles, hf_models, browser."""

import os
import shutil
import tempfile

import jax
import pytest

from mha_jax import machine

# The tests' programs are tiny, so XLA's CPU optimisation passes cost more time than they
# save: without them the default run is about a third faster. The tests are compile-bound
# (XLA's backend compile is about 60 % of their CPU time), and XLA:CPU's MLIR fusion emitters
# compile slower than its older elemental emitter: without them the patching tests take 41 %
# less CPU. Set before the first computation; subprocesses inherit it
# (`builders.with_devices`). Benchmarks and real runs keep XLA's defaults.
FAST_COMPILE = ("--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true "
                "--xla_cpu_use_fusion_emitters=false")
if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {FAST_COMPILE}".strip()


def _share_compilations() -> None:
  """One persistent XLA cache per test run, shared by the xdist workers and every
  subprocess a test starts: many tests compile the same tiny programs. A cache dir set
  by the user (JAX_COMPILATION_CACHE_DIR) is used as is."""
  global _OWN_CACHE
  if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _OWN_CACHE = tempfile.mkdtemp(prefix="mha-jax-test-xla-")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _OWN_CACHE
  # The workers write only compiles of a second or more (writing the rest cost them 8 %
  # more CPU than it saved); the subprocesses they start write every compile, so a CLI
  # run a test starts twice compiles once.
  own = os.environ.get("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS")
  os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
  jax.config.update("jax_compilation_cache_dir", os.environ["JAX_COMPILATION_CACHE_DIR"])
  jax.config.update("jax_persistent_cache_min_compile_time_secs",
                    1.0 if own is None else float(own))


_OWN_CACHE = None
_share_compilations()
# NumPy's huge-page madvise stalls on first touch on this kind of VM (mha_jax.machine);
# every worker and subprocess CLI turns it off the same way
machine.avoid_hugepage_stalls()


# Tests that start processes (training, kills, meshes, the compile cache's checks) and the
# real models go first: xdist (--dist loadgroup) hands out the groups in collection order,
# so a long group left to the end keeps one worker busy while the other idles.
_EARLY = ("tests/train/", "tests/cli/", "tests/pretrained/")


@pytest.hookimpl(tryfirst=True)      # before xdist reads the groups
def pytest_collection_modifyitems(config, items):
  """A test without an xdist group runs in its file's group: a file's module fixtures and
  compiled programs are then made on one worker, not on both."""
  for item in items:
    if item.get_closest_marker("xdist_group") is None:
      item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::")[0]))
  items.sort(key=lambda item: not item.nodeid.startswith(_EARLY))


def pytest_unconfigure(config):
  if _OWN_CACHE:       # the process that made the cache removes it
    shutil.rmtree(_OWN_CACHE, ignore_errors=True)


# On GPU/TPU, float32 matmuls default to lower precision; tests compare at 1e-5.
jax.config.update("jax_default_matmul_precision", "highest")


# --------------------------------------------------------------------------
# Real models: one import per model per worker, shared by pretrained/test_pretrained and
# pretrained/test_studies_real (both in xdist group "pretrained", so on one worker).
# --------------------------------------------------------------------------


def _imported_workdir(tmp_path_factory, name: str) -> str:
  from mha_jax import cli
  from mha_jax.pretrained import registry
  try:
    registry.find_model(name)
  except ValueError as e:      # fail loudly: CI installs these packages
    pytest.fail(f"real-model tests need the model packages: {e}")
  workdir = str(tmp_path_factory.mktemp("real") / name)
  assert cli.main(["import", name, "--workdir", workdir]) == 0
  return workdir



@pytest.fixture(scope="session")
def smollm2_workdir(tmp_path_factory) -> str:
  """`mha-jax import smollm2-135m` into a fresh workdir (read it, or copy it first)."""
  return _imported_workdir(tmp_path_factory, "smollm2-135m")


@pytest.fixture(scope="session")
def minilm_workdir(tmp_path_factory) -> str:
  """`mha-jax import minilm-l6` into a fresh workdir (read it, or copy it first)."""
  return _imported_workdir(tmp_path_factory, "minilm-l6")


@pytest.fixture(scope="session")
def gemma3_workdir(tmp_path_factory) -> str:
  """`mha-jax import gemma3-270m` (GGUF Q4_K_M from its chunk packages) into a fresh
  workdir (read it, or copy it first)."""
  return _imported_workdir(tmp_path_factory, "gemma3-270m")


@pytest.fixture(scope="session")
def smol_run(smollm2_workdir):
  """SmolLM2-135M loaded once (`mha_jax.load`), for every test that reads it."""
  import mha_jax
  return mha_jax.load(smollm2_workdir)


@pytest.fixture(scope="session")
def minilm_run(minilm_workdir):
  """MiniLM-L6 loaded once (`mha_jax.load`), for every test that reads it."""
  import mha_jax
  return mha_jax.load(minilm_workdir)


# --------------------------------------------------------------------------
# Tiny trained runs shared by several modules (one per worker that needs them).
# --------------------------------------------------------------------------


@pytest.fixture(scope="session")
def ind_run(tmp_path_factory):
  """A tiny induction run with checkpoints at steps 4 and 8 (copy it before changing it)."""
  from builders import QUIET, induction_cfg
  from mha_jax.train import loop
  wd = str(tmp_path_factory.mktemp("faults") / "ind")
  loop.train(induction_cfg("--config.train.steps=8"), wd, **QUIET)
  return wd


@pytest.fixture(scope="session")
def parallel_run(tmp_path_factory):
  """A 1-step translation run on parallel text files: (workdir, {split_side: path})."""
  from builders import QUIET, TINY_TRANSLATION, parallel_files, tiny
  from mha_jax.train import loop
  base = tmp_path_factory.mktemp("parallel")
  paths = parallel_files(str(base))
  cfg = tiny("configs/translation.py", TINY_TRANSLATION, "--config.data.kind=parallel",
             "--config.train.steps=1", "--config.eval.bleu_examples=2",
             "--config.data.max_len=8",
             *[f"--config.data.{k}={v}" for k, v in paths.items()])
  wd = str(base / "run")
  loop.train(cfg, wd, **QUIET)
  return wd, paths


@pytest.fixture(scope="session")
def tiny_attn_lm(tmp_path_factory):
  """(workdir, config): a two-layer attention-only LM over bytes, trained 2 steps (read
  it, or copy it first); shared by the patching and primer tests."""
  from mha_jax.train import loop
  from builders import tiny
  wd = str(tmp_path_factory.mktemp("tiny_attn_lm") / "run")
  cfg = tiny("configs/lm.py:attn_only,layers=2", [
      "--config.train.progress=false", "--config.train.steps=2", "--config.data.tokenizer=bytes",
      "--config.model.d_model=16", "--config.model.max_len=32", "--config.train.batch_size=4",
      "--config.eval.batch_size=4", "--config.eval.lm_batches=1"])
  loop.train(cfg, wd, log=lambda s: None)
  return wd, cfg


@pytest.fixture(scope="session")
def tiny_hf_folder(tmp_path_factory) -> str:
  """A tiny LLaMA in the Hugging Face layout (random weights, the WordLevel tokenizer of
  hf_models: words t0 .. t95), written without torch."""
  import json
  import numpy as np
  from safetensors.numpy import save_file
  from hf_models import V, tiny_llama_hf, tokenizer_json
  folder = tmp_path_factory.mktemp("hf") / "tiny-llama"
  folder.mkdir()
  w, cfg = tiny_llama_hf(np.random.default_rng(0), v=V)
  save_file(w, str(folder / "model.safetensors"))
  (folder / "config.json").write_text(json.dumps(cfg))
  (folder / "tokenizer.json").write_text(tokenizer_json())
  return str(folder)


@pytest.fixture(scope="session")
def tiny_hf_run(tiny_hf_folder, tmp_path_factory):
  """tiny_hf_folder loaded by `mha_jax.load` (imported into a model cache of its own)."""
  import mha_jax
  return mha_jax.load(tiny_hf_folder, cache=str(tmp_path_factory.mktemp("models")),
                      log=lambda s: None)


# --------------------------------------------------------------------------
# TPU compile checks (marker `tpu`, libtpu in its own venv): programs compiled for v5e:2x2
# once and read by more than one test (their tests share an xdist group, so one worker).
# --------------------------------------------------------------------------


@pytest.fixture(scope="session")
def v5e_lm_train_plan():
  """configs/lm.py's train job (impl auto) planned for v5e:2x2 on its default mesh (data
  4), at a real run's matmul precision: the train and eval steps' plan.json dict."""
  pytest.importorskip("libtpu", reason="the TPU compiler (libtpu) is not installed")
  from builders import ROOT
  from mha_jax import plan
  before = jax.config.jax_default_matmul_precision
  jax.config.update("jax_default_matmul_precision", None)
  try:
    return plan.make_plan(plan.PlanOptions(topology="v5e:2x2", job="train"),
                          config=os.path.join(ROOT, "configs", "lm.py"))
  finally:
    jax.config.update("jax_default_matmul_precision", before)
