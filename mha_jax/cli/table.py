"""The verbs: the table VERBS (name -> Verb) and BENCH (`mha-jax bench NAME`), the
experiment harness's added through HARNESS. A study verb is one `study_verb` entry (the
runner loads the run, checks --out and prints); the other verbs' calls are below."""

from __future__ import annotations

import importlib
import json
import os
import sys

from mha_jax import accounting, compare_runs, storage, sweep as sweep_lib
from mha_jax import config as mc
from mha_jax import over_seeds, plan as plan_lib
from mha_jax.analysis import ablate as ablate_lib, analyze as analysis_report
from mha_jax.roles import role_steps as role_steps_lib
from mha_jax.roles import taxonomy as taxonomy_lib
from mha_jax.circuits import circuit as circuit_lib, induction_circuits as circuits_report
from mha_jax.cli import outputs
from mha_jax.cli.runner import Study, study_verb
from mha_jax.cli.verb import STEP, WORKDIR, Verb, flagged, input_spec, out_spec
from mha_jax.errors import UserError
from mha_jax.patching import patch as patch_lib, patch_explorer
from mha_jax.pretrained import importer
from mha_jax.pruning import prune as prune_lib, prune_curve as curve_lib
from mha_jax.tasks import pretrained_lm
from mha_jax.tasks.base import EvalOptions
from mha_jax.train import distributed

DESCRIPTION = "mha-jax: train, study and benchmark multi-head attention (one verb per job)."

# The experiment harness (claims, benchmarks: mha_jax/harness/) adds its verbs
# through this one module, `VERBS` and `BENCH` tables of `Verb`; the library never
# imports it otherwise (tests/docs/test_architecture.py checks this edge).
HARNESS = "mha_jax.harness.verbs"


def _json(obj) -> int:
  print(json.dumps(obj))
  return 0


def _keys(*names):
  """show: the result's `names` (those it has) as one line of JSON."""
  return lambda res, out, opts: json.dumps({k: res[k] for k in names if k in res})


def _analyze_check(workdir, out, opts):
  if opts.roles_only and not outputs.is_multi_seed(workdir):
    raise UserError(f"--roles-only is for a multi-seed workdir; {workdir!r} is one run")
  return outputs.writable_out(out, workdir)


def _curve_check(workdir, out, opts):
  curve_lib.check_out(workdir, out)      # refused now, not after the work
  return out


def _export_check(workdir, out, opts):
  prune_lib.check_export(workdir, out)   # refused before the load
  return out


def _patch_files(res, out, opts) -> str:
  extra = {"dla": ", dla.json", "explorer": ", explorer.html"}
  return (f"{patch_lib.format_summary(res)}\nwrote {out}/ (patching.json, the methods' "
          f"JSON, *.png{''.join(extra.get(o, '') for o in opts.outputs)})")


def _curve_files(rows, out, opts) -> str:
  return (f"{curve_lib.format_curve(rows, 'bleu' in rows[0])}\nwrote {out}/curve.json, "
          f"curve.md, curve.png")


def _summary(module, files: str, seconds: bool = False):
  """show: `module.format_summary(result)`, then the files written (and the time)."""
  def show(res, out, opts):
    took = f" in {res['seconds']['this_run']:.0f} s" if seconds else ""
    return f"{module.format_summary(res)}\nwrote {out}/ ({files}){took}"
  return show


STUDIES = {
    "analyze": Study(analysis_report.analyze, out="analysis", check=_analyze_check,
                     seeds=over_seeds.ANALYZE,
                     show=lambda res, out, opts: f"{json.dumps(res, indent=1)}\nwrote "
                     f"{out}/ (heads.json, heads.csv, *.png, explorer.html)"),
    "ablate": Study(ablate_lib.ablate, out="analysis",
                    show=lambda res, out, opts: json.dumps(res)),
    "prune": Study(prune_lib.prune, out=prune_lib.default_out,
                   check=lambda workdir, out, opts: out,
                   show=_keys("kept", "kept_heads", "base", "after", "lambdas")),
    "prune-curve": Study(curve_lib.prune_curve, out="pruning_curve", check=_curve_check,
                         seeds=over_seeds.CURVE,
                         show=_curve_files),
    "export-pruned": Study(prune_lib.export_pruned, check=_export_check,
                           show=_keys("head_counts", "max_abs_diff_vs_masked",
                                      "relative_diff_vs_masked", "forward_speed")),
    "circuits": Study(circuits_report.circuits, out="circuits", show=lambda res, out, opts:
                      _summary(circuits_report, "circuits.json, induction.png"
                               if "top_induction_heads" in res else "circuits.json, "
                               "composition.png, positivity.png, icl.png")(res, out, opts)),
    "role-steps": Study(role_steps_lib.role_steps, out="role_steps", show=_summary(
        role_steps_lib, "role_steps.json, role_steps.png", seconds=True)),
    "taxonomy": Study(taxonomy_lib.taxonomy, out="taxonomy", show=lambda res, out, opts:
                      f"{taxonomy_lib.format_summary(res)}\nwrote {out}/ (roles.json, "
                      f"taxonomy.png)"),
    "patch": Study(patch_lib.patch, show=_patch_files),
    "circuit": Study(circuit_lib.circuit, show=_summary(
        circuit_lib, "circuit.json, faithfulness.png, circuit.png")),
}


# ------------------------------------------------------------------ the other verbs' calls

def _zoo(args, opts: accounting.ZooOptions) -> int:
  print(accounting.zoo(opts))
  return 0


def _train(args, opts: distributed.TrainOptions) -> int:
  from mha_jax.train import loop
  many = distributed.initialize(opts.coordinator, opts.num_processes, opts.process_id,
                                auto=opts.multihost, process_timeout=opts.process_timeout,
                                startup_timeout=opts.startup_timeout,
                                step_timeout=opts.step_timeout)
  try:
    cfg = mc.load_config(args.config)
    rest = mc.apply_overrides(cfg, args.extra)
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
    text = flagged(e) if isinstance(e, UserError) else str(e)
    print(f"mha-jax: {'error: ' if isinstance(e, UserError) else ''}{text}", file=sys.stderr,
          flush=True)
    distributed.finish(text)
    sys.stdout.flush()
    os._exit(2 if isinstance(e, UserError) else 1)
  except Exception as e:   # noqa: BLE001 - several processes: see distributed.failed
    if not many:
      raise
    distributed.failed(e)
  distributed.finish()
  return _json(summary)


def _eval(args, opts: EvalOptions) -> int:
  if outputs.is_multi_seed(args.workdir):   # one line per seed, then mean and std
    print(over_seeds.over_seeds(over_seeds.EVAL, args.workdir, None, opts, step=args.step,
                                log=lambda m: print(m, flush=True)))
    return 0
  loaded = outputs.load(args)
  return _json({"workdir": args.workdir, "step": loaded.step, "split": opts.split,
                **over_seeds.evaluate(loaded, opts)})


def _patch_explorer(args, opts: patch_explorer.ExplorerOptions) -> int:
  patch_explorer.patching_data(args.out)       # its files checked before the run is loaded
  loaded = outputs.load(args) if args.workdir else None
  print(patch_explorer.rewrite(loaded, args.out, opts))
  return 0


def _compare_runs(args, opts: compare_runs.CompareOptions) -> int:
  out = args.out or storage.join(args.dirs[0], "compare")
  compare_runs.compare_runs(args.dirs, out, opts)
  print(f"wrote {out}/ (compare.json, compare.md, compare.png)")
  return 0


def _sweep(args, opts: sweep_lib.SweepOptions) -> int:
  from mha_jax.train import loop
  spec = mc.resolve(args.config)
  runs = sweep_lib.plan(spec, args.workdir, args.extra)
  if opts.print_commands:
    print("\n".join(sweep_lib.commands(runs)))
    return 0
  sweep_lib.run_sweep(spec, args.workdir, args.extra, train_fn=loop.train)
  return 0


def _quickstart(args, opts) -> int:
  from mha_jax import quickstart
  quickstart.quickstart(args.workdir, args.extra)
  return 0


def _import(args, opts: importer.ImportOptions) -> int:
  cfg = importer.import_model(args.workdir, name=opts.name, file=opts.file, dtype=opts.dtype,
                              mesh=opts.mesh)
  m = cfg["model"]
  return _json({"workdir": args.workdir, "task": cfg["task"], "family": m["family"],
                "layers": m["num_layers"], "heads": m["num_heads"],
                "kv_heads": m.get("num_kv_heads", m["num_heads"]),
                "d_model": m["d_model"], "source": cfg["source"]["path"]})


def _generate(args, opts: pretrained_lm.GenerateOptions) -> int:
  loaded = outputs.load(args)
  if not (loaded.task.decoder_only and not loaded.task.trainable):   # an imported LM
    from mha_jax import loader
    loader.refuse("generate", loaded.workdir, "an imported decoder LM (its tokenizer turns "
                  "text into tokens and back)")
  out = loaded.task.generate(loaded.params, opts.prompt, opts.max_new_tokens, chat=opts.chat)
  return _json({"prompt": opts.prompt, "chat": opts.chat, "continuation": out["text"],
                "tokens": out["tokens"]})


def _plan(args, opts: plan_lib.PlanOptions) -> int:
  topo = plan_lib.topology(opts.topology)    # before JAX starts: cpu:N asks for N devices
  out = outputs.writable_out(args.out)
  doc = plan_lib.make_plan(opts, config=args.config, overrides=args.extra,
                           workdir=args.workdir, topo=topo)
  print(plan_lib.format_plan(doc))
  print(f"wrote {plan_lib.write_plan(doc, out)}")
  return 0


# ------------------------------------------------------------------ the table

def _read_only(where: str) -> str:
  return f"{where}; a read-only workdir needs one elsewhere"


TRAIN_CONFIG = input_spec("config", "configs/FILE.py[:arg]", required=True)
VERBS = {
    "zoo": Verb("params, FLOPs and score memory of the model zoo", _zoo,
                accounting.ZooOptions, config=None),
    "train": Verb("train (or resume) a run from a config file", _train,
                  distributed.TrainOptions, (TRAIN_CONFIG, WORKDIR), config="training"),
    "eval": Verb("evaluate a run's checkpoint; prints one JSON object", _eval, EvalOptions,
                 (WORKDIR, STEP)),
    "analyze": study_verb("head roles, importance, ablations, plots, explorer",
                          STUDIES["analyze"], analysis_report.AnalyzeOptions,
                          (WORKDIR, STEP, out_spec("WORKDIR/analysis"))),
    "ablate": study_verb("evaluate a checkpoint with heads ablated", STUDIES["ablate"],
                         ablate_lib.AblateOptions,
                         (WORKDIR, STEP, out_spec("WORKDIR/analysis"))),
    "prune": study_verb("prune heads: L0 gates, Michel et al., or random",
                        STUDIES["prune"], prune_lib.PruneOptions,
                        (WORKDIR, out_spec("WORKDIR_pruned_METHOD, a new workdir"))),
    "prune-curve": study_verb("BLEU vs heads kept for l0, michel and random",
                              STUDIES["prune-curve"], curve_lib.CurveOptions,
                              (WORKDIR, out_spec("WORKDIR/pruning_curve"))),
    "export-pruned": study_verb("remove pruned heads from the weights for real",
                                STUDIES["export-pruned"], prune_lib.ExportOptions,
                                (WORKDIR, input_spec("out", "the new workdir",
                                                     required=True))),
    "circuits": study_verb("induction heads, composition, positivity, paths",
                           STUDIES["circuits"], circuits_report.CircuitsOptions,
                           (WORKDIR, out_spec(_read_only("WORKDIR/circuits")))),
    "role-steps": study_verb("the step at which each head role appears over a run's "
                             "checkpoints", STUDIES["role-steps"],
                             role_steps_lib.RoleStepsOptions,
                             (WORKDIR, out_spec(_read_only("WORKDIR/role_steps")))),
    "taxonomy": study_verb("every head of a decoder LM named by its role, each role "
                           "checked causally", STUDIES["taxonomy"],
                           taxonomy_lib.TaxonomyOptions,
                           (WORKDIR, out_spec(_read_only("WORKDIR/taxonomy")))),
    "sweep": Verb("run the runs a sweep config lists", _sweep, sweep_lib.SweepOptions,
                  (input_spec("config", "a sweep config", required=True), WORKDIR),
                  config="training"),
    "quickstart": Verb("train, evaluate and summarize the default model", _quickstart,
                       inputs=(input_spec("workdir", "the run's folder",
                                          "workdirs/quickstart"),), config="training"),
    "import": Verb("a pretrained model as a new workdir (offline)", _import,
                   importer.ImportOptions, (WORKDIR,)),
    "generate": Verb("greedy continuation with the KV cache (imported LMs)", _generate,
                     pretrained_lm.GenerateOptions, (WORKDIR,)),
    "patch": study_verb("activation, path and attribution patching; DLA", STUDIES["patch"],
                        patch_lib.PatchOptions, (WORKDIR, out_spec(None))),
    "patch-explorer": Verb("(re)write a patch result's explorer.html from its JSON",
                           _patch_explorer, patch_explorer.ExplorerOptions,
                           (input_spec("out", "the patch result's folder", required=True),
                            input_spec("workdir", "the run it patched: also the attention "
                                       "view of its first pairs"))),
    "circuit": study_verb("the circuit of a behaviour: edge scores, faithfulness curve, "
                          "CPR/CMD", STUDIES["circuit"], circuit_lib.CircuitOptions,
                          (WORKDIR, out_spec(None))),
    "compare-runs": Verb("table a sweep's runs (h x variant): loss, sinks, roles, induction, "
                         "pruning", _compare_runs, compare_runs.CompareOptions,
                         (input_spec("dirs", "sweep workdirs (one workdir per point), "
                                     "multi-seed or run workdirs", required=True,
                                     many=True, positional=True, metavar="DIR"),
                          out_spec("DIR/compare")), config=None),
    "plan": Verb("compile a job ahead of time for a TPU topology or cpu:N: memory, FLOPs, "
                 "kernels and time per device (no weights, no accelerator)", _plan,
                 plan_lib.PlanOptions,
                 (input_spec("config", "a training config configs/FILE.py[:arg] "
                             "(or --hf-config, or --workdir)"),
                  input_spec("workdir", "a run's folder (its config and its "
                             "checkpoint's shapes)"), out_spec(None)),
                 config="training"),
}
BENCH: dict[str, Verb] = {}


def harness() -> None:
  """Adds the experiment harness's verbs (claims, primer, bench ...), once."""
  if getattr(harness, "done", False):
    return
  harness.done = True
  try:
    mod = importlib.import_module(HARNESS)
  except ModuleNotFoundError as e:     # the library without its harness (not installed)
    if e.name not in (HARNESS, HARNESS.split(".")[0]):
      raise
    return
  VERBS.update(mod.VERBS)
  BENCH.update(mod.BENCH)
