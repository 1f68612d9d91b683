"""Attention benchmark: this project's layer against its peers, side by side in one run.

Every implementation runs the same self-attention (same weights, same input) in the
same process. Rounds are interleaved (each round times every implementation once),
so drift on a shared machine hits all of them alike; we report the median.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from typing import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx

from mha_jax import accounting, attention, layers
from mha_jax.errors import UserError

DEFAULT_HEADS = (8, 12, 16, 32, 64, 96)


def _round_seconds(fn: Callable[[], object], rounds: int) -> list[float]:
  """Wall seconds of each of `rounds` calls (the caller takes the median)."""
  out = []
  for _ in range(rounds):
    t0 = time.perf_counter()
    jax.block_until_ready(fn())
    out.append(time.perf_counter() - t0)
  return out


def matmul_gflops(n: int = 2048, rounds: int = 7, dtype=jnp.float32) -> float:
  """The machine's measured (n x n) @ (n x n) rate, GFLOP/s, median of `rounds`."""
  a = jax.random.normal(jax.random.PRNGKey(0), (n, n), dtype)
  f = jax.jit(lambda a, b: a @ b)
  jax.block_until_ready(f(a, a))
  t = statistics.median(_round_seconds(lambda: f(a, a), rounds))
  return 2 * n**3 / t / 1e9


def _linen_dpa_fn(query, key, value, bias=None, mask=None, **_):
  """attention_fn for flax.linen that calls jax.nn.dot_product_attention."""
  return jax.nn.dot_product_attention(query, key, value, bias=bias, mask=mask,
                                      implementation="xla")


def build_impls(d_model: int, num_heads: int, *, with_cudnn: bool,
                dtype=jnp.float32) -> dict[str, tuple[Callable, object]]:
  """name -> (pure function f(params, x) -> y, params), all with the same weights."""
  ours = attention.init_attention_params(jax.random.PRNGKey(0), d_model, num_heads,
                                         use_bias=True, dtype=dtype)
  flax_params = {"params": layers.to_flax_linen(ours)}
  impls = {}
  for impl in ("auto", "reference", "xla"):
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


def run(*, d_model: int = 768, seq_len: int = 512, batch: int = 4,
        heads=DEFAULT_HEADS, rounds: int = 5, warmup: int = 1, with_cudnn: bool | None = None,
        dtype: str = "float32", log: Callable[[str], None] = print) -> dict:
  """Times forward and forward+backward for every implementation and every h."""
  if rounds < 1:
    raise UserError(f"rounds must be >= 1; got {rounds}")
  for h in heads:
    if h < 1 or d_model % h:
      raise UserError(f"heads: h={h} does not divide d_model={d_model}")
  if with_cudnn is None:
    with_cudnn = attention._gpu_available()
  dt = jnp.dtype(dtype)
  if with_cudnn and dt == jnp.float32:
    log("note: cuDNN attention needs bfloat16/float16; rerun with --dtype bfloat16 "
        "for the impl=cudnn row")
    with_cudnn = False
  gflops = matmul_gflops(dtype=dt)
  log(f"device: {jax.devices()[0].device_kind} x{jax.device_count()}, "
      f"{dtype} matmul rate {gflops:.1f} GFLOP/s")
  fwd_flops = accounting.attention_flops(d_model, seq_len, batch=batch)["total"]
  x = jax.random.normal(jax.random.PRNGKey(1), (batch, seq_len, d_model), dt)
  rows = []
  for h in heads:
    impls = build_impls(d_model, h, with_cudnn=with_cudnn, dtype=dt)
    compiled = {}
    for name, (f, p) in impls.items():
      fwd = jax.jit(f)
      grad = jax.jit(jax.grad(lambda p, x, f=f: jnp.sum(f(p, x).astype(jnp.float32)),
                              argnums=(0, 1)))
      compiled[name] = {"forward": (lambda fwd=fwd, p=p: fwd(p, x)),
                        "forward+backward": (lambda grad=grad, p=p: grad(p, x))}
      for run_fn in compiled[name].values():
        for _ in range(warmup):
          jax.block_until_ready(run_fn())
    times = {(n, m): [] for n in compiled for m in ("forward", "forward+backward")}
    for _ in range(rounds):  # interleaved
      for (n, m) in times:
        times[(n, m)] += _round_seconds(compiled[n][m], 1)
    for mode, mult in (("forward", 1), ("forward+backward", 3)):
      meds = {n: statistics.median(times[(n, mode)]) for n in compiled}
      peers = [v for n, v in meds.items() if not n.startswith("mha_jax")]
      best_peer = min(peers)
      for n, med in meds.items():
        rows.append({"heads": h, "d_k": d_model // h, "mode": mode, "impl": n,
                     "median_ms": med * 1e3,
                     "ratio_to_best_peer": med / best_peer,
                     "pct_of_matmul_rate": 100 * mult * fwd_flops / med / (gflops * 1e9),
                     "times_ms": [t * 1e3 for t in times[(n, mode)]]})
    log(f"h={h}: done")
  return {
      "config": {"d_model": d_model, "seq_len": seq_len, "batch": batch,
                 "heads": list(heads), "rounds": rounds, "warmup": warmup, "dtype": dtype},
      "machine": {"backend": jax.default_backend(),
                  "device_kind": jax.devices()[0].device_kind,
                  "device_count": jax.device_count(), "cpu_count": os.cpu_count(),
                  "platform": platform.platform(), "jax": jax.__version__,
                  "matmul_gflops": gflops},
      "flops_forward": fwd_flops,
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


def write_json(result: dict, path: str) -> None:
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  tmp = path + ".tmp"
  with open(tmp, "w") as f:
    json.dump(result, f, indent=1)
  os.replace(tmp, path)
