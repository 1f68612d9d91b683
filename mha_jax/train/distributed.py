"""Multi-process start-up, shared decisions, and a watchdog for lost processes.

On a TPU VM slice `initialize(auto=True)` lets JAX find the coordinator itself. Anywhere
else (several processes on one machine, GPU hosts) the coordinator address, the number
of processes and this process's id are given, as flags or as the environment variables
MHA_JAX_COORDINATOR, MHA_JAX_NUM_PROCESSES and MHA_JAX_PROCESS_ID. CPU processes
exchange collectives over gloo.

Faults (docs/guide/faults.md):
- Start-up: JAX's `initialization_timeout` (--startup-timeout, MHA_JAX_STARTUP_TIMEOUT)
  bounds the wait for the coordinator and the other processes; a failure is one line.
- A lost process: each process publishes a heartbeat in the coordination service's
  key-value store and a watchdog thread reads everyone's. A process silent for
  --process-timeout seconds (MHA_JAX_PROCESS_TIMEOUT, default 60), or one that failed
  and said so, makes every other process print one line naming it and exit
  (EXIT_LOST), without waiting in a collective or JAX's shutdown barrier. JAX's own
  heartbeat timeout is set longer, so its C++ abort never comes first.
- A duplicate --process-id: every process but 0 claims its id from process 0's
  coordinator process (on the port after --coordinator's) before JAX registers it; the
  second claim of an id is one line.
- Decisions (resume from which step, nothing to do): process 0 takes them and `share`s
  them, so every process takes the same path even when their views of the workdir
  differ (a stale bucket listing).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import subprocess
import sys
import threading
import time
from typing import Any, Callable

import jax

from mha_jax.errors import UserError
from mha_jax.settings import setting


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainOptions:
  """The settings of `train`: the processes of a multi-process run (`initialize`'s)."""
  multihost: bool = setting(False, help="call jax.distributed.initialize() and let JAX "
                            "find the cluster (Cloud TPU VM slices)")
  coordinator: str | None = setting(None, help="HOST:PORT of process 0, for a "
                                    "multi-process run (or MHA_JAX_COORDINATOR)")
  num_processes: str | None = setting(None, help="number of processes (or "
                                      "MHA_JAX_NUM_PROCESSES)")
  process_id: str | None = setting(None, help="this process's id, 0..N-1 (or "
                                   "MHA_JAX_PROCESS_ID)")
  process_timeout: str | None = setting(None, help="seconds without a heartbeat after "
                                        "which a process counts as lost and every other "
                                        "one stops (or MHA_JAX_PROCESS_TIMEOUT; default 60)")
  startup_timeout: str | None = setting(None, help="seconds to wait for the coordinator "
                                        "and every process at start-up (or "
                                        "MHA_JAX_STARTUP_TIMEOUT; default 300)")
  step_timeout: str | None = setting(None, help="seconds without progress on any process "
                                     "(a main thread frozen while its heartbeat goes on) "
                                     "after which every process stops (or "
                                     "MHA_JAX_STEP_TIMEOUT; default 900)")

ENV = {"coordinator": "MHA_JAX_COORDINATOR", "num_processes": "MHA_JAX_NUM_PROCESSES",
       "process_id": "MHA_JAX_PROCESS_ID"}
TIMEOUT_ENV = {"process_timeout": "MHA_JAX_PROCESS_TIMEOUT",
               "startup_timeout": "MHA_JAX_STARTUP_TIMEOUT",
               "step_timeout": "MHA_JAX_STEP_TIMEOUT"}
DEFAULT_TIMEOUTS = {"process_timeout": 60.0, "startup_timeout": 300.0, "step_timeout": 900.0}
EXIT_LOST = 1
PREFIX = "mha-jax/"


def settings(coordinator: str | None = None, num_processes: int | None = None,
             process_id: int | None = None, environ=os.environ) -> dict | None:
  """The multi-process settings from the arguments, else the environment; None if unset.

  Raises ValueError, naming the setting (and its variable), when only some are given or
  a value is malformed.
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
    names = ", ".join(f"{n} (or {ENV[n]})" for n in missing)
    raise UserError(f"a multi-process run needs coordinator, num_processes and "
                    f"process_id; missing {names}",
                    setting=("coordinator", "num_processes", "process_id", *missing))
  coord = str(given["coordinator"])
  host, _, port = coord.rpartition(":")
  if not host or not port.isdigit() or not 0 < int(port) < 65536:
    raise UserError(f"coordinator must be HOST:PORT; got {coord!r}", setting="coordinator")
  out = {"coordinator": coord}
  for name in ("num_processes", "process_id"):
    try:
      out[name] = int(given[name])
    except (TypeError, ValueError):
      raise UserError(f"{name} must be an integer; got {given[name]!r}",
                      setting=name) from None
  if out["num_processes"] < 1:
    raise UserError(f"num_processes must be >= 1; got {out['num_processes']}",
                    setting="num_processes")
  if not 0 <= out["process_id"] < out["num_processes"]:
    raise UserError(f"process_id must be in [0, {out['num_processes']}); got "
                    f"{out['process_id']}", setting="process_id")
  return out


def timeouts(process_timeout: float | None = None, startup_timeout: float | None = None,
             step_timeout: float | None = None, environ=os.environ) -> dict[str, float]:
  """{"process_timeout", "startup_timeout", "step_timeout"} in seconds: the arguments,
  else the environment, else DEFAULT_TIMEOUTS. Each must be a number >= 1."""
  given = {"process_timeout": process_timeout, "startup_timeout": startup_timeout,
           "step_timeout": step_timeout}
  out = {}
  for name, var in TIMEOUT_ENV.items():
    v = given[name]
    if v is None:
      v = environ.get(var) or DEFAULT_TIMEOUTS[name]
    try:
      out[name] = float(v)
    except (TypeError, ValueError):
      out[name] = float("nan")
    if not out[name] >= 1:
      raise UserError(f"{name} (or {var}) must be a number of seconds >= 1; got {v!r}",
                      setting=name)
  return out


def _client():
  from jax._src import distributed as jd   # the client JAX's own multihost utils use
  return jd.global_state.client


def _start_error(e: BaseException, s: dict | None, startup: float) -> UserError:
  """One line for a start-up that failed: which setting to check."""
  text = " ".join(str(e).split())
  where = (f"--coordinator {s['coordinator']}, --num-processes {s['num_processes']}, "
           f"--process-id {s['process_id']}" if s else "the cluster JAX detected")
  if "DEADLINE_EXCEEDED" in text or "timed out" in text.lower() or "Barrier" in text:
    why = (f"not every process connected within --startup-timeout={startup:g} s: the "
           f"coordinator is unreachable (wrong host or port, process 0 not started, a "
           f"firewall), --num-processes is more than the processes started, or two "
           f"processes have the same --process-id")
  elif "ALREADY_EXISTS" in text or "duplicate" in text.lower() or "restart" in text.lower():
    why = "another process registered with the same --process-id"
  else:
    why = "the coordination service refused this process"
  return UserError(f"multi-process start-up failed ({where}): {why}. JAX said: "
                   f"{text[:300]}")


_state: dict[str, Any] = {"watchdog": None, "context": "", "counter": {}, "progress": 0}


def initialize(coordinator: str | None = None, num_processes: int | None = None,
               process_id: int | None = None, *, auto: bool = False,
               process_timeout: float | None = None,
               startup_timeout: float | None = None,
               step_timeout: float | None = None) -> bool:
  """Starts JAX's multi-process runtime if asked to, and the lost-process watchdog;
  returns whether it did.

  Must run before anything touches a JAX backend. `auto` (the --multihost flag) lets
  JAX discover the cluster (Cloud TPU VMs, SLURM). A start-up that fails raises
  UserError within startup_timeout.
  """
  s = settings(coordinator, num_processes, process_id)
  tm = timeouts(process_timeout, startup_timeout, step_timeout)
  if s is None and not auto:
    return False
  # CPU devices of different processes talk through gloo (no effect on TPU/GPU devices).
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  # JAX's own start-up timeout ends in a C++ abort: ours (_startup_guard) comes first
  kw = dict(initialization_timeout=int(tm["startup_timeout"]) + 30,
            # longer than the watchdog's, so that one speaks first (JAX's own ends in a
            # C++ abort and a stack dump)
            heartbeat_timeout_seconds=int(2 * tm["process_timeout"] + 30),
            shutdown_timeout_seconds=int(tm["process_timeout"]))
  guard = _startup_guard(s, tm["startup_timeout"])
  try:
    if s is not None and s["process_id"] != 0:
      _claim(s)
    if s is None:
      jax.distributed.initialize(**kw)
    else:
      with _service_apart(s, kw, tm):
        jax.distributed.initialize(s["coordinator"], num_processes=s["num_processes"],
                                   process_id=s["process_id"], **kw)
  except UserError:
    raise
  except Exception as e:  # noqa: BLE001 - XlaRuntimeError and friends: one line
    raise _start_error(e, s, tm["startup_timeout"]) from None
  finally:
    guard.set()
  if jax.process_count() > 1:
    _state["watchdog"] = Watchdog(tm["process_timeout"], tm["step_timeout"]).start()
  return True


def _claim(s: dict) -> None:
  """Claims --process-id from process 0's coordinator process (train/coordinator.py, on
  the port after --coordinator's) before JAX registers it: a duplicate id is one line
  here, where JAX's runtime would abort the process that held it first. An unreachable
  coordinator is retried until the start-up guard ends the wait."""
  import socket
  host, _, port = s["coordinator"].rpartition(":")
  while True:
    try:
      with socket.create_connection((host.strip("[]"), int(port) + 1), timeout=5) as c:
        c.sendall(f"{s['process_id']}\n".encode())
        reply = c.makefile().readline().strip()
      break
    except OSError:
      time.sleep(0.2)
  if reply != "ok":
    raise UserError(
        f"multi-process start-up failed (coordinator {s['coordinator']}, "
        f"num_processes {s['num_processes']}, process_id {s['process_id']}): "
        f"another process took process_id {s['process_id']} first; give every "
        f"process its own id, 0 to {s['num_processes'] - 1}",
        setting=("coordinator", "num_processes", "process_id", "process_id"))


def _startup_guard(s: dict | None, startup: float) -> threading.Event:
  """A thread that ends this process with one line unless the returned event is set
  within `startup` seconds (a connect or a registration barrier that never completes
  would otherwise end in JAX's C++ abort)."""
  done = threading.Event()

  def guard():
    if not done.wait(startup):
      print(f"mha-jax: error: {_start_error(TimeoutError('timed out'), s, startup)}",
            file=sys.stderr, flush=True)
      os._exit(2)

  threading.Thread(target=guard, daemon=True, name="mha-jax start-up guard").start()
  return done


@contextlib.contextmanager
def _service_apart(s: dict, kw: dict, tm: dict):
  """On process 0: the coordination service started in a process of its own
  (train/coordinator.py), and jax.distributed.initialize told not to start one."""
  if s["process_id"] != 0 or s["num_processes"] < 2:
    yield
    return
  from jax._src import distributed as jd
  port = s["coordinator"].rpartition(":")[2]
  proc = subprocess.Popen(
      [sys.executable, "-m", "mha_jax.train.coordinator", port, str(s["num_processes"]),
       str(kw["heartbeat_timeout_seconds"]), str(kw["shutdown_timeout_seconds"]),
       str(kw["initialization_timeout"]), str(tm["process_timeout"] + 15)],
      stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, stderr=subprocess.DEVNULL, text=True,
      start_new_session=True)
  line = proc.stdout.readline().strip()
  if line != "ready":
    proc.kill()
    raise UserError(f"multi-process start-up failed: process 0 cannot start its id service "
                    f"on port {port} (coordinator {s['coordinator']}) "
                    f"({line or 'it exited'})", setting="coordinator")
  _state["service"] = proc
  real = jd._jax

  class NoService:    # jax.distributed.initialize's _jax, without a service of its own
    def __getattr__(self, name):
      return getattr(real, name)

    @staticmethod
    def get_distributed_runtime_service(*args, **kwargs):
      return None

  jd._jax = NoService()
  try:
    yield
  except BaseException:
    proc.kill()
    raise
  finally:
    jd._jax = real


def multi() -> bool:
  return jax.process_count() > 1


def set_context(text: str) -> None:
  """What the lost-process line says about resuming (e.g. the workdir)."""
  _state["context"] = text


def _key(name: str) -> str:
  n = _state["counter"][name] = _state["counter"].get(name, 0) + 1
  return f"{PREFIX}{name}/{n}"


def _wait_ms() -> int:
  w = _state["watchdog"]
  return int(1000 * (w.timeout if w else DEFAULT_TIMEOUTS["process_timeout"])) * 10


def share(name: str, fn: Callable[[], Any]) -> Any:
  """fn() computed on process 0 only; its (JSON) value returned on every process.

  A UserError raised by fn is raised on every process, with the same message. Every
  process must call share with the same names in the same order. On one process this
  is just fn().
  """
  if not multi():
    return fn()
  key = _key(f"share/{name}")
  if jax.process_index() == 0:
    try:
      value = fn()
    except UserError as e:
      _client().key_value_set(key, json.dumps({"error": str(e)}))
      raise
    except BaseException as e:
      _client().key_value_set(key, json.dumps({"bug": f"{type(e).__name__}: {e}"}))
      raise
    _client().key_value_set(key, json.dumps({"value": value}))
    return value
  got = json.loads(_client().blocking_key_value_get(key, _wait_ms()))
  if "error" in got:
    raise UserError(got["error"])
  if "bug" in got:
    raise RuntimeError(f"process 0 failed deciding {name}: {got['bug']}")
  return got["value"]


def gather(name: str, value: Any) -> list:
  """Every process's (JSON) value, in process order. [value] on one process."""
  if not multi():
    return [value]
  key = _key(f"gather/{name}")
  c = _client()
  c.key_value_set(f"{key}/{jax.process_index()}", json.dumps(value))
  return [json.loads(c.blocking_key_value_get(f"{key}/{i}", _wait_ms()))
          for i in range(jax.process_count())]


def progress() -> None:
  """Marks a step of this process's main thread (a training step, a save, an
  evaluation begun or ended); the watchdog publishes the count with its heartbeat."""
  _state["progress"] += 1


class Watchdog:
  """Heartbeats and progress of every process through the coordination service's
  key-value store.

  Every `timeout / 10` seconds this process publishes its beat and its progress count
  (`progress`) and reads everyone's. A process whose beat has not moved for `timeout`
  seconds is lost (it died, or froze whole: SIGSTOP); a process that published a failure
  (`fail`) has failed; a coordinator that stops answering is lost too. Once the steps
  have begun, no progress on any process for `step_timeout` seconds is a stall: a main
  thread frozen while its heartbeat goes on leaves the others waiting in a collective
  for ever. The processes behind the others are named (or, all at one point, none). On
  any of them this process prints one line and exits EXIT_LOST at once (os._exit: a
  collective or JAX's shutdown barrier would wait for the lost process).
  """

  def __init__(self, timeout: float, step_timeout: float = DEFAULT_TIMEOUTS["step_timeout"],
               lost: Callable[[int | None, str], bool] | None = None):
    """lost(process or None, why): what a loss or a stall does (default: say it, exit)."""
    self.timeout, self.step_timeout = float(timeout), float(step_timeout)
    self.lost = lost or self._lost
    self.interval = max(0.2, self.timeout / 10)
    self.me, self.n = jax.process_index(), jax.process_count()
    self._stop = threading.Event()
    self._beats = 0
    self._seen: dict[int, tuple[str, float]] = {}
    self._moved: tuple[tuple, float] = ((), time.monotonic())   # progress, when it moved
    self._thread = threading.Thread(target=self._run, daemon=True, name="mha-jax watchdog")

  def start(self) -> "Watchdog":
    self._beat()
    self._thread.start()
    return self

  def _beat(self) -> None:
    self._beats += 1
    _client().key_value_set(f"{PREFIX}beat/{self.me}", f"{self._beats} {_state['progress']}",
                            allow_overwrite=True)

  def _run(self) -> None:
    while not self._stop.wait(self.interval):
      try:
        self._beat()
        entries = dict(_client().key_value_dir_get(PREFIX))
      except Exception as e:  # noqa: BLE001 - the coordination service is gone
        if self._stop.is_set():
          return
        self._lost(0, f"(the coordinator) was lost: it stopped answering "
                      f"({' '.join(str(e).split())[:120]})")
        return
      if self.check(entries, time.monotonic()):
        return

  def check(self, entries: dict, now: float) -> bool:
    """Whether a process was lost or failed, or the steps stalled (said, and exiting)."""
    steps = {}
    for i in range(self.n):
      if f"{PREFIX}done/{i}" in entries:
        continue
      beat = entries.get(f"{PREFIX}beat/{i}")
      steps[i] = int(beat.split()[1]) if beat and len(beat.split()) == 2 else 0
      if i == self.me:
        continue
      failed = entries.get(f"{PREFIX}failed/{i}")
      if failed is not None:
        return self.lost(i, f"failed: {failed}")
      last = self._seen.get(i)
      if last is None or last[0] != beat:
        self._seen[i] = (beat, now)
      elif now - last[1] > self.timeout:
        return self.lost(i, f"was lost: no heartbeat for {now - last[1]:.0f} s (it died, "
                             f"was killed or froze; --process-timeout={self.timeout:g})")
    key = tuple(sorted(steps.items()))
    if key != self._moved[0]:
      self._moved = (key, now)
    elif max(steps.values(), default=0) > 0 and now - self._moved[1] > self.step_timeout:
      return self._stalled(steps, now - self._moved[1])
    return False

  def _stalled(self, steps: dict, seconds: float) -> bool:
    low, high = min(steps.values()), max(steps.values())
    behind = [i for i, s in steps.items() if s == low]
    how = f"no process made progress for {seconds:.0f} s (--step-timeout={self.step_timeout:g})"
    if low == high:
      return self.lost(None, f"{how}; every process is at the same point: a collective "
                              f"that never completes, or a step that never ends")
    who = ", ".join(map(str, behind))
    return self.lost(None, f"{how}: process(es) {who} of {self.n} stopped behind the "
                            f"others (frozen, or stuck in a call), which wait for them")

  def _lost(self, i: int | None, why: str) -> bool:
    if self._stop.is_set():
      return True
    ctx = _state["context"]
    head = (f"{why}; process {self.me} of {self.n} stops" if i is None else
            f"process {i} of {self.n} {why}; process {self.me} stops too")
    print(f"mha-jax: error: {head}. Run the same command on every process to resume from "
          f"the last complete checkpoint{' in ' + ctx if ctx else ''}", file=sys.stderr,
          flush=True)
    sys.stdout.flush()
    os._exit(EXIT_LOST)

  def stop(self) -> None:
    self._stop.set()


def finish(error: str | None = None) -> None:
  """Tells the other processes that this one ends: normally (error None), or failing
  with `error` (their watchdogs then stop too, naming it). Stops the watchdog."""
  w = _state["watchdog"]
  if w is None:
    return
  w.stop()
  key = f"{PREFIX}done/{w.me}" if error is None else f"{PREFIX}failed/{w.me}"
  try:
    _client().key_value_set(key, error or "ok", allow_overwrite=True)
  except Exception:  # noqa: BLE001 - the coordinator is gone already
    pass
  _state["watchdog"] = None
  if error is None:   # every process meets at JAX's shutdown barrier, then the service ends
    jax.distributed.shutdown()
    proc = _state.pop("service", None)
    if proc is not None:
      proc.terminate()
      proc.wait(timeout=10)


def failed(e: BaseException) -> None:
  """Ends this process after an unexpected error `e` in a multi-process run, never
  returning. A runtime error (a collective or a barrier whose peer is gone: gloo says
  "Connection closed by peer") waits for the watchdog to name the lost process, at most
  the process timeout; anything else is a bug: its traceback, then the other processes
  are told."""
  import traceback
  w = _state["watchdog"]
  if w is not None and isinstance(e, jax.errors.JaxRuntimeError):
    w._thread.join(w.timeout + 3 * w.interval)   # it exits the process if a peer is lost
  traceback.print_exception(e, file=sys.stderr)
  finish(f"{type(e).__name__}: {' '.join(str(e).split())[:200]}")
  sys.stderr.flush()
  sys.stdout.flush()
  os._exit(EXIT_LOST)


def preempted(step: int) -> bool:
  """Whether the processes agreed to stop at `step` for a preemption (SIGTERM to any of
  them: JAX's preemption sync manager picks one step for all)."""
  from jax.experimental import multihost_utils
  return bool(multihost_utils.reached_preemption_sync_point(step))
