"""Metrics to DIR/metrics.jsonl (one JSON object a line) and TensorBoard event files."""

from __future__ import annotations

import json
import time

from mha_jax import storage


class MetricsWriter:

  def __init__(self, workdir: str, enabled: bool = True):
    self.enabled = enabled
    self.path = storage.join(workdir, "metrics.jsonl")
    # On an object store the lines are kept here (read once) and the file rewritten.
    self._lines = None
    if enabled and storage.is_uri(self.path):
      self._lines = storage.read_text(self.path) if storage.exists(self.path) else ""
    self._tb = None
    if enabled:
      from tensorboardX import SummaryWriter
      tb = storage.join(workdir, "tb")
      if storage.is_uri(tb):
        _register_tb_uri(tb)
      self._tb = SummaryWriter(tb)

  def write(self, step: int, split: str, values: dict) -> None:
    if not self.enabled:
      return
    rec = {"step": int(step), "split": split, "time": time.time(),
           **{k: float(v) for k, v in values.items()}}
    line = json.dumps(rec) + "\n"
    if self._lines is None:
      storage.append_text(self.path, line)
    else:
      self._lines += line
      storage.write_text(self.path, self._lines)
    for k, v in values.items():
      self._tb.add_scalar(f"{split}/{k}", float(v), int(step))

  def close(self) -> None:
    """Flushes the TensorBoard events; a full disk or a read-only place is a
    StorageFault naming the folder."""
    if self._tb is not None:
      tb, self._tb = self._tb, None
      with storage.faults(storage.join(storage.dirname(self.path), "tb"), "metrics"):
        tb.close()


def read_metrics(workdir: str) -> list[dict]:
  path = storage.join(workdir, "metrics.jsonl")
  if not storage.exists(path):
    return []
  return [json.loads(l) for l in storage.read_text(path).splitlines() if l.strip()]


class _UriEventFile:
  """A TensorBoard event file on an object store: buffered, the whole file rewritten
  through storage at each flush (what tensorboardX's own gs:// writer does, without
  google-cloud-storage)."""

  def __init__(self, path: str):
    self.path, self.data = path, bytearray()

  def write(self, b: bytes) -> None:
    self.data += b

  def flush(self) -> None:
    storage.write_bytes(self.path, bytes(self.data))

  def close(self) -> None:
    self.flush()


class _UriEventFiles:
  def open(self, path: str) -> _UriEventFile:
    return _UriEventFile(path)

  def directory_check(self, path: str) -> None:
    storage.makedirs(path)


def _register_tb_uri(path: str) -> None:
  from tensorboardX import record_writer
  record_writer.register_writer_factory(path.split(":")[0], _UriEventFiles())
