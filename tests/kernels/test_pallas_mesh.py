"""Pallas kernels on a mesh: through shard_map (batch over "data", heads over "model",
GQA groups kept whole) they give the unsharded call's outputs and gradients; on 8 host
CPU devices in interpret mode, in a subprocess (the device count is fixed at start).
Compiled for a real TPU topology in test_tpu_compile.py (marker tpu)."""

import json
import subprocess
import sys

import pytest

from builders import ROOT, with_devices

# Each case: the sharded call (under jax.set_mesh) against the same call with no mesh,
# forward and the gradients of <sin(o), 1> in q, k, v (and the bias).
_SCRIPT = r"""
import json, sys
import jax, jax.numpy as jnp, numpy as np
from mha_jax.kernels import pallas
from mha_jax.train import sharding

assert jax.device_count() == 8
out = {}

def inputs(b, t, h, g, dk, bias=False, seed=0):
  ks = jax.random.split(jax.random.PRNGKey(seed), 4)
  args = [jax.random.normal(ks[0], (b, t, h, dk)), jax.random.normal(ks[1], (b, t, g, dk)),
          jax.random.normal(ks[2], (b, t, g, dk))]
  if bias:
    args.append(0.5 * jax.random.normal(ks[3], (1, h, t, t)))
  return args

def compare(name, fn, args, mesh_shape):
  loss = lambda *a: jnp.sum(jnp.sin(fn(*a)))
  run = lambda: (jax.jit(fn)(*args), jax.jit(jax.grad(loss, range(len(args))))(*args))
  want, gwant = run()
  mesh = sharding.make_mesh(*mesh_shape)
  with jax.set_mesh(mesh):
    got, ggot = run()
    hlo = jax.jit(fn).lower(*args).as_text()
  diff = lambda a, b: float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
  out[name] = {"out": diff(got, want), "grad": max(diff(a, b) for a, b in zip(ggot, gwant)),
               "scale": float(np.max(np.abs(np.asarray(want)))),
               "shard_map": "shard_map" in hlo or "manual" in hlo.lower()}

cases = json.loads(sys.argv[1])
# Pallas's generic interpreter (interpret=True): TPU interpret mode (pallas_tpu_interpret)
# holds a barrier across the simulated devices that can deadlock on a 2-core host.
if "splash" in cases:     # GQA, G = 4 split over model = 4; causal, soft-capped
  f = lambda q, k, v: pallas.pallas_attention(q, k, v, causal=True, kernel="tpu_splash",
                                              interpret=True, softcap=2.0)
  compare("splash", f, inputs(2, 128, 8, 4, 32), (2, 4))
if "splash_repeat" in cases:   # G = 2 does not split over model = 4: kv repeated to H
  f = lambda q, k, v: pallas.pallas_attention(q, k, v, kernel="tpu_splash", interpret=True)
  compare("splash_repeat", f, inputs(4, 128, 4, 1, 32), (2, 4))
if "gpu" in cases:        # the Triton kernel's interpret mode; MQA on a data axis
  f = lambda q, k, v: pallas.pallas_attention(q, k, v, causal=True, kernel="gpu",
                                              interpret=True)
  compare("gpu", f, inputs(8, 32, 2, 1, 16), (8, 1))
print("RESULT" + json.dumps(out))
"""


def _run(cases):
  r = subprocess.run([sys.executable, "-c", _SCRIPT, json.dumps(cases)], env=with_devices(8),
                     cwd=ROOT, capture_output=True, text=True, timeout=900)
  assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
  res = json.loads(r.stdout.split("RESULT")[1])
  assert sorted(res) == sorted(cases)
  for name, d in res.items():
    assert d["shard_map"], (name, "the kernel was not called inside shard_map")
    assert d["scale"] > 0.1, (name, d)
    assert d["out"] <= 1e-5 and d["grad"] <= 1e-4, (name, d)
  return res


def test_pallas_through_shard_map_equals_the_unsharded_call():
  _run(["splash"])


@pytest.mark.slow
def test_every_pallas_kernel_through_shard_map_equals_the_unsharded_call():
  """The kv heads repeated when "model" does not divide them (MQA: G = 1), and the GPU
  kernel. The TPU flash kernel (the one with a bias) has no generic interpreter: its
  shard_map is checked by compiling for a TPU (test_tpu_compile.py)."""
  _run(["splash_repeat", "gpu"])
