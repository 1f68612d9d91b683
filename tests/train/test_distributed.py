"""Multi-process training on one machine: 2 processes x 2 CPU devices, gloo collectives."""

import os
import signal
import socket
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

import mha_jax
from mha_jax.train import checkpoint as ckpt_lib
from mha_jax.train import distributed
from mha_jax.train.metrics import read_metrics
from builders import with_devices

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = ["--config", "configs/induction.py", "--config.model.d_model=16",
        "--config.data.vocab_size=12", "--config.data.half_len=6",
        "--config.data.min_half_len=3", "--config.model.max_len=13",
        "--config.train.batch_size=8", "--config.eval.lm_batches=1",
        "--config.eval.batch_size=8", "--config.train.warmup=2",
        "--config.train.progress=false", "--config.train.eval_every=1000"]


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


def _env(devices: int) -> dict:
  return with_devices(devices)


def _start(wd, steps, procs=2, *extra, env_flags=False):
  """Starts `procs` training processes (2 devices each) on a fresh port."""
  port = _free_port()
  out = []
  for i in range(procs):
    args = [sys.executable, "-m", "mha_jax.cli", "train", *TINY, *extra,
            f"--config.train.steps={steps}", "--workdir", wd]
    env = _env(2)
    if env_flags:     # the environment variables, as the TPU launch script can use
      env.update(MHA_JAX_COORDINATOR=f"localhost:{port}", MHA_JAX_NUM_PROCESSES=str(procs),
                 MHA_JAX_PROCESS_ID=str(i))
    else:
      args += ["--coordinator", f"localhost:{port}", "--num-processes", str(procs),
               "--process-id", str(i)]
    out.append(subprocess.Popen(args, cwd=ROOT, env=env, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
  return out


def _finish(procs, timeout=240):
  logs = [p.communicate(timeout=timeout)[0] for p in procs]
  for p, log in zip(procs, logs):
    assert p.returncode == 0, log[-3000:]
  return logs


def _params(wd, step):
  c = ckpt_lib.Checkpoints(wd, read_only=True)
  try:
    return c.restore_params(step)[0]
  finally:
    c.close()


def _max_diff(a, b) -> float:
  return max(float(np.max(np.abs(np.asarray(x) - np.asarray(y))))
             for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


EVERY = ["--config.train.checkpoint_every=10", "--config.train.log_every=10"]


@pytest.mark.slow   # 3 training subprocesses, 2 of them coupled (~26 s)
def test_two_processes_train_like_one_and_write_once(tmp_path):
  two, one = str(tmp_path / "two"), str(tmp_path / "one")
  logs = _finish(_start(two, 20, 2, *EVERY))
  assert '"status": "done"' in logs[0] and "step 20/20" in logs[0]
  assert "step 20/20" not in logs[1]             # only process 0 speaks
  # The same global batch on one process with the same 4 devices.
  r = subprocess.run([sys.executable, "-m", "mha_jax.cli", "train", *TINY, *EVERY,
                      "--config.train.steps=20", "--workdir", one], cwd=ROOT, env=_env(4),
                     text=True, capture_output=True, timeout=240)
  assert r.returncode == 0, r.stdout + r.stderr
  diff = _max_diff(_params(two, 20), _params(one, 20))
  print(f"2-process vs 1-process max |param diff| after 20 steps: {diff:.3g}")
  assert diff <= 1e-6
  # Written once: two checkpoints, one metrics row per logged step.
  assert sorted(os.listdir(os.path.join(two, "checkpoints"))) == ["10", "20"]
  assert [m["step"] for m in read_metrics(two) if m["split"] == "train"] == [10, 20]
  # ... and restored by one process on one device.
  loaded = mha_jax.load(two)
  assert loaded.step == 20 and _max_diff(loaded.params, _params(one, 20)) <= 1e-6


@pytest.mark.slow
def test_sigkill_of_one_process_then_restart_of_both_resumes(tmp_path):
  """SIGKILL one process once a checkpoint exists; the other is stuck without it and is
  killed too (as a scheduler would); restarting both resumes from the checkpoint."""
  killed, ref = str(tmp_path / "killed"), str(tmp_path / "ref")
  every = ["--config.train.checkpoint_every=4", "--config.train.log_every=4"]
  procs = _start(killed, 40, 2, *every, env_flags=True)
  deadline = time.time() + 180
  ckdir = os.path.join(killed, "checkpoints")
  while time.time() < deadline and not any(
      d.isdigit() and int(d) >= 8 for d in (os.listdir(ckdir) if os.path.isdir(ckdir) else [])):
    time.sleep(0.05)
  procs[1].send_signal(signal.SIGKILL)
  procs[1].wait()
  time.sleep(1.0)
  procs[0].send_signal(signal.SIGKILL)
  procs[0].communicate()
  killed_at = max(int(d) for d in os.listdir(ckdir) if d.isdigit())
  assert 8 <= killed_at < 40                      # the kill interrupted training
  logs = _finish(_start(killed, 40, 2, *every))
  assert f"resumed from step {killed_at}" in logs[0]
  _finish(_start(ref, 40, 2, *every))
  assert _max_diff(_params(killed, 40), _params(ref, 40)) <= 1e-6


@pytest.mark.parametrize("kw, env, match", [
    (dict(coordinator="localhost:1234"), {}, "missing num_processes"),
    (dict(coordinator="nohost", num_processes=2, process_id=0), {}, "HOST:PORT"),
    (dict(coordinator="h:1", num_processes="two", process_id=0), {}, "num_processes must"),
    (dict(coordinator="h:1", num_processes=2, process_id=2), {}, r"process_id must be in \[0, 2\)"),
    ({}, {"MHA_JAX_COORDINATOR": "h:1", "MHA_JAX_NUM_PROCESSES": "2"}, "MHA_JAX_PROCESS_ID"),
])
def test_multi_process_settings_are_checked(kw, env, match):
  with pytest.raises(ValueError, match=match):
    distributed.settings(**kw, environ=env)


def test_multi_process_settings_from_flags_or_environment():
  assert distributed.settings(environ={}) is None
  env = {"MHA_JAX_COORDINATOR": "10.0.0.2:8476", "MHA_JAX_NUM_PROCESSES": "4",
         "MHA_JAX_PROCESS_ID": "3"}
  assert distributed.settings(environ=env) == {"coordinator": "10.0.0.2:8476",
                                               "num_processes": 4, "process_id": 3}
  # A flag wins over its variable.
  assert distributed.settings(process_id=1, environ=env)["process_id"] == 1


def test_fault_timeouts_from_flags_or_environment():
  assert distributed.timeouts(environ={}) == {"process_timeout": 60.0,
                                              "startup_timeout": 300.0,
                                              "step_timeout": 900.0}
  env = {"MHA_JAX_PROCESS_TIMEOUT": "15", "MHA_JAX_STARTUP_TIMEOUT": "20",
         "MHA_JAX_STEP_TIMEOUT": "40"}
  assert distributed.timeouts(environ=env) == {"process_timeout": 15.0,
                                               "startup_timeout": 20.0,
                                               "step_timeout": 40.0}
  assert distributed.timeouts(process_timeout="7", environ=env)["process_timeout"] == 7.0
  for bad in ("soon", "0", "nan", "-3"):
    with pytest.raises(ValueError, match=r"process_timeout \(or MHA_JAX_PROCESS_TIMEOUT\) "
                                         r"must be a number of seconds >= 1"):
      distributed.timeouts(process_timeout=bad, environ={})
  with pytest.raises(ValueError, match="startup_timeout"):
    distributed.timeouts(environ={"MHA_JAX_STARTUP_TIMEOUT": "x"})
  with pytest.raises(ValueError, match=r"step_timeout \(or MHA_JAX_STEP_TIMEOUT\)"):
    distributed.timeouts(environ={"MHA_JAX_STEP_TIMEOUT": "0.5"})


def test_the_watchdog_names_a_lost_heartbeat_and_a_stall_of_the_steps():
  """The watchdog's decisions on made-up key-value entries of 3 processes (no JAX
  cluster): a heartbeat that stops; a main thread frozen behind the others while its
  heartbeat goes on; every process stuck at one point; a finished process ignored."""
  said = []

  def watchdog():
    said.clear()
    w = distributed.Watchdog(timeout=10, step_timeout=30,
                             lost=lambda i, why: said.append((i, why)) or True)
    w.me, w.n = 0, 3
    return lambda t, beats, **extra: w.check(
        {**{f"mha-jax/beat/{i}": b for i, b in beats.items()}, **extra}, t)
  check = watchdog()
  # every beat and step moves: nothing to say
  for t in range(0, 60, 5):
    assert not check(t, {0: f"{t} {t}", 1: f"{t} {t}", 2: f"{t} {t}"})
  # process 2's main thread freezes at step 55 (its beat goes on); 0 and 1 run ahead to
  # 57 and wait in a collective: a stall named after step_timeout, not before
  for t in range(60, 91, 5):
    assert not check(t, {0: f"{t} 57", 1: f"{t} 57", 2: f"{t} 55"})
  assert check(95, {0: "95 57", 1: "95 57", 2: "95 55"})
  (who, why), = said
  assert who is None and "no process made progress for 35 s (--step-timeout=30)" in why
  assert "process(es) 2 of 3 stopped behind the others" in why
  # all at one point
  check = watchdog()
  for t in (100, 120):
    assert not check(t, {0: f"{t} 60", 1: f"{t} 60", 2: f"{t} 60"})
  assert check(131, {0: "131 60", 1: "131 60", 2: "131 60"})
  assert "every process is at the same point" in said[0][1]
  # a heartbeat that stops (SIGSTOP: the whole process froze) is named after timeout
  check = watchdog()
  assert not check(200, {0: "1 61", 1: "1 61", 2: "7 61"})
  assert not check(209, {0: "2 62", 1: "2 62", 2: "7 61"})
  assert check(211, {0: "3 63", 1: "3 63", 2: "7 61"})
  assert said == [(2, "was lost: no heartbeat for 11 s (it died, was killed or froze; "
                      "--process-timeout=10)")]
  # before the first step (every count 0) nothing stalls; a finished process is ignored
  check = watchdog()
  for t in (300, 400, 500):
    assert not check(t, {0: f"{t} 0", 1: f"{t} 0"}, **{"mha-jax/done/2": "ok"})
  assert said == []
