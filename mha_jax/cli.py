"""The `mha-jax` command."""

from __future__ import annotations

import argparse
import json
import sys

from mha_jax import storage
from mha_jax.errors import UserError


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
  from mha_jax import config as mc
  from mha_jax.train import loop
  from mha_jax.train import distributed
  distributed.initialize(args.coordinator, args.num_processes, args.process_id,
                         auto=args.multihost)
  cfg = mc.load_config(args.config)
  rest = mc.apply_overrides(cfg, extra)
  if rest:
    raise UserError(f"unrecognized arguments: {' '.join(rest)}")
  try:
    summary = loop.train(cfg, args.workdir)
  except loop.TrainingDiverged as e:
    print(f"mha-jax: {e}", file=sys.stderr)
    return 1
  print(json.dumps(summary))
  return 0


def _cmd_eval(args) -> int:
  from mha_jax.loader import load
  check_split(args.split)
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
  check_split(args.split)
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
  from mha_jax.analysis import importance, report
  from mha_jax.loader import load
  if args.mode not in ("zero", "mean"):
    raise UserError(f"--mode must be 'zero' or 'mean'; got {args.mode!r}")
  check_split(args.split)
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
  from mha_jax.analysis import importance, report
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
  from mha_jax.pruning import gates, run as prune_run
  hc = gates.HardConcrete(beta=args.beta, init_log_alpha=args.init_log_alpha,
                          per_layer_mean=args.per_layer_mean, binarize=args.binarize)
  out = args.out or args.workdir.rstrip("/") + f"_pruned_{args.method}"
  res = prune_run.prune(args.workdir, out, method=args.method, lam=args.l0_lambda,
                        lambdas=args.lambdas, keep=args.keep,
                        stacks=[s for s in args.stacks.split(",") if s], steps=args.steps,
                        lr=args.lr, finetune=args.finetune,
                        keep_one_per_layer=args.keep_one_per_layer, seed=args.seed, hc=hc,
                        bleu_limit=args.bleu_sentences)
  keys = ("kept", "kept_heads", "base", "after", "lambdas")
  print(json.dumps({k: res[k] for k in keys if k in res}))
  return 0


def _curve_options(args) -> dict:
  """The options of `prune-curve`, the same for one run and for each seed of many."""
  return dict(counts=args.counts, stacks=[s for s in args.stacks.split(",") if s],
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
  from mha_jax.pruning import run as prune_run
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
  rep = claims_run.run_claims(args.out, only=args.only, workdir=args.workdir,
                              induction_workdir=args.induction_workdir,
                              sweep_workdir=args.sweep_workdir)
  for r in rep["claims"]:
    print(f"{r['verdict']:>14}  {r['name']}")
  print(f"wrote {args.out}/REPORT.md, claims.json, primer.html in {rep['seconds']:.0f} s")
  return 0


def _cmd_sweep(args, extra) -> int:
  from mha_jax import sweep
  from mha_jax.train import loop
  from mha_jax import config as mc
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
  from mha_jax.patching import run as patch_run
  out = writable_out(args.out, args.workdir)
  summary = patch_run.study(load(args.workdir), out, task=args.task,
                            pairs_file=args.pairs, methods=args.method,
                            n_pairs=args.n_pairs, seed=args.seed,
                            per_position=args.per_position, receivers=args.receivers)
  print(patch_run.format_summary(summary))
  print(f"wrote {out}/ (patching.json, dla.json, the methods' JSON, *.png)")
  return 0


def build_parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(prog="mha-jax", description=__doc__, allow_abbrev=False)
  sub = p.add_subparsers(dest="command", required=True)

  z = sub.add_parser("zoo", help="params, FLOPs and score memory of the model zoo")
  z.add_argument("--seq-len", type=int, default=2048)
  z.add_argument("--batch", type=int, default=1)
  z.add_argument("--d-model", type=int, default=None,
                 help="instead of the zoo, every h dividing this width")
  z.set_defaults(func=_cmd_zoo)

  t = sub.add_parser("train", help="train (or resume) a run from a config file")
  t.add_argument("--config", required=True, help="configs/FILE.py[:arg]")
  t.add_argument("--workdir", required=True)
  t.add_argument("--multihost", action="store_true",
                 help="call jax.distributed.initialize() and let JAX find the cluster "
                      "(Cloud TPU VM slices)")
  t.add_argument("--coordinator", default=None,
                 help="HOST:PORT of process 0, for a multi-process run (or "
                      "MHA_JAX_COORDINATOR)")
  t.add_argument("--num-processes", default=None,
                 help="number of processes (or MHA_JAX_NUM_PROCESSES)")
  t.add_argument("--process-id", default=None,
                 help="this process's id, 0..N-1 (or MHA_JAX_PROCESS_ID)")
  t.set_defaults(func=_cmd_train, extra=True)

  e = sub.add_parser("eval", help="evaluate a run's checkpoint; prints one JSON object")
  e.add_argument("--workdir", required=True)
  e.add_argument("--split", default="test")
  e.add_argument("--step", type=int, default=None)
  e.set_defaults(func=_cmd_eval)

  a = sub.add_parser("analyze", help="head roles, importance, ablations, plots, explorer")
  a.add_argument("--workdir", required=True)
  a.add_argument("--split", default="test")
  a.add_argument("--step", type=int, default=None)
  a.add_argument("--no-ablations", action="store_true", help="skip the leave-one-out pass")
  a.add_argument("--roles-only", action="store_true",
                 help="multi-seed workdir: each seed's head roles only (roles_only.json), "
                      "then their stability; no importance, ablations or explorer")
  a.add_argument("--out", default=None, help="output folder (default: WORKDIR/analysis)")
  a.add_argument("--bleu-sentences", type=int, default=64,
                 help="sentences for BLEU in the leave-one-out pass (0 = all)")
  a.add_argument("--conllu", default=None,
                 help="imported encoders: a CoNLL-U file of sentences for syntactic roles")
  a.set_defaults(func=_cmd_analyze)

  ab = sub.add_parser("ablate", help="evaluate a checkpoint with heads ablated")
  ab.add_argument("--workdir", required=True)
  ab.add_argument("--heads", default="", help="e.g. encoder.2.5,decoder_cross.0.1")
  ab.add_argument("--mode", default="zero", help="zero or mean")
  ab.add_argument("--each", action="store_true", help="every single-head ablation")
  ab.add_argument("--induction-vs-random", action="store_true",
                  help="LM: the top --top induction heads together vs --draws sets of "
                       "random heads from the same layers")
  ab.add_argument("--top", type=int, default=5)
  ab.add_argument("--draws", type=int, default=5)
  ab.add_argument("--split", default="test")
  ab.add_argument("--step", type=int, default=None)
  ab.add_argument("--out", default=None, help="output folder (default: WORKDIR/analysis)")
  ab.set_defaults(func=_cmd_ablate)

  pr = sub.add_parser("prune", help="prune heads: L0 gates, Michel et al., or random")
  pr.add_argument("--workdir", required=True)
  pr.add_argument("--out", default=None, help="new workdir (default: WORKDIR_pruned_METHOD)")
  pr.add_argument("--method", default="l0", help="l0, michel or random")
  pr.add_argument("--l0-lambda", type=float, default=None,
                  help="L0 penalty (with --keep K: default 0.05, it only ranks the heads)")
  pr.add_argument("--lambdas", type=_float_list, default=(),
                  help="sweep lambda: one sub-workdir per value")
  pr.add_argument("--keep", type=int, default=None, help="end with exactly K heads")
  pr.add_argument("--stacks", default="encoder",
                  help="comma-separated: encoder, decoder_self, decoder_cross, lm")
  pr.add_argument("--steps", type=int, default=300, help="gate training steps (l0)")
  pr.add_argument("--lr", type=float, default=0.05, help="gate learning rate (l0)")
  pr.add_argument("--finetune", action="store_true", help="also train the model (l0)")
  pr.add_argument("--beta", type=float, default=1 / 3)
  pr.add_argument("--init-log-alpha", type=float, default=2.0)
  pr.add_argument("--per-layer-mean", action="store_true")
  pr.add_argument("--binarize", default="nonzero", help="nonzero or threshold")
  pr.add_argument("--keep-one-per-layer", action="store_true", help="michel: never empty a layer")
  pr.add_argument("--seed", type=int, default=0)
  pr.add_argument("--bleu-sentences", type=int, default=0, help="test BLEU sentences (0 = all)")
  pr.set_defaults(func=_cmd_prune)

  pc = sub.add_parser("prune-curve", help="BLEU vs heads kept for l0, michel and random")
  pc.add_argument("--workdir", required=True)
  pc.add_argument("--out", default=None, help="default: WORKDIR/pruning_curve")
  pc.add_argument("--counts", type=_int_list, default=(48, 36, 24, 12, 6, 3, 0))
  pc.add_argument("--stacks", default="encoder")
  pc.add_argument("--l0-lambda", type=float, default=0.05)
  pc.add_argument("--steps", type=int, default=200)
  pc.add_argument("--bleu-sentences", type=int, default=0)
  pc.add_argument("--random-draws", type=int, default=1,
                  help="random pruning: the mean over this many random orders")
  pc.add_argument("--save-workdirs", type=_int_list, default=(),
                  help="head counts (of --counts) at which each method's pruned model is "
                       "written as OUT/{method}_k{K}, ready for export-pruned")
  pc.set_defaults(func=_cmd_prune_curve)

  ex = sub.add_parser("export-pruned", help="remove pruned heads from the weights for real")
  ex.add_argument("--workdir", required=True)
  ex.add_argument("--out", required=True)
  ex.set_defaults(func=_cmd_export_pruned)

  ci = sub.add_parser("circuits", help="induction heads, composition, positivity, paths")
  ci.add_argument("--workdir", required=True)
  ci.add_argument("--no-track", action="store_true", help="skip the pass over checkpoints")
  ci.add_argument("--out", default=None,
                  help="output folder (default: WORKDIR/circuits; a read-only workdir "
                       "needs one elsewhere)")
  ci.set_defaults(func=_cmd_circuits)

  cl = sub.add_parser("claims", help="measure the seed documents' claims; report + primer")
  cl.add_argument("--only", default=None, help="comma-separated claim names")
  cl.add_argument("--out", default="claims")
  cl.add_argument("--workdir", default=None, help="a quickstart workdir to reuse")
  cl.add_argument("--induction-workdir", default=None,
                  help="a trained configs/induction.py workdir to reuse")
  cl.add_argument("--sweep-workdir", default=None,
                  help="a `mha-jax sweep` workdir: its loss at d_k = 1")
  cl.set_defaults(func=_cmd_claims)

  sw = sub.add_parser("sweep", help="run the runs a sweep config lists")
  sw.add_argument("--config", required=True)
  sw.add_argument("--workdir", required=True)
  sw.add_argument("--print-commands", action="store_true",
                  help="print one `mha-jax train` command per run instead")
  sw.set_defaults(func=_cmd_sweep, extra=True)

  q = sub.add_parser("quickstart", help="train, evaluate and summarize the default model")
  q.add_argument("--workdir", default="workdirs/quickstart")
  q.set_defaults(func=_cmd_quickstart, extra=True)

  im = sub.add_parser("import", help="a pretrained model as a new workdir (offline)")
  im.add_argument("name", nargs="?", default=None,
                  help="smollm2-135m, minilm-l6 or gemma3-270m")
  im.add_argument("--file", default=None,
                  help="a GGUF file (llama, qwen2, qwen3, gemma3), or a Hugging Face folder "
                       "(config.json + model.safetensors or shards) of a family in "
                       "docs/guide/model-families.md")
  im.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"),
                  help="the params' dtype (bfloat16 keeps bf16 weights as they are)")
  im.add_argument("--mesh", default=None,
                  help="place the params sharded as they load: model=4 or data=2,model=4 "
                       "(heads over model; docs/guide/model-families.md)")
  im.add_argument("--workdir", required=True)
  im.set_defaults(func=_cmd_import)

  g = sub.add_parser("generate", help="greedy continuation with the KV cache (imported LMs)")
  g.add_argument("--workdir", required=True)
  g.add_argument("--prompt", required=True)
  g.add_argument("--max-new-tokens", type=int, default=16)
  g.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
  g.set_defaults(func=_cmd_generate)

  pa = sub.add_parser("patch", help="activation, path and attribution patching; DLA")
  pa.add_argument("--workdir", required=True)
  pa.add_argument("--task", choices=("ioi", "induction"), default=None)
  pa.add_argument("--pairs", default=None, help="a JSONL file, one {clean, corrupt, "
                  "answer, wrong} a line")
  pa.add_argument("--method", type=_list_of(str, "method names"),
                  default=("activation", "attribution"),
                  help="comma-separated: activation, path, attribution (default: "
                       "activation,attribution)")
  pa.add_argument("--n-pairs", type=int, default=8, help="built-in tasks: pairs drawn")
  pa.add_argument("--seed", type=int, default=0)
  pa.add_argument("--per-position", action="store_true",
                  help="also patch every head at every position")
  pa.add_argument("--receivers", type=int, default=2,
                  help="path patching: the top heads whose q, k, v receive")
  pa.add_argument("--out", required=True)
  pa.set_defaults(func=_cmd_patch)

  b = sub.add_parser("bench", help="benchmarks")
  bsub = b.add_subparsers(dest="bench", required=True)
  ba = bsub.add_parser("attention", help="this layer vs flax.linen, flax.nnx, jax.nn")
  add_bench_attention_args(ba)
  ba.set_defaults(func=_cmd_bench_attention)
  bt = bsub.add_parser("train", help="the quickstart model's training step, ours vs flax.linen")
  bt.add_argument("--config", default="configs/translation.py:quickstart")
  bt.add_argument("--rounds", type=int, default=10)
  bt.add_argument("--warmup", type=int, default=2)
  bt.add_argument("--workdir", default="workdirs/bench_train",
                  help="where the task writes its generated data")
  bt.add_argument("--matmul-size", type=int, default=2048,
                  help="n of the n x n matmul that measures the machine's rate")
  bt.add_argument("--out", default="results/bench_train.json")
  bt.set_defaults(func=_cmd_bench_train, extra=True)
  return p


_BENCH_OUT = "results/bench_attention.json"


class _Given(argparse.Action):
  """Stores the value and records that it was given (--scale-t has other defaults)."""

  def __call__(self, parser, namespace, values, option_string=None):
    setattr(namespace, self.dest, values)
    setattr(namespace, self.dest + "_given", True)


def add_bench_attention_args(p: argparse.ArgumentParser) -> None:
  from mha_jax.bench import DEFAULT_HEADS
  p.add_argument("--d-model", type=int, default=768, action=_Given,
                 help="default 768 (512 with --scale-t)")
  p.add_argument("--seq-len", type=int, default=512)
  p.add_argument("--batch", type=int, default=4, action=_Given,
                 help="default 4 (1 with --scale-t)")
  p.add_argument("--heads", type=_int_list, default=DEFAULT_HEADS, action=_Given,
                 help="comma-separated head counts (default: %(default)s; 8 with --scale-t)")
  p.add_argument("--scale-t", action="store_true",
                 help="time and peak memory against T (512 .. 32768), one capped "
                      "subprocess per implementation and T")
  p.add_argument("--seq-lens", type=_int_list, default=None,
                 help="with --scale-t: comma-separated T values")
  p.add_argument("--impls", type=lambda s: [x.strip() for x in s.split(",") if x.strip()],
                 default=None, help="comma-separated implementation names (default: all; "
                 "without --scale-t the peers always run)")
  p.add_argument("--max-mem-gb", type=float, default=6.0,
                 help="with --scale-t: address-space cap per subprocess (default 6)")
  p.set_defaults(d_model_given=False, batch_given=False, heads_given=False)
  p.add_argument("--rounds", type=int, default=5)
  p.add_argument("--warmup", type=int, default=1)
  p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
  p.add_argument("--out", default=_BENCH_OUT)


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
  from mha_jax import config as mc
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


def check_split(split: str) -> None:
  from mha_jax.tasks import check_split as check
  try:
    check(split)
  except UserError:
    raise UserError(f"--split must be train, valid or test; got {split!r}") from None


def main(argv=None) -> int:
  parser = build_parser()
  args, extra = parser.parse_known_args(argv)
  if extra and not getattr(args, "extra", False):
    parser.error(f"unrecognized arguments: {' '.join(extra)}")
  try:
    check_flags(args)
    return args.func(args, extra) if getattr(args, "extra", False) else args.func(args)
  except UserError as e:     # bad input: one line. Anything else is a bug: its traceback.
    print(f"mha-jax: error: {e}", file=sys.stderr)
    return 2


if __name__ == "__main__":
  sys.exit(main())
