"""One writer per workdir: the run marker and the lock.

A workdir `train` writes into is new, empty, or a mha-jax run. A run is recognised by
its marker, MARKER (written by the first `train`, with the time and the command), or,
for runs written before the marker existed, by a config.json that mha-jax wrote (a
task and a model) or a multi-seed manifest. Anything else is a user's folder: refused,
naming what is in it, nothing touched.

While `train` runs it holds LOCK in the workdir: a file created atomically (O_EXCL on
local disks, a conditional create on object stores through fsspec's "xb" mode) holding
the host, the PID, the start time and a heartbeat refreshed every HEARTBEAT_S seconds.
A second `train` on the same workdir refuses, naming the holder. A lock left by a run
that crashed is *stale* (its PID is gone on this host, or its heartbeat is older than
STALE_S seconds) and is taken over with a warning. In a multi-process run process 0
locks for all.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
import threading
import time
import uuid

from mha_jax import storage
from mha_jax.errors import StorageFault, UserError

MARKER = "mha-jax-run.json"
LOCK = "train.lock"
HEARTBEAT_S = 60.0
STALE_S = 600.0
KNOWN_TASKS = ("translation", "lm", "pretrained_lm", "embedding")


def warn(message: str) -> None:
  print(f"mha-jax: warning: {message}", file=sys.stderr)


# ------------------------------------------------------------------ the marker

def _written_by_mha_jax(workdir: str) -> bool:
  """A run from before the marker: a config.json mha-jax wrote, or a seeds manifest."""
  for name, key in (("config.json", "task"), ("seeds.json", "seeds")):
    p = storage.join(workdir, name)
    if not storage.isfile(p):
      continue
    try:
      d = storage.read_json(p)
    except (OSError, ValueError):
      continue
    if isinstance(d, dict) and (d.get(key) in KNOWN_TASKS and isinstance(d.get("model"), dict)
                                if key == "task" else isinstance(d.get(key), list)):
      return True
  return False


def check_workdir(workdir: str) -> str:
  """"new", "empty" or "run"; a file, or a folder holding anything but a mha-jax run,
  is refused (UserError naming what is there). Reads only. Process 0 decides for a
  multi-process run (the others would see its first files appear)."""
  if not storage.is_writer():
    return "run"
  if not storage.exists(workdir):
    return "new"
  if not storage.isdir(workdir):
    raise UserError(f"workdir {workdir!r} is a file, not a folder; train needs a folder "
                    f"(new, empty, or a mha-jax run)", setting="workdir")
  names = [n for n in storage.listdir(workdir) if n != LOCK]
  if not names:
    return "empty"
  if MARKER in names or _written_by_mha_jax(workdir):
    return "run"
  shown = ", ".join(names[:6]) + (f" and {len(names) - 6} more" if len(names) > 6 else "")
  raise UserError(f"workdir {workdir!r} is not empty and holds no mha-jax run (no "
                  f"{MARKER}; it holds {shown}); train writes only into a new or empty "
                  f"folder or a run of its own, and overwrites nothing else. Give another "
                  f"workdir", setting=("workdir", "workdir"))


def write_marker(workdir: str) -> None:
  """Marks `workdir` as a mha-jax run (once; kept as first written)."""
  p = storage.join(workdir, MARKER)
  if not storage.exists(p):
    storage.write_json(p, {"mha_jax": "run", "created": _now(), "command": _command()},
                       atomic=True)


# Folders of a workdir that mha-jax manages: a command's --out may not lie in them (a
# folder in checkpoints/ breaks the checkpoint listing).
MANAGED = ("checkpoints", "checkpoints.bad", "data", "tb")


def check_out(out: str, workdir: str, setting: str = "out") -> None:
  """Refuses an output folder (the setting `setting`) that is the source workdir itself
  or lies inside one of its managed folders (MANAGED)."""
  if storage.normpath(out) == storage.normpath(workdir):
    raise UserError(f"{setting} {out!r} is the source workdir {workdir!r} itself; give a "
                    f"new folder", setting=setting)
  for name in MANAGED:
    if storage.is_within(out, storage.join(workdir, name)):
      raise UserError(f"{setting} {out!r} lies inside {name}/ of the workdir {workdir!r}, "
                      f"which mha-jax manages; give a folder outside it", setting=setting)


# ------------------------------------------------------------------ the lock

def _now() -> str:
  return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())


def _command() -> str:
  return " ".join([storage.basename(sys.argv[0])] + sys.argv[1:])[:500]


def describe(holder: dict) -> str:
  return (f"host {holder.get('host', '?')}, PID {holder.get('pid', '?')}, started "
          f"{holder.get('started', '?')}")


def _read(p: str) -> dict | None:
  for _ in range(3):   # a lock being created may be empty for a moment
    try:
      d = storage.read_json(p)
      if isinstance(d, dict):
        return d
    except FileNotFoundError:
      return None
    except (OSError, ValueError):
      pass
    time.sleep(0.2)
  return {}


def _pid_alive(pid) -> bool:
  try:
    os.kill(int(pid), 0)
  except ProcessLookupError:
    return False
  except (PermissionError, ValueError, TypeError, OverflowError):
    return True      # someone else's process, or no number: assume it runs
  return True


def stale_reason(holder: dict, now: float | None = None) -> str | None:
  """Why a lock's holder no longer runs, or None while it may still run."""
  if not holder:
    return "the lock file is empty or unreadable"
  now = time.time() if now is None else now
  if holder.get("host") == socket.gethostname() and not _pid_alive(holder.get("pid")):
    return f"PID {holder.get('pid')} is no longer running on this host"
  age = now - float(holder.get("heartbeat", 0) or 0)
  if age > STALE_S:
    return f"no heartbeat for {age / 60:.0f} min"
  return None


class Lock:
  """The lock of one workdir, held from acquire() to release()."""

  def __init__(self, workdir: str, *, log=warn):
    self.workdir = workdir
    self.path = storage.join(workdir, LOCK)
    self.log = log
    self.token = uuid.uuid4().hex
    self.info = {"host": socket.gethostname(), "pid": os.getpid(), "started": _now(),
                 "command": _command(), "token": self.token}
    self._stop = threading.Event()
    self._thread = None

  def _payload(self) -> bytes:
    return json.dumps({**self.info, "heartbeat": time.time()}).encode()

  def acquire(self, wait_s: float = 0.0) -> "Lock":
    """Takes the lock; while a live holder has it, waits up to wait_s seconds for it to
    be released (0: refuses at once)."""
    deadline, tries = time.time() + wait_s, 0
    while tries < 3:
      tries += 1
      try:
        created = storage.create_exclusive(self.path, self._payload())
      except StorageFault as e:
        raise StorageFault(f"train: {e}; train writes its checkpoints into workdir "
                           f"{self.workdir!r}: give one on a writable disk",
                           setting="workdir") from None
      if created:
        self._thread = threading.Thread(target=self._beat, daemon=True,
                                        name=f"mha-jax lock {self.path}")
        self._thread.start()
        return self
      holder = _read(self.path)
      if holder is None:       # released meanwhile
        continue
      if holder.get("token") == self.token:   # ours: a retried create that had succeeded
        created = True
      if created:
        self._thread = threading.Thread(target=self._beat, daemon=True,
                                        name=f"mha-jax lock {self.path}")
        self._thread.start()
        return self
      reason = stale_reason(holder)
      if reason is None and time.time() < deadline:
        tries -= 1
        time.sleep(0.2)
        continue
      if reason is None:
        raise UserError(f"workdir {self.workdir!r} is in use by another run: "
                        f"{describe(holder)} (lock {self.path}). Two runs would write "
                        f"the same checkpoints and metrics; wait for it to end or stop it "
                        f"(a lock left by a crashed run is taken over by itself)")
      self.log(f"taking over the stale lock {self.path} of {describe(holder)}: {reason}")
      storage.remove(self.path)
    raise UserError(f"workdir {self.workdir!r}: another process keeps taking the lock "
                    f"{self.path}; refusing to run beside it")

  def _beat(self) -> None:
    while not self._stop.wait(HEARTBEAT_S):
      try:
        if (_read(self.path) or {}).get("token") != self.token:
          return            # taken from us (judged stale): nothing of ours to refresh
        storage.write_bytes(self.path, self._payload(), atomic=True)
      except Exception:  # noqa: BLE001 - a missed heartbeat is no reason to stop training
        pass

  def release(self) -> None:
    self._stop.set()
    if self._thread is not None:
      self._thread.join(timeout=5)
    try:
      if (_read(self.path) or {}).get("token") == self.token:
        storage.remove(self.path)
    except OSError:
      pass


@contextlib.contextmanager
def hold(workdir: str, *, log=warn):
  """The workdir's lock for the block (process 0; the other processes hold nothing).
  A workdir this call created and left empty is removed again."""
  if not storage.is_writer():
    yield None
    return
  created = not storage.exists(workdir)
  try:
    storage.makedirs(workdir)
    lock = Lock(workdir, log=log).acquire()
  except BaseException:
    _remove_if_empty(workdir, created)
    raise
  try:
    yield lock
  finally:
    lock.release()
    _remove_if_empty(workdir, created)


def _remove_if_empty(workdir: str, created: bool) -> None:
  try:
    if created and storage.isdir(workdir) and not storage.listdir(workdir):
      storage.rmdir(workdir)
  except OSError:
    pass
