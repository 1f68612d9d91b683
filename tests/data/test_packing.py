"""Sentence packing (data/packing.py): the packed batch is the padded batch's maths."""
import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from mha_jax import config as mc
from mha_jax import tasks
from mha_jax.data import packing
from mha_jax.data import vocab
from mha_jax.errors import UserError
from mha_jax.train import loop
from mha_jax.train.metrics import read_metrics
from builders import with_devices

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SMALL = ["--config.data.train_size=400", "--config.data.valid_size=20",
         "--config.data.test_size=20", "--config.data.grammar.num_nouns=30",
         "--config.data.grammar.num_verbs=12", "--config.data.grammar.num_adjectives=10",
         "--config.data.grammar.num_adverbs=6", "--config.data.grammar.num_names=10",
         "--config.model.d_model=16", "--config.model.d_ff=32", "--config.model.enc_layers=1",
         "--config.model.dec_layers=1", "--config.train.batch_size=24",
         "--config.eval.bleu_examples=10", "--config.train.warmup=2",
         "--config.train.progress=false", "--config.model.max_rel=4"]


def _cfg(*extra):
  cfg = mc.load_config(os.path.join(ROOT, "configs/translation.py"))
  mc.apply_overrides(cfg, SMALL + list(extra))
  return cfg


def test_pack_places_every_pair_once_with_segments_and_positions():
  rng = np.random.default_rng(0)
  b, s, t = 40, 12, 13
  src = np.zeros((b, s), np.int32)
  tgt = np.zeros((b, t), np.int32)
  sl, tl = rng.integers(1, s + 1, b), rng.integers(2, t + 1, b)
  for i in range(b):   # pair i's tokens encode (i, position) so they can be traced back
    src[i, :sl[i]] = 1000 * (i + 1) + np.arange(sl[i])
    tgt[i, :tl[i]] = 1000 * (i + 1) + 500 + np.arange(tl[i])
  need = packing.rows_needed({"src": src, "tgt": tgt}, vocab.PAD_ID)
  assert need < b
  assert need >= int(np.ceil(max(sl.sum() / s, tl.sum() / t)))
  out = packing.pack({"src": src, "tgt": tgt}, need + 2, vocab.PAD_ID)
  assert out["src"].shape == (need + 2, s) and out["tgt"].shape == (need + 2, t)
  assert (out["src"][need:] == vocab.PAD_ID).all() and (out["src_seg"][need:] == 0).all()
  seen = set()
  for name, lens, off in (("src", sl, 0), ("tgt", tl, 500)):
    tok, seg, pos = out[name], out[f"{name}_seg"], out[f"{name}_pos"]
    for r in range(tok.shape[0]):
      for k in range(1, seg[r].max() + 1):
        cols = np.flatnonzero(seg[r] == k)
        assert (np.diff(cols) == 1).all()          # a pair's tokens are contiguous
        pair = tok[r, cols[0]] // 1000 - 1
        np.testing.assert_array_equal(tok[r, cols], 1000 * (pair + 1) + off + np.arange(lens[pair]))
        np.testing.assert_array_equal(pos[r, cols], np.arange(lens[pair]))
        seen.add((name, pair, r))
      assert (tok[r][seg[r] == 0] == vocab.PAD_ID).all()
  # every pair once per side, and on the same row on both sides
  assert sorted(p for n, p, _ in seen if n == "src") == list(range(b))
  assert {(p, r) for n, p, r in seen if n == "src"} == {(p, r) for n, p, r in seen if n == "tgt"}
  # a ladder: its smallest rung that holds the batch
  assert packing.pack({"src": src, "tgt": tgt}, (need - 1, need + 3, b), vocab.PAD_ID)[
      "src"].shape[0] == need + 3
  with pytest.raises(ValueError, match=f"rows={need - 1} is fewer than the {need} rows"):
    packing.pack({"src": src, "tgt": tgt}, need - 1, vocab.PAD_ID)


def test_rows_ladder_and_rung():
  assert packing.rows_ladder([10, 17, 12], 64, 4) == (20, 64)     # 17 * 1.1 -> 19 -> 20
  assert packing.rows_ladder([60], 64, 1) == (64,)                 # capped at the batch
  assert packing.rung((20, 64), 20) == 20 and packing.rung((20, 64), 21) == 64
  with pytest.raises(UserError, match="needs 65 packed rows"):
    packing.rung((20, 64), 65)


@pytest.mark.parametrize("extra", [pytest.param([], marks=pytest.mark.slow), ["--config.model.pos=sinusoidal",
                                     "--config.model.ln_position=post"]])
def test_packed_loss_and_gradients_equal_the_padded_batch(tmp_path, extra):
  cfg = _cfg(*extra)
  task = tasks.build(cfg, str(tmp_path))
  params = task.init_params(jax.random.PRNGKey(1))
  padded = task.train_batch(3)
  rows = task.train_rows_needed(3)
  assert rows < cfg.train.batch_size // 2     # packing removes most of the padding
  packed = task.packed_train_batch(3, rows + 1)

  @jax.jit
  def f(batch):
    return jax.value_and_grad(lambda p: task.loss(p, batch, label_smoothing=0.1),
                              has_aux=True)(params)

  (obj_a, met_a), g_a = f(padded)
  (obj_b, met_b), g_b = f(packed)
  np.testing.assert_allclose(obj_b, obj_a, rtol=1e-5)
  for k in ("loss", "accuracy", "tokens"):
    np.testing.assert_allclose(met_b[k], met_a[k], rtol=1e-5, err_msg=k)
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(g_a), jax.tree.leaves(g_b)):
    np.testing.assert_allclose(b, a, atol=2e-6, rtol=1e-4, err_msg=jax.tree_util.keystr(path))
  if not extra:   # the segment mask is what makes them equal: without it, pairs mix
    leaky = {k: v for k, v in packed.items() if k not in ("src_seg", "src_pos", "tgt_seg",
                                                           "tgt_pos")}
    assert abs(float(f(leaky)[0][0]) - float(obj_a)) > 1e-3


@pytest.mark.slow   # every default translation training test already trains packed batches
def test_training_packed_follows_the_padded_loss_curve(tmp_path):
  losses = {}
  for pack in (True, False):
    cfg = _cfg("--config.eval.bleu_examples=2", "--config.train.steps=6",
               "--config.train.log_every=1",
               "--config.train.eval_every=6", "--config.train.checkpoint_every=6",
               f"--config.train.pack={str(pack).lower()}")
    wd = str(tmp_path / f"pack_{pack}")
    loop.train(cfg, wd, log=lambda s: None)
    losses[pack] = [m["loss"] for m in read_metrics(wd) if m.get("split") == "train"]
  assert len(losses[True]) == 6
  np.testing.assert_allclose(losses[True], losses[False], rtol=1e-4)


def test_processes_share_one_packed_batch(tmp_path):
  task = tasks.build(_cfg(), str(tmp_path))
  rows = packing.rows_ladder([task.train_rows_needed(s) for s in range(8)], 24, 2)[0]
  whole = loop.packed_batches([task], 5, (rows,))[0]
  parts = [loop.packed_batches([task], 5, (rows,), i, 2)[0] for i in range(2)]
  assert rows % 2 == 0 and parts[0]["src"].shape[0] == rows // 2
  for k in whole:
    np.testing.assert_array_equal(np.concatenate([p[k] for p in parts]), whole[k])


_MESH_SCRIPT = r"""
import json, sys
sys.path.insert(0, sys.argv[1] + "/tests")
from builders import TINY_TRANSLATION, tiny
from mha_jax.train import loop
from mha_jax.train.metrics import read_metrics
out = {}
for d, m in [(1, 1), (8, 1), (2, 4)]:
  cfg = tiny("configs/translation.py", TINY_TRANSLATION, "--config.train.steps=5",
             "--config.train.log_every=1", "--config.train.batch_size=16",
             f"--config.mesh.data={d}", f"--config.mesh.model={m}")
  loop.train(cfg, f"{sys.argv[2]}/m{d}x{m}", log=lambda s: None)
  out[f"{d}x{m}"] = [r["loss"] for r in read_metrics(f"{sys.argv[2]}/m{d}x{m}")
                     if r["split"] == "train"]
print("RESULT" + json.dumps(out))
"""


@pytest.mark.slow
def test_packed_batches_split_over_a_mesh_give_the_one_device_curve(tmp_path):
  env = with_devices(8)
  r = subprocess.run([sys.executable, "-c", _MESH_SCRIPT, ROOT, str(tmp_path)], env=env,
                     cwd=ROOT, capture_output=True, text=True, timeout=600)
  assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
  curves = json.loads(r.stdout.split("RESULT")[1])
  assert len(curves["1x1"]) == 5
  for name, curve in curves.items():
    np.testing.assert_allclose(curve, curves["1x1"], atol=1e-5, err_msg=name)
