"""Workdirs on cloud storage (issue 15, item 5): every workdir file goes through
mha_jax.storage (etils.epath), so `--workdir gs://bucket/run` works; only process 0 writes.

The gs:// tests run offline against a fake bucket: fsspec's "gcs" protocol (what epath
uses for gs:// without TensorFlow) is replaced by a folder-backed filesystem, and orbax's
TensorStore spec for gs:// by a "file" spec into the same folder. Code that touched a
gs:// workdir through os/open would write a local folder named "gs:" instead, which
these tests look for.
"""

import ast
import importlib
import json
import os
import types

import jax
import pytest

import mha_jax
from mha_jax import cli as cli_mod
from mha_jax import storage
from mha_jax import tasks
from mha_jax.loader import load_config
from mha_jax.models import common
from mha_jax.train import loop
from builders import ROOT, TINY_INDUCTION, tiny

QUIET = dict(log=lambda s: None)

# ---------------------------------------------------------------------------
# (a) no module touches files through os/open/shutil/pathlib, except these uses,
# none of them a workdir.

FORBIDDEN_OS = {"makedirs", "mkdir", "listdir", "scandir", "walk", "replace", "rename",
                "renames", "remove", "unlink", "rmdir", "removedirs", "stat", "access",
                "chmod", "open", "path"}
FORBIDDEN_MODULES = {"shutil", "pathlib", "tempfile"}
ALLOWED = {   # (module, what it calls): why it is not workdir I/O
    ("mha_jax/storage.py", "*"): "the one module that does workdir I/O",
    ("mha_jax/config.py", "os.path"): "config files (Python) found and imported by path",
    ("mha_jax/kernels/dispatch.py", "open"): "/proc/meminfo, for the memory budget",
    ("mha_jax/harness/", "*"): "the experiment harness, a user of the library: the "
        "benchmarks' local result files and scratch folders, /proc readings",
    ("mha_jax/pretrained/registry.py", "os.path"): "model files inside pip packages",
    ("mha_jax/pretrained/hf_folder.py", "os.path"):
        "the user's --file folder, read by safetensors (a local file)",
    ("mha_jax/pretrained/hf_folder.py", "open"): "the user's --file folder's JSON files",
    ("mha_jax/pretrained/gguf_file.py", "os.path"):
        "the user's --file GGUF, memory-mapped by gguf (a local file)",
    ("mha_jax/machine.py", "open"): "/sys/kernel/mm/transparent_hugepage/defrag (THP mode)",
    ("mha_jax/compile_cache.py", "*"):
        "JAX's compilation cache folder on the local disk (never a workdir), /proc/cpuinfo",
    ("mha_jax/plan.py", "*"): "XLA's buffer-assignment dump in a local temporary folder",
    ("mha_jax/pretrained/importer.py", "*"):
        "the user's local model cache (load by name) and the user's local model files",
}


def file_io_calls(source: str) -> set[str]:
  """What a module's source uses to touch files directly: "open", "os.<name>",
  "os.path", "shutil", "pathlib", "tempfile", "savefig" (matplotlib to a path)."""
  found = set()
  for node in ast.walk(ast.parse(source)):
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and \
        node.func.id == "open":
      found.add("open")
    elif isinstance(node, ast.Attribute) and node.attr == "savefig" and not (
        isinstance(node.value, ast.Name) and node.value.id == "storage"):
      found.add("savefig")             # matplotlib writing to a path: storage.savefig
    elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
      if node.value.id == "os" and node.attr in FORBIDDEN_OS:
        found.add(f"os.{node.attr}")
      elif node.value.id in FORBIDDEN_MODULES:
        found.add(node.value.id)
    elif isinstance(node, (ast.Import, ast.ImportFrom)):
      names = ([a.name for a in node.names] if isinstance(node, ast.Import)
               else [node.module or ""])
      names += [f"{node.module}.{a.name}" for a in node.names] \
          if isinstance(node, ast.ImportFrom) else []
      for n in names:
        top = n.split(".")[0]
        if top in FORBIDDEN_MODULES:
          found.add(top)
        if n in ("os.path",) or (isinstance(node, ast.ImportFrom) and node.module == "os"):
          found.add("os.path")
  return found


def test_file_io_scan_flags_direct_file_access():
  snippets = {"open('x/config.json', 'w').write('{}')": {"open"},
              "import os\nos.makedirs(wd, exist_ok=True)": {"os.makedirs"},
              "import os\nos.path.exists(p)": {"os.path"},
              "import os\nos.replace(a, b)": {"os.replace"},
              "import shutil\nshutil.copytree(a, b)": {"shutil"},
              "from pathlib import Path\nPath(wd).write_text('x')": {"pathlib"},
              "fig.savefig(os.path.join(out, 'a.png'))": {"savefig", "os.path"},
              "from os import path\npath.join(a, b)": {"os.path"},
              "import os\nos.cpu_count(); os.environ.get('X')": set(),
              "from mha_jax import storage\nstorage.write_json(p, {})": set(),
              "storage.savefig(fig, p, dpi=90)": set()}
  for src, want in snippets.items():
    assert file_io_calls(src) == want, src


def test_no_module_touches_files_but_through_storage():
  pkg = os.path.join(ROOT, "mha_jax")
  offenders = {}
  for d, _, files in os.walk(pkg):
    for f in files:
      if not f.endswith(".py"):
        continue
      rel = os.path.relpath(os.path.join(d, f), ROOT)
      if any(rel == m or (m.endswith("/") and rel.startswith(m))
             for m, what in ALLOWED if what == "*"):
        continue
      calls = file_io_calls(open(os.path.join(d, f), encoding="utf-8").read())
      bad = sorted(c for c in calls if (rel, c) not in ALLOWED)
      if bad:
        offenders[rel] = bad
  assert offenders == {}, ("workdir I/O must go through mha_jax.storage "
                           f"(or be allow-listed in this test with a reason): {offenders}")
  assert len(ALLOWED) <= 12   # the allow-list stays short


# ---------------------------------------------------------------------------
# (b) a gs:// workdir, end to end, against a fake bucket.

@pytest.fixture
def fake_gcs(tmp_path, monkeypatch):
  """gs://... -> tmp_path/bucket/...; returns the folder that holds the buckets.
  The test runs in an empty current folder, where os/open on a gs:// string would
  leave a "gs:" folder."""
  import fsspec
  from etils.epath import backend
  from fsspec.implementations.dirfs import DirFileSystem
  from fsspec.implementations.local import LocalFileSystem
  from orbax.checkpoint._src.path import gcs_utils

  root = tmp_path / "buckets"
  root.mkdir()

  class FakeGCS(DirFileSystem):
    protocol = ("gs", "gcs")

    def __init__(self, *args, **kwargs):
      super().__init__(path=str(root), fs=LocalFileSystem())

    @classmethod
    def _strip_protocol(cls, path):
      path = str(path)
      for pre in ("gs://", "gcs://"):
        if path.startswith(pre):
          return path[len(pre):].rstrip("/")
      return path.rstrip("/")

  fsspec.register_implementation("gcs", FakeGCS, clobber=True)
  backend.fsspec_backend._get_filesystem.cache_clear()
  monkeypatch.setattr(gcs_utils, "get_kvstore_for_gcs", lambda p: {
      "driver": "file", "path": str(root / p[len("gs://"):])})
  # orbax asks google-cloud-storage whether the bucket has a hierarchical namespace
  monkeypatch.setattr(gcs_utils, "get_bucket", lambda name: types.SimpleNamespace(
      hierarchical_namespace_enabled=False))
  cwd = tmp_path / "cwd"
  cwd.mkdir()
  monkeypatch.chdir(cwd)
  yield root
  importlib.import_module("fsspec.registry")._registry.pop("gcs", None)
  backend.fsspec_backend._get_filesystem.cache_clear()
  assert os.listdir(cwd) == [], "something wrote a gs:// path as a local path"


def _files(folder):
  return sorted(os.path.relpath(os.path.join(d, f), folder)
                for d, _, fs in os.walk(folder) for f in fs)


GS_CFG = ("--config.train.steps=4", "--config.train.checkpoint_every=4",
          "--config.train.eval_every=100", "--config.train.log_every=2")


def test_gs_workdir_train_resume_load_eval_analyze(fake_gcs, capsys):
  wd = "gs://bucket/run"
  cfg = tiny("configs/induction.py", TINY_INDUCTION, *GS_CFG)
  loop.train(cfg, wd, **QUIET)
  files = _files(fake_gcs / "bucket" / "run")
  assert "config.json" in files and "metrics.jsonl" in files
  assert any(f.startswith("checkpoints/4/params/") for f in files)
  assert any(f.startswith("tb/events.out.tfevents") for f in files)
  rows = [json.loads(l) for l in storage.read_text(wd + "/metrics.jsonl").splitlines()]
  assert [r["step"] for r in rows if r["split"] == "train"] == [2, 4]   # appended
  loaded = mha_jax.load(wd)
  assert loaded.step == 4 and loaded.workdir == wd
  local = storage.read_json(str(fake_gcs / "bucket" / "run" / "config.json"))
  assert local["seed"] == cfg.seed
  # resume: the same command again finds the run and its checkpoint
  assert loop.train(cfg, wd, **QUIET)["step"] == 4
  assert cli_mod.main(["eval", "--workdir", wd, "--split", "valid"]) == 0
  assert json.loads(capsys.readouterr().out)["step"] == 4
  assert cli_mod.main(["analyze", "--workdir", wd, "--no-ablations"]) == 0
  files = _files(fake_gcs / "bucket" / "run")
  assert {"analysis/heads.json", "analysis/heads.csv", "analysis/summary.json",
          "analysis/roles.png", "analysis/explorer.html"} <= set(files)
  png = storage.read_bytes(wd + "/analysis/roles.png")
  assert png[:8] == b"\x89PNG\r\n\x1a\n"
  assert storage.read_json(wd + "/analysis/heads.json")[0]["head"] == "lm.0.0"


@pytest.mark.slow
def test_gs_workdir_ablate_prune_export_circuits(fake_gcs):
  wd = "gs://bucket/run"
  loop.train(tiny("configs/induction.py", TINY_INDUCTION, *GS_CFG), wd, **QUIET)
  assert cli_mod.main(["ablate", "--workdir", wd, "--heads", "lm.0.0"]) == 0
  assert cli_mod.main(["prune", "--workdir", wd, "--out", "gs://bucket/pruned",
                       "--method", "random", "--keep", "1", "--stacks", "lm"]) == 0
  pruned = _files(fake_gcs / "bucket" / "pruned")
  assert {"config.json", "pruning.json"} <= set(pruned)
  assert mha_jax.load("gs://bucket/pruned").step == 4
  assert cli_mod.main(["export-pruned", "--workdir", "gs://bucket/pruned",
                       "--out", "gs://bucket/exported"]) == 0
  assert sum(common.head_counts(mha_jax.load("gs://bucket/exported").params)["lm"]) == 1
  assert cli_mod.main(["circuits", "--workdir", wd, "--no-track"]) == 0
  files = _files(fake_gcs / "bucket" / "run")
  assert {"analysis/ablation_zero.json", "circuits/circuits.json"} <= set(files)


# ---------------------------------------------------------------------------
# (c) a process other than 0 writes nothing (orbax coordinates its own checkpoints).

class _NoCheckpoints:
  """Stands in for orbax, which decides for itself which process writes what."""

  def __init__(self, workdir, **kwargs):
    self.saved = []

  def latest_step(self):
    return None

  def all_steps(self):
    return []

  def save(self, step, *args, **kwargs):
    self.saved.append(step)

  save_params = save

  def close(self):
    pass


@pytest.mark.xdist_group("trained_runs")   # on the worker that trains ind_run
def test_process_1_writes_nothing(ind_run, tmp_path, monkeypatch):
  from mha_jax.train import checkpoint as ckpt_lib
  wd = ind_run                              # trained by process 0 (shared with test_workdirs and the rest)
  cfg = load_config(wd)
  cfg.train.steps = 4
  before = {f: os.path.getsize(os.path.join(wd, f)) for f in _files(wd)}
  assert "config.json" in before and "metrics.jsonl" in before

  monkeypatch.setattr(jax, "process_index", lambda *a: 1)
  assert not storage.is_writer()
  real = ckpt_lib.Checkpoints   # reading is real; what orbax would write is not simulated
  monkeypatch.setattr(ckpt_lib, "Checkpoints", lambda wd, **kw: real(wd, **kw)
                      if kw.get("read_only") else _NoCheckpoints(wd, **kw))
  # one process holds all the data: process 1 of 1 would get no rows
  orig = tasks.LMTask.train_batch
  monkeypatch.setattr(tasks.LMTask, "train_batch", lambda self, step, i, n:
                      orig(self, step, 0, 1))
  wd1 = str(tmp_path / "run_p1")
  assert loop.train(cfg, wd1, **QUIET)["step"] == 4
  assert not os.path.exists(wd1)
  # studies from an existing run: reports, ablations, pruned workdirs
  assert cli_mod.main(["analyze", "--workdir", wd, "--no-ablations"]) == 0
  out = str(tmp_path / "pruned")
  assert cli_mod.main(["prune", "--workdir", wd, "--out", out, "--method", "random",
                       "--keep", "1", "--stacks", "lm"]) == 0
  assert {f: os.path.getsize(os.path.join(wd, f)) for f in _files(wd)} == before
  assert not os.path.exists(out)
