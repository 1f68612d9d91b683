"""The blocked kernel on a mesh: inside shard_map (the mesh in context; batch over "data",
heads over "model", GQA groups kept whole) it gives the unsharded call's outputs and
gradients, each device blocks only its own rows (no all-gather of the batch, 1/8 of the
FLOPs on 8 devices); on 8 host CPU devices, in a subprocess (the device count is fixed
at start)."""

import json
import subprocess
import sys

import pytest

from builders import ROOT, with_devices

# Each case: the call under jax.set_mesh against the same call with no mesh, forward and
# the gradients of <sin(o), 1> in every input; the compiled program's HLO, per-device
# FLOPs and temporaries against the one-device program's.
_SCRIPT = r"""
import json, sys
import jax, jax.numpy as jnp, numpy as np
from mha_jax.kernels.blocked import blocked_attention
from mha_jax.train import sharding

assert jax.device_count() == 8
out = {}

def inputs(b, t, h, g, dk, extra=(), seed=0):
  ks = jax.random.split(jax.random.PRNGKey(seed), 6)
  args = [jax.random.normal(ks[0], (b, t, h, dk)), jax.random.normal(ks[1], (b, t, g, dk)),
          jax.random.normal(ks[2], (b, t, g, dk))]
  if "bias" in extra:
    args.append(0.5 * jax.random.normal(ks[3], (1, h, t, t)))
  if "table" in extra:
    args.append(0.5 * jax.random.normal(ks[4], (h, 9)))
  if "sink" in extra:
    args.append(jax.random.normal(ks[5], (h,)))
  return args

def flops(c):
  ca = c.cost_analysis()
  return (ca[0] if isinstance(ca, list) else ca)["flops"]

def compare(name, fn, args, mesh_shape):
  def both(*a):   # o and the gradients of <sin(o), 1>: one program
    o, vjp = jax.vjp(fn, *a)
    return o, vjp(jnp.cos(o))
  one = jax.jit(both).lower(*args).compile()
  want, gwant = one(*args)
  mesh = sharding.make_mesh(*mesh_shape)
  with jax.set_mesh(mesh):
    rows = lambda a: a.ndim == 4 and a.shape[0] > 1 and a.shape[0] % mesh_shape[0] == 0
    put = lambda a: jax.device_put(a, jax.sharding.NamedSharding(
        mesh, jax.sharding.PartitionSpec("data" if rows(a) else None)))
    sargs = [put(a) for a in args]
    many = jax.jit(both).lower(*sargs).compile()
    got, ggot = many(*sargs)
  diff = lambda a, b: float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
  hlo = many.as_text()
  out[name] = {"out": diff(got, want), "grad": max(diff(a, b) for a, b in zip(ggot, gwant)),
               "scale": float(np.max(np.abs(np.asarray(want)))),
               "batch_gathers": sum("all-gather(" in line and "dimensions={0}" in line
                                    for line in hlo.splitlines()),
               "flops_ratio": flops(many) / flops(one),
               "temps_ratio": many.memory_analysis().temp_size_in_bytes /
                              one.memory_analysis().temp_size_in_bytes}

cases = json.loads(sys.argv[1])
if "data" in cases:       # batch over 8: steps of one (row, head) pair, blocks of 16
  f = lambda q, k, v: blocked_attention(q, k, v, causal=True, block_q=16, block_k=16,
                                        block_heads=1)
  compare("data", f, inputs(8, 64, 4, 4, 16), (8, 1))
if "flops" in cases:      # one step, one block: XLA's count is exact (loops count once)
  f = lambda q, k, v: blocked_attention(q, k, v, causal=True)
  compare("flops", f, inputs(8, 64, 4, 4, 16), (8, 1))
if "gqa" in cases:        # G = 4 over model = 4, batch over data = 2; bias and table
  f = lambda q, k, v, b, tab: blocked_attention(q, k, v, None, b, causal=True,
                                                rel_bias_HR=tab, block_q=16, block_heads=1)
  compare("gqa", f, inputs(4, 32, 8, 4, 16, ("bias", "table")), (2, 4))
if "repeat" in cases:     # G = 2 does not split over model = 4: kv repeated; a sink
  f = lambda q, k, v, sk: blocked_attention(q, k, v, causal=True, sink_H=sk, window=8,
                                            block_q=8, block_k=8, block_heads=1)
  compare("repeat", f, inputs(2, 32, 8, 2, 16, ("sink",)), (2, 4))
if "odd_batch" in cases:  # B = 3 does not split over data = 2: heads over model only
  f = lambda q, k, v: blocked_attention(q, k, v, sigmoid_bias=-1.0, block_q=16,
                                        block_heads=1)
  compare("odd_batch", f, inputs(3, 32, 4, 4, 16), (2, 4))
print("RESULT" + json.dumps(out))
"""


def _run(cases):
  r = subprocess.run([sys.executable, "-c", _SCRIPT, json.dumps(cases)], env=with_devices(8),
                     cwd=ROOT, capture_output=True, text=True, timeout=900)
  assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
  res = json.loads(r.stdout.split("RESULT")[1])
  assert sorted(res) == sorted(cases)
  for name, d in res.items():
    assert d["scale"] > 0.1, (name, d)
    assert d["out"] <= 1e-5 and d["grad"] <= 1e-4, (name, d)
    # The batch is never gathered (the repeated kv heads' gradient may be, over "model").
    assert d["batch_gathers"] == 0, (name, "the sharded program gathers the batch", d)
  return res


@pytest.mark.slow  # default run: test_pallas_mesh.py (the shard_map path)
def test_blocked_on_a_data_mesh_keeps_each_devices_rows():
  res = _run(["data", "flops"])
  # XLA counts a loop's body once; with one step and one block nothing is in a loop.
  assert 0.1 <= res["flops"]["flops_ratio"] <= 0.15, res["flops"]
  assert res["data"]["temps_ratio"] <= 0.5, res["data"]


@pytest.mark.slow
def test_blocked_on_data_and_model_axes_equals_the_unsharded_call():
  _run(["gqa", "repeat", "odd_batch"])
