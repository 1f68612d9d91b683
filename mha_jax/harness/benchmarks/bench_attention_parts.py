"""Where one attention layer's forward+backward goes: the layer against its parts and the
best peer, with the matmul rate, in one process.

    mha-jax bench attention-parts [--heads 8,96] [--rounds 7]
                                  [--out docs/results/attention_parts_cpu.json]

Shapes as `mha-jax bench attention` (d_model 768, T 512, batch 4, float32, biases); each
row is a forward+backward (the gradient of <y, ct> with respect to every input and
weight, ct a fixed random cotangent given at run time: with sum(y)'s ones XLA may turn
a weight's gradient into a row sum), rounds interleaved over the rows, medians; the
matmul rate is a row of the same rounds (a (2048, 2048) @ (2048, 2048) product), so
every row meets the same load:

  layer          `attention.multi_head_attention(params, x, impl="auto")`
  projections    the layer's matmuls alone: x @ [W_Q W_K W_V] (one (D, 3D) matmul, as
                 the layer's fused projection) with its biases, split into q, k, v, then
                 (q + k + v) @ W_O + b_O: the attention core replaced by a sum, so the
                 backward joins three gradients again as the layer's does
  core           the attention core alone: the blocked kernel (what auto runs at these
                 shapes) on q, k, v (B, T, H, K)
  bare matmuls   the projections without their biases or any reshape: (B*T, D) @
                 (D, 3D) and (B*T, D) @ (D, D), the matmul rate at the layer's shapes
  flax.linen     the fastest peer in `bench attention` (flax.linen MHDPA)

FLOPs are the matmul FLOPs each row's forward+backward runs: the backward's two
matmuls per forward one, and the forward's matmuls except the last one before the
output, which the gradient of <y, ct> never needs (XLA removes it as dead code): W_O's
forward in the layer, the projections row and the peer, and both forwards of the bare
matmuls (that row is the backward's matmuls alone). The blocked backward also recomputes
the scores (one more scores matmul, 2 B T^2 D), not counted. The floor is the layer's
FLOPs over the faster of the two measured rates (the (2048, 2048) product's and the bare
projection matmuls'): no implementation's time is below it, so the best peer's time
over the floor is the largest ratio to that peer any implementation can reach on this
machine.
"""

from __future__ import annotations

import dataclasses
import statistics
import time

import jax
import jax.numpy as jnp

from mha_jax.harness import bench
from mha_jax import accounting, attention
from mha_jax.kernels import blocked
from mha_jax.machine import machine
from mha_jax.settings import setting


@dataclasses.dataclass(frozen=True, kw_only=True)
class AttentionPartsOptions:
  """The settings of `bench attention-parts`."""
  heads: tuple[int, ...] = setting((8, 96), lo=1, help="comma-separated head counts")
  d_model: int = setting(768, lo=1, help="the width D")
  seq_len: int = setting(512, lo=1, help="the sequence length T")
  batch: int = setting(4, lo=1, help="the batch size")
  rounds: int = setting(7, lo=1, help="timed rounds (interleaved over the rows)")
  out: str = setting("results/attention_parts.json", path=True, help="the JSON file")


def parts(d: int, h: int, t: int, b: int):
  """{name: (f(args) -> scalar, args, the matmul FLOPs its forward+backward runs)} of
  one h (see the module's docstring: the last forward matmul is dead code)."""
  k = d // h
  p = attention.init_attention_params(jax.random.PRNGKey(0), d, h, use_bias=True)
  x = jax.random.normal(jax.random.PRNGKey(1), (b, t, d))
  qkv = [jax.random.normal(jax.random.PRNGKey(i), (b, t, h, k)) for i in (2, 3, 4)]
  fl = accounting.attention_flops(d, t, batch=b)
  proj, core = fl["projections"], fl["scores"] + fl["mixing"]
  w_o = 2 * b * t * d * d     # W_O's forward: never run by the gradient of <y, ct>

  def layer(p, x):
    return attention.multi_head_attention(p, x, impl="auto")

  def projections(p, x):
    w = jnp.concatenate([p["wq"], p["wk"], p["wv"]], axis=1).reshape(d, 3 * d)
    bias = jnp.concatenate([p["bq"], p["bk"], p["bv"]], axis=0).reshape(3 * d)
    y = x.reshape(b * t, d) @ w + bias
    return (y[:, :d] + y[:, d:2 * d] + y[:, 2 * d:]) @ p["wo"].reshape(d, d) + p["bo"]

  def core_fn(q, k_, v):
    return blocked.blocked_attention(q, k_, v)

  def bare(w3, wo, x2):
    return x2 @ w3, x2 @ wo

  linen_f, linen_p = bench.build_impls(d, h, with_cudnn=False)["flax.linen MHDPA"]
  w3 = jax.random.normal(jax.random.PRNGKey(5), (d, 3 * d)) / d ** 0.5
  wo = jax.random.normal(jax.random.PRNGKey(6), (d, d)) / d ** 0.5
  return {"layer": (layer, (p, x), 3 * (proj + core) - w_o),
          "projections": (projections, (p, x), 3 * proj - w_o),
          "core": (core_fn, tuple(qkv), 3 * core),
          "bare matmuls": (bare, (w3, wo, x.reshape(b * t, d)), 2 * proj),
          "flax.linen MHDPA": (linen_f, (linen_p, x), 3 * (proj + core) - w_o)}


def run(args: AttentionPartsOptions) -> int:
  d, t, b = args.d_model, args.seq_len, args.batch
  matmul, matmul_flops = bench.matmul_row()
  result = {"config": {"d_model": d, "seq_len": t, "batch": b, "rounds": args.rounds,
                       "dtype": "float32", "mode": "forward+backward"}, "heads": {}}
  for h in args.heads:
    fns = {"matmul 2048": (matmul, (), matmul_flops)}      # forward only
    for name, (f, a, flops) in parts(d, h, t, b).items():
      fns[name] = (*bench.forward_backward(f, a), flops)
    for g, a, _ in fns.values():
      jax.block_until_ready(g(*a))             # compile and warm up
    times = {n: [] for n in fns}
    for _ in range(args.rounds):               # interleaved rounds
      for n, (g, a, _) in fns.items():
        bench.settle()
        t0 = time.perf_counter()
        jax.block_until_ready(g(*a))
        times[n].append(time.perf_counter() - t0)
    med = {n: statistics.median(v) for n, v in times.items()}
    rate = matmul_flops / med.pop("matmul 2048") / 1e9
    times.pop("matmul 2048"), fns.pop("matmul 2048")
    rows = {n: {"median_ms": 1e3 * med[n], "gflop": fns[n][2] / 1e9,
                "pct_of_matmul_rate": 100 * fns[n][2] / med[n] / 1e9 / rate,
                "share_of_layer": med[n] / med["layer"],
                "times_ms": [1e3 * x for x in times[n]]} for n in fns}
    best_rate = max(rate, fns["bare matmuls"][2] / med["bare matmuls"] / 1e9)
    floor = fns["layer"][2] / best_rate / 1e9
    result["heads"][str(h)] = {
        "rows": rows, "matmul_gflops": rate, "floor_gflops": best_rate,
        "floor_ms": 1e3 * floor,
        "rest_ms": 1e3 * (med["layer"] - med["projections"] - med["core"]),
        "ratio_to_linen": med["flax.linen MHDPA"] / med["layer"],
        "ratio_bound": med["flax.linen MHDPA"] / floor}
  result["machine"] = machine()
  result["table"] = table_of(result)
  print(result["table"])
  bench.write_json(result, args.out)
  print(f"wrote {args.out}")
  return 0


def table_of(result: dict) -> str:
  """The markdown table, one block of rows per h, and the bound."""
  lines = ["| h | part | ms | GFLOP | % of matmul rate | share of the layer's time |",
           "|---|---|---|---|---|---|"]
  for h, r in result["heads"].items():
    for n, row in r["rows"].items():
      lines.append(f"| {h} | {n} | {row['median_ms']:.1f} | {row['gflop']:.2f} | "
                   f"{row['pct_of_matmul_rate']:.0f} | {row['share_of_layer']:.2f} |")
  lines.append("")
  for h, r in result["heads"].items():
    lines.append(f"h = {h}: matmul rate {r['matmul_gflops']:.0f} GFLOP/s in these rounds; "
                 f"the layer is {r['ratio_to_linen']:.2f}x flax.linen; its floor "
                 f"(FLOPs / {r['floor_gflops']:.0f} GFLOP/s) {r['floor_ms']:.1f} ms allows at most "
                 f"{r['ratio_bound']:.2f}x; layer - projections - core = "
                 f"{r['rest_ms']:.1f} ms.")
  return "\n".join(lines)
