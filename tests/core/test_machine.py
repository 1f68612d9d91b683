"""The one machine record (mha_jax.machine.machine): its keys, their types, this machine's
values."""

import datetime
import json
import os
import platform

import jax
import pytest

from mha_jax.errors import UserError
from mha_jax import machine as machine_mod
from mha_jax.machine import DATE_FORMAT, machine

KEYS = {"backend", "device_kind", "device_count", "cpu_count", "cores_used", "platform",
        "python", "jax", "date", "load_average"}


def test_the_record_holds_this_machine_now():
  before = datetime.datetime.now(datetime.timezone.utc).replace(second=0, microsecond=0)
  m = machine()
  assert set(m) == KEYS                       # no matmul rate unless the caller gives one
  assert m["cpu_count"] == os.cpu_count()
  assert m["cores_used"] == len(os.sched_getaffinity(0)) and 1 <= m["cores_used"] <= m["cpu_count"]
  assert m["backend"] == jax.default_backend() and m["device_count"] == jax.device_count()
  assert m["device_kind"] == jax.devices()[0].device_kind
  assert m["jax"] == jax.__version__ and m["python"] == platform.python_version()
  assert m["platform"] == platform.platform()
  when = datetime.datetime.strptime(m["date"], DATE_FORMAT).replace(tzinfo=datetime.timezone.utc)
  assert before <= when <= datetime.datetime.now(datetime.timezone.utc)
  assert len(m["load_average"]) == 3 and all(isinstance(x, float) and x >= 0
                                             for x in m["load_average"])
  assert json.loads(json.dumps(m)) == m        # plain JSON, as written


def test_a_measured_matmul_rate_is_passed_in_and_checked():
  assert machine(matmul_gflops=12)["matmul_gflops"] == 12.0
  for bad in (0, -3.0, "fast", float("nan")):
    with pytest.raises(UserError, match="matmul_gflops") as e:
      machine(matmul_gflops=bad)
    assert e.value.settings == ("matmul_gflops",)


def test_huge_page_madvise_is_turned_off_only_where_the_kernel_would_stall(tmp_path,
                                                                          monkeypatch):
  before = machine_mod.numpy_hugepages()
  try:
    monkeypatch.delenv("NUMPY_MADVISE_HUGEPAGE", raising=False)
    f = tmp_path / "defrag"
    for text, off in (("always defer defer+madvise [madvise] never\n", True),
                      ("always defer [defer+madvise] madvise never\n", True),
                      ("[always] defer defer+madvise madvise never\n", False),
                      ("always [defer] defer+madvise madvise never\n", False),
                      ("", False)):
      f.write_text(text)
      machine_mod.numpy_hugepages(True)
      assert machine_mod.avoid_hugepage_stalls(str(f)) is off, text
      assert machine_mod.numpy_hugepages() is (not off), text
    assert machine_mod.avoid_hugepage_stalls(str(tmp_path / "absent")) is False
    monkeypatch.setenv("NUMPY_MADVISE_HUGEPAGE", "1")      # the user's choice stands
    f.write_text("always defer defer+madvise [madvise] never\n")
    machine_mod.numpy_hugepages(True)
    assert machine_mod.avoid_hugepage_stalls(str(f)) is False
    assert machine_mod.numpy_hugepages() is True
  finally:
    machine_mod.numpy_hugepages(before)
