"""Llama-3.1-70B on v5p without a full compile: why its plan is slow to make here, and the
least memory its train state needs per device on each v5p slice.

  PYTHONPATH=$PWD /work/venv-tpu/bin/python scripts/plan_llama70b.py

1. Lowers (traces, no compile) the forward of Llama-3.1-8B and -70B (docs/data/*.config.json,
   bfloat16, B 8 x T 2048) for v5p:2x2x1 with a model axis of 4: the time and the size of
   the lowered program. The decoder runs its layers as a Python loop over
   params["lm"]["layer_i"] (no scan), so the program holds every layer: its size, and
   XLA's compile time, grow with the layer count.
2. Per v5p slice (model axis: the largest that divides the 64 heads and the devices):
   the bytes per device of the params and of the train state (params, gradients, AdamW's
   two moments, all in the params' dtype, laid out as training lays them out), a lower
   bound on any train step (activations and temporaries come on top).
Writes docs/results/plan_llama70b_v5p.json.
"""

from __future__ import annotations

import json
import os
import time

os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

RESULT = "docs/results/plan_llama70b_v5p.json"
SLICES = ("v5p:2x2x1", "v5p:2x2x2", "v5p:2x2x4", "v5p:2x4x4")


def _source(name: str, mesh: str):
  from mha_jax import plan
  opts = plan.PlanOptions(topology="v5p:2x2x1", job="forward", dtype="bfloat16", mesh=mesh,
                          hf_config=f"docs/data/{name}.config.json")
  return plan.load_source(opts, None, [], None)


def lowered(name: str) -> dict:
  import jax
  from mha_jax import plan
  from mha_jax.kernels import dispatch
  from mha_jax.train import sharding
  src = _source(name, "data=1,model=4")
  mesh = sharding.make_mesh(1, 4, devices=plan.topology("v5p:2x2x1").devices)
  args = (plan.placed(src.params, sharding.shardings(src.params, mesh)),
          plan.batch_on(src.batches["forward"], mesh))
  t0, c0 = time.time(), time.process_time()
  with dispatch.compile_target(mesh):
    text = jax.jit(lambda p, b: src.task.apply(p, b)).lower(*args).as_text()
  return {"model": name, "layers": int(src.cfg.model.num_layers),
          "lower_wall_s": round(time.time() - t0, 1), "lower_cpu_s": round(time.process_time() - c0, 1),
          "stablehlo_lines": text.count("\n"), "dot_general": text.count("stablehlo.dot_general"),
          "while_loops": text.count("stablehlo.while")}


def state_bytes(name: str) -> list[dict]:
  from mha_jax import plan
  from mha_jax.train import sharding
  src = _source(name, "data=1,model=4")
  rows = []
  for topo_name in SLICES:
    topo = plan.topology(topo_name)
    n = len(topo.devices)
    model = max(m for m in range(1, n + 1) if n % m == 0 and src.heads % m == 0)
    mesh = sharding.make_mesh(n // model, model, devices=topo.devices)
    params = plan.shard_bytes(plan.placed(src.params, sharding.shardings(src.params, mesh)))
    rows.append({"topology": topo_name, "devices": n, "mesh": dict(mesh.shape),
                 "params": params, "train_state": 4 * params, "hbm": topo.hbm,
                 "state_fits": 4 * params <= topo.hbm})
  return rows


def main() -> None:
  import jax
  from mha_jax import machine
  from mha_jax.plan import versions
  out = {"lowered": [lowered(m) for m in ("llama-3.1-8b", "llama-3.1-70b")],
         "train_state_70b": state_bytes("llama-3.1-70b"), **versions(),
         "machine": machine.machine()}
  jax.config.update("jax_default_matmul_precision", None)
  with open(RESULT, "w") as f:
    json.dump(out, f, indent=1)
  print(json.dumps(out, indent=1))


if __name__ == "__main__":
  main()
