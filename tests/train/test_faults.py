"""Faults and bad input (issue 10): checkpoint damage, data loss, silent nonsense,
tracebacks. Every test here failed before the fix it guards."""

import json
import os
import shutil

import numpy as np
import pytest

import mha_jax
from mha_jax import cli as cli_mod
from mha_jax import config as mc
from mha_jax.errors import BadCheckpoint, UserError
from mha_jax.train import checkpoint as ckpt_lib
from mha_jax.train import loop
from helpers import QUIET, ROOT, _copy, _largest, _tree, copy_with_own_data, induction_cfg


# One worker builds this module's trained fixture once (see setup.cfg: --dist loadgroup).
pytestmark = pytest.mark.xdist_group('faults')

def _flip(path, n=64):
  data = bytearray(open(path, "rb").read())
  mid = len(data) // 2
  for i in range(mid, mid + n):
    data[i] ^= 0xFF
  open(path, "wb").write(bytes(data))


def _damage(wd, how):
  step = os.path.join(wd, "checkpoints", "8")
  for big in _largest(os.path.join(step, "params")):
    if how == "random_bytes":
      open(big, "wb").write(np.random.default_rng(0).bytes(os.path.getsize(big)))
    elif how == "truncated":
      open(big, "r+b").truncate(os.path.getsize(big) // 3)
    elif how == "deleted":
      os.remove(big)
    elif how == "flipped_64_bytes":
      _flip(big)
  if how == "params_swapped":   # readable by orbax, but not the bytes that were saved
    shutil.rmtree(os.path.join(step, "params"))
    shutil.copytree(os.path.join(wd, "checkpoints", "4", "params"), os.path.join(step, "params"))
  if how == "meta_garbled":
    open(os.path.join(step, "meta", "metadata"), "w").write("{not json")
  elif how == "params_removed":
    shutil.rmtree(os.path.join(step, "params"))


# ------------------------------------------------------------------ data loss

def test_keep_zero_is_refused_and_every_checkpoint_survives(ind_run, tmp_path):
  wd = _copy(ind_run, tmp_path)
  before = _tree(wd)
  for keep in ("0", "-1"):
    with pytest.raises(UserError, match=rf"train.keep must be >= 1 .*got {keep}"):
      loop.train(induction_cfg("--config.train.steps=12", f"--config.train.keep={keep}"),
                 wd, **QUIET)
    with pytest.raises(UserError, match="train.keep must be >= 1"):   # fresh run too
      loop.train(induction_cfg("--config.train.steps=4", f"--config.train.keep={keep}"),
                 str(tmp_path / "fresh"), **QUIET)
  assert _tree(wd) == before and ckpt_lib.step_dirs(wd) == [4, 8]
  assert not os.path.exists(tmp_path / "fresh")


def test_a_failed_train_leaves_a_workdir_that_a_later_run_may_use(tmp_path):
  wd = str(tmp_path / "run")
  with pytest.raises(UserError, match="more than model.max_len"):   # fails after config.json
    loop.train(induction_cfg("--config.train.steps=2", "--config.data.half_len=9"), wd, **QUIET)
  assert ckpt_lib.step_dirs(wd) == []
  loop.prepare_workdir(induction_cfg("--config.train.steps=2"), wd)   # was "another config"
  assert json.load(open(os.path.join(wd, "config.json")))["data"]["half_len"] == 6


# ------------------------------------------------------------------ checkpoint faults

DAMAGE = ("random_bytes", "truncated", "deleted", "flipped_64_bytes", "params_swapped",
          "meta_garbled", "params_removed")


@pytest.mark.parametrize("how", DAMAGE)
def test_a_bad_newest_checkpoint_falls_back_for_load_and_eval(ind_run, tmp_path, how,
                                                              capsys):
  wd = _copy(ind_run, tmp_path)
  good = mha_jax.load(wd, step=4, **QUIET).params
  _damage(wd, how)
  before = _tree(wd)
  warnings = []
  loaded = mha_jax.load(wd, log=warnings.append)
  assert loaded.step == 4 and ckpt_lib.tree_equal(loaded.params, good)
  assert any(os.path.join("checkpoints", "8") in w for w in warnings), warnings
  with pytest.raises(BadCheckpoint, match=r"checkpoints/8"):        # asked for by name
    mha_jax.load(wd, step=8, **QUIET)
  assert cli_mod.main(["eval", "--workdir", wd, "--split", "valid"]) == 0
  out, err = capsys.readouterr()
  assert json.loads(out)["step"] == 4 and np.isfinite(json.loads(out)["loss"])
  assert "mha-jax: warning: checkpoint" in err and "checkpoints/8" in err
  assert _tree(wd) == before                                        # nothing deleted or written


def test_resuming_train_starts_from_the_newest_good_checkpoint(ind_run, tmp_path, capsys):
  wd = _copy(ind_run, tmp_path)
  _damage(wd, "params_swapped")
  logs = []
  res = loop.train(induction_cfg("--config.train.steps=8"), wd, log=logs.append)
  assert res["status"] == "done" and res["step"] == 8
  assert "resumed from step 4 in " + wd in logs
  err = capsys.readouterr().err
  assert "checkpoints/8: checksum mismatch in params" in err and "checkpoints.bad" in err
  assert ckpt_lib.step_dirs(wd) == [4, 8]                          # 8 written again
  assert os.listdir(os.path.join(wd, "checkpoints.bad")) == ["8"]  # the bad one, kept
  # Bit-identical to the undamaged run's step 8 (resume is deterministic).
  assert ckpt_lib.tree_equal(mha_jax.load(wd, **QUIET).params,
                             mha_jax.load(ind_run, **QUIET).params)


def test_checksums_are_saved_and_every_checkpoint_bad_is_an_error(ind_run, tmp_path):
  wd = _copy(ind_run, tmp_path)
  meta = json.load(open(os.path.join(wd, "checkpoints", "8", "meta", "metadata")))
  assert set(meta["checksums"]) == {"params", "opt_state"}
  assert all(len(v) == 64 for v in meta["checksums"]["params"].values())
  for step in ("4", "8"):
    for f in _largest(os.path.join(wd, "checkpoints", step, "params")):
      _flip(f)
  with pytest.raises(BadCheckpoint, match=r"every checkpoint .* is bad \(steps \[8, 4\]\)"):
    mha_jax.load(wd, **QUIET)
  assert ckpt_lib.step_dirs(wd) == [4, 8]


def test_train_refuses_a_pruned_workdir_and_leaves_config_json_untouched(ind_run, tmp_path):
  loaded = mha_jax.load(ind_run, **QUIET)
  wd = str(tmp_path / "pruned")
  os.makedirs(wd)
  shutil.copy(os.path.join(ind_run, "config.json"), wd)
  c = ckpt_lib.Checkpoints(wd)
  c.save_params(8, loaded.params, {"step": 8})
  c.close()
  before = open(os.path.join(wd, "config.json"), "rb").read()
  with pytest.raises(UserError, match="pruned or exported model .* no optimizer state"):
    loop.train(induction_cfg("--config.train.steps=12"), wd, **QUIET)
  assert open(os.path.join(wd, "config.json"), "rb").read() == before
  assert mha_jax.load(wd, **QUIET).step == 8                          # still loads


# ------------------------------------------------------------------ the run's data

def test_loading_and_evaluating_never_write_to_the_workdir(parallel_run, ind_run):
  for wd in (parallel_run[0], ind_run):
    before = _tree(wd)
    loaded = mha_jax.load(wd)
    loaded.task.evaluate(loaded.params, "valid", bleu=False)
    assert _tree(wd) == before


def test_data_edited_after_training_is_refused_and_the_vocabulary_kept(parallel_run,
                                                                       tmp_path):
  wd, paths = parallel_run
  wd, cfg = copy_with_own_data(wd, paths, tmp_path)
  vocab = open(os.path.join(wd, "data", "vocab.json")).read()
  assert mha_jax.load(wd).task.vocab_size == len(json.loads(vocab))
  with open(cfg["data"]["train_src"], "a") as f:
    f.write("brand new words\n")
  with open(cfg["data"]["train_tgt"], "a") as f:
    f.write("words new brand\n")
  with pytest.raises(UserError, match=r"data.train_src/data.train_tgt: the training data no "
                                      r"longer matches the run's vocabulary .*3 new"):
    mha_jax.load(wd)
  assert open(os.path.join(wd, "data", "vocab.json")).read() == vocab


# ------------------------------------------------------------------ silent nonsense

@pytest.mark.parametrize("field,value,msg", [
    ("model.dropout", "1.5", r"model.dropout must be in \[0, 1\); got 1.5"),
    ("model.dropout", "-0.1", r"model.dropout must be in \[0, 1\); got -0.1"),
    ("train.clip", "-1", r"train.clip must be >= 0 \(global-norm clipping; 0 = none\); got -1"),
    ("train.keep", "-1", r"train.keep must be >= 1 \(checkpoints kept on disk\); got -1"),
    ("train.label_smoothing", "1.0", r"train.label_smoothing must be in \[0, 1\); got 1.0"),
    ("train.lr", "0", r"train.lr must be > 0; got 0"),
    ("train.b2", "1.5", r"train.b2 must be in \[0, 1\); got 1.5"),
    ("train.warmup", "-5", r"train.warmup must be >= 0; got -5"),
    ("train.weight_decay", "-0.1", r"train.weight_decay must be >= 0; got -0.1"),
    ("train.max_loss_factor", "0.5", r"train.max_loss_factor must be > 1"),
    ("eval.batch_size", "0", r"eval.batch_size must be >= 1; got 0"),
    ("data.half_len", "-1", r"data.half_len must be >= 0; got -1"),
])
def test_every_numeric_field_is_range_checked_by_name(field, value, msg):
  with pytest.raises(UserError, match=msg):
    mc.validate(induction_cfg(f"--config.{field}={value}"))


def test_clip_zero_means_no_clipping():
  import jax.numpy as jnp
  g = {"w": jnp.asarray([3.0, -4.0])}

  def first_update(clip):
    cfg = induction_cfg(f"--config.train.clip={clip}", "--config.train.schedule=constant",
                        "--config.train.warmup=0")
    mc.validate(cfg)
    opt = loop.make_optimizer(cfg.train)
    state = opt.update(g, opt.init(g), {"w": jnp.zeros(2)})[1]   # step 0 has lr 0
    return np.asarray(opt.update(g, state, {"w": jnp.zeros(2)})[0]["w"])

  none = first_update("0")       # was clip_by_global_norm(0): every gradient zeroed
  assert np.all(np.abs(none) > 1e-4)
  np.testing.assert_allclose(none, first_update("1e30"), rtol=1e-6)


def test_a_loss_that_grows_without_nan_stops_the_run(tmp_path, monkeypatch):
  # lr 100 with a long warmup: the loss climbs from ln 12 = 2.48 to 20,000 without NaN.
  closed = []
  for cls in (loop.MetricsWriter, ckpt_lib.Checkpoints):
    monkeypatch.setattr(cls, "close", lambda self, real=cls.close, name=cls.__name__: (
        closed.append(name), real(self))[1])
  wd = str(tmp_path / "run")
  with pytest.raises(loop.TrainingDiverged,
                     match=r"is more than train.max_loss_factor=4 times the starting loss "
                           r"2.48.*Last good checkpoint: step 4"):
    loop.train(induction_cfg("--config.train.steps=12", "--config.train.lr=100",
                             "--config.train.warmup=1000", "--config.train.log_every=1"),
               wd, **QUIET)
  assert ckpt_lib.step_dirs(wd) == [4]
  assert sorted(closed) == ["Checkpoints", "MetricsWriter"]   # closed on the way out
  meta = json.load(open(os.path.join(wd, "checkpoints", "4", "meta", "metadata")))
  assert meta["initial_loss"] == pytest.approx(np.log(12), abs=0.05)


def test_lm_label_smoothing_changes_the_objective_as_the_formula_says():
  import jax
  import jax.numpy as jnp
  import optax
  from mha_jax import tasks
  cfg = induction_cfg()
  task = tasks.build(cfg)
  params = task.init_params(jax.random.PRNGKey(0))
  batch = task.train_batch(0)
  plain, m = task.loss(params, batch)
  smooth, m2 = task.loss(params, batch, label_smoothing=0.2)
  logits = task.apply(params, batch).astype(jnp.float32)
  v = logits.shape[-1]
  labels = 0.8 * jax.nn.one_hot(batch["tokens"][:, 1:], v) + 0.2 / v
  want = optax.softmax_cross_entropy(logits, labels).mean()
  assert float(smooth) == pytest.approx(float(want), rel=1e-5)
  assert float(smooth) != pytest.approx(float(plain), rel=1e-4)
  assert float(m["loss"]) == pytest.approx(float(m2["loss"]))       # the metric is plain NLL


# ------------------------------------------------------------------ messages, not tracebacks

def test_cli_prints_one_line_for_bad_input_and_a_traceback_for_bugs(ind_run, tmp_path,
                                                                    capsys, monkeypatch):
  bad = tmp_path / "bad.py"
  bad.write_text("def get_config(arg=None)\n  return 1\n")
  assert cli_mod.main(["train", "--config", str(bad), "--workdir", str(tmp_path / "w")]) == 2
  err = capsys.readouterr().err
  assert err.count("\n") == 1 and f"--config: '{bad}' line 1" in err, err
  wd = _copy(ind_run, tmp_path)
  open(os.path.join(wd, "config.json"), "w").write('{"task": "lm",')
  assert cli_mod.main(["eval", "--workdir", wd]) == 2
  err = capsys.readouterr().err
  assert err.count("\n") == 1 and os.path.join(wd, "config.json") + " is not valid JSON" in err
  import mha_jax.loader

  def bug(*a, **k):
    raise ValueError("an internal shape bug")        # e.g. raised inside JAX
  monkeypatch.setattr(mha_jax.loader, "load", bug)
  with pytest.raises(ValueError, match="an internal shape bug"):
    cli_mod.main(["eval", "--workdir", ind_run])


def test_ablate_checks_head_names_before_evaluating(ind_run, capsys, monkeypatch):
  from mha_jax import tasks

  def no_eval(*a, **k):
    raise AssertionError("evaluated before checking --heads")
  monkeypatch.setattr(tasks.LMTask, "evaluate", no_eval)
  assert cli_mod.main(["ablate", "--workdir", ind_run, "--heads", "lm.99.0"]) == 2
  assert "lm.99.0" in capsys.readouterr().err


def test_binary_data_files_name_the_field_and_the_file(tmp_path):
  from mha_jax.data import parallel, text
  p = tmp_path / "train.src"
  p.write_bytes(b"ok line\n\xff\xfe\x00binary\n")
  with pytest.raises(UserError, match=rf"data.train_src: '{p}' is not UTF-8 text"):
    parallel.read_lines(str(p), "data.train_src")
  with pytest.raises(UserError, match=rf"data.text_files: '{p}' is not UTF-8 text"):
    text.read_corpus([str(p)])


@pytest.mark.parametrize("head,msg", [
    ("x", r"not valid CoNLL-U .*'head'"),
    ("9", r"sentence 1 of .*token 1 \('the'\): head 9 is not a token of the sentence \(0..2\)"),
    ("_", r"head None is not a token"),
])
def test_conllu_heads_that_are_not_tokens_are_refused(tmp_path, head, msg):
  from mha_jax.data import parallel
  p = tmp_path / "t.conllu"
  p.write_text(f"1\tthe\tthe\tDET\t_\t_\t{head}\tdet\t_\t_\n"
               "2\tdog\tdog\tNOUN\t_\t_\t0\troot\t_\t_\n\n")
  with pytest.raises(UserError, match=msg):
    parallel.read_conllu_arcs(str(p), [["the", "dog"]], "data.conllu.train")


# ------------------------------------------------------------------ review defects

def _task_members(proto):
  return {n for c in proto.__mro__ if c.__module__.startswith("mha_jax.tasks")
          for n in list(vars(c)) + list(getattr(c, "__annotations__", {}))
          if not n.startswith("_")}


def test_studies_use_only_the_typed_task_interface(ind_run, parallel_run):
  import ast
  import glob
  from mha_jax import tasks
  allowed = (_task_members(tasks.TranslationData) | _task_members(tasks.PretrainedLMData)
             | _task_members(tasks.EmbeddingData))
  assert {"apply", "loss", "evaluate", "eval_batches", "train_batch", "vocab_size",
          "vocab", "words", "arcs", "trainable", "decoder_only", "reports_bleu",
          "role_family", "compares_to_dense", "repeated_eval_tokens"} <= allowed
  used = {}
  root = os.path.join(ROOT, "mha_jax")
  # The studies and the toolkit they share; the prompt pairs and the patching Study (from
  # patching/, never checked here) still read the tokenizer's config (task.cfg, special_ids).
  for path in sorted(p for d in ("toolkit", "analysis", "pruning", "circuits")
                     for p in glob.glob(os.path.join(root, d, "*.py"))
                     if os.path.basename(p) not in ("pairs.py", "activation_patching.py")):
    tree = ast.parse(open(path).read())
    task_names = {"task"} | {  # names bound to loaded.task (task = loaded.task, ...)
        t.id for node in ast.walk(tree) if isinstance(node, ast.Assign)
        for t, v in ([(node.targets[0], node.value)] if not isinstance(node.targets[0], ast.Tuple)
                     else zip(node.targets[0].elts, getattr(node.value, "elts", [])))
        if isinstance(t, ast.Name) and ast.unparse(v) in ("loaded.task",)}
    for node in ast.walk(tree):
      if isinstance(node, ast.Attribute):
        base = ast.unparse(node.value)
        if base in ("loaded.task",) or base in task_names:
          used.setdefault(node.attr, set()).add(os.path.basename(path))
  assert used and set(used) <= allowed, {k: v for k, v in used.items() if k not in allowed}
  assert isinstance(mha_jax.load(ind_run, **QUIET).task, tasks.LMData)
  assert isinstance(mha_jax.load(parallel_run[0]).task, tasks.TranslationData)
  assert mha_jax.Loaded.__annotations__["task"] in ("tasks.Task", tasks.Task)


def test_circuits_over_checkpoints_builds_the_task_once(ind_run, monkeypatch):
  from mha_jax import tasks
  from mha_jax.circuits import behaviour, circuits_report
  loaded = mha_jax.load(ind_run, **QUIET)
  tokens, lengths = behaviour.eval_tokens(loaded, batch=8)
  built = []
  real = tasks.build
  monkeypatch.setattr(tasks, "build", lambda *a, **k: built.append(1) or real(*a, **k))
  rows = circuits_report.over_checkpoints(loaded, tokens, lengths, log=lambda s: None)
  assert [r["step"] for r in rows] == [4, 8] and built == []
  at4 = circuits_report.over_checkpoints(loaded, tokens, lengths, log=lambda s: None)[0]
  direct = behaviour.icl_score(mha_jax.load(ind_run, step=4, **QUIET), tokens, lengths)
  assert at4["icl_score"] == pytest.approx(direct["icl_score"], abs=1e-6)


def test_michel_and_random_masks_leave_the_callers_mask_alone(ind_run):
  from mha_jax.toolkit import masks
  from mha_jax.pruning import methods
  loaded = mha_jax.load(ind_run, **QUIET)
  start = masks.ones_mask(loaded.params, ["lm"])
  start["lm"][0][1] = 0.0
  snapshot = {s: [m.copy() for m in ls] for s, ls in start.items()}
  rnd = methods.random_masks(loaded, stacks=["lm"], counts=[2], start_mask=start)
  mic = methods.michel_masks(loaded, stacks=["lm"], counts=[5], start_mask=start, limit=8,
                             log=lambda s: None)
  assert masks.count(rnd[2]) == 2 and masks.count(mic[5]) == 5 and mic[5]["lm"][0][1] == 0
  for s in start:
    for a, b in zip(start[s], snapshot[s]):
      np.testing.assert_array_equal(a, b)


def test_prune_curve_trains_the_gates_once(ind_run, tmp_path, monkeypatch):
  from mha_jax.pruning import curve, methods
  calls = []
  real = methods.train_gates
  monkeypatch.setattr(methods, "train_gates", lambda *a, **k: calls.append(1) or real(*a, **k))
  rows = curve.pruning_curve(ind_run, str(tmp_path / "c"), counts=[8, 4, 1], stacks=["lm"],
                             steps=2, log=lambda s: None)
  assert len(calls) == 1
  l0 = {r["kept"]: set(r["kept_heads"]) for r in rows if r["method"] == "l0"}
  assert len(l0[1]) == 1 and l0[1] <= l0[4] <= l0[8]     # nested: one ranking, top K


def test_prune_l0_keep_k_needs_no_lambda(ind_run, tmp_path, capsys):
  out = str(tmp_path / "p")
  assert cli_mod.main(["prune", "--workdir", ind_run, "--out", out, "--method", "l0",
                       "--keep", "3", "--stacks", "lm", "--steps", "2"]) == 0
  info = json.load(open(os.path.join(out, "pruning.json")))
  assert info["kept"] == 3 and info["lambda"] == 0.05
  assert cli_mod.main(["prune", "--workdir", ind_run, "--out", str(tmp_path / "q"),
                       "--method", "l0", "--stacks", "lm"]) == 2
  assert "--l0-lambda X, --lambdas a,b,c or --keep K" in capsys.readouterr().err


def test_special_ids_have_one_definition_per_vocabulary():
  import ast
  import glob
  from mha_jax.data import repeated_tokens, text, vocab as vocab_lib
  from mha_jax.models import common
  assert text.BOS_ID is vocab_lib.LM_BOS_ID and repeated_tokens.BOS_ID is vocab_lib.LM_BOS_ID
  assert common.ModelSpec("seq2seq").pad_id == vocab_lib.PAD_ID
  root = os.path.join(ROOT, "mha_jax")
  literal = []
  for path in glob.glob(os.path.join(root, "**", "*.py"), recursive=True):
    if path.endswith(os.path.join("data", "vocab.py")):
      continue
    for node in ast.walk(ast.parse(open(path).read())):
      if isinstance(node, (ast.Assign, ast.AnnAssign)):   # X_ID = 0, pad_id: int = 0
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        names = [getattr(t, "id", getattr(t, "attr", "")) for t in targets]
        if (any(n.lower().endswith("_id") for n in names) and
            isinstance(node.value, ast.Constant)):
          literal.append((os.path.basename(path), names))
      if isinstance(node, ast.Compare) and any(   # ids != 0: padding by a literal
          isinstance(c, ast.Constant) and c.value == 0 for c in node.comparators) and any(
              isinstance(o, ast.NotEq) for o in node.ops) and any(
                  w in ast.unparse(node.left) for w in ("src", "tgt", "ids")):
        literal.append((os.path.basename(path), ast.unparse(node)))
  assert literal == []


def test_misleading_names_and_dead_code_are_gone():
  import inspect
  from mha_jax import bench
  from mha_jax.toolkit import importance, roles
  from mha_jax.data import synthetic_translation
  from mha_jax.models import seq2seq
  assert hasattr(roles, "RoleStats") and not hasattr(roles, "EncoderRoleStats")
  assert not hasattr(roles, "DIRECTIONS") and not hasattr(synthetic_translation, "generate")
  assert "x" not in inspect.signature(bench.build_impls).parameters
  assert not hasattr(bench, "_median_seconds")
  assert "np.ndarray" not in str(inspect.signature(importance.michel_importance).return_annotation)
  assert "(pre-LN)" not in seq2seq.__doc__
  assert "RNG is not restored" in " ".join(ckpt_lib.__doc__.split())
  cfg = mc.load_config("configs/lm.py")
  assert cfg.data.text_files == ()
  src = open(os.path.join(ROOT, "configs", "lm.py")).read()
  assert src.count("text_files =") + src.count("text_files=") == 1


def test_ci_installs_the_browser_and_no_test_installs_anything():
  root = ROOT
  ci = open(os.path.join(root, ".ci", "run")).read()
  assert "apt-get install -y -qq chromium" in ci and "command -v chromium" in ci
  import ast
  runners = {"run", "Popen", "call", "check_call", "check_output", "system", "popen"}
  import glob
  for path in glob.glob(os.path.join(root, "tests", "**", "*.py"), recursive=True):
    name = os.path.relpath(path, root)
    if os.path.abspath(path) != os.path.abspath(__file__):
      tree = ast.parse(open(path).read())
      for node in ast.walk(tree):    # a command a test runs: subprocess.* / os.system
        func = getattr(node, "func", None)
        if isinstance(node, ast.Call) and getattr(func, "attr", getattr(func, "id", "")) in runners:
          words = [c.value for a in node.args for c in ast.walk(a)
                   if isinstance(c, ast.Constant) and isinstance(c.value, str)]
          text = " ".join(words)
          assert "apt-get" not in text and "pip" not in words and "pip install" not in text, \
              (name, text)


def test_the_results_the_readme_cites_are_in_the_repository():
  import glob
  import re
  import subprocess
  root = ROOT
  pages = [os.path.join(root, "README.md")] + glob.glob(os.path.join(root, "docs", "guide",
                                                                     "*.md"))
  readme = "\n".join(open(p).read() for p in pages)    # the README and the guide pages
  cited = set(re.findall(r"docs/results/[\w.\-{},*/]+", readme))
  assert cited
  tracked = subprocess.run(["git", "ls-files", "docs/results"], cwd=root, text=True,
                           capture_output=True).stdout.split()
  ignored = subprocess.run(["git", "check-ignore", "docs/results/x.json"], cwd=root).returncode
  assert ignored == 1                                   # .gitignore no longer hides them
  for c in cited:
    m = re.fullmatch(r"(.*?)\{(.*?)\}(.*)", c)     # stem{a,b}tail
    names = ([m[1] + e + m[3] for e in m[2].split(",")] if m else [c.rstrip(".")])
    for n in names:
      folder = n if n.endswith("/") else n + "/"
      if n.endswith("/") or any(t.startswith(folder) for t in tracked):
        assert any(t.startswith(folder) for t in tracked), (n, tracked)   # a folder
        continue
      pat = re.escape(n).replace(r"\*", ".*")
      assert any(re.fullmatch(pat, t) for t in tracked), (n, tracked)


def test_analyze_and_ablate_write_only_to_out(ind_run, tmp_path, capsys):
  before = _tree(ind_run)
  out = str(tmp_path / "out")
  assert cli_mod.main(["ablate", "--workdir", ind_run, "--heads", "lm.0.0", "--split",
                       "valid", "--out", out]) == 0
  assert cli_mod.main(["analyze", "--workdir", ind_run, "--split", "valid",
                       "--no-ablations", "--out", out]) == 0
  assert {"ablation_zero.json", "heads.json"} <= set(os.listdir(out))
  assert _tree(ind_run) == before
  blocker = tmp_path / "file"
  blocker.write_text("")
  capsys.readouterr()
  assert cli_mod.main(["ablate", "--workdir", ind_run, "--heads", "lm.0.0",
                       "--out", str(blocker / "x")]) == 2
  assert "cannot be created" in capsys.readouterr().err
