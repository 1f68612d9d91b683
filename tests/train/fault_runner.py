"""`python tests/train/fault_runner.py VERB ...`: the mha-jax CLI in a process whose view
of the workdir is faulty, as the environment variable MHA_JAX_TEST_FAULTS (JSON) says:

  {"hide": ["checkpoints/20"]}   such folders (and what they hold) are missing from listings
                                 (a stale bucket listing: they are still there to read)
  {"blind": ["checkpoints/20"]}  ... and missing altogether (a checkpoint another host
                                 has and this one has not)
"""

import json
import os
import sys

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


if __name__ == "__main__":
  _install(json.loads(os.environ.get("MHA_JAX_TEST_FAULTS", "{}")))
  sys.exit(cli.main(sys.argv[1:]))
