"""The machine record every results JSON carries under "machine": one function, one set
of keys, so a page reads every benchmark's and study's machine the same way.

    from mha_jax.machine import machine
    doc = {"rows": rows, "machine": machine(matmul_gflops=rate)}

A matmul rate is measured by the caller (mha_jax.harness.bench.matmul_gflops, the harness)
and passed in; this module never times anything.
"""

from __future__ import annotations

import os
import platform
import time

import jax

from mha_jax.errors import UserError

DATE_FORMAT = "%Y-%m-%d %H:%M UTC"


def machine(matmul_gflops: float | None = None) -> dict:
  """What a measurement ran on, now, as a plain JSON-ready dict.

  Keys: backend ("cpu", "gpu", "tpu"), device_kind (jax.devices()[0]'s), device_count,
  cpu_count (the machine's CPUs), cores_used (the CPUs this process may run on: its
  affinity where the OS tells it, else cpu_count), platform (platform.platform()), python,
  jax (versions), date (UTC, DATE_FORMAT), load_average (1, 5 and 15 minute load averages,
  None where the OS has none), and matmul_gflops where the caller passes the float32
  matmul rate it measured (GFLOP/s) in the same run.
  """
  if matmul_gflops is not None and not (isinstance(matmul_gflops, (int, float))
                                        and matmul_gflops > 0):
    raise UserError(f"matmul_gflops must be a positive number of GFLOP/s, got "
                    f"{matmul_gflops!r}", setting="matmul_gflops")
  cpus = os.cpu_count() or 0
  affinity = getattr(os, "sched_getaffinity", None)
  load = getattr(os, "getloadavg", None)
  device = jax.devices()[0]
  record = {"backend": jax.default_backend(), "device_kind": device.device_kind,
            "device_count": jax.device_count(), "cpu_count": cpus,
            "cores_used": len(affinity(0)) if affinity else cpus,
            "platform": platform.platform(), "python": platform.python_version(),
            "jax": jax.__version__, "date": time.strftime(DATE_FORMAT, time.gmtime()),
            "load_average": [round(x, 2) for x in load()] if load else None}
  if matmul_gflops is not None:
    record["matmul_gflops"] = float(matmul_gflops)
  return record



THP_DEFRAG = "/sys/kernel/mm/transparent_hugepage/defrag"


def avoid_hugepage_stalls(defrag_file: str = THP_DEFRAG) -> bool:
  """Stops NumPy asking for transparent huge pages where the kernel would stall on them.

  NumPy madvises every large array MADV_HUGEPAGE. Where the kernel's THP defrag mode is
  "madvise" or "defer+madvise", each first touch of such an array may then compact
  memory synchronously: on a 2-core VM filling a 680 MB array took 9 s instead of
  0.3 s, and importing Gemma 3 270M 38 s instead of 24 s. The CLI and the tests call
  this first; an explicit NUMPY_MADVISE_HUGEPAGE in the environment is left as the
  user set it. Returns whether it turned the madvise off.
  """
  if "NUMPY_MADVISE_HUGEPAGE" in os.environ:
    return False
  try:
    with open(defrag_file) as f:
      mode = f.read().split("[", 1)[1].split("]", 1)[0]
  except (OSError, IndexError):
    return False
  if mode not in ("madvise", "defer+madvise"):
    return False
  numpy_hugepages(False)
  return True


def numpy_hugepages(enabled: bool | None = None) -> bool:
  """Whether NumPy madvises its large arrays MADV_HUGEPAGE (its NUMPY_MADVISE_HUGEPAGE,
  read only at import); with `enabled`, sets it. Returns the setting before the call."""
  import numpy as np
  core = getattr(np, "_core", None) or np.core      # NumPy 2 / NumPy 1.26
  if enabled is None:
    return bool(core.multiarray._get_madvise_hugepage())
  return bool(core.multiarray._set_madvise_hugepage(bool(enabled)))
