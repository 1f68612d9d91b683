"""`mha-jax plan` on cpu:N (no libtpu needed): its param count against the accounting
module's, its temporaries against an analytic count of a reference-kernel program's
scores, a job planned twice, a job too big for the topology (fits false, exit 0), a bad
topology refused by name, the Hugging Face config's param shapes against the importer's,
and the verb through `mha_jax.cli.main`. The TPU topologies' tests are marked `tpu`
(pytest -m tpu, in an environment with libtpu)."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from builders import ROOT, with_devices

from mha_jax import accounting, attention, chips, cli, gpu_targets, plan
from mha_jax import config as mha_config
from mha_jax.errors import UserError

HAS_LIBTPU = importlib.util.find_spec("libtpu") is not None
LLAMA_8B = os.path.join(ROOT, "docs", "data", "llama-3.1-8b.config.json")


def _induction_plan(**kw):
  opts = plan.PlanOptions(topology="cpu:1", job=kw.pop("job", "forward"), **kw)
  return plan.make_plan(opts, config=os.path.join(ROOT, "configs", "induction.py"),
                        overrides=["--config.model.num_heads=8"])


def test_param_bytes_equal_the_accounting_modules_count():
  p = _induction_plan()
  # configs/induction.py: attention only, no LayerNorm, learned positions into Q and K;
  # embed (V, D), unembed (D, V), pos_embed (max_len, D) and L attention layers
  d, v, layers, max_len = 64, 64, 2, 49
  count = 2 * v * d + max_len * d + layers * accounting.attention_params(d, 8)
  assert p["params"] == {"count": count, "bytes": 4 * count}


def test_a_job_planned_twice_is_the_same_plan():
  a, b = _induction_plan(), _induction_plan()
  for k in ("date", "machine"):        # when, and the load average then
    a.pop(k), b.pop(k)
  for prog in a["programs"] + b["programs"]:   # how long the compile took
    prog.pop("compile_wall_s"), prog.pop("compile_cpu_s")
  assert a == b
  assert set(a) >= {"topology", "platform", "device_kind", "devices", "mesh", "job",
                    "params", "programs", "fits", "jax", "libtpu"}
  prog = a["programs"][0]
  assert set(prog) >= {"name", "flops", "bytes_accessed", "per_device", "fits",
                       "attention_kernels", "est_seconds"}
  assert set(prog["per_device"]) == {"arguments", "outputs", "temps", "total", "hbm"}
  assert prog["flops"] > 0 and prog["attention_kernels"]


def test_temps_hold_the_reference_kernels_scores():
  """The temporaries of a reference-kernel forward+backward hold its (B, H, T, S) scores
  (the weights are kept for the backward), and on CPU the buffer assignment's temps are
  what memory_analysis says."""
  topo = plan.topology("cpu:1")
  mesh = plan.sharding.make_mesh(1, 1, devices=topo.devices)
  b, t, d, h = 2, 256, 64, 4
  params = jax.eval_shape(lambda k: attention.init_attention_params(k, d, h),
                          jax.random.PRNGKey(0))
  x = jax.ShapeDtypeStruct((b, t, d), jnp.float32)

  def grad(p, x):
    return jax.grad(lambda p: jnp.sum(attention.multi_head_attention(
        p, x, x, impl="reference") ** 2))(p)
  prog = plan.compile_program("grad", grad, (params, x), topo, mesh)
  scores = accounting.score_memory_bytes(b, h, t)
  assert prog["per_device"]["temps"] >= scores
  compiled = jax.jit(grad).lower(params, x).compile()
  assert prog["per_device"]["temps"] == compiled.memory_analysis().temp_size_in_bytes
  assert prog["attention_kernels"] == ["reference"]


def test_flops_count_every_trip_of_a_loop():
  """XLA's cost analysis counts a while body once; the plan's FLOPs count the blocked
  kernel's key-block loop at every trip: within 2% of the analytic matmul count (the rest
  is the softmax's elementwise work), where XLA's own count is under half of it."""
  topo = plan.topology("cpu:1")
  mesh = plan.sharding.make_mesh(1, 1, devices=topo.devices)
  b, t, d, h = 2, 1024, 64, 4
  params = jax.eval_shape(lambda k: attention.init_attention_params(k, d, h),
                          jax.random.PRNGKey(0))
  x = jax.ShapeDtypeStruct((b, t, d), jnp.float32)
  prog = plan.compile_program("blocked", lambda p, x: attention.multi_head_attention(
      p, x, x, impl="blocked"), (params, x), topo, mesh)
  want = accounting.attention_flops(d, t, batch=b, num_heads=h)["total"]
  assert prog["loops"] and all(n and n > 1 for n in prog["loops"])
  assert want <= prog["flops"] <= 1.02 * want
  assert prog["xla_flops"] < want / 2


def test_matmul_flops_of_a_fori_loop():
  m, k, trips = 16, 32, 7
  f = lambda x, w: jax.lax.fori_loop(0, trips, lambda i, x: jnp.tanh(x @ w), x)
  hlo = jax.jit(f).lower(jnp.ones((m, k)), jnp.ones((k, k))).compile().as_text()
  got = plan.matmul_flops(hlo)
  assert got == {"once": 2 * m * k * k, "counted": 2 * m * k * k * trips, "loops": [trips]}


def test_a_job_too_big_is_a_plan_that_does_not_fit(tmp_path, capsys):
  """A config.json whose embeddings alone (16 Mi tokens x 8,192 floats, twice) pass any
  host's memory: fits false with the numbers, exit status 0."""
  with open(LLAMA_8B) as f:
    cfg = json.load(f)
  cfg.update(vocab_size=2**24, hidden_size=8192, num_hidden_layers=1,
             num_attention_heads=64, intermediate_size=256)
  src = tmp_path / "config.json"
  src.write_text(json.dumps(cfg))
  out = tmp_path / "plan"
  rc = cli.main(["plan", "--topology", "cpu:1", "--hf-config", str(src), "--job", "forward",
                 "--batch", "1", "--seq", "4", "--out", str(out)])
  assert rc == 0
  doc = json.loads((out / "plan.json").read_text())
  params = 2 * 2**24 * 8192 * 4
  assert doc["fits"] is False and doc["params"]["bytes"] >= params
  dev = doc["programs"][0]["per_device"]
  assert dev["arguments"] >= params and dev["total"] > dev["hbm"]
  assert doc["suggestion"]["fits"] is False
  assert "does not fit" in capsys.readouterr().out


def test_a_compile_refused_for_memory_is_a_plan_that_does_not_fit(monkeypatch):
  """libtpu refuses to compile a program whose temporaries pass the HBM (RESOURCE_EXHAUSTED,
  as Llama-3.1-8B's train step on v5e:2x4 did): the plan says fits false, with the
  compiler's temporaries and the arguments' bytes from their shapes."""
  msg = ("RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for HLO "
         "temporaries (37.86G) exceeds available HBM (15.75G).")

  def refuse(self, *a, **k):
    raise jax.errors.JaxRuntimeError(msg)
  monkeypatch.setattr(jax.stages.Lowered, "compile", refuse)
  p = _induction_plan(search=0)
  (prog,) = p["programs"]
  dev = prog["per_device"]
  assert p["fits"] is False and prog["fits"] is False and prog["flops"] is None
  assert dev["temps"] == int(37.86 * 2**30) and dev["arguments"] >= p["params"]["bytes"]
  assert dev["total"] >= dev["temps"] + dev["arguments"]
  assert "does not fit" in plan.format_plan(p)


def _counting_compiles(monkeypatch) -> list:
  """Every Lowered.compile call appended to the returned list (then compiled as usual)."""
  calls, real = [], jax.stages.Lowered.compile

  def count(self, *a, **k):
    calls.append(1)
    return real(self, *a, **k)
  monkeypatch.setattr(jax.stages.Lowered, "compile", count)
  return calls


def test_a_program_whose_arguments_pass_the_hbm_is_ruled_out_uncompiled(monkeypatch):
  """Arguments of 4 MiB per device against 1 MiB of HBM: fits false from the shapes,
  nothing lowered or compiled; the train step's least total adds its gradients (one
  float32 per param: global-norm clipping holds them all) to its arguments."""
  calls = _counting_compiles(monkeypatch)
  topo = dataclasses.replace(plan.topology("cpu:1"), hbm=2**20)
  mesh = plan.sharding.make_mesh(1, 1, devices=topo.devices)
  x = jax.ShapeDtypeStruct((1024, 1024), jnp.float32)
  prog = plan.compile_program("f", lambda x: x * 2, (x,), topo, mesh)
  assert prog["compiled"] is False and prog["fits"] is False and not calls
  assert prog["per_device"]["arguments"] == prog["per_device"]["total"] == 4 * 2**20
  count = 2 * 64 * 64 + 49 * 64 + 2 * accounting.attention_params(64, 8)
  opts = plan.PlanOptions(topology="cpu:1", job="train", search=0)
  p = plan.make_plan(opts, config=os.path.join(ROOT, "configs", "induction.py"),
                     overrides=["--config.model.num_heads=8"],
                     topo=dataclasses.replace(topo, hbm=int(3.5 * 4 * count)))
  train, ev = p["programs"]
  d = train["per_device"]
  assert train["compiled"] is False and d["total"] - d["arguments"] == 4 * count
  assert d["arguments"] >= 3 * 4 * count        # params and AdamW's two moments
  assert ev.get("compiled", True) and len(calls) == 1 and p["fits"] is False


@pytest.mark.slow  # default run: test_a_program_whose_arguments_pass_the_hbm_is_ruled_out_uncompiled
def test_the_search_skips_slices_ruled_out_from_shapes(monkeypatch):
  """suggest over made-up larger slices (cpu:1's device, each its own HBM): one whose
  arguments pass its HBM is skipped uncompiled and not counted against --search; one that
  passes the bound is compiled until its first program that does not fit (its eval step
  not compiled); the next, roomy, fits. With --search 0, nothing compiled: the first
  slice not ruled out is named as `next`."""
  calls = _counting_compiles(monkeypatch)
  base = plan.topology("cpu:1")
  hbm = {"cpu:1": 2**10, "tight": 2**10, "mid": None, "roomy": 2**40}
  probe = _induction_plan(job="train", search=0)
  train_total = probe["programs"][0]["per_device"]
  hbm["mid"] = train_total["arguments"] + 4 * (2 * 64 * 64 + 49 * 64 +   # + gradients
                                                2 * accounting.attention_params(64, 8)) + 64
  calls.clear()
  monkeypatch.setattr(plan, "larger", lambda name: ["tight", "mid", "roomy"])
  monkeypatch.setattr(plan, "topology", lambda name: dataclasses.replace(
      base, name=name, hbm=hbm[name]))
  p = _induction_plan(job="train", search=2)
  s = p["suggestion"]
  assert p["fits"] is False and s["fits"] is True and s["topology"] == "roomy"
  assert [(t["topology"], bool(t.get("ruled_out"))) for t in s["tried"]] == [
      ("tight", True), ("mid", False)]
  assert s["tried"][1]["total"] > hbm["mid"]
  assert len(calls) == 1 + 2          # mid's train step; roomy's train and eval steps
  calls.clear()
  s = _induction_plan(job="train", search=0)["suggestion"]
  assert s["fits"] is False and [t["topology"] for t in s["tried"]] == ["tight"]
  assert s["next"]["topology"] == "mid" and s["next"]["total"] <= hbm["mid"] and not calls


def test_study_jobs_budget_half_the_hbm_less_the_params():
  """A study job's chunks come from half the target's HBM less the params per device
  (float32 on cpu:1: 4 bytes a param); a default budget below one item is a plan that
  does not fit, uncompiled; a --memory-budget below one item is refused by name."""
  count = 2 * 64 * 64 + 49 * 64 + 2 * accounting.attention_params(64, 8)
  topo = dataclasses.replace(plan.topology("cpu:1"), hbm=2**30)
  cfg = dict(config=os.path.join(ROOT, "configs", "induction.py"),
             overrides=["--config.model.num_heads=8"])
  p = plan.make_plan(plan.PlanOptions(topology="cpu:1", job="patch", batch=4), topo=topo,
                     **cfg)
  assert p["programs"][0]["memory_budget"] == (2**30 - 4 * count) // 2
  small = dataclasses.replace(topo, hbm=2**20)
  p = plan.make_plan(plan.PlanOptions(topology="cpu:1", job="circuit", batch=4), topo=small,
                     **cfg)
  (prog,) = p["programs"]
  assert prog["compiled"] is False and prog["fits"] is False and p["fits"] is False
  assert "--memory-budget" in prog["ruled_out"] and prog["per_device"]["total"] > 4 * count
  with pytest.raises(UserError) as e:
    plan.make_plan(plan.PlanOptions(topology="cpu:1", job="circuit", batch=4,
                                    memory_budget="1KB"), topo=topo, **cfg)
  assert "memory_budget" in e.value.settings


def test_a_bad_topology_is_refused_by_name(tmp_path, capsys):
  rc = cli.main(["plan", "--topology", "v5x:2x2", "--config", "configs/induction.py",
                 "--out", str(tmp_path / "p")])
  err = capsys.readouterr().err
  assert rc == 2 and "'v5x:2x2'" in err and "v5e:2x2" in err and "cpu:N" in err
  assert not (tmp_path / "p").exists()


@pytest.mark.skipif(HAS_LIBTPU, reason="libtpu is installed here")
def test_a_tpu_topology_without_libtpu_says_how_to_get_it(tmp_path, capsys):
  rc = cli.main(["plan", "--topology", "v5e:2x2", "--config", "configs/induction.py",
                 "--out", str(tmp_path / "p")])
  assert rc == 2 and "pip install 'mha-jax[tpu]'" in capsys.readouterr().err


@pytest.mark.skipif(gpu_targets.plugin_installed(), reason="the CUDA plugin is installed")
def test_a_gpu_topology_without_the_plugin_says_how_to_get_it(tmp_path, capsys):
  rc = cli.main(["plan", "--topology", "h100:1", "--config", "configs/induction.py",
                 "--out", str(tmp_path / "p")])
  assert rc == 2 and "jax-cuda12-plugin==" in capsys.readouterr().err


@pytest.mark.gpu_compile
@pytest.mark.skipif(not gpu_targets.plugin_installed(), reason="needs the CUDA plugin")
def test_the_verb_on_a_compile_only_h100(tmp_path):
  """plan --topology h100:1 through the CLI: the H100's device kind and memory, FLOPs from
  gpu_targets.cost_analysis, a roofline time from mha_jax.chips."""
  out = tmp_path / "p"
  rc = cli.main(["plan", "--topology", "h100:1", "--config", "configs/induction.py",
                 "--config.model.num_heads=8", "--job", "forward", "--out", str(out)])
  assert rc == 0
  doc = json.loads((out / "plan.json").read_text())
  h100 = chips.CHIPS["h100"]
  assert (doc["platform"], doc["device_kind"], doc["devices"]) == ("gpu", h100.device_kind, 1)
  (prog,) = doc["programs"]
  assert prog["per_device"]["hbm"] == h100.hbm_bytes and prog["fits"]
  # the batch's forward: at least the attention layers' matmuls (accounting's count)
  b, t = 32, 48    # 32 rows of 49 tokens: 48 positions at least
  assert prog["flops"] >= 2 * accounting.attention_flops(64, t, batch=b)["total"]
  assert prog["est_seconds"] > 0


@pytest.mark.slow   # 8 families' transformers models built and saved: 27 s under load
def test_hf_config_param_shapes_are_the_importers(tmp_path):
  """For each decoder family, the shapes plan reads from a config.json are those the
  importer builds from the same model's tensors."""
  pytest.importorskip("transformers")
  from hf_models import build_hf, save_folder
  from mha_jax.pretrained import adapters, hf_folder
  for case in ("llama", "phi3_longrope", "qwen2", "qwen3", "gemma2", "olmo2", "gpt2",
               "gpt_neox"):
    folder = save_folder(build_hf(case), tmp_path / case)
    params = hf_folder.read(folder)[0]
    with open(os.path.join(folder, "config.json")) as f:
      cfg = json.load(f)
    fam = adapters.FAMILIES[hf_folder.architecture(cfg)]
    s = adapters.read_config(cfg, fam, folder)
    want = jax.tree.map(lambda a: (a.shape, str(a.dtype)), params)
    got = jax.tree.map(lambda a: (a.shape, str(a.dtype)),
                       plan.hf_param_shapes(fam, s, "float32"))
    assert got == want, case


@pytest.mark.slow
def test_the_verb_on_4_host_devices_with_a_model_axis(tmp_path):
  """cpu:4 in a fresh process (plan asks JAX for the 4 devices), heads over model=2."""
  out = tmp_path / "p"
  env = with_devices(1)
  r = subprocess.run([sys.executable, "-m", "mha_jax.cli", "plan", "--topology", "cpu:4",
                      "--config", "configs/induction.py", "--mesh", "data=2,model=2",
                      "--job", "train", "--batch", "8", "--out", str(out)],
                     cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
  assert r.returncode == 0, r.stderr
  doc = json.loads((out / "plan.json").read_text())
  assert doc["devices"] == 4 and doc["mesh"] == {"data": 2, "model": 2}
  assert [p["name"] for p in doc["programs"]] == ["train_step", "eval_step"]
  assert all(p["mesh"] == {"data": 2, "model": 2} for p in doc["programs"])
  assert "train_step" in r.stdout


def test_circuit_job_counts_eap_igs_five_gradients():
  """job circuit from shapes alone: EAP (one backward to every end) and EAP-IG (5 of them
  in a scan, the edge product once, as in EAP). With each trip counted, EAP-IG's FLOPs
  pass 2.5 EAPs' (XLA's own count, the scan body once, is about one EAP's)."""
  p = _induction_plan(job="circuit", batch=4)
  eap, ig = p["programs"]
  assert (eap["name"], ig["name"]) == ("eap", "eap_ig") and 5 in ig["loops"]
  assert 2.5 * eap["flops"] < ig["flops"] < 5 * eap["flops"]
  assert ig["xla_flops"] < 1.5 * eap["flops"]
  for prog in (eap, ig):    # the study's default budget holds the tiny model's ends at once
    assert (prog["ends_per_chunk"], prog["chunks"], prog["memory_budget"]) >= (1, 1, 2 << 30)
    assert prog["chunks"] == 1


@pytest.mark.slow  # default run: test_circuit_job_counts_eap_igs_five_gradients
def test_taxonomy_job_compiles_the_causal_checks_and_the_detectors():
  """job taxonomy from shapes alone: the head taxonomy's four causal checks (repeat loss,
  IOI logit difference, context logit, text loss) with top-k heads mean-ablated and its
  three detectors (sink and copy suppression on the 4 windows, the effective embeddings
  of the 65 ordinal items), their rows per batch planned (all rows fit the default
  budget); the checks that read logits at every position cost more than the one that
  reads one, and copy suppression (every head's result against the sample) more than
  the sink (key 0's weights)."""
  p = _induction_plan(job="taxonomy", batch=4)
  progs = {q["name"]: q for q in p["programs"]}
  checks = {"taxonomy_repeat_loss", "taxonomy_ioi_logit_diff", "taxonomy_context_logit",
            "taxonomy_text_loss"}
  found = {"taxonomy_detector_attention_sink", "taxonomy_detector_copy_suppression",
           "taxonomy_detector_effective_embeddings"}
  assert set(progs) == checks | found
  assert all(q["fits"] and q["flops"] > 0 for q in progs.values())
  assert {n: q["rows_per_batch"] for n, q in progs.items()} == {
      **{n: 4 for n in checks | found}, "taxonomy_detector_effective_embeddings": 65}
  assert progs["taxonomy_text_loss"]["flops"] > progs["taxonomy_ioi_logit_diff"]["flops"]
  assert (progs["taxonomy_detector_copy_suppression"]["flops"]
          > progs["taxonomy_detector_attention_sink"]["flops"])


@pytest.mark.slow  # default run: test_the_verb_on_a_workdir_plans_its_checkpoints_shapes
def test_the_patch_job_on_2_host_devices(tmp_path):
  """job patch through the CLI on cpu:2 with the heads over model=2: one sweep program
  whose groups of `chunk` interventions cover every layer and head (2 x 8)."""
  out = tmp_path / "p"
  r = subprocess.run([sys.executable, "-m", "mha_jax.cli", "plan", "--topology", "cpu:2",
                      "--config", "configs/induction.py", "--config.model.num_heads=8",
                      "--mesh", "model=2", "--job", "patch", "--batch", "4", "--out", str(out)],
                     cwd=ROOT, env=with_devices(1), capture_output=True, text=True, timeout=600)
  assert r.returncode == 0, r.stderr
  doc = json.loads((out / "plan.json").read_text())
  (prog,) = doc["programs"]
  assert prog["name"] == "patch_sweep" and doc["mesh"] == {"data": 1, "model": 2}
  assert prog["chunk"] >= 1 and prog["chunk"] * prog["groups"] >= 2 * 8
  assert prog["flops"] > 0 and prog["fits"]


def test_the_verb_on_a_workdir_plans_its_checkpoints_shapes(tiny_attn_lm, tmp_path):
  """`plan --workdir W --job patch`: the run's config and its checkpoint's param shapes
  (nothing restored), counted against the config's own init."""
  from mha_jax import tasks
  wd, cfg = tiny_attn_lm
  out = tmp_path / "plan"
  assert cli.main(["plan", "--topology", "cpu:1", "--workdir", wd, "--job", "patch",
                   "--batch", "2", "--out", str(out)]) == 0
  doc = json.loads((out / "plan.json").read_text())
  shapes = jax.eval_shape(tasks.build(cfg, None).init_params, jax.random.PRNGKey(0))
  assert doc["params"]["count"] == sum(int(np.prod(a.shape)) for a in jax.tree.leaves(shapes))
  assert doc["source"] == wd and doc["job"] == "patch"
  assert [p["name"] for p in doc["programs"]] == ["patch_sweep"] and doc["fits"]


# ------------------------------------------------------------------ TPU topologies

@pytest.mark.tpu
@pytest.mark.skipif(not HAS_LIBTPU, reason="needs libtpu (pip install 'mha-jax[tpu]')")
def test_tpu_temps_count_every_memory_space():
  """On v5e XLA places temporaries in VMEM: the plan's temps hold the reference
  kernel's scores there, and its total is the compiler's peak."""
  topo = plan.topology("v5e:2x2")
  mesh = plan.sharding.make_mesh(4, 1, devices=topo.devices)
  b, t, d, h = 8, 512, 256, 4
  params = jax.eval_shape(lambda k: attention.init_attention_params(k, d, h),
                          jax.random.PRNGKey(0))
  rep = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  params = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=rep), params)
  x = jax.ShapeDtypeStruct((b, t, d), jnp.float32, sharding=jax.sharding.NamedSharding(
      mesh, jax.sharding.PartitionSpec("data")))

  def grad(p, x):
    return jax.grad(lambda p: jnp.sum(attention.multi_head_attention(
        p, x, x, impl="reference") ** 2))(p)
  prog = plan.compile_program("grad", grad, (params, x), topo, mesh)
  assert prog["per_device"]["temps"] >= accounting.score_memory_bytes(b // 4, h, t)
  assert prog["est_seconds"] > 0


@pytest.mark.tpu
@pytest.mark.skipif(not HAS_LIBTPU, reason="needs libtpu (pip install 'mha-jax[tpu]')")
def test_tpu_llama_8b_forward_plan_has_the_published_param_count():
  # a real run's matmul precision (the CLI's), not the tests' 'highest' (conftest.py):
  # Mosaic refuses fp32 contract precision on bfloat16 operands
  before = jax.config.jax_default_matmul_precision
  jax.config.update("jax_default_matmul_precision", None)
  try:
    p = plan.make_plan(plan.PlanOptions(topology="v5e:2x2", job="forward", hf_config=LLAMA_8B,
                                        dtype="bfloat16", batch=4, seq=128, mesh="model=4"))
  finally:
    jax.config.update("jax_default_matmul_precision", before)
  assert p["params"]["count"] == 8_030_261_248      # Llama-3.1-8B's published size
  assert p["devices"] == 4 and np.isfinite(p["programs"][0]["est_seconds"])


@pytest.mark.tpu
@pytest.mark.xdist_group("v5e_lm_train")
def test_tpu_lm_train_step_runs_pallas_under_auto(v5e_lm_train_plan):
  """configs/lm.py (T 128, impl auto) planned for v5e:2x2 on this CPU machine: the train
  and eval steps are traced for the slice, so auto's choice is the Pallas kernel (inside
  shard_map over the data axis), as on the TPU VM, and the compiled steps hold its Mosaic
  calls (the train step: forward, dq and dkv of each layer)."""
  p = v5e_lm_train_plan
  layers = mha_config.load_config(os.path.join(ROOT, "configs", "lm.py")).model.num_layers
  assert [g["attention_kernels"] for g in p["programs"]] == [["pallas"], ["pallas"]]
  assert p["mesh"] == {"data": 4, "model": 1}
  assert p["programs"][0]["mosaic_calls"] >= 3 * layers
  assert p["programs"][1]["mosaic_calls"] >= layers
  assert p["fits"] and p["device_kind"] == chips.CHIPS["v5e"].device_kind


SMOLLM2 = os.path.join(ROOT, "docs", "data", "smollm2-135m.config.json")


@pytest.fixture(scope="module")
def smollm2_study_plans():
  """The patching sweep and the EAP / EAP-IG programs at SmolLM2-135M's published shapes
  (its config.json), compiled for v5e:2x2, 8 pairs of 32 tokens over the data axis."""
  if not HAS_LIBTPU:
    pytest.skip("needs libtpu (pip install 'mha-jax[tpu]')")
  topo = plan.topology("v5e:2x2")
  return {job: plan.make_plan(plan.PlanOptions(topology="v5e:2x2", job=job,
                                               hf_config=SMOLLM2), topo=topo)
          for job in ("patch", "circuit")}


@pytest.mark.tpu
@pytest.mark.slow     # 30 layers compiled for v5e: CPU-minutes; the TPU CI step runs the rest
@pytest.mark.xdist_group("v5e_smollm2_studies")
@pytest.mark.parametrize("job,names", [("patch", ["patch_sweep"]),
                                       ("circuit", ["eap", "eap_ig"])])
def test_tpu_studies_at_smollm2_shapes_compile_for_v5e(smollm2_study_plans, job, names):
  p = smollm2_study_plans[job]
  assert p["params"]["count"] == 134_515_008          # SmolLM2-135M's published size
  assert p["mesh"] == {"data": 4, "model": 1} and p["device_kind"] == chips.CHIPS["v5e"].device_kind
  assert [g["name"] for g in p["programs"]] == names
  for g in p["programs"]:
    assert g["fits"] and g["flops"] > 0 and g["per_device"]["arguments"] > 0
    assert "pallas" not in g["attention_kernels"]     # T = 32: no Pallas block fits


@pytest.mark.tpu
def test_tpu_matmul_flops_count_a_maps_dots_times_its_trips():
  """The TPU compiler writes dots as convolutions and gives its while loops no known trip
  count: a lax.map of two matmuls over 16 rows is counted from the loop's bound."""
  if not HAS_LIBTPU:
    pytest.skip("needs libtpu (pip install 'mha-jax[tpu]')")
  topo = plan.topology("v5e:2x2")
  rep = jax.sharding.NamedSharding(jax.sharding.Mesh(topo.devices[:1], ("data",)),
                                   jax.sharding.PartitionSpec())
  n, m = 16, 128
  f = jax.jit(lambda w, xs: jax.lax.map(lambda a: jnp.tanh(a @ w[0]) @ w[1], xs))
  hlo = f.lower(jax.ShapeDtypeStruct((2, m, m), jnp.float32, sharding=rep),
                jax.ShapeDtypeStruct((n, m, m), jnp.float32, sharding=rep)).compile().as_text()
  one = 2 * (2 * m * m * m)
  assert plan.matmul_flops(hlo) == {"once": one, "counted": n * one, "loops": [n]}


@pytest.mark.tpu
@pytest.mark.parametrize("spec,a,b", [
    ("bhqd,bhkd->bhqk", (8, 4, 32, 64), (8, 4, 32, 64)),     # batched: dilated windows
    ("btd,dhk->bthk", (8, 32, 512), (512, 8, 64)),           # a padded window over heads
    ("bthk,hkd->btd", (8, 32, 8, 64), (8, 64, 512))])
def test_tpu_matmul_flops_of_dots_written_as_convolutions_are_xlas(spec, a, b):
  """XLA's cost analysis counts the valid taps of a convolution; so does matmul_flops, and
  both give the einsum's 2 x output x contracted size."""
  if not HAS_LIBTPU:
    pytest.skip("needs libtpu (pip install 'mha-jax[tpu]')")
  topo = plan.topology("v5e:2x2")
  rep = jax.sharding.NamedSharding(jax.sharding.Mesh(topo.devices[:1], ("data",)),
                                   jax.sharding.PartitionSpec())
  s = lambda shape: jax.ShapeDtypeStruct(shape, jnp.bfloat16, sharding=rep)
  compiled = jax.jit(lambda x, y: jnp.einsum(spec, x, y)).lower(s(a), s(b)).compile()
  ins, out = spec.split("->")
  size = dict(zip(ins.split(",")[0] + ins.split(",")[1], a + b))
  want = 2 * math.prod(size[c] for c in set(ins.replace(",", "")))
  assert "convolution(" in compiled.as_text()
  assert plan.matmul_flops(compiled.as_text())["once"] == want
  cost = compiled.cost_analysis()
  assert (cost[0] if isinstance(cost, list) else cost)["flops"] == want


@pytest.mark.slow     # two fresh processes
def test_the_circuit_job_splits_the_node_values_over_the_mesh(tmp_path):
  """job circuit through the CLI on cpu:4 at data=2, model=2: each program's node values
  split over both axes (node_values_split), and a device's arguments (params, node values,
  tokens) below one device's whole."""
  def run(topology, mesh, name):
    out = tmp_path / name
    r = subprocess.run([sys.executable, "-m", "mha_jax.cli", "plan", "--topology", topology,
                        "--config", "configs/induction.py", "--config.model.num_heads=8",
                        *mesh, "--job", "circuit", "--batch", "4", "--out", str(out)],
                       cwd=ROOT, env=with_devices(1), capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr
    return json.loads((out / "plan.json").read_text())
  many = run("cpu:4", ["--mesh", "data=2,model=2"], "many")
  one = run("cpu:1", [], "one")
  for m, o in zip(many["programs"], one["programs"]):
    assert m["node_values_split"] == {"data": 2, "model": 2} and m["fits"], m
    assert o["node_values_split"] == {"data": 1, "model": 1}
    assert m["per_device"]["arguments"] < o["per_device"]["arguments"] / 2


def test_a_circuit_job_too_big_for_its_pairs_names_the_pairs_that_fit():
  """A default budget below one end at 4 pairs, above it at 1: the plan does not fit and
  names the most pairs that do (the study's refusal, memory.eap_pairs_that_fit)."""
  cfg = dict(config=os.path.join(ROOT, "configs", "induction.py"),
             overrides=["--config.model.num_heads=8"])
  base = plan.topology("cpu:1")
  found = {}
  for hbm in (2**21, 2**22, 2**23, 2**24):
    p = plan.make_plan(plan.PlanOptions(topology="cpu:1", job="circuit", batch=4, search=0),
                       topo=dataclasses.replace(base, hbm=hbm), **cfg)
    prog = p["programs"][0]
    if prog.get("pairs_that_fit"):
      found = prog
      break
  assert found, "no hbm gave a budget between one pair's and four pairs' one-end chunk"
  k = found["pairs_that_fit"]
  assert 1 <= k < 4 and found["fits"] is False and found["compiled"] is False
  assert f"at most {k} of its 4 pairs fit it" in found["ruled_out"]
  assert f"plan --batch {k}" in found["ruled_out"]
