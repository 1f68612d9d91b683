"""JAX's coordination service in a process of its own, started by process 0.

`python -m mha_jax.train.coordinator PORT NUM_PROCESSES HEARTBEAT_S SHUTDOWN_S REGISTER_S LINGER_S`

JAX runs the service inside process 0 by default; when that process dies, every other
process's runtime sees the socket close and aborts at once with a C++ fatal log and a
stack dump, before anything of ours can speak. Served from here, the service outlives a
lost process 0 by LINGER_S seconds, long enough for the other processes' watchdogs
(train/distributed.py) to notice, say so in one line and exit. It prints "ready" once
it listens, and exits when its parent (process 0) has ended and LINGER_S have passed,
or at once on SIGTERM (process 0's normal end).
"""

from __future__ import annotations

import os
import signal
import sys
import time


def main(argv: list[str]) -> int:
  port, n, heartbeat, shutdown, register = (int(a) for a in argv[:5])
  linger = float(argv[5])
  from jax._src.lib import _jax
  parent = os.getppid()
  signal.signal(signal.SIGTERM, lambda *a: os._exit(0))
  try:
    service = _jax.get_distributed_runtime_service(
        f"[::]:{port}", n, heartbeat_timeout=heartbeat, shutdown_timeout=shutdown,
        cluster_register_timeout=register)
  except Exception as e:  # noqa: BLE001 - the port is taken, ...: process 0 says it
    print(f"error: {' '.join(str(e).split())[:300]}", flush=True)
    return 1
  print("ready", flush=True)
  while os.getppid() == parent:
    time.sleep(0.5)
  time.sleep(linger)
  del service
  os._exit(0)


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
