"""Wall time of 1 seed vs N seeds (train.seeds, one vmapped program) of the quickstart
model.

    mha-jax bench seeds [--seeds 8] [--workdir workdirs/bench_seeds]
        [--out docs/results/bench_seeds_cpu.json] [--config.train.steps=...]

Trains configs/translation.py:quickstart (the model and run `mha-jax quickstart` trains)
once with train.seeds=1 and once with train.seeds=N, the same steps, each into a fresh
workdir (WORKDIR/seeds_1, WORKDIR/seeds_N; an existing one is refused, so move it away
first). Wall time is the whole `train` call: data, compilation, the steps, checkpoints
and the final validation (BLEU on eval.bleu_examples sentences per seed). The step time
is the median time between consecutive training-log records (log_every steps), taken
from the seeds' metrics.jsonl timestamps; records that hold a checkpoint save are left
out. The 1-minute load average is read before and after each run (the machine may be
shared).
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import time

from mha_jax.errors import UserError
from mha_jax.settings import setting


CONFIG = "configs/translation.py:quickstart"
OVERRIDES = True       # the verb hands on --config.KEY=VALUE (the quickstart config's)


@dataclasses.dataclass(frozen=True, kw_only=True)
class SeedsOptions:
  """The settings of `bench seeds`."""
  seeds: int = setting(8, lo=2, help="N, the seeds of the vmapped run")
  workdir: str = setting("workdirs/bench_seeds", path=True, help="where the two runs train "
                         "(WORKDIR/seeds_1, WORKDIR/seeds_N; an existing one is refused)")
  out: str = setting("docs/results/bench_seeds_cpu.json", path=True, help="the JSON file")
  step_rounds: int = setting(0, lo=0, help="only time the step, 1 vs N seeds interleaved, "
                             "this many rounds; adds the result to --out if it exists. Not "
                             "a fair ratio: the 1-seed step runs slower right after the "
                             "N-seed one")
  profile: int = setting(0, lo=0, help="only profile the step (1 seed, N seeds, 1 seed at N "
                         "times the batch) over this many interleaved rounds; adds it to "
                         "--out as \"profile\"")


def _load() -> float:
  return os.getloadavg()[0]


def step_ms(workdir: str, log_every: int, checkpoint_every: int) -> float:
  """Median ms per step between consecutive train records (no checkpoint in between)."""
  from mha_jax.train.metrics import read_metrics
  recs = [r for r in read_metrics(workdir) if r["split"] == "train"]
  gaps = [(b["time"] - a["time"]) / (b["step"] - a["step"]) * 1e3
          for a, b in zip(recs, recs[1:])
          if b["step"] - a["step"] == log_every and a["step"] % checkpoint_every]
  return statistics.median(gaps) if gaps else float("nan")


def run_one(seeds: int, workdir: str, overrides) -> dict:
  from mha_jax import config as mc
  from mha_jax.train import loop
  cfg = mc.load_config(CONFIG)
  rest = mc.apply_overrides(cfg, [*overrides, f"--config.train.seeds={seeds}",
                                  "--config.train.progress=false"])
  if rest:
    raise UserError(f"unrecognized arguments: {' '.join(rest)}")
  if os.path.exists(workdir):
    raise UserError(f"workdir: {workdir} exists; move it away (this benchmark times fresh "
                    f"runs)", setting="workdir")
  load_before = _load()
  t0 = time.perf_counter()
  summary = loop.train(cfg, workdir, log=lambda s: print(f"  [{seeds} seed(s)] {s}",
                                                         flush=True))
  wall = time.perf_counter() - t0
  if summary["status"] != "done":
    raise RuntimeError(f"{workdir}: training {summary['status']} at step {summary['step']}; "
                     f"no timing written (resume it with mha-jax train)")
  dirs = summary.get("workdirs", [workdir])
  t = cfg.train
  valid = summary["valid"] if seeds > 1 else [summary["valid"]]
  return {"seeds": seeds, "wall_s": wall, "steps": t.steps,
          "step_ms": statistics.median(step_ms(d, t.log_every, t.checkpoint_every)
                                       for d in dirs),
          "load_before": load_before, "load_after": _load(), "workdir": workdir,
          "valid_bleu": [v["bleu"] for v in valid], "valid_loss": [v["loss"] for v in valid]}


def step_and_init(overrides):
  """CONFIG with `overrides`: (cfg, task, the train step, init(key) -> (params, opt
  state)), the pieces both step timings jit."""
  from mha_jax import config as mc, tasks
  from mha_jax.train import loop
  cfg = mc.load_config(CONFIG)
  mc.apply_overrides(cfg, list(overrides))
  task = tasks.build(cfg, None)
  opt = loop.make_optimizer(cfg.train)
  step = loop.make_train_step(task, opt, cfg)

  def init(key):
    p = task.init_params(key)
    return p, opt.init(p)
  return cfg, task, step, init


def interleaved_steps(seeds: int, rounds: int, overrides) -> dict:
  """The training step alone (loop.make_train_step, jitted; vmapped over `seeds`), 1 seed
  and N seeds timed in alternation so both see the same machine load; medians in ms."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  _, task, step, init = step_and_init(overrides)
  keys = jnp.stack([jax.random.PRNGKey(i) for i in range(seeds)])
  batches = [task.train_batch(i) for i in range(seeds)]
  one = (jax.jit(step, donate_argnums=(0, 1)), jax.jit(init)(keys[0]), batches[0], keys[0])
  many = (jax.jit(jax.vmap(step, in_axes=(0, 0, 0, None, 0)), donate_argnums=(0, 1)),
          jax.jit(jax.vmap(init))(keys),
          {k: np.stack([b[k] for b in batches]) for k in batches[0]}, keys)
  states = [one[1], many[1]]
  times = [[], []]
  for r in range(rounds + 1):          # round 0 compiles
    for i, (fn, _, batch, key) in enumerate((one, many)):
      t0 = time.perf_counter()
      p, o, m = fn(*states[i], batch, jnp.int32(r), key)
      jax.block_until_ready(m)
      states[i] = (p, o)
      if r:
        times[i].append((time.perf_counter() - t0) * 1e3)
  a, b = statistics.median(times[0]), statistics.median(times[1])
  return {"rounds": rounds, "one_seed_ms": a, "n_seeds_ms": b, "seeds": seeds,
          "ratio": b / a, "load_after": _load()}


def profile_steps(seeds: int, rounds: int, overrides) -> dict:
  """Where an N-seed step's time goes, against one seed: the same jitted step
  (loop.make_train_step) for 1 seed at batch B, N seeds vmapped at batch B each, and 1
  seed at batch N*B (the N seeds' work without the seed axis). For each: compile
  seconds, XLA's FLOPs and bytes per step, median ms (interleaved rounds), GFLOP/s; and
  the host's seconds to build the N batches of a step."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  cfg, task, step, init = step_and_init(overrides)
  keys = jnp.stack([jax.random.PRNGKey(i) for i in range(seeds)])
  t0 = time.perf_counter()
  batches = [task.train_batch(i) for i in range(seeds)]
  stacked = {k: np.stack([b[k] for b in batches]) for k in batches[0]}
  host_s = time.perf_counter() - t0
  wide = {k: np.concatenate([b[k] for b in batches]) for k in batches[0]}
  cases = {"1 seed, batch B": (jax.jit(step), jax.jit(init)(keys[0]), batches[0], keys[0]),
           f"{seeds} seeds vmapped, batch B each": (
               jax.jit(jax.vmap(step, in_axes=(0, 0, 0, None, 0))), jax.jit(jax.vmap(init))(keys),
               stacked, keys),
           f"1 seed, batch {seeds}B": (jax.jit(step), jax.jit(init)(keys[0]), wide, keys[0])}
  out = {}
  for name, (fn, state, batch, key) in cases.items():
    t0 = time.perf_counter()
    compiled = fn.lower(*state, batch, jnp.int32(0), key).compile()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    out[name] = {"compile_s": time.perf_counter() - t0, "gflop": cost.get("flops", 0) / 1e9,
                 "gbytes": cost.get("bytes accessed", 0) / 1e9, "times_ms": [],
                 "fn": compiled, "state": state, "batch": batch, "key": key}
  for r in range(rounds + 1):          # round 0 warms up
    for c in out.values():
      t0 = time.perf_counter()
      m = c["fn"](*c["state"], c["batch"], jnp.int32(r), c["key"])[2]
      jax.block_until_ready(m)
      if r:
        c["times_ms"].append((time.perf_counter() - t0) * 1e3)
  rows = {}
  for name, c in out.items():
    ms = statistics.median(c["times_ms"])
    rows[name] = {"compile_s": round(c["compile_s"], 2), "gflop": round(c["gflop"], 3),
                  "gbytes": round(c["gbytes"], 3), "step_ms": round(ms, 1),
                  "gflop_per_s": round(c["gflop"] / ms * 1e3, 1)}
  return {"seeds": seeds, "rounds": rounds, "batch_size": cfg.train.batch_size,
          "host_batches_s": round(host_s, 4), "cases": rows, "load_after": _load()}


def format_profile(res: dict) -> str:
  base = res["cases"]["1 seed, batch B"]
  lines = ["| step | compile s | GFLOP (XLA) | GB accessed | ms | vs 1 seed | GFLOP/s |",
           "|---|---:|---:|---:|---:|---:|---:|"]
  for name, r in res["cases"].items():
    lines.append(f"| {name} | {r['compile_s']:.1f} | {r['gflop']:.2f} | {r['gbytes']:.2f} | "
                 f"{r['step_ms']:.0f} | {r['step_ms'] / base['step_ms']:.2f}x | "
                 f"{r['gflop_per_s']:.1f} |")
  lines.append(f"\nhost: {res['seeds']} batches of {res['batch_size']} built in "
               f"{res['host_batches_s'] * 1e3:.1f} ms")
  return "\n".join(lines)


def format_table(res: dict) -> str:
  one = res["rows"][0]
  lines = [f"{res['config']}: {one['steps']} steps, batch {res['batch_size']} per seed; "
           f"{res['machine']['cpu_count']} CPUs, jax {res['machine']['jax']}", "",
           "| seeds | wall s | vs 1 seed | wall s per seed | step ms | step vs 1 seed | "
           "valid BLEU (mean, min-max) | load 1 min (before, after) |",
           "|---:|---:|---:|---:|---:|---:|---|---|"]
  for r in res["rows"]:
    b = r["valid_bleu"]
    lines.append(
        f"| {r['seeds']} | {r['wall_s']:.1f} | {r['wall_s'] / one['wall_s']:.2f}x | "
        f"{r['wall_s'] / r['seeds']:.1f} | {r['step_ms']:.0f} | "
        f"{r['step_ms'] / one['step_ms']:.2f}x | {statistics.mean(b):.1f} ({min(b):.1f}-"
        f"{max(b):.1f}) | {r['load_before']:.2f}, {r['load_after']:.2f} |")
  return "\n".join(lines)


def _add_to(out: str, key: str, res: dict) -> bool:
  """Adds `res` under `key` to the JSON at `out` when it exists; whether it did."""
  if not os.path.exists(out):
    return False
  with open(out) as f:
    full = json.load(f)
  full[key] = res
  with open(out, "w") as f:
    json.dump(full, f, indent=1)
  return True


def _profile(a: SeedsOptions, overrides) -> int:
  from mha_jax.machine import machine
  res = {**profile_steps(a.seeds, a.profile, overrides), "machine": machine()}
  res["table"] = format_profile(res)
  print(res["table"])
  if not _add_to(a.out, "profile", res):
    with open(a.out, "w") as f:
      json.dump({"profile": res}, f, indent=1)
  print(f"wrote {a.out}")
  return 0


def _step_rounds(a: SeedsOptions, overrides) -> int:
  from mha_jax.machine import machine
  res = {"load_before": _load(), **interleaved_steps(a.seeds, a.step_rounds, overrides),
         "machine": machine()}
  print(f"step alone, interleaved, median of {a.step_rounds}: 1 seed "
        f"{res['one_seed_ms']:.0f} ms, {a.seeds} seeds {res['n_seeds_ms']:.0f} ms "
        f"({res['ratio']:.2f}x); load {res['load_before']:.2f} -> {res['load_after']:.2f}")
  if not _add_to(a.out, "step_interleaved", res):
    with open(a.out + ".steps.json", "w") as f:
      json.dump(res, f, indent=1)
  return 0


def run(a: SeedsOptions, overrides=()) -> int:
  """The benchmark: the two runs (or --profile, or --step-rounds alone)."""
  if a.profile:
    return _profile(a, overrides)
  if a.step_rounds:
    return _step_rounds(a, overrides)
  from mha_jax import config as mc
  from mha_jax.machine import machine
  cfg = mc.load_config(CONFIG)
  rest = mc.apply_overrides(cfg, list(overrides))
  if rest:
    raise UserError(f"unrecognized arguments: {' '.join(rest)}")
  for n in (1, a.seeds):       # both refused before either trains
    if os.path.exists(os.path.join(a.workdir, f"seeds_{n}")):
      raise UserError(f"workdir: {a.workdir}/seeds_{n} exists; move it away (this "
                      f"benchmark times fresh runs)", setting="workdir")
  rows = []
  for n in (1, a.seeds):
    print(f"training {n} seed(s) ...", flush=True)
    rows.append(run_one(n, os.path.join(a.workdir, f"seeds_{n}"), overrides))
    print(json.dumps(rows[-1]), flush=True)
  res = {"config": CONFIG, "overrides": list(overrides), "batch_size": cfg.train.batch_size,
         "machine": machine(), "rows": rows,
         "ratio_wall": rows[1]["wall_s"] / rows[0]["wall_s"],
         "note": "shared machine: see the load averages"}
  print(format_table(res))
  os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
  with open(a.out, "w") as f:
    json.dump(res, f, indent=1)
  print(f"\nwrote {a.out}")
  return 0
