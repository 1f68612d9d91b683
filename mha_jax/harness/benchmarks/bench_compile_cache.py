"""First and second runs of `mha-jax` commands with the persistent compilation cache.

    mha-jax bench compile-cache --workdir smollm2 [--commands quickstart,analyze,patch]
                                [--out docs/results/compile_cache.json]

Each command runs three times as a fresh process: without the cache (--compile-cache
off), into an empty cache folder (first run), then again on the same folder (second
run); outputs go to fresh folders each time. Reported: the wall times, the programs each
run compiled and loaded (JAX_LOG_COMPILES + JAX_EXPLAIN_CACHE_MISSES count them), the
cache's size, and for `patch` the seconds of its activation-patching sweep (from its
summary.json) with the command's wall time over them. Each command's entry records the
date and the load average when it ran. `quickstart` trains its own model; the others
read --workdir (an imported SmolLM2-135M: `mha-jax import smollm2-135m --workdir W`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time

from mha_jax.harness.benchmarks import child_env
from mha_jax.settings import setting

COMMANDS = ("quickstart", "analyze", "patch", "patch_head_out", "patch_all_sites", "circuit")


@dataclasses.dataclass(frozen=True, kw_only=True)
class CompileCacheOptions:
  """The settings of `bench compile-cache`."""
  workdir: str = setting(path=True, help="an imported smollm2-135m (mha-jax import "
                         "smollm2-135m --workdir W)")
  commands: tuple[str, ...] = setting(("quickstart", "analyze", "patch"), choices=COMMANDS,
                                      help="the commands to time")
  out: str = setting("docs/results/compile_cache.json", path=True, help="the JSON file "
                     "(the commands measured before are kept)")


def commands(workdir: str, tmp: str, i: str) -> dict:
  """The command lines, their outputs under tmp (fresh for each run `i`)."""
  return {
      "quickstart": ["quickstart", "--workdir", f"{tmp}/qs{i}"],
      "analyze": ["analyze", "--workdir", workdir, "--out", f"{tmp}/an{i}"],
      "patch": ["patch", "--workdir", workdir, "--task", "ioi", "--n-pairs", "4",
                "--out", f"{tmp}/pa{i}"],
      "patch_head_out": ["patch", "--workdir", workdir, "--task", "ioi", "--n-pairs", "4",
                         "--sites", "head_out", "--method", "activation",
                         "--out", f"{tmp}/ph{i}"],
      "patch_all_sites": ["patch", "--workdir", workdir, "--task", "ioi", "--n-pairs", "4",
                          "--sites", "head_out,q,k,v,kv,resid", "--out", f"{tmp}/ps{i}"],
      "circuit": ["circuit", "--workdir", workdir, "--task", "ioi", "--n-pairs", "4",
                  "--sample", "20", "--out", f"{tmp}/ci{i}"],
  }


def run_once(argv, cache: str) -> dict:
  env = child_env(JAX_LOG_COMPILES="1", JAX_EXPLAIN_CACHE_MISSES="1")
  env.pop("JAX_COMPILATION_CACHE_DIR", None)
  t0 = time.perf_counter()
  p = subprocess.run([sys.executable, "-m", "mha_jax.cli", *argv, "--compile-cache", cache],
                     capture_output=True, text=True, env=env)
  sec = time.perf_counter() - t0
  if p.returncode != 0:
    raise RuntimeError(f"{' '.join(argv)} failed:\n{p.stderr[-3000:]}")
  out = {"seconds": round(sec, 2),
         "compiled": p.stderr.count("PERSISTENT COMPILATION CACHE MISS"),
         "loaded": p.stderr.count("Persistent compilation cache hit")}
  summary = os.path.join(argv[argv.index("--out") + 1], "summary.json") if "--out" in argv \
      else ""
  if argv[0] == "patch" and os.path.exists(summary):
    with open(summary) as f:
      sweep = json.load(f)["seconds"].get("patch_head_out")
    if sweep:                 # the activation-patching sweep's own seconds
      out.update(sweep_s=sweep, ratio_to_sweep=round(sec / sweep, 2))
  return out


def table_of(result: dict) -> str:
  """The markdown table of every command measured: wall seconds of the three runs and,
  for `patch`, over its sweep's seconds."""
  rows = ["| command | no cache (s) | first run (s) | second run (s) | programs compiled "
          "first / second | cache (MB) |", "|---|---|---|---|---|---|"]
  for name, r in result["commands"].items():
    cells = [f"{r[k]['seconds']:.1f}" + (f" ({r[k]['ratio_to_sweep']:.2f}x its sweep)"
                                         if "ratio_to_sweep" in r[k] else "")
             for k in ("no_cache", "first", "second")]
    rows.append(f"| `{' '.join(r['argv'][:1])}` ({name}) | {' | '.join(cells)} | "
                f"{r['first']['compiled']} / {r['second']['compiled']} | "
                f"{r['cache_bytes'] / 1e6:.1f} |")
  return "\n".join(rows)


def _size(root: str) -> int:
  return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(root) for f in fs)


def run(args: CompileCacheOptions) -> int:
  names = list(args.commands)
  from mha_jax.harness import bench
  from mha_jax import cli
  result = {"workdir": args.workdir, "commands": {}}
  if os.path.exists(args.out):             # keep the commands measured before
    with open(args.out) as f:
      result["commands"] = json.load(f).get("commands", {})
  with tempfile.TemporaryDirectory() as tmp:
    for name in names:
      argv_of = lambda i: commands(args.workdir, tmp, i)[name]  # noqa: E731
      if argv_of("0")[0] not in cli.VERBS:
        print(f"{name}: no such verb here, skipped", flush=True)
        continue
      cache = os.path.join(tmp, f"xla_{name}")
      off = run_once(argv_of("off"), "off")
      first = run_once(argv_of("1"), cache)
      second = run_once(argv_of("2"), cache)
      result["commands"][name] = {"argv": argv_of("N"), "no_cache": off, "first": first,
                                  "second": second, "cache_bytes": _size(cache),
                                  "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                                  "load_average": [round(x, 2) for x in os.getloadavg()]}
      print(f"{name}: no cache {off['seconds']} s, first {first['seconds']} s "
            f"({first['compiled']} compiled), second {second['seconds']} s "
            f"({second['compiled']} compiled, {second['loaded']} loaded)", flush=True)
  from mha_jax.machine import machine
  result["machine"] = machine()
  result["table"] = table_of(result)
  print(result["table"])
  bench.write_json(result, args.out)
  print(f"wrote {args.out}")
  return 0
