"""Multi-process start-up: one call to `jax.distributed.initialize`, from flags or env.

On a TPU VM slice `initialize(auto=True)` lets JAX find the coordinator itself. Anywhere
else (several processes on one machine, GPU hosts) the coordinator address, the number
of processes and this process's id are given, as flags or as the environment variables
MHA_JAX_COORDINATOR, MHA_JAX_NUM_PROCESSES and MHA_JAX_PROCESS_ID. CPU processes
exchange collectives over gloo.
"""

from __future__ import annotations

import os

import jax

from mha_jax.errors import UserError

ENV = {"coordinator": "MHA_JAX_COORDINATOR", "num_processes": "MHA_JAX_NUM_PROCESSES",
       "process_id": "MHA_JAX_PROCESS_ID"}


def settings(coordinator: str | None = None, num_processes: int | None = None,
             process_id: int | None = None, environ=os.environ) -> dict | None:
  """The multi-process settings from the arguments, else the environment; None if unset.

  Raises ValueError, naming the flag (and its variable), when only some are given or a
  value is malformed.
  """
  given = {"coordinator": coordinator, "num_processes": num_processes,
           "process_id": process_id}
  for name, var in ENV.items():
    if given[name] is None and environ.get(var, "") != "":
      given[name] = environ[var]
  if all(v is None for v in given.values()):
    return None
  missing = [n for n, v in given.items() if v is None]
  if missing:
    flags = ", ".join(f"--{n.replace('_', '-')} (or {ENV[n]})" for n in missing)
    raise UserError(f"a multi-process run needs --coordinator, --num-processes and "
                     f"--process-id; missing {flags}")
  coord = str(given["coordinator"])
  host, _, port = coord.rpartition(":")
  if not host or not port.isdigit() or not 0 < int(port) < 65536:
    raise UserError(f"--coordinator must be HOST:PORT; got {coord!r}")
  out = {"coordinator": coord}
  for name in ("num_processes", "process_id"):
    try:
      out[name] = int(given[name])
    except (TypeError, ValueError):
      raise UserError(f"--{name.replace('_', '-')} must be an integer; got "
                       f"{given[name]!r}") from None
  if out["num_processes"] < 1:
    raise UserError(f"--num-processes must be >= 1; got {out['num_processes']}")
  if not 0 <= out["process_id"] < out["num_processes"]:
    raise UserError(f"--process-id must be in [0, {out['num_processes']}); got "
                     f"{out['process_id']}")
  return out


def initialize(coordinator: str | None = None, num_processes: int | None = None,
               process_id: int | None = None, *, auto: bool = False) -> bool:
  """Starts JAX's multi-process runtime if asked to; returns whether it did.

  Must run before anything touches a JAX backend. `auto` (the --multihost flag) lets
  JAX discover the cluster (Cloud TPU VMs, SLURM).
  """
  s = settings(coordinator, num_processes, process_id)
  if s is None and not auto:
    return False
  # CPU devices of different processes talk through gloo (no effect on TPU/GPU devices).
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  if s is None:
    jax.distributed.initialize()
  else:
    jax.distributed.initialize(s["coordinator"], num_processes=s["num_processes"],
                               process_id=s["process_id"])
  return True
