"""Metrics to DIR/metrics.jsonl (one JSON object a line) and TensorBoard event files."""

from __future__ import annotations

import json
import os
import time


class MetricsWriter:

  def __init__(self, workdir: str, enabled: bool = True):
    self.enabled = enabled
    self.path = os.path.join(workdir, "metrics.jsonl")
    self._tb = None
    if enabled:
      from tensorboardX import SummaryWriter
      self._tb = SummaryWriter(os.path.join(workdir, "tb"))

  def write(self, step: int, split: str, values: dict) -> None:
    if not self.enabled:
      return
    rec = {"step": int(step), "split": split, "time": time.time(),
           **{k: float(v) for k, v in values.items()}}
    with open(self.path, "a") as f:
      f.write(json.dumps(rec) + "\n")
    for k, v in values.items():
      self._tb.add_scalar(f"{split}/{k}", float(v), int(step))

  def close(self) -> None:
    if self._tb is not None:
      self._tb.close()


def read_metrics(workdir: str) -> list[dict]:
  path = os.path.join(workdir, "metrics.jsonl")
  if not os.path.exists(path):
    return []
  with open(path) as f:
    return [json.loads(l) for l in f if l.strip()]
