"""The (data, model) mesh: heads and MLP units split over "model", same maths as 1 device."""

import json
import os
import subprocess
import sys

import jax
import pytest
from jax.sharding import PartitionSpec as P

from mha_jax import tasks
from mha_jax.train import sharding

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from builders import with_devices  # noqa: E402
from builders import TINY_TRANSLATION, tiny  # noqa: E402


def test_param_specs_split_heads_and_mlp_units_over_model():
  cfg = tiny("configs/translation.py", TINY_TRANSLATION)
  shapes = jax.eval_shape(lambda k: tasks.init_model(cfg, k, 50), jax.random.PRNGKey(0))
  specs = jax.tree_util.tree_map_with_path(
      lambda p, x: sharding.param_spec(p, x.shape, 2), shapes)
  enc = specs["encoder"]["layer_0"]
  assert enc["self_attn"]["wq"] == P(None, "model", None)
  assert enc["self_attn"]["wo"] == P("model", None, None)
  assert enc["self_attn"]["rel_bias"] == P("model", None)
  assert specs["decoder"]["layer_0"]["cross_attn"]["wv"] == P(None, "model", None)
  assert enc["mlp"]["w1"] == P(None, "model") and enc["mlp"]["b1"] == P("model")
  assert enc["mlp"]["w2"] == P("model", None) and enc["mlp"]["b2"] == P()
  assert enc["ln1"]["scale"] == P()
  # A model axis that does not divide the heads leaves them replicated; so does size 1.
  assert sharding.param_spec([jax.tree_util.DictKey("wq")],
                             (16, 6, 4), 4) == P()
  assert sharding.param_spec([jax.tree_util.DictKey("wq")], (16, 8, 2), 1) == P()


@pytest.mark.parametrize("data, model, match", [
    (0, 3, "does not divide"), (2, 1, "needs 2 devices"), (-1, 1, "mesh.data"),
    (0, 0, "mesh.model")])
def test_bad_meshes_are_named(data, model, match):
  with pytest.raises(ValueError, match=match):
    sharding.make_mesh(data, model, devices=jax.devices()[:1])


_SCRIPT = r"""
import json, sys
import jax, numpy as np
sys.path.insert(0, sys.argv[1] + "/tests")
from builders import TINY_INDUCTION, tiny
from mha_jax.train import loop, checkpoint as ckpt_lib
from mha_jax.train.metrics import read_metrics
out, base = {}, sys.argv[2]
# The LM with MLPs and LayerNorm: heads and MLP units are both split.
args = TINY_INDUCTION + ["--config.train.log_every=1", "--config.train.eval_every=100",
                         "--config.train.checkpoint_every=3", "--config.model.attn_only=false",
                         "--config.model.d_ff=32", "--config.model.layer_norm=true"]
def run(name, data, model, steps):
  cfg = tiny("configs/induction.py", args, f"--config.mesh.data={data}",
             f"--config.mesh.model={model}", f"--config.train.steps={steps}")
  loop.train(cfg, f"{base}/{name}", log=lambda s: None)
  return [m["loss"] for m in read_metrics(f"{base}/{name}") if m["split"] == "train"]
def params(name, step):
  c = ckpt_lib.Checkpoints(f"{base}/{name}", read_only=True)
  p = c.restore_params(step)[0]; c.close(); return p
meshes = json.loads(sys.argv[3])
curves = {f"{d}x{m}": run(f"m{d}x{m}", d, m, 6) for d, m in meshes}
ref = params("m1x1", 6)
out["curves"] = curves
out["param_diff"] = {k: max(float(np.abs(np.asarray(a) - np.asarray(b)).max()) for a, b in
                            zip(jax.tree.leaves(params("m" + k, 6)), jax.tree.leaves(ref)))
                     for k in curves}
if len(meshes) > 2:
  run("moved", 4, 2, 3)            # saved under (4, 2), resumed under (2, 4)
  run("moved", 2, 4, 6)
  out["moved_diff"] = max(float(np.abs(np.asarray(a) - np.asarray(b)).max()) for a, b in
                          zip(jax.tree.leaves(params("moved", 6)), jax.tree.leaves(ref)))
print("RESULT" + json.dumps(out))
"""


def _run_meshes(tmp_path, meshes):
  env = with_devices(8)
  r = subprocess.run([sys.executable, "-c", _SCRIPT, ROOT, str(tmp_path), json.dumps(meshes)],
                     env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
  assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
  res = json.loads(r.stdout.split("RESULT")[1])
  ref = res["curves"]["1x1"]
  assert len(ref) == 6 and ref[-1] < ref[0]
  for name, curve in res["curves"].items():
    assert max(abs(a - b) for a, b in zip(curve, ref)) <= 1e-5, (name, curve, ref)
    assert res["param_diff"][name] <= 1e-5, (name, res["param_diff"])
  print(json.dumps(res))
  return res


@pytest.mark.slow
def test_heads_split_four_ways_give_the_one_device_loss_curve(tmp_path):
  _run_meshes(tmp_path, [(1, 1), (2, 4)])


@pytest.mark.slow
def test_every_mesh_gives_the_same_curve_and_checkpoints_move_between_meshes(tmp_path):
  res = _run_meshes(tmp_path, [(1, 1), (8, 1), (4, 2), (2, 4)])
  assert res["moved_diff"] <= 1e-5
