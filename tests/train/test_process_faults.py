"""Faults of multi-process runs and of storage (issue 31; docs/guide/faults.md): a
finished run launched again, a lost process, an error on one process, preemption,
start-up faults (localhost processes), then a full disk under import and train (no
background tracebacks), a flaky bucket and the lock's race on it.

Every test here is `slow` (most start 2-3 coupled training processes). Run them with
    PYTHONPATH=$PWD python -m pytest -q -n 0 -m slow tests/train/test_process_faults.py -s
(-s prints the measured seconds and parameter differences).
"""

import json
import os
import signal
import subprocess
import sys
import time

from typing import Callable

import pytest

from test_distributed import EVERY, ROOT, TINY, _free_port, _max_diff, _params
from builders import with_devices

RUNNER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fault_runner.py")
TIMEOUT = 10        # --process-timeout of these tests (the default is 60 s)
pytestmark = pytest.mark.slow


def _start(wd, steps, procs=2, ids=None, faults=None, extra=(), num=None, port=None,
           env_extra=None):
  """Training processes (2 devices each) with process ids `ids` (default 0..procs-1);
  faults: {process id: MHA_JAX_TEST_FAULTS of that process}."""
  port = port or _free_port()
  out = []
  for i in ids if ids is not None else range(procs):
    env = {**with_devices(2), "MHA_JAX_PROCESS_TIMEOUT": str(TIMEOUT), **(env_extra or {})}
    if faults and i in faults:
      env["MHA_JAX_TEST_FAULTS"] = json.dumps(faults[i])
    args = [sys.executable, RUNNER, "train", *TINY, *EVERY, *extra,
            f"--config.train.steps={steps}", "--workdir", wd, "--coordinator",
            f"localhost:{port}", "--num-processes", str(num or procs), "--process-id", str(i)]
    out.append(subprocess.Popen(args, cwd=ROOT, env=env, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
  return out


def _wait(procs, timeout=300):
  """[(returncode, output)], every process ended (killed past the timeout)."""
  res = []
  for p in procs:
    try:
      out = p.communicate(timeout=timeout)[0]
    except subprocess.TimeoutExpired:
      p.kill()
      out = p.communicate()[0] + "\n<killed: timed out>"
    res.append((p.returncode, out))
  return res


def _ok(procs):
  res = _wait(procs)
  for rc, out in res:
    assert rc == 0, out[-3000:]
  return [out for _, out in res]


def _no_dump(out: str) -> None:
  """No C++ fatal log, stack dump or Python traceback."""
  for bad in ("Check failure stack trace", "Terminating process", "Traceback", "@     0x"):
    assert bad not in out, out[-3000:]


def _wait_for_checkpoint(wd, step, procs, timeout=240):
  ck = os.path.join(wd, "checkpoints")
  deadline = time.time() + timeout
  while time.time() < deadline:
    if os.path.isdir(os.path.join(ck, str(step))):
      return
    assert all(p.poll() is None for p in procs), "a process ended early"
    time.sleep(0.05)
  raise AssertionError(f"no checkpoint {step} in {timeout} s")


@pytest.fixture(scope="module")
def ref40(tmp_path_factory):
  """An uninterrupted 2-process run of 40 steps."""
  wd = str(tmp_path_factory.mktemp("ref") / "ref")
  _ok(_start(wd, 40))
  return _params(wd, 40)


def test_finished_and_partly_finished_runs_launched_again(tmp_path, ref40):
  wd = str(tmp_path / "run")
  _ok(_start(wd, 20))
  # Launched again: process 0 decides "nothing to do" for both, even when process 1
  # sees no checkpoint at all.
  for faults in (None, {1: {"blind": ["checkpoints"]}}):
    logs = _ok(_start(wd, 20, faults=faults))
    assert "nothing to do" in logs[0] and '"step": 20' in logs[1], logs
    assert sorted(os.listdir(os.path.join(wd, "checkpoints"))) == ["10", "20"]
  # A checkpoint process 1 cannot see: both refuse in one line, nothing written.
  res = _wait(_start(wd, 40, faults={1: {"blind": ["checkpoints/20"]}}))
  for rc, out in res:
    assert rc == 2 and "process(es) [1] do not see checkpoint 20" in out, out[-2000:]
    _no_dump(out)
  assert sorted(os.listdir(os.path.join(wd, "checkpoints"))) == ["10", "20"]
  # Partly finished, with a stale listing on process 1 (no step 20 in it): both resume
  # from process 0's step 20 and end where an uninterrupted run ends.
  logs = _ok(_start(wd, 40, faults={1: {"hide": ["checkpoints/20"]}}))
  assert "resumed from step 20" in logs[0]
  diff = _max_diff(_params(wd, 40), ref40)
  print(f"\nlaunched again from step 20: max |param diff| vs uninterrupted: {diff:.3g}")
  assert diff <= 1e-6


@pytest.mark.parametrize("victim", [1, 0])
def test_a_lost_process_stops_the_others_in_one_line_and_a_relaunch_resumes(
    tmp_path, ref40, victim):
  wd = str(tmp_path / "run")
  procs = _start(wd, 40, extra=["--config.train.checkpoint_every=5"])
  _wait_for_checkpoint(wd, 10, procs)
  procs[victim].send_signal(signal.SIGKILL)
  killed = time.time()
  (rc, out), = _wait([p for i, p in enumerate(procs) if i != victim], timeout=120)
  seconds = time.time() - killed
  line = [l for l in out.splitlines() if l.startswith("mha-jax:")]
  print(f"\nSIGKILL of process {victim}: the other exited {rc} after {seconds:.1f} s "
        f"(--process-timeout={TIMEOUT}): {line}")
  assert rc != 0 and len(line) == 1 and f"process {victim} of 2 was lost" in line[0]
  assert "run the same command on every process to resume" in line[0].lower()
  _no_dump(out)
  assert seconds < TIMEOUT + 20      # a bound, not a timing: it would hang for ever
  _wait(procs[victim:victim + 1])
  logs = _ok(_start(wd, 40))
  assert "resumed from step" in logs[0]
  diff = _max_diff(_params(wd, 40), ref40)
  print(f"relaunch after the loss of process {victim}: max |param diff| vs "
        f"uninterrupted: {diff:.3g}")
  assert diff <= 1e-6


def test_a_lost_process_of_four_stops_the_other_three_and_a_relaunch_resumes(tmp_path,
                                                                             ref40):
  wd, victim = str(tmp_path / "run"), 2
  procs = _start(wd, 40, procs=4, extra=["--config.train.checkpoint_every=5"])
  _wait_for_checkpoint(wd, 10, procs)
  procs[victim].send_signal(signal.SIGKILL)
  killed = time.time()
  others = [p for i, p in enumerate(procs) if i != victim]
  res, ended = [], []
  for p in others:                  # when each one ended, as measured from here
    res += _wait([p], timeout=120)
    ended.append(time.time() - killed)
  _wait(procs[victim:victim + 1])
  for k, ((rc, out), seconds) in zip([0, 1, 3], zip(res, ended)):
    line = [l for l in out.splitlines() if l.startswith("mha-jax:")]
    print(f"\nSIGKILL of process {victim} of 4: process {k} exited {rc} after "
          f"{seconds:.1f} s (--process-timeout={TIMEOUT}): {line}")
    assert rc != 0 and len(line) == 1 and f"process {victim} of 4 was lost" in line[0], \
        out[-3000:]
    _no_dump(out)
  assert max(ended) < TIMEOUT + 20    # a bound, not a timing: it would hang for ever
  logs = _ok(_start(wd, 40, procs=4))
  assert "resumed from step" in logs[0]
  diff = _max_diff(_params(wd, 40), ref40)
  print(f"relaunch of 4 after the loss of process {victim}: max |param diff| vs an "
        f"uninterrupted 2-process run: {diff:.3g}")
  assert diff <= 1e-6


def test_an_error_on_one_process_stops_the_others_naming_it(tmp_path):
  wd, port = str(tmp_path / "run"), _free_port()
  good = _start(wd, 20, ids=[0], num=2, port=port)
  bad = _start(wd, 20, ids=[1], num=2, port=port, extra=["--config.train.lr=-1"])
  (rc0, out0), (rc1, out1) = _wait(good + bad, timeout=120)
  print(f"\nan error on process 1: {out1.strip().splitlines()[-1]}\nprocess 0: "
        f"{out0.strip().splitlines()[-1]}")
  assert rc1 == 2 and "mha-jax: error: train.lr must be > 0" in out1
  assert rc0 == 1 and "process 1 of 2 failed: train.lr must be > 0" in out0
  _no_dump(out0)
  _no_dump(out1)


@pytest.mark.parametrize("who", ["all", "one"])
def test_sigterm_to_all_or_one_process_saves_one_step_and_resumes(tmp_path, ref40, who):
  wd = str(tmp_path / "run")
  procs = _start(wd, 40)
  _wait_for_checkpoint(wd, 10, procs)
  for p in procs if who == "all" else procs[1:]:
    p.send_signal(signal.SIGTERM)
  sent = time.time()
  res = _wait(procs, timeout=120)
  seconds = time.time() - sent
  for rc, out in res:
    assert rc == 0 and '"status": "preempted"' in out, out[-3000:]
    _no_dump(out)
  steps = {json.loads(out.strip().splitlines()[-1])["step"] for _, out in res}
  assert len(steps) == 1            # one step for all
  step, = steps
  print(f"\nSIGTERM to {who}: both saved step {step} and exited 0 after {seconds:.1f} s")
  assert 10 <= step < 40 and os.path.isdir(os.path.join(wd, "checkpoints", str(step)))
  logs = _ok(_start(wd, 40))
  assert f"resumed from step {step}" in logs[0]
  diff = _max_diff(_params(wd, 40), ref40)
  print(f"resume after SIGTERM to {who}: max |param diff| vs uninterrupted: {diff:.3g}")
  assert diff <= 1e-6


@pytest.mark.parametrize("case", ["unreachable", "too many", "duplicate id"])
def test_start_up_faults_end_in_one_line_within_the_start_up_timeout(tmp_path, case):
  wd, startup = str(tmp_path / "run"), 8
  env = {"MHA_JAX_STARTUP_TIMEOUT": str(startup)}
  if case == "unreachable":      # no process 0: nothing listens on the port
    procs = _start(wd, 4, ids=[1], num=2, env_extra=env)
  elif case == "too many":       # --num-processes 3, two started
    procs = _start(wd, 4, ids=[0, 1], num=3, env_extra=env)
  else:
    procs = _start(wd, 4, ids=[0, 1, 1], num=3, env_extra=env)
  began = time.time()
  res = _wait(procs, timeout=startup + 120)
  seconds = time.time() - began     # from the launch: Python and JAX start first
  taken = 0
  for k, (rc, out) in enumerate(res):
    line = [l for l in out.splitlines() if l.startswith("mha-jax:")]
    print(f"\n{case}: process {k} exit {rc} after {seconds:.1f} s: {line}")
    assert rc != 0 and "<killed: timed out>" not in out
    assert len(line) == 1 and "start-up failed" in line[0], out[-3000:]
    _no_dump(out)
    taken += "another process took --process-id 1 first" in line[0]
  # a duplicate id: the second claim of it is refused; the others wait for a process 2
  assert taken == (1 if case == "duplicate id" else 0)


# ---------------------------------------------------------------------------
# Background tracebacks: orbax's threads report a full disk themselves (absl logging,
# with a traceback) before the caller says it in one line; those reports are dropped.

def test_orbax_background_reports_of_storage_faults_are_dropped():
  import logging
  from mha_jax.train import checkpoint as ckpt_lib
  ckpt_lib.quiet_storage_faults()
  ckpt_lib.quiet_storage_faults()           # once, however often it is asked
  log = logging.getLogger("absl")
  assert log.filters.count(ckpt_lib.QUIET_FILTER) == 1

  def record(exc):
    return logging.LogRecord("absl", logging.ERROR, __file__, 1, "raised: %s", (exc,),
                             (type(exc), exc, None))
  full = ValueError('RESOURCE_EXHAUSTED: Error writing "wv/0.0.0" in OCDBT database: '
                    'No space left on device')
  assert not ckpt_lib.QUIET_FILTER.filter(record(full))
  assert not ckpt_lib.QUIET_FILTER.filter(record(OSError(30, "Read-only file system")))
  assert ckpt_lib.QUIET_FILTER.filter(record(KeyError("a bug")))     # a bug keeps its traceback
  assert ckpt_lib.QUIET_FILTER.filter(logging.LogRecord("absl", logging.ERROR, __file__, 1,
                                                  "no exception", (), None))


@pytest.fixture
def full_disk(tmp_path, request):
  """A small tmpfs, 3 MB or the size the test's parameter names (root only; skipped
  elsewhere)."""
  mnt = tmp_path / "full"
  mnt.mkdir()
  size = getattr(request, "param", "3M")
  r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mnt)],
                     capture_output=True, timeout=30)
  if r.returncode:
    pytest.skip(f"cannot mount a small tmpfs here ({r.stderr.decode().strip()})")
  yield str(mnt)
  subprocess.run(["umount", str(mnt)], timeout=30)


@pytest.mark.parametrize("full_disk", ["600k"], indirect=True)
def test_train_onto_a_full_disk_says_one_line(full_disk):
  wd = os.path.join(full_disk, "run")
  r = subprocess.run([sys.executable, "-m", "mha_jax.cli", "train", "--config",
                      "configs/induction.py", "--config.model.d_model=64",
                      "--config.train.steps=40", "--config.train.checkpoint_every=10",
                      "--config.train.progress=false", "--config.train.eval_every=1000",
                      "--workdir", wd], cwd=ROOT, env=with_devices(1), capture_output=True,
                     text=True, timeout=300)
  print(f"\ntrain onto a full disk, exit {r.returncode}, stderr:\n{r.stderr}")
  assert r.returncode == 2
  assert r.stderr.count("\n") == 1 and "the disk is full" in r.stderr, r.stderr[-3000:]
  assert not [d for d in os.listdir(os.path.join(wd, "checkpoints")) if "tmp" in d]


def test_import_onto_a_full_disk_says_one_line_and_leaves_nothing(full_disk):
  r = subprocess.run([sys.executable, "-m", "mha_jax.cli", "import", "minilm-l6",
                      "--workdir", os.path.join(full_disk, "m")], cwd=ROOT,
                     env=with_devices(1), capture_output=True, text=True, timeout=300)
  print(f"\nimport onto a full disk, exit {r.returncode}, stderr:\n{r.stderr}")
  assert r.returncode == 2
  assert r.stderr.count("\n") == 1 and "the disk is full" in r.stderr, r.stderr[-3000:]
  assert os.listdir(full_disk) == []


# ---------------------------------------------------------------------------
# A flaky object store: the fake bucket of test_storage.py with injected faults.

from test_storage import fake_gcs  # noqa: E402,F401 - the fixture
from builders import TINY_INDUCTION, tiny  # noqa: E402


class HttpError(OSError):
  """What gcsfs raises for an HTTP error status."""

  def __init__(self, code: int, message: str):
    super().__init__(message)
    self.code = code


def _flaky(monkeypatch, fails: Callable[[str, str], int | None]):
  """Every call of the fake bucket's open/exists/isdir/info/ls/makedirs/rm goes through
  fails(method, path): an HTTP code to fail with, or None. Returns the failures seen."""
  import fsspec
  cls = fsspec.get_filesystem_class("gcs")
  seen = []
  for name in ("open", "exists", "isdir", "info", "ls", "makedirs", "rm"):
    real = getattr(cls, name)

    def method(self, path, *a, _real=real, _name=name, **k):
      code = fails(_name, str(path))
      if code is not None:
        seen.append((_name, str(path), code))
        raise HttpError(code, f"{code} {'Service Unavailable' if code == 503 else 'Forbidden'}"
                              f": {path}")
      return _real(self, path, *a, **k)
    monkeypatch.setattr(cls, name, method)
  return seen


GS = ("--config.train.steps=8", "--config.train.checkpoint_every=4",
      "--config.train.eval_every=100", "--config.train.log_every=4",
      "--config.train.progress=false")


def test_transient_bucket_errors_are_retried_with_backoff_and_logged(fake_gcs, monkeypatch,
                                                                    capsys):
  from mha_jax import storage
  from mha_jax.train import loop
  calls = [0]

  def fails(method, path):
    """Every 7th call on the run's own files fails with 503, 6 failures in all (orbax's
    checkpoint I/O has gcsfs's and TensorStore's own retries on a real bucket)."""
    if "/checkpoints" in path:
      return None
    calls[0] += 1
    return 503 if calls[0] % 7 == 0 and calls[0] <= 42 else None
  seen = _flaky(monkeypatch, fails)
  monkeypatch.setattr(storage, "RETRIES", {})
  monkeypatch.setenv(storage.RETRY_ENV, "30")
  res = loop.train(tiny("configs/induction.py", TINY_INDUCTION, *GS), "gs://bucket/run",
                   log=lambda s: None)
  err = capsys.readouterr().err
  warnings = [l for l in err.splitlines() if "retry" in l]
  print(f"\nflaky bucket: {len(seen)} injected 503s, retries {storage.RETRIES}; e.g. "
        f"{warnings[:1]}")
  assert res["status"] == "done" and res["step"] == 8
  assert len(seen) == 6 and sum(storage.RETRIES.values()) == 6 and len(warnings) == 6
  assert all("503 Service Unavailable" in w and "retry 1 in 0.5 s" in w for w in warnings)


def test_a_bucket_that_keeps_failing_or_forbids_is_one_line_naming_the_object(
    fake_gcs, monkeypatch, capsys):
  from mha_jax import cli as cli_mod
  from mha_jax import storage
  monkeypatch.setenv(storage.RETRY_ENV, "2")     # 0.5 + 1 s of waiting, then give up
  args = ["train", "--config", os.path.join(ROOT, "configs/induction.py"), *TINY_INDUCTION,
          *GS]
  rule = [lambda m, p: 503 if p.endswith("config.json") else None]
  _flaky(monkeypatch, lambda m, p: rule[0](m, p))
  assert cli_mod.main([*args, "--workdir", "gs://bucket/a"]) == 2
  err = capsys.readouterr().err
  line = err.strip().splitlines()[-1]
  print(f"\nstill failing: {line}")
  assert err.count("; retry ") == 2 and line.startswith("mha-jax: error:")
  assert "gs://bucket/a/config.json" in line and "after 3 tries" in line
  # A 403 on the second checkpoint: one line naming it, that checkpoint not listed.
  rule[0] = lambda m, p: 403 if "/checkpoints/8" in p and m == "open" else None
  assert cli_mod.main([*args, "--workdir", "gs://bucket/b"]) == 2
  err = capsys.readouterr().err
  print(f"forbidden: {err.strip()}")
  assert err.count("\n") == 1 and "access is denied" in err and "checkpoints/8" in err, err
  assert sorted(os.listdir(fake_gcs / "bucket" / "b" / "checkpoints")) == ["4"]


def test_the_lock_on_a_bucket_is_taken_by_one_of_two_racing_processes(tmp_path):
  """Two processes create the same lock on the fake bucket at the same instant, 20
  times: each time exactly one gets it."""
  code = f"""
import sys, time, types
sys.path.insert(0, {os.path.dirname(os.path.abspath(__file__))!r})
import fsspec
from fsspec.implementations.dirfs import DirFileSystem
from fsspec.implementations.local import LocalFileSystem
from etils.epath import backend
root = {str(tmp_path)!r}
class FakeGCS(DirFileSystem):
  protocol = ("gs", "gcs")
  def __init__(self, *a, **k):
    super().__init__(path=root, fs=LocalFileSystem())
  @classmethod
  def _strip_protocol(cls, path):
    return str(path).replace("gs://", "").rstrip("/")
fsspec.register_implementation("gcs", FakeGCS, clobber=True)
backend.fsspec_backend._get_filesystem.cache_clear()
from mha_jax import storage
start = float(sys.argv[1])
won = []
for i in range(20):
  while time.time() < start + 0.2 * i:
    pass
  won.append(storage.create_exclusive(f"gs://bucket/lock{{i}}", sys.argv[2].encode()))
print("".join("1" if w else "0" for w in won))
"""
  (tmp_path / "bucket").mkdir()
  start = time.time() + 8
  procs = [subprocess.Popen([sys.executable, "-c", code, str(start), name], cwd=ROOT,
                            env=with_devices(1), stdout=subprocess.PIPE, text=True)
           for name in ("a", "b")]
  outs = [p.communicate(timeout=120)[0].strip() for p in procs]
  assert all(len(o) == 20 for o in outs), outs
  for i in range(20):
    assert outs[0][i] != outs[1][i]           # one winner
    holder = (tmp_path / "bucket" / f"lock{i}").read_text()
    assert holder == ("a" if outs[0][i] == "1" else "b")


def _cut(monkeypatch, where: str):
  """The first write to a fake-bucket object whose path ends with `where` is cut off
  halfway: half its bytes reach the bucket, then the connection resets. Returns the
  cut objects."""
  import fsspec
  cls = fsspec.get_filesystem_class("gcs")
  real, cut = cls.open, []

  class Cut:
    def __init__(self, f, text):
      self.f, self.data = f, "" if text else b""

    def write(self, b):
      self.data += b
      return len(b)

    def __enter__(self):
      return self

    def __exit__(self, *exc):
      self.close()

    def close(self):
      self.f.write(self.data[:len(self.data) // 2])
      self.f.close()
      raise ConnectionResetError(f"connection reset: the write of {cut[-1]} was cut off "
                                 f"after {len(self.data) // 2} of {len(self.data)} bytes")

  def open_(self, path, mode="rb", *a, **k):
    f = real(self, path, mode, *a, **k)
    if ("w" in mode or "x" in mode) and str(path).endswith(where) and not cut:
      cut.append(str(path))
      return Cut(f, "b" not in mode)
    return f
  monkeypatch.setattr(cls, "open", open_)
  return cut


@pytest.mark.parametrize("where", ["checkpoints/8/meta/metadata",
                                   "checkpoints/8/params/_METADATA",
                                   "checkpoints/8/commit_success.txt"])
def test_a_write_cut_off_halfway_never_lists_the_checkpoint_and_a_resume_takes_the_last(
    fake_gcs, monkeypatch, capsys, caplog, where):
  from mha_jax import cli as cli_mod
  from mha_jax.train import checkpoint as ckpt_lib
  args = ["train", "--config", os.path.join(ROOT, "configs/induction.py"), *TINY_INDUCTION,
          *GS[1:]]
  assert cli_mod.main([*args, "--config.train.steps=12", "--workdir", "gs://bucket/ref"]) == 0
  ref = _params("gs://bucket/ref", 12)
  capsys.readouterr()
  cut = _cut(monkeypatch, where)
  rc = cli_mod.main([*args, "--config.train.steps=12", "--workdir", "gs://bucket/run"])
  err = capsys.readouterr().err
  assert cut and rc == 2 and err.count("\n") == 1 and err.startswith("mha-jax: error:")
  assert "checkpoint 8" in err and "gs://bucket/run/checkpoints/8" in err, err
  loud = [r.getMessage() for r in caplog.records if r.exc_info and r.levelno >= 40 and
          ckpt_lib.QUIET_FILTER.filter(r)]      # what would print after the line
  assert not loud, loud
  c = ckpt_lib.Checkpoints("gs://bucket/run", read_only=True)
  try:
    assert c.all_steps() == [4]              # the cut checkpoint is not listed
  finally:
    c.close()
  assert cli_mod.main([*args, "--config.train.steps=12", "--workdir", "gs://bucket/run"]) == 0
  assert "resumed from step 4" in "".join(capsys.readouterr())
  diff = _max_diff(_params("gs://bucket/run", 12), ref)
  print(f"\ncut off {cut}: exit {rc}, stderr: {err.strip()}\nresumed after the cut: "
        f"max |param diff| vs uninterrupted: {diff:.3g}")   # after capsys's last read
  assert diff <= 1e-6


# ---------------------------------------------------------------------------
# A process frozen (SIGSTOP, or a main thread stuck while its heartbeat goes on), and a
# process killed in the middle of a checkpoint write (issue 44).

def _lines(out: str) -> list[str]:
  return [l for l in out.splitlines() if l.startswith("mha-jax:")]


def test_a_process_stopped_with_sigstop_ends_the_others_in_one_line_and_a_relaunch_resumes(
    tmp_path, ref40):
  wd = str(tmp_path / "run")
  procs = _start(wd, 40, extra=["--config.train.checkpoint_every=5"])
  _wait_for_checkpoint(wd, 10, procs)
  procs[1].send_signal(signal.SIGSTOP)      # alive, frozen: the others wait in a collective
  stopped = time.time()
  (rc, out), = _wait(procs[:1], timeout=120)
  seconds = time.time() - stopped
  line = _lines(out)
  print(f"\nSIGSTOP of process 1: process 0 exited {rc} after {seconds:.1f} s "
        f"(--process-timeout={TIMEOUT}): {line}")
  assert rc != 0 and len(line) == 1 and "process 1 of 2 was lost" in line[0], out[-3000:]
  _no_dump(out)
  assert seconds < TIMEOUT + 20      # a bound, not a timing: it would wait for ever
  procs[1].send_signal(signal.SIGKILL)
  _wait(procs[1:])
  logs = _ok(_start(wd, 40))
  assert "resumed from step" in logs[0]
  diff = _max_diff(_params(wd, 40), ref40)
  print(f"relaunch after SIGSTOP: max |param diff| vs uninterrupted: {diff:.3g}")
  assert diff == 0.0


def test_a_main_thread_frozen_with_its_heartbeat_alive_is_a_stall_every_process_ends(
    tmp_path, ref40):
  """Process 1's main thread stops before step 15; its watchdog thread keeps beating, so
  only the watchdog on step progress (--step-timeout) ends the run."""
  wd, step_timeout = str(tmp_path / "run"), 12
  procs = _start(wd, 40, faults={1: {"freeze_at": 15}},
                 env_extra={"MHA_JAX_STEP_TIMEOUT": str(step_timeout)})
  _wait_for_checkpoint(wd, 10, procs)
  began = time.time()
  res = _wait(procs, timeout=180)
  seconds = time.time() - began
  for k, (rc, out) in enumerate(res):
    line = _lines(out)
    print(f"\nmain thread of process 1 frozen at step 15: process {k} exited {rc} "
          f"{seconds:.1f} s after checkpoint 10 (--step-timeout={step_timeout}): {line}")
    assert rc != 0 and "<killed: timed out>" not in out, out[-3000:]
    assert len(line) == 1 and "no process made progress for" in line[0], out[-3000:]
    assert f"--step-timeout={step_timeout}" in line[0] and "Run the same command" in line[0]
    assert "process(es) 1 of 2 stopped behind" in line[0] or "same point" in line[0]
    _no_dump(out)
  logs = _ok(_start(wd, 40))
  assert "resumed from step 10" in logs[0]
  diff = _max_diff(_params(wd, 40), ref40)
  print(f"relaunch after the stall: max |param diff| vs uninterrupted: {diff:.3g}")
  assert diff == 0.0


@pytest.mark.parametrize("who", ["process 0", "every process"])
def test_sigkill_in_the_middle_of_a_checkpoint_write_never_lists_it_and_resumes_exactly(
    tmp_path, ref40, who):
  """The save of checkpoint 20 pauses once its items are written into orbax's temporary
  folder (fault_runner's pause_in_save), and is killed there: on process 0 (which
  commits; process 1 waits for it in orbax's barrier), or on both."""
  from mha_jax.train import checkpoint as ckpt_lib
  wd = str(tmp_path / "run")
  victims = [0] if who == "process 0" else [0, 1]
  markers = {i: str(tmp_path / f"paused-{i}") for i in victims}
  procs = _start(wd, 40, faults={i: {"pause_in_save": 20, "marker": markers[i]}
                                 for i in victims})
  deadline = time.time() + 240
  while not all(os.path.exists(m) for m in markers.values()):
    assert time.time() < deadline and all(p.poll() is None for p in procs[:1]), \
        "no paused save"
    time.sleep(0.05)
  for i in victims:
    procs[i].send_signal(signal.SIGKILL)
  res = _wait(procs, timeout=120)
  ck = os.path.join(wd, "checkpoints")
  left = sorted(os.listdir(ck))
  print(f"\nSIGKILL of {who} in the write of checkpoint 20: left {left}; exits "
        f"{[rc for rc, _ in res]}")
  assert any(n.startswith("20.") and "tmp" in n for n in left), left   # killed mid-write
  assert "20" not in left and ckpt_lib.step_dirs(wd) == [10]
  c = ckpt_lib.Checkpoints(wd, read_only=True)
  try:
    assert c.all_steps() == [10]              # the half-written checkpoint is not listed
  finally:
    c.close()
  if who == "process 0":                      # the other one ends in one line
    rc, out = res[1]
    line = _lines(out)
    assert rc != 0 and len(line) == 1 and "process 0 of 2 was lost" in line[0], out[-3000:]
    _no_dump(out)
  logs = _ok(_start(wd, 40))
  assert "resumed from step 10" in logs[0]
  assert not [n for n in os.listdir(ck) if "tmp" in n]     # orbax removed the partial one
  diff = _max_diff(_params(wd, 40), ref40)
  print(f"relaunch after SIGKILL of {who} mid-write: max |param diff| vs uninterrupted: "
        f"{diff:.3g}")
  assert diff == 0.0
