"""How far the patch head table moves when a study runs in bfloat16 weights (softmax,
norms, logits and metrics in float32) against float32, on real models.

    mha-jax bench bf16-drift [--models smollm2-135m,gemma3-270m] [--pairs 8]
                             [--out docs/results/bf16_drift_cpu.json]

Per model: `import` (float32) into a temporary workdir, IOI pairs (seed 0, the pairs the
float32 model gets wrong kept), then activation patching of head_out and AtP of head_out,
once with the float32 params and once with them cast to bfloat16 (`memory.cast`, what
`patch --dtype bfloat16` does). Quoted: max |difference| of the recovery tables, the
top-10 overlap by |value| and the Pearson correlation (activation_patching.agreement),
and the seconds of each sweep.
"""

from __future__ import annotations

import dataclasses
import json
import tempfile
import time

import numpy as np

from mha_jax.pretrained import registry
from mha_jax.settings import setting


@dataclasses.dataclass(frozen=True, kw_only=True)
class Bf16DriftOptions:
  """The settings of `bench bf16-drift`."""
  models: tuple[str, ...] = setting(("smollm2-135m", "gemma3-270m"),
                                    choices=tuple(registry.KNOWN),
                                    help="comma-separated packaged models")
  pairs: int = setting(8, lo=1, help="IOI pairs per model")
  out: str | None = setting(None, path=True, help="the JSON file (rewritten after each "
                            "model; default: printed only)")


def drift(name: str, n_pairs: int) -> dict:
  import mha_jax
  from mha_jax.pretrained import importer
  from mha_jax.toolkit import activation_patching as ap, memory, pairs as pairs_lib
  wd = tempfile.mkdtemp(prefix="bf16_drift_") + "/wd"
  importer.import_model(wd, name=name, dtype="float32")
  loaded = mha_jax.load(wd)
  pairs = pairs_lib.ioi_pairs(loaded.task, n_pairs, 0)
  out = {"model": name, "pairs": n_pairs}
  tables = {}
  for dt in ("float32", "bfloat16"):
    s = ap.Study(loaded.task, memory.cast(loaded.params, dt), pairs)
    t0 = time.perf_counter()
    rec = s.patch("z")["recovery"]
    sec = time.perf_counter() - t0
    atp = s.attribution(("z",))["z"]["heads"]
    tables[dt] = {"patch_head_out": rec, "atp_head_out": atp}
    out[f"seconds_patch_{dt}"] = round(sec, 2)
    out[f"ld_clean_{dt}"] = float(np.mean(s.ld_clean))
    out[f"ld_corrupt_{dt}"] = float(np.mean(s.ld_corrupt))
  for k in ("patch_head_out", "atp_head_out"):
    a, b = tables["bfloat16"][k], tables["float32"][k]
    agree = ap.agreement(a, b, top=10)
    out[k] = {"max_abs_diff": float(np.nanmax(np.abs(a - b))),
              "max_abs_float32": float(np.nanmax(np.abs(b))),
              "top10_overlap": agree["top10_overlap"], "pearson": agree["pearson"],
              "top10_float32": ap.top(ap.head_table(b), 10, by_abs=True)[:10],
              "top10_bfloat16": ap.top(ap.head_table(a), 10, by_abs=True)[:10]}
  return out


def run(a: Bf16DriftOptions) -> int:
  from mha_jax.machine import machine
  doc = {"what": "patch head_out recovery and AtP head_out: bfloat16 weights against "
                 "float32 (IOI, seed 0, failing pairs kept)", "models": [],
         "machine": machine()}
  for m in a.models:
    r = drift(m, a.pairs)
    print(json.dumps(r, indent=1))
    doc["models"].append(r)
    if a.out:
      with open(a.out, "w") as f:
        json.dump(doc, f, indent=1)
  return 0
