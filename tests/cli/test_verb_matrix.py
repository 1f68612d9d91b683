"""Every verb that reads a run, through `mha_jax.cli.main`, on every kind of run: it works
on the kinds it takes, and refuses each other kind in one line naming the verb, what it
needs and the run's kind (`loader.kind`). One table: VERBS (the command line of each
verb and the kinds it takes) x KINDS (the runs, made by the CLI where the CLI makes
them: train, import, prune, export-pruned). The verbs that read no run (zoo, train,
import, sweep, quickstart, the harness's) are tested where they live; train, import,
prune and export-pruned also make the kinds here.

The default run keeps every refusal and each verb's cheapest working cells (`V.fast`),
on tiny runs made once per worker; the other working cells (an imported model's
analysis, MiniLM's studies, the circuit's edge scores on every decoder, ...) are slow."""

import functools
import json
import os
import shutil

import pytest

from mha_jax import cli

# On the worker that trains conftest's ind_run, parallel_run and tiny_attn_lm.
pytestmark = pytest.mark.xdist_group("trained_runs")

KINDS = ("translation", "lm", "attn_only", "llama", "gemma3", "minilm", "pruned", "seeds")
# The words of loader.kind each kind's refusal shows.
KIND_WORDS = {
    "translation": "a translation run (an encoder-decoder, task 'translation')",
    "lm": "a decoder LM trained here (task 'lm')",
    "attn_only": "an attention-only decoder LM trained here (task 'lm')",
    "llama": "an imported decoder LM (task 'pretrained_lm', family 'llama')",
    "gemma3": "an imported decoder LM (task 'pretrained_lm', family 'gemma3')",
    "minilm": "an imported encoder (task 'embedding': no decoder, no next-token logits)",
    "pruned": "a decoder LM trained here (task 'lm'), pruned by export-pruned",
    "seeds": "a multi-seed run (seeds.json)"}
DECODERS = ("lm", "attn_only", "llama", "gemma3", "pruned")
HEAD = {k: "encoder.0.0" if k in ("translation", "minilm") else "lm.0.0" for k in KINDS}
STACKS = {k: [] if k in ("translation", "minilm") else ["--stacks", "lm"] for k in KINDS}
LM_FLAGS = ["--config.train.progress=false", "--config.data.tokenizer=bytes",
            "--config.model.d_model=16", "--config.model.max_len=32",
            "--config.train.batch_size=4", "--config.eval.batch_size=4",
            "--config.eval.lm_batches=1", "--config.train.warmup=1"]


def _ok(argv):
  assert cli.main(argv) == 0, argv


# ------------------------------------------------------------------ the kinds of run

@pytest.fixture(scope="module")
def runs(tmp_path_factory, parallel_run, tiny_attn_lm, request):
  """{kind: workdir}, made lazily (MiniLM only for the cells that ask for it)."""
  from builders import ROOT
  import hf_models
  base = tmp_path_factory.mktemp("kinds")
  lm_config = os.path.join(ROOT, "configs/lm.py")

  def lm():
    wd = str(base / "lm")
    _ok(["train", "--config", f"{lm_config}:layers=2,heads=2", "--workdir", wd, *LM_FLAGS,
         "--config.train.steps=4", "--config.train.checkpoint_every=2"])
    return wd

  def imported(family):
    folder = hf_models.save_folder(hf_models.build_hf(family), str(base / f"hf_{family}"))
    wd = str(base / family)
    _ok(["import", "--file", folder, "--workdir", wd])
    return wd

  def pruned():
    masked, wd = str(base / "lm_masked"), str(base / "pruned")
    _ok(["prune", "--workdir", get("lm"), "--method", "random", "--keep", "3", "--stacks",
         "lm", "--out", masked])
    _ok(["export-pruned", "--workdir", masked, "--out", wd])
    return wd

  def seeds():
    wd = str(base / "seeds")
    _ok(["train", "--config", f"{lm_config}:layers=1,heads=2", "--workdir", wd, *LM_FLAGS,
         "--config.train.steps=2", "--config.train.seeds=0,1"])
    return wd

  make = {"translation": lambda: parallel_run[0], "lm": lm,
          "attn_only": lambda: tiny_attn_lm[0], "llama": lambda: imported("llama"),
          "gemma3": lambda: imported("gemma3"),
          "minilm": lambda: request.getfixturevalue("minilm_workdir"),
          "pruned": pruned, "seeds": seeds}

  @functools.cache
  def get(kind):
    return make[kind]()
  return get


@pytest.fixture(scope="module")
def patched(runs, tmp_path_factory):
  """kind -> the folder `mha-jax patch` wrote on that run (made once, on demand)."""
  base = tmp_path_factory.mktemp("patched")

  @functools.cache
  def get(kind):
    out = str(base / kind)
    _ok(VERBS["patch"].argv(runs(kind), out, kind))
    return out
  return get


# ------------------------------------------------------------------ the verbs


class V:
  """A verb's cells: `argv(workdir, out, kind)`, the kinds it takes, what its refusal
  says it needs (a multi-seed workdir: `seeds_needs`, the CLI's refusal), the kinds whose
  working cells run by default (`fast`: the others are slow; every refusal is a default
  cell), and the files a working cell writes in --out."""

  def __init__(self, argv, takes, needs, fast=("attn_only",), files=(), seeds_needs="one run",
               seeds_files=None):
    self.argv, self.takes, self.needs, self.fast = argv, takes, needs, set(fast)
    self.files, self.seeds_needs = files, seeds_needs
    self.seeds_files = files if seeds_files is None else seeds_files

  def needs_of(self, kind):
    return self.seeds_needs if kind == "seeds" else self.needs


def _out(name):
  return lambda wd, o, k: [name, "--workdir", wd, "--out", o]


VERBS = {
    "eval": V(lambda wd, o, k: ["eval", "--workdir", wd], KINDS, "",
              fast=("attn_only",)),
    "analyze": V(lambda wd, o, k: _out("analyze")(wd, o, k) + [
        "--no-ablations", "--bleu-limit", "2", "--role-limit", "4", "--importance-limit", "4"]
        + (["--roles", "attention_sink"] if k in ("llama", "gemma3") else []),
        KINDS, "", fast=("attn_only",),
        files=("heads.json", "explorer.html"), seeds_files=("stability.json",)),
    "ablate": V(lambda wd, o, k: _out("ablate")(wd, o, k) + ["--heads", HEAD[k]],
                KINDS[:-1], "one run", fast=("attn_only",)),
    "prune": V(lambda wd, o, k: _out("prune")(wd, o, k) + [
        "--method", "random", "--keep", "1", "--bleu-limit", "2", *STACKS[k]],
        KINDS[:-1], "one run", fast=("attn_only",), files=("pruning.json",)),
    "prune-curve": V(lambda wd, o, k: _out("prune-curve")(wd, o, k) + [
        "--counts", "1", "--steps", "1", "--bleu-limit", "2", *STACKS[k]],
        KINDS, "", files=("curve.json",),
        seeds_files=("curve_stability.json",)),
    "export-pruned": V(_out("export-pruned"), ("pruned",),
                       "a run `mha-jax prune` wrote (its pruning.json: prune it first)",
                       files=("pruning.json", "config.json"), fast=("pruned",),
                       seeds_needs="a run `mha-jax prune` wrote"),
    "circuits": V(lambda wd, o, k: _out("circuits")(wd, o, k) + ["--no-track", "--samples", "2"],
                  DECODERS, "a decoder LM (one causal stack: induction heads, composition)",
                  fast=("pruned",), files=("circuits.json",)),
    "role-steps": V(lambda wd, o, k: _out("role-steps")(wd, o, k) + [
        "--roles", "induction", "--draws", "1", "--top-k", "1"],
        ("lm", "attn_only", "pruned"),
        "a decoder LM trained here (it follows the checkpoints of its training)",
        files=("role_steps.json",)),
    "taxonomy": V(lambda wd, o, k: _out("taxonomy")(wd, o, k) + [
        "--roles", "previous_token,attention_sink", "--no-causal"],
        DECODERS, "a decoder LM (its heads' roles are read on next-token prediction)",
        files=("roles.json", "taxonomy.png")),
    "generate": V(lambda wd, o, k: ["generate", "--workdir", wd, "--prompt", "hi",
                                    "--max-new-tokens", "2"], ("llama", "gemma3"),
                  "an imported decoder LM (its tokenizer turns text into tokens and back)",
                  fast=("llama",)),
    "patch": V(lambda wd, o, k: _out("patch")(wd, o, k) + [
        "--task", "induction", "--n-pairs", "2", "--keep-failing", "--method", "activation"],
        DECODERS, "a decoder LM (prompt pairs compared by their next-token logits)",
        files=("patching.json",)),
    "patch-explorer": V(None, DECODERS, "the decoder LM `mha-jax patch` patched",
                        files=("explorer.html",)),
    "circuit": V(lambda wd, o, k: _out("circuit")(wd, o, k) + [
        "--task", "induction", "--n-pairs", "2", "--steps", "1", "--sample", "4",
        "--keep-failing", "--method", "eap"],
        DECODERS, "a decoder LM (prompt pairs compared by their next-token logits)",
        files=("circuit.json",), fast=()),
    "compare-runs": V(lambda wd, o, k: [
        "compare-runs", wd, "--out", o, "--prune-steps", "1", "--windows", "1",
        "--composition-samples", "1", "--no-track"],
        ("translation", "lm", "attn_only", "pruned", "seeds"),
        "runs trained here (a sweep's points: their training settings, checkpoints and "
        "studies)", files=("compare.json",)),
}


def _cells():
  for verb, v in VERBS.items():
    for kind in KINDS:
      works = kind in v.takes
      slow = works and kind not in v.fast
      marks = [pytest.mark.slow] if slow else []
      yield pytest.param(verb, kind, works, marks=marks,
                         id=f"{verb}-{kind}-{'works' if works else 'refused'}")


def test_the_table_covers_every_verb_that_reads_a_run():
  reads = {n for n, v in cli.VERBS.items()
           if any(s.name in ("workdir", "dirs") for s in v.inputs)} - {
               "train", "sweep", "quickstart", "import",      # these make a run
               "plan"}     # reads a run's shapes only (checkpoint metadata): tests/plan/
  assert reads == set(VERBS), sorted(reads ^ set(VERBS))


@pytest.mark.parametrize("verb,kind,works", list(_cells()))
def test_verb_on_kind(verb, kind, works, runs, patched, tmp_path, capsys):
  v = VERBS[verb]
  wd, out = runs(kind), str(tmp_path / "out")
  if verb == "patch-explorer":      # a patch result: this run's, or the attention-only one's
    out = str(tmp_path / "result")
    shutil.copytree(patched(kind if works else "attn_only"), out)
    argv = ["patch-explorer", "--out", out, "--workdir", wd, "--attention-pairs", "1"]
  else:
    argv = v.argv(wd, out, kind)
  capsys.readouterr()
  rc = cli.main(argv)
  said = capsys.readouterr()
  err = said.err
  if works:
    assert rc == 0, err[-3000:]
    for f in (v.seeds_files if kind == "seeds" else v.files):
      assert os.path.exists(os.path.join(out, f)), (f, os.listdir(out))
    if verb == "eval":        # one JSON object (a multi-seed run: one per seed, then theirs)
      assert json.loads(said.out.splitlines()[-1])["workdir"] == wd
    return
  assert rc == 2, err[-3000:]
  lines = err.splitlines()
  assert len(lines) == 1, err
  assert lines[0].startswith(f"mha-jax: error: {verb} needs {v.needs_of(kind)}"), lines[0]
  where = "DIR" if verb == "compare-runs" else "--workdir"      # a positional DIR...
  assert f"; {where} {wd!r} is {KIND_WORDS[kind]}" in lines[0], lines[0]
  assert verb == "patch-explorer" or not os.path.exists(out)   # a refusal leaves no --out
