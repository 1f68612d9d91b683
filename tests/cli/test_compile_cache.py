"""The CLI's persistent compilation cache: a second process loads instead of compiling,
gets the same bits, and a cache whose key differs (XLA flags, jaxlib version, machine)
is never used."""

import json
import os
import subprocess
import sys

import pytest

from mha_jax import compile_cache
from mha_jax.errors import UserError
from builders import ROOT

# Runs the CLI; with PATCH_JAXLIB set, JAX's cache key sees another jaxlib version string.
_MAIN = ("import os, sys\n"
         "if os.environ.get('PATCH_JAXLIB'):\n"
         "  import jax._src.cache_key as k; k.jaxlib_version_str += os.environ['PATCH_JAXLIB']\n"
         "from mha_jax import cli\n"
         "sys.exit(cli.main(sys.argv[1:]))")


def _cli(argv, cache: str, **env) -> dict:
  """One `mha-jax` process with JAX logging every compile: its stdout and the counts of
  persistent-cache misses (compiled) and hits (loaded)."""
  e = {**os.environ, "PYTHONPATH": ROOT, "JAX_LOG_COMPILES": "1",
       "JAX_EXPLAIN_CACHE_MISSES": "1", **env}
  p = subprocess.run([sys.executable, "-c", _MAIN, *argv, "--compile-cache", cache],
                     capture_output=True, text=True, env=e, cwd=ROOT, timeout=300)
  assert p.returncode == 0, p.stderr[-3000:]
  return {"out": p.stdout, "misses": p.stderr.count("PERSISTENT COMPILATION CACHE MISS"),
          "hits": p.stderr.count("Persistent compilation cache hit")}


def _files(root) -> set:
  return {os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs}


@pytest.fixture(scope="module")
def warm(tiny_attn_lm, tmp_path_factory):
  """(argv, cache root, the cold run, the run without a cache): `mha-jax eval` on the
  tiny LM, run once into an empty cache."""
  wd, _ = tiny_attn_lm
  argv = ["eval", "--workdir", wd]
  root = str(tmp_path_factory.mktemp("xla"))
  cold = _cli(argv, root)
  off = _cli(argv, "off")
  return argv, root, cold, off


def test_a_second_process_compiles_nothing_and_gets_the_same_bits(warm):
  argv, root, cold, off = warm
  assert cold["misses"] >= 2 and cold["hits"] == 0
  assert off["misses"] == off["hits"] == 0            # off: the cache is not consulted
  before = _files(root)
  assert len(before) == cold["misses"]               # one entry per compiled program
  again = _cli(argv, root)
  assert again["misses"] == 0 and again["hits"] == cold["misses"]
  assert _files(root) == before
  # the printed float32 loss and accuracy, bit for bit, with and without the cache
  assert json.loads(again["out"]) == json.loads(cold["out"]) == json.loads(off["out"])


@pytest.mark.parametrize("env", [
    {"XLA_FLAGS": os.environ.get("XLA_FLAGS", "") + " --xla_cpu_enable_fast_min_max=true"},
    pytest.param({"PATCH_JAXLIB": ".other"}, marks=pytest.mark.slow)],
    ids=["xla_flag", "jaxlib_version"])
@pytest.mark.slow  # default run: test_a_second_process_compiles_nothing_and_gets_the_same_bits
def test_a_changed_key_misses(warm, env):
  argv, root, cold, _ = warm
  other = _cli(argv, root, **env)
  assert other["hits"] == 0 and other["misses"] == cold["misses"]
  assert json.loads(other["out"]) == json.loads(cold["out"])


def test_where_the_cache_lives(tmp_path):
  key = compile_cache.machine_key()
  home = {"XDG_CACHE_HOME": str(tmp_path / "xdg")}
  assert compile_cache.resolve(None, home) == str(tmp_path / "xdg" / "mha-jax" / "xla" / key)
  assert compile_cache.resolve(None, {**home, "JAX_COMPILATION_CACHE_DIR": "/j"}) == "/j"
  env = {**home, "JAX_COMPILATION_CACHE_DIR": "/j", compile_cache.ENV: str(tmp_path / "e")}
  assert compile_cache.resolve(None, env) == str(tmp_path / "e" / key)
  assert compile_cache.resolve(str(tmp_path / "f"), env) == str(tmp_path / "f" / key)
  assert compile_cache.resolve("off", env) is None
  assert compile_cache.resolve(None, {**env, compile_cache.ENV: "OFF"}) is None
  with pytest.raises(UserError, match="--compile-cache"):
    compile_cache.resolve(" ", env)


def test_the_machine_key_names_the_cpu_and_its_flags():
  a = "processor\t: 0\nmodel name\t: X\nflags\t\t: fpu sse2 avx2\n"
  same = "processor\t: 1\nmodel name\t: X\nflags\t\t: avx2 fpu sse2\n" * 2
  assert compile_cache.machine_key(a) == compile_cache.machine_key(same)
  assert compile_cache.machine_key(a) == compile_cache.machine_key(a + "cpu MHz\t: 1234\n")
  assert compile_cache.machine_key(a) != compile_cache.machine_key(a.replace("avx2", "avx512f"))
  assert compile_cache.machine_key(a) != compile_cache.machine_key(a.replace(": X", ": Y"))


@pytest.mark.slow
def test_a_cache_that_cannot_be_written_is_said_once_not_per_program(tiny_attn_lm, tmp_path):
  """A full disk under the cache (every entry's write fails): one line naming the cache,
  none of JAX's per-program warnings, and the command's result."""
  wd, _ = tiny_attn_lm
  full = ("import errno, os, sys\n"
          "import jax._src.compilation_cache as cc\n"
          "def full(*a, **k):\n"
          "  raise OSError(errno.ENOSPC, 'No space left on device')\n"
          "cc.put_executable_and_time = full\n"
          "from mha_jax import cli\n"
          "sys.exit(cli.main(sys.argv[1:]))")
  cache = str(tmp_path / "xla")
  e = {**os.environ, "PYTHONPATH": ROOT}
  p = subprocess.run([sys.executable, "-c", full, "eval", "--workdir", wd, "--compile-cache",
                      cache], capture_output=True, text=True, env=e, cwd=ROOT, timeout=300)
  assert p.returncode == 0 and json.loads(p.stdout)["loss"] > 0, p.stderr[-2000:]
  assert "UserWarning" not in p.stderr and "Error writing" not in p.stderr, p.stderr[-2000:]
  said = [l for l in p.stderr.splitlines() if l.startswith("mha-jax: warning: the compile")]
  assert len(said) == 1 and compile_cache.resolve(cache) in said[0], p.stderr[-2000:]
  assert "cannot be written (OSError: [Errno 28] No space left on device)" in said[0]
