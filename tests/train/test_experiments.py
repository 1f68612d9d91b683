"""Sweeps, the TPU launch script, the quickstart and the induction run."""

import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

import mha_jax
from mha_jax import cli, sweep, tasks
from mha_jax.train import loop
from mha_jax.train.metrics import read_metrics
from builders import ROOT, TINY_TRANSLATION, tiny


def test_sweep_print_commands(capsys):
  assert cli.main(["sweep", "--config", "configs/sweep_heads.py:heads=1,4,8,64",
                   "--workdir", "runs/sw", "--print-commands",
                   "--config.train.steps=300"]) == 0
  lines = capsys.readouterr().out.strip().splitlines()
  assert len(lines) == 4
  assert lines[3] == ("mha-jax train --config configs/translation.py:d_model=64 --workdir "
                      "runs/sw/h64 --config.model.num_heads=64 --config.train.steps=300")
  assert not os.path.exists(os.path.join(ROOT, "runs", "sw"))


def test_sweep_rejects_heads_not_dividing_d_model(tmp_path):
  with pytest.raises(ValueError, match="model.num_heads=3 does not divide model.d_model=64"):
    sweep.plan("configs/sweep_heads.py:heads=2,3", str(tmp_path), [])


@pytest.mark.slow   # trains three runs of the sweep (~16 s)
def test_sweep_runs_skips_finished_and_summarizes(tmp_path):
  wd = str(tmp_path / "sweep")
  extra = TINY_TRANSLATION + ["--config.train.steps=3", "--config.train.eval_every=3",
                              "--config.train.log_every=3"]
  spec = "configs/sweep_heads.py:heads=1,16,d_model=16"
  logs = []
  rows = sweep.run_sweep(spec, wd, extra, train_fn=lambda c, w: loop.train(c, w, log=logs.append),
                         log=logs.append)
  assert [(r["heads"], r["d_k"]) for r in rows] == [(1, 16), (16, 1)]
  for r in rows:   # 4 D^2 for every h, plus the relative-position table, 2 * 16 + 1 per head
    blk = mha_jax.load(os.path.join(wd, r["run"])).params["encoder"]["layer_0"]["self_attn"]
    assert r["attn_params_per_layer"] == sum(x.size for x in jax.tree.leaves(blk))
    assert r["attn_params_per_layer"] == 4 * 16 * 16 + 33 * r["heads"]
  assert all(r["step"] == 3 and r["valid_loss"] > 0 and r["valid_bleu"] is not None
             for r in rows)
  assert os.path.getsize(os.path.join(wd, "sweep.png")) > 1000
  assert json.load(open(os.path.join(wd, "sweep.json"))) == rows
  assert "| h16 | 16 | 1 |" in open(os.path.join(wd, "sweep.md")).read()
  logs.clear()
  sweep.run_sweep(spec, wd, extra, train_fn=lambda c, w: pytest.fail("retrained"),
                  log=logs.append)
  assert sum("finished already, skipping" in l for l in logs) == 2


def test_launch_tpu_vm_dry_run_prints_gcloud_commands():
  r = subprocess.run(["bash", "scripts/launch_tpu_vm.sh", "--name", "tpu1", "--zone", "z1",
                      "--create", "--type", "v4-32", "--dry-run", "--", "mha-jax", "train",
                      "--config", "configs/translation.py", "--workdir", "runs/a"],
                     cwd=ROOT, capture_output=True, text=True)
  assert r.returncode == 0, r.stderr
  lines = [l for l in r.stdout.splitlines() if l.startswith("gcloud")]
  assert lines[0].startswith("gcloud compute tpus tpu-vm create tpu1 --zone z1 "
                             "--accelerator-type v4-32")
  assert "scp" in lines[1] and "--worker=all" in lines[1]
  assert "pip\\ install" in lines[2] and "\\[tpu\\,gcs\\]" in lines[2]   # gcs: workdirs in buckets
  assert "--worker=all" in lines[3] and "--multihost" in lines[3]
  # Explicit multi-process flags, one ssh per worker.
  r = subprocess.run(["bash", "scripts/launch_tpu_vm.sh", "--name", "tpu1", "--zone", "z1",
                      "--workers", "4", "--dry-run", "--", "mha-jax", "train",
                      "--config", "configs/translation.py", "--workdir", "gs://b/run"],
                     cwd=ROOT, capture_output=True, text=True)
  assert r.returncode == 0, r.stderr
  lines = [l for l in r.stdout.splitlines() if l.startswith("gcloud")]
  assert "describe tpu1" in lines[2]
  runs = lines[3:]
  assert len(runs) == 4
  for i, line in enumerate(runs):
    assert f"--worker={i}" in line and "--multihost" not in line
    assert (f"--coordinator\\ WORKER0_IP:8476\\ --num-processes\\ 4\\ "
            f"--process-id\\ {i}") in line, line
  r = subprocess.run(["bash", "scripts/launch_tpu_vm.sh", "--zone", "z1", "--", "ls"],
                     cwd=ROOT, capture_output=True, text=True)
  assert r.returncode == 2 and "--name is required" in r.stderr


def test_token_ids_beyond_the_vocabulary_are_refused():
  with pytest.raises(ValueError, match=r"training batch: token id 50 is not in the vocabulary "
                                       r"of 50 tokens \(ids 0\.\.49\)"):
    tasks.check_ids(np.array([[1, 50]]), 50, "training batch")


@pytest.mark.slow
def test_quickstart_end_to_end(tmp_path):
  wd = str(tmp_path / "qs")
  r = subprocess.run([sys.executable, "-m", "mha_jax.cli", "quickstart", "--workdir", wd],
                     cwd=ROOT, capture_output=True, text=True, timeout=900)
  assert r.returncode == 0, r.stderr[-2000:]
  res = json.load(open(os.path.join(wd, "quickstart.json")))
  assert res["test"]["bleu"] > res["copy_baseline_bleu"] + 30
  assert "test BLEU" in r.stdout
  assert res["pruning"]["kept"] == 12
  roles = res["analysis"]["role_counts"]["encoder"]
  assert sum(roles.values()) == 48 and roles.get("positional", 0) >= 1
  assert res["pruning"]["after"]["bleu"] > res["pruning"]["base"]["bleu"] - 5


@pytest.mark.slow     # trains the induction config (the circuits test, also slow, checks its circuit)
def test_induction_config_learns_to_copy(tmp_path):
  """The repeated half's loss falls from about ln V to below 1 nat."""
  wd = str(tmp_path / "ind")
  cfg = tiny("configs/induction.py", ["--config.train.progress=false"])
  loop.train(cfg, wd, log=lambda s: None)
  valid = [r for r in read_metrics(wd) if r["split"] == "valid"]
  assert abs(valid[0]["loss_first"] - np.log(64)) < 0.1
  assert valid[-1]["loss_repeat"] < 1.0 < valid[0]["loss_repeat"]
  assert valid[-1]["loss_first"] > 3.9     # the first copy stays unpredictable
