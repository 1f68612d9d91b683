"""Speed of edge attribution on a decoder LM (default SmolLM2-135M's IOI pairs).

    mha-jax bench circuit [--workdir DIR] [--pairs 8] [--steps 5] [--rounds 2]
                          [--out results/bench_circuit.json]

  forward+backward   one forward and backward of the mean logit difference
                     (toolkit.activation_patching.Study.forward_backward_seconds): the unit
  EAP                every edge's score (circuits.edges.EdgeStudy.eap): one forward and
                     backward of the edge-masked forward (the node outputs and ablated
                     values are computed once when the study is built; their two
                     forwards are timed apart)
  EAP-IG             --steps steps on the inputs, against (steps + 2) x the unit
  curve              19 circuit sizes as one batched program (circuits.search.curve)
  one edge forward   the edge-masked forward alone (what each exact patch costs)

Medians over --rounds after a warm-up (compilation excluded and reported). float32, CPU.
Prints a table and writes JSON with the machine's matmul rate.
"""

from __future__ import annotations

import dataclasses
import os
import time

import numpy as np

from mha_jax.settings import setting


@dataclasses.dataclass(frozen=True, kw_only=True)
class CircuitBenchOptions:
  """The settings of `bench circuit`."""
  workdir: str = setting("workdirs/smollm2", path=True, help="an imported decoder LM")
  pairs: int = setting(8, lo=1, help="IOI pairs")
  steps: int = setting(5, lo=1, help="EAP-IG's steps")
  rounds: int = setting(2, lo=1, help="timed rounds after a warm-up")
  curve: bool = setting(True, help="time the faithfulness curve (--no-curve: leave it out)")
  out: str = setting("results/bench_circuit.json", path=True, help="the JSON file")


def run(args: CircuitBenchOptions) -> int:
  import jax
  import jax.numpy as jnp
  from mha_jax.harness import bench
  from mha_jax import load
  from mha_jax.machine import machine
  from mha_jax.circuits import edges as edges_lib, search
  from mha_jax.toolkit import activation_patching, pairs as pairs_lib
  loaded = load(args.workdir)
  pairs = pairs_lib.ioi_pairs(loaded.task, args.pairs)
  s = activation_patching.Study(loaded.task, loaded.params, pairs, share_prefix=False)
  t0 = time.perf_counter()
  es = edges_lib.EdgeStudy(s)
  setup = time.perf_counter() - t0
  fb = s.forward_backward_seconds(args.rounds)
  ones = jnp.ones(es.mask.shape, jnp.float32)
  _, fwd_first, fwd, _ = bench.first_and_rounds(lambda: es.metric(ones), args.rounds)
  _, eap_first, eap, _ = bench.first_and_rounds(es.eap, args.rounds)
  _, ig_first, ig, _ = bench.first_and_rounds(lambda: es.eap_ig(args.steps), args.rounds)
  scores = es.eap()
  counts = search.sizes(len(es.edges))
  curve = curve_first = float("nan")
  if args.curve:
    keeps = np.stack([search.top_n(es.graph, es.edges, scores, n) for n in counts]).astype(
        np.float32)
    _, curve_first, curve, _ = bench.first_and_rounds(lambda: jax.block_until_ready(es.curve(keeps)),
                                   args.rounds)
  rate = bench.matmul_gflops()
  result = {"workdir": args.workdir, "pairs": len(pairs), "tokens": int(pairs.clean.shape[1]),
            "graph": es.graph.size(), "steps": args.steps, "study_setup_s": setup,
            "forward_backward_s": fb, "edge_forward_s": fwd,
            "eap_s": eap, "eap_ratio": eap / fb, "eap_first_s": eap_first,
            "eap_ig_s": ig, "eap_ig_ratio": ig / fb, "eap_ig_bound": args.steps + 2,
            "eap_ig_first_s": ig_first, "curve_sizes": len(counts), "curve_s": curve,
            "curve_first_s": curve_first, "curve_ratio_to_edge_forward": curve / fwd,
            "edge_forward_first_s": fwd_first,
            "machine": machine(matmul_gflops=rate)}
  rows = [f"| {es.graph.size()['edges']} edges, {len(pairs)} IOI pairs | median s | "
          f"ratio |", "|---|---|---|",
          f"| forward+backward (plain) | {fb:.3f} | 1.00x |",
          f"| EAP, every edge | {eap:.3f} | {eap / fb:.2f}x (issue: <= 3x) |",
          f"| EAP-IG, {args.steps} steps | {ig:.3f} | {ig / fb:.2f}x (issue: <= "
          f"{args.steps + 2}x) |",
          f"| one edge-masked forward | {fwd:.3f} | {fwd / fb:.2f}x |",
          f"| curve, {len(counts)} sizes, one program | {curve:.3f} | "
          f"{curve / fwd:.1f}x one edge forward |"]
  result["table"] = "\n".join(rows)
  print(result["table"])
  print(f"matmul rate {rate:.0f} GFLOP/s (load average {os.getloadavg()[0]:.1f})")
  bench.write_json(result, args.out)
  print(f"wrote {args.out}")
  return 0
