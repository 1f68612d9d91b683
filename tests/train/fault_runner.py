"""`python tests/train/fault_runner.py VERB ...`: the mha-jax CLI in a process whose view
of the workdir is faulty, as the environment variable MHA_JAX_TEST_FAULTS (JSON) says:

  {"hide": ["checkpoints/20"]}   such folders (and what they hold) are missing from listings
                                 (a stale bucket listing: they are still there to read)
  {"blind": ["checkpoints/20"]}  ... and missing altogether (a checkpoint another host
                                 has and this one has not)
  {"pause_in_save": 20, "marker": PATH}  the save of checkpoint 20 stops once every item
                                 is written into orbax's temporary folder, before it is
                                 committed (renamed); PATH is written then, so a test can
                                 kill the process in the middle of the write
  {"freeze_at": 15}              the main thread stops for ever before step 15 (its
                                 heartbeat goes on: the watchdog must see the stall)
"""

import json
import os
import sys
import time

from mha_jax import cli, storage


def _install(faults: dict) -> None:
  hide = tuple(faults.get("hide", ())) + tuple(faults.get("blind", ()))
  blind = tuple(faults.get("blind", ()))

  def gone(p, names) -> bool:
    p = os.fspath(p).rstrip("/") + "/"      # the folder itself or anything inside it
    return any(f"/{n}/" in p for n in names)

  listdir, isdir, exists = storage.listdir, storage.isdir, storage.exists
  storage.listdir = lambda p: [n for n in listdir(p) if not gone(storage.join(p, n), hide)]
  storage.isdir = lambda p: not gone(p, blind) and isdir(p)
  storage.exists = lambda p: not gone(p, blind) and exists(p)
  if "pause_in_save" in faults:
    _pause_in_save(int(faults["pause_in_save"]), faults["marker"])
  if "freeze_at" in faults:
    _freeze_at(int(faults["freeze_at"]))


def _pause_in_save(step: int, marker: str) -> None:
  from orbax.checkpoint._src.handlers import composite_checkpoint_handler as cch
  real = cch.CompositeCheckpointHandler.save

  def save(self, directory, *a, **k):
    out = real(self, directory, *a, **k)
    if os.path.basename(str(directory)).startswith(f"{step}."):   # 20.orbax-checkpoint-tmp-*
      with open(marker, "w") as f:
        f.write(str(directory))
      while True:
        time.sleep(60)
    return out
  cch.CompositeCheckpointHandler.save = save


def _freeze_at(step: int) -> None:
  from mha_jax.train import distributed
  real = distributed.preempted

  def preempted(s):
    while s == step:
      time.sleep(60)
    return real(s)
  distributed.preempted = preempted


if __name__ == "__main__":
  _install(json.loads(os.environ.get("MHA_JAX_TEST_FAULTS", "{}")))
  sys.exit(cli.main(sys.argv[1:]))
