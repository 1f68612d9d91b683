"""The results pages read a file's machine from the one record (mha_jax.machine.machine)
and from the records the committed files were written with before it (measurements,
never rewritten): each page below, both ways."""

import ast
import json
import pathlib
import shutil
import sys

import pytest

from mha_jax.machine import machine

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
import docs_results  # noqa: E402

# A record no machine here writes, so a page that shows it read the record.
NEW = {"backend": "tpu", "device_kind": "TPU v9", "device_count": 8, "cpu_count": 96,
       "cores_used": 48, "platform": "TestOS-1.0", "python": "3.99.0", "jax": "9.9.9",
       "date": "2031-01-02 03:04 UTC", "load_average": [1.5, 2.5, 3.5], "matmul_gflops": 4321.0}
# The machine facts the older files keep at their top level.
OLD_TOP = ("backend", "cpus", "cpu_count", "devices", "cores_used", "jax", "date",
           "matmul_gflops", "load_average", "processor")
FILES = ("bench_train_cpu.json", "bench_seeds_cpu.json", "variants/compare.json",
         "compile_cache.json", "bench_patching_cpu.json", "taxonomy/gemma3/roles.json",
         "taxonomy/text/role_steps.json")


def pages(docs) -> str:
  return "\n".join(f(docs) for f in (docs_results.training_step_page, docs_results.seeds_page,
                                     docs_results.variants_page, docs_results.commands_page,
                                     docs_results.taxonomy_page))


def as_new(d: dict, **extra) -> dict:
  """The file as its writer writes it now: the one record under "machine", none of the
  older keys."""
  out = {k: v for k, v in d.items() if k not in OLD_TOP}
  out["machine"] = {**NEW, **extra}
  if "merged" in out:
    out["merged"] = [{**run, "machine": {**NEW, **extra}} for run in out["merged"]]
  return out


def as_old(d: dict, top: tuple, name: str = "machine") -> dict:
  """A file rewritten since with the one record, as its writer wrote it before: the
  record's `top` keys at the top level and platform.machine()'s string as "machine"."""
  m = d.get("machine")
  if not isinstance(m, dict):
    return d
  out = {k: v for k, v in d.items() if k != "machine"}
  out.update({k: m[k] for k in top if k in m})
  if "matmul_gflops" in m:
    out["matmul_gflops_before"] = m["matmul_gflops"]
    out["matmul_gflops_after"] = m.get("matmul_gflops_after", m["matmul_gflops"])
  out[name] = "x86_64"
  return out


@pytest.fixture
def docs(tmp_path):
  shutil.copytree(ROOT / "docs" / "results", tmp_path / "results")
  return tmp_path


@pytest.fixture
def old_docs(docs):
  """The results with the files written since in the one record put back in the shapes
  their writers used before (the readers must take both)."""
  for f, top in (("compile_cache.json", ("jax", "cpu_count")),
                 ("bench_patching_cpu.json", ("jax", "backend", "cpu_count", "cores_used",
                                              "date", "load_average"))):
    path = docs / "results" / f
    path.write_text(json.dumps(as_old(json.loads(path.read_text()), top)))
  return docs


def test_the_fake_record_and_the_reader_have_the_record_s_keys():
  assert NEW.keys() == machine(matmul_gflops=1.0).keys() == set(docs_results.MACHINE_KEYS)


def test_pages_read_the_committed_files_older_records(old_docs):
  docs = old_docs
  old = {f: json.loads((docs / "results" / f).read_text()) for f in FILES}
  text = pages(docs)
  t, s = old["bench_train_cpu.json"], old["bench_seeds_cpu.json"]
  assert f"{t['backend']}, {t['cpus']} cores, matmul rate {t['matmul_gflops']:.0f} GFLOP/s" in text
  assert f"{s['backend']}, {s['cpus']} cores" in text
  c = old["variants/compare.json"]
  assert isinstance(c["machine"], str) and f"Machine: {c['machine']}; {c['date']}." in text
  cc, bp = old["compile_cache.json"], old["bench_patching_cpu.json"]
  assert f"jax {cc['jax']}, {cc['machine']}, {cc['cpu_count']} cores" in text
  assert (f"jax {bp['jax']}, {bp['cores_used']} of {bp['cpu_count']} cores, load average "
          f"{bp['load_average'][0]:.1f}, {bp['date']}") in text
  m = old["taxonomy/gemma3/roles.json"]["machine"]
  before, after = m["matmul_gflops"]                       # the older [before, after]
  assert (f"{m['written']}, {m['platform']}, {m['cpu_count']} CPUs ({m['device']}); float32 "
          f"matmul {before:.0f} / {after:.0f} GFLOP/s") in text
  m = old["taxonomy/text/role_steps.json"]["machine"]
  assert f"{m['written']}, {m['platform']}, {m['cpu_count']} CPUs ({m['device']}); " in text


def test_pages_read_the_one_record(docs):
  for f in FILES:
    path = docs / "results" / f
    extra = {"matmul_gflops_after": 1234.0} if f.endswith("roles.json") else {}
    path.write_text(json.dumps(as_new(json.loads(path.read_text()), **extra)))
  text = pages(docs)
  assert "tpu, 96 cores, matmul rate 4321 GFLOP/s" in text                 # training step
  assert "batch 64 per seed, tpu, 96 cores" in text                         # seeds
  assert "Machine: TestOS-1.0, 96 cores (tpu); 2031-01-02 03:04 UTC." in text   # variants
  assert "jax 9.9.9, TestOS-1.0, 96 cores, shared" in text                  # compile cache
  assert "jax 9.9.9, 48 of 96 cores, load average 1.5, 2031-01-02 03:04 UTC." in text
  assert ("2031-01-02 03:04 UTC, TestOS-1.0, 96 CPUs (tpu); float32 matmul 4321 / 1234 "
          "GFLOP/s before / after") in text                                 # taxonomy
  assert text.count("2031-01-02 03:04 UTC, TestOS-1.0, 96 CPUs (tpu)") == 2  # + role steps


def test_machine_of_renames_the_older_keys_and_keeps_the_record():
  rec = machine(matmul_gflops=2.0)
  assert docs_results.machine_of({"rows": [], "machine": rec}) == rec
  old = docs_results.machine_of({"cpus": 2, "devices": 1, "backend": "cpu", "machine": "x86_64",
                                 "matmul_gflops": 50.0, "rows": []})
  assert old == {"cpu_count": 2, "device_count": 1, "backend": "cpu",
                 "description": "x86_64", "matmul_gflops": 50.0}
  assert docs_results.machine_of({"machine": {"machine": "x86_64", "cpu_count": 2, "date": "d",
                                              "load_average_1_5_15": [1.0, 2.0, 3.0]}}) == {
      "description": "x86_64", "cpu_count": 2, "date": "d", "load_average": [1.0, 2.0, 3.0]}


# Writers not yet on the one record: the lead's files on main, converted when they land.


def _is_record(node) -> bool:
  """machine(...) (or machine.machine(...)), or {**machine(...), more keys}: the one
  record (a name holding one is trusted)."""
  call = lambda n: (isinstance(n, ast.Call) and (
      isinstance(n.func, ast.Name) and n.func.id == "machine"
      or isinstance(n.func, ast.Attribute) and n.func.attr == "machine"
      and isinstance(n.func.value, ast.Name) and n.func.value.id == "machine"))
  return (call(node) or isinstance(node, ast.Name)
          or isinstance(node, ast.Dict) and any(k is None and call(v)
                                               for k, v in zip(node.keys, node.values)))


def own_records(source: str) -> list[int]:
  """Lines where `source` writes a "machine" that is not the one record: a dict entry
  `"machine": ...` or an assignment `doc["machine"] = ...`."""
  bad = []
  for n in ast.walk(ast.parse(source)):
    pairs = []
    if isinstance(n, ast.Dict):
      pairs = [(k, v) for k, v in zip(n.keys, n.values)]
    elif isinstance(n, ast.Assign):
      pairs = [(t.slice, n.value) for t in n.targets if isinstance(t, ast.Subscript)]
    bad += [v.lineno for k, v in pairs if isinstance(k, ast.Constant)
            and k.value == "machine" and not _is_record(v)]
  return sorted(bad)


def test_every_writer_uses_the_one_record():
  bad = [f"{p.relative_to(ROOT)}:{line}" for d in ("mha_jax", "scripts")
         for p in sorted((ROOT / d).rglob("*.py"))
         for line in own_records(p.read_text())]
  assert bad == []
  assert own_records('d = {"machine": platform.machine()}\nd["machine"] = {"cpus": 2}\n'
                     'ok = {"machine": machine(), "m": {**machine(), "load": "x"}}') == [1, 2]
