"""Peak host memory of `mha-jax import` of a random Llama model written as sharded bf16
safetensors (an HF folder), against the bound: 1.3 x the largest shard + the model once.

    mha-jax bench import-peak [--shape llama31_8b_2layers] [--dtype bfloat16]
                              [--folder DIR] [--out docs/results/import_peak_cpu.json]

The folder is written one tensor at a time (random normal * 0.02, in row blocks), then a
fresh process imports it (`importer.import_model`) and reports its peak RSS
(VmHWM) after its imports and at the end; the difference is what the import
added. "model once" is the params' bytes in the import's dtype.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import tempfile

from mha_jax.settings import setting

SHAPES = {
    # Llama-3.1-8B's width with 2 layers (issue 47, item 6)
    "llama31_8b_2layers": dict(hidden_size=4096, num_hidden_layers=2, num_attention_heads=32,
                               num_key_value_heads=8, intermediate_size=14336,
                               vocab_size=128256, tie_word_embeddings=False),
    # Llama-3.2-1B's shapes (item 5)
    "llama32_1b": dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32,
                       num_key_value_heads=8, intermediate_size=8192, vocab_size=128256,
                       tie_word_embeddings=True),
    # small enough for the default tests, the embeddings most of it as in small models
    "small": dict(hidden_size=512, num_hidden_layers=2, num_attention_heads=8,
                  num_key_value_heads=4, intermediate_size=2048, vocab_size=32768,
                  tie_word_embeddings=False),
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, intermediate_size=96, vocab_size=256,
                 tie_word_embeddings=False),
}


@dataclasses.dataclass(frozen=True, kw_only=True)
class ImportPeakOptions:
  """The settings of `bench import-peak`."""
  shape: str = setting("llama31_8b_2layers", choices=tuple(sorted(SHAPES)),
                       help="the random model's shapes")
  dtype: str = setting("bfloat16", choices=("bfloat16", "float32"),
                       help="the import's dtype")
  folder: str | None = setting(None, path=True, help="the HF folder to import (written "
                               "there first when it has no config.json; default: a "
                               "temporary one)")
  out: str | None = setting(None, path=True, help="the JSON file (default: printed only)")


def tensors(s: dict) -> list[tuple[str, tuple]]:
  """(name, shape) of a LlamaForCausalLM's weights, in the HF layout."""
  d, f, v = s["hidden_size"], s["intermediate_size"], s["vocab_size"]
  k = d // s["num_attention_heads"]
  g = s["num_key_value_heads"] * k
  out = [("model.embed_tokens.weight", (v, d)), ("model.norm.weight", (d,))]
  for i in range(s["num_hidden_layers"]):
    p = f"model.layers.{i}."
    out += [(p + "input_layernorm.weight", (d,)), (p + "post_attention_layernorm.weight", (d,)),
            (p + "self_attn.q_proj.weight", (d, d)), (p + "self_attn.k_proj.weight", (g, d)),
            (p + "self_attn.v_proj.weight", (g, d)), (p + "self_attn.o_proj.weight", (d, d)),
            (p + "mlp.gate_proj.weight", (f, d)), (p + "mlp.up_proj.weight", (f, d)),
            (p + "mlp.down_proj.weight", (d, f))]
  if not s["tie_word_embeddings"]:
    out.append(("lm_head.weight", (v, d)))
  return out


def _random(shape, rng, norm: bool):
  import ml_dtypes
  import numpy as np
  if norm:
    return np.ones(shape, ml_dtypes.bfloat16)
  out = np.empty(shape, ml_dtypes.bfloat16)
  for i in range(0, shape[0], 4096):
    blk = out[i:i + 4096]
    blk[...] = (0.02 * rng.standard_normal(blk.shape, dtype=np.float32)).astype(ml_dtypes.bfloat16)
  return out


def write_folder(folder: str, shape: str, tokenizer_json: str, shard_bytes: int = 2**30) -> dict:
  """The random model as sharded bf16 safetensors + config.json + tokenizer.json;
  returns {"shards": [bytes...]}. One shard in memory at a time."""
  import numpy as np
  from safetensors.numpy import save_file
  s = SHAPES[shape]
  os.makedirs(folder, exist_ok=True)
  rng = np.random.default_rng(0)
  groups, cur, size = [], [], 0
  for name, shp in tensors(s):
    b = 2 * int(np.prod(shp))
    if cur and size + b > shard_bytes:
      groups.append(cur)
      cur, size = [], 0
    cur.append((name, shp))
    size += b
  groups.append(cur)
  weight_map, sizes = {}, []
  for j, g in enumerate(groups):
    fname = f"model-{j + 1:05d}-of-{len(groups):05d}.safetensors"
    save_file({n: _random(shp, rng, len(shp) == 1) for n, shp in g},
              os.path.join(folder, fname), metadata={"format": "pt"})
    sizes.append(os.path.getsize(os.path.join(folder, fname)))
    weight_map.update({n: fname for n, _ in g})
  with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
    json.dump({"metadata": {"total_size": sum(sizes)}, "weight_map": weight_map}, f)
  cfg = dict(s, model_type="llama", architectures=["LlamaForCausalLM"], rms_norm_eps=1e-5,
             rope_theta=500000.0, max_position_embeddings=2048, hidden_act="silu",
             torch_dtype="bfloat16", bos_token_id=1, eos_token_id=2)
  with open(os.path.join(folder, "config.json"), "w") as f:
    json.dump(cfg, f)
  with open(os.path.join(folder, "tokenizer.json"), "w") as f:
    f.write(tokenizer_json)
  return {"shards": sizes}


# The peak is the process's VmHWM (its own address space's high-water mark): getrusage's
# ru_maxrss also holds the parent's peak before the exec (Linux keeps it across execve).
_CHILD = """
import json, sys
from mha_jax.pretrained import importer
import jax, numpy
jax.devices()
hwm = lambda: 1024 * int(next(ln for ln in open("/proc/self/status")
                              if ln.startswith("VmHWM")).split()[1])
if sys.argv[4]:
  importer.import_model(sys.argv[4] + ".wd", file=sys.argv[4], dtype=sys.argv[3])
base = hwm()
cfg = importer.import_model(sys.argv[1], file=sys.argv[2], dtype=sys.argv[3])
print(json.dumps({"base_rss": base, "peak_rss": hwm()}))
"""


def measure(folder: str, workdir: str, dtype: str, warm: str | None = None) -> dict:
  """Peak RSS of a fresh process importing `folder` into `workdir`. warm: a (tiny) HF
  folder imported first, next to itself, so that the base holds what any import loads
  once (modules, TensorStore's thread pools), not the model."""
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  out = subprocess.run([sys.executable, "-c", _CHILD, workdir, folder, dtype, warm or ""],
                       env=env, capture_output=True, text=True)
  if out.returncode:
    raise RuntimeError(f"the import failed:\n{out.stderr[-3000:]}")
  return json.loads(out.stdout.strip().splitlines()[-1])


def run(a: ImportPeakOptions) -> int:
  from mha_jax.harness import module_at     # the tests' WordLevel tokenizer (a checkout's)
  tokenizer_json = module_at("hf_models", os.path.join(os.path.dirname(__file__), "..",
                                                       "..", "..", "tests")).tokenizer_json
  from mha_jax.machine import machine
  tmp = tempfile.mkdtemp(prefix="import_peak_")
  folder = a.folder or os.path.join(tmp, "hf")
  if not os.path.exists(os.path.join(folder, "config.json")):
    write_folder(folder, a.shape, tokenizer_json())
  shards = sorted(os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder)
                  if f.endswith(".safetensors"))
  r = measure(folder, os.path.join(tmp, "wd"), a.dtype)
  n = sum(__import__("math").prod(shp) for _, shp in tensors(SHAPES[a.shape]))
  model = n * (2 if a.dtype == "bfloat16" else 4)
  bound = int(1.3 * shards[-1] + model)
  doc = {"shape": a.shape, "config": SHAPES[a.shape], "dtype": a.dtype, "params": n,
         "shards_bytes": shards, "largest_shard": shards[-1], "model_bytes": model,
         "base_rss": r["base_rss"], "peak_rss": r["peak_rss"],
         "added_peak": r["peak_rss"] - r["base_rss"], "bound": bound,
         "within_bound": r["peak_rss"] - r["base_rss"] <= bound, "machine": machine()}
  print(json.dumps({k: v for k, v in doc.items() if k != "machine"}, indent=1))
  if a.out:
    with open(a.out, "w") as f:
      json.dump(doc, f, indent=1)
  return 0
