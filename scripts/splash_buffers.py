"""Which buffers of the splash kernel grow with the head count: one attention layer's
forward+backward (B 32, T 128, d_model 768, causal, float32; configs/lm.py's shapes at
d_model 768) compiled for v5e:2x2 (data 4) at h = 8 (d_k 96) and h = 96 (d_k 8), with q,
k and v in the kernel's default layout (heads, T, K) and in the layout the wrapper picks
(pallas.splash_blocks), read from XLA's buffer assignment, into
docs/results/splash_buffers_v5e.json (scripts/docs_results.py renders it).

  PYTHONPATH=$PWD /work/venv-tpu/bin/python scripts/splash_buffers.py
"""

from __future__ import annotations

import glob
import json
import os
import re
import tempfile

os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

RESULT = "docs/results/splash_buffers_v5e.json"
B, T, D = 32, 128, 768
_VALUE = re.compile(r"<\d+ (\S+) @\d+> \(size=(\d+),offset=\d+\): (\S+)")


def buffers(dump_dir: str, least: int = 2**20) -> list[dict]:
  """The values of the temporaries (not parameters, outputs or constants) in the largest
  buffer assignment of dump_dir, of at least `least` bytes: name, shape with its layout
  (T(8,128): tiled 8 x 128; S(1): VMEM), bytes."""
  path = max(glob.glob(os.path.join(dump_dir, "*buffer-assignment.txt")), key=os.path.getsize)
  text = open(path).read()
  out, seen = [], set()
  for head, body in re.findall(r"^(allocation \d+: .*):\n((?: value:.*\n)*)", text, re.M):
    if any(t in head for t in ("parameter", "live-out", "constant", "thread-local")):
      continue
    for name, size, shape in _VALUE.findall(body):
      if int(size) >= least and name not in seen:
        seen.add(name)
        out.append({"name": name, "shape": shape, "bytes": int(size)})
  return sorted(out, key=lambda v: (-v["bytes"], v["name"]))


def measure(h: int, layout: str) -> dict:
  import jax
  import jax.numpy as jnp
  from jax.experimental.pallas.ops.tpu.splash_attention import (
      splash_attention_kernel as splash)
  from jax.sharding import NamedSharding, PartitionSpec as P
  from mha_jax import plan
  from mha_jax.kernels import dispatch, pallas
  topo = plan.topology("v5e:2x2")
  mesh = jax.sharding.Mesh(topo.devices, ("data",))
  x = jax.ShapeDtypeStruct((B, T, h, D // h), jnp.float32, sharding=NamedSharding(mesh, P("data")))
  loss = lambda q, k, v: jnp.sum(pallas.pallas_attention(
      q, k, v, causal=True, kernel="tpu_splash", platform="tpu", mesh=mesh) ** 2)
  ours = pallas.splash_blocks
  if layout == "head_dim_minor":
    pallas.splash_blocks = lambda k: splash.BlockSizes.get_default()
  try:
    with dispatch.compile_target(mesh):
      lowered = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(x, x, x)
    with tempfile.TemporaryDirectory() as d:
      lowered.compile(compiler_options={"xla_dump_to": d})
      spaces, bufs = plan.temp_bytes(d), buffers(d)
  finally:
    pallas.splash_blocks = ours
  return {"heads": h, "d_k": D // h, "layout": layout, "temps": spaces,
          "temps_total": sum(spaces.values()), "buffers": bufs,
          "qkv_bytes_unpadded": B // 4 * h * T * (D // h) * 4}


def main() -> None:
  from mha_jax import machine
  rows = [measure(h, layout) for h in (8, 96) for layout in ("head_dim_minor", "ours")]
  for r in rows:
    print(r["heads"], r["layout"], r["temps"])
  import jax
  out = {"topology": "v5e:2x2", "mesh": {"data": 4}, "shapes": {"B": B, "T": T, "d_model": D},
         "program": "grad of sum(splash(q, k, v)^2), causal, float32, one layer",
         "jax": jax.__version__, "rows": rows, "machine": machine.machine()}
  with open(RESULT, "w") as f:
    json.dump(out, f, indent=1)
  print(f"wrote {RESULT}")


if __name__ == "__main__":
  main()
