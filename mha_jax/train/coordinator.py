"""JAX's coordination service in a process of its own, started by process 0.

`python -m mha_jax.train.coordinator PORT NUM_PROCESSES HEARTBEAT_S SHUTDOWN_S REGISTER_S LINGER_S`

JAX runs the service inside process 0 by default; when that process dies, every other
process's runtime sees the socket close and aborts at once with a C++ fatal log and a
stack dump, before anything of ours can speak. Served from here, the service outlives a
lost process 0 by LINGER_S seconds, long enough for the other processes' watchdogs
(train/distributed.py) to notice, say so in one line and exit. It prints "ready" once
it listens, and exits when its parent (process 0) has ended and LINGER_S have passed,
or GRACE_S seconds after a SIGTERM (process 0's normal end).

It also serves the process-id claims on PORT + 1: a process sends its --process-id (one
line) before it registers with JAX, and gets "ok" or "taken" (id 0 is process 0's).
JAX's runtime, given a duplicate id, aborts the first holder with a C++ dump; a claim
ends the second one in one line instead (train/distributed.py).
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import threading
import time


GRACE_S = 3.0


def serve_claims(port: int) -> None:
  """Answers process-id claims on `port` in a daemon thread: the first claim of an id
  gets "ok", any later one "taken"."""
  if socket.has_dualstack_ipv6():
    server = socket.create_server(("", port), family=socket.AF_INET6, dualstack_ipv6=True)
  else:
    server = socket.create_server(("", port))
  claimed = {"0"}

  def answer():
    while True:
      conn, _ = server.accept()
      with conn:
        conn.settimeout(5)
        try:
          pid = conn.makefile().readline().strip()
          conn.sendall(b"taken\n" if pid in claimed else b"ok\n")
          claimed.add(pid)
        except OSError:
          pass

  threading.Thread(target=answer, daemon=True).start()


def main(argv: list[str]) -> int:
  port, n, heartbeat, shutdown, register = (int(a) for a in argv[:5])
  linger = float(argv[5])
  from jax._src.lib import _jax
  parent = os.getppid()
  ending = []
  signal.signal(signal.SIGTERM, lambda *a: ending.append(1))
  try:
    service = _jax.get_distributed_runtime_service(
        f"[::]:{port}", n, heartbeat_timeout=heartbeat, shutdown_timeout=shutdown,
        cluster_register_timeout=register)
    serve_claims(int(port) + 1)
  except Exception as e:  # noqa: BLE001 - the port is taken, ...: process 0 says it
    print(f"error: {' '.join(str(e).split())[:300]}", flush=True)
    return 1
  print("ready", flush=True)
  while os.getppid() == parent and not ending:
    time.sleep(0.5)
  # SIGTERM (process 0 passed JAX's shutdown barrier): the other processes' own
  # disconnects still need the service for a moment (else their runtimes abort)
  time.sleep(GRACE_S if ending else linger)
  del service
  os._exit(0)


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
