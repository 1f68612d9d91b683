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


# ------------------------------------------- the benchmarks that were scripts/*.py


@pytest.mark.slow    # a 2048 matmul's rate, the revision's package imported, four compiles
def test_bench_ab_attention_compares_a_revision_with_the_tree(tmp_path, capsys):
  out = tmp_path / "ab.json"
  assert cli.main(["bench", "ab-attention", "HEAD", "--heads", "2", "--d-model", "8",
                   "--seq-len", "4", "--batch", "1", "--rounds", "2",
                   "--out", str(out)]) == 0, capsys.readouterr().err
  doc = json.loads(out.read_text())
  assert doc["config"]["rev"] == "HEAD" and doc["config"]["heads"] == [2]
  rows = {r["impl"]: r for r in doc["rows"]}
  assert set(rows) == {"mha_jax at HEAD", "mha_jax now", "flax.linen MHDPA",
                       "linen + jax.nn.dot_product_attention"}
  peer = min(r["median_ms"] for n, r in rows.items() if not n.startswith("mha_jax"))
  for r in rows.values():
    assert len(r["times_ms"]) == 2
    assert r["median_ms"] == pytest.approx(float(np.median(r["times_ms"])))
    assert r["ratio_to_best_peer"] == pytest.approx(r["median_ms"] / peer)


def test_bench_ab_attention_refuses_a_bad_revision_or_width(tmp_path, capsys):
  out = tmp_path / "ab.json"
  assert cli.main(["bench", "ab-attention", "no-such-rev", "--out", str(out)]) == 2
  assert "rev 'no-such-rev' is not a revision" in capsys.readouterr().err
  assert cli.main(["bench", "ab-attention", "--heads", "3", "--d-model", "8",
                   "--out", str(out)]) == 2
  assert "--heads [3] do not divide --d-model 8" in capsys.readouterr().err


def _plan(h: int, data: int) -> dict:
  """A planted plan.json of `mha-jax plan` (the keys plan-heads reads)."""
  step = {"name": "train_step", "attention_kernels": [f"k{h}"], "flops": 10.0 * h,
          "bytes_accessed": 3.0 * h, "per_device": {"total": 100 + h, "temp": h},
          "memory_spaces": {"hbm": h}, "est_seconds": 0.5}
  return {"programs": [step], "params": {"count": 1000 + h}, "mesh": {"data": data},
          "jax": "j", "libtpu": "l", "date": "d", "device_kind": "TPU v5 lite"}


def test_bench_plan_heads_collects_the_plans_with_their_scores_bytes(tmp_path, capsys,
                                                                    monkeypatch):
  from mha_jax import config as mc
  from builders import ROOT
  monkeypatch.chdir(ROOT)                 # configs/lm.py, as the benchmark reads it
  plans, out = tmp_path / "plans", tmp_path / "summary.json"
  for impl, h in (("reference", 8), ("auto", 96)):
    (plans / f"{impl}_h{h}").mkdir(parents=True)
    (plans / f"{impl}_h{h}" / "plan.json").write_text(json.dumps(_plan(h, data=4)))
  assert cli.main(["bench", "plan-heads", "--plans", str(plans), "--collect",
                   "--out", str(out)]) == 0, capsys.readouterr().err
  doc = json.loads(out.read_text())
  assert [(r["impl"], r["heads"], r["d_k"]) for r in doc["rows"]] == [
      ("reference", 8, 96), ("auto", 96, 8)]           # the ends first, as ORDER runs
  for r in doc["rows"]:
    h = r["heads"]
    cfg = mc.load_config(f"configs/lm.py:heads={h},d_model=768")
    want = (cfg.train.batch_size // 4) * h * cfg.model.max_len ** 2 * 4 * cfg.model.num_layers
    assert r["scores_bytes"] == want and r["params"] == 1000 + h
    assert r["kernels"] == [f"k{h}"] and r["train_step"]["total"] == 100 + h
  assert (doc["topology"], doc["mesh"], doc["device_kind"]) == ("v5e:2x2", {"data": 4},
                                                                "TPU v5 lite")
  assert cli.main(["bench", "plan-heads", "--plans", str(tmp_path / "none"), "--collect",
                   "--out", str(out)]) == 2
  assert "--plans: no plan.json under" in capsys.readouterr().err


@pytest.mark.slow    # compiles the (tiny) quickstart step for 1 seed and for 2 vmapped
def test_bench_seeds_times_one_step_against_the_vmapped_seeds(tmp_path, capsys):
  from builders import TINY_TRANSLATION
  out = tmp_path / "seeds.json"
  assert cli.main(["bench", "seeds", "--seeds", "2", "--step-rounds", "2", "--out", str(out),
                   *TINY_TRANSLATION, "--config.train.batch_size=4"]) == 0, \
      capsys.readouterr().err
  doc = json.loads((tmp_path / "seeds.json.steps.json").read_text())   # no --out yet
  assert (doc["seeds"], doc["rounds"]) == (2, 2)
  assert doc["ratio"] == pytest.approx(doc["n_seeds_ms"] / doc["one_seed_ms"])
  assert doc["machine"]["cpu_count"] > 0


def test_bench_seeds_refuses_an_earlier_run_before_training(tmp_path, capsys):
  out = tmp_path / "seeds.json"
  (tmp_path / "wd" / "seeds_2").mkdir(parents=True)
  assert cli.main(["bench", "seeds", "--seeds", "2", "--workdir", str(tmp_path / "wd"),
                   "--out", str(out)]) == 2
  assert "--workdir" in capsys.readouterr().err and not out.exists()
  assert cli.main(["bench", "seeds", "--out", str(out), "--config.no.such=1"]) == 2


@pytest.mark.slow    # three processes: transformers builds the folder, import, forward
def test_bench_moe_import_imports_the_tiny_moe_and_runs_it(tmp_path, capsys):
  from mha_jax.harness.benchmarks import bench_moe_import as moe
  out = tmp_path / "moe.json"
  assert cli.main(["bench", "moe-import", "--model", "tiny", "--layers", "1",
                   "--out", str(out)]) == 0, capsys.readouterr().err
  doc = json.loads(out.read_text())
  assert doc["config"] == {**moe.TINY_OLMOE, "num_hidden_layers": 1}
  assert "failed" not in doc["import"] and "failed" not in doc["forward_process"], doc
  assert doc["logits_finite"] is True and doc["import"]["peak_rss_gb"] > 0


@pytest.mark.slow    # generates with both libraries (compiles a decode per length)
def test_bench_models_times_the_model_against_transformers(tiny_hf_folder, tmp_path,
                                                           capsys):
  wd, out = str(tmp_path / "wd"), tmp_path / "models.json"
  assert cli.main(["import", "--file", tiny_hf_folder, "--workdir", wd]) == 0
  assert cli.main(["bench", "models", "--workdir", wd, "--batches", "1,2", "--seq-lens", "8",
                   "--new-tokens", "3", "--rounds", "1", "--out", str(out)]) == 0, \
      capsys.readouterr().err
  doc = json.loads(out.read_text())
  assert doc["logits_rel_err_vs_transformers"] < 1e-4     # the same weights on both sides
  assert {(r["impl"], r["batch"]) for r in doc["rows"]} == {
      (i, b) for i in ("mha-jax", "transformers") for b in (1, 2)}
  for r in doc["rows"]:
    b = r["batch"]
    assert r["forward_tok_s"] == pytest.approx(b * 8 / r["forward_s"])
    assert r["decode_tok_s"] == pytest.approx(b * 2 / max(r["generate_n_s"] -
                                                          r["generate_1_s"], 1e-9))


@pytest.mark.slow    # three fresh processes of `mha-jax analyze`
def test_bench_compile_cache_runs_each_command_three_times(ind_run, tmp_path, capsys):
  out = tmp_path / "cc.json"
  assert cli.main(["bench", "compile-cache", "--workdir", ind_run, "--commands", "analyze",
                   "--out", str(out)]) == 0, capsys.readouterr().err
  r = json.loads(out.read_text())["commands"]["analyze"]
  assert r["argv"][:3] == ["analyze", "--workdir", ind_run]
  assert r["no_cache"]["compiled"] == 0 < r["first"]["compiled"]     # nothing cached when off
  assert r["second"]["loaded"] > 0 and r["cache_bytes"] > 0


@pytest.mark.slow    # SmolLM2-135M: the IOI head sweep and AtP
def test_bench_patching_times_the_sweep_and_atp(smollm2_workdir, tmp_path, capsys):
  out = tmp_path / "patching.json"
  assert cli.main(["bench", "patching", "--workdir", smollm2_workdir, "--pairs", "2",
                   "--rounds", "1", "--out", str(out)]) == 0, capsys.readouterr().err
  doc = json.loads(out.read_text())
  assert doc["pairs"] == 2 and doc["sweep"].endswith("270 heads")    # 30 layers x 9
  a = doc["atp"]
  assert a["ratio_to_forward_backward"] == pytest.approx(a["median_s"] /
                                                         a["forward_backward_s"])
  assert "| mha-jax (one compiled program) |" in doc["table"]


@pytest.mark.slow    # SmolLM2-135M: `mha-jax circuit` on a MIB task as a fresh process
def test_bench_mib_circuit_runs_a_task_as_the_circuit_verb(smollm2_workdir, tmp_path, capsys):
  out = tmp_path / "mib.json"
  assert cli.main(["bench", "mib-circuit", "--workdir", smollm2_workdir, "--skip-timing",
                   "--tasks", "mib-ioi", "--model", "smollm2", "--out", str(out)]) == 0, \
      capsys.readouterr().err
  t = json.loads(out.read_text())["tasks"]["mib-ioi"]
  assert t["model"] == "smollm2" and t["argv"][:4] == ["circuit", "--workdir",
                                                       smollm2_workdir, "--task"]
  assert t["graph"]["edges"] > 0 and 0 < t["pairs"] <= 8


@pytest.mark.slow    # imports SmolLM2-135M, then two Jupyter kernels
def test_bench_notebook_times_a_fresh_kernel_to_the_first_view(tmp_path, capsys):
  pytest.importorskip("jupyter_client")
  out, ci = tmp_path / "nb.json", tmp_path / "ci.json"
  ci.write_text(json.dumps({"seconds": {"a": 1.0}}))
  assert cli.main(["bench", "notebook", "--repeats", "1", "--ci-json", str(ci),
                   "--out", str(out)]) == 0, capsys.readouterr().err
  doc = json.loads(out.read_text())
  assert doc["ci"] == {"seconds": {"a": 1.0}} and len(doc["cold"]) == len(doc["warm"]) == 1
  for r in doc["cold"] + doc["warm"]:
    assert 0 < r["kernel_ready_s"] <= r["first_view_s"]


def test_bench_eap_peer_without_the_peers_says_how_to_add_them(tmp_path, capsys,
                                                               monkeypatch):
  import importlib.util
  real = importlib.util.find_spec
  monkeypatch.setattr(importlib.util, "find_spec",
                      lambda name, *a: None if name in ("eap", "MIB_circuit_track")
                      else real(name, *a))
  out = tmp_path / "peer.json"
  assert cli.main(["bench", "eap-peer", "--workdir", str(tmp_path), "--out", str(out)]) == 2
  err = capsys.readouterr().err
  assert "eap, MIB_circuit_track are not importable" in err and "PYTHONPATH" in err
  assert not out.exists()


@pytest.mark.slow    # SmolLM2-135M's edges by the EAP-IG library (the peers on PYTHONPATH)
def test_bench_eap_peer_agrees_with_the_library(smollm2_workdir, tmp_path, capsys):
  pytest.importorskip("eap")
  pytest.importorskip("MIB_circuit_track")
  out = tmp_path / "peer.json"
  assert cli.main(["bench", "eap-peer", "--workdir", smollm2_workdir, "--pairs", "2",
                   "--steps", "2", "--methods", "eap", "--no-mib-eval",
                   "--out", str(out)]) == 0, capsys.readouterr().err
  a = json.loads(out.read_text())["methods"]["eap"]["mib_graph"]
  assert a["pearson"] > 0.999 and a["top100"] >= 95


@pytest.mark.slow    # the 1B run's path at test size: three fresh processes and torch
def test_bench_scale_1b_path_at_test_size_matches_torch_hooks(tmp_path, capsys):
  """A random transformers Llama (2 layers, width 64) with SmolLM2's tokenizer saved
  sharded in bf16, imported, then `patch --sites head_out` and `circuit --method eap-ig`
  on 4 IOI pairs with a memory budget; the head table equals torch forward hooks on the
  same transformers model; the weights' std is the --init-range setting."""
  pytest.importorskip("torch")
  out = tmp_path / "scale.json"
  assert cli.main(["bench", "scale-1b", "--shape", "tiny", "--work", str(tmp_path / "w"),
                   "--budget", "64MB", "--sample", "6", "--out", str(out)]) == 0, \
      capsys.readouterr().err
  doc = json.loads(out.read_text())
  assert doc["import"]["rc"] == doc["patch"]["rc"] == doc["circuit"]["rc"] == 0
  ref = doc["reference"]
  assert len(ref["heads"]) == 5 and ref["max_abs_diff"] < 1e-4
  assert ref["ld_clean"] != ref["ld_corrupt"]
  assert doc["patch_plan"]["bytes"] <= 64 * 10**6
  mem = doc["circuit_summary"]["memory_budget"]
  assert mem["bytes"] == 64 * 10**6 and mem["eap_ig"]["bytes"] <= 64 * 10**6
  # the model's weights have the setting's std (transformers' initializer_range, default
  # 0.1: recovery divides by the clean-corrupt gap, which the torch run measures too)
  cfg = json.loads((tmp_path / "w" / "hf" / "config.json").read_text())
  assert cfg["initializer_range"] == doc["initializer_range"] == 0.1
  assert abs(doc["gap"] - (ref["ld_clean"] - ref["ld_corrupt"])) < 1e-4
  # a --work built with another std is refused by name, not mixed into the results
  assert cli.main(["bench", "scale-1b", "--shape", "tiny", "--work", str(tmp_path / "w"),
                   "--init-range", "0.02", "--no-circuit"]) == 2
  assert "initializer_range 0.1, not --init-range 0.02" in capsys.readouterr().err
