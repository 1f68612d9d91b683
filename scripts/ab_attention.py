"""The attention layer at a git revision against the working tree's, in one process,
rounds interleaved (drift on a shared machine hits both alike), forward+backward, with
flax.linen and linen + jax.nn as peers. Prints a table and writes JSON.

  PYTHONPATH=. python scripts/ab_attention.py 135ac61 --heads 8,96 --rounds 7 \
      --out docs/results/ab_fused_qkv_cpu.json

(135ac61: the code before the fused q/k/v projection.)
"""

import argparse
import importlib.util
import os
import statistics
import subprocess
import sys
import tempfile
import time

import jax
import jax.numpy as jnp

from experiments import bench
from mha_jax import attention


def _old_attention(rev: str):
  src = subprocess.run(["git", "show", f"{rev}:mha_jax/attention.py"], check=True,
                       capture_output=True, text=True).stdout
  path = os.path.join(tempfile.mkdtemp(), "attention_at_rev.py")
  with open(path, "w") as f:
    f.write(src)
  spec = importlib.util.spec_from_file_location("attention_at_rev", path)
  mod = importlib.util.module_from_spec(spec)
  sys.modules["attention_at_rev"] = mod
  spec.loader.exec_module(mod)
  return mod


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("rev")
  ap.add_argument("--heads", default="8,96")
  ap.add_argument("--rounds", type=int, default=7)
  ap.add_argument("--d-model", type=int, default=768)
  ap.add_argument("--seq-len", type=int, default=512)
  ap.add_argument("--batch", type=int, default=4)
  ap.add_argument("--out", default="results/ab_attention.json")
  a = ap.parse_args()
  old = _old_attention(a.rev)
  gflops = bench.matmul_gflops()
  print(f"matmul rate {gflops:.1f} GFLOP/s")
  x = jax.random.normal(jax.random.PRNGKey(1), (a.batch, a.seq_len, a.d_model))
  rows = []
  for h in [int(v) for v in a.heads.split(",")]:
    built = bench.build_impls(a.d_model, h, with_cudnn=False)
    p = built["mha_jax impl=auto"][1]
    fns = {f"mha_jax at {a.rev}": (lambda p, x: old.multi_head_attention(p, x), p),
           "mha_jax now": (lambda p, x: attention.multi_head_attention(p, x), p),
           "flax.linen MHDPA": built["flax.linen MHDPA"],
           "linen + jax.nn.dot_product_attention":
               built["linen + jax.nn.dot_product_attention"]}
    comp = {}
    for n, (f, pp) in fns.items():
      g = jax.jit(jax.grad(lambda p, x, f=f: jnp.sum(f(p, x)), argnums=(0, 1)))
      jax.block_until_ready(g(pp, x))
      comp[n] = (lambda g=g, pp=pp: g(pp, x))
    times = {n: [] for n in comp}
    for _ in range(a.rounds):
      for n in comp:
        times[n] += bench._round_seconds(comp[n], 1)
    med = {n: statistics.median(t) * 1e3 for n, t in times.items()}
    peer = min(v for n, v in med.items() if not n.startswith("mha_jax"))
    for n, m in med.items():
      rows.append({"heads": h, "impl": n, "median_ms": m, "ratio_to_best_peer": m / peer,
                   "times_ms": [t * 1e3 for t in times[n]]})
      print(f"h={h} {n}: {m:.0f} ms, {m / peer:.2f}x the best peer")
    print(f"h={h} now / at {a.rev}: {med['mha_jax now'] / med[f'mha_jax at {a.rev}']:.3f}")
  result = {"config": vars(a), "mode": "forward+backward",
            "machine": {"backend": jax.default_backend(), "cpu_count": os.cpu_count(),
                        "jax": jax.__version__, "matmul_gflops": gflops,
                        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())},
            "rows": rows}
  bench.write_json(result, a.out)
  print(f"wrote {a.out}")


if __name__ == "__main__":
  main()
