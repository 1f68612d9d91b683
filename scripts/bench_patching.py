"""Speed of activation patching on SmolLM2-135M: mha-jax's batched sweep vs a torch-hooks loop.

    python scripts/bench_patching.py [--workdir DIR] [--pairs 4] [--rounds 3]
                                     [--out results/bench_patching.json]

The sweep: every head's output (z, the input of W_O; all positions), clean into corrupt,
on --pairs IOI pairs; the metric is the logit difference at the last position.

  mha-jax       `patching.core.Study.patch("z")`: one compiled program, a vmap over the
                270 interventions (chunked to the memory budget).
  torch hooks   what TransformerLens and nnsight users run: transformers'
                LlamaForCausalLM on the same float32 weights, one forward per head with
                a forward pre-hook on that layer's o_proj replacing the head's slice by
                the clean run's (cached by hooks on a clean forward), in a Python loop.

Both give the same recovery table (checked: max abs difference is printed and stored).
Also: AtP for all heads (one forward of the clean run, one forward+backward of the
corrupt run) against one forward+backward. Medians over --rounds after a warm-up
(compilation excluded; its time is reported). float32, CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _times(fn, rounds: int):
  t0 = time.perf_counter()
  out = fn()                               # warm-up (compiles)
  first = time.perf_counter() - t0
  times = []
  for _ in range(rounds):
    t0 = time.perf_counter()
    out = fn()
    times.append(time.perf_counter() - t0)
  return out, first, statistics.median(times), times


def torch_sweep(hf, pairs):
  """The loop of forwards with hooks: (L, H) logit differences (N,) per head."""
  import torch
  cfg = hf.config
  L, H = cfg.num_hidden_layers, cfg.num_attention_heads
  K = cfg.head_dim
  clean = torch.from_numpy(pairs.clean.astype(np.int64))
  corrupt = torch.from_numpy(pairs.corrupt.astype(np.int64))
  rows = torch.arange(len(pairs))
  at = torch.from_numpy(pairs.length.astype(np.int64) - 1)
  ans = torch.from_numpy(pairs.answer.astype(np.int64))
  wrong = torch.from_numpy(pairs.wrong.astype(np.int64))
  cache = {}

  def saver(i):
    def hook(mod, args):
      cache[i] = args[0].detach().clone()
    return hook

  with torch.inference_mode():
    hs = [hf.model.layers[i].self_attn.o_proj.register_forward_pre_hook(saver(i))
          for i in range(L)]
    hf(clean, use_cache=False)
    for h in hs:
      h.remove()
    out = np.zeros((L, H, len(pairs)))
    for i in range(L):
      for h in range(H):
        def patch(mod, args, i=i, h=h):
          z = args[0].clone()
          z[..., h * K:(h + 1) * K] = cache[i][..., h * K:(h + 1) * K]
          return (z,)
        handle = hf.model.layers[i].self_attn.o_proj.register_forward_pre_hook(patch)
        logits = hf(corrupt, use_cache=False).logits
        handle.remove()
        last = logits[rows, at]
        out[i, h] = (last[rows, ans] - last[rows, wrong]).numpy()
  return out


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__)
  p.add_argument("--workdir", default=None, help="an imported smollm2-135m (default: import "
                 "into a temporary folder)")
  p.add_argument("--pairs", type=int, default=4)
  p.add_argument("--rounds", type=int, default=3)
  p.add_argument("--torch-rounds", type=int, default=1,
                 help="rounds of the (slow) torch loop after its warm-up")
  p.add_argument("--cores", type=int, default=0,
                 help="pin the process to this many cores and torch to as many threads "
                      "(0: all cores, torch's default threads); on a shared machine torch's "
                      "OpenMP threads thrash, 1 keeps both libraries on equal terms")
  p.add_argument("--out", default="results/bench_patching.json")
  args = p.parse_args(argv)
  cores = sorted(os.sched_getaffinity(0))
  if args.cores:                     # before JAX starts its thread pool
    cores = cores[:args.cores]
    os.sched_setaffinity(0, set(cores))
  import jax
  import mha_jax
  from mha_jax.patching import core, pairs as pairs_lib
  from mha_jax.pretrained import importer
  workdir, tmp = args.workdir, None
  if workdir is None:
    tmp = tempfile.TemporaryDirectory()
    workdir = os.path.join(tmp.name, "smollm2")
    importer.import_model(workdir, name="smollm2-135m")
  run = mha_jax.load(workdir)
  pairs = pairs_lib.ioi_pairs(run.task, args.pairs, seed=0)
  t0 = time.perf_counter()
  s = core.Study(run.task, run.params, pairs)
  setup = time.perf_counter() - t0
  ours, ours_first, ours_med, ours_all = _times(lambda: s.patch("z"), args.rounds)
  print(f"mha-jax batched sweep: {ours_med:.2f} s (first call {ours_first:.1f} s)", flush=True)
  atp, atp_first, atp_med, _ = _times(lambda: s.attribution(("z",)), args.rounds)
  fb = s.forward_backward_seconds(args.rounds)
  print(f"AtP all heads: {atp_med:.3f} s; one forward+backward {fb:.3f} s", flush=True)
  result = {"model": "smollm2-135m (SmolLM2-135M-Instruct Q4_1 GGUF, dequantized to f32)",
            "sweep": "head outputs (z), all positions, clean into corrupt, "
                     f"{s.layers * max(s.heads)} heads",
            "pairs": len(pairs), "tokens": int(pairs.clean.shape[1]),
            "mha_jax": {"median_s": ours_med, "first_call_s": ours_first, "runs_s": ours_all,
                        "study_setup_s": setup},
            "atp": {"median_s": atp_med, "first_call_s": atp_first,
                    "forward_backward_s": fb, "ratio_to_forward_backward": atp_med / fb,
                    "agreement_with_exact": core.agreement(atp["z"]["heads"],
                                                           ours["recovery"])},
            "jax": jax.__version__, "backend": jax.default_backend(),
            "cpu_count": os.cpu_count(), "cores_used": len(cores),
            "machine": platform.machine(),
            "load_average": os.getloadavg()}
  try:
    import torch
    import transformers
  except ImportError:
    torch = None
    print("transformers/torch not installed: mha-jax only")
  if torch is not None:
    from bench_models import to_transformers
    if args.cores:
      torch.set_num_threads(args.cores)
    hf = to_transformers(run)
    theirs, t_first, t_med, t_all = _times(lambda: torch_sweep(hf, pairs), args.torch_rounds)
    denom = s.ld_clean.mean() - s.ld_corrupt.mean()
    rec = (theirs.mean(-1) - s.ld_corrupt.mean()) / denom
    diff = float(np.nanmax(np.abs(rec - ours["recovery"])))
    print(f"torch hooks loop: {t_med:.2f} s; max |recovery difference| {diff:.2e}", flush=True)
    s_full = core.Study(run.task, run.params, pairs, share_prefix=False)
    _, f_first, f_med, f_all = _times(lambda: s_full.patch("z"), args.rounds)
    print(f"mha-jax batched sweep without the shared prefix: {f_med:.2f} s", flush=True)
    result["mha_jax_no_shared_prefix"] = {"median_s": f_med, "first_call_s": f_first,
                                          "runs_s": f_all}
    result["torch_hooks_loop"] = {"median_s": t_med, "first_s": t_first, "runs_s": t_all,
                                  "torch": torch.__version__,
                                  "transformers": transformers.__version__,
                                  "threads": torch.get_num_threads(),
                                  "max_abs_recovery_difference": diff}
    result["speedup"] = t_med / ours_med
    result["speedup_no_shared_prefix"] = t_med / f_med
  rows = [f"| sweep ({s.layers * max(s.heads)} heads, {len(pairs)} IOI pairs, "
          f"{len(cores)} core(s)) | median s | torch loop / this |", "|---|---|---|",
          f"| mha-jax batched, shared prefix computed once | {ours_med:.2f} | "
          f"{result.get('speedup', float('nan')):.2f}x |"]
  if "torch_hooks_loop" in result:
    rows.append(f"| mha-jax batched, every position | "
                f"{result['mha_jax_no_shared_prefix']['median_s']:.2f} | "
                f"{result['speedup_no_shared_prefix']:.2f}x |")
    rows.append(f"| torch hooks loop (transformers, {result['torch_hooks_loop']['threads']} "
                f"thread(s)) | {result['torch_hooks_loop']['median_s']:.2f} | 1.00x |")
  rows.append(f"| AtP, all heads (mha-jax) | {atp_med:.3f} | "
              f"{atp_med / fb:.2f}x one forward+backward ({fb:.3f} s) |")
  result["table"] = "\n".join(rows)
  print(result["table"])
  os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
  with open(args.out, "w") as f:
    json.dump(result, f, indent=1)
  print(f"wrote {args.out}")


if __name__ == "__main__":
  main()
