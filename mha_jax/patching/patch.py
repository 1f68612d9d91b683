"""`mha-jax patch`: a causal head study of one workdir, written as JSON and heatmaps.

  DIR/patching.json     the pairs (clean and corrupt logit differences; "left_out": the
                        pairs whose clean logit difference is < 0, unless kept); under
                        "scores" one table per sweep of --sites keyed by head name, the
                        recovery (LD - LD_corrupt) / (LD_clean - LD_corrupt) of the pair
                        means: head_out, q, k, v (per query head) and k_kv, v_kv (kv:
                        per key/value head, "lm.{layer}.{kv head}", GQA models);
                        "resid" per layer and position; the top heads; with --outputs
                        logit_lens, the logit lens. The asked sweeps run as one
                        compiled program.
  DIR/dla.json          (--outputs dla) "heads": mean direct logit attribution on the
                        clean runs, "mlp"
  DIR/attribution.json  AtP scores of head outputs and their agreement with exact
                        patching (Pearson, Spearman, top-10 overlap), with the seconds
  DIR/path.json         path patching: every sender to the logits, and to the top
                        heads' q, k, v; the strongest edges
  DIR/*.png             layer x head heatmaps
  DIR/explorer.html     (--outputs explorer; later: `mha-jax patch-explorer`) the
                        explorer's patching view of these files, with the attention
                        view of the first pairs (patching/patch_explorer.py)

Only what is asked runs: DLA, the logit lens and the explorer page's attention view
each compile programs of their own (seconds each on SmolLM2), so they are outputs to
ask for (--outputs), not a fixed cost of every head table.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable, Sequence

import numpy as np

from mha_jax import loader, settings, storage
from mha_jax.errors import UserError
from mha_jax.toolkit import activation_patching, memory, pairs as pairs_lib
from mha_jax.patching import patch_explorer
from mha_jax.toolkit import plots
from mha_jax.settings import setting
from mha_jax.train import sharding

METHODS = ("activation", "path", "attribution")
BEHAVIOURS = pairs_lib.BEHAVIOURS    # --task: what the pairs test
# --sites: the activation-patching sweeps; kv is k and v per key/value head (GQA models)
SITES = ("head_out", "q", "k", "v", "kv", "resid")
# --outputs: what the command adds to the asked methods' tables and heatmaps
OUTPUTS = ("dla", "logit_lens", "explorer")
_SWEEPS = {"head_out": (("head_out", "z", False),), "q": (("q", "q", False),),
           "k": (("k", "k_q", False),), "v": (("v", "v_q", False),),
           "kv": (("k_kv", "k", False), ("v_kv", "v", False)),
           "resid": (("resid", "resid_pre", True),)}


def _sweeps(sites: Sequence[str], gqa: bool) -> list[tuple[str, str, bool]]:
  """(table name, core site, per position) of each asked sweep, in SITES' order."""
  bad = [x for x in sites if x not in SITES]
  if bad or not sites:
    raise UserError(f"sites must be a comma-separated subset of {SITES}; got "
                    f"{','.join(sites)!r}", setting="sites")
  return [sw for x in SITES if x in sites and (x != "kv" or gqa) for sw in _SWEEPS[x]]


def _per_layer_positions(arr_LT) -> dict:
  return {f"lm.{l}": [round(float(v), 6) for v in row] for l, row in enumerate(arr_LT)}


def _timed(fn):
  t0 = time.perf_counter()
  out = fn()
  return out, time.perf_counter() - t0


def failing_pairs(s, pairs) -> list[dict]:
  """The pairs whose clean logit difference is negative (the model fails the clean
  prompt), each {"index", "ld_clean", "ld_corrupt", **its text}; refused when all fail."""
  bad = [{"index": i, "ld_clean": round(float(s.ld_clean[i]), 6),
          "ld_corrupt": round(float(s.ld_corrupt[i]), 6), **pairs.text[i]}
         for i in range(len(pairs)) if s.ld_clean[i] < 0]
  if len(bad) == len(pairs):
    raise UserError(f"the model gets every clean prompt wrong (clean logit differences "
                    f"{[b['ld_clean'] for b in bad]}): nothing to patch; keep_failing "
                    f"keeps them", setting="keep_failing")
  return bad


@dataclasses.dataclass(frozen=True, kw_only=True)
class PatchOptions:
  """The settings of `patch`; `methods=` marks those only some methods read."""
  task: str | None = setting(None, choices=BEHAVIOURS, help="a built-in behaviour the pairs "
                             "test (or give pairs)")
  pairs: str | None = setting(None, path=True, help="a JSONL file, one {clean, corrupt, "
                              "answer, wrong} a line")
  method: tuple[str, ...] = setting(("activation", "attribution"), choices=METHODS,
                                    metavar="METHOD[,METHOD...]",
                                    help=f"of {', '.join(METHODS)} (default: "
                                         f"activation,attribution)")
  n_pairs: int = setting(8, lo=1, help="built-in behaviours: pairs drawn")
  seed: int = setting(0, lo=0, help="the random seed (default: 0)")
  keep_failing: bool = setting(False, help="keep the pairs whose clean prompt the model "
                               "gets wrong (clean logit difference < 0; left out by "
                               "default)")
  top: int = setting(10, lo=1, help="the top heads listed in patching.json")
  sites: tuple[str, ...] = setting(("head_out",), choices=SITES, methods=("activation",),
                                   metavar="SITE[,SITE...]",
                                   help=f"the sweeps, of {', '.join(SITES)} (default: "
                                        f"head_out; kv: k and v per key/value head)")
  per_position: bool = setting(False, methods=("activation",),
                               help="also patch every head at every position")
  receivers: int = setting(2, lo=1, methods=("path",),
                           help="the top heads whose q, k, v receive")
  outputs: tuple[str, ...] = setting((), choices=OUTPUTS, metavar="OUTPUT[,OUTPUT...]",
                                     help=f"also write, of {', '.join(OUTPUTS)}: dla.json "
                                          "(direct logit attribution), the logit lens "
                                          "(in patching.json), explorer.html (default: "
                                          "none, only the methods' tables and heatmaps)")
  memory_budget: str | None = memory.budget_setting(
      "a sweep's program", "the chunk sizes (interventions per group, pairs per batch) are")
  dtype: str | None = memory.dtype_setting()
  mesh: str | None = memory.mesh_setting()


def patch(loaded, out: str, opts: PatchOptions = PatchOptions(), *, log=print) -> dict:
  """Runs the asked methods on the pairs (activation patching: the sweeps of `sites`,
  in one program); writes the files in `out`; returns a summary."""
  settings.check(opts)
  if not loaded.task.decoder_only:
    loader.refuse("patch", loaded.workdir, "a decoder LM (prompt pairs compared by their "
                  "next-token logits)")
  behaviour, pairs_file, methods = opts.task, opts.pairs, opts.method
  n_pairs, seed, per_position, receivers = opts.n_pairs, opts.seed, opts.per_position, \
      opts.receivers
  top, sites, keep_failing = opts.top, opts.sites, opts.keep_failing
  if not methods:
    raise UserError(f"method must be a comma-separated subset of {METHODS}; got ''",
                    setting="method")
  _sweeps(sites, False)
  pairs = pairs_lib.select_pairs(loaded.task, behaviour, pairs_file, n_pairs, seed)
  params = memory.cast(loaded.params, opts.dtype)
  mesh = sharding.study_mesh(opts.mesh)
  budget, budget_from = memory.budget(opts.memory_budget, memory.params_bytes(params, mesh=mesh))
  s = activation_patching.Study(loaded.task, params, pairs, memory_budget=budget, mesh=mesh)
  failing = [] if keep_failing else failing_pairs(s, pairs)
  if failing:
    keep = np.asarray([i for i in range(len(pairs)) if i not in {f["index"] for f in failing}])
    log(f"left out {len(failing)} pair(s) whose clean prompt the model gets wrong (clean "
        f"logit difference < 0; --keep-failing keeps them): " + "; ".join(
            f"#{f['index']} {f['ld_clean']:+.3f}" for f in failing))
    pairs = pairs.subset(keep)
    s = s.subset(keep)
  storage.makedirs(out)
  label = behaviour or "pairs"
  summary = {"pairs": len(pairs), "layers": s.layers, "heads": s.heads[0],
             "kv_heads": s.kv_heads[0], "ld_clean": float(np.mean(s.ld_clean)),
             "ld_corrupt": float(np.mean(s.ld_corrupt)), "seconds": {}}
  log(f"{len(pairs)} pairs, mean logit difference clean {summary['ld_clean']:.3f}, "
      f"corrupt {summary['ld_corrupt']:.3f}")
  doc = {"workdir": loaded.workdir, "task": label, "direction": "denoise (clean into corrupt)",
         "metric": "recovery = (LD_patched - LD_corrupt) / (LD_clean - LD_corrupt) of the "
                   "pair-mean logit differences LD = logit(answer) - logit(wrong)",
         "ld_clean": summary["ld_clean"], "ld_corrupt": summary["ld_corrupt"],
         "pairs": [{**p, "ld_clean": round(float(c), 6), "ld_corrupt": round(float(x), 6)}
                   for p, c, x in zip(pairs.to_json(), s.ld_clean, s.ld_corrupt)],
         "left_out": failing, "scores": {}}
  summary["left_out"] = len(failing)
  summary["memory_budget"] = {"bytes": budget, "from": budget_from}
  w = _Writing(s, out, label, loaded.workdir, summary, doc, methods, sites, per_position,
               receivers, top, log)
  if "dla" in opts.outputs:
    _write_dla(w)
  for method, write in _WRITERS:   # in this order: each may reuse an earlier one's scores
    if method in methods:
      write(w)
  if "logit_lens" in opts.outputs:
    lens = s.logit_lens()
    doc["logit_lens"] = {"logit_diff": [round(float(v), 6) for v in lens["logit_diff"]],
                         "prob": [round(float(v), 6) for v in lens["prob"]],
                         "layers": ["embed"] + [f"lm.{i}" for i in range(s.layers)]}
  storage.write_json(storage.join(out, "patching.json"), doc)
  storage.write_json(storage.join(out, "summary.json"), summary)
  if "explorer" in opts.outputs:
    patch_explorer.write(out, patch_explorer.attention_data(s, loaded.task))
  return summary


@dataclasses.dataclass
class _Writing:
  """What study's per-method writers share: the Study, where and how to write, the
  summary and patching.json's doc they fill, and exact head_out recoveries once known."""
  s: activation_patching.Study
  out: str
  label: str
  workdir: str
  summary: dict
  doc: dict
  methods: Sequence[str]
  sites: Sequence[str]
  per_position: bool
  receivers: int
  top: int
  log: Callable
  exact_heads: np.ndarray | None = None   # (L, H) head_out recovery

  def exact(self) -> np.ndarray:
    """Exact head_out recoveries, patched now if no sweep has yet."""
    if self.exact_heads is None:
      self.exact_heads = self.s.patch("z")["recovery"]
    return self.exact_heads


def _write_activation(w: _Writing) -> None:
  """Activation patching's sweeps of `sites` (one program), their heatmaps and the per
  position sweep, into patching.json's doc."""
  s, doc, summary, label, out = w.s, w.doc, w.summary, w.label, w.out
  gqa = any(g != h for g, h in zip(s.kv_heads, s.heads))
  sweeps = _sweeps(w.sites, gqa)
  if "kv" in w.sites and not gqa:
    w.log("--sites kv: this model has as many key/value heads as query heads (k and v "
          "are those tables)")
  if sweeps:
    res, sec = _timed(lambda: s.patch_many([(site, pp) for _, site, pp in sweeps]))
    summary["seconds"]["patch_" + "+".join(n for n, _, _ in sweeps)] = round(sec, 2)
    summary["plan"] = dataclasses.asdict(s.last_plan)
  for name, site, _ in sweeps:
    rec = res[site]["recovery"]
    if name == "resid":
      doc["resid"] = _per_layer_positions(rec)
      plots.heatmap(rec, f"{label}: recovery, patching resid_pre", storage.join(
          out, "patching_resid_pre.png"), "position")
      continue
    counts = s.kv_heads if site in activation_patching.KV_SITES else s.heads
    doc["scores"][name] = activation_patching.head_table(rec, counts)
    if name == "head_out":
      w.exact_heads = rec
    plots.heatmap(rec, f"{label}: recovery, patching {name} (clean into corrupt)",
             storage.join(out, f"patching_{name}.png"),
             "kv head" if site in activation_patching.KV_SITES else "head")
  if w.per_position:
    res, sec = _timed(lambda: s.patch("z", per_position=True))
    summary["seconds"]["patch_head_out_per_position"] = round(sec, 2)
    doc["head_out_per_position"] = {
        f"lm.{l}.{h}": [round(float(v), 6) for v in res["recovery"][l, h]]
        for l in range(s.layers) for h in range(s.heads[l])}
  if "head_out" in doc["scores"]:
    doc["top"] = {"head_out": activation_patching.top(doc["scores"]["head_out"], w.top, by_abs=True)}
    summary["top_head_out"] = doc["top"]["head_out"]


def _write_dla(w: _Writing) -> None:
  """dla.json and its heatmap: direct logit attribution on the clean runs."""
  d = w.s.dla()
  dla_doc = {"workdir": w.workdir, "task": w.label, "run": "clean",
             "direction": "logit(answer) - logit(wrong), final norm scale frozen at the "
                          "clean run",
             "heads": activation_patching.head_table(d["heads"], w.s.heads),
             "mlp": {f"lm.{i}": round(float(v), 6) for i, v in enumerate(d["mlp"])},
             "embed": d["embed"], "ld": d["ld"], "sum_of_parts": d["ld_frozen_sum"],
             # heads + MLPs + embeddings = LD holds when each head's result enters the
             # residual as it is; a post-attention norm (Gemma's) rescales it: not exact
             "sums_to_ld": bool(abs(d["ld_frozen_sum"] - d["ld"]) <= 1e-3 * max(1.0, abs(d["ld"])))}
  dla_doc["top"] = activation_patching.top(dla_doc["heads"], w.top, by_abs=True)
  w.summary["top_dla"] = dla_doc["top"]
  storage.write_json(storage.join(w.out, "dla.json"), dla_doc)
  plots.heatmap(d["heads"], f"{w.label}: direct logit attribution (clean)",
           storage.join(w.out, "dla_heads.png"))


def _write_attribution(w: _Writing) -> None:
  """attribution.json: AtP's head_out scores, their seconds and their agreement with
  exact patching."""
  s, summary = w.s, w.summary
  atp, sec = _timed(lambda: s.attribution(("z",)))
  summary["seconds"]["attribution"] = round(sec, 2)
  a_doc = {"workdir": w.workdir, "task": w.label, "direction": "denoise",
           "method": "AtP: (z_clean - z_corrupt) . d mean LD / dz at the corrupt run, "
                     "over (LD_clean - LD_corrupt)",
           "scores": {"head_out": activation_patching.head_table(atp["z"]["heads"], s.heads)},
           # its cost in forward+backward passes: `mha-jax bench patching`
           "seconds": {"attribution_first_call": round(sec, 3)}}
  t0 = time.perf_counter()
  s.attribution(("z",))
  a_doc["seconds"]["attribution"] = round(time.perf_counter() - t0, 3)
  # AtP's own reference when activation patching did not run; none when its sites
  # had no head_out
  exact = w.exact() if "activation" not in w.methods else w.exact_heads
  if exact is not None:
    a_doc["agreement"] = {"head_out": activation_patching.agreement(atp["z"]["heads"], exact, w.top)}
    summary["attribution_agreement"] = a_doc["agreement"]["head_out"]
  else:
    w.log("attribution: no agreement with exact patching (--sites has no head_out)")
  summary["attribution_seconds"] = a_doc["seconds"]
  storage.write_json(storage.join(w.out, "attribution.json"), a_doc)
  plots.heatmap(atp["z"]["heads"], f"{w.label}: AtP estimate of head_out recovery",
           storage.join(w.out, "attribution_head_out.png"))


def _write_path(w: _Writing) -> None:
  """path.json: every sender to the logits, and to the top heads' q, k, v."""
  s, summary, heads = w.s, w.summary, w.s.heads
  p_doc = {"workdir": w.workdir, "task": w.label, "direction": "denoise",
           "method": "sender z clean, other heads frozen at corrupt (MLPs recompute), "
                     "receiver input recorded then patched"}
  res, sec = _timed(lambda: s.path_patch("logits"))
  summary["seconds"]["path_logits"] = round(sec, 2)
  p_doc["to_logits"] = activation_patching.head_table(res["recovery"][..., 0], heads)
  plots.heatmap(res["recovery"][..., 0], f"{w.label}: path patching, sender -> logits",
           storage.join(w.out, "path_logits.png"))
  ranked = activation_patching.top(activation_patching.head_table(w.exact(), heads), w.receivers, by_abs=True)
  recv = [tuple(int(x) for x in n.split(".")[1:]) for n, _ in ranked]
  recv = [r for r in recv if r[0] > 0]
  edges = [{"sender": n, "receiver": "logits", "channel": "direct", "recovery": v}
           for n, v in p_doc["to_logits"].items()]
  for ch in ("q", "k", "v") if recv else ():
    res, sec = _timed(lambda: s.path_patch(recv, ch))
    summary["seconds"][f"path_{ch}"] = round(sec, 2)
    for r, rname in enumerate(res["receivers"]):
      for l in range(s.layers):
        for h in range(heads[l]):
          v = res["recovery"][l, h, r]
          if l < recv[r][0] and np.isfinite(v):
            edges.append({"sender": f"lm.{l}.{h}", "receiver": rname, "channel": ch,
                          "recovery": round(float(v), 6)})
  p_doc["receivers"] = [f"lm.{a}.{b}" for a, b in recv]
  edges.sort(key=lambda e: -abs(e["recovery"]))
  p_doc["edges"] = edges[:50]
  summary["top_edges"] = edges[:w.top]
  storage.write_json(storage.join(w.out, "path.json"), p_doc)


# study's writer of each method, in the order they run
_WRITERS = (("activation", _write_activation), ("attribution", _write_attribution),
            ("path", _write_path))


def format_summary(summary: dict) -> str:
  lines = [f"{summary['pairs']} pairs; LD clean {summary['ld_clean']:.3f}, corrupt "
           f"{summary['ld_corrupt']:.3f}"]
  if "top_head_out" in summary:
    lines.append("top heads, activation patching of head outputs (recovery): " + ", ".join(
        f"{n} {v:+.3f}" for n, v in summary["top_head_out"]))
  if "top_dla" in summary:
    lines.append("top heads, direct logit attribution: " + ", ".join(
        f"{n} {v:+.3f}" for n, v in summary["top_dla"]))
  if "attribution_agreement" in summary:
    a = summary["attribution_agreement"]
    lines.append(f"AtP vs exact: Pearson {a['pearson']:.3f}, Spearman {a['spearman']:.3f}, "
                 f"top-10 overlap {a['top10_overlap']:.1f}")
  if "top_edges" in summary:
    lines.append("strongest path-patching edges: " + ", ".join(
        f"{e['sender']}->{e['receiver']}({e['channel']}) {e['recovery']:+.3f}"
        for e in summary["top_edges"][:5]))
  return "\n".join(lines)
