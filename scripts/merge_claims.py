"""Merge the settings of one `mha-jax claims` run into a committed claims.json, and
rewrite that folder's REPORT.md: each claim's cells of the new run's settings replace
or join the committed ones, in the settings' order; the new run's workdirs, seconds and
machine record (mha_jax.machine.machine: platform, cores, date, the load average now; and
the note on the load where given) are recorded per setting under "runs".

  python scripts/merge_claims.py COMMITTED_DIR NEW_DIR ["a note on the load"]
"""

import json
import os
import sys

from mha_jax.harness.claims import run as claims_run
from mha_jax.machine import machine


def merge(base: dict, new: dict, note: str = "") -> dict:
  order = list(claims_run.SETTINGS)
  ran = [s for s in new["settings"]]
  by_name = {c["name"]: c for c in base["claims"]}
  for c in new["claims"]:
    old = by_name.setdefault(c["name"], {**c, "settings": {}})
    cells = {**old["settings"], **{s: v for s, v in c["settings"].items() if s in ran}}
    old["settings"] = {s: cells[s] for s in order if s in cells}
    old["verdict"] = "; ".join(f"{s}: {v['verdict']}" for s, v in old["settings"].items()
                               if "per_seed" in v)
    old["seconds"] = round(sum(v.get("seconds", 0) for v in old["settings"].values()), 1)
  settings = {**base["settings"], **new["settings"]}
  base["settings"] = {s: settings[s] for s in order if s in settings}
  base["workdirs"] = {**base.get("workdirs", {}),
                      **{k: v for k, v in new.get("workdirs", {}).items() if v}}
  ran_on = {**machine(), **({"load": note} if note else {})}
  base.setdefault("runs", []).append({"settings": ran, "seconds": new["seconds"],
                                      "workdirs": {k: v for k, v in new["workdirs"].items()
                                                   if v}, "machine": ran_on})
  base["seconds"] = round(base["seconds"] + new["seconds"], 1)
  return base


def main(argv):
  base_dir, new_dir = argv[0], argv[1]
  base = json.load(open(os.path.join(base_dir, "claims.json")))
  new = json.load(open(os.path.join(new_dir, "claims.json")))
  out = merge(base, new, argv[2] if len(argv) > 2 else "")
  with open(os.path.join(base_dir, "claims.json"), "w") as f:
    json.dump(out, f, indent=1)
  with open(os.path.join(base_dir, "REPORT.md"), "w") as f:
    f.write(claims_run.format_report({**out, "primer": None}))
  print(f"merged {', '.join(new['settings'])} into {base_dir}/claims.json and REPORT.md")


if __name__ == "__main__":
  main(sys.argv[1:])
