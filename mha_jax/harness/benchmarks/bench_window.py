"""Sliding-window attention in the blocked kernel: the window as a dense band mask
against skipping the key blocks outside it.

    mha-jax bench window [--seq-lens 4096,8192,16384] [--window 512]
                         [--rounds 2] [--out results/bench_window.json]

Both run kernels.blocked.blocked_attention, causal, forward+backward (jax.grad of the
sum of the output) on random q, k, v of (B, T, H, K) = (1, T, 4, 64), float32:

  dense mask  mask = the (T, T) band i - j < window (what attention.py passed to every
              kernel before the window was a kernel argument): every causal block is
              computed, the mask zeroes most of them.
  skipping    window=W: the key blocks wholly outside every query's window are not
              visited (forward and backward), so the work grows as T * W.

Time: both modes compiled in one process per T, rounds interleaved (each round times
each mode once, so drift on a shared machine hits both alike), medians over --rounds,
as `mha-jax bench attention` does. Memory: each (mode, T) once more in a fresh process
(address space capped), its peak resident memory read from VmHWM, as `--scale-t` does.
The machine's measured matmul rate is printed and stored with each row's rate in GFLOP/s
of the attention's useful work (4 B H K FLOPs per allowed (query, key) pair forward,
2.5x that forward+backward: the backward's five block matmuls, one of them recomputing
the scores).
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import sys
import time

from mha_jax.settings import setting

B, H, K = 1, 4, 64
MODES = ("dense mask", "skipping")
# Each (mode, T) runs in a subprocess: `python -m THIS time T W ROUNDS CAP_GB` or
# `python -m THIS memory MODE T W CAP_GB` (address space capped at CAP_GB).
ME = [sys.executable, "-m", "mha_jax.harness.benchmarks.bench_window"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class WindowOptions:
  """The settings of `bench window`."""
  seq_lens: tuple[int, ...] = setting((4096, 8192, 16384), lo=1,
                                      help="comma-separated sequence lengths T")
  window: int = setting(512, lo=1, help="the sliding window W")
  rounds: int = setting(2, lo=1, help="timed rounds (interleaved)")
  max_mem_gb: float = setting(8.0, lo=0, lo_open=True, help="address-space cap per "
                              "subprocess")
  out: str = setting("results/bench_window.json", path=True, help="the JSON file")


def _pairs(t: int, window: int) -> int:
  """Allowed (query, key) pairs: causal and i - j < window."""
  return sum(min(i + 1, window) for i in range(t))


def _compiled(mode: str, t: int, window: int):
  """(compiled forward+backward of `mode` at length t, its arguments, compile seconds)."""
  import jax
  import jax.numpy as jnp

  from mha_jax.kernels import blocked

  ks = jax.random.split(jax.random.PRNGKey(0), 3)
  q, k, v = (jax.random.normal(kk, (B, t, H, K), jnp.float32) for kk in ks)
  # The band is an argument: as a constant of the program, XLA:CPU spends minutes
  # constant-folding it (measured: 70 s at T = 4096).
  if mode == "dense mask":
    band = (jnp.arange(t)[:, None] - jnp.arange(t)[None, :] < window)[None, None]
    f = lambda q, k, v, m: blocked.blocked_attention(q, k, v, m, causal=True)  # noqa: E731
  else:
    band = jnp.zeros((), bool)    # unused
    f = lambda q, k, v, m: blocked.blocked_attention(q, k, v, causal=True,  # noqa: E731
                                                     window=window)
  grad = jax.jit(jax.grad(lambda q, k, v, m: jnp.sum(f(q, k, v, m)), argnums=(0, 1, 2)))
  t0 = time.perf_counter()
  compiled = grad.lower(q, k, v, band).compile()
  return compiled, (q, k, v, band), time.perf_counter() - t0


def memory_one(mode: str, t: int, window: int) -> dict:
  """In a fresh subprocess: compile and run one mode once; its peak resident memory."""
  import jax

  from mha_jax.harness import bench
  compiled, args, compile_s = _compiled(mode, t, window)
  jax.block_until_ready(compiled(*args))
  return {"mode": mode, "seq_len": t, "compile_s": compile_s,
          "max_rss_mb": bench.peak_rss_mb()}


def time_both(t: int, window: int, rounds: int) -> list[dict]:
  """In a subprocess: both modes at length t, rounds interleaved; medians."""
  import jax

  from mha_jax.harness import bench
  fns = {m: _compiled(m, t, window) for m in MODES}
  for compiled, args, _ in fns.values():
    jax.block_until_ready(compiled(*args))
  times = {m: [] for m in MODES}
  for _ in range(rounds):
    for m, (compiled, args, _) in fns.items():
      times[m] += bench.round_seconds(lambda: compiled(*args), 1)
  flops = 2.5 * 4 * B * H * K * _pairs(t, window)
  out = []
  for m in MODES:
    med = statistics.median(times[m])
    out.append({"mode": m, "seq_len": t, "median_ms": med * 1e3,
                "times_ms": [x * 1e3 for x in times[m]], "useful_gflops": flops / med / 1e9})
  return out


def _sub(argv1, cap_gb):
  from mha_jax.harness import bench
  code, out, err = bench.run_capped(argv1, cap_gb, 3600)
  line = [x for x in out.splitlines() if x.startswith(("{", "["))]
  if code == 0 and line:
    return json.loads(line[-1]), ""
  return None, ("timeout" if code is None else
                (err.strip().splitlines() or ["error"])[-1][:300])


def run(args: WindowOptions) -> int:
  import jax

  from mha_jax.harness import bench
  from mha_jax.machine import machine
  gflops = bench.matmul_gflops()
  print(f"backend {jax.default_backend()}, {os.cpu_count()} CPUs, float32 matmul rate "
        f"{gflops:.1f} GFLOP/s")
  rows = []
  for t in args.seq_lens:
    timed, why = _sub([*ME, "time", str(t), str(args.window), str(args.rounds)],
                      args.max_mem_gb)
    for mode in MODES:
      row = {"mode": mode, "seq_len": t, "status": "ok" if timed else why}
      if timed:
        row.update(next(r for r in timed if r["mode"] == mode))
        mem, why_m = _sub([*ME, "memory", mode, str(t), str(args.window)],
                          args.max_mem_gb)
        row.update(mem if mem else {"status": why_m})
      rows.append(row)
      print(f"T={t} {mode}: " + (f"{row['median_ms']:.0f} ms, {row['max_rss_mb']:.0f} MB"
                                 if row["status"] == "ok" else row["status"]), flush=True)
  result = {"config": {"batch": B, "heads": H, "head_dim": K, "window": args.window,
                       "timing": "both modes in one process per T, rounds interleaved",
                       "causal": True, "dtype": "float32", "mode": "forward+backward",
                       "kernel": "blocked (default blocks: 512 x 512)",
                       "rounds": args.rounds, "max_mem_gb": args.max_mem_gb,
                       "memory": "peak resident set (VmHWM) of a fresh process per row, "
                                 "one forward+backward, JAX runtime included"},
            "machine": machine(matmul_gflops=gflops), "rows": rows}
  print(format_table(result))
  bench.write_json(result, args.out)
  print(f"wrote {args.out}")
  return 0


def format_table(result: dict) -> str:
  by = {(r["mode"], r["seq_len"]): r for r in result["rows"]}
  c, m = result["config"], result["machine"]
  out = [f"blocked kernel, causal, window {c['window']}, (B, H, K) = ({c['batch']}, "
         f"{c['heads']}, {c['head_dim']}), float32 forward+backward; matmul "
         f"{m['matmul_gflops']:.1f} GFLOP/s", "",
         "| T | dense mask ms | skipping ms | ratio | dense mask MB | skipping MB | "
         "skipping GFLOP/s (% of matmul) |", "|---:|---:|---:|---:|---:|---:|---:|"]
  for t in sorted({r["seq_len"] for r in result["rows"]}):
    d, s = by.get(("dense mask", t), {}), by.get(("skipping", t), {})
    if d.get("status") != "ok" or s.get("status") != "ok":
      out.append(f"| {t} | {d.get('status')} | {s.get('status')} | | | | |")
      continue
    pct = 100 * s["useful_gflops"] / m["matmul_gflops"]
    out.append(f"| {t} | {d['median_ms']:.0f} | {s['median_ms']:.0f} | "
               f"{d['median_ms'] / s['median_ms']:.1f} | {d['max_rss_mb']:.0f} | "
               f"{s['max_rss_mb']:.0f} | {s['useful_gflops']:.1f} ({pct:.0f} %) |")
  return "\n".join(out)


if __name__ == "__main__":
  if len(sys.argv) == 6 and sys.argv[1] in ("time", "memory"):
    import resource
    cap = int(float(sys.argv[-1]) * 2**30)
    resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
    if sys.argv[1] == "time":
      _, _, t, w, r, _cap = sys.argv
      print(json.dumps(time_both(int(t), int(w), int(r))))
    else:
      _, _, mode, t, w, _cap = sys.argv
      print(json.dumps(memory_one(mode, int(t), int(w))))
  else:
    sys.exit("usage: python -m mha_jax.harness.benchmarks.bench_window time T W ROUNDS CAP_GB "
             "| memory MODE T W CAP_GB (the benchmark is `mha-jax bench window`)")
