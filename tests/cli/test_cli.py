"""The `mha-jax` command: its one style (choices, config files, per-method flags), zoo and
the benchmark harness (no timings are asserted)."""

import glob
import json
import os
import subprocess
import sys

import pytest

from mha_jax import cli
from mha_jax import config as mc


def test_zoo_prints_every_model_with_d_k(capsys):
  assert cli.main(["zoo", "--seq-len", "1024"]) == 0
  out = capsys.readouterr().out
  assert "T=1024" in out
  for model, d_k in (("Transformer-base", 64), ("GPT-2 XL", 64), ("LLaMA 65B", 128),
                     ("GPT-3 175B", 128)):
    line = next(l for l in out.splitlines() if l.startswith(model))
    assert int(line.split()[-5]) == d_k, line
  assert "603,979,776" in out            # 4 * 12288^2
  llama2 = next(l for l in out.splitlines() if l.startswith("LLaMA-2 70B")).split()
  assert (llama2[3], llama2[4], llama2[6]) == ("64", "8", "150,994,944")   # h, h_kv, params


def test_console_script_entry_point_runs():
  r = subprocess.run([sys.executable, "-m", "mha_jax.cli", "zoo"], capture_output=True,
                     text=True, check=True)
  assert "LLaMA 13B" in r.stdout


@pytest.mark.slow    # a benchmark run end to end (~11 s); `pytest -m slow`
def test_bench_attention_writes_json_and_table(tmp_path, capsys):
  out = tmp_path / "b.json"
  assert cli.main(["bench", "attention", "--d-model", "32", "--seq-len", "8", "--batch", "1",
                   "--heads", "4,8", "--rounds", "2", "--out", str(out),
                   "--impls", "mha_jax impl=auto,mha_jax impl=blocked"]) == 0
  text = capsys.readouterr().out
  data = json.loads(out.read_text())
  impls = {r["impl"] for r in data["rows"]}
  assert impls == {"mha_jax impl=auto", "mha_jax impl=blocked", "flax.linen MHDPA",
                   "flax.nnx MultiHeadAttention", "linen + jax.nn.dot_product_attention"}
  assert len(data["rows"]) == 2 * 2 * len(impls)       # h x mode x impl
  assert all(len(r["times_ms"]) == 2 and r["median_ms"] > 0 for r in data["rows"])
  assert data["machine"]["matmul_gflops"] > 0
  assert "| 8 | 4 | flax.linen MHDPA |" in text


@pytest.mark.slow
def test_bench_scale_t_reports_time_memory_and_over_cap(tmp_path, capsys):
  """Each (impl, T) in its own capped subprocess; an allocation over the cap is reported."""
  out = tmp_path / "s.json"
  assert cli.main(["bench", "attention", "--scale-t", "--d-model", "16", "--heads", "2",
                   "--seq-lens", "16,40000", "--impls", "mha_jax impl=reference",
                   "--rounds", "1", "--max-mem-gb", "4", "--out", str(out)]) == 0
  rows = json.loads(out.read_text())["rows"]
  assert [r["status"] for r in rows] == ["ok", "over cap"]   # 2 * 40000^2 * 4 B = 12.8 GB
  assert rows[0]["median_ms"] > 0 and 50 < rows[0]["max_rss_mb"] < 4096
  assert "over cap" in capsys.readouterr().out


def test_bench_rejects_heads_not_dividing_width(tmp_path, capsys):
  assert cli.main(["bench", "attention", "--d-model", "30", "--heads", "8",
                   "--out", str(tmp_path / "x.json")]) == 2
  assert "h=8 does not divide d_model=30" in capsys.readouterr().err
  assert not (tmp_path / "x.json").exists()


def test_zoo_head_sweep_keeps_params_and_flops_flat(capsys):
  assert cli.main(["zoo", "--d-model", "64", "--seq-len", "128", "--batch", "16"]) == 0
  rows = [l.split() for l in capsys.readouterr().out.splitlines() if l[:5].strip().isdigit()]
  assert [int(r[0]) for r in rows] == [1, 2, 4, 8, 16, 32, 64]
  assert [int(r[1]) for r in rows] == [64, 32, 16, 8, 4, 2, 1]
  assert {r[2] for r in rows} == {"16,384"} and len({r[3] for r in rows}) == 1
  mib = [float(r[4]) for r in rows]
  assert mib == sorted(mib) and mib[-1] == 64 * mib[0]


# ------------------------------------------------------------------ one CLI style

L0_FLAGS = ("--l0-lambda", "--lambdas", "--steps", "--lr", "--finetune", "--beta",
            "--init-log-alpha", "--per-layer-mean", "--binarize")


@pytest.mark.parametrize("argv,flag,value", [
    (["analyze", "--workdir", "w", "--split", "bogus"], "--split", "bogus"),
    (["eval", "--workdir", "w", "--split", "dev"], "--split", "dev"),
    (["ablate", "--workdir", "w", "--mode", "half"], "--mode", "half"),
    (["prune", "--workdir", "w", "--method", "magic"], "--method", "magic"),
    (["prune", "--workdir", "w", "--stacks", "encoder,decoder"], "--stacks", "decoder"),
    (["prune", "--workdir", "w", "--binarize", "round"], "--binarize", "round"),
    (["prune-curve", "--workdir", "w", "--stacks", "lm,x"], "--stacks", "x"),
    (["patch", "--workdir", "w", "--out", "o", "--task", "copy"], "--task", "copy"),
    (["patch", "--workdir", "w", "--out", "o", "--method", "path,exact"], "--method", "exact"),
    (["import", "gpt5", "--workdir", "w"], "name", "gpt5"),
    (["import", "--file", "f", "--dtype", "int8", "--workdir", "w"], "--dtype", "int8"),
    (["claims", "--only", "mixture_dip,nope"], "--only", "nope"),
    (["bench", "attention", "--impls", "mha_jax impl=magic"], "--impls", "mha_jax impl=magic"),
    (["bench", "attention", "--dtype", "int8"], "--dtype", "int8"),
])
def test_a_bad_choice_is_the_parsers_error_naming_flag_and_value(argv, flag, value, capsys):
  assert cli.main(argv) == 2
  err = capsys.readouterr().err
  assert err.startswith("usage: mha-jax ") and "Traceback" not in err, err
  assert f"error: argument {flag}: invalid choice: {value!r} (choose from" in err, err


def _study_config(tmp_path, **keys) -> str:
  """A study config file holding `keys`; a new name each time (Python's bytecode cache
  could take a rewrite of the same size in the same second for the old file)."""
  path = tmp_path / f"study_{len(list(tmp_path.glob('study_*.py')))}.py"
  path.write_text("import ml_collections\n\ndef get_config(arg=None):\n"
                  f"  return ml_collections.ConfigDict({keys!r})\n")
  return str(path)


@pytest.fixture
def prune_calls(monkeypatch):
  """What `mha-jax prune` hands the pruning function (which is not run, nor is the
  workdir loaded): the workdir, out and the options' settings."""
  import dataclasses
  import types
  from mha_jax.pruning import prune as prune_lib
  calls = []
  from mha_jax import loader
  monkeypatch.setattr(loader, "load_workdir", lambda workdir, step=None: types.SimpleNamespace(
      workdir=workdir))
  monkeypatch.setattr(prune_lib, "prune", lambda loaded, out, opts: calls.append(
      dict(workdir=loaded.workdir, out=out, **dataclasses.asdict(opts))) or
      {"kept": opts.keep})
  return calls


def test_a_config_files_settings_reach_the_verb_and_overrides_apply_in_order(
    tmp_path, prune_calls, capsys):
  spec = _study_config(tmp_path, method="michel", keep=4, stacks="lm",
                       keep_one_per_layer=True, workdir="runs/a")
  assert cli.main(["prune", "--config", spec]) == 0
  (call,) = prune_calls
  assert (call["workdir"], call["method"], call["keep"], call["stacks"],
          call["keep_one_per_layer"]) == ("runs/a", "michel", 4, ("lm",), True)
  assert call["out"] == "runs/a_pruned_michel"
  assert json.loads(capsys.readouterr().out) == {"kept": 4}
  assert cli.main(["prune", "--config", spec, "--config.keep=6",
                   "--config.keep_one_per_layer", "false"]) == 0
  assert (prune_calls[-1]["keep"], prune_calls[-1]["keep_one_per_layer"]) == (6, False)
  assert cli.main(["prune", "--config", spec, "--config.keep=6", "--keep", "8",
                   "--workdir", "runs/b", "--stacks", "encoder,lm"]) == 0
  assert (prune_calls[-1]["keep"], prune_calls[-1]["workdir"],
          prune_calls[-1]["stacks"]) == (8, "runs/b", ("encoder", "lm"))


def test_a_config_file_is_checked_like_the_flags(tmp_path, prune_calls, capsys):
  for keys, argv, msg in (
      (dict(method="michel", keep=4, steps=3), [],
       "key 'steps' is not a flag of `mha-jax prune --method michel`"),
      (dict(keep=4, stepz=3), [], "key 'stepz' is not a flag of `mha-jax prune`; did you "
       "mean steps?"),
      (dict(keep=4), ["--config.stepz=3"], "config key 'stepz' is unknown"),
      (dict(keep=4, stacks="lm,deco"), [], "argument --stacks: invalid choice: 'deco'"),
      (dict(keep="four"), [], "argument --keep: invalid int value: 'four'"),
      (dict(keep=4, finetune="yes"), [], "key 'finetune' must be true or false; got 'yes'"),
      (dict(keep=4, method="michel"), ["--lr", "1"],
       "unrecognized arguments: --lr 1 (flags of --method l0)")):
    spec = _study_config(tmp_path, workdir="w", **keys)
    assert cli.main(["prune", "--config", spec, *argv]) == 2, keys
    err = capsys.readouterr().err
    assert msg in err and "Traceback" not in err, (msg, err)
  assert cli.main(["prune", "--workdir", "w", "--config.keep=4"]) == 2
  assert "--config.keep=4 overrides a key of --config FILE; none given" in (
      capsys.readouterr().err)
  assert prune_calls == []


def test_prune_help_shows_only_the_flags_of_the_method_asked(capsys):
  def help_of(*argv):
    assert cli.main([*argv, "--help"]) == 0
    return capsys.readouterr().out
  common = help_of("prune")
  michel, l0, rnd = (help_of("prune", "--method", m) for m in ("michel", "l0", "random"))
  for flag in L0_FLAGS + ("--keep-one-per-layer", "--seed"):
    assert flag not in common and flag not in michel.replace("--keep-one-per-layer", "")
    assert (flag in l0) == (flag in L0_FLAGS + ("--seed",)), flag
  assert "--keep-one-per-layer" in michel and "--seed" in rnd and "--steps" not in rnd
  assert "mha-jax prune --method {l0,michel,random} --help" in " ".join(common.split())
  for text in (common, michel, l0):
    assert all(f in text for f in ("--workdir", "--keep", "--stacks", "--config"))
  assert "--receivers" in help_of("patch", "--method", "path")
  assert "--receivers" not in help_of("patch", "--method", "activation")


CONFIG_VERBS = ("prune-curve", "prune", "analyze", "ablate", "circuits", "patch", "claims")


@pytest.mark.parametrize("path", sorted(glob.glob(os.path.join(
    mc.REPO_ROOT, "configs", "studies", "*.py"))), ids=os.path.basename)
def test_each_study_config_loads_into_its_verbs_flags(path):
  stem = os.path.basename(path)[:-3].replace("_", "-")
  verb = next(v for v in CONFIG_VERBS if stem == v or stem.startswith(v + "-"))
  cfg = mc.load_config(path, training=False)
  args, _ = cli.parse_args([verb, "--config", path, "--workdir", "w", "--out", "o"])
  assert args.command == verb and args.config == path
  for key, want in cfg.items():
    got = getattr(args, key)
    if isinstance(got, tuple) and isinstance(want, str):   # comma-separated in the file
      want = tuple(type(got[0])(v) for v in want.split(","))
    assert got == (tuple(want) if isinstance(want, (list, tuple)) else want), key


def test_the_cli_page_shows_the_real_prune_help(monkeypatch, capsys):
  monkeypatch.setenv("COLUMNS", "80")     # argparse wraps at the terminal's width
  page = open(os.path.join(mc.REPO_ROOT, "docs", "guide", "cli.md")).read()
  for argv in (["prune"], ["prune", "--method", "michel"]):
    assert cli.main([*argv, "--help"]) == 0
    assert f"```text\n{capsys.readouterr().out.rstrip()}\n```" in page, argv


STUDY_SETTINGS = {   # verb: (a setting that is not its default, the flags it still needs)
    "eval": (dict(split="valid"), ["--workdir", "w"]),
    "analyze": (dict(split="train", bleu_limit=3), ["--workdir", "w"]),
    "ablate": (dict(mode="mean", top=2), ["--workdir", "w"]),
    "prune": (dict(keep=3, lambdas=(0.1, 0.2)), ["--workdir", "w"]),
    "prune-curve": (dict(random_draws=2, counts="4,2"), ["--workdir", "w"]),
    "export-pruned": (dict(out="o2"), ["--workdir", "w"]),
    "circuits": (dict(track=False), ["--workdir", "w"]),
    "role-steps": (dict(draws=2, check_steps=(100, 200)), ["--workdir", "w"]),
    "taxonomy": (dict(top_k=2, roles=("induction", "successor")), ["--workdir", "w"]),
    "claims": (dict(out="c2"), []),
    "patch": (dict(n_pairs=3, receivers=4, method="path"), ["--workdir", "w", "--out", "o"]),
    "circuit": (dict(n_pairs=3, ablation="mean", target=0.5), ["--workdir", "w", "--out", "o"]),
    "generate": (dict(max_new_tokens=4, chat=True), ["--workdir", "w", "--prompt", "p"]),
    "import": (dict(name="minilm-l6", dtype="bfloat16"), ["--workdir", "w"]),
    "patch-explorer": (dict(attention_pairs=3), ["--out", "o"]),
    "primer": (dict(pruned="p"), ["--out", "o"]),
}


def test_every_study_verb_reads_its_flags_from_a_config_file(tmp_path):
  assert set(STUDY_SETTINGS) == {n for n, v in cli.VERBS.items() if v.config == "study"}
  for verb, (keys, needed) in STUDY_SETTINGS.items():
    args, _ = cli.parse_args([verb, "--config", _study_config(tmp_path, **keys), *needed])
    for key, want in keys.items():
      want = (tuple(want) if isinstance(want, tuple) else
              tuple(int(v) for v in want.split(",")) if key == "counts" else
              (want,) if key == "method" and verb == "patch" else want)
      assert getattr(args, key) == want, (verb, key)
  spec = _study_config(tmp_path, name="minilm-l6")
  assert cli.parse_args(["import", "smollm2-135m", "--config", spec, "--workdir", "w"]
                        )[0].name == "smollm2-135m"       # the command line's name wins
