"""mha-jax: train, study and benchmark multi-head attention (one verb per job).

One style for every verb: a flag with a fixed set of values is checked by the parser
(`choices`, and per item for comma-separated lists), a numeric flag by its range
(FLAG_RANGES). The study verbs also read their flags from a config file, loaded as
`train` loads its own:

    mha-jax prune --workdir W --config configs/studies/prune_michel.py --config.keep=6

A config's keys are the flags' names (`--keep-one-per-layer` is `keep_one_per_layer`);
`--config.KEY=VALUE` overrides a key and a flag on the command line overrides both. A verb
with methods (`prune --method`, `patch --method`) takes, and lists in --help, only the
flags of the methods asked for. The verbs are the table VERBS; each calls one function.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import json
import os
import sys
from typing import Callable, Sequence

import ml_collections

from mha_jax import config as mc
from mha_jax import storage
from mha_jax.analysis import importance
from mha_jax.errors import UserError
from mha_jax.models import common as C
from mha_jax.patching import run as patch_run
from mha_jax.circuits import circuit as circuit_run, tasks as circuit_tasks
from mha_jax.toolkit import ablations
from mha_jax.pretrained import registry
from mha_jax.pruning import gates, run as prune_run
from mha_jax.tasks.base import SPLITS


def _list_of(cast, what):
  """An argparse type for comma-separated values, "1,2,3" -> (1, 2, 3)."""
  def parse(text: str) -> tuple:
    try:
      return tuple(cast(v) for v in text.split(",") if v.strip())
    except ValueError:
      raise argparse.ArgumentTypeError(f"expected comma-separated {what}; got {text!r}") from None
  return parse


_int_list = _list_of(int, "integers")
_float_list = _list_of(float, "numbers")


def _cmd_zoo(args) -> int:
  from mha_jax import accounting
  if args.d_model is not None:
    print(accounting.format_head_sweep(args.d_model, seq_len=args.seq_len, batch=args.batch))
    print("\nAt d_k = 1 a query and a key are single numbers: a head can then only favour "
          "the key with the largest or the smallest k.")
    return 0
  print(accounting.format_zoo(seq_len=args.seq_len, batch=args.batch))
  print("\nParams and FLOPs are the same for every h at a given d_model; the score "
        "tensor grows with h. Grouped-query attention (h_kv < h) shrinks W_K, W_V and "
        "the KV cache by h / h_kv.")
  return 0


def _cmd_bench_attention(args) -> int:
  from mha_jax import bench
  if args.scale_t:
    seq_lens = args.seq_lens or bench.SCALE_T
    impls = tuple(args.impls) if args.impls else None
    result = bench.run_scale_t(d_model=args.d_model if args.d_model_given else 512,
                               num_heads=args.heads[0] if args.heads_given else 8,
                               batch=args.batch if args.batch_given else 1,
                               seq_lens=seq_lens, impls=impls, rounds=args.rounds,
                               max_mem_gb=args.max_mem_gb)
    print(bench.format_scale_t(result))
    out = args.out if args.out != _BENCH_OUT else "results/bench_attention_scale_t.json"
    bench.write_json(result, out)
    print(f"\nwrote {out}")
    return 0
  if args.variants:
    result = bench.run_variants(d_model=args.d_model, seq_len=args.seq_len,
                                batch=args.batch, heads=args.heads if args.heads_given else (8,),
                                rounds=args.rounds, warmup=args.warmup, dtype=args.dtype)
    print(bench.format_variants(result))
    out = args.out if args.out != _BENCH_OUT else "results/bench_attention_variants.json"
    bench.write_json(result, out)
    print(f"\nwrote {out}")
    return 0
  result = bench.run(d_model=args.d_model, seq_len=args.seq_len, batch=args.batch,
                     heads=args.heads, rounds=args.rounds, warmup=args.warmup,
                     dtype=args.dtype, impls=tuple(args.impls) if args.impls else None)
  print(bench.format_table(result))
  bench.write_json(result, args.out)
  print(f"\nwrote {args.out}")
  return 0


def _cmd_bench_train(args, extra) -> int:
  from mha_jax import bench, bench_train
  if any(not a.startswith("--config.") for a in extra):
    raise UserError(f"unrecognized arguments: {' '.join(extra)}")
  result = bench_train.run(args.config, extra, rounds=args.rounds, warmup=args.warmup,
                           workdir=args.workdir, matmul_size=args.matmul_size)
  print(bench_train.format_table(result))
  bench.write_json(result, args.out)
  print(f"\nwrote {args.out}")
  return 0


def _cmd_train(args, extra) -> int:
  from mha_jax.train import loop
  from mha_jax.train import distributed
  many = distributed.initialize(args.coordinator, args.num_processes, args.process_id,
                                auto=args.multihost, process_timeout=args.process_timeout,
                                startup_timeout=args.startup_timeout)
  try:
    cfg = mc.load_config(args.config)
    rest = mc.apply_overrides(cfg, extra)
    if rest:
      raise UserError(f"unrecognized arguments: {' '.join(rest)}")
    summary = loop.train(cfg, args.workdir)
  except (UserError, loop.TrainingDiverged) as e:
    if not many:
      if isinstance(e, UserError):
        raise
      print(f"mha-jax: {e}", file=sys.stderr)
      return 1
    # Several processes: say it, tell the others (their watchdogs stop them), and end
    # without JAX's shutdown barrier, which would wait for them.
    print(f"mha-jax: {'error: ' if isinstance(e, UserError) else ''}{e}", file=sys.stderr,
          flush=True)
    distributed.finish(str(e))
    sys.stdout.flush()
    os._exit(2 if isinstance(e, UserError) else 1)
  except Exception as e:   # noqa: BLE001 - several processes: see distributed.failed
    if not many:
      raise
    distributed.failed(e)
  distributed.finish()
  print(json.dumps(summary))
  return 0


def _cmd_eval(args) -> int:
  from mha_jax.loader import load
  def eval_one(wd, **extra):
    run = load(wd, step=args.step)
    res = run.task.evaluate(run.params, args.split)
    print(json.dumps({"workdir": wd, **extra, "step": run.step, "split": args.split, **res}),
          flush=True)
    return res

  seeds = _multi_seed(args.workdir)
  if not seeds:
    eval_one(args.workdir)
    return 0
  from mha_jax.analysis import stability   # one line per seed, then mean and std over seeds
  all_res = [eval_one(wd, seed=s) for s, wd in seeds]
  print(json.dumps({"workdir": args.workdir, "seeds": [s for s, _ in seeds],
                    "split": args.split, **{
                        f"{k}_{name}": v for k in all_res[0]
                        for name, v in stability.stats([r[k] for r in all_res]).items()
                        if name in ("mean", "std")}}))
  return 0


def _out_dir(args, default: str = "analysis") -> str:
  """--out, by default WORKDIR/analysis; checked writable before any work is done."""
  return writable_out(args.out or storage.join(args.workdir, default), args.workdir)


def writable_out(out: str, workdir: str | None = None, flag: str = "--out") -> str:
  """Creates folder `out` (a command's output) and checks that it takes files, before any
  work is done; never the source workdir itself or inside its managed folders."""
  from mha_jax.errors import StorageFault
  from mha_jax.train import lock as lock_lib
  if workdir is not None:
    lock_lib.check_out(out, workdir, flag)
  if storage.exists(out) and not storage.isdir(out):
    raise UserError(f"{flag} {out!r} is a file, not a folder")
  try:
    storage.makedirs(out)
  except StorageFault as e:
    raise UserError(f"{flag} {out!r} cannot be created ({storage.FAULTS[e.kind]}); a "
                    f"read-only workdir needs {flag} elsewhere") from None
  if not storage.writable(out):
    raise UserError(f"{flag} {out!r} is not writable; a read-only workdir needs {flag} "
                    f"elsewhere")
  return out


def _multi_seed(workdir: str):
  """[(seed, seed workdir)] when --workdir is a multi-seed run (train.seeds), else None."""
  from mha_jax.train import seeds as seeds_lib
  return seeds_lib.seed_workdirs(workdir) if seeds_lib.is_multi_seed(workdir) else None


def _cmd_analyze_seeds(args, seeds) -> int:
  """analyze over a multi-seed workdir: each seed's report into its own workdir's
  analysis/ (or --out/seed_<s>), then the role stability across seeds into --out
  (default WORKDIR/analysis)."""
  from mha_jax.analysis import report, stability
  from mha_jax.loader import load
  out = _out_dir(args)
  heads = {}
  for s, wd in seeds:
    run = load(wd, step=args.step)
    seed_out = (storage.join(args.out, f"seed_{s}") if args.out else
                storage.join(wd, "analysis"))
    print(f"seed {s}: analysing {wd} into {seed_out} ...", flush=True)
    if args.roles_only:   # roles alone, beside (not over) a full report
      heads[s] = storage.join(seed_out, "roles_only.json")
      storage.makedirs(seed_out)
      storage.write_json(heads[s], report.head_roles(run, args.split))
      continue
    report.analyze(run, out_dir=seed_out, log=lambda m: None, **_analyze_options(args))
    heads[s] = storage.join(seed_out, "heads.json")
  rep = stability.write_role_stability(heads, out)
  print(stability.format_roles(rep))
  print(f"wrote {out}/ (stability.json, stability.md, stability.png) and each seed's "
        f"analysis")
  return 0


def _analyze_options(args) -> dict:
  """The options of `analyze`, the same for one run and for each seed of many."""
  return dict(split=args.split, loo=not args.no_ablations,
              loo_bleu_limit=args.bleu_sentences, conllu=args.conllu)


def _cmd_analyze(args) -> int:
  from mha_jax.analysis import report
  from mha_jax.loader import load
  seeds = _multi_seed(args.workdir)
  if seeds:
    return _cmd_analyze_seeds(args, seeds)
  if args.roles_only:
    raise UserError(f"--roles-only is for a multi-seed workdir; {args.workdir!r} is one run")
  run = load(args.workdir, step=args.step)
  out = _out_dir(args)
  summary = report.analyze(run, out_dir=out, **_analyze_options(args))
  print(json.dumps(summary, indent=1))
  print(f"wrote {out}/ (heads.json, heads.csv, *.png, explorer.html)")
  return 0


def _cmd_ablate(args) -> int:
  from mha_jax.analysis import report
  from mha_jax.loader import load
  if not args.each and not args.heads and not args.induction_vs_random:
    raise UserError("give --heads stack.layer.head[,...], --each or --induction-vs-random")
  run = load(args.workdir, step=args.step)
  out_dir = _out_dir(args)
  if args.induction_vs_random:
    return _ablate_induction(run, args, out_dir)
  heads = None if args.each else importance.parse_heads(run.params, args.heads)
  is_tr = run.task.reports_bleu                 # names checked above, before this pass
  base = run.task.evaluate(run.params, args.split, bleu=is_tr, bleu_limit=0)
  if args.each:
    rows = importance.leave_one_out(run, split=args.split, mode=args.mode, bleu_limit=0,
                                    base=base)
    result = {"mode": args.mode, "split": args.split, "base": base, "each": rows}
  else:
    res = importance.ablate(run, heads, mode=args.mode, split=args.split, bleu_limit=0)
    rows = [{"head": args.heads, **res, **{f"delta_{k}": res[k] - base[k] for k in res}}]
    result = {"mode": args.mode, "split": args.split, "heads": args.heads, "base": base,
              "ablated": res, "delta": {k: res[k] - base[k] for k in res}}
  name = "ablation_each" if args.each else "ablation"
  storage.write_json(storage.join(out_dir, f"{name}_{args.mode}.json"), result)
  key = "delta_bleu" if is_tr else "delta_loss"
  report._plot_bars([r["head"] for r in rows], [r[key] for r in rows],
                    storage.join(out_dir, f"{name}_{args.mode}.png"), key)
  if args.each:   # the full list is in the JSON file; print the ten largest effects
    result = {k: v for k, v in result.items() if k != "each"}
    result["largest"] = sorted(rows, key=lambda r: r[key] if is_tr else -r[key])[:10]
  print(json.dumps(result))
  return 0


def _ablate_induction(run, args, out_dir: str) -> int:
  from mha_jax.analysis import report
  if not run.task.decoder_only:
    raise UserError(f"--induction-vs-random needs a language model; {args.workdir!r} has "
                     f"task {run.config.task!r}")
  rows = report.saved_or_head_roles(run, args.split)
  scores = {r["head"]: r["induction"] for r in rows if "induction" in r}
  res = importance.induction_vs_random(run, scores, top=args.top, draws=args.draws,
                                       mode=args.mode, split=args.split)
  storage.write_json(storage.join(out_dir, f"ablation_induction_{args.mode}.json"), res)
  print(json.dumps({k: res[k] for k in ("mode", "top_heads", "top_scores", "top_delta",
                                        "random_delta_mean")}))
  return 0


def _cmd_prune(args) -> int:
  hc = gates.HardConcrete(beta=args.beta, init_log_alpha=args.init_log_alpha,
                          per_layer_mean=args.per_layer_mean, binarize=args.binarize)
  out = args.out or args.workdir.rstrip("/") + f"_pruned_{args.method}"
  res = prune_run.prune(args.workdir, out, method=args.method, lam=args.l0_lambda,
                        lambdas=args.lambdas, keep=args.keep,
                        stacks=list(args.stacks), steps=args.steps,
                        lr=args.lr, finetune=args.finetune,
                        keep_one_per_layer=args.keep_one_per_layer, seed=args.seed, hc=hc,
                        bleu_limit=args.bleu_sentences)
  keys = ("kept", "kept_heads", "base", "after", "lambdas")
  print(json.dumps({k: res[k] for k in keys if k in res}))
  return 0


def _curve_options(args) -> dict:
  """The options of `prune-curve`, the same for one run and for each seed of many."""
  return dict(counts=args.counts, stacks=list(args.stacks),
              lam=args.l0_lambda, steps=args.steps, bleu_limit=args.bleu_sentences,
              random_draws=args.random_draws, save_workdirs=args.save_workdirs)


def _cmd_prune_curve_seeds(args, seeds, out: str) -> int:
  """prune-curve over a multi-seed workdir: each seed's curve into its own workdir's
  pruning_curve/ (or --out/seed_<s>), then their mean and spread into --out."""
  from mha_jax.analysis import stability
  from mha_jax.pruning import curve
  paths, metric = {}, "loss"
  for s, wd in seeds:
    seed_out = (storage.join(args.out, f"seed_{s}") if args.out else
                storage.join(wd, "pruning_curve"))
    print(f"seed {s}: pruning curve of {wd} into {seed_out} ...", flush=True)
    rows = curve.pruning_curve(wd, seed_out, log=lambda m: None, **_curve_options(args))
    metric = curve.curve_metric(rows, "bleu" in rows[0])
    paths[s] = storage.join(seed_out, "curve.json")
  rep = stability.write_curve_stability(paths, out, metric)
  print(stability.format_curve(rep))
  print(f"wrote {out}/curve_stability.json, .md, .png and each seed's curve")
  return 0


def _cmd_prune_curve(args) -> int:
  from mha_jax.pruning import curve
  out = args.out or args.workdir.rstrip("/") + "/pruning_curve"
  if storage.exists(out) and not storage.isdir(out):      # refused now, not after the work
    raise UserError(f"--out {out!r} is a file, not a folder")
  seeds = _multi_seed(args.workdir)
  if seeds:
    return _cmd_prune_curve_seeds(args, seeds, out)
  rows = curve.pruning_curve(args.workdir, out, **_curve_options(args))
  print(curve.format_curve(rows, "bleu" in rows[0]))
  print(f"wrote {out}/curve.json, curve.md, curve.png")
  return 0


def _cmd_export_pruned(args) -> int:
  info = prune_run.export(args.workdir, args.out)
  print(json.dumps({k: info[k] for k in ("head_counts", "max_abs_diff_vs_masked",
                                          "relative_diff_vs_masked", "forward_speed")}))
  return 0


def _cmd_circuits(args) -> int:
  from mha_jax.circuits import report as circuits_report
  out = _out_dir(args, "circuits")
  res = circuits_report.circuits(args.workdir, out, track=not args.no_track)
  print(circuits_report.format_summary(res))
  print(f"wrote {out}/ (circuits.json, composition.png, positivity.png, icl.png)")
  return 0


def _cmd_claims(args) -> int:
  from mha_jax.claims import run as claims_run
  rep = claims_run.run_claims(args.out, only=args.only, settings=args.settings,
                              workdir=args.workdir,
                              induction_workdir=args.induction_workdir,
                              sweep_workdir=args.sweep_workdir,
                              text_workdir=args.text_workdir,
                              voita_workdir=args.voita_workdir, toy_seeds=args.toy_seeds)
  for r in rep["claims"]:
    print(f"{r['name']}: {r['verdict']}")
  print(f"wrote {args.out}/REPORT.md, claims.json, primer.html in {rep['seconds']:.0f} s")
  return 0


def _cmd_sweep(args, extra) -> int:
  from mha_jax import sweep
  from mha_jax.train import loop
  spec = mc.resolve(args.config)
  runs = sweep.plan(spec, args.workdir, extra)
  if args.print_commands:
    print("\n".join(sweep.commands(runs)))
    return 0
  sweep.run_sweep(spec, args.workdir, extra, train_fn=loop.train)
  return 0


def _cmd_quickstart(args, extra) -> int:
  from mha_jax import quickstart
  quickstart.run(args.workdir, extra)
  return 0


def _cmd_import(args) -> int:
  from mha_jax.pretrained import importer
  cfg = importer.import_model(args.workdir, name=args.name, file=args.file, dtype=args.dtype,
                              mesh=args.mesh)
  m = cfg["model"]
  print(json.dumps({"workdir": args.workdir, "task": cfg["task"], "family": m["family"],
                    "layers": m["num_layers"], "heads": m["num_heads"],
                    "kv_heads": m.get("num_kv_heads", m["num_heads"]),
                    "d_model": m["d_model"], "source": cfg["source"]["path"]}))
  return 0


def _cmd_generate(args) -> int:
  from mha_jax.loader import load
  run = load(args.workdir)
  if not (run.task.decoder_only and not run.task.trainable):   # an imported LM
    raise UserError(f"--workdir {args.workdir!r} holds task {run.config.task!r}; generate "
                     f"needs a language model (pretrained_lm)")
  out = run.task.generate(run.params, args.prompt, args.max_new_tokens, chat=args.chat)
  print(json.dumps({"prompt": args.prompt, "chat": args.chat, "continuation": out["text"],
                    "tokens": out["tokens"]}))
  return 0


def _cmd_patch(args) -> int:
  from mha_jax.loader import load
  out = writable_out(args.out, args.workdir)
  summary = patch_run.study(load(args.workdir), out, task=args.task,
                            pairs_file=args.pairs, methods=args.method,
                            n_pairs=args.n_pairs, seed=args.seed,
                            per_position=args.per_position, receivers=args.receivers,
                            sites=args.sites, keep_failing=args.keep_failing)
  print(patch_run.format_summary(summary))
  print(f"wrote {out}/ (patching.json, dla.json, the methods' JSON, *.png, explorer.html)")
  return 0


def _cmd_circuit(args) -> int:
  from mha_jax.loader import load
  circuit_run.check(args.method, args.ablation, args.target, args.steps)
  out = writable_out(args.out, args.workdir)
  doc = circuit_run.study(load(args.workdir), out, task=args.task, pairs_file=args.pairs,
                          method=args.method, ablation=args.ablation, target=args.target,
                          n_pairs=args.n_pairs, seed=args.seed, steps=args.steps,
                          ig_on=args.ig_on, keep_failing=args.keep_failing,
                          sample=args.sample, threshold=args.threshold)
  print(circuit_run.format_summary(doc))
  print(f"wrote {out}/ (circuit.json, faithfulness.png, circuit.png)")
  return 0


# ------------------------------------------------------------------ the flags, as data

def _arg(*names: str, **kw) -> tuple:
  """One flag: add_argument's arguments, kept as data so the verb table can list it."""
  return names, kw


def _items(choices, what: str = "names") -> Callable[[str], tuple]:
  """An argparse type for comma-separated names, each one of `choices` (a tuple, or a
  function that returns one, called when a value is read): "a,b" -> ("a", "b")."""
  def parse(text: str) -> tuple:
    names = tuple(v.strip() for v in text.split(",") if v.strip())
    known = tuple(choices() if callable(choices) else choices)
    if not names:
      raise argparse.ArgumentTypeError(f"expected comma-separated {what}; got {text!r}")
    for v in names:
      if v not in known:
        raise argparse.ArgumentTypeError(
            f"invalid choice: {v!r} (choose from {', '.join(map(repr, known))})")
    return names
  return parse


def _mesh(text: str) -> str:
  """An argparse type for import --mesh: checked by train.sharding.parse_mesh."""
  from mha_jax.train import sharding
  try:
    sharding.parse_mesh(text)
  except UserError as e:
    raise argparse.ArgumentTypeError(str(e)) from None
  return text


def _claim_names() -> tuple:
  from mha_jax.claims import run as claims_run
  return tuple(claims_run.CLAIMS)


def _setting_names() -> tuple:
  from mha_jax.claims import run as claims_run
  return tuple(claims_run.SETTINGS)


DTYPES = ("float32", "bfloat16", "float16")
WORKDIR = _arg("--workdir", required=True, help="the run's folder")
SPLIT = _arg("--split", default="test", choices=SPLITS, help="the data split (default: test)")
STEP = _arg("--step", type=int, default=None, help="the checkpoint (default: the latest)")
SEED = _arg("--seed", type=int, default=0, help="the random seed (default: 0)")
STACKS = _arg("--stacks", type=_items(tuple(C.STACKS), "stacks"), default=("encoder",),
              metavar="STACK[,STACK...]",
              help=f"attention stacks, of {', '.join(C.STACKS)} (default: encoder)")


def _out(default: str) -> tuple:
  return _arg("--out", default=None, help=f"output folder (default: {default})")


def _bleu(default: int, what: str) -> tuple:
  return _arg("--bleu-sentences", type=int, default=default, help=f"{what} (0 = all)")


def _claims_args(cl: argparse.ArgumentParser) -> None:
  """The flags of `claims`, as add_argument calls (the verb grows them with the claims)."""
  cl.add_argument("--only", type=_items(_claim_names, "claim names"), default=None,
                  help="comma-separated claim names (default: all)")
  cl.add_argument("--out", default="claims")
  cl.add_argument("--workdir", default=None, help="a quickstart workdir to reuse")
  cl.add_argument("--induction-workdir", default=None,
                  help="a trained configs/induction.py workdir to reuse")
  cl.add_argument("--sweep-workdir", default=None,
                  help="a `mha-jax sweep` workdir: its loss at d_k = 1")
  cl.add_argument("--settings", type=_items(_setting_names, "settings"), default=None,
                  help="comma-separated: toy, text, smollm2, gemma3, voita, minilm "
                       "(default: toy, and text / voita when their workdir is given)")
  cl.add_argument("--text-workdir", default=None,
                  help="a trained configs/attn_only_text.py workdir (one run or seed_<s>/)")
  cl.add_argument("--voita-workdir", default=None,
                  help="a translation workdir with sinusoidal positions (one run or "
                       "seed_<s>/)")
  cl.add_argument("--toy-seeds", default="0,1,2",
                  help="the seeds the toy setting trains (default: 0,1,2)")


@dataclasses.dataclass(frozen=True)
class Verb:
  """A verb of `mha-jax`: what it does, the function it calls, its flags."""
  help: str
  func: Callable
  flags: tuple = ()            # _arg specs, in --help's order
  groups: tuple = ()           # (title, flags): a section of --help each
  methods: tuple = ()          # (method, flags only it takes), every method; --method picks
  study: bool = True           # --config FILE holds the verb's own flags
  extra: bool = False          # hands --config.KEY=VALUE to a training config (train)
  add: Callable | None = None  # flags written as add_argument calls (claims, bench)


VERBS = {
    "zoo": Verb("params, FLOPs and score memory of the model zoo", _cmd_zoo, (
        _arg("--seq-len", type=int, default=2048), _arg("--batch", type=int, default=1),
        _arg("--d-model", type=int, default=None,
             help="instead of the zoo, every h dividing this width")), study=False),
    "train": Verb("train (or resume) a run from a config file", _cmd_train, (
        _arg("--config", required=True, help="configs/FILE.py[:arg]"), WORKDIR), groups=((
            "processes", (
                _arg("--multihost", action="store_true",
                     help="call jax.distributed.initialize() and let JAX find the cluster "
                          "(Cloud TPU VM slices)"),
                _arg("--coordinator", default=None,
                     help="HOST:PORT of process 0, for a multi-process run (or "
                          "MHA_JAX_COORDINATOR)"),
                _arg("--num-processes", default=None,
                     help="number of processes (or MHA_JAX_NUM_PROCESSES)"),
                _arg("--process-id", default=None,
                     help="this process's id, 0..N-1 (or MHA_JAX_PROCESS_ID)"),
                _arg("--process-timeout", default=None,
                     help="seconds without a heartbeat after which a process counts as "
                          "lost and every other one stops (or MHA_JAX_PROCESS_TIMEOUT; "
                          "default 60)"),
                _arg("--startup-timeout", default=None,
                     help="seconds to wait for the coordinator and every process at "
                          "start-up (or MHA_JAX_STARTUP_TIMEOUT; default 300)"))),),
        study=False, extra=True),
    "eval": Verb("evaluate a run's checkpoint; prints one JSON object", _cmd_eval,
                 (WORKDIR, SPLIT, STEP)),
    "analyze": Verb("head roles, importance, ablations, plots, explorer", _cmd_analyze, (
        WORKDIR, SPLIT, STEP, _out("WORKDIR/analysis"),
        _arg("--no-ablations", action="store_true", help="skip the leave-one-out pass"),
        _arg("--roles-only", action="store_true",
             help="multi-seed workdir: each seed's head roles only (roles_only.json), "
                  "then their stability; no importance, ablations or explorer"),
        _bleu(64, "sentences for BLEU in the leave-one-out pass"),
        _arg("--conllu", default=None,
             help="imported encoders: a CoNLL-U file of sentences for syntactic roles"))),
    "ablate": Verb("evaluate a checkpoint with heads ablated", _cmd_ablate, (
        WORKDIR, _arg("--heads", default="", help="e.g. encoder.2.5,decoder_cross.0.1"),
        _arg("--each", action="store_true", help="every single-head ablation"),
        _arg("--mode", default="zero", choices=importance.MODES,
             help="an ablated head's output: 0 or its mean (default: zero)"),
        SPLIT, STEP, _out("WORKDIR/analysis")), groups=((
            "induction heads against random ones (language models)", (
                _arg("--induction-vs-random", action="store_true",
                     help="the top --top induction heads together vs --draws sets of "
                          "random heads from the same layers"),
                _arg("--top", type=int, default=5), _arg("--draws", type=int, default=5))),)),
    "prune": Verb("prune heads: L0 gates, Michel et al., or random", _cmd_prune, (
        WORKDIR, _out("WORKDIR_pruned_METHOD, a new workdir"),
        _arg("--method", default="l0", choices=prune_run.METHODS,
             help="l0: train Hard Concrete gates (Voita et al.); michel: drop the heads "
                  "of least gradient importance (Michel et al.); random (default: l0)"),
        _arg("--keep", type=int, default=None, help="end with exactly K heads"),
        STACKS, _bleu(0, "test BLEU sentences")), methods=(
            ("l0", (
                _arg("--l0-lambda", type=float, default=None,
                     help="L0 penalty (with --keep K: default 0.05, it only ranks the "
                          "heads)"),
                _arg("--lambdas", type=_float_list, default=(),
                     help="sweep lambda: one sub-workdir per value"),
                _arg("--steps", type=int, default=300, help="gate training steps"),
                _arg("--lr", type=float, default=0.05, help="gate learning rate"),
                _arg("--finetune", action="store_true", help="also train the model"),
                _arg("--beta", type=float, default=1 / 3,
                     help="the Hard Concrete temperature"),
                _arg("--init-log-alpha", type=float, default=2.0),
                _arg("--per-layer-mean", action="store_true"),
                _arg("--binarize", default="nonzero", choices=gates.BINARIZE,
                     help="a head is kept when its gate is nonzero, or above 0.5"),
                SEED)),
            ("michel", (_arg("--keep-one-per-layer", action="store_true",
                             help="never empty a layer"),)),
            ("random", (SEED,)))),
    "prune-curve": Verb("BLEU vs heads kept for l0, michel and random", _cmd_prune_curve, (
        WORKDIR, _out("WORKDIR/pruning_curve"),
        _arg("--counts", type=_int_list, default=(48, 36, 24, 12, 6, 3, 0)),
        STACKS, _bleu(0, "test BLEU sentences"),
        _arg("--random-draws", type=int, default=1,
             help="random pruning: the mean over this many random orders"),
        _arg("--save-workdirs", type=_int_list, default=(),
             help="head counts (of --counts) at which each method's pruned model is "
                  "written as OUT/{method}_k{K}, ready for export-pruned")), groups=((
            "l0 gates", (_arg("--l0-lambda", type=float, default=0.05),
                         _arg("--steps", type=int, default=200))),)),
    "export-pruned": Verb("remove pruned heads from the weights for real",
                          _cmd_export_pruned,
                          (WORKDIR, _arg("--out", required=True, help="the new workdir"))),
    "circuits": Verb("induction heads, composition, positivity, paths", _cmd_circuits, (
        WORKDIR, _arg("--no-track", action="store_true",
                      help="skip the pass over checkpoints"),
        _out("WORKDIR/circuits; a read-only workdir needs one elsewhere"))),
    "claims": Verb("measure the seed documents' claims; report + primer", _cmd_claims,
                   add=_claims_args),
    "sweep": Verb("run the runs a sweep config lists", _cmd_sweep, (
        _arg("--config", required=True), WORKDIR,
        _arg("--print-commands", action="store_true",
             help="print one `mha-jax train` command per run instead")),
        study=False, extra=True),
    "quickstart": Verb("train, evaluate and summarize the default model", _cmd_quickstart,
                       (_arg("--workdir", default="workdirs/quickstart"),),
                       study=False, extra=True),
    "import": Verb("a pretrained model as a new workdir (offline)", _cmd_import, (
        _arg("name", nargs="?", default=None, choices=tuple(registry.KNOWN),
             help="a packaged model (or give --file)"),
        _arg("--file", default=None,
             help="a GGUF file (llama, qwen2, qwen3, gemma3), or a Hugging Face folder "
                  "(config.json + model.safetensors or shards) of a family in "
                  "docs/guide/model-families.md"),
        _arg("--dtype", default="float32", choices=DTYPES,
             help="the params' dtype (bfloat16 keeps bf16 weights as they are)"),
        _arg("--mesh", default=None, type=_mesh,
             help="place the params sharded as they load: model=4 or data=2,model=4 "
                  "(heads over model; docs/guide/model-families.md)"),
        WORKDIR)),
    "generate": Verb("greedy continuation with the KV cache (imported LMs)", _cmd_generate, (
        WORKDIR, _arg("--prompt", required=True),
        _arg("--max-new-tokens", type=int, default=16),
        _arg("--chat", action="store_true", help="wrap the prompt in the chat template"))),
    "patch": Verb("activation, path and attribution patching; DLA", _cmd_patch, (
        WORKDIR, _arg("--task", choices=patch_run.TASKS, default=None),
        _arg("--pairs", default=None,
             help="a JSONL file, one {clean, corrupt, answer, wrong} a line"),
        _arg("--method", type=_items(patch_run.METHODS, "method names"),
             default=("activation", "attribution"), metavar="METHOD[,METHOD...]",
             help=f"of {', '.join(patch_run.METHODS)} (default: activation,attribution)"),
        _arg("--n-pairs", type=int, default=8, help="built-in tasks: pairs drawn"), SEED,
        _arg("--keep-failing", action="store_true",
             help="keep the pairs whose clean prompt the model gets wrong (clean logit "
                  "difference < 0; left out by default)"),
        _arg("--out", required=True, help="output folder")), methods=(
            ("activation", (
                _arg("--sites", type=_items(patch_run.SITES, "site names"),
                     default=("head_out",), metavar="SITE[,SITE...]",
                     help=f"the sweeps, of {', '.join(patch_run.SITES)} (default: "
                          f"head_out; kv: k and v per key/value head)"),
                _arg("--per-position", action="store_true",
                     help="also patch every head at every position"))),
            ("path", (_arg("--receivers", type=int, default=2,
                           help="the top heads whose q, k, v receive"),)),
            ("attribution", ()))),
    "circuit": Verb("the circuit of a behaviour: edge scores, faithfulness curve, CPR/CMD",
                    _cmd_circuit, (
        WORKDIR, _arg("--task", choices=circuit_tasks.TASKS, default=None),
        _arg("--pairs", default=None, help="a JSONL file, one {clean, corrupt, answer, "
             "wrong[, metric]} a line (metric: logit_diff or prob_diff)"),
        _arg("--method", choices=circuit_run.METHODS, default="auto",
             help="edge scores: auto (default: the most faithful of eap, eap-ig and, on "
                  "small graphs, exact, by CPR), eap, eap-ig, exact patching, or greedy "
                  "(ACDC-style pruning with exact patching; small graphs)"),
        _arg("--ablation", choices=ablations.KINDS, default="corrupt",
             help="what an edge outside the circuit carries"),
        _arg("--target", type=float, default=0.8, help="faithfulness of the node view's "
             "circuit, in (0, 1]"),
        _arg("--steps", type=int, default=5, help="EAP-IG's interpolation steps (EAP-IG "
             "is also run for the agreement report)"),
        _arg("--ig-on", choices=circuit_run.E.IG_ON, default="inputs",
             help="EAP-IG interpolates the input embedding or every edge together"),
        _arg("--sample", type=int, default=200,
             help="edges exact patching checks EAP and EAP-IG on"),
        _arg("--keep-failing", action="store_true",
             help="keep pairs whose clean prompt the model gets wrong"),
        _arg("--n-pairs", type=int, default=8, help="built-in tasks: pairs drawn"), SEED,
        _arg("--out", required=True, help="output folder")), methods=(
            ("auto", ()), ("eap", ()), ("eap-ig", ()), ("exact", ()),
            ("greedy", (_arg("--threshold", type=float, default=0.01,
                             help="an edge goes when the metric moves by less than this "
                                  "share of m(full) - m(empty)"),)))),
}
_BENCH_OUT = "results/bench_attention.json"


class _Given(argparse.Action):
  """Stores the value and records that it was given (--scale-t has other defaults)."""

  def __call__(self, parser, namespace, values, option_string=None):
    setattr(namespace, self.dest, values)
    setattr(namespace, self.dest + "_given", True)


def add_bench_attention_args(p: argparse.ArgumentParser) -> None:
  from mha_jax import bench
  p.add_argument("--d-model", type=int, default=768, action=_Given,
                 help="default 768 (512 with --scale-t)")
  p.add_argument("--seq-len", type=int, default=512)
  p.add_argument("--batch", type=int, default=4, action=_Given,
                 help="default 4 (1 with --scale-t)")
  p.add_argument("--heads", type=_int_list, default=bench.DEFAULT_HEADS, action=_Given,
                 help="comma-separated head counts (default: %(default)s; 8 with --scale-t)")
  p.add_argument("--scale-t", action="store_true",
                 help="time and peak memory against T (512 .. 32768), one capped "
                      "subprocess per implementation and T")
  p.add_argument("--seq-lens", type=_int_list, default=None,
                 help="with --scale-t: comma-separated T values")
  p.add_argument("--impls", type=_items(bench.impl_names(with_cudnn=True),
                                        "implementation names"),
                 default=None, metavar="IMPL[,IMPL...]",
                 help=f"of {', '.join(bench.impl_names(with_cudnn=True))} (default: all; "
                      f"without --scale-t the peers always run)")
  p.add_argument("--variants", action="store_true",
                 help="each attention variant's forward and forward+backward against "
                      "softmax (h = 8 unless --heads)")
  p.add_argument("--max-mem-gb", type=float, default=6.0,
                 help="with --scale-t: address-space cap per subprocess (default 6)")
  p.set_defaults(d_model_given=False, batch_given=False, heads_given=False)
  p.add_argument("--rounds", type=int, default=5)
  p.add_argument("--warmup", type=int, default=1)
  p.add_argument("--dtype", default="float32", choices=DTYPES)
  p.add_argument("--out", default=_BENCH_OUT)


BENCH = {
    "attention": Verb("this layer vs flax.linen, flax.nnx, jax.nn", _cmd_bench_attention,
                      add=add_bench_attention_args, study=False),
    "train": Verb("the quickstart model's training step, ours vs flax.linen",
                  _cmd_bench_train, (
                      _arg("--config", default="configs/translation.py:quickstart"),
                      _arg("--rounds", type=int, default=10),
                      _arg("--warmup", type=int, default=2),
                      _arg("--workdir", default="workdirs/bench_train",
                           help="where the task writes its generated data"),
                      _arg("--matmul-size", type=int, default=2048,
                           help="n of the n x n matmul that measures the machine's rate"),
                      _arg("--out", default="results/bench_train.json")),
                  study=False, extra=True),
}


# ------------------------------------------------------------------ the parser

def _add_flags(p, flags, seen: set) -> None:
  for names, kw in flags:
    if names not in seen:       # a flag two asked methods share (--seed) is added once
      seen.add(names)
      p.add_argument(*names, **kw)


def _add_verb(sub, name: str, verb: Verb, methods: Sequence[str] | None):
  """The sub-parser of `verb`, with the flags of `methods` (None: the verb's defaults;
  () with --help: none, and the help says how to see them)."""
  all_methods = dict(verb.methods)
  if methods is None:
    methods = _default_methods(verb)
  epilog = None
  if verb.methods and not methods:
    epilog = (f"Each method has its own flags: mha-jax {name} --method "
              f"{{{','.join(all_methods)}}} --help.")
  elif verb.methods:
    epilog = f"The flags of --method {','.join(methods)}; other methods take others."
  if verb.study:
    epilog = ((epilog + " ") if epilog else "") + (
        "--config FILE.py[:ARG]: these flags from a config file (keys: the flags' names, "
        "'-' written '_'); --config.KEY=VALUE overrides a key; a flag given here "
        "overrides both (docs/guide/cli.md).")
  p = sub.add_parser(name, help=verb.help, description=verb.help, epilog=epilog,
                     allow_abbrev=False)
  seen: set = set()
  _add_flags(p, verb.flags, seen)
  if verb.add:
    verb.add(p)
  for title, flags in verb.groups:
    _add_flags(p.add_argument_group(title), flags, seen)
  for m in methods:
    if all_methods[m]:
      _add_flags(p.add_argument_group(f"--method {m}"), all_methods[m], seen)
  for _, flags in verb.methods:   # the other methods' settings keep their defaults
    for names, kw in flags:
      if names not in seen:
        default = False if kw.get("action") == "store_true" else kw.get("default")
        p.set_defaults(**{names[0].lstrip("-").replace("-", "_"): default})
  if verb.study:
    p.add_argument("--config", default=None, metavar="FILE.py[:ARG]",
                   help="this verb's flags from a config file (configs/studies/)")
  p.add_argument("--compile-cache", default=None, metavar="DIR|off",
                 help="JAX's compilation cache (default: $MHA_JAX_COMPILE_CACHE, else "
                      "~/.cache/mha-jax/xla; docs/guide/performance.md)")
  p.set_defaults(func=verb.func, extra=verb.extra)
  return p


def _default_methods(verb: Verb) -> tuple:
  for names, kw in verb.flags:
    if names == ("--method",):
      d = kw["default"]
      return tuple(d) if isinstance(d, (tuple, list)) else (d,)
  return ()


def build_parser(methods: dict[str, Sequence[str]] | None = None) -> argparse.ArgumentParser:
  """The `mha-jax` parser; `methods` names the methods whose flags a verb takes (the
  verb's --method default when not named). `parser.verbs` maps each verb to its parser."""
  p = argparse.ArgumentParser(prog="mha-jax", description=__doc__.split("\n\n")[0],
                              allow_abbrev=False)
  sub = p.add_subparsers(dest="command", required=True)
  p.verbs = {name: _add_verb(sub, name, verb, (methods or {}).get(name))
             for name, verb in VERBS.items()}
  b = sub.add_parser("bench", help="benchmarks")
  bsub = b.add_subparsers(dest="bench", required=True)
  for name, verb in BENCH.items():
    _add_verb(bsub, name, verb, None)
  return p


# ------------------------------------------------------------------ config files

def _methods_asked(verb: Verb, cfg, rest: Sequence[str]) -> tuple | None:
  """The methods whose flags the verb takes: the last --method on the command line, else
  the config's `method`, else the default (None); () for --help without one."""
  if not verb.methods:
    return None
  pre = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
  pre.add_argument("--method", default=None)
  pre.add_argument("-h", "--help", action="store_true")
  known, _ = pre.parse_known_args(list(rest))
  value = known.method
  if value is None and cfg is not None and cfg.get("method") is not None:
    value = cfg.method
  if value is None:
    return () if known.help else None
  names = value.split(",") if isinstance(value, str) else list(value)
  return tuple(m.strip() for m in names if m.strip() in dict(verb.methods))


def _config_argv(cfg, parser: argparse.ArgumentParser, spec: str, where: str) -> list[str]:
  """The config's settings as the flags they stand for (so the parser checks each);
  an unknown key is refused by its name."""
  actions = {a.dest: a for a in parser._actions if a.dest not in ("help", "config")}
  argv, positional = [], []
  for key, value in cfg.items():
    if key not in actions:
      close = difflib.get_close_matches(key, list(actions), n=3)
      hint = f"; did you mean {', '.join(close)}?" if close else ""
      raise UserError(f"--config {spec}: key {key!r} is not a flag of {where}{hint} (its "
                      f"keys: {', '.join(sorted(actions))})")
    a = actions[key]
    if value is None:
      continue
    if isinstance(value, ml_collections.ConfigDict):
      raise UserError(f"--config {spec}: key {key!r} is a group; a study config is flat")
    if a.nargs == 0:     # store_true
      if not isinstance(value, bool):
        raise UserError(f"--config {spec}: key {key!r} must be true or false; got {value!r}")
      argv += [a.option_strings[0]] if value else []
      continue
    text = ",".join(map(str, value)) if isinstance(value, (list, tuple)) else str(value)
    if a.option_strings:
      argv.append(f"{a.option_strings[0]}={text}")   # "=": a value may start with "-"
    else:
      positional.append((a, text))
  for a, text in positional:    # used when the command line gives none
    parser.set_defaults(**{a.dest: text})
  return argv


def parse_args(argv: Sequence[str] | None = None) -> tuple[argparse.Namespace, list[str]]:
  """argv -> (args, the --config.KEY=VALUE a training verb hands on). A study verb reads
  --config FILE (the loader `train` uses) and its --config.KEY=VALUE overrides first, then
  the command line's flags over them."""
  argv = list(sys.argv[1:] if argv is None else argv)
  name = argv[0] if argv else None
  verb = VERBS.get(name)
  if verb is None or not verb.study:    # train, sweep, ... read --config as a training config
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and not args.extra:
      parser.error(f"unrecognized arguments: {' '.join(extra)}")
    return args, extra
  rest = argv[1:]
  pre = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
  pre.add_argument("--config", default=None)
  spec = pre.parse_known_args(rest)[0].config
  cfg = None
  if spec:
    cfg = mc.load_config(spec, training=False)
    rest = mc.apply_overrides(cfg, rest)
  else:
    given = [a for a in rest if a.startswith("--config.")]
    if given:
      raise UserError(f"{given[0]} overrides a key of --config FILE; none given")
  methods = _methods_asked(verb, cfg, rest)
  parser = build_parser({name: methods} if methods is not None else None)
  file_argv = []
  if cfg is not None:
    where = f"`mha-jax {name}" + (f" --method {','.join(methods)}`" if methods else "`")
    file_argv = _config_argv(cfg, parser.verbs[name], spec, where)
  args, unknown = parser.parse_known_args([name, *file_argv, *rest])
  if unknown:
    flags = {u.split("=")[0] for u in unknown}
    owners = sorted({m for m, fl in verb.methods for names, _ in fl if flags & set(names)})
    hint = f" (flags of --method {' or '.join(owners)})" if owners else ""
    parser.verbs[name].error(f"unrecognized arguments: {' '.join(unknown)}{hint}")
  return args, []


# The range of every numeric flag, by its argparse dest (the same meaning in every
# command that has it): (lo, hi, lo_open, hi_open, note), as config.RANGES.
FLAG_RANGES = {
    "seq_len": (1, None, False, False, ""), "batch": (1, None, False, False, ""),
    "d_model": (1, None, False, False, ""), "step": (0, None, False, False, ""),
    "bleu_sentences": (0, None, False, False, " (0 = all)"),
    "top": (1, None, False, False, ""), "draws": (1, None, False, False, ""),
    "l0_lambda": (0, None, False, False, ""), "lambdas": (0, None, False, False, ""),
    "steps": (1, None, False, False, ""),   # prune --keep: checked against the heads
    "lr": (0, None, True, False, ""), "beta": (0, None, True, False, ""),
    "seed": (0, None, False, False, ""), "counts": (0, None, False, False, ""),
    "random_draws": (1, None, False, False, ""),
    "save_workdirs": (0, None, False, False, ""),
    "max_new_tokens": (1, None, False, False, ""), "rounds": (1, None, False, False, ""),
    "warmup": (0, None, False, False, ""), "heads": (1, None, False, False, ""),
    "seq_lens": (1, None, False, False, ""), "max_mem_gb": (0, None, True, False, ""),
    "matmul_size": (1, None, False, False, ""),
}
# Flags naming a folder or file: never empty (`--workdir ''` would be the current folder).
PATH_FLAGS = ("workdir", "out", "file", "config", "conllu", "induction_workdir",
              "sweep_workdir")


def check_flags(args) -> None:
  """Every numeric flag within its range (FLAG_RANGES) and no empty path, before any
  work is done; errors name the flag and the value."""
  import math
  for dest, (lo, hi, lo_open, hi_open, note) in FLAG_RANGES.items():
    value = getattr(args, dest, None)
    flag = "--" + dest.replace("_", "-")
    for v in (value if isinstance(value, (tuple, list)) else [value]):
      if v is None or isinstance(v, str):   # ablate --heads names heads, bench's counts
        continue
      if isinstance(v, float) and not math.isfinite(v):
        raise UserError(f"{flag} must be a finite number; got {v!r}")
      mc.check_range(flag, v, lo, hi, lo_open=lo_open, hi_open=hi_open, note=note)
  for dest in PATH_FLAGS:
    v = getattr(args, dest, None)
    if isinstance(v, str) and not v.strip():
      raise UserError(f"--{dest.replace('_', '-')} must name a folder or file; got {v!r}")


def main(argv=None) -> int:
  """Runs one verb; returns the exit status (2: bad input, said in one line)."""
  try:
    args, extra = parse_args(argv)
  except SystemExit as e:    # argparse: --help (0) or a usage error (2), printed already
    return e.code if isinstance(e.code, int) else 0
  except UserError as e:
    print(f"mha-jax: error: {e}", file=sys.stderr)
    return 2
  try:
    check_flags(args)
    from mha_jax import compile_cache
    compile_cache.enable(args.compile_cache)
    return args.func(args, extra) if args.extra else args.func(args)
  except UserError as e:     # bad input: one line. Anything else is a bug: its traceback.
    print(f"mha-jax: error: {e}", file=sys.stderr)
    return 2


if __name__ == "__main__":
  sys.exit(main())
