"""JAX's persistent compilation cache for the command line: a second run of a command on
the same shapes loads its compiled programs from disk instead of compiling them again.

Where the cache lives, first match wins:

  --compile-cache DIR | off      a flag of every verb
  MHA_JAX_COMPILE_CACHE=DIR|off  the environment
  JAX_COMPILATION_CACHE_DIR      JAX's own variable: used as it is (no subfolder)
  $XDG_CACHE_HOME/mha-jax/xla    the default (~/.cache/mha-jax/xla)

Under DIR (the first two and the default) the entries go in a subfolder named by
`machine_key()`: the jax and jaxlib versions, the platform, and the CPU's model and
instruction-set flags. JAX keys every entry by the program, the jaxlib version, the
backend's platform and version, the devices, the compile options and the XLA flags; on
CPU the backend's version is just "cpu", and XLA:CPU compiles for the host's instruction
set, so a folder shared between machines (a home folder on NFS) keeps one subfolder per
kind of CPU. Every program is cached, however quick its compile (JAX's default skips
those under a second), unless JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS says otherwise.
The library itself never turns the cache on: only `mha-jax` does.

A cache that cannot be written (a read-only folder, a full disk) is said once, in one
line, and the command goes on compiling as it would without it: JAX's own warning,
one per compiled program, is not shown.
"""

from __future__ import annotations

import hashlib
import os
import platform

ENV = "MHA_JAX_COMPILE_CACHE"
OFF = ("off", "none", "0", "false", "no")
# JAX's warning when a cache entry cannot be read or written (jax._src.compiler)
JAX_FAULT = ("Error writing persistent compilation cache entry",
             "Error reading persistent compilation cache entry")
_SAID: dict = {}       # "path": the cache now in use; "said": its fault said already


def default_root(environ=None) -> str:
  """$XDG_CACHE_HOME/mha-jax/xla, ~/.cache/mha-jax/xla without it."""
  environ = os.environ if environ is None else environ
  base = environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
  return os.path.join(base, "mha-jax", "xla")


def _cpu_identity(cpuinfo: str | None = None) -> str:
  """The CPU's model name and feature flags (Linux /proc/cpuinfo), else platform's."""
  if cpuinfo is None:
    try:
      with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
        cpuinfo = f.read(1 << 16)
    except OSError:
      cpuinfo = ""
  keep = {}
  for line in cpuinfo.splitlines():
    name, _, value = line.partition(":")
    name = name.strip()
    if name in ("model name", "flags", "Features", "CPU part", "CPU implementer"):
      keep.setdefault(name, " ".join(sorted(value.split())))
  return "|".join(f"{k}={v}" for k, v in sorted(keep.items())) or platform.processor()


def machine_key(cpuinfo: str | None = None) -> str:
  """A short name for this machine's kind and JAX's version, e.g.
  "jax0.10.2-x86_64-3f2a9c1d0b7e" (the last part: a hash of the CPU's model and flags)."""
  import jax
  import jaxlib
  cpu = hashlib.sha256(_cpu_identity(cpuinfo).encode()).hexdigest()[:12]
  return (f"jax{jax.__version__}-jaxlib{jaxlib.__version__}-{platform.system().lower()}-"
          f"{platform.machine()}-{cpu}")


def resolve(flag: str | None = None, environ=None) -> str | None:
  """The folder the cache uses (None: off), from the flag, the environment, or the
  default (see the module's docstring)."""
  environ = os.environ if environ is None else environ
  value = flag if flag is not None else environ.get(ENV)
  if value is not None:
    value = value.strip()
    if value.lower() in OFF:
      return None
    if not value:
      from mha_jax.errors import UserError
      raise UserError(f"--compile-cache must name a folder or be 'off'; got {flag!r}"
                      if flag is not None else f"{ENV} must name a folder or be 'off'; got ''")
    return os.path.join(os.path.abspath(os.path.expanduser(value)), machine_key())
  if environ.get("JAX_COMPILATION_CACHE_DIR"):
    return environ["JAX_COMPILATION_CACHE_DIR"]
  return os.path.join(default_root(environ), machine_key())


def enable(flag: str | None = None) -> str | None:
  """Points JAX's persistent cache at `resolve(flag)` (before the first compile) or
  turns it off; returns the folder (None: off). A folder that cannot be made turns the
  cache off rather than failing the command."""
  import jax
  path = resolve(flag)
  if path is None:
    jax.config.update("jax_enable_compilation_cache", False)
    return None
  try:
    os.makedirs(path, exist_ok=True)
  except OSError:
    jax.config.update("jax_enable_compilation_cache", False)
    return None
  jax.config.update("jax_enable_compilation_cache", True)
  jax.config.update("jax_compilation_cache_dir", path)
  say_faults_once(path)
  jax.config.update("jax_persistent_cache_min_compile_time_secs",
                    float(os.environ.get("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", 0)))
  return path


def say_faults_once(path: str) -> None:
  """JAX's warnings that a cache entry cannot be written or read become one line for
  the cache at `path` (the first; the others are dropped); other warnings pass."""
  import sys
  import warnings
  _SAID.update(path=path, said=False)
  if _SAID.get("hooked"):
    return
  _SAID["hooked"] = True
  shown = warnings.showwarning

  def show(message, category, filename, lineno, file=None, line=None):
    text = str(message)
    if not text.startswith(JAX_FAULT):
      return shown(message, category, filename, lineno, file, line)
    if not _SAID["said"]:
      _SAID["said"] = True
      why = " ".join(text.split("': ", 1)[-1].split())[:160]
      print(f"mha-jax: warning: the compile cache {_SAID['path']} cannot be "
            f"{'written' if 'writing' in text else 'read'} ({why}); programs are compiled "
            f"as without it (--compile-cache off turns it off)", file=sys.stderr, flush=True)
  warnings.showwarning = show
