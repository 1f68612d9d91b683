"""Speed of activation patching on SmolLM2-135M: mha-jax against TransformerLens and
nnsight.

    mha-jax bench patching [--workdir DIR] [--pairs 4] [--rounds 3] [--command]
                           [--torch-rounds 1] [--out results/bench_patching.json]

The sweep: every head's output (z, the input of W_O; all positions), clean into corrupt,
on --pairs IOI pairs; the metric is the recovery (LD - LD_corrupt) / (LD_clean -
LD_corrupt) of the pair-mean logit differences at the last position, the same function
on every side.

  mha-jax           `toolkit.activation_patching.Study.patch("z")`: one compiled program, a vmap over
                    the 270 interventions (chunked to the memory budget).
  TransformerLens   4.x: `TransformerBridge.boot_transformers(..., hf_model=hf)` over
                    transformers' model read from the same GGUF file by transformers'
                    own reader (offline), timed in `patching.get_act_patch_attn_head_out_all_pos`.
  nnsight           0.8: `LanguageModel(hf)`; one trace records z on the clean prompts,
                    then one batched trace per layer with an invoke per head.
  torch hooks       (--torch-rounds) a loop of transformers forwards with a pre-hook on
                    o_proj.

The peers need the `bench` extra (pip install .[bench], best in its own virtual
environment). Values first: each table's max abs difference to mha-jax's is printed and
stored (and the peers' weights are checked equal to mha-jax's). Then medians over the
rounds after a first call (mha-jax's first call compiles; its time is reported). With
--command, `mha-jax patch --sites head_out --method activation` as a fresh process
(without, into and from the compile cache), against each peer's load + first sweep. Also
AtP for all heads against one forward+backward. float32, CPU.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

from mha_jax.harness.benchmarks import child_env
from mha_jax.harness.benchmarks.bench_models import to_transformers
from mha_jax.settings import setting


@dataclasses.dataclass(frozen=True, kw_only=True)
class PatchingOptions:
  """The settings of `bench patching`."""
  workdir: str | None = setting(None, path=True, help="an imported smollm2-135m (default: "
                                "import it into a temporary folder)")
  pairs: int = setting(4, lo=1, help="the IOI pairs")
  rounds: int = setting(3, lo=1, help="timed rounds of mha-jax's sweep after its first call")
  torch_rounds: int = setting(0, lo=0, help="rounds of the (slow) torch-hooks loop after "
                              "its warm-up (0: skip)")
  peer_rounds: int = setting(1, lo=0, help="rounds of each peer's sweep after its first "
                             "call (0: the first is the median)")
  peer_layers: int | None = setting(None, lo=1, help="run the peers on the first N layers' "
                                    "heads only and scale their times to all heads (a "
                                    "peer's sweep is a forward per head)")
  command: bool = setting(False, help="also time `mha-jax patch --sites head_out` as fresh "
                          "processes")
  no_prefix: bool = setting(False, help="also time mha-jax's sweep without the shared "
                            "prefix")
  cores: int = setting(0, lo=0, help="pin the process to this many cores and torch to as "
                       "many threads (0: all cores, torch's default threads); on a shared "
                       "machine torch's OpenMP threads thrash, 1 keeps both libraries on "
                       "equal terms")
  out: str = setting("results/bench_patching.json", path=True, help="the JSON file")



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


def _pair_tensors(pairs):
  import torch
  t = lambda a: torch.from_numpy(np.asarray(a, np.int64))  # noqa: E731
  return (t(pairs.clean), t(pairs.corrupt), torch.arange(len(pairs)), t(pairs.length - 1),
          t(pairs.answer), t(pairs.wrong))


def recovery_metric(logits_fn, pairs):
  """The recovery of the pair-mean logit differences, as mha-jax defines it: a function
  of a (N, T, V) logits tensor, with LD_clean and LD_corrupt from `logits_fn(tokens)`."""
  import torch
  clean, corrupt, rows, at, ans, wrong = _pair_tensors(pairs)

  def ld(logits):
    last = logits[rows, at]
    return last[rows, ans] - last[rows, wrong]

  with torch.no_grad():
    c, x = ld(logits_fn(clean)).mean(), ld(logits_fn(corrupt)).mean()
  return lambda logits: (ld(logits).mean() - x) / (c - x)


def tl_sweep(bridge, pairs, layers: int | None = None):
  """TransformerLens: `patching.get_act_patch_attn_head_out_all_pos` on a
  TransformerBridge, the recovery metric above: an (L, H) table (with `layers`, only
  the first `layers` layers' heads, through its index_df; the rest NaN)."""
  import itertools
  import pandas as pd
  import torch
  from transformer_lens import patching
  clean, corrupt = _pair_tensors(pairs)[:2]
  metric = recovery_metric(lambda t: bridge(t), pairs)
  L, H = bridge.cfg.n_layers, bridge.cfg.n_heads
  with torch.no_grad():
    _, clean_cache = bridge.run_with_cache(clean)
    if layers is None or layers >= L:
      out = patching.get_act_patch_attn_head_out_all_pos(bridge, corrupt, clean_cache, metric)
      return np.asarray(out, np.float64)
    df = pd.DataFrame(list(itertools.product(range(layers), range(H))),
                      columns=["layer", "head"])
    flat = patching.get_act_patch_attn_head_out_all_pos(bridge, corrupt, clean_cache, metric,
                                                        index_df=df, index_axis_names=None)
  out = np.full((L, H), np.nan)
  out[:layers] = np.asarray(flat, np.float64).reshape(layers, H)
  return out


def nnsight_sweep(lm, hf, pairs, heads_per_trace: int | None = None,
                  layers: int | None = None):
  """nnsight: one trace records every layer's o_proj input (z) on the clean prompts;
  then batched traces, each with one invoke per patched head (the corrupt prompts with
  that head's slice of z from the clean run), `heads_per_trace` heads a trace (default:
  one layer's). The recovery metric above: an (L, H) table."""
  import torch
  cfg = lm.config
  L, H, K = cfg.num_hidden_layers, cfg.num_attention_heads, cfg.head_dim
  clean, corrupt = _pair_tensors(pairs)[:2]
  blocks = lm.model.layers
  metric = recovery_metric(lambda t: hf(t).logits, pairs)   # lm wraps hf
  per = heads_per_trace or H
  todo = [(i, h) for i in range(min(L, layers or L)) for h in range(H)]
  out = np.full((L, H), np.nan)      # with `layers`, only the first layers' heads
  z_clean = []           # filled in the trace (names bound there stay in nnsight's frame)
  with torch.no_grad():
    with lm.trace(clean):
      for i in range(L):
        z_clean.append(blocks[i].self_attn.o_proj.input.save())
    for start in range(0, len(todo), per):
      chunk, saved = todo[start:start + per], []
      with lm.trace() as tracer:
        for i, h in chunk:
          with tracer.invoke(corrupt):
            z = blocks[i].self_attn.o_proj.input
            z[:, :, h * K:(h + 1) * K] = z_clean[i][:, :, h * K:(h + 1) * K]
            saved.append(lm.lm_head.output.save())
      for (i, h), logits in zip(chunk, saved):
        out[i, h] = float(metric(logits))
  return out


def load_peers(gguf_path: str | None = None, hf=None, tokenizer=None):
  """transformers' model (read from the GGUF file with its own reader, or `hf`), then
  TransformerLens' TransformerBridge and nnsight's LanguageModel over it, offline:
  {"hf", "tl", "nnsight", "seconds": {"hf", "tl", "nnsight"}, "state": hf's state dict}."""
  import warnings
  import torch
  import transformers
  from nnsight import LanguageModel
  from transformer_lens.model_bridge import TransformerBridge
  sec = {}
  t0 = time.perf_counter()
  if hf is None:
    folder, name = os.path.split(gguf_path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=name, dtype=torch.float32).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)
  sec["hf"] = time.perf_counter() - t0
  state = dict(hf.state_dict())       # before the bridge wraps the modules (and renames)
  t0 = time.perf_counter()
  tl = TransformerBridge.boot_transformers("HuggingFaceTB/SmolLM2-135M", hf_model=hf,
                                           tokenizer=tokenizer, device="cpu")
  sec["tl"] = time.perf_counter() - t0
  t0 = time.perf_counter()
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")       # "LanguageModel is deprecated" (0.8)
    lm = LanguageModel(hf, tokenizer=tokenizer)
  sec["nnsight"] = time.perf_counter() - t0
  return {"hf": hf, "tl": tl, "nnsight": lm, "seconds": sec, "state": state}


def to_transformers_sd(loaded) -> dict:
  """mha-jax's weights in transformers' layout (to check the peers hold the same)."""
  return to_transformers(loaded).state_dict()


def command_times(workdir: str, n_pairs: int) -> dict:
  """Wall seconds of `mha-jax patch --sites head_out --method activation` as a fresh
  process (imports, load, the baseline runs, the sweep, its heatmap; no --outputs):
  without the compile cache, into an empty one, and again from it; with the sweep's own
  seconds."""
  out = {}
  with tempfile.TemporaryDirectory() as tmp:
    for name, cache in (("no_cache", "off"), ("first", f"{tmp}/xla"), ("second", f"{tmp}/xla")):
      argv = [sys.executable, "-m", "mha_jax.cli", "patch", "--workdir", workdir, "--task",
              "ioi", "--n-pairs", str(n_pairs), "--sites", "head_out", "--method",
              "activation", "--out", f"{tmp}/{name}", "--compile-cache", cache]
      t0 = time.perf_counter()
      subprocess.run(argv, check=True, env=child_env(), capture_output=True)
      wall = time.perf_counter() - t0
      with open(f"{tmp}/{name}/summary.json") as f:
        sweep = json.load(f)["seconds"]["patch_head_out"]
      out[name] = {"wall_s": round(wall, 2), "sweep_s": sweep, "ratio": round(wall / sweep, 2),
                   "outputs": []}     # patch --outputs: none
      print(f"mha-jax patch --sites head_out ({name}): {wall:.1f} s, its sweep {sweep:.1f} s",
            flush=True)
  return out


def table_of(result: dict, heads: int, pairs: int, cores: int) -> str:
  """The markdown table: each side's sweep (median, and first call) and command."""
  ours = result["mha_jax"]
  cmd = result.get("command", {})
  best = min([p["median_s"] for p in result["peers"].values()] or [float("nan")])
  best_cmd = min([p["command_s"] for p in result["peers"].values()] or [float("nan")])
  rows = [f"| head-output sweep, {heads} heads x {pairs} IOI pairs, {cores} core(s) | sweep, "
          "median s | first call s | command s (peers: load + first sweep) | max abs "
          "difference to mha-jax |",
          "|---|---|---|---|---|"]
  c = " / ".join(f"{cmd[k]['wall_s']:.1f}" for k in ("no_cache", "first", "second") if k in cmd)
  rows.append(f"| mha-jax (one compiled program) | {ours['median_s']:.2f} | "
              f"{ours['first_call_s']:.1f} | {c or 'n/a'} (no cache / first / second) | 0 |")
  for name, p in result["peers"].items():
    rows.append(f"| {name.replace('_', ' ')} {p['version']} | {p['median_s']:.2f} | "
                f"{p['first_s']:.1f} | {p['command_s']:.1f} | "
                f"{p['max_abs_recovery_difference']:.1e} |")
  if "torch_hooks_loop" in result:
    t = result["torch_hooks_loop"]
    rows.append(f"| torch hooks loop | {t['median_s']:.2f} | {t['first_s']:.1f} | | "
                f"{t['max_abs_recovery_difference']:.1e} |")
  rows.append(f"\nmha-jax's sweep is {best / ours['median_s']:.1f}x the faster peer's")
  if cmd:
    rows[-1] += (f"; its command {best_cmd / cmd['second']['wall_s']:.1f}x (compile cache "
                 f"warm) and {best_cmd / cmd['no_cache']['wall_s']:.1f}x (no cache) the faster "
                 f"peer's load + sweep")
  m = result["machine"]
  rows.append(f"matmul rate {m['matmul_gflops']:.0f} GFLOP/s before the run, "
              f"{m.get('matmul_gflops_after', float('nan')):.0f} after; load average "
              f"{m['load_average'][0]:.1f}")
  rows.append(f"AtP, all heads (mha-jax): {result['atp']['median_s']:.3f} s = "
              f"{result['atp']['ratio_to_forward_backward']:.2f}x one forward+backward "
              f"({result['atp']['forward_backward_s']:.3f} s)")
  return "\n".join(rows)


def _ours(loaded, pairs, rounds: int) -> tuple:
  """mha-jax's sweep and AtP: (the Study, its table, the result's entries)."""
  from mha_jax.harness import bench
  from mha_jax.machine import machine
  from mha_jax.toolkit import activation_patching
  rate_before = bench.matmul_gflops()
  t0 = time.perf_counter()
  s = activation_patching.Study(loaded.task, loaded.params, pairs)
  setup = time.perf_counter() - t0
  ours, ours_first, ours_med, ours_all = bench.first_and_rounds(lambda: s.patch("z"), rounds)
  print(f"mha-jax batched sweep: {ours_med:.2f} s (first call {ours_first:.1f} s)", flush=True)
  atp, atp_first, atp_med, _ = bench.first_and_rounds(lambda: s.attribution(("z",)), rounds)
  fb = s.forward_backward_seconds(rounds)
  print(f"AtP all heads: {atp_med:.3f} s; one forward+backward {fb:.3f} s", flush=True)
  result = {"model": "smollm2-135m (SmolLM2-135M-Instruct Q4_1 GGUF, dequantized to f32)",
            "sweep": "head outputs (z), all positions, clean into corrupt, "
                     f"{s.layers * max(s.heads)} heads",
            "pairs": len(pairs), "tokens": int(pairs.clean.shape[1]),
            "mha_jax": {"median_s": ours_med, "first_call_s": ours_first, "runs_s": ours_all,
                        "study_setup_s": setup},
            "atp": {"median_s": atp_med, "first_call_s": atp_first,
                    "forward_backward_s": fb, "ratio_to_forward_backward": atp_med / fb,
                    "agreement_with_exact": activation_patching.agreement(atp["z"]["heads"],
                                                           ours["recovery"])},
            "machine": machine(matmul_gflops=rate_before)}
  return s, ours, result


def _peers(loaded, pairs, ours, a: PatchingOptions, result: dict) -> None:
  """TransformerLens' and nnsight's sweeps (when installed) into result["peers"]."""
  from mha_jax.harness import bench
  import torch
  import transformers
  P = load_peers(loaded.config["source"]["path"])
  hf_same = max(float((P["state"][k] - v).abs().max())
                for k, v in to_transformers_sd(loaded).items())
  print(f"peers loaded: {P['seconds']}; max |weight difference| to mha-jax's {hf_same:.1e}",
        flush=True)
  n = a.peer_layers
  for name, fn in (("transformer_lens", lambda: tl_sweep(P["tl"], pairs, n)),
                   ("nnsight", lambda: nnsight_sweep(P["nnsight"], P["hf"], pairs, layers=n))):
    table, p_first, p_med, p_all = bench.first_and_rounds(fn, a.peer_rounds)
    diff = float(np.nanmax(np.abs(table - ours["recovery"])))
    done = int(np.isfinite(table).sum())
    if done < table.size:     # a part of the heads: the time per head, times all heads
      scale = table.size / done
      p_first, p_med, p_all = p_first * scale, p_med * scale, [t * scale for t in p_all]
    load = P["seconds"]["hf"] + P["seconds"]["tl" if name == "transformer_lens" else
                                              "nnsight"]
    result["peers"][name] = {
        "median_s": p_med, "first_s": p_first, "runs_s": p_all, "load_s": load,
        "command_s": load + p_first, "max_abs_recovery_difference": diff,
        "heads_run": done, "heads": int(table.size),
        "version": importlib.metadata.version(name.replace("_", "-"))}
    print(f"{name}: sweep {p_med:.2f} s (first {p_first:.1f} s), load {load:.1f} s; max "
          f"|recovery difference| to mha-jax {diff:.2e}", flush=True)
  result["peers_weights_max_abs_difference"] = hf_same
  result["torch"], result["transformers"] = torch.__version__, transformers.__version__
  result["torch_threads"] = torch.get_num_threads()


def _torch_loop(loaded, pairs, s, ours, rounds: int) -> dict:
  """The loop of transformers forwards with a pre-hook on o_proj, against ours."""
  import torch
  from mha_jax.harness import bench
  hf = to_transformers(loaded)
  theirs, t_first, t_med, t_all = bench.first_and_rounds(lambda: torch_sweep(hf, pairs),
                                                         rounds)
  denom = s.ld_clean.mean() - s.ld_corrupt.mean()
  rec = (theirs.mean(-1) - s.ld_corrupt.mean()) / denom
  diff = float(np.nanmax(np.abs(rec - ours["recovery"])))
  print(f"torch hooks loop: {t_med:.2f} s; max |recovery difference| {diff:.2e}", flush=True)
  return {"median_s": t_med, "first_s": t_first, "runs_s": t_all,
          "threads": torch.get_num_threads(), "max_abs_recovery_difference": diff}


def _installed(*names: str) -> bool:
  try:
    for name in names:
      importlib.import_module(name)
  except ImportError:
    return False
  return True


def run(args: PatchingOptions) -> int:
  cores = sorted(os.sched_getaffinity(0))
  if args.cores:                     # before JAX's CPU backend starts its thread pool
    cores = cores[:args.cores]
    os.sched_setaffinity(0, set(cores))
  import mha_jax
  from mha_jax.harness import bench
  from mha_jax.toolkit import activation_patching, pairs as pairs_lib
  from mha_jax.pretrained import importer
  workdir, tmp = args.workdir, None
  if workdir is None:
    tmp = tempfile.TemporaryDirectory()
    workdir = os.path.join(tmp.name, "smollm2")
    importer.import_model(workdir, name="smollm2-135m")
  loaded = mha_jax.load(workdir)
  pairs = pairs_lib.ioi_pairs(loaded.task, args.pairs, seed=0)
  s, ours, result = _ours(loaded, pairs, args.rounds)
  torch_ok = _installed("torch", "transformers")
  if not torch_ok:
    print("transformers/torch not installed: mha-jax only")
  elif args.cores:
    import torch
    torch.set_num_threads(args.cores)
  result["peers"] = {}
  if not _installed("nnsight", "transformer_lens"):
    print("transformer-lens / nnsight not installed (pip install .[bench]): no peers")
  elif torch_ok:
    _peers(loaded, pairs, ours, args, result)
  if args.command:
    result["command"] = command_times(workdir, len(pairs))
  if torch_ok and args.torch_rounds:
    result["torch_hooks_loop"] = _torch_loop(loaded, pairs, s, ours, args.torch_rounds)
  if args.no_prefix:
    s_full = activation_patching.Study(loaded.task, loaded.params, pairs, share_prefix=False)
    _, f_first, f_med, f_all = bench.first_and_rounds(lambda: s_full.patch("z"), args.rounds)
    print(f"mha-jax batched sweep without the shared prefix: {f_med:.2f} s", flush=True)
    result["mha_jax_no_shared_prefix"] = {"median_s": f_med, "first_call_s": f_first,
                                          "runs_s": f_all}
  result["machine"]["matmul_gflops_after"] = bench.matmul_gflops()
  result["table"] = table_of(result, s.layers * max(s.heads), len(pairs), len(cores))
  print(result["table"])
  bench.write_json(result, args.out)
  print(f"wrote {args.out}")
  if tmp:
    tmp.cleanup()
  return 0
