"""mha-jax: train, study and benchmark multi-head attention (one verb per job).

Every verb's flags are generated from dataclasses of settings (`mha_jax.settings`): a
study's options (`analysis.analyze.AnalyzeOptions`, `pruning.prune.PruneOptions`, ...) and
the verb's inputs (`--workdir`, `--step`, `--out`). A setting's flag is its name with `-`
for `_` (`bleu_limit` is `--bleu-limit`); its type, default, choices (per item for a
comma-separated list), range and help come from its field, and `settings.check` checks
the options before any work. A study verb also reads its settings from a config file,
loaded as `train` loads its own:

    mha-jax prune --workdir W --config configs/studies/prune_michel.py --config.keep=6

A config's keys are the settings' names; `--config.KEY=VALUE` overrides a key and a flag
on the command line overrides both. A verb with methods (`prune --method`, `patch
--method`, `circuit --method`) takes, and lists in --help, only the flags of the methods
asked for. The verbs are the table VERBS (and the experiment harness's, registered
through HARNESS); each builds its options, loads the run and calls one function.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import importlib
import json
import os
import re
import sys
from typing import Callable, Sequence

import ml_collections

from mha_jax import config as mc
from mha_jax import machine, settings, storage
from mha_jax import plan as plan_lib
from mha_jax.analysis import ablate as ablate_lib, analyze as analysis_report
from mha_jax.roles import role_steps as role_steps_lib
from mha_jax.roles import taxonomy as taxonomy_lib
from mha_jax import compare_runs as compare_runs_lib
from mha_jax.circuits import circuit as circuit_lib, induction_circuits as circuits_report
from mha_jax.errors import UserError
from mha_jax.patching import patch as patch_lib, patch_explorer
from mha_jax.pretrained import registry
from mha_jax.pruning import prune as prune_lib, prune_curve as curve_lib
from mha_jax.settings import setting
from mha_jax.tasks.base import SPLITS

# The experiment harness (claims, benchmarks: mha_jax/harness/) adds its verbs
# through this one module, `VERBS` and `BENCH` tables of `Verb`; the library never
# imports it otherwise (tests/docs/test_architecture.py checks this edge).
HARNESS = "mha_jax.harness.verbs"
DTYPES = ("float32", "bfloat16", "float16")


# ------------------------------------------------------------------ a verb

@dataclasses.dataclass(frozen=True)
class Verb:
  """A verb of `mha-jax`: its help, its call `call(args, opts) -> exit status`, its
  settings (`opts`, a dataclass of `settings.setting` fields; the options object `call`
  gets) and its inputs (`settings.Spec`s in `args`, not in `opts`: --workdir, --out).
  `config`: what `--config` is, "study" (this verb's settings file), "training" (a
  training config, `--config.KEY=VALUE` handed on to it) or None."""
  help: str
  call: Callable
  opts: type | None = None
  inputs: tuple = ()
  config: str | None = "study"

  def specs(self, methods: Sequence[str] | None = None) -> list[settings.Spec]:
    """The inputs, then the settings (only those of `methods` among method-bound ones;
    None: every method's)."""
    own = settings.specs(self.opts) if self.opts else []
    return list(self.inputs) + [s for s in own if methods is None or s.methods is None
                                or set(s.methods) & set(methods)]

  @property
  def methods(self) -> tuple[str, ...]:
    """The methods of its `method` setting when some settings are bound to methods."""
    own = settings.specs(self.opts) if self.opts else []
    if not any(s.methods for s in own):
      return ()
    return next(s.choices for s in own if s.name == "method")

  @property
  def default_methods(self) -> tuple[str, ...]:
    d = next(s.default for s in settings.specs(self.opts) if s.name == "method")
    return tuple(d) if isinstance(d, tuple) else (d,)


def input_spec(name: str, help: str, default=None, *, kind: type = str, path: bool = True,
               required: bool = False, many: bool = False, **kw) -> settings.Spec:
  """A verb's input as a setting (a folder, a step; `many`: one or more): checked like
  the settings."""
  return settings.Spec(name=name, kind=kind, many=many, optional=not required,
                       default=default, required=required, help=help, path=path, **kw)


WORKDIR = input_spec("workdir", "the run's folder", required=True)
STEP = input_spec("step", "the checkpoint (default: the latest)", kind=int, path=False, lo=0)


def _out(default: str | None) -> settings.Spec:
  if default is None:
    return input_spec("out", "output folder", required=True)
  return input_spec("out", f"output folder (default: {default})")


def options(verb: Verb, args):
  """The verb's options object from the parsed `args`, checked."""
  if verb.opts is None:
    return None
  names = [f.name for f in dataclasses.fields(verb.opts)]
  return settings.check(verb.opts(**{n: getattr(args, n) for n in names}))


# ------------------------------------------------------------------ outputs and runs

# The folders writable_out created for this command, outermost first: a command refused
# (UserError) removes those still empty, so a refusal leaves no empty --out behind.
MADE: list[str] = []


def writable_out(out: str, workdir: str | None = None) -> str:
  """Creates folder `out` (a command's output) and checks that it takes files, before any
  work is done; never the source workdir itself or inside its managed folders. The
  folders it creates are removed again, while empty, if the command is refused."""
  from mha_jax.errors import StorageFault
  from mha_jax.train import lock as lock_lib
  if workdir is not None:
    lock_lib.check_out(out, workdir)
  if storage.exists(out) and not storage.isdir(out):
    raise UserError(f"--out {out!r} is a file, not a folder")
  new, p = [], storage.normpath(out)
  while p and not storage.exists(p) and p not in new:
    new.insert(0, p)
    p = storage.dirname(p)
  try:
    storage.makedirs(out)
    MADE.extend(new)
  except StorageFault as e:
    raise UserError(f"--out {out!r} cannot be created ({storage.FAULTS[e.kind]}); a "
                    f"read-only workdir needs --out elsewhere") from None
  if not storage.writable(out):
    raise UserError(f"--out {out!r} is not writable; a read-only workdir needs --out "
                    f"elsewhere")
  return out


def unmake_out() -> None:
  """Removes the folders writable_out created for this command that are still empty
  (innermost first): a refused command leaves no empty --out."""
  while MADE:
    p = MADE.pop()
    try:
      if storage.isdir(p) and not storage.listdir(p):
        storage.rmdir(p)
    except (OSError, UserError):   # another process wrote there: kept
      pass


def _load(args, workdir: str | None = None):
  """The run at --workdir (or `workdir`); a multi-seed workdir is refused naming the verb
  (the verbs that take one, eval, analyze and prune-curve, load each seed)."""
  from mha_jax import loader
  wd = workdir or args.workdir
  if workdir is None and _multi_seed(wd):
    loader.refuse(args.command, wd, f"one run (one of its seeds, "
                  f"{wd.rstrip('/')}/seed_<s>)")
  return loader.load_workdir(wd, step=getattr(args, "step", None))


def _multi_seed(workdir: str):
  """[(seed, seed workdir)] when --workdir is a multi-seed run (train.seeds), else None."""
  from mha_jax.train import seeds as seeds_lib
  return seeds_lib.seed_workdirs(workdir) if seeds_lib.is_multi_seed(workdir) else None


def _seed_out(args, s: int, wd: str, default: str) -> str:
  """A seed's output: --out/seed_<s>, else that seed's own WORKDIR/default."""
  return storage.join(args.out, f"seed_{s}") if args.out else storage.join(wd, default)


def _print(obj) -> int:
  print(json.dumps(obj))
  return 0


# ------------------------------------------------------------------ the verbs' calls

@dataclasses.dataclass(frozen=True, kw_only=True)
class ZooOptions:
  """The settings of `zoo`."""
  seq_len: int = setting(2048, lo=1, help="the sequence length T")
  batch: int = setting(1, lo=1, help="the batch size")
  d_model: int | None = setting(None, lo=1, help="instead of the zoo, every h dividing "
                                "this width")


def _zoo(args, opts: ZooOptions) -> int:
  from mha_jax import accounting
  if opts.d_model is not None:
    print(accounting.format_head_sweep(opts.d_model, seq_len=opts.seq_len, batch=opts.batch))
    print("\nAt d_k = 1 a query and a key are single numbers: a head can then only favour "
          "the key with the largest or the smallest k.")
    return 0
  print(accounting.format_zoo(seq_len=opts.seq_len, batch=opts.batch))
  print("\nParams and FLOPs are the same for every h at a given d_model; the score "
        "tensor grows with h. Grouped-query attention (h_kv < h) shrinks W_K, W_V and "
        "the KV cache by h / h_kv.")
  return 0


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainOptions:
  """The settings of `train`: the processes of a multi-process run."""
  multihost: bool = setting(False, help="call jax.distributed.initialize() and let JAX "
                            "find the cluster (Cloud TPU VM slices)")
  coordinator: str | None = setting(None, help="HOST:PORT of process 0, for a "
                                    "multi-process run (or MHA_JAX_COORDINATOR)")
  num_processes: str | None = setting(None, help="number of processes (or "
                                      "MHA_JAX_NUM_PROCESSES)")
  process_id: str | None = setting(None, help="this process's id, 0..N-1 (or "
                                   "MHA_JAX_PROCESS_ID)")
  process_timeout: str | None = setting(None, help="seconds without a heartbeat after "
                                        "which a process counts as lost and every other "
                                        "one stops (or MHA_JAX_PROCESS_TIMEOUT; default 60)")
  startup_timeout: str | None = setting(None, help="seconds to wait for the coordinator "
                                        "and every process at start-up (or "
                                        "MHA_JAX_STARTUP_TIMEOUT; default 300)")
  step_timeout: str | None = setting(None, help="seconds without progress on any process "
                                     "(a main thread frozen while its heartbeat goes on) "
                                     "after which every process stops (or "
                                     "MHA_JAX_STEP_TIMEOUT; default 900)")


def _train(args, opts: TrainOptions) -> int:
  from mha_jax.train import distributed, loop
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
  return _print(summary)


@dataclasses.dataclass(frozen=True, kw_only=True)
class EvalOptions:
  """The settings of `eval`."""
  split: str = setting("test", choices=SPLITS, help="the data split (default: test)")


def _eval(args, opts: EvalOptions) -> int:
  def eval_one(wd, **extra):
    run = _load(args, wd)
    res = run.task.evaluate(run.params, opts.split)
    print(json.dumps({"workdir": wd, **extra, "step": run.step, "split": opts.split, **res}),
          flush=True)
    return res

  seeds = _multi_seed(args.workdir)
  if not seeds:
    eval_one(args.workdir)
    return 0
  from mha_jax.toolkit import stability   # one line per seed, then mean and std over seeds
  all_res = [eval_one(wd, seed=s) for s, wd in seeds]
  return _print({"workdir": args.workdir, "seeds": [s for s, _ in seeds],
                 "split": opts.split, **{
                     f"{k}_{name}": v for k in all_res[0]
                     for name, v in stability.stats([r[k] for r in all_res]).items()
                     if name in ("mean", "std")}})


def _analyze(args, opts: analysis_report.AnalyzeOptions) -> int:
  seeds = _multi_seed(args.workdir)
  if not seeds and opts.roles_only:
    raise UserError(f"--roles-only is for a multi-seed workdir; {args.workdir!r} is one run")
  out = writable_out(args.out or storage.join(args.workdir, "analysis"), args.workdir)
  if not seeds:
    summary = analysis_report.analyze(_load(args), out, opts)
    print(json.dumps(summary, indent=1))
    print(f"wrote {out}/ (heads.json, heads.csv, *.png, explorer.html)")
    return 0
  # Several seeds: each seed's report, then the role stability across seeds into out.
  from mha_jax.toolkit import stability
  from mha_jax.roles import head_roles
  heads = {}
  for s, wd in seeds:
    run, seed_out = _load(args, wd), _seed_out(args, s, wd, "analysis")
    print(f"seed {s}: analysing {wd} into {seed_out} ...", flush=True)
    if opts.roles_only:   # roles alone, beside (not over) a full report
      heads[s] = storage.join(seed_out, "roles_only.json")
      storage.makedirs(seed_out)
      storage.write_json(heads[s], head_roles.head_roles(run, opts.split))
      continue
    analysis_report.analyze(run, seed_out, opts, log=lambda m: None)
    heads[s] = storage.join(seed_out, "heads.json")
  rep = stability.write_role_stability(heads, out)
  print(stability.format_roles(rep))
  print(f"wrote {out}/ (stability.json, stability.md, stability.png) and each seed's "
        f"analysis")
  return 0


def _ablate(args, opts: ablate_lib.AblateOptions) -> int:
  out = writable_out(args.out or storage.join(args.workdir, "analysis"), args.workdir)
  return _print(ablate_lib.ablate(_load(args), out, opts))


def _prune(args, opts: prune_lib.PruneOptions) -> int:
  out = args.out or prune_lib.default_out(args.workdir, opts)
  res = prune_lib.prune(_load(args), out, opts)
  return _print({k: res[k] for k in ("kept", "kept_heads", "base", "after", "lambdas")
                 if k in res})


def _prune_curve(args, opts: curve_lib.CurveOptions) -> int:
  out = args.out or storage.join(args.workdir.rstrip("/"), "pruning_curve")
  curve_lib.check_out(args.workdir, out)      # refused now, not after the work
  seeds = _multi_seed(args.workdir)
  if not seeds:
    rows = curve_lib.prune_curve(_load(args), out, opts)
    print(curve_lib.format_curve(rows, "bleu" in rows[0]))
    print(f"wrote {out}/curve.json, curve.md, curve.png")
    return 0
  # Several seeds: each seed's curve, then their mean and spread into out.
  from mha_jax.toolkit import stability
  paths, metric = {}, "loss"
  for s, wd in seeds:
    seed_out = _seed_out(args, s, wd, "pruning_curve")
    print(f"seed {s}: pruning curve of {wd} into {seed_out} ...", flush=True)
    rows = curve_lib.prune_curve(_load(args, wd), seed_out, opts, log=lambda m: None)
    metric = curve_lib.curve_metric(rows, "bleu" in rows[0])
    paths[s] = storage.join(seed_out, "curve.json")
  rep = stability.write_curve_stability(paths, out, metric)
  print(stability.format_curve(rep))
  print(f"wrote {out}/curve_stability.json, .md, .png and each seed's curve")
  return 0


def _export_pruned(args, opts: prune_lib.ExportOptions) -> int:
  prune_lib.check_export(args.workdir, args.out)     # refused before the load
  info = prune_lib.export_pruned(_load(args), args.out, opts)
  return _print({k: info[k] for k in ("head_counts", "max_abs_diff_vs_masked",
                                      "relative_diff_vs_masked", "forward_speed")})


def _circuits(args, opts: circuits_report.CircuitsOptions) -> int:
  out = writable_out(args.out or storage.join(args.workdir, "circuits"), args.workdir)
  res = circuits_report.circuits(_load(args), out, opts)
  print(circuits_report.format_summary(res))
  print(f"wrote {out}/ (circuits.json, composition.png, positivity.png, icl.png)")
  return 0


def _role_steps(args, opts: role_steps_lib.RoleStepsOptions) -> int:
  out = writable_out(args.out or storage.join(args.workdir, "role_steps"), args.workdir)
  doc = role_steps_lib.role_steps(_load(args), out, opts)
  print(role_steps_lib.format_summary(doc))
  print(f"wrote {out}/ (role_steps.json, role_steps.png) in {doc['seconds']['this_run']:.0f} s")
  return 0


def _taxonomy(args, opts: taxonomy_lib.TaxonomyOptions) -> int:
  out = writable_out(args.out or storage.join(args.workdir, "taxonomy"), args.workdir)
  doc = taxonomy_lib.taxonomy(_load(args), out, opts)
  print(taxonomy_lib.format_summary(doc))
  print(f"wrote {out}/ (roles.json, taxonomy.png)")
  return 0


def _patch(args, opts: patch_lib.PatchOptions) -> int:
  out = writable_out(args.out, args.workdir)
  summary = patch_lib.patch(_load(args), out, opts)
  print(patch_lib.format_summary(summary))
  extra = {"dla": ", dla.json", "explorer": ", explorer.html"}
  print(f"wrote {out}/ (patching.json, the methods' JSON, *.png"
        f"{''.join(extra.get(o, '') for o in opts.outputs)})")
  return 0


def _patch_explorer(args, opts: patch_explorer.ExplorerOptions) -> int:
  patch_explorer.patching_data(args.out)       # its files checked before the run is loaded
  run = _load(args) if args.workdir else None
  print(patch_explorer.rewrite(run, args.out, opts))
  return 0


def _circuit(args, opts: circuit_lib.CircuitOptions) -> int:
  out = writable_out(args.out, args.workdir)
  doc = circuit_lib.circuit(_load(args), out, opts)
  print(circuit_lib.format_summary(doc))
  print(f"wrote {out}/ (circuit.json, faithfulness.png, circuit.png)")
  return 0


def _compare_runs(args, opts) -> int:
  from mha_jax import compare_runs
  out = args.out or storage.join(args.dirs[0], "compare")
  compare_runs.compare_runs(args.dirs, out, opts)
  print(f"wrote {out}/ (compare.json, compare.md, compare.png)")
  return 0


@dataclasses.dataclass(frozen=True, kw_only=True)
class SweepOptions:
  """The settings of `sweep`."""
  print_commands: bool = setting(False, help="print one `mha-jax train` command per run "
                                 "instead")


def _sweep(args, opts: SweepOptions) -> int:
  from mha_jax import sweep
  from mha_jax.train import loop
  spec = mc.resolve(args.config)
  runs = sweep.plan(spec, args.workdir, args.extra)
  if opts.print_commands:
    print("\n".join(sweep.commands(runs)))
    return 0
  sweep.run_sweep(spec, args.workdir, args.extra, train_fn=loop.train)
  return 0


def _quickstart(args, opts) -> int:
  from mha_jax import quickstart
  quickstart.quickstart(args.workdir, args.extra)
  return 0


@dataclasses.dataclass(frozen=True, kw_only=True)
class ImportOptions:
  """The settings of `import`: which model, its dtype and how its params are placed."""
  name: str | None = setting(None, choices=tuple(registry.KNOWN), positional=True,
                             help="a packaged model (or give --file)")
  file: str | None = setting(None, path=True, help="a GGUF file (llama, qwen2, qwen3, "
                             "gemma3), or a Hugging Face folder (config.json + "
                             "model.safetensors or shards) of a family in "
                             "docs/guide/model-families.md")
  dtype: str = setting("float32", choices=DTYPES, help="the params' dtype (bfloat16 keeps "
                       "bf16 weights as they are)")
  mesh: str | None = setting(None, help="place the params sharded as they load: model=4 "
                             "or data=2,model=4 (heads over model; "
                             "docs/guide/model-families.md)")


def _import(args, opts: ImportOptions) -> int:
  from mha_jax.pretrained import importer
  cfg = importer.import_model(args.workdir, name=opts.name, file=opts.file, dtype=opts.dtype,
                              mesh=opts.mesh)
  m = cfg["model"]
  return _print({"workdir": args.workdir, "task": cfg["task"], "family": m["family"],
                 "layers": m["num_layers"], "heads": m["num_heads"],
                 "kv_heads": m.get("num_kv_heads", m["num_heads"]),
                 "d_model": m["d_model"], "source": cfg["source"]["path"]})


@dataclasses.dataclass(frozen=True, kw_only=True)
class GenerateOptions:
  """The settings of `generate`."""
  prompt: str = setting(help="the text to continue")
  max_new_tokens: int = setting(16, lo=1, help="tokens to generate")
  chat: bool = setting(False, help="wrap the prompt in the chat template")


def _generate(args, opts: GenerateOptions) -> int:
  run = _load(args)
  if not (run.task.decoder_only and not run.task.trainable):   # an imported LM
    from mha_jax import loader
    loader.refuse("generate", run.workdir, "an imported decoder LM (its tokenizer turns text into "
                  "tokens and back)")
  out = run.task.generate(run.params, opts.prompt, opts.max_new_tokens, chat=opts.chat)
  return _print({"prompt": opts.prompt, "chat": opts.chat, "continuation": out["text"],
                 "tokens": out["tokens"]})


def _plan(args, opts: plan_lib.PlanOptions) -> int:
  topo = plan_lib.topology(opts.topology)    # before JAX starts: cpu:N asks for N devices
  out = writable_out(args.out)
  doc = plan_lib.make_plan(opts, config=args.config, overrides=args.extra,
                           workdir=args.workdir, topo=topo)
  print(plan_lib.format_plan(doc))
  print(f"wrote {plan_lib.write_plan(doc, out)}")
  return 0


TRAIN_CONFIG = input_spec("config", "configs/FILE.py[:arg]", required=True)
VERBS = {
    "zoo": Verb("params, FLOPs and score memory of the model zoo", _zoo, ZooOptions,
                config=None),
    "train": Verb("train (or resume) a run from a config file", _train, TrainOptions,
                  (TRAIN_CONFIG, WORKDIR), config="training"),
    "eval": Verb("evaluate a run's checkpoint; prints one JSON object", _eval, EvalOptions,
                 (WORKDIR, STEP)),
    "analyze": Verb("head roles, importance, ablations, plots, explorer", _analyze,
                    analysis_report.AnalyzeOptions, (WORKDIR, STEP, _out("WORKDIR/analysis"))),
    "ablate": Verb("evaluate a checkpoint with heads ablated", _ablate,
                   ablate_lib.AblateOptions, (WORKDIR, STEP, _out("WORKDIR/analysis"))),
    "prune": Verb("prune heads: L0 gates, Michel et al., or random", _prune,
                  prune_lib.PruneOptions,
                  (WORKDIR, _out("WORKDIR_pruned_METHOD, a new workdir"))),
    "prune-curve": Verb("BLEU vs heads kept for l0, michel and random", _prune_curve,
                        curve_lib.CurveOptions, (WORKDIR, _out("WORKDIR/pruning_curve"))),
    "export-pruned": Verb("remove pruned heads from the weights for real", _export_pruned,
                          prune_lib.ExportOptions,
                          (WORKDIR, input_spec("out", "the new workdir", required=True))),
    "circuits": Verb("induction heads, composition, positivity, paths", _circuits,
                     circuits_report.CircuitsOptions,
                     (WORKDIR, _out("WORKDIR/circuits; a read-only workdir needs one "
                                    "elsewhere"))),
    "role-steps": Verb("the step at which each head role appears over a run's checkpoints",
                       _role_steps, role_steps_lib.RoleStepsOptions,
                       (WORKDIR, _out("WORKDIR/role_steps; a read-only workdir needs one "
                                      "elsewhere"))),
    "taxonomy": Verb("every head of a decoder LM named by its role, each role checked "
                     "causally", _taxonomy, taxonomy_lib.TaxonomyOptions,
                     (WORKDIR, _out("WORKDIR/taxonomy; a read-only workdir needs one "
                                    "elsewhere"))),
    "sweep": Verb("run the runs a sweep config lists", _sweep, SweepOptions,
                  (input_spec("config", "a sweep config", required=True), WORKDIR),
                  config="training"),
    "quickstart": Verb("train, evaluate and summarize the default model", _quickstart,
                       inputs=(input_spec("workdir", "the run's folder",
                                      "workdirs/quickstart"),), config="training"),
    "import": Verb("a pretrained model as a new workdir (offline)", _import, ImportOptions,
                   (WORKDIR,)),
    "generate": Verb("greedy continuation with the KV cache (imported LMs)", _generate,
                     GenerateOptions, (WORKDIR,)),
    "patch": Verb("activation, path and attribution patching; DLA", _patch,
                  patch_lib.PatchOptions, (WORKDIR, _out(None))),
    "patch-explorer": Verb("(re)write a patch result's explorer.html from its JSON",
                           _patch_explorer, patch_explorer.ExplorerOptions,
                           (input_spec("out", "the patch result's folder", required=True),
                            input_spec("workdir", "the run it patched: also the attention "
                                   "view of its first pairs"))),
    "circuit": Verb("the circuit of a behaviour: edge scores, faithfulness curve, CPR/CMD",
                    _circuit, circuit_lib.CircuitOptions, (WORKDIR, _out(None))),
    "compare-runs": Verb("table a sweep's runs (h x variant): loss, sinks, roles, induction, "
                         "pruning", _compare_runs, compare_runs_lib.CompareSettings,
                         (input_spec("dirs", "sweep workdirs (one workdir per point), "
                                     "multi-seed or run workdirs", required=True,
                                     many=True, positional=True, metavar="DIR"),
                          _out("DIR/compare")), config=None),
    "plan": Verb("compile a job ahead of time for a TPU topology or cpu:N: memory, FLOPs, "
                 "kernels and time per device (no weights, no accelerator)", _plan,
                 plan_lib.PlanOptions, (input_spec("config", "a training config configs/FILE.py[:arg] "
                                   "(or --hf-config, or --workdir)"),
                        input_spec("workdir", "a run's folder (its config and its "
                                   "checkpoint's shapes)"), _out(None)),
                 config="training"),
}
BENCH: dict[str, Verb] = {}


def _harness() -> None:
  """Adds the experiment harness's verbs (claims, primer, bench ...), once."""
  if getattr(_harness, "done", False):
    return
  _harness.done = True
  try:
    mod = importlib.import_module(HARNESS)
  except ModuleNotFoundError as e:     # the library without its harness (not installed)
    if e.name not in (HARNESS, HARNESS.split(".")[0]):
      raise
    return
  VERBS.update(mod.VERBS)
  BENCH.update(mod.BENCH)


# ------------------------------------------------------------------ flags from settings

def _items(kind: type, choices: Sequence | None, what: str) -> Callable[[str], tuple]:
  """An argparse type for comma-separated values of `kind`, each one of `choices` when
  given: "a,b" -> ("a", "b")."""
  def parse(text: str) -> tuple:
    try:
      values = tuple(kind(v.strip()) for v in text.split(",") if v.strip())
    except ValueError:
      raise argparse.ArgumentTypeError(f"expected comma-separated {what}; got {text!r}"
                                       ) from None
    if choices is not None:
      if not values:
        raise argparse.ArgumentTypeError(f"expected comma-separated {what}; got {text!r}")
      for v in values:
        if v not in choices:
          raise argparse.ArgumentTypeError(
              f"invalid choice: {v!r} (choose from {', '.join(map(repr, choices))})")
    return values
  return parse


_WHAT = {int: "integers", float: "numbers", str: "names"}


class _Tuple(argparse.Action):
  """Positional values (nargs="+") stored as the tuple a `tuple[...]` setting declares."""

  def __call__(self, parser, namespace, values, option_string=None):
    setattr(namespace, self.dest, tuple(values))


def flag_of(spec: settings.Spec) -> tuple[tuple, dict]:
  """add_argument's (names, keywords) for one setting."""
  kw: dict = {"help": spec.help, "default": spec.default}
  if spec.kind is bool:
    kw["action"] = argparse.BooleanOptionalAction if spec.default else "store_true"
  elif spec.many:
    kw["type"] = _items(spec.kind, spec.choices, _WHAT[spec.kind])
    kw["metavar"] = spec.metavar or spec.name.upper() + "[,...]"
  else:
    kw["type"] = spec.kind
    if spec.choices is not None:
      kw["choices"] = spec.choices
    if spec.metavar:
      kw["metavar"] = spec.metavar
  if spec.positional and spec.many:    # DIR...: one or more values, space-separated
    return (spec.name,), {**kw, "type": spec.kind, "nargs": "+", "action": _Tuple}
  if spec.positional:
    return (spec.name,), {**kw, "nargs": "?"}
  return (spec.flag,), {**kw, "dest": spec.name, "required": spec.required}


def add_verb(sub, name: str, verb: Verb, methods: Sequence[str] | None):
  """The sub-parser of `verb`, with the flags of `methods` (None: the verb's defaults;
  () with --help: none, and the help says how to see them)."""
  if verb.methods and methods is None:
    methods = verb.default_methods
  epilog = None
  if verb.methods and not methods:
    epilog = (f"Each method has its own flags: mha-jax {name} --method "
              f"{{{','.join(verb.methods)}}} --help.")
  elif verb.methods:
    epilog = f"The flags of --method {','.join(methods)}; other methods take others."
  if verb.config == "study":
    epilog = ((epilog + " ") if epilog else "") + (
        "--config FILE.py[:ARG]: these settings from a config file (keys: the settings' "
        "names, each flag with '_' for '-'); --config.KEY=VALUE overrides a key; a flag "
        "given here overrides both (docs/guide/cli.md).")
  p = sub.add_parser(name, help=verb.help, description=verb.help, epilog=epilog,
                     allow_abbrev=False)
  groups = {}
  for spec in verb.specs(methods if verb.methods else None):
    where = p
    if spec.methods is not None and verb.methods:
      m = next(m for m in methods if m in spec.methods)
      where = groups.setdefault(m, p.add_argument_group(f"--method {m}"))
    names, kwargs = flag_of(spec)
    where.add_argument(*names, **kwargs)
  added = {a.dest for a in p._actions}
  p.set_defaults(**{s.name: s.default for s in verb.specs() if s.name not in added})
  if verb.config == "study":
    p.add_argument("--config", default=None, metavar="FILE.py[:ARG]",
                   help="this verb's settings from a config file (configs/studies/)")
  p.add_argument("--compile-cache", default=None, metavar="DIR|off",
                 help="JAX's compilation cache (default: $MHA_JAX_COMPILE_CACHE, else "
                      "~/.cache/mha-jax/xla; docs/guide/performance.md)")
  p.set_defaults(verb=verb)
  return p


def build_parser(methods: dict[str, Sequence[str]] | None = None) -> argparse.ArgumentParser:
  """The `mha-jax` parser; `methods` names the methods whose flags a verb takes (the
  verb's --method default when not named). `parser.verbs` maps each verb to its parser."""
  _harness()
  p = argparse.ArgumentParser(prog="mha-jax", description=__doc__.split("\n\n")[0],
                              allow_abbrev=False)
  sub = p.add_subparsers(dest="command", required=True)
  p.verbs = {name: add_verb(sub, name, verb, (methods or {}).get(name))
             for name, verb in VERBS.items()}
  if BENCH:
    b = sub.add_parser("bench", help="benchmarks")
    bsub = b.add_subparsers(dest="bench", required=True)
    for name, verb in BENCH.items():
      add_verb(bsub, name, verb, None)
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
  return tuple(m.strip() for m in names if m.strip() in verb.methods)


def _config_argv(cfg, parser: argparse.ArgumentParser, spec: str, where: str) -> list[str]:
  """The config's settings as the flags they stand for (so the parser checks each);
  an unknown key is refused by its name."""
  actions = {a.dest: a for a in parser._actions
             if a.dest not in ("help", "config", "compile_cache")}
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
    if a.nargs == 0:     # a switch: --finetune, or --track / --no-track
      if not isinstance(value, bool):
        raise UserError(f"--config {spec}: key {key!r} must be true or false; got {value!r}")
      on, off = a.option_strings[0], a.option_strings[1:]
      argv += [on] if value else off[:1]
      continue
    text = ",".join(map(str, value)) if isinstance(value, (list, tuple)) else str(value)
    if a.option_strings:
      argv.append(f"{a.option_strings[0]}={text}")   # "=": a value may start with "-"
    else:
      positional.append((a, text))
  for a, text in positional:    # used when the command line gives none
    kind = a.type or str
    parser.set_defaults(**{a.dest: tuple(kind(v) for v in text.split(",")) if a.nargs == "+"
                           else kind(text)})
  return argv


def _verb_of(argv: Sequence[str]) -> tuple[str | None, Verb | None, list[str]]:
  """(its name, the verb, the rest of argv) of `mha-jax VERB ...` / `mha-jax bench VERB`."""
  _harness()
  if argv and argv[0] == "bench" and len(argv) > 1 and argv[1] in BENCH:
    return argv[1], BENCH[argv[1]], list(argv[2:])
  name = argv[0] if argv else None
  return name, VERBS.get(name), list(argv[1:])


def parse_args(argv: Sequence[str] | None = None) -> tuple[argparse.Namespace, list[str]]:
  """argv -> (args, the --config.KEY=VALUE a training verb hands on, also args.extra);
  args.verb is the Verb. A study verb reads --config FILE (the loader `train` uses) and its
  --config.KEY=VALUE overrides first, then the command line's flags over them."""
  argv = list(sys.argv[1:] if argv is None else argv)
  name, verb, rest = _verb_of(argv)
  if verb is None or verb.config != "study":
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and (verb is None or verb.config != "training"
                  or any(not a.startswith("--config.") for a in extra)):
      parser.error(f"unrecognized arguments: {' '.join(extra)}")
    args.extra = extra
    return args, extra
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
  sub = parser.verbs[name] if name in parser.verbs else _bench_parser(parser, name)
  head = [name] if name in VERBS else ["bench", name]
  file_argv = []
  if cfg is not None:
    where = f"`mha-jax {' '.join(head)}" + (f" --method {','.join(methods)}`" if methods
                                            else "`")
    file_argv = _config_argv(cfg, sub, spec, where)
  args, unknown = parser.parse_known_args([*head, *file_argv, *rest])
  if unknown:
    flags = {u.split("=")[0] for u in unknown}
    owners = sorted({m for s in verb.specs() if s.methods and s.flag in flags
                     for m in s.methods})
    hint = f" (flags of --method {' or '.join(owners)})" if owners else ""
    sub.error(f"unrecognized arguments: {' '.join(unknown)}{hint}")
  args.extra = []
  return args, []


def _bench_parser(parser, name: str):
  bench = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
  bsub = next(a for a in bench.choices["bench"]._actions
              if isinstance(a, argparse._SubParsersAction))
  return bsub.choices[name]


# ------------------------------------------------------------------ errors as flags

_QUOTED = re.compile(r"((?<!\w)'[^']*'|\"[^\"]*\")")


def flagged(e: UserError, verb: Verb | None = None) -> str:
  """The message of `e` with each setting it names (`e.settings`) shown as its flag
  (`bleu_limit` -> `--bleu-limit`), outside quoted values; the first mention each. A
  message that starts with the name of one of `verb`'s settings or inputs, followed by a
  space or a colon (`file '/x': no tokenizer.json`), shows that one as its flag too."""
  text = str(e)
  todo = list(e.settings)
  first = re.match(r"([a-z][a-z_]*)[ :]", text)
  if verb is not None and first and first.group(1) not in todo and any(
      s.name == first.group(1) and not s.positional for s in verb.specs()):
    todo.insert(0, first.group(1))
  parts = _QUOTED.split(text)
  for i in range(0, len(parts), 2):
    for name in list(todo):
      new, n = re.subn(rf"(?<![\w./-]){re.escape(name)}(?![\w/-])",
                       "--" + name.replace("_", "-"), parts[i], count=1)
      if n:
        parts[i] = new
        todo.remove(name)
  return "".join(parts)


def environment(args) -> None:
  """The environment variables every verb reads, parsed now (before any work), each bad
  one refused in a line naming it: MHA_JAX_STORAGE_RETRY_S, MHA_JAX_COMPILE_CACHE (train
  reads its MHA_JAX_* process variables as its flags' defaults and checks them as it
  checks the flags)."""
  from mha_jax import compile_cache
  storage.retry_budget()
  compile_cache.resolve(args.compile_cache)


def main(argv=None) -> int:
  """Runs one verb; returns the exit status (2: bad input, said in one line)."""
  machine.avoid_hugepage_stalls()
  argv = list(sys.argv[1:] if argv is None else argv)
  verb = _verb_of(argv)[1]
  try:
    args, _ = parse_args(argv)
    verb = args.verb
    for spec in verb.inputs:       # the inputs: checked as the settings are
      settings.check_value(spec, getattr(args, spec.name))
    opts = options(verb, args)
    environment(args)
  except SystemExit as e:    # argparse: --help (0) or a usage error (2), printed already
    return e.code if isinstance(e.code, int) else 0
  except UserError as e:
    print(f"mha-jax: error: {flagged(e, verb)}", file=sys.stderr)
    return 2
  try:
    from mha_jax import compile_cache
    compile_cache.enable(args.compile_cache)
    return verb.call(args, opts)
  except UserError as e:     # bad input: one line. Anything else is a bug: its traceback.
    unmake_out()
    print(f"mha-jax: error: {flagged(e, verb)}", file=sys.stderr)
    return 2
  finally:
    MADE.clear()


if __name__ == "__main__":   # python -m mha_jax.cli: the one module the harness extends
  from mha_jax.cli import main as _main
  sys.exit(_main())
