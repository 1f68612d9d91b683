"""Time from a fresh Jupyter kernel to the first attention view, cold and warm.

    mha-jax bench notebook [--out docs/results/notebooks.json] [--ci-json FILE]
                           [--repeats 2]

A fresh kernel (jupyter_client, the python3 kernel) runs the README's three lines on
SmolLM2-135M (`mha_jax.load("smollm2-135m")`, `loaded.run(prompt)`, shown); the time is
from starting the kernel to the view's HTML arriving. This process first imports the
model into a fresh model cache (first_import_and_load_s: the one-time import a new user
waits for once), so the kernels only load it. "cold": JAX's persistent
compilation cache in an empty folder; "warm": a second fresh kernel on that folder (the
kernel gets JAX_COMPILATION_CACHE_DIR, as `mha_jax.compile_cache.enable()` would set).
--ci-json adds the `pytest -m notebooks` times that FILE holds ({"seconds": {...}}).
Writes the JSON with the machine record.
"""

from __future__ import annotations

import dataclasses
import json
import tempfile
import time

from mha_jax.harness.benchmarks import ROOT, child_env
from mha_jax.settings import setting
PROMPT = "When Mary and John went to the store, John gave a drink to"
CODE = ("import time; t = time.time()\nimport mha_jax\nloaded = mha_jax.load('smollm2-135m')\n"
        "t_load = time.time() - t\ntr = loaded.run({prompt!r})\nt_run = time.time() - t - t_load\n"
        "mha_jax.show(tr)\nprint(round(t_load, 2), round(t_run, 2))\n")


def first_view(env: dict) -> dict:
  """Seconds from starting a kernel to the first view's HTML (and the kernel's own
  split: ready, load, run)."""
  from jupyter_client import KernelManager
  km = KernelManager(kernel_name="python3")
  t0 = time.perf_counter()
  km.start_kernel(env=env, cwd=ROOT)
  kc = km.client()
  kc.start_channels()
  try:
    kc.wait_for_ready(timeout=120)
    ready = time.perf_counter() - t0
    msg_id = kc.execute(CODE.format(prompt=PROMPT))
    view = split = None
    while split is None:
      msg = kc.get_iopub_msg(timeout=900)
      if msg["parent_header"].get("msg_id") != msg_id:
        continue
      kind, content = msg["msg_type"], msg["content"]
      if kind == "display_data" and "mha-jax-view" in content["data"].get("text/html", ""):
        view = time.perf_counter() - t0
      elif kind == "stream" and view is not None:
        split = [float(x) for x in content["text"].split()]
      elif kind == "error":
        raise RuntimeError("\n".join(content["traceback"]))
  finally:
    kc.stop_channels()
    km.shutdown_kernel(now=True)
  return {"first_view_s": round(view, 2), "kernel_ready_s": round(ready, 2),
          "load_s": split[0], "run_s": split[1]}


@dataclasses.dataclass(frozen=True, kw_only=True)
class NotebookOptions:
  """The settings of `bench notebook`."""
  out: str = setting("docs/results/notebooks.json", path=True, help="the JSON file")
  ci_json: str | None = setting(None, path=True, help="a JSON file of `pytest -m "
                                "notebooks` times ({\"seconds\": {...}}) to add")
  repeats: int = setting(2, lo=1, help="cold + warm pairs, each in a new cache folder")


def run(args: NotebookOptions) -> int:
  import mha_jax
  from mha_jax.machine import machine
  models = tempfile.mkdtemp(prefix="models-")     # a fresh model cache: the import is timed
  t = time.perf_counter()
  mha_jax.load("smollm2-135m", cache=models, log=lambda s: None)
  import_s = time.perf_counter() - t
  env = child_env(JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0", MHA_JAX_MODELS=models)
  result = {"prompt": PROMPT, "model": "smollm2-135m",
            "first_import_and_load_s": round(import_s, 2)}
  for name in ("cold", "warm"):
    result[name] = []
  for _ in range(args.repeats):
    with tempfile.TemporaryDirectory() as tmp:
      env["JAX_COMPILATION_CACHE_DIR"] = tmp
      for name in ("cold", "warm"):
        result[name].append(first_view(env))
        print(name, result[name][-1], flush=True)
  if args.ci_json:
    with open(args.ci_json) as f:
      result["ci"] = json.load(f)
  result["machine"] = machine()
  import shutil
  shutil.rmtree(models, ignore_errors=True)
  with open(args.out, "w") as f:
    json.dump(result, f, indent=1)
  print(f"wrote {args.out}")
  return 0
