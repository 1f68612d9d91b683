"""The cases of the probe of bad input (issue 44), each a test: a verb that failed for
every input, raw tracebacks, silent no-ops and refusals that came after the work. The
verb x run-kind matrix is tests/cli/test_verb_matrix.py."""

import json
import os

import pytest

from mha_jax import cli as cli_mod

# On the worker that trains conftest's ind_run and parallel_run (setup.cfg: --dist loadgroup).
pytestmark = pytest.mark.xdist_group("trained_runs")


def _value(spec, n: int) -> list[str]:
  """n command-line values of `spec`'s item kind (its choices when it has some)."""
  if spec.choices:
    return [str(c) for c in spec.choices[:n]]
  return {int: ["1", "2"], float: ["0.5", "0.25"], str: ["a", "b"]}[spec.kind][:n]


def _sequence_cases():
  """(verb name, verb, spec) for every sequence setting or input of every verb."""
  cli_mod.build_parser()        # adds the harness's verbs
  verbs = [(n, v) for n, v in cli_mod.VERBS.items()]
  verbs += [(f"bench {n}", v) for n, v in cli_mod.BENCH.items()]
  return [pytest.param(n, v, s, id=f"{n}:{s.name}") for n, v in verbs for s in v.specs()
          if s.many]


@pytest.mark.parametrize("name,verb,spec", _sequence_cases())
def test_every_sequence_setting_reaches_its_verb_as_the_tuple_its_dataclass_declares(
    name, verb, spec, tmp_path):
  head = name.split()
  argv = []
  for s in verb.specs():
    if s.required and s.name != spec.name:
      argv += [str(tmp_path)] if s.positional else [s.flag, str(tmp_path)]
  if spec.methods:
    argv += ["--method", spec.methods[0]]
  values = _value(spec, 2)
  argv += values if spec.positional else [spec.flag, ",".join(values)]
  args, _ = cli_mod.parse_args([*head, *argv])
  got = getattr(args, spec.name)
  assert isinstance(got, tuple) and got == tuple(spec.kind(v) for v in values), got


@pytest.mark.slow  # default run: test_verb_matrix.py's compare-runs cell
def test_compare_runs_through_the_command_line(ind_run, tmp_path, capsys):
  out = str(tmp_path / "cmp")
  assert cli_mod.main(["compare-runs", ind_run, ind_run, "--out", out, "--prune-steps", "1",
                       "--windows", "1", "--composition-samples", "1", "--no-track"]) == 0, \
      capsys.readouterr().err
  doc = json.load(open(os.path.join(out, "compare.json")))
  assert doc["dirs"] == [ind_run, ind_run] and len(doc["rows"]) == 2


def test_role_steps_checks_the_roles_causally_on_a_toy_induction_run(ind_run, tmp_path,
                                                                      capsys):
  # its window is 13 positions: the causal check's repeated tokens must fit it, as the
  # scores' do
  out = str(tmp_path / "rs")
  assert cli_mod.main(["role-steps", "--workdir", ind_run, "--out", out, "--steps", "8",
                       "--roles", "induction", "--draws", "1", "--top-k", "1"]) == 0, \
      capsys.readouterr().err
  doc = json.load(open(os.path.join(out, "role_steps.json")))
  assert "effect" in doc["causal"][0]["checks"]["induction"]


def test_role_steps_default_roles_leave_out_successor_without_a_tokenizer(ind_run, tmp_path,
                                                                          capsys):
  out = str(tmp_path / "rs")
  assert cli_mod.main(["role-steps", "--workdir", ind_run, "--out", out, "--steps", "8",
                       "--no-causal"]) == 0, capsys.readouterr().err
  doc = json.load(open(os.path.join(out, "role_steps.json")))
  assert doc["not_asked"]["successor"] == "no tokenizer"
  assert "successor" not in doc["thresholds"] and "induction" in doc["thresholds"]


@pytest.fixture
def no_load(monkeypatch):
  """mha_jax.load fails the test: nothing may be loaded before the checks."""
  from mha_jax import loader
  monkeypatch.setattr(loader, "load_workdir", lambda *a, **k: pytest.fail("worked before checking"))


@pytest.mark.parametrize("value", ["soon", "-1", "inf"])
def test_a_bad_storage_retry_variable_is_one_line_naming_it_before_any_work(
    value, tmp_path, monkeypatch, capsys, no_load):
  from mha_jax import storage
  monkeypatch.setenv(storage.RETRY_ENV, value)
  assert cli_mod.main(["eval", "--workdir", str(tmp_path)]) == 2
  err = capsys.readouterr().err
  assert err.count("\n") == 1, err
  assert f"MHA_JAX_STORAGE_RETRY_S must be a number of seconds >= 0; got {value!r}" in err
  monkeypatch.setenv(storage.RETRY_ENV, "2.5")
  assert storage.retry_budget() == 2.5


@pytest.mark.parametrize("content", [None, '{"task": "ioi", "pairs": [', b"\xff\xfe\x00"])
def test_patch_explorer_refuses_a_folder_without_a_readable_result_in_one_line(
    content, tmp_path, capsys, no_load):
  out = tmp_path / "result"
  out.mkdir()
  if content is not None:
    (out / "patching.json").write_bytes(content.encode() if isinstance(content, str)
                                        else content)
  assert cli_mod.main(["patch-explorer", "--out", str(out), "--workdir", str(tmp_path)]) == 2
  err = capsys.readouterr().err
  assert err.count("\n") == 1 and err.startswith("mha-jax: error: --out"), err
  assert ("no patching.json or dla.json" if content is None else
          f"{out / 'patching.json'} is not") in err
  assert sorted(os.listdir(out)) == ([] if content is None else ["patching.json"])


@pytest.mark.parametrize("verb,needs", [
    pytest.param("patch", "a decoder LM (prompt pairs compared by their next-token logits)",
                 marks=pytest.mark.slow),
    ("circuit", "a decoder LM (prompt pairs compared by their next-token logits)"),
    ("role-steps", "a decoder LM trained here")])
def test_decoder_verbs_refuse_a_translation_run_by_name_and_leave_no_out(
    verb, needs, parallel_run, tmp_path, capsys):
  wd, _ = parallel_run
  out = tmp_path / "new" / "out"
  extra = ["--task", "induction"] if verb != "role-steps" else []
  assert cli_mod.main([verb, "--workdir", wd, "--out", str(out), *extra]) == 2
  err = capsys.readouterr().err
  assert err.count("\n") == 1, err
  assert f"{verb} needs {needs}" in err and f"--workdir {wd!r} is a translation run" in err
  assert not (tmp_path / "new").exists()      # --out and the parent it made: removed


@pytest.mark.parametrize("verb", ["patch", "circuit"])
@pytest.mark.parametrize("pair,why", [
    ({"clean": "abcab", "corrupt": "abcab", "answer": "c", "wrong": "d"},
     "the corrupt prompt is the clean one"),
    ({"clean": "abcab", "corrupt": "abdab", "answer": "c", "wrong": "c"},
     "answer and wrong are the same token 'c'")])
def test_pairs_that_cannot_move_the_metric_are_refused_before_any_compile(
    verb, pair, why, tiny_attn_lm, tmp_path, capsys, monkeypatch):
  from mha_jax.toolkit import activation_patching
  monkeypatch.setattr(activation_patching, "Study",
                      lambda *a, **k: pytest.fail("compiled before checking the pairs"))
  wd, _ = tiny_attn_lm
  good = {"clean": "abcab", "corrupt": "abdab", "answer": "c", "wrong": "d"}
  path = tmp_path / "pairs.jsonl"
  path.write_text(json.dumps(good) + "\n" + json.dumps(pair) + "\n")
  out = tmp_path / "out"
  assert cli_mod.main([verb, "--workdir", wd, "--out", str(out), "--pairs", str(path)]) == 2
  err = capsys.readouterr().err
  assert err.count("\n") == 1 and f"--pairs {path}, line 2: {why}" in err, err
  assert not out.exists()


@pytest.mark.parametrize("override,said", [
    ("--config.train.batch_size=0", "train.batch_size must be >= 1; got 0"),
    ("--config.model.dropout=2", "model.dropout must be in [0, 1); got 2.0")])
def test_a_config_range_error_names_the_config_key_not_a_flag_that_does_not_exist(
    override, said, tmp_path, capsys):
  from builders import ROOT
  assert cli_mod.main(["train", "--config", os.path.join(ROOT, "configs/induction.py"),
                       "--workdir", str(tmp_path / "w"), override]) == 2
  err = capsys.readouterr().err
  assert err == f"mha-jax: error: {said}\n", err
  assert not (tmp_path / "w").exists()


@pytest.mark.parametrize("verb", ["prune", "prune-curve"])
def test_a_stack_the_model_lacks_is_named_as_such(verb, ind_run, tmp_path, capsys):
  # prune-curve said "--counts: 48 is outside 0..0 heads in ['encoder']" on an LM
  assert cli_mod.main([verb, "--workdir", ind_run, "--out", str(tmp_path / "o")]) == 2
  err = capsys.readouterr().err
  assert err == "mha-jax: error: --stacks: 'encoder' is not in this model; it has ['lm']\n"


def test_analyze_roles_on_a_translation_run_is_refused_not_ignored(parallel_run, tmp_path,
                                                                   capsys):
  wd, _ = parallel_run
  out = tmp_path / "a"
  assert cli_mod.main(["analyze", "--workdir", wd, "--out", str(out), "--roles", "retrieval",
                       "--retrieval-len", "1000000000"]) == 2
  err = capsys.readouterr().err
  assert err.count("\n") == 1 and err.startswith(
      "mha-jax: error: analyze --roles needs a decoder LM (the head taxonomy's roles); "
      f"--workdir {wd!r} is a translation run"), err
  assert not out.exists()


def test_a_retrieval_length_without_role_retrieval_is_refused(ind_run, tmp_path, capsys):
  assert cli_mod.main(["analyze", "--workdir", ind_run, "--out", str(tmp_path / "a"),
                       "--retrieval-len", "100"]) == 2
  err = capsys.readouterr().err
  assert "--retrieval-len is read by role retrieval only; give --roles with retrieval" in err
