"""Shared test helpers: an independent NumPy oracle for multi-head attention."""

import os
import shutil
import tempfile

import jax
import numpy as np
import pytest

# The tests' programs are tiny, so XLA's CPU optimisation passes cost more time than they
# save: without them the default run is about a third faster. Set before the first
# computation; subprocesses inherit it (`with_devices`). Benchmarks and real runs keep
# XLA's defaults.
FAST_COMPILE = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {FAST_COMPILE}".strip()


_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def with_devices(n: int) -> dict:
  """os.environ for a subprocess with n host devices, the tests' XLA flags and the
  repository on its PYTHONPATH."""
  return {**os.environ,
          "XLA_FLAGS": f"{os.environ['XLA_FLAGS']} --xla_force_host_platform_device_count={n}",
          "PYTHONPATH": os.pathsep.join([_ROOT, os.environ.get("PYTHONPATH", "")])}


def _share_compilations() -> None:
  """One persistent XLA cache per test run, shared by the xdist workers and every
  subprocess a test starts: many tests compile the same tiny programs. A cache dir set
  by the user (JAX_COMPILATION_CACHE_DIR) is used as is."""
  global _OWN_CACHE
  if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _OWN_CACHE = tempfile.mkdtemp(prefix="mha-jax-test-xla-")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _OWN_CACHE
  os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
  jax.config.update("jax_compilation_cache_dir", os.environ["JAX_COMPILATION_CACHE_DIR"])
  jax.config.update("jax_persistent_cache_min_compile_time_secs",
                    float(os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"]))


_OWN_CACHE = None
_share_compilations()


def pytest_unconfigure(config):
  if _OWN_CACHE:       # the process that made the cache removes it
    shutil.rmtree(_OWN_CACHE, ignore_errors=True)


# On GPU/TPU, float32 matmuls default to lower precision; tests compare at 1e-5.
jax.config.update("jax_default_matmul_precision", "highest")


def rel_err(a, ref) -> float:
  """max |a - ref| / max |ref| over the compared entries, in float64."""
  a, ref = np.asarray(a, np.float64), np.asarray(ref, np.float64)
  return float(np.max(np.abs(a - ref)) / np.max(np.abs(ref)))


def numpy_rope(x_TK, pos_T, base=10000.0, layout="half", dim=None):
  """Rotary embedding of one head's (T, K) rows, from the formula (Su et al. 2021).

  Pair i (i < dim/2) turns by the angle pos * base**(-2i/dim). "half" pairs feature i
  with i + dim/2 (Hugging Face rotate_half); "interleaved" pairs 2i with 2i+1.
  Features from dim on pass through.
  """
  x = np.array(x_TK, np.float64)
  dim = x.shape[-1] if dim is None else dim
  out = x.copy()
  for t in range(x.shape[0]):
    for i in range(dim // 2):
      a, b = (i, i + dim // 2) if layout == "half" else (2 * i, 2 * i + 1)
      ang = float(pos_T[t]) * base ** (-2.0 * i / dim)
      c, s = np.cos(ang), np.sin(ang)
      out[t, a] = x[t, a] * c - x[t, b] * s
      out[t, b] = x[t, b] * c + x[t, a] * s
  return out


def numpy_mha(params, x, context=None, mask=None, causal=False, gates=None, bias=None,
              rope=None, positions=None, kv_positions=None):
  """Per-head loop in float64 NumPy, written from the paper, not from mha_jax.

  Grouped-query attention: params["wk"] may have G heads, G dividing H; query head h
  reads key/value head h // (H // G). rope: (base, layout, dim) rotates q and k of
  every head by numpy_rope at positions (B, T) (default arange(T)) and kv_positions
  (B, S) (default: positions for self-attention, arange(S) for context).

  Returns (out (B, T, D), weights (B, H, T, S)).
  """
  p = {k: np.asarray(v, np.float64) for k, v in params.items()}
  x = np.asarray(x, np.float64)
  c = x if context is None else np.asarray(context, np.float64)
  B, T, D = x.shape
  S = c.shape[1]
  _, H, K = p["wq"].shape
  G = p["wk"].shape[1]
  if rope is not None:
    pos = np.broadcast_to(np.arange(T) if positions is None else np.asarray(positions),
                          (B, T))
    if kv_positions is not None:
      kv_pos = np.broadcast_to(np.asarray(kv_positions), (B, S))
    else:
      kv_pos = pos if context is None else np.broadcast_to(np.arange(S), (B, S))
  allowed = np.ones((B, H, T, S), bool)
  if mask is not None:
    m = np.asarray(mask)
    if m.ndim == 2:
      m = m[None, None]
    allowed &= np.broadcast_to(m, (B, H, T, S))
  if causal:
    allowed &= np.tril(np.ones((T, S), bool))[None, None]
  heads = np.zeros((B, T, H, K))
  weights = np.zeros((B, H, T, S))
  for b in range(B):
    for h in range(H):
      j = h // (H // G)                 # this query head's key/value head
      q = x[b] @ p["wq"][:, h, :] + (p["bq"][h] if "bq" in p else 0)
      k = c[b] @ p["wk"][:, j, :] + (p["bk"][j] if "bk" in p else 0)
      v = c[b] @ p["wv"][:, j, :] + (p["bv"][j] if "bv" in p else 0)
      if rope is not None:
        q = numpy_rope(q, pos[b], *rope)
        k = numpy_rope(k, kv_pos[b], *rope)
      s = q @ k.T / np.sqrt(K)
      if bias is not None:
        s = s + np.broadcast_to(np.asarray(bias, np.float64), (B, H, T, S))[b, h]
      for t in range(T):
        ok = allowed[b, h, t]
        if not ok.any():
          continue
        e = np.exp(s[t][ok] - s[t][ok].max())
        weights[b, h, t, ok] = e / e.sum()
      o = weights[b, h] @ v
      if gates is not None:
        g = np.asarray(gates, np.float64)
        o = o * (g[h] if g.ndim == 1 else g[b, h])
      heads[b, :, h, :] = o
  out = np.einsum("bthk,hkd->btd", heads, p["wo"]) + (p["bo"] if "bo" in p else 0)
  return out, weights


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


# --------------------------------------------------------------------------
# Tiny trained runs shared by several modules (one per worker that needs them).
# --------------------------------------------------------------------------


@pytest.fixture(scope="session")
def ind_run(tmp_path_factory):
  """A tiny induction run with checkpoints at steps 4 and 8 (copy it before changing it)."""
  from helpers import QUIET, induction_cfg
  from mha_jax.train import loop
  wd = str(tmp_path_factory.mktemp("faults") / "ind")
  loop.train(induction_cfg("--config.train.steps=8"), wd, **QUIET)
  return wd


@pytest.fixture(scope="session")
def parallel_run(tmp_path_factory):
  """A 1-step translation run on parallel text files: (workdir, {split_side: path})."""
  from helpers import QUIET, TINY_TRANSLATION, _parallel_files, tiny
  from mha_jax.train import loop
  base = tmp_path_factory.mktemp("parallel")
  paths = _parallel_files(str(base))
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
  from helpers import tiny
  wd = str(tmp_path_factory.mktemp("tiny_attn_lm") / "run")
  cfg = tiny("configs/lm.py:attn_only,layers=2", [
      "--config.train.progress=false", "--config.train.steps=2", "--config.data.tokenizer=bytes",
      "--config.model.d_model=16", "--config.model.max_len=32", "--config.train.batch_size=4",
      "--config.eval.batch_size=4", "--config.eval.lm_batches=1"])
  loop.train(cfg, wd, log=lambda s: None)
  return wd, cfg
