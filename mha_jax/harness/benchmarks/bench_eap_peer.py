"""The EAP-IG library and MIB's evaluation as measured peers of `mha-jax circuit`.

    PYTHONPATH=EAP_IG/src:MIB venv-eap/bin/python -m mha_jax.cli bench eap-peer \
        --workdir W [--pairs 4] [--steps 5] [--methods eap,eap-ig] [--mib-eval eap-ig]
        [--rounds 1] [--command] [--out docs/results/circuits/eap_peer_smollm2.json]

The peers are benchmark-only (the `bench` extra, best in a virtual environment of its
own with --system-site-packages): TransformerLens 3.x (`HookedTransformer`; 4.x dropped
it), EAP-IG (a checkout of hannamw/EAP-IG at 7af394a, the commit MIB's circuit track
pins: its `src/` on PYTHONPATH) and MIB's circuit track (a checkout of
hannamw/MIB-circuit-track on PYTHONPATH, for MIB_circuit_track.evaluation and .metrics).
Neither is a package to install, so both come in on PYTHONPATH; nothing here is imported
by mha-jax.

The same weights: the workdir's params written into transformers' LlamaForCausalLM
(bench_models.to_transformers) and converted by TransformerLens' own
`convert_llama_weights` into a `HookedTransformer` (no folding or centring), float32,
CPU, grouped-query attention ungrouped (`ungroup_grouped_query_attention`, as MIB runs
it). The same pairs: `circuit --task ioi`'s first --pairs pairs (those the model gets
right), as text; the library tokenizes them itself, without a BOS (its `tokenize_plus`
prepends one; the project's prompts have none: a wrapper passing prepend_bos=False), and
its tokens are checked equal to the project's; its score matrices, which it allocates
with device='cuda', are made on the CPU (on_cpu). Those are the only changes.

1. Edge agreement. The library's scores (`attribute`, EAP and EAP-IG-inputs with
   --steps steps: its points k/steps, `--ig-points left` here) against the project's
   (`EdgeStudy.eap`, `.eap_ig(steps, "inputs", "left")`) on `--graph mib` (one edge per
   library edge, names mapped by circuits.mib_graph, the library's sign and 1/N undone),
   and on the grouped graph (a key/value end's score the sum of the library's over its
   group's query heads). Pearson, Spearman, top-100 overlap by |score|, max |difference|
   over max |score|.
2. CPR and CMD. MIB's own `evaluate_area_under_curve` on the library's graph (signed
   ranking for CPR, absolute for CMD, as its print_results.py reads them) against the
   project's `circuits.search.mib` on the same scores (--mib-eval: which methods).
3. Wall times: the library's model build, attribution and MIB's evaluation, against
   `mha-jax circuit --graph mib --method M --n-pairs N` as a fresh process (--command;
   model load included on both sides).
4. The peer timing table (--rounds R): per method, R interleaved rounds of the
   library's attribution and the project's on each graph, in the same process, so
   that the shared machine's load hits both alike; the library's median, the
   project's first call (it compiles) and its median over the later ones. The float32
   matmul rate (2048^3, median of 7) of JAX and of torch is measured before and after.

Writes --out with the machine record (mha_jax.machine.machine(), with JAX's matmul
rate; the load average at each step) and prints the tables.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

from mha_jax.errors import UserError
from mha_jax.harness.benchmarks import child_env
from mha_jax.harness.benchmarks.bench_models import to_transformers
from mha_jax.settings import setting

METHODS = ("eap", "eap-ig")


@dataclasses.dataclass(frozen=True, kw_only=True)
class EapPeerOptions:
  """The settings of `bench eap-peer`."""
  workdir: str = setting(path=True, help="an imported smollm2-135m")
  pairs: int = setting(4, lo=1, help="the IOI pairs requested")
  steps: int = setting(5, lo=1, help="EAP-IG's steps")
  methods: tuple[str, ...] = setting(METHODS, choices=METHODS, help="the methods compared")
  mib_eval: tuple[str, ...] | None = setting(("eap-ig",), choices=METHODS, help="the "
                                             "methods MIB's evaluation runs on (default: "
                                             "eap-ig)")
  no_mib_eval: bool = setting(False, help="run MIB's evaluation on none")
  rounds: int = setting(1, lo=1, help="interleaved timing rounds of each method's "
                        "attribution (library, then ours on each graph)")
  command: bool = setting(False, help="also time mha-jax circuit as fresh processes")
  out: str = setting("docs/results/circuits/eap_peer_smollm2.json", path=True,
                     help="the JSON file")


def stamp() -> dict:
  return {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
          "load_average": [round(x, 2) for x in os.getloadavg()]}


def peer_model(loaded, tokenizer_file: str):
  """TransformerLens' HookedTransformer over the workdir's weights (LLaMA family), set
  up as MIB's run_attribution does."""
  import torch
  import transformers
  from transformer_lens import HookedTransformer, HookedTransformerConfig
  from transformer_lens.pretrained.weight_conversions import convert_llama_weights
  hf = to_transformers(loaded).float().eval()
  c = hf.config
  cfg = HookedTransformerConfig(
      d_model=c.hidden_size, d_head=c.hidden_size // c.num_attention_heads,
      n_heads=c.num_attention_heads, n_key_value_heads=c.num_key_value_heads,
      d_mlp=c.intermediate_size, n_layers=c.num_hidden_layers, n_ctx=2048,
      d_vocab=c.vocab_size, act_fn="silu", normalization_type="RMS", eps=c.rms_norm_eps,
      positional_embedding_type="rotary", rotary_base=c.rope_theta if hasattr(c, "rope_theta")
      else c.rope_parameters["rope_theta"], rotary_adjacent_pairs=False,
      rotary_dim=c.hidden_size // c.num_attention_heads, gated_mlp=True, final_rms=True,
      original_architecture="LlamaForCausalLM", default_prepend_bos=False, device="cpu",
      dtype=torch.float32)
  tok = transformers.PreTrainedTokenizerFast(tokenizer_file=tokenizer_file)
  tok.pad_token = tok.pad_token or tok.eos_token or "<|endoftext|>"
  model = HookedTransformer(cfg, tokenizer=tok)
  model.load_and_process_state_dict(convert_llama_weights(hf, cfg), fold_ln=False,
                                    center_writing_weights=False, center_unembed=False,
                                    fold_value_biases=False)
  model.cfg.use_split_qkv_input = True
  model.cfg.use_attn_result = True
  model.cfg.use_hook_mlp_in = True
  model.cfg.ungroup_grouped_query_attention = True
  return model.eval()


def no_bos(eap_modules):
  """The library's tokenize_plus with prepend_bos=False, put in every module that
  imported it."""
  import eap.utils as eap_utils
  from transformer_lens.utils import get_attention_mask

  def tokenize_plus(model, inputs, max_length=None):
    tokens = model.to_tokens(inputs, prepend_bos=False, padding_side="right")
    mask = get_attention_mask(model.tokenizer, tokens, False)
    return tokens, mask, mask.sum(1), mask.size(1)
  for m in [eap_utils, *eap_modules]:
    if hasattr(m, "tokenize_plus"):
      m.tokenize_plus = tokenize_plus
  return tokenize_plus


def on_cpu(eap_modules):
  """The library allocates its score matrices with device='cuda' (7af394a): its modules'
  `torch` is given a torch whose zeros() maps that to the CPU (the one other change)."""
  import torch

  class TorchOnCPU:
    def __getattr__(self, name):
      return getattr(torch, name)

    @staticmethod
    def zeros(*a, **kw):
      if kw.get("device") == "cuda":
        kw["device"] = "cpu"
      return torch.zeros(*a, **kw)
  for m in eap_modules:
    m.torch = TorchOnCPU()


def agreement(a, b, top: int = 100) -> dict:
  from scipy.stats import pearsonr, spearmanr
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  ta = set(np.argsort(-np.abs(a), kind="stable")[:top].tolist())
  tb = set(np.argsort(-np.abs(b), kind="stable")[:top].tolist())
  return {"n": len(a), "pearson": float(pearsonr(a, b)[0]), "spearman": float(spearmanr(a, b)[0]),
          f"top{top}": len(ta & tb), "max_abs_diff": float(np.abs(a - b).max()),
          "max_abs_diff_over_max": float(np.abs(a - b).max() / np.abs(b).max()),
          "largest_ours": float(b[np.argmax(np.abs(b))]),
          "largest_library": float(a[np.argmax(np.abs(a))])}


def grouped_sum(mib_graph, mib_edges, scores, grouped_graph, grouped_edges) -> np.ndarray:
  """(E_grouped,) the mib graph's scores summed onto the grouped graph: a key/value end
  of query head h is the end of its key/value head h // (heads / kv_heads)."""
  index = {(grouped_graph.nodes[u], grouped_graph.ends[e]): r
           for r, (u, e) in enumerate(grouped_edges)}
  out = np.zeros(len(grouped_edges))
  for (u, e), v in zip(mib_edges, scores):
    end = mib_graph.ends[e].split(".")
    if len(end) == 4 and end[3] in "kv":
      layer = int(end[1])
      r = grouped_graph.heads[layer] // grouped_graph.kv_heads[layer]
      end[2] = str(int(end[2]) // r)
    out[index[(mib_graph.nodes[u], ".".join(end))]] += v
  return out


def _peers_importable() -> None:
  """The peers' checkouts on PYTHONPATH, or a refusal saying how."""
  missing = [m for m in ("eap", "MIB_circuit_track") if importlib.util.find_spec(m) is None]
  if missing:
    raise UserError(f"the peers {', '.join(missing)} are not importable: put the EAP-IG "
                    f"checkout's src/ and the MIB-circuit-track checkout on PYTHONPATH "
                    f"(docs/guide/circuits.md)")


def run(args: EapPeerOptions) -> int:
  _peers_importable()
  from mha_jax.harness import bench
  from mha_jax.machine import machine
  result = measure(args, lambda partial: bench.write_json(partial, args.out))
  result["matmul_gflops_after"] = matmul_rates()
  result["machine"] = machine(matmul_gflops=result["matmul_gflops_before"]["jax"])
  bench.write_json(result, args.out)
  print(table(result))
  print(f"wrote {args.out}")
  return 0


def measure(args: EapPeerOptions, save=lambda doc: None) -> dict:
  """The measurements (see the module docstring); save(doc) after each step."""
  import torch
  from functools import partial
  from torch.utils.data import DataLoader
  import eap.attribute
  import eap.evaluate
  from eap.graph import Graph
  from MIB_circuit_track.dataset import collate_EAP
  from MIB_circuit_track.evaluation import evaluate_area_under_curve
  from MIB_circuit_track.metrics import get_metric
  from mha_jax import loader
  from mha_jax.circuits import circuit, edges as edges_lib, mib_graph, search
  torch.set_num_threads(os.cpu_count() or 1)
  no_bos([eap.attribute, eap.evaluate])
  import eap.utils
  on_cpu([eap.attribute, eap.evaluate, eap.utils])
  out = {"workdir": args.workdir, "pairs_requested": args.pairs, "steps": args.steps,
         "ig_points": "left", "rounds": args.rounds, "seconds": {}, "started": stamp(),
         "matmul_gflops_before": matmul_rates()}
  sec = out["seconds"]
  loaded = loader.load(args.workdir)
  studies = {}
  for g in ("mib", "grouped"):
    s, metric, _, failing = circuit.prepare(loaded, "ioi", None, args.pairs, 0, False,
                                            log=print, graph=g)
    studies[g] = edges_lib.EdgeStudy(s, metric=metric)
  es = studies["mib"]
  pairs = es.s.pairs
  out["pairs"] = pairs.to_json()
  t0 = time.perf_counter()
  model = peer_model(loaded, os.path.join(args.workdir, "tokenizer.json"))
  sec["library_model_build"] = round(time.perf_counter() - t0, 2)
  data = [(t["clean"], t["corrupt"], [int(a), int(w)])
          for t, a, w in zip(pairs.text, pairs.answer, pairs.wrong)]
  for (c, x, _), ci, xi, n in zip(data, pairs.clean, pairs.corrupt, pairs.length):
    for text, ids in ((c, ci), (x, xi)):
      got = model.to_tokens(text, prepend_bos=False)[0].tolist()
      if got != [int(v) for v in ids[:n]]:
        raise RuntimeError(f"the library's tokens of {text!r} differ from the project's: {got}")
  loader_ = DataLoader(data, batch_size=len(data), collate_fn=collate_EAP)
  metric = get_metric("logit_diff", "ioi", model.tokenizer, model)
  n = len(data)
  ours = {"eap": lambda s: s.eap(),
          "eap-ig": lambda s: s.eap_ig(args.steps, "inputs", "left")}
  lib_method = {"eap": "EAP", "eap-ig": "EAP-IG-inputs"}
  out["methods"] = {}
  for m in args.methods:
    def library():
      graph = Graph.from_model(model)
      eap.attribute.attribute(model, graph, loader_, partial(metric, mean=True, loss=True),
                              lib_method[m], "patching", ig_steps=args.steps, quiet=True)
      return graph
    graph, mine, times = timed_rounds(args.rounds, library,
                                      {g: partial(ours[m], s) for g, s in studies.items()})
    with tempfile.TemporaryDirectory() as tmp:
      graph.to_json(os.path.join(tmp, "g.json"))
      doc = json.load(open(os.path.join(tmp, "g.json")))
    lib = mib_graph.scores_of(doc, es.graph, es.edges, n)       # our sign and units
    gs = studies["grouped"]
    lib_grouped = grouped_sum(es.graph, es.edges, lib, gs.graph, gs.edges)
    row = {"library_seconds": times["library"]["median"],
           "ours_seconds_both_graphs": round(sum(times[g]["rounds"][0] for g in studies), 2),
           "timing": times,
           "mib_graph": agreement(lib, mine["mib"]),
           "grouped_graph_gqa_sum": agreement(lib_grouped, mine["grouped"]), **stamp()}
    print(m, json.dumps(row), flush=True)
    out["methods"][m] = row
    save(out)
    if not args.no_mib_eval and m in (args.mib_eval or ()):
      row["mib_evaluation"] = mib_eval(model, graph, loader_, metric, es, lib, search,
                                       evaluate_area_under_curve)
      print(m, "MIB evaluation", json.dumps(row["mib_evaluation"]), flush=True)
    out["methods"][m] = row
    save(out)
  if args.command:
    out["command"] = command_times(args)
  return out


def matmul_rates(n: int = 2048, rounds: int = 7) -> dict:
  """{"jax", "torch"}: the float32 (n x n) @ (n x n) rate, GFLOP/s, median of rounds
  (the project's and the library's array library, on the same machine)."""
  import torch
  from mha_jax.harness import bench
  a = torch.randn(n, n)
  a @ a
  ts = []
  for _ in range(rounds):
    t0 = time.perf_counter()
    a @ a
    ts.append(time.perf_counter() - t0)
  return {"jax": round(bench.matmul_gflops(n, rounds), 1),
          "torch": round(2 * n**3 / statistics.median(ts) / 1e9, 1), **stamp()}


def timed_rounds(rounds: int, library, ours: dict):
  """(the library's last result, {graph: our last scores}, seconds): `rounds` rounds,
  each timing library() then every ours[graph]() once. seconds: {"library", graph:
  {"rounds": [...], "median"; ours also "first" (compiles) and "median_warm" (the
  median after the first; None with one round)}}."""
  times = {"library": []} | {g: [] for g in ours}
  mine = {}
  for _ in range(rounds):
    t0 = time.perf_counter()
    graph = library()
    times["library"].append(time.perf_counter() - t0)
    for g, fn in ours.items():
      t0 = time.perf_counter()
      mine[g] = np.asarray(fn())
      times[g].append(time.perf_counter() - t0)
  out = {k: {"rounds": [round(t, 2) for t in v], "median": round(statistics.median(v), 2)}
         for k, v in times.items()}
  for g in ours:
    out[g]["first"] = out[g]["rounds"][0]
    out[g]["median_warm"] = (round(statistics.median(times[g][1:]), 2)
                             if len(times[g]) > 1 else None)
  return graph, mine, out


def mib_eval(model, graph, loader_, metric, es, lib_scores, search, evaluate) -> dict:
  """MIB's evaluate_area_under_curve (signed for CPR, absolute for CMD) on the library's
  graph, and the project's search.mib on the same scores."""
  from functools import partial
  got = {}
  for name, absolute in (("signed", False), ("absolute", True)):
    t0 = time.perf_counter()
    counts, area, from_1, _, faith = evaluate(model, graph, loader_,
                                              partial(metric, mean=False, loss=False),
                                              absolute=absolute, quiet=True)
    got[name] = {"seconds": round(time.perf_counter() - t0, 2), "area_under": area,
                 "area_from_1": from_1, "faithfulness": faith,
                 "edge_counts": [float(c) for c in counts]}
  t0 = time.perf_counter()
  ours = search.mib(es, lib_scores)
  t_ours = time.perf_counter() - t0
  return {"mib": {"cpr": got["signed"]["area_under"], "cmd": got["absolute"]["area_from_1"],
                  "curves": got},
          "ours": {"cpr": ours["cpr"], "cmd": ours["cmd"], "seconds": round(t_ours, 2),
                   "curve_signed": ours["curve_signed"],
                   "curve_absolute": ours["curve_absolute"]},
          "cpr_diff": abs(ours["cpr"] - got["signed"]["area_under"]),
          "cmd_diff": abs(ours["cmd"] - got["absolute"]["area_from_1"]), **stamp()}


def command_times(args) -> dict:
  """`mha-jax circuit --graph mib --method M` as a fresh process, cold and warm
  compile cache: wall seconds and the command's own."""
  out = {}
  env = child_env()
  with tempfile.TemporaryDirectory() as tmp:
    for m in args.methods:
      for run_name in ("cold", "warm"):
        argv = ["circuit", "--workdir", args.workdir, "--task", "ioi", "--n-pairs",
                str(args.pairs), "--graph", "mib", "--method", m, "--steps", str(args.steps)]
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-m", "mha_jax.cli", *argv, "--out",
                        f"{tmp}/{m}_{run_name}", "--compile-cache", f"{tmp}/xla_{m}"],
                       check=True, env=env, capture_output=True)
        wall = time.perf_counter() - t0
        with open(f"{tmp}/{m}_{run_name}/circuit.json") as f:
          doc = json.load(f)
        out[f"{m}_{run_name}"] = {"argv": argv, "wall_s": round(wall, 2),
                                  "seconds": doc["seconds"], "cpr": doc["cpr"],
                                  "cmd": doc["cmd"], **stamp()}
        print(m, run_name, json.dumps(out[f"{m}_{run_name}"]), flush=True)
  return out


def table(r: dict) -> str:
  rows = ["| method | graph | Pearson | Spearman | top-100 | max diff / max | library s |",
          "|---|---|---|---|---|---|---|"]
  for m, row in r["methods"].items():
    for g in ("mib_graph", "grouped_graph_gqa_sum"):
      a = row[g]
      rows.append(f"| {m} | {g} | {a['pearson']:.7f} | {a['spearman']:.5f} | "
                  f"{a['top100']}/100 | {a['max_abs_diff_over_max']:.2e} | "
                  f"{row['library_seconds']} |")
    if "mib_evaluation" in row:
      e = row["mib_evaluation"]
      rows.append(f"| {m} | MIB's evaluation | CPR {e['mib']['cpr']:.4f} (ours "
                  f"{e['ours']['cpr']:.4f}) | CMD {e['mib']['cmd']:.4f} (ours "
                  f"{e['ours']['cmd']:.4f}) | | | |")
  return "\n".join(rows + ["", *timing_table(r)])


def timing_table(r: dict) -> list[str]:
  """The peer timing table: library median against ours (first call, warm median) per
  method and graph, with the matmul rates."""
  rates = [r[k] for k in ("matmul_gflops_before", "matmul_gflops_after") if k in r]
  rows = [f"{r.get('rounds', 1)} interleaved rounds; float32 matmul GFLOP/s (JAX / torch): "
          + ", ".join(f"{x['jax']} / {x['torch']}" for x in rates), "",
          "| method | graph | library median s | ours first s | ours warm median s | "
          "library / ours warm |", "|---|---|---|---|---|---|"]
  for m, row in r["methods"].items():
    t = row.get("timing")
    for g in [g for g in (t or {}) if g != "library"]:
      warm = t[g]["median_warm"]
      rows.append(f"| {m} | {g} | {t['library']['median']} | {t[g]['first']} | {warm} | "
                  + (f"{t['library']['median'] / warm:.1f}x |" if warm else " |"))
  return rows

