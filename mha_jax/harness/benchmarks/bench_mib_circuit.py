"""`mha-jax circuit` with MIB's evaluation: its time cold and warm, and MIB's tasks.

    mha-jax bench mib-circuit --workdir W [--tasks mib-ioi,mib-mcqa,...]
        [--out docs/results/circuits/mib_smollm2.json] [--skip-timing] [--model NAME]

1. The default `circuit` (IOI, 4 pairs) as a fresh process twice on one compile-cache
   folder: cold (empty) and warm. Reported: wall seconds, circuit.json's own seconds (wall
   and process CPU per step), and the command's total over its EAP-IG + the curves (the
   issue's target: <= 3x), in wall and in CPU seconds (CPU: less noisy on a shared machine).
2. Each MIB task (circuits.mib_tasks) with --graph mib (MIB's edge count) and
   --method eap-ig (left points, MIB's): CPR, CMD, the pairs kept, the graph's size.
Each entry records the date and the load average; the machine record is added.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time

from mha_jax.circuits import mib_tasks
from mha_jax.harness.benchmarks import child_env
from mha_jax.settings import setting


@dataclasses.dataclass(frozen=True, kw_only=True)
class MibCircuitOptions:
  """The settings of `bench mib-circuit`."""
  workdir: str = setting(path=True, help="the model's workdir (an imported smollm2-135m)")
  tasks: tuple[str, ...] = setting(mib_tasks.TASKS, choices=mib_tasks.TASKS,
                                   help="the MIB tasks to run")
  out: str = setting("docs/results/circuits/mib_smollm2.json", path=True,
                     help="the JSON file (what it holds is kept, each entry updated)")
  skip_timing: bool = setting(False, help="only the tasks, not the cold and warm timing")
  label: str = setting("timing", help="the key the timing is stored under (e.g. "
                       "timing_before, to keep a measurement before a change)")
  model: str | None = setting(None, help="the model's name in the results (default: the "
                              "workdir)")


def circuit_run(argv, cache: str) -> tuple[float, dict]:
  """(wall seconds, circuit.json) of `mha-jax circuit ARGV` as a fresh process."""
  t0 = time.perf_counter()
  p = subprocess.run([sys.executable, "-m", "mha_jax.cli", *argv, "--compile-cache", cache],
                     capture_output=True, text=True, env=child_env())
  if p.returncode != 0:
    raise RuntimeError(f"{' '.join(argv)} failed:\n{p.stderr[-3000:]}")
  with open(os.path.join(argv[argv.index("--out") + 1], "circuit.json")) as f:
    return round(time.perf_counter() - t0, 2), json.load(f)


def stamp() -> dict:
  return {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
          "load_average": [round(x, 2) for x in os.getloadavg()]}


def timing(workdir: str, tmp: str) -> dict:
  out = {}
  cache = os.path.join(tmp, "xla")
  for run_name in ("cold", "warm"):
    argv = ["circuit", "--workdir", workdir, "--task", "ioi", "--n-pairs", "4",
            "--out", os.path.join(tmp, run_name)]
    wall, doc = circuit_run(argv, cache)
    sec = doc["seconds"]
    # the curves: one step for every method since search.curves (before: curve_NAME)
    own = sec["eap_ig"] + sec.get("curves", sec.get("curve_eap-ig", 0.0))
    cpu = doc.get("cpu_seconds", {})
    own_cpu = cpu["eap_ig"] + cpu["curves"] if cpu else None
    out[run_name] = {"argv": argv[:-2], "wall_s": wall, "seconds": sec,
                     "eap_ig_plus_curve_s": round(own, 2),
                     "total_over_eap_ig_plus_curve": round(sec["total"] / own, 2),
                     "wall_over_eap_ig_plus_curve": round(wall / own, 2),
                     **({"cpu_seconds": cpu, "cpu_total_over_eap_ig_plus_curve":
                         round(cpu["total"] / own_cpu, 2)} if cpu else {}),
                     "cpr": doc["cpr"], "cmd": doc["cmd"], "chosen": doc["chosen"], **stamp()}
    print(run_name, json.dumps(out[run_name]), flush=True)
  return out


def tasks(workdir: str, tmp: str, names, model: str | None = None) -> dict:
  out = {}
  for name in names:
    argv = ["circuit", "--workdir", workdir, "--task", name, "--n-pairs", "8",
            "--graph", "mib", "--method", "eap-ig", "--sample", "20",
            "--out", os.path.join(tmp, name)]
    wall, doc = circuit_run(argv, os.path.join(tmp, "xla"))
    out[name] = {"argv": argv[:-2], "model": model or workdir, "cpr": doc["cpr"], "cmd": doc["cmd"],
                 "cpr_absolute_ranking": doc["cpr_absolute_ranking"],
                 "pairs": doc["pairs"], "failing": len(doc["failing"]),
                 "graph": doc["graph"], "metric_full": doc["metric_full"],
                 "metric_empty": doc["metric_empty"], "wall_s": wall,
                 "curve_signed": doc["curve_signed"], "curve_absolute": doc["curve_absolute"],
                 **stamp()}
    print(name, out[name]["cpr"], out[name]["cmd"], flush=True)
  return out


def table(t: dict) -> str:
  """The timing as a markdown table: seconds per step, the total and its ratio."""
  steps = list(next(iter(t.values()))["seconds"])
  rows = ["| run | " + " | ".join(steps) + " | wall | total / (EAP-IG + curve) | load |",
          "|---" * (len(steps) + 4) + "|"]
  for name, r in t.items():
    rows.append(f"| {name} | " + " | ".join(f"{r['seconds'].get(k, 0):.1f}" for k in steps)
                + f" | {r['wall_s']:.1f} | {r['total_over_eap_ig_plus_curve']:.2f} | "
                + " / ".join(f"{x:.1f}" for x in r["load_average"]) + " |")
  return "\n".join(rows)


def run(args: MibCircuitOptions) -> int:
  from mha_jax.harness import bench
  from mha_jax.machine import machine
  result = {"workdir": args.workdir}
  if os.path.exists(args.out):
    with open(args.out) as f:
      result.update(json.load(f))
  with tempfile.TemporaryDirectory() as tmp:
    if not args.skip_timing:
      result[args.label] = timing(args.workdir, tmp)
      result["machine"] = machine()
      bench.write_json(result, args.out)
      print(table(result[args.label]))
    for name in args.tasks:
      result.setdefault("tasks", {}).update(tasks(args.workdir, tmp, [name], args.model))
      bench.write_json(result, args.out)
  result["machine"] = machine()
  bench.write_json(result, args.out)
  print(f"wrote {args.out}")
  return 0
