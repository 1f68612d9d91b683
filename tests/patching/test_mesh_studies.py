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


_CLI = r"""
import json, sys
import jax
from mha_jax import cli
assert jax.device_count() == 8
wd, out = sys.argv[1], sys.argv[2]
common = ["--workdir", wd, "--task", "induction", "--n-pairs", "3", "--keep-failing"]
got = {}
for name, mesh in (("one", []), ("mesh", ["--mesh", "data=2,model=4"])):
  assert cli.main(["patch", *common, "--method", "activation", "--sites", "head_out",
                   "--out", f"{out}/patch_{name}", *mesh]) == 0
  assert cli.main(["circuit", *common, "--method", "eap", "--sample", "4",
                   "--out", f"{out}/circuit_{name}", *mesh]) == 0
  p = json.load(open(f"{out}/patch_{name}/patching.json"))["scores"]["head_out"]
  c = json.load(open(f"{out}/circuit_{name}/circuit.json"))["edges"]
  split = json.load(open(f"{out}/circuit_{name}/circuit.json"))["memory_budget"]["node_values_split"]
  got[name] = {"patch": p, "edges": {e["from"] + ">" + e["to"]: e["score"] for e in c},
               "split": split}
got["refused"] = cli.main(["patch", *common, "--out", f"{out}/bad", "--mesh", "data=3,model=2"])
print("RESULT" + json.dumps(got))
"""


@pytest.mark.slow      # a fresh 8-device process: two patch and two circuit runs
def test_patch_and_circuit_take_a_mesh_on_the_command_line(tiny_attn_lm, tmp_path):
  """`patch --mesh data=2,model=4` and `circuit --mesh ...` on 8 host devices: the same
  head table and edge scores (names and values) as on one device; a mesh that is not
  the device count (3 x 2 of 8) is refused."""
  r = subprocess.run([sys.executable, "-c", _CLI, tiny_attn_lm[0], str(tmp_path)],
                     env=with_devices(8), capture_output=True, text=True, timeout=900)
  assert r.returncode == 0, r.stderr[-3000:]
  got = json.loads(r.stdout.split("RESULT")[-1])
  assert got["refused"] == 2 and "mesh='data=3,model=2'" in r.stderr
  one, mesh = got["one"], got["mesh"]
  assert one["patch"].keys() == mesh["patch"].keys() and len(one["patch"]) > 1
  assert max(abs(one["patch"][k] - mesh["patch"][k]) for k in one["patch"]) < 1e-4
  assert one["edges"].keys() == mesh["edges"].keys() and len(one["edges"]) > 1
  assert max(abs(one["edges"][k] - mesh["edges"][k]) for k in one["edges"]) < 1e-5
  assert one["split"] == {"data": 1, "model": 1}      # circuit.json: the node values' split
  assert mesh["split"]["data"] in (1, 2) and mesh["split"]["model"] in (1, 4)
  assert mesh["split"] != one["split"], mesh["split"]


def test_a_study_mesh_that_is_not_the_device_count_is_refused_by_name(tiny_attn_lm, tmp_path,
                                                                      capsys):
  from mha_jax import cli
  import jax
  n = jax.device_count()
  rc = cli.main(["patch", "--workdir", tiny_attn_lm[0], "--task", "induction", "--n-pairs",
                 "3", "--out", str(tmp_path / "p"), "--mesh", f"data=2,model={n}"])
  err = capsys.readouterr().err
  assert rc == 2 and f"mesh='data=2,model={n}'" in err and f"sees {n}" in err, err
  assert not (tmp_path / "p").exists()
