"""The benchmarks of `mha-jax bench NAME` (mha_jax/harness/benchmarks/), each run through
`mha_jax.cli.main` at tiny sizes: what they write is checked against numbers computed
here (FLOPs from the shapes, head counts from the checkpoints), never against a time."""

import json
import os

import numpy as np
import pytest

import mha_jax
from mha_jax import cli
from mha_jax.models import common
from mha_jax.pruning import prune as prune_lib

# On the worker that trains conftest's ind_run (setup.cfg: --dist loadgroup).
pytestmark = pytest.mark.xdist_group("trained_runs")


def test_every_benchmark_is_a_bench_verb_with_flags_from_its_options():
  from mha_jax.harness import benchmarks
  cli.build_parser()
  for name in benchmarks.NAMES:
    verb = cli.BENCH[name]
    assert verb.opts.__name__.endswith("Options") and verb.help
    assert "out" in {s.name for s in verb.specs()}


@pytest.mark.slow    # compiles five forward+backward programs per h and times a 2048 matmul
def test_bench_attention_parts_counts_each_parts_flops(tmp_path, capsys):
  out = tmp_path / "parts.json"
  d, t, b = 16, 8, 1
  assert cli.main(["bench", "attention-parts", "--heads", "2,4", "--d-model", str(d),
                   "--seq-len", str(t), "--batch", str(b), "--rounds", "1",
                   "--out", str(out)]) == 0, capsys.readouterr().err
  doc = json.loads(out.read_text())
  proj = 4 * 2 * b * t * d * d               # x @ W_Q, W_K, W_V and the heads @ W_O
  core = 2 * 2 * b * t * t * d               # scores and mixing, over all heads
  w_o = 2 * b * t * d * d                    # dead in the gradient of <y, ct>
  want = {"layer": 3 * (proj + core) - w_o, "projections": 3 * proj - w_o,
          "core": 3 * core, "bare matmuls": 2 * proj}
  assert list(doc["heads"]) == ["2", "4"]
  for h, r in doc["heads"].items():
    for name, flops in want.items():
      assert r["rows"][name]["gflop"] == pytest.approx(flops / 1e9), (h, name)
    assert r["rows"]["layer"]["share_of_layer"] == 1.0
    med = {n: row["median_ms"] for n, row in r["rows"].items()}
    assert r["ratio_to_linen"] == pytest.approx(med["flax.linen MHDPA"] / med["layer"])
    assert r["rest_ms"] == pytest.approx(med["layer"] - med["projections"] - med["core"])
  assert doc["machine"]["backend"] and "| 4 | layer |" in capsys.readouterr().out


def test_bench_pruned_times_the_dense_run_against_its_export(ind_run, tmp_path, capsys):
  loaded = mha_jax.load(ind_run)
  counts = common.head_counts(loaded.params)
  mask = {s: [np.asarray([1.0, 1.0] + [0.0] * (n - 2), np.float32) for n in layers]
          for s, layers in counts.items()}
  masked, exported = str(tmp_path / "masked"), str(tmp_path / "exported")
  prune_lib.save_pruned(loaded, masked, loaded.params, mask, {"method": "manual"}, 0,
                        log=lambda s: None)
  prune_lib.export_pruned(mha_jax.load(masked), exported, log=lambda s: None)
  out = tmp_path / "pruned.json"
  assert cli.main(["bench", "pruned", "--dense", ind_run, "--pruned", exported,
                   "--batch", "2", "--seq-len", "8", "--rounds", "2",
                   "--out", str(out)]) == 0, capsys.readouterr().err
  doc = json.loads(out.read_text())
  assert doc["head_counts"] == {"dense": counts,
                                "pruned": {s: [2] * len(c) for s, c in counts.items()}}
  assert doc["stacks"] == list(counts)
  assert [r["part"] for r in doc["rows"]] == ["attention", "model"]
  for r in doc["rows"]:
    assert r["speedup"] == pytest.approx(r["dense_ms"] / r["pruned_ms"])
    assert len(doc["times_ms"][f"{r['part']}/dense"]) == 2
  # the same run as both: nothing was pruned, and the bench says so naming its flags
  assert cli.main(["bench", "pruned", "--dense", ind_run, "--pruned", ind_run,
                   "--out", str(tmp_path / "x.json")]) == 2
  assert "--pruned has the same head counts as --dense" in capsys.readouterr().err


def _allowed_pairs(t: int, window: int) -> int:
  """Causal (query, key) pairs with i - j < window, counted from the band itself."""
  i, j = np.meshgrid(np.arange(t), np.arange(t), indexing="ij")
  return int(((j <= i) & (i - j < window)).sum())


@pytest.mark.slow    # one subprocess per (T, mode): four JAX start-ups
def test_bench_window_times_both_modes_and_counts_the_band(tmp_path, capsys):
  out = tmp_path / "window.json"
  assert cli.main(["bench", "window", "--seq-lens", "64,96", "--window", "16",
                   "--rounds", "1", "--out", str(out)]) == 0, capsys.readouterr().err
  doc = json.loads(out.read_text())
  rows = {(r["mode"], r["seq_len"]): r for r in doc["rows"]}
  assert set(rows) == {(m, t) for m in ("dense mask", "skipping") for t in (64, 96)}
  for (_, t), r in rows.items():
    assert r["status"] == "ok" and r["max_rss_mb"] > 0, r
    flops = 2.5 * 4 * 1 * 4 * 64 * _allowed_pairs(t, 16)    # B H K
    assert r["useful_gflops"] == pytest.approx(flops / (r["median_ms"] / 1e3) / 1e9)
  assert doc["config"]["window"] == 16 and doc["machine"]["matmul_gflops"] > 0


@pytest.mark.slow    # SmolLM2-135M's edge study
def test_bench_circuit_times_eap_against_one_forward_backward(smollm2_workdir, tmp_path,
                                                               capsys):
  out = tmp_path / "circuit.json"
  assert cli.main(["bench", "circuit", "--workdir", smollm2_workdir, "--pairs", "2",
                   "--steps", "1", "--rounds", "1", "--no-curve",
                   "--out", str(out)]) == 0, capsys.readouterr().err
  doc = json.loads(out.read_text())
  assert (doc["pairs"], doc["steps"], doc["eap_ig_bound"]) == (2, 1, 3)
  assert doc["eap_ratio"] == pytest.approx(doc["eap_s"] / doc["forward_backward_s"])
  assert doc["eap_ig_ratio"] == pytest.approx(doc["eap_ig_s"] / doc["forward_backward_s"])
  assert np.isnan(doc["curve_s"])                  # --no-curve
  assert f"| {doc['graph']['edges']} edges, 2 IOI pairs |" in doc["table"]


@pytest.mark.slow    # imports SmolLM2-135M and patches every head twice
def test_bench_bf16_drift_compares_the_two_dtypes_tables(tmp_path, capsys):
  out = tmp_path / "drift.json"
  assert cli.main(["bench", "bf16-drift", "--models", "smollm2-135m", "--pairs", "2",
                   "--out", str(out)]) == 0, capsys.readouterr().err
  (m,) = json.loads(out.read_text())["models"]
  assert (m["model"], m["pairs"]) == ("smollm2-135m", 2)
  for k in ("patch_head_out", "atp_head_out"):
    r = m[k]
    assert 0 <= r["top10_overlap"] <= 1 and -1 <= r["pearson"] <= 1
    assert 0 <= r["max_abs_diff"] and len(r["top10_float32"]) == 10
    # a table in bfloat16 weights stays near the float32 one: its largest entry's size
    assert r["max_abs_diff"] < r["max_abs_float32"]


def _llama_params(d: int, layers: int, heads: int, kv: int, f: int, v: int) -> int:
  """A LlamaForCausalLM's weights, counted from its config (untied head)."""
  k = d // heads
  per_layer = 2 * d * d + 2 * d * kv * k + 3 * d * f + 2 * d   # q, o; k, v; MLP; 2 norms
  return 2 * v * d + layers * per_layer + d                     # embed, lm_head; final norm


def test_bench_import_peak_writes_the_folder_and_states_the_bound(tmp_path, capsys):
  folder, out = str(tmp_path / "hf"), tmp_path / "peak.json"
  assert cli.main(["bench", "import-peak", "--shape", "tiny", "--dtype", "float32",
                   "--folder", folder, "--out", str(out)]) == 0, capsys.readouterr().err
  doc = json.loads(out.read_text())
  n = _llama_params(64, 2, 4, 2, 96, 256)
  shards = sorted(os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder)
                  if f.endswith(".safetensors"))
  assert (doc["params"], doc["model_bytes"]) == (n, 4 * n)
  assert doc["shards_bytes"] == shards and doc["largest_shard"] == shards[-1]
  assert doc["bound"] == int(1.3 * shards[-1] + 4 * n)
  assert doc["added_peak"] == doc["peak_rss"] - doc["base_rss"]
  assert doc["within_bound"] == (doc["added_peak"] <= doc["bound"])
