"""Model files are untrusted input: the GGUF, safetensors, tokenizer.json and config.json
readers fuzzed with hypothesis over mutations of real small files (fuzz_readers.py, the
corpus in fuzz_corpus/). Every outcome is a correct import or one UserError naming the
file; never another exception, a hang, or an allocation larger than the file justifies.

The default run fuzzes each reader for a few seconds (derandomized: the same examples
every run); the `slow` test runs longer, and fuzzes the real SmolLM2 GGUF's header in
place. `-s` prints the executions and the distinct outcomes.
"""

import collections
import os
import shutil
import signal
import tracemalloc

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fuzz_readers as fz
from mha_jax.errors import UserError
from mha_jax.pretrained import importer

GGUF_SEED = os.path.join(fz.CORPUS, "tiny.gguf")
HF_SEED = os.path.join(fz.CORPUS, "hf")
HANG_S = 20                   # one import of a tiny file takes well under a second
RUNS = collections.Counter()  # executions per reader
OUTCOMES = collections.defaultdict(set)   # distinct outcomes (the error's first words)
BUGS = collections.defaultdict(list)      # any other exception: (kind and place, file)
KEEP = os.environ.get("MHA_JAX_FUZZ_KEEP")  # a folder to copy each failing input into
PATHS = collections.defaultdict(set)  # distinct paths: the set of reader lines one run ran
TRACE = {"on": False}                 # measured in the slow run (sys.settrace is slow)
READERS = tuple(os.path.join(os.path.dirname(importer.__file__), f) for f in (
    "gguf_file.py", "hf_folder.py", "tokenizer.py", "importer.py", "adapters.py")) + (
    os.path.join(os.path.dirname(os.path.dirname(importer.__file__)), "data",
                 "tokenizer_json.py"),)


def _traced(fn, lines: set):
  """fn() with every line the readers run added to `lines`."""
  import sys

  def local(frame, event, arg):
    if event == "line":
      lines.add((frame.f_code.co_filename, frame.f_lineno))
    return local

  def tracer(frame, event, arg):
    return local if frame.f_code.co_filename in READERS else None
  sys.settrace(tracer)
  try:
    return fn()
  finally:
    sys.settrace(None)


def _fuzz_settings(n: int, **kw):
  return settings(max_examples=n, deadline=None, derandomize=True, database=None,
                  suppress_health_check=list(HealthCheck), **kw)


def _alarm(*_):
  raise TimeoutError(f"an import took more than {HANG_S} s (a hang)")


def outcome(path: str, target: str, size: int | None = None, read=None) -> str:
  """Imports `path` and checks the outcome: "ok", or a UserError naming `path`. No other
  exception, no hang (HANG_S), and at most 64 MB + 64 bytes per byte of the file
  allocated (Python and NumPy allocations, tracemalloc)."""
  RUNS[target] += 1
  size = size or (sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))
                  if os.path.isdir(path) else os.path.getsize(path))
  old = signal.signal(signal.SIGALRM, _alarm)
  signal.alarm(HANG_S)
  tracemalloc.reset_peak()
  try:
    run = lambda: (read or (lambda p: importer.read_model(file=p)))(path)  # noqa: E731
    lines = set()
    try:
      _traced(run, lines) if TRACE["on"] else run()
    finally:
      if TRACE["on"]:
        PATHS[target].add(hash(frozenset(lines)))
    result = "ok"
  except UserError as e:
    text = str(e)
    if path not in text or "\n" in text.strip():
      _bug(target, path, f"a UserError that does not name the file in one line: {text}")
    result = " ".join(text.replace(path, "FILE").split()[:7])
  except BaseException as e:  # noqa: BLE001 - every other outcome is a bug
    import traceback
    where = traceback.extract_tb(e.__traceback__)[-1]
    _bug(target, path, f"{type(e).__name__} at {os.path.basename(where.filename)}:"
                       f"{where.lineno}: {' '.join(str(e).split())[:150]}")
    result = f"BUG {type(e).__name__}"
  finally:
    signal.alarm(0)
    signal.signal(signal.SIGALRM, old)
  peak = tracemalloc.get_traced_memory()[1]
  assert peak < 64 * 2 ** 20 + 64 * size, f"allocated {peak} bytes for a {size}-byte file"
  OUTCOMES[target].add(result)
  return result


def _bug(target: str, path: str, what: str) -> None:
  BUGS[target].append(what)
  if KEEP:
    dest = os.path.join(KEEP, f"{target.replace(' ', '_')}-{len(BUGS[target])}")
    (shutil.copytree if os.path.isdir(path) else shutil.copyfile)(path, dest)


def _no_bugs(target: str) -> None:
  bugs = BUGS.pop(target, [])
  kinds = collections.Counter(b.split(": ")[0] for b in bugs)
  assert not bugs, f"{len(bugs)} bad outcomes of {RUNS[target]}: {dict(kinds)}; e.g. " \
                   f"{sorted(set(bugs))[:6]}"


@pytest.fixture(scope="module", autouse=True)
def traced():
  tracemalloc.start()
  yield
  tracemalloc.stop()
  print(f"\nfuzzing: executions {dict(RUNS)}; distinct outcomes "
        f"{ {k: len(v) for k, v in OUTCOMES.items()} }; distinct paths through the "
        f"readers (slow run) { {k: len(v) for k, v in PATHS.items()} }")


def test_the_seeds_import():
  assert outcome(GGUF_SEED, "seed") == "ok"
  assert outcome(HF_SEED, "seed") == "ok"
  _no_bugs("seed")


def _gguf_bytes(tmp, n, slow=False):
  data = open(GGUF_SEED, "rb").read()
  hot = fz.gguf_header_length(GGUF_SEED)

  @_fuzz_settings(n)
  @given(st.data())
  def run(d):
    path = os.path.join(tmp, "m.gguf")
    with open(path, "wb") as f:
      f.write(d.draw(fz.byte_mutation(data, hot)))
    outcome(path, "gguf bytes")
  run()


def _gguf_fields(tmp, n):
  @_fuzz_settings(n)
  @given(fz.gguf_rewrite(GGUF_SEED))
  def run(change):
    path = os.path.join(tmp, "m.gguf")
    fz.write_gguf_changed(GGUF_SEED, path, *change)
    outcome(path, "gguf fields")
  run()


def _folder(tmp, n):
  @_fuzz_settings(n)
  @given(fz.folder_mutation(HF_SEED))
  def run(changes):
    outcome(fz.make_folder(HF_SEED, os.path.join(tmp, "m"), changes), "hf folder")
  run()


FUZZERS = {"gguf bytes": _gguf_bytes, "gguf fields": _gguf_fields, "hf folder": _folder}
DEFAULT_RUN = {"gguf bytes": 15, "gguf fields": 8, "hf folder": 20}   # a few seconds
SLOW_RUN = int(os.environ.get("MHA_JAX_FUZZ_EXAMPLES", "1500"))       # per reader


# gguf bytes: slow (the field fuzzer mutates the same tiny GGUF in the default run)
@pytest.mark.parametrize("target", [pytest.param(t, marks=pytest.mark.slow)
                                    if t == "gguf bytes" else t for t in FUZZERS])
def test_mutated_model_files_import_or_are_refused_naming_the_file(tmp_path, target):
  FUZZERS[target](str(tmp_path), DEFAULT_RUN[target])
  _no_bugs(target)


@pytest.mark.slow
@pytest.mark.parametrize("target", list(FUZZERS))
def test_mutated_model_files_longer_run(tmp_path, target, monkeypatch):
  monkeypatch.setitem(TRACE, "on", True)
  FUZZERS[target](str(tmp_path), SLOW_RUN)
  _no_bugs(target)


@pytest.mark.slow
def test_the_smollm2_header_mutated_in_place(tmp_path, monkeypatch):
  """The real SmolLM2 GGUF (49,152 tokens, 30 layers, Q4_1), copied once; each example
  overwrites bytes of its header in place (lengths, counts, dims, types: no shift, so
  the tensors stay where the header says) and imports the header (read_header: the
  metadata, the vocabulary and the tensor infos), then puts the bytes back."""
  from mha_jax.pretrained import gguf_file, registry
  src = registry.find_model("smollm2-135m")
  path = str(tmp_path / "smollm2.gguf")
  shutil.copyfile(src, path)
  hot = fz.gguf_header_length(path)
  with open(path, "rb") as f:
    header = f.read(hot)
  monkeypatch.setitem(TRACE, "on", True)

  @_fuzz_settings(max(SLOW_RUN // 10, 20))
  @given(st.data())
  def run(d):
    mutated = d.draw(fz.byte_mutation(header, hot).filter(lambda b: len(b) == len(header)))
    with open(path, "r+b") as f:
      f.write(mutated)
    try:
      outcome(path, "smollm2 header", size=hot, read=gguf_file.read_header)
    finally:
      with open(path, "r+b") as f:
        f.write(header)
  run()
  _no_bugs("smollm2 header")


# ------------------------------------------------------------------ what the fuzzing found

def _cfg_folder(tmp_path, **change):
  import json
  folder = fz.make_folder(HF_SEED, str(tmp_path / "m"), {})
  cfg = json.load(open(os.path.join(folder, "config.json")))
  cfg.update(change)
  with open(os.path.join(folder, "config.json"), "w") as f:
    json.dump(cfg, f)
  return folder


def test_a_header_that_claims_two_to_the_forty_elements_is_refused_before_allocating(
    tmp_path):
  """A GGUF tensor of 2^20 x 2^20 (4 TB as float32) and a config.json of 10^12 layers:
  refused, having allocated far less than a megabyte per claimed gigabyte."""
  path = str(tmp_path / "m.gguf")
  fz.write_gguf_changed(GGUF_SEED, path, {}, {"token_embd.weight": "huge"})
  with pytest.raises(UserError, match="m.gguf"):
    importer.read_model(file=path)
  assert outcome(path, "claims") != "ok"
  for key in ("num_hidden_layers", "hidden_size", "vocab_size", "intermediate_size"):
    assert outcome(_cfg_folder(tmp_path, **{key: 2 ** 40}), "claims") != "ok"
  _no_bugs("claims")


def test_a_folder_with_only_a_pickle_is_refused_saying_why_and_nothing_unpickles(
    tmp_path, monkeypatch):
  import pickle
  folder = fz.make_folder(HF_SEED, str(tmp_path / "m"), {"model.safetensors": None})
  with open(os.path.join(folder, "pytorch_model.bin"), "wb") as f:
    f.write(b"not read")
  for mod in (pickle,):
    monkeypatch.setattr(mod, "load", lambda *a, **k: pytest.fail("unpickled"))
    monkeypatch.setattr(mod, "loads", lambda *a, **k: pytest.fail("unpickled"))
  with pytest.raises(UserError) as e:
    importer.read_model(file=folder)
  text = str(e.value)
  assert "pytorch_model.bin" in text and "pickle" in text and "safetensors" in text, text
