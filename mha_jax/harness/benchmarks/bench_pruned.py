#!/usr/bin/env python
"""Forward-pass speed of a pruned (exported) checkpoint against its dense source.

  mha-jax bench pruned --dense runs/qs --pruned runs/qs_exported

Times, side by side in one process with interleaved rounds (median of --rounds):
  attention  every attention block of the pruned stacks alone, on the same inputs
  model      the whole forward pass (teacher-forced logits) on a test batch
Prints a table and writes JSON.
"""
import dataclasses
import json
import os
import statistics
import time

import jax

from mha_jax import attention
from mha_jax.errors import UserError
from mha_jax.loader import load
from mha_jax.models import common
from mha_jax.settings import setting


@dataclasses.dataclass(frozen=True, kw_only=True)
class PrunedOptions:
  """The settings of `bench pruned`."""
  dense: str = setting(path=True, help="the dense run's workdir")
  pruned: str = setting(path=True, help="its pruned, exported workdir (mha-jax "
                        "export-pruned)")
  batch: int = setting(64, lo=1, help="the batch size")
  seq_len: int = setting(64, lo=1, help="the attention inputs' T")
  rounds: int = setting(15, lo=1, help="timed rounds (interleaved)")
  out: str = setting("results/bench_pruned.json", path=True, help="the JSON file")


def blocks(params, stacks):
  return [p for s, _, p in common.attention_blocks(params) if s in stacks]


def run(a: PrunedOptions) -> int:
  dense, pruned = load(a.dense), load(a.pruned)
  counts_d, counts_p = common.head_counts(dense.params), common.head_counts(pruned.params)
  stacks = [s for s in counts_p if counts_p[s] != counts_d[s]]
  if not stacks:
    raise UserError("pruned has the same head counts as dense: export it first "
                    "(mha-jax export-pruned)", setting=("pruned", "dense"))
  d = dense.params["embed"].shape[1]
  x = jax.random.normal(jax.random.PRNGKey(0), (a.batch, a.seq_len, d))

  def attn_fn(params):
    bl = blocks(params, stacks)
    return jax.jit(lambda x: sum(attention.multi_head_attention(p, x) for p in bl))

  batch = next(dense.task.eval_batches("test", a.batch))[0]
  fns = {
      ("attention", "dense"): (attn_fn(dense.params), (x,)),
      ("attention", "pruned"): (attn_fn(pruned.params), (x,)),
      ("model", "dense"): (jax.jit(lambda b: dense.task.apply(dense.params, b)), (batch,)),
      ("model", "pruned"): (jax.jit(lambda b: pruned.task.apply(pruned.params, b)), (batch,)),
  }
  for f, args in fns.values():
    jax.block_until_ready(f(*args))
  times = {k: [] for k in fns}
  for _ in range(a.rounds):
    for k, (f, args) in fns.items():
      t0 = time.perf_counter()
      jax.block_until_ready(f(*args))
      times[k].append(time.perf_counter() - t0)
  med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
  heads = lambda c: sum(sum(c[s]) for s in stacks)
  rows = [{"part": part, "dense_ms": med[(part, "dense")], "pruned_ms": med[(part, "pruned")],
           "speedup": med[(part, "dense")] / med[(part, "pruned")]}
          for part in ("attention", "model")]
  print(f"pruned stacks {stacks}: {heads(counts_d)} -> {heads(counts_p)} heads "
        f"({counts_p}); batch {a.batch}, attention inputs T={a.seq_len}, "
        f"median of {a.rounds} interleaved rounds, {jax.devices()[0].device_kind}")
  print("| part | dense ms | pruned ms | speed-up |\n|---|---:|---:|---:|")
  for r in rows:
    print(f"| {r['part']} | {r['dense_ms']:.2f} | {r['pruned_ms']:.2f} | {r['speedup']:.2f}x |")
  os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
  with open(a.out, "w") as f:
    json.dump({"dense": a.dense, "pruned": a.pruned, "stacks": stacks,
               "head_counts": {"dense": counts_d, "pruned": counts_p}, "rows": rows,
               "times_ms": {f"{k[0]}/{k[1]}": [t * 1e3 for t in v] for k, v in times.items()}},
              f, indent=1)
  return 0
