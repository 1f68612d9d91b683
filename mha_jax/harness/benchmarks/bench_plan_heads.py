"""The seeds' claim per device: `mha-jax plan` of the LM's train step at h = 8 .. 96.

configs/lm.py's train step at h = 8, 16, 32, 64, 96 (d_model 768, so d_k = 96 .. 8) on a
TPU slice, one row per kernel, into docs/results/plan_heads_v5e.json
(scripts/docs_results.py renders it).

  mha-jax bench plan-heads --plans /tmp/plan_heads [--topology v5e:2x2]

(with the TPU compiler installed: libtpu). Each plan is written to
PLANS/<impl>_h<h>/plan.json (a plan already there is kept, so an interrupted run resumes);
the summary (--out) collects them.
"""

from __future__ import annotations

import dataclasses
import json
import os

from mha_jax.errors import UserError
from mha_jax.settings import setting


HEADS = (8, 16, 32, 64, 96)
ORDER = (8, 96, 16, 32, 64)     # the ends first: an interrupted run has the range
IMPLS = ("reference", "auto")
D_MODEL = 768
RESULT = "docs/results/plan_heads_v5e.json"


@dataclasses.dataclass(frozen=True, kw_only=True)
class PlanHeadsOptions:
  """The settings of `bench plan-heads`."""
  plans: str = setting(path=True, help="the folder of the plans (PLANS/<impl>_h<h>/"
                       "plan.json; one already there is kept)")
  topology: str = setting("v5e:2x2", help="the TPU slice (mha-jax plan --topology)")
  out: str = setting(RESULT, path=True, help="the summary's JSON file")
  collect: bool = setting(False, help="only collect the plans already in --plans")


def _scores(doc: dict, h: int) -> int:
  """Analytic bytes of one train step's attention probabilities on one device (float32
  (B / data, h, T, T) per layer, every layer's kept for the backward)."""
  from mha_jax import config as mc
  cfg = mc.load_config(f"configs/lm.py:heads={h},d_model={D_MODEL}")
  rows = cfg.train.batch_size // doc["mesh"]["data"]
  return rows * h * cfg.model.max_len ** 2 * 4 * cfg.model.num_layers


def _row(impl: str, h: int, doc: dict) -> dict:
  progs = {p["name"]: p for p in doc["programs"]}
  return {"impl": impl, "heads": h, "d_k": D_MODEL // h, "params": doc["params"]["count"],
          "scores_bytes": _scores(doc, h),
          "kernels": sorted({k for p in doc["programs"] for k in p["attention_kernels"]}),
          **{name: {"flops": p["flops"], "bytes_accessed": p["bytes_accessed"],
                    **p["per_device"], "memory_spaces": p.get("memory_spaces", {}),
                    "est_seconds": p["est_seconds"]} for name, p in progs.items()}}


def run(args: PlanHeadsOptions) -> int:
  from mha_jax import machine, plan
  rows, versions, doc = [], {}, None
  for h in ORDER:
    for impl in IMPLS:
      path = os.path.join(args.plans, f"{impl}_h{h}", "plan.json")
      if not os.path.exists(path) and args.collect:
        continue
      if not os.path.exists(path):
        opts = plan.PlanOptions(topology=args.topology, job="train")
        doc = plan.make_plan(opts, config=f"configs/lm.py:heads={h},d_model={D_MODEL}",
                             overrides=[f"--config.model.impl={impl}"])
        plan.write_plan(doc, os.path.dirname(path))
      with open(path) as f:
        doc = json.load(f)
      versions = {"jax": doc["jax"], "libtpu": doc["libtpu"], "date": doc["date"]}
      rows.append(_row(impl, h, doc))
      print(impl, h, rows[-1]["train_step"]["total"], flush=True)
  if doc is None:
    raise UserError(f"plans: no plan.json under {args.plans!r} to collect", setting="plans")
  out = {"topology": args.topology, "device_kind": doc["device_kind"], "mesh": doc["mesh"],
         "config": f"configs/lm.py:heads=H,d_model={D_MODEL} --config.model.impl=IMPL",
         "job": "train", "chip": doc.get("chip"), **versions,
         "kernel_choice": ("reference: softmax(QK^T)V in XLA ops, the scores materialised; "
                           "auto: dispatch's choice for the TPU target (Pallas splash "
                           "through shard_map; q, k and v as (heads, K, T) when K < 128)"),
         "rows": rows, "machine": machine.machine()}
  with open(args.out, "w") as f:
    json.dump(out, f, indent=1)
  print(f"wrote {args.out}")
  return 0
