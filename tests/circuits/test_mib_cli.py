"""`mha-jax circuit --graph mib --export mib`, then `--evaluate` of the written graph:
the same curves and areas, through the CLI."""

import json
import os

import pytest

from mha_jax import cli


@pytest.fixture(scope="module")
def mlp_lm(tmp_path_factory):
  """A two-layer LM with MLPs over bytes, trained 2 steps."""
  from builders import tiny
  from mha_jax.train import loop
  wd = str(tmp_path_factory.mktemp("mlp_lm") / "run")
  cfg = tiny("configs/lm.py:layers=2,heads=2", [
      "--config.train.progress=false", "--config.train.steps=2", "--config.data.tokenizer=bytes",
      "--config.model.d_model=16", "--config.model.max_len=32", "--config.train.batch_size=4",
      "--config.eval.batch_size=4", "--config.eval.lm_batches=1"])
  loop.train(cfg, wd, log=lambda s: None)
  return wd


@pytest.mark.slow
def test_export_then_evaluate_through_the_cli(mlp_lm, tmp_path):
  out, back = str(tmp_path / "a"), str(tmp_path / "b")
  common = ["--workdir", mlp_lm, "--task", "induction", "--n-pairs", "4", "--keep-failing",
            "--sample", "6"]
  assert cli.main(["circuit", *common, "--method", "eap", "--graph", "mib", "--export", "mib",
                   "--out", out]) == 0
  doc = json.load(open(os.path.join(out, "circuit.json")))
  graph = json.load(open(os.path.join(out, "mib_graph.json")))
  assert doc["graph_kind"] == "mib" and len(graph["edges"]) == doc["graph"]["edges"]
  assert set(graph["cfg"]) == {"n_layers", "n_heads", "parallel_attn_mlp", "d_model"}
  assert cli.main(["circuit", *common, "--evaluate", os.path.join(out, "mib_graph.json"),
                   "--out", back]) == 0
  again = json.load(open(os.path.join(back, "circuit.json")))
  assert again["chosen"] == "imported" and set(again["agreement"]) == {"imported"}
  for key in ("curve_signed", "curve_absolute"):
    for p, q in zip(doc[key], again[key]):
      assert p["edges"] == q["edges"] and abs(p["faithfulness"] - q["faithfulness"]) < 1e-5
  assert abs(doc["cpr"] - again["cpr"]) < 1e-5 and abs(doc["cmd"] - again["cmd"]) < 1e-5


def test_export_needs_the_library_s_graph(tiny_attn_lm, tmp_path, capsys):
  wd, _ = tiny_attn_lm          # attention-only: the library's graph has MLPs
  assert cli.main(["circuit", "--workdir", wd, "--task", "induction", "--n-pairs", "2",
                   "--keep-failing", "--export", "mib", "--out", str(tmp_path / "x")]) != 0
  assert "MLP in every layer" in capsys.readouterr().err
