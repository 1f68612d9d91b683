"""Attention benchmark: this project's layer against its peers, side by side in one run.

Every implementation runs the same self-attention (same weights, same input) in the
same process. Rounds are interleaved (each round times every implementation once),
so drift on a shared machine hits all of them alike; we report the median. Each timed
call starts once the process has gone idle (settle), so that one implementation's
memory release does not land in the next one's time.
"""

from __future__ import annotations

import dataclasses
import json
import os
import resource
import statistics
import time
from typing import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp

from mha_jax import storage
from mha_jax import accounting, attention, layers
from mha_jax.kernels import xla as xla_kernels
from mha_jax.errors import UserError
from mha_jax.machine import machine
from mha_jax.settings import DTYPES, setting

DEFAULT_HEADS = (8, 12, 16, 32, 64, 96)


def _cpu_seconds() -> float:
  r = resource.getrusage(resource.RUSAGE_SELF)
  return r.ru_utime + r.ru_stime


def settle(max_s: float = 1.0, quiet_s: float = 0.002, poll_s: float = 0.02) -> None:
  """Waits (at most max_s) until this process uses no CPU between two polls.

  A call's memory is given back after it returns: at h = 96 the peers' score tensors
  are gigabytes, and releasing them took 0.16 s of system time in the 0.3 s after
  the call (measured), which otherwise lands in the next implementation's time (our
  blocked forward: 58 ms alone, 210 ms right after jax.nn's forward+backward).
  """
  deadline = time.perf_counter() + max_s
  last = _cpu_seconds()
  while time.perf_counter() < deadline:
    time.sleep(poll_s)
    now = _cpu_seconds()
    if now - last < quiet_s:
      return
    last = now


def first_and_rounds(fn: Callable[[], object], rounds: int):
  """(fn's output, seconds of the first call (compiling), median seconds of the next
  `rounds` calls (the first's when rounds is 0), those seconds)."""
  t0 = time.perf_counter()
  out = jax.block_until_ready(fn())
  first = time.perf_counter() - t0
  times = []
  for _ in range(rounds):
    t0 = time.perf_counter()
    out = jax.block_until_ready(fn())
    times.append(time.perf_counter() - t0)
  return out, first, statistics.median(times or [first]), times


def round_seconds(fn: Callable[[], object], rounds: int) -> list[float]:
  """Wall seconds of each of `rounds` calls (the caller takes the median), each
  started on a settled process (settle)."""
  out = []
  for _ in range(rounds):
    settle()
    t0 = time.perf_counter()
    jax.block_until_ready(fn())
    out.append(time.perf_counter() - t0)
  return out


def matmul_row(n: int = 2048, dtype=jnp.float32) -> tuple[Callable[[], object], float]:
  """(fn() -> the (n x n) @ (n x n) product, its FLOPs), compiled: the matmul rate as a
  row of a benchmark's interleaved rounds, so that it meets the load the other rows do."""
  a = jax.random.normal(jax.random.PRNGKey(0), (n, n), dtype)
  f = jax.jit(lambda a: a @ a)
  jax.block_until_ready(f(a))
  return (lambda: f(a)), 2 * n**3


def matmul_gflops(n: int = 2048, rounds: int = 7, dtype=jnp.float32) -> float:
  """The machine's measured (n x n) @ (n x n) rate, GFLOP/s, median of `rounds`."""
  fn, flops = matmul_row(n, dtype)
  return flops / statistics.median(round_seconds(fn, rounds)) / 1e9


def forward_backward(f: Callable, args: tuple, key: int = 9) -> tuple[Callable, tuple]:
  """(jit of the gradient of <f(*args), ct> in every argument, args + (ct,)): the
  benchmarks' forward+backward. ct is a fixed random float32 cotangent of f's outputs,
  passed at run time: with sum(y)'s ones XLA may turn a weight's gradient into a row
  sum, and with a constant lay a matmul operand out at compile time."""
  out = jax.eval_shape(f, *args)
  cts = jax.tree.map(lambda o: jax.random.normal(jax.random.PRNGKey(key), o.shape,
                                                 jnp.float32), out)

  def loss(*a):
    *xs, c = a
    return sum(jnp.vdot(y.astype(jnp.float32), ct)
               for y, ct in zip(jax.tree.leaves(f(*xs)), jax.tree.leaves(c)))
  return jax.jit(jax.grad(loss, argnums=tuple(range(len(args))))), tuple(args) + (cts,)


def _linen_dpa_fn(query, key, value, bias=None, mask=None, **_):
  """attention_fn for flax.linen that calls jax.nn.dot_product_attention."""
  return jax.nn.dot_product_attention(query, key, value, bias=bias, mask=mask,
                                      implementation="xla")


PEERS = ("flax.linen MHDPA", "linen + jax.nn.dot_product_attention",
         "flax.nnx MultiHeadAttention")
OURS = ("auto", "reference", "xla", "blocked")


def impl_names(with_cudnn: bool) -> tuple[str, ...]:
  """The rows build_impls makes, in order, without building them."""
  ours = OURS + (("cudnn",) if with_cudnn else ())
  return tuple(f"mha_jax impl={i}" for i in ours) + PEERS


IMPLS = impl_names(with_cudnn=True)


@dataclasses.dataclass(frozen=True, kw_only=True)
class BenchAttentionOptions:
  """The settings of `bench attention`; None: the mode's default."""
  d_model: int | None = setting(None, lo=1, help="default 768 (512 with --scale-t)")
  seq_len: int = setting(512, lo=1, help="the sequence length T")
  batch: int | None = setting(None, lo=1, help="default 4 (1 with --scale-t)")
  heads: tuple[int, ...] | None = setting(None, lo=1, help="comma-separated head counts "
                                          "(default: 8,12,16,32,64,96; 8 with --scale-t "
                                          "or --variants)")
  scale_t: bool = setting(False, help="time and peak memory against T (512 .. 32768), "
                          "one capped subprocess per implementation and T")
  seq_lens: tuple[int, ...] | None = setting(None, lo=1, help="with --scale-t: "
                                             "comma-separated T values")
  impls: tuple[str, ...] | None = setting(None, choices=IMPLS,
                                          metavar="IMPL[,IMPL...]",
                                          help=f"of {', '.join(IMPLS)} "
                                               f"(default: all; without --scale-t the "
                                               f"peers always run)")
  variants: bool = setting(False, help="each attention variant's forward and "
                           "forward+backward against softmax (h = 8 unless --heads)")
  max_mem_gb: float = setting(6.0, lo=0, lo_open=True, help="with --scale-t: "
                              "address-space cap per subprocess (default 6)")
  rounds: int = setting(5, lo=1, help="timed rounds")
  warmup: int = setting(1, lo=0, help="untimed rounds first")
  dtype: str = setting("float32", choices=DTYPES, help="the inputs' dtype")


def build_impls(d_model: int, num_heads: int, *, with_cudnn: bool,
                dtype=jnp.float32) -> dict[str, tuple[Callable, object]]:
  """name -> (pure function f(params, x) -> y, params), all with the same weights."""
  from flax import nnx   # here: every mha-jax command imports this module (its verbs)
  ours = attention.init_attention_params(jax.random.PRNGKey(0), d_model, num_heads,
                                         use_bias=True, dtype=dtype)
  flax_params = {"params": layers.to_flax_linen(ours)}
  impls = {}
  for impl in OURS:
    impls[f"mha_jax impl={impl}"] = (
        lambda p, x, impl=impl: attention.multi_head_attention(p, x, impl=impl), ours)
  if with_cudnn:
    impls["mha_jax impl=cudnn"] = (
        lambda p, x: attention.multi_head_attention(p, x, impl="cudnn"), ours)
  linen = nn.MultiHeadDotProductAttention(num_heads=num_heads, use_bias=True, dtype=dtype)
  impls["flax.linen MHDPA"] = (lambda p, x: linen.apply(p, x), flax_params)
  linen_dpa = nn.MultiHeadDotProductAttention(num_heads=num_heads, use_bias=True,
                                              dtype=dtype, attention_fn=_linen_dpa_fn)
  impls["linen + jax.nn.dot_product_attention"] = (
      lambda p, x: linen_dpa.apply(p, x), flax_params)
  model = nnx.MultiHeadAttention(num_heads, d_model, decode=False, dtype=dtype,
                                 rngs=nnx.Rngs(0))
  graphdef, state = nnx.split(model)
  impls["flax.nnx MultiHeadAttention"] = (
      lambda s, x: nnx.merge(graphdef, s)(x), state)
  return impls


def run_attention(*, d_model: int = 768, seq_len: int = 512, batch: int = 4,
                  heads=DEFAULT_HEADS, rounds: int = 5, warmup: int = 1, with_cudnn: bool | None = None,
                  dtype: str = "float32", impls: tuple[str, ...] | None = None,
                  log: Callable[[str], None] = print) -> dict:
  """Times forward and forward+backward for every implementation (or those named in
  `impls`; the peers always run) and every h."""
  if rounds < 1:
    raise UserError(f"rounds must be >= 1; got {rounds}")
  for h in heads:
    if h < 1 or d_model % h:
      raise UserError(f"heads: h={h} does not divide d_model={d_model}")
  if with_cudnn is None:
    with_cudnn = xla_kernels.gpu_available()
  dt = jnp.dtype(dtype)
  if with_cudnn and dt == jnp.float32:
    log("note: cuDNN attention needs bfloat16/float16; rerun with --dtype bfloat16 "
        "for the impl=cudnn row")
    with_cudnn = False
  gflops = matmul_gflops(dtype=dt)
  log(f"device: {jax.devices()[0].device_kind} x{jax.device_count()}, "
      f"{dtype} matmul rate {gflops:.1f} GFLOP/s")
  fwd_flops = accounting.attention_flops(d_model, seq_len, batch=batch)["total"]
  # forward+backward runs the backward's two matmuls per forward one and the forward's
  # but W_O's: the gradient of <y, ct> never needs y itself (XLA removes it).
  flops = {"forward": fwd_flops,
           "forward+backward": 3 * fwd_flops - 2 * batch * seq_len * d_model**2}
  x = jax.random.normal(jax.random.PRNGKey(1), (batch, seq_len, d_model), dt)
  rows = []
  for h in heads:
    built = build_impls(d_model, h, with_cudnn=with_cudnn, dtype=dt)
    if impls is not None:
      unknown = sorted(set(impls) - set(built))
      if unknown:
        raise UserError(f"impls: unknown names {unknown}; known: {sorted(built)}")
      built = {n: v for n, v in built.items() if n in impls or n in PEERS}
    compiled = {}
    for name, (f, p) in built.items():
      fwd = jax.jit(f)
      grad, grad_args = forward_backward(f, (p, x))
      compiled[name] = {"forward": (lambda fwd=fwd, p=p: fwd(p, x)),
                        "forward+backward": (lambda grad=grad, a=grad_args: grad(*a))}
      for run_fn in compiled[name].values():
        for _ in range(warmup):
          jax.block_until_ready(run_fn())
    times = {(n, m): [] for n in compiled for m in ("forward", "forward+backward")}
    for _ in range(rounds):  # interleaved
      for (n, m) in times:
        times[(n, m)] += round_seconds(compiled[n][m], 1)
    for mode in ("forward", "forward+backward"):
      meds = {n: statistics.median(times[(n, mode)]) for n in compiled}
      peers = [v for n, v in meds.items() if not n.startswith("mha_jax")]
      best_peer = min(peers)
      for n, med in meds.items():
        rows.append({"heads": h, "d_k": d_model // h, "mode": mode, "impl": n,
                     "median_ms": med * 1e3,
                     "ratio_to_best_peer": med / best_peer,
                     "pct_of_matmul_rate": 100 * flops[mode] / med / (gflops * 1e9),
                     "times_ms": [t * 1e3 for t in times[(n, mode)]]})
    log(f"h={h}: done")
  return {
      "config": {"d_model": d_model, "seq_len": seq_len, "batch": batch,
                 "heads": list(heads), "rounds": rounds, "warmup": warmup, "dtype": dtype},
      "note": "2-core CPU shared with other jobs: timings are noisy; rounds are "
              "interleaved so drift hits every implementation alike; each timed call "
              "starts once the process is idle (bench.settle)",
      "machine": machine(matmul_gflops=gflops),
      "flops_forward": fwd_flops, "flops_forward_backward": flops["forward+backward"],
      "rows": rows,
  }


def format_table(result: dict) -> str:
  """Markdown table: one row per (h, impl), forward and forward+backward side by side."""
  rows = result["rows"]
  impls = list(dict.fromkeys(r["impl"] for r in rows))
  by = {(r["heads"], r["impl"], r["mode"]): r for r in rows}
  c = result["config"]
  out = [f"d_model={c['d_model']}, T={c['seq_len']}, batch={c['batch']}, {c['dtype']}, "
         f"median of {c['rounds']} interleaved rounds; {result['machine']['device_kind']}, "
         f"matmul {result['machine']['matmul_gflops']:.1f} GFLOP/s",
         "",
         "| h | d_k | implementation | fwd ms | fwd / best peer | fwd % matmul | "
         "fwd+bwd ms | fwd+bwd / best peer | fwd+bwd % matmul |",
         "|---:|---:|---|---:|---:|---:|---:|---:|---:|"]
  for h in c["heads"]:
    for n in impls:
      f, b = by[(h, n, "forward")], by[(h, n, "forward+backward")]
      out.append(f"| {h} | {f['d_k']} | {n} | {f['median_ms']:.1f} | "
                 f"{f['ratio_to_best_peer']:.2f} | {f['pct_of_matmul_rate']:.0f} | "
                 f"{b['median_ms']:.1f} | {b['ratio_to_best_peer']:.2f} | "
                 f"{b['pct_of_matmul_rate']:.0f} |")
  first, last = c["heads"][0], c["heads"][-1]
  out.append("")
  out.append(f"Slow-down from h={first} to h={last} (fwd+bwd, same FLOPs):")
  for n in impls:
    a, b = by[(first, n, "forward+backward")], by[(last, n, "forward+backward")]
    out.append(f"  {n}: {b['median_ms'] / a['median_ms']:.2f}x")
  return "\n".join(out)


# --------------------------------------------------------------------------
# --variants: each attention variant against softmax, in one run.
# --------------------------------------------------------------------------


def run_variants(*, d_model: int = 768, seq_len: int = 512, batch: int = 4, heads=(8,),
                 rounds: int = 5, warmup: int = 1, dtype: str = "float32",
                 variants: tuple[str, ...] | None = None,
                 log: Callable[[str], None] = print) -> dict:
  """Forward and forward+backward of the layer (impl="auto", causal self-attention) for
  each variant and h, rounds interleaved over the variants; ratios against softmax."""
  variants = attention.VARIANTS if variants is None else tuple(variants)
  unknown = [v for v in variants if v not in attention.VARIANTS]
  if unknown:
    raise UserError(f"variants: unknown {unknown}; known: {attention.VARIANTS}")
  if "softmax" not in variants:
    variants = ("softmax",) + variants
  if rounds < 1:
    raise UserError(f"rounds must be >= 1; got {rounds}")
  for h in heads:
    if h < 1 or d_model % h:
      raise UserError(f"heads: h={h} does not divide d_model={d_model}")
  dt = jnp.dtype(dtype)
  gflops = matmul_gflops(dtype=dt)
  log(f"device: {jax.devices()[0].device_kind} x{jax.device_count()}, "
      f"{dtype} matmul rate {gflops:.1f} GFLOP/s")
  x = jax.random.normal(jax.random.PRNGKey(1), (batch, seq_len, d_model), dt)
  rows = []
  for h in heads:
    compiled, kernels = {}, {}
    for v in variants:
      p = attention.init_attention_params(jax.random.PRNGKey(0), d_model, h, use_bias=True,
                                          dtype=dt, variant=v)
      f = lambda p, x, v=v: attention.multi_head_attention(p, x, causal=True, variant=v)
      fwd = jax.jit(f)
      grad = jax.jit(jax.grad(lambda p, x, f=f: jnp.sum(f(p, x).astype(jnp.float32)),
                              argnums=(0, 1)))
      compiled[v] = {"forward": (lambda fwd=fwd, p=p: fwd(p, x)),
                     "forward+backward": (lambda grad=grad, p=p: grad(p, x))}
      for fn in compiled[v].values():
        for _ in range(warmup):
          jax.block_until_ready(fn())
      width = d_model // h // (2 if v == "differential" else 1)
      kernels[v] = attention.resolve_impl(
          "auto", jax.ShapeDtypeStruct((batch, seq_len, h, width), dt), False, variant=v)
    times = {(v, m): [] for v in compiled for m in ("forward", "forward+backward")}
    for _ in range(rounds):  # interleaved
      for key in times:
        times[key] += round_seconds(compiled[key[0]][key[1]], 1)
    for mode in ("forward", "forward+backward"):
      base = statistics.median(times[("softmax", mode)])
      for v in compiled:
        med = statistics.median(times[(v, mode)])
        rows.append({"heads": h, "variant": v, "kernel": kernels[v], "mode": mode,
                     "median_ms": med * 1e3, "ratio_to_softmax": med / base,
                     "times_ms": [t * 1e3 for t in times[(v, mode)]]})
    log(f"h={h}: done")
  return {"config": {"d_model": d_model, "seq_len": seq_len, "batch": batch,
                     "heads": list(heads), "rounds": rounds, "warmup": warmup,
                     "dtype": dtype, "variants": list(variants), "causal": True,
                     "impl": "auto"},
          "note": "rounds interleaved over the variants on a shared machine; ratios are "
                  "each variant's median over softmax's in the same run",
          "machine": machine(matmul_gflops=gflops),
          "rows": rows}


def format_variants(result: dict) -> str:
  """Markdown table: one row per (h, variant), forward and forward+backward."""
  c = result["config"]
  by = {(r["heads"], r["variant"], r["mode"]): r for r in result["rows"]}
  out = [f"d_model={c['d_model']}, T={c['seq_len']}, batch={c['batch']}, {c['dtype']}, "
         f"causal self-attention, impl=auto, median of {c['rounds']} interleaved rounds; "
         f"{result['machine']['device_kind']}, matmul "
         f"{result['machine']['matmul_gflops']:.1f} GFLOP/s", "",
         "| h | variant | kernel | fwd ms | fwd / softmax | fwd+bwd ms | fwd+bwd / softmax |",
         "|---:|---|---|---:|---:|---:|---:|"]
  for h in c["heads"]:
    for v in c["variants"]:
      f, b = by[(h, v, "forward")], by[(h, v, "forward+backward")]
      out.append(f"| {h} | {v} | {f['kernel']} | {f['median_ms']:.1f} | "
                 f"{f['ratio_to_softmax']:.2f} | {b['median_ms']:.1f} | "
                 f"{b['ratio_to_softmax']:.2f} |")
  return "\n".join(out)


def write_json(result: dict, path: str) -> None:
  storage.makedirs(storage.dirname(storage.abspath(path)))
  storage.write_json(path, result, atomic=True)


# --------------------------------------------------------------------------
# --scale-t: time and peak resident memory against the sequence length, one fresh
# subprocess per (implementation, T) so that each peak is its own.
# --------------------------------------------------------------------------

SCALE_T = tuple(512 * 2**i for i in range(7))     # 512 .. 32768


def _scale_t_one(name: str, *, d_model: int, num_heads: int, seq_len: int, batch: int,
                 rounds: int) -> dict:
  """Runs in the subprocess: compile, then time forward+backward of one implementation."""
  x = jax.random.normal(jax.random.PRNGKey(1), (batch, seq_len, d_model), jnp.float32)
  impls = build_impls(d_model, num_heads, with_cudnn=False)
  if name not in impls:
    raise UserError(f"impl {name!r} is not one of {sorted(impls)}")
  f, p = impls[name]
  grad = jax.jit(jax.grad(lambda p, x: jnp.sum(f(p, x).astype(jnp.float32)), argnums=(0, 1)))
  t0 = time.perf_counter()
  compiled = grad.lower(p, x).compile()
  compile_s = time.perf_counter() - t0
  times = round_seconds(lambda: compiled(p, x), rounds)
  return {"impl": name, "seq_len": seq_len, "median_ms": statistics.median(times) * 1e3,
          "times_ms": [t * 1e3 for t in times], "compile_s": compile_s,
          "max_rss_mb": peak_rss_mb()}


def peak_rss_mb() -> float:
  """This process's peak resident memory, MB. VmHWM belongs to the process image (Linux
  carries ru_maxrss over from the parent across fork + exec, so a child started by a big
  process would report the parent's peak)."""
  try:
    with open("/proc/self/status") as f:
      for line in f:
        if line.startswith("VmHWM:"):
          return int(line.split()[1]) / 1024
  except OSError:
    pass
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run_capped(argv: list[str], max_mem_gb: float, timeout_s: float):
  """Runs argv with its address space capped; returns (exit code, stdout, stderr).

  The cap (RLIMIT_AS) makes an over-large allocation fail inside the child instead of
  exhausting a shared machine. Status is the exit code, or -signal, or None on timeout.
  """
  import subprocess
  # The child sets the limit on itself first thing (no fork-time hook: JAX is threaded).
  proc = subprocess.Popen(argv + [str(max_mem_gb)], stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True, env=os.environ.copy())
  try:
    out, err = proc.communicate(timeout=timeout_s)
  except subprocess.TimeoutExpired:
    proc.kill()
    out, err = proc.communicate()
    return None, out, err
  return proc.returncode, out, err


def run_scale_t(*, d_model: int = 512, num_heads: int = 8, batch: int = 1,
                seq_lens=SCALE_T, impls: tuple[str, ...] | None = None, rounds: int = 3,
                max_mem_gb: float = 6.0, timeout_s: float = 1200,
                log: Callable[[str], None] = print) -> dict:
  """Forward+backward time and peak resident memory for each implementation and T.

  Each (implementation, T) runs in a fresh Python process whose address space is capped
  at max_mem_gb; one that fails to allocate is reported as "over cap" (the memory a
  (B, H, T, S) score tensor needs grows as T^2). Once an implementation is over the cap
  or the time limit at some T, larger T are not tried.
  """
  import sys
  if max_mem_gb <= 0:
    raise UserError(f"max_mem_gb must be > 0; got {max_mem_gb}")
  if impls is None:
    impls = impl_names(with_cudnn=False)
  rows = []
  for name in impls:
    stop = None
    for t in seq_lens:
      if stop is not None:
        rows.append({"impl": name, "seq_len": t, "status": stop + " (at a smaller T)"})
        continue
      r = rounds if t <= 4096 else 1
      argv = [sys.executable, "-m", "mha_jax.harness.bench", "scale-t-one", name, str(d_model),
              str(num_heads), str(t), str(batch), str(r)]
      code, out, err = run_capped(argv, max_mem_gb, timeout_s)
      line = [l for l in out.splitlines() if l.startswith("{")]
      if code == 0 and line:
        row = json.loads(line[-1])
        row["status"] = "ok"
      else:
        oom = code is not None and ("RESOURCE_EXHAUSTED" in err or "MemoryError" in err
                                    or "bad_alloc" in err or code < 0
                                    or "attention scores whole" in err)  # refused up front
        status = "timeout" if code is None else ("over cap" if oom else "error")
        row = {"impl": name, "seq_len": t, "status": status,
               "error": err.strip().splitlines()[-1][:300] if err.strip() else ""}
        stop = status
      rows.append(row)
      log(f"{name} T={t}: {row['status']} "
          + (f"{row['median_ms']:.0f} ms, {row['max_rss_mb']:.0f} MB" if row["status"] == "ok"
             else row.get("error", "")))
  return {"config": {"d_model": d_model, "heads": num_heads, "batch": batch,
                     "seq_lens": list(seq_lens), "rounds": rounds,
                     "rounds_note": "1 timed round for T > 4096, after compilation",
                     "max_mem_gb": max_mem_gb, "dtype": "float32", "mode": "forward+backward",
                     "memory": "peak resident set (VmHWM) of a fresh process per row, "
                               "JAX runtime included; address space capped at max_mem_gb"},
          "machine": machine(), "rows": rows}


def format_scale_t(result: dict) -> str:
  """Markdown table: one row per T, time and peak memory per implementation."""
  c = result["config"]
  impls = list(dict.fromkeys(r["impl"] for r in result["rows"]))
  by = {(r["impl"], r["seq_len"]): r for r in result["rows"]}
  out = [f"d_model={c['d_model']}, h={c['heads']}, batch={c['batch']}, float32, "
         f"forward+backward; peak resident memory per fresh process, cap {c['max_mem_gb']} GB",
         "", "| T | " + " | ".join(impls) + " |", "|---:|" + "---|" * len(impls)]
  for t in c["seq_lens"]:
    cells = []
    for n in impls:
      r = by.get((n, t), {"status": "-"})
      cells.append(f"{r['median_ms']:.0f} ms, {r['max_rss_mb'] / 1024:.2f} GB"
                   if r["status"] == "ok" else r["status"])
    out.append(f"| {t} | " + " | ".join(cells) + " |")
  out.append("")
  for n in impls:
    ok = [r for r in result["rows"] if r["impl"] == n and r["status"] == "ok"]
    if ok:
      top = max(ok, key=lambda r: r["seq_len"])
      out.append(f"  {n}: largest T {top['seq_len']}, peak {top['max_rss_mb'] / 1024:.2f} GB")
    else:
      out.append(f"  {n}: no T ran")
  return "\n".join(out)


if __name__ == "__main__":
  import sys
  if len(sys.argv) == 9 and sys.argv[1] == "scale-t-one":
    _, _, name, d, h, t, b, r, cap_gb = sys.argv
    cap = int(float(cap_gb) * 2**30)
    resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
    print(json.dumps(_scale_t_one(name, d_model=int(d), num_heads=int(h), seq_len=int(t),
                                  batch=int(b), rounds=int(r))))
  else:
    sys.exit("usage: python -m mha_jax.harness.bench scale-t-one NAME D H T B ROUNDS CAP_GB")
