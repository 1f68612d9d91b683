"""Studies on a mesh: a patching Study with `mesh=` places the params as training does
(heads and MLP units over "model") and the rows of every program (pairs, and a sweep's
interventions folded into them) over "data"; the head tables (names and values) and the
EAP scores equal the single-device study's, on 8 host CPU devices in a subprocess (the
device count is fixed at start)."""

import json
import subprocess
import sys

import pytest

from builders import ROOT, with_devices

_SCRIPT = r"""
import json, sys
sys.path.insert(0, sys.argv[1] + "/tests")
import jax, numpy as np
from oracles import D, G, H, K, L, LlamaTask
from mha_jax.circuits import edges
from mha_jax.models import llama
from mha_jax.toolkit import activation_patching as ap
from mha_jax.toolkit.pairs import Pairs
from mha_jax.train import sharding

assert jax.device_count() == 8
params = llama.init(jax.random.PRNGKey(3), vocab_size=37, d_model=D, num_heads=H,
                    num_kv_heads=G, head_dim=K, num_layers=L, d_ff=24)
params = jax.tree.map(lambda a: a * 3.0 if a.ndim == 3 else a, params)
rng = np.random.default_rng(5)
clean = rng.integers(0, 37, (4, 7)).astype(np.int32)
corrupt = clean.copy()
corrupt[:, 1:3] = rng.integers(0, 37, (4, 2))
pairs = Pairs(clean, corrupt, np.asarray([3, 8, 11, 5]), np.asarray([4, 9, 20, 6]),
              np.asarray([7, 6, 7, 7]), [{}] * 4)
sweeps = [("z", False), ("k", True), ("resid_pre", True)]
out = {}
mesh = sharding.make_mesh(4, 2)

def tables(s):
  got = s.patch_many(sweeps)
  return {site: np.asarray(got[site]["recovery"]) for site, _ in sweeps}

one = ap.Study(LlamaTask(), params, pairs)
many = ap.Study(LlamaTask(), params, pairs, mesh=mesh)
wq = many.params["lm"]["layer_0"]["attn"]["wq"]
out["wq_spec"] = str(wq.sharding.spec)
out["tokens_spec"] = str(many.tokens["clean"].sharding.spec)
a, b = tables(one), tables(many)
out["patch"] = {k: float(np.nanmax(np.abs(a[k] - b[k]))) for k in a}
out["names_equal"] = ap.head_table(a["z"]).keys() == ap.head_table(b["z"]).keys()
small = ap.Study(LlamaTask(), params, pairs, mesh=mesh,
                 memory_budget=ap.memory.patch_bytes(one.shapes(3), 4, 4))
c = tables(small)
out["patch_chunked"] = {k: float(np.nanmax(np.abs(a[k] - c[k]))) for k in a}
out["chunk"] = small.last_plan.interventions_per_group
e1, e2 = edges.EdgeStudy(one).eap(), edges.EdgeStudy(many).eap()
out["eap"] = float(np.max(np.abs(e1 - e2)))
out["eap_scale"] = float(np.max(np.abs(e1)))
print("RESULT" + json.dumps(out))
"""


@pytest.mark.slow      # a fresh 8-device process: ~2 min on 2 loaded cores
def test_patch_tables_and_eap_on_a_mesh_equal_one_device():
  r = subprocess.run([sys.executable, "-c", _SCRIPT, ROOT], env=with_devices(8),
                     capture_output=True, text=True, timeout=900)
  assert r.returncode == 0, r.stderr[-3000:]
  out = json.loads(r.stdout.split("RESULT")[-1])
  assert "model" in out["wq_spec"] and "data" in out["tokens_spec"]
  assert out["names_equal"]
  assert max(out["patch"].values()) < 1e-4, out     # sums split over "model": float32 order
  assert max(out["patch_chunked"].values()) < 1e-4 and out["chunk"] == 4, out
  assert out["eap"] < 1e-5 * max(1.0, out["eap_scale"]), out
