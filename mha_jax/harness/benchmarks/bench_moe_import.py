"""Import and forward of a mixture-of-experts model at its real width (random weights).

OLMoE-1B-7B's config (hidden 2048, 64 experts of 1024, top 8, vocabulary 50304) or
Qwen3-30B-A3B's (hidden 2048, 128 experts of 768, top 8, 32 query / 4 kv heads of 128,
vocabulary 151936) with random bf16 weights and 2 layers, saved as a Hugging Face folder,
then `mha-jax import` (--dtype) and one forward of 1 x 128 tokens, each in its own process
under /usr/bin/time -v (wall time, peak resident memory). Writes the JSON (--out) with
the machine record. The model "tiny" (OLMoE's layout at width 64) checks the path in
seconds.

  mha-jax bench moe-import [--model olmoe|qwen3_moe|tiny] [--layers 2]
      [--dtype bfloat16] [--out FILE]

The folder is written with transformers and torch (the benchmark's own needs, never
mha_jax's) and the tests' WordLevel tokenizer (tests/hf_models.py: a checkout's).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
import tempfile

from mha_jax.harness.benchmarks import ROOT, child_env
from mha_jax.settings import setting

OLMOE_1B_7B = dict(vocab_size=50304, hidden_size=2048, intermediate_size=1024,
                   num_attention_heads=16, num_key_value_heads=16, num_experts=64,
                   num_experts_per_tok=8, max_position_embeddings=4096, rms_norm_eps=1e-5,
                   norm_topk_prob=False, tie_word_embeddings=False, pad_token_id=1,
                   eos_token_id=50279)
# Qwen/Qwen3-30B-A3B's config.json (its published values; every layer sparse)
QWEN3_30B_A3B = dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                     moe_intermediate_size=768, num_attention_heads=32, num_key_value_heads=4,
                     head_dim=128, num_experts=128, num_experts_per_tok=8,
                     norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
                     max_position_embeddings=40960, rms_norm_eps=1e-6,
                     rope_parameters={"rope_theta": 1000000.0, "rope_type": "default"},
                     tie_word_embeddings=False, use_sliding_window=False,
                     bos_token_id=151643, eos_token_id=151645)
TINY_OLMOE = dict(OLMOE_1B_7B, vocab_size=128, hidden_size=64, intermediate_size=32,
                  num_attention_heads=4, num_key_value_heads=4, num_experts=4,
                  num_experts_per_tok=2, max_position_embeddings=256, pad_token_id=1,
                  eos_token_id=2)
MODELS = {"olmoe": ("OLMoE-1B-7B", "Olmoe", OLMOE_1B_7B),
          "qwen3_moe": ("Qwen3-30B-A3B", "Qwen3Moe", QWEN3_30B_A3B),
          "tiny": ("OLMoE at width 64", "Olmoe", TINY_OLMOE)}


@dataclasses.dataclass(frozen=True, kw_only=True)
class MoeImportOptions:
  """The settings of `bench moe-import`."""
  model: str = setting("olmoe", choices=tuple(sorted(MODELS)), help="the config")
  layers: int = setting(2, lo=1, help="its layers")
  dtype: str = setting("float32", choices=("float32", "bfloat16"), help="the import's "
                       "--dtype")
  out: str | None = setting(None, path=True, help="the JSON file (default: "
                            "docs/results/moe_import_{model}_{dtype}_cpu.json)")

BUILD = r"""
import sys, torch, transformers
from mha_jax.harness import module_at
save_folder = module_at("hf_models", sys.argv[3]).save_folder
cfg = transformers.__CLS__Config(**__KW__, num_hidden_layers=int(sys.argv[2]))
torch.manual_seed(0)
with torch.device("meta"):
  model = transformers.__CLS__ForCausalLM(cfg)
model = model.to_empty(device="cpu").to(torch.bfloat16)
with torch.no_grad():
  for p in model.parameters():
    p.normal_(0, 0.02) if p.ndim > 1 else p.fill_(1.0)
save_folder(model, sys.argv[1])
"""

FORWARD = r"""
import sys, time, numpy as np, mha_jax
t0 = time.perf_counter()
run = mha_jax.load(sys.argv[1])
t1 = time.perf_counter()
tok = np.random.default_rng(0).integers(0, int(sys.argv[2]), (1, 128)).astype(np.int32)
logits = np.asarray(run.task.logits(run.params, tok))
t2 = time.perf_counter()
logits = np.asarray(run.task.logits(run.params, tok))
t3 = time.perf_counter()
print("TIMES", t1 - t0, t2 - t1, t3 - t2, bool(np.isfinite(logits).all()))
"""


def timed(cmd: list[str]) -> tuple[dict, str]:
  """{wall_s, peak_rss_gb} of a command run under /usr/bin/time -v (and "failed": its
  last lines, e.g. "Command terminated by signal 9" when the shared machine's memory ran
  out), and its stdout."""
  r = subprocess.run(["/usr/bin/time", "-v"] + cmd, capture_output=True, text=True,
                     env=child_env())
  rss = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", r.stderr).group(1))
  wall = re.search(r"Elapsed \(wall clock\) time \(h:mm:ss or m:ss\): ([\d:.]+)", r.stderr)
  parts = [float(x) for x in wall.group(1).split(":")]
  secs = sum(p * 60 ** i for i, p in enumerate(reversed(parts)))
  out = {"wall_s": round(secs, 1), "peak_rss_gb": round(rss / 2**20, 2)}
  if r.returncode:
    out["failed"] = r.stderr.split("\tCommand being timed")[0].strip()[-600:]
  return out, r.stdout


def run(a: MoeImportOptions) -> int:
  from mha_jax.machine import machine
  name, cls, kw = MODELS[a.model]
  out_path = a.out or f"docs/results/moe_import_{a.model}_{a.dtype}_cpu.json"
  with tempfile.TemporaryDirectory() as tmp:
    folder, wd = os.path.join(tmp, "hf"), os.path.join(tmp, "w")
    build, _ = timed([sys.executable, "-c", BUILD.replace("__KW__", repr(kw)).replace("__CLS__", cls),
                      folder, str(a.layers), os.path.join(ROOT, "tests")])
    size = sum(os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder))
    imp, _ = timed([sys.executable, "-m", "mha_jax.cli", "import", "--file", folder,
                    "--workdir", wd, "--dtype", a.dtype])
    fwd, out = ({"failed": "not run: the import failed"}, "") if "failed" in imp else timed(
        [sys.executable, "-c", FORWARD, wd, str(kw["vocab_size"])])
  doc = {"what": f"{name}'s config, random bf16 weights, imported as {a.dtype}",
         "dtype": a.dtype, "model": name,
         "config": {**kw, "num_hidden_layers": a.layers},
         "folder_gb": round(size / 2**30, 2), "build_folder": build, "import": imp,
         "forward_process": fwd}
  if "TIMES" in out:
    load_s, first_s, second_s, finite = (float(x) if i < 3 else x == "True" for i, x in
                                         enumerate(out.split("TIMES")[1].split()))
    doc.update(load_s=round(load_s, 1), forward_1x128_first_s=round(first_s, 1),
               forward_1x128_again_s=round(second_s, 2), logits_finite=finite)
  doc["machine"] = machine()
  with open(out_path, "w") as f:
    json.dump(doc, f, indent=1)
    f.write("\n")
  print(json.dumps(doc, indent=1))
  return 0
