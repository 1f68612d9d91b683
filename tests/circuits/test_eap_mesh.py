"""EAP and EAP-IG on a mesh: the node values (B, T, N_nodes, D) live split over it (the
pairs over "data", D over "model"), each device holding the share the memory plan counts,
and the scores (at one chunk and at many) equal the single-device ones, on 8 host CPU
devices in a subprocess (the device count is fixed at start)."""

import json
import subprocess
import sys

import pytest

from builders import ROOT, with_devices

_SCRIPT = r"""
import json, sys
sys.path.insert(0, sys.argv[1] + "/tests")
import jax, numpy as np
from oracles import LlamaTask, tiny_llama_pairs
from mha_jax.circuits import edges
from mha_jax.toolkit import activation_patching as ap, memory
from mha_jax.train import sharding

assert jax.device_count() == 8
params, pairs = tiny_llama_pairs(slice(1, 4), [7, 7, 7])
pairs = pairs.subset(np.asarray([0, 1, 2, 0]))            # 4 pairs: 2 per data device
one = edges.EdgeStudy(ap.Study(LlamaTask(), params, pairs))
mesh = sharding.make_mesh(2, 4)
many = edges.EdgeStudy(ap.Study(LlamaTask(), params, pairs, mesh=mesh))
out = {"spec": list(many.clean_out.sharding.spec), "axes": list(many.node_axes())}
shard = many.clean_out.addressable_shards[0].data
out["shard_bytes"] = int(shard.nbytes)
out["whole_bytes"] = int(np.asarray(one.clean_out).nbytes)
sh = many.shapes("eap")
out["model_node_bytes"] = (sh.fixed() - memory.EapShapes(sh.model, sh.nodes, 0).fixed()
                           + 3 * out["whole_bytes"])
small = edges.EdgeStudy(ap.Study(LlamaTask(), params, pairs, mesh=mesh,
                                 memory_budget=memory.eap_bytes(sh, 3)))
got = {}
for name, es in (("one", one), ("many", many), ("small", small)):
  got[name] = {"eap": es.eap()}
  out[f"{name}_chunks"] = len(es.last_plan.chunks)
  got[name]["ig"] = es.eap_ig(2, "inputs", "left")
out["chunks"] = out["small_chunks"]
out["ends"] = len(small.graph.ends)
for name in ("many", "small"):
  for k in ("eap", "ig"):
    out[f"{name}_{k}"] = float(np.max(np.abs(got[name][k] - got["one"][k])))
out["scale"] = float(max(np.max(np.abs(v)) for v in got["one"].values()))
print("RESULT" + json.dumps(out))
"""


@pytest.mark.slow      # a fresh 8-device process
def test_eap_node_values_split_over_the_mesh_and_scores_equal_one_device():
  r = subprocess.run([sys.executable, "-c", _SCRIPT, ROOT], env=with_devices(8),
                     capture_output=True, text=True, timeout=900)
  assert r.returncode == 0, r.stderr[-3000:]
  out = json.loads(r.stdout.split("RESULT")[-1])
  assert out["spec"] == ["data", None, None, "model"], out
  assert out["axes"] == [2, 4]
  # a device holds an eighth of the node values, and the byte model counts that share
  assert out["shard_bytes"] * 8 == out["whole_bytes"], out
  assert out["model_node_bytes"] == 3 * out["shard_bytes"], out
  assert out["chunks"] == -(-out["ends"] // 3) > 1 and out["many_chunks"] == 1, out
  for k in ("many_eap", "many_ig", "small_eap", "small_ig"):
    assert out[k] < 1e-5 * max(1.0, out["scale"]), (k, out)
