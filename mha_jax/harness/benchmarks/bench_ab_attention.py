"""The attention layer at a git revision against the working tree's, in one process,
rounds interleaved (drift on a shared machine hits both alike), forward+backward, with
flax.linen and linen + jax.nn as peers. Prints a table and writes JSON.

  mha-jax bench ab-attention 135ac61 --heads 8,96 --rounds 7 \
      --out docs/results/ab_fused_qkv_cpu.json

(135ac61: the code before the fused q/k/v projection; run in the checkout, whose git
history holds the revision.) The revision's whole package is loaded, kernels included, so
a kernel change is compared too:

  mha-jax bench ab-attention 8c0d26a --heads 8,96 --rounds 7 \
      --out docs/results/ab_packed_qkv_cpu.json

(8c0d26a: q, k, v read from one packed projection by the blocked kernel; not kept.)
"""

import dataclasses
import importlib
import importlib.machinery
import importlib.util
import statistics
import subprocess
import sys
import tempfile

import jax

from mha_jax.harness import bench
from mha_jax import attention
from mha_jax.errors import UserError
from mha_jax.harness.benchmarks import ROOT
from mha_jax.machine import machine
from mha_jax.settings import setting


@dataclasses.dataclass(frozen=True, kw_only=True)
class AbAttentionOptions:
  """The settings of `bench ab-attention`."""
  rev: str = setting("HEAD", positional=True, help="the git revision to compare with the "
                     "working tree (default: HEAD)")
  heads: tuple[int, ...] = setting((8, 96), lo=1, help="the head counts h")
  rounds: int = setting(7, lo=1, help="timed rounds (interleaved)")
  d_model: int = setting(768, lo=1, help="the model width (a multiple of each h)")
  seq_len: int = setting(512, lo=1, help="T")
  batch: int = setting(4, lo=1, help="B")
  out: str = setting("results/ab_attention.json", path=True, help="the JSON file")


def _old_attention(rev: str):
  """mha_jax.attention as the package was at `rev` (the whole package, kernels
  included, extracted with git archive), imported beside the working tree's: the
  working tree's modules are put back in sys.modules afterwards."""
  root = tempfile.mkdtemp()
  tar = subprocess.run(["git", "-C", ROOT, "archive", rev, "mha_jax"], capture_output=True)
  if tar.returncode:
    raise UserError(f"rev {rev!r} is not a revision of {ROOT}'s history: "
                    f"{tar.stderr.decode().strip()[-300:]}", setting="rev")
  subprocess.run(["tar", "-x", "-C", root], input=tar.stdout, check=True)
  ours = {n: m for n, m in sys.modules.items() if n == "mha_jax" or n.startswith("mha_jax.")}
  for n in ours:
    del sys.modules[n]
  try:    # the revision's package, found in its folder (sys.path unchanged)
    spec = importlib.machinery.PathFinder.find_spec("mha_jax", [root])
    sys.modules["mha_jax"] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sys.modules["mha_jax"])
    return importlib.import_module("mha_jax.attention")
  finally:
    for n in [n for n in sys.modules if n == "mha_jax" or n.startswith("mha_jax.")]:
      del sys.modules[n]
    sys.modules.update(ours)


def run(a: AbAttentionOptions) -> int:
  bad = [h for h in a.heads if a.d_model % h]
  if bad:
    raise UserError(f"heads {bad} do not divide d_model {a.d_model}",
                    setting=("heads", "d_model"))
  old = _old_attention(a.rev)
  gflops = bench.matmul_gflops()
  print(f"matmul rate {gflops:.1f} GFLOP/s")
  x = jax.random.normal(jax.random.PRNGKey(1), (a.batch, a.seq_len, a.d_model))
  rows = []
  for h in a.heads:
    built = bench.build_impls(a.d_model, h, with_cudnn=False)
    p = built["mha_jax impl=auto"][1]
    fns = {f"mha_jax at {a.rev}": (lambda p, x: old.multi_head_attention(p, x), p),
           "mha_jax now": (lambda p, x: attention.multi_head_attention(p, x), p),
           "flax.linen MHDPA": built["flax.linen MHDPA"],
           "linen + jax.nn.dot_product_attention":
               built["linen + jax.nn.dot_product_attention"]}
    mm, mm_flops = bench.matmul_row()
    comp = {"matmul 2048": mm}
    for n, (f, pp) in fns.items():        # the gradient of <y, ct> (bench.forward_backward)
      g, args = bench.forward_backward(f, (pp, x))
      jax.block_until_ready(g(*args))
      comp[n] = (lambda g=g, args=args: g(*args))
    times = {n: [] for n in comp}
    for _ in range(a.rounds):      # interleaved: each round times every row once
      for n in comp:
        times[n] += bench.round_seconds(comp[n], 1)
    rate = mm_flops / statistics.median(times.pop("matmul 2048")) / 1e9
    med = {n: statistics.median(t) * 1e3 for n, t in times.items()}
    peer = min(v for n, v in med.items() if not n.startswith("mha_jax"))
    for n, md in med.items():
      rows.append({"heads": h, "impl": n, "median_ms": md, "ratio_to_best_peer": md / peer,
                   "matmul_gflops": rate, "times_ms": [t * 1e3 for t in times[n]]})
      print(f"h={h} {n}: {md:.0f} ms, {md / peer:.2f}x the best peer")
    now, then = times["mha_jax now"], times[f"mha_jax at {a.rev}"]
    per_round = sorted(u / v for u, v in zip(now, then))
    print(f"h={h} now / at {a.rev}: {med['mha_jax now'] / med[f'mha_jax at {a.rev}']:.3f} "
          f"(rounds {per_round[0]:.3f}-{per_round[-1]:.3f}); matmul {rate:.0f} GFLOP/s")
  result = {"config": dataclasses.asdict(a), "mode": "forward+backward",
            "machine": machine(matmul_gflops=gflops),
            "rows": rows}
  bench.write_json(result, a.out)
  print(f"wrote {a.out}")
  return 0
