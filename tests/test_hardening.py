"""Faults and bad input, round 2 (issue 25): one writer per workdir, no user file
overwritten, no silently wrong model, clear errors on full disks and read-only places.
Every test here failed before the fix it guards."""

import errno
import json
import os
import shutil
import signal
import subprocess
import sys

import numpy as np
import pytest

import mha_jax
from mha_jax import cli as cli_mod
from mha_jax import config as mc
from mha_jax.errors import UserError
from mha_jax.train import checkpoint as ckpt_lib
from mha_jax.train import loop
from conftest import numpy_mha
from test_faults import QUIET, _copy, _tree, induction_cfg
from test_train import TINY_INDUCTION, TINY_TRANSLATION, tiny

pytestmark = pytest.mark.xdist_group('faults')


@pytest.fixture(scope="module")
def run8(tmp_path_factory):
  """A tiny induction run with checkpoints at steps 4 and 8 (copy it before changing it)."""
  wd = str(tmp_path_factory.mktemp("hardening") / "ind")
  loop.train(induction_cfg("--config.train.steps=8"), wd, **QUIET)
  return wd


# ------------------------------------------------------------------ masked NaN / inf

@pytest.mark.parametrize("impl", ["reference", "xla", "blocked"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("poison", [np.nan, np.inf])
def test_a_nan_or_inf_in_a_masked_key_or_value_does_not_reach_real_queries(impl, causal,
                                                                           poison):
  import jax
  import jax.numpy as jnp
  from mha_jax import attention
  b, t, d, h = 2, 6, 8, 2
  params = attention.init_attention_params(jax.random.PRNGKey(0), d, h)
  x = np.asarray(jax.random.normal(jax.random.PRNGKey(1), (b, t, d)))
  lengths = np.array([4, 6])
  valid_BT = np.arange(t)[None] < lengths[:, None]
  mask = valid_BT[:, None, None, :]                                  # padding as keys
  clean = np.where(valid_BT[..., None], x, 0.0)
  want, _ = numpy_mha(params, clean, mask=mask, causal=causal)
  dirty = np.where(valid_BT[..., None], x, poison)                   # padded rows poisoned
  got = np.asarray(attention.multi_head_attention(params, jnp.asarray(dirty),
                                                  mask=jnp.asarray(mask), causal=causal,
                                                  impl=impl))
  assert np.isfinite(got[valid_BT]).all()
  np.testing.assert_allclose(got[valid_BT], want[valid_BT], atol=1e-5)
  # The kernel alone, with poisoned keys and values at the padded positions only.
  q = jax.random.normal(jax.random.PRNGKey(2), (b, t, h, 4))
  k = jax.random.normal(jax.random.PRNGKey(3), (b, t, h, 4))
  v = jax.random.normal(jax.random.PRNGKey(4), (b, t, h, 4))
  pad = ~valid_BT[:, :, None, None]
  from mha_jax.kernels import dispatch
  ref, _ = dispatch.run_kernel("reference", q, k * valid_BT[:, :, None, None],
                               v * valid_BT[:, :, None, None], jnp.asarray(mask), causal, None)
  out, _ = dispatch.run_kernel(impl, q, jnp.where(pad, poison, k), jnp.where(pad, poison, v),
                               jnp.asarray(mask), causal, None)
  np.testing.assert_allclose(np.asarray(out)[valid_BT], np.asarray(ref)[valid_BT], atol=1e-5)


# ------------------------------------------------------------------ silent nonsense

@pytest.mark.parametrize("argv,msg", [
    (["ablate", "--induction-vs-random", "--top", "0"], r"--top must be >= 1; got 0"),
    (["ablate", "--induction-vs-random", "--draws", "-1"], r"--draws must be >= 1; got -1"),
    (["prune", "--method", "l0", "--lr", "-1", "--keep", "2"], r"--lr must be > 0; got -1.0"),
    (["prune", "--bleu-sentences", "-1", "--keep", "2"],
     r"--bleu-sentences must be >= 0 \(0 = all\); got -1"),
    (["prune-curve", "--counts", "4,-2"], r"--counts must be >= 0; got -2"),
    (["prune", "--l0-lambda", "nan"], r"--l0-lambda must be a finite number; got nan"),
    (["generate", "--prompt", "x", "--max-new-tokens", "0"],
     r"--max-new-tokens must be >= 1; got 0"),
])
def test_every_numeric_flag_is_range_checked_before_any_work(run8, tmp_path, argv, msg,
                                                             capsys, monkeypatch):
  from mha_jax import loader
  monkeypatch.setattr(loader, "load", lambda *a, **k: pytest.fail("loaded before checking"))
  out = str(tmp_path / "out")
  assert cli_mod.main([argv[0], "--workdir", run8, *argv[1:]] +
                      (["--out", out] if argv[0] in ("prune", "prune-curve") else [])) == 2
  err = capsys.readouterr().err
  assert err.count("\n") == 1 and msg.replace("\\", "") in err.replace("\\", "") or \
      pytest.fail(err)
  assert not os.path.exists(out)


def test_an_empty_workdir_is_refused_and_the_current_folder_untouched(tmp_path, capsys,
                                                                      monkeypatch):
  monkeypatch.chdir(tmp_path)
  (tmp_path / "config.json").write_text('{"mine": 1}')
  assert cli_mod.main(["train", "--config", mc.REPO_ROOT + "/configs/induction.py",
                       "--workdir", ""]) == 2
  assert "--workdir must name a folder or file; got ''" in capsys.readouterr().err
  assert os.listdir(tmp_path) == ["config.json"]
  assert (tmp_path / "config.json").read_text() == '{"mine": 1}'


def test_a_bogus_split_is_refused_naming_the_valid_ones(run8, capsys):
  assert cli_mod.main(["analyze", "--workdir", run8, "--split", "bogus"]) == 2
  assert "--split must be train, valid or test; got 'bogus'" in capsys.readouterr().err
  run = mha_jax.load(run8, **QUIET)
  with pytest.raises(UserError, match=r"split must be one of train, valid, test; got 'bogus'"):
    run.model.evaluate(run.params, "bogus")
  with pytest.raises(UserError, match=r"split must be one of train, valid, test"):
    next(run.model.eval_batches("bogus", 4))


def test_an_unknown_impl_is_refused_with_the_other_config_fields(tmp_path):
  wd = str(tmp_path / "run")
  with pytest.raises(UserError, match=r"model.impl must be one of auto, reference, xla, "
                                      r"cudnn, blocked, pallas; got 'fast'"):
    loop.train(induction_cfg("--config.train.steps=2", "--config.model.impl=fast"), wd,
               **QUIET)
  assert not os.path.exists(wd)


@pytest.mark.parametrize("heads,msg", [
    (("2", "1", "0"), r"sentence 1 of .*: the heads form a cycle \(tokens 1 -> 2 -> 1\)"),
    (("1", "0", "2"), r"the heads form a cycle \(tokens 1 -> 1\)"),
    (("2", "3", "1"), r"sentence 1 of .* has no root \(no token with head 0\)"),
])
def test_conllu_heads_that_form_no_tree_are_refused(tmp_path, heads, msg):
  from mha_jax.data import parallel
  p = tmp_path / "t.conllu"
  p.write_text(f"1\tthe\tthe\tDET\t_\t_\t{heads[0]}\tdet\t_\t_\n"
               f"2\tdog\tdog\tNOUN\t_\t_\t{heads[1]}\troot\t_\t_\n"
               f"3\truns\trun\tVERB\t_\t_\t{heads[2]}\troot\t_\t_\n\n")
  with pytest.raises(UserError, match=msg):
    parallel.read_conllu_arcs(str(p), [["the", "dog", "runs"]], "data.conllu.train")


# ------------------------------------------------------------------ orbax closed cleanly

def _cli(*argv, timeout=240, env=None):
  """`python -m mha_jax.cli ARGV` in a subprocess: (returncode, stdout, stderr)."""
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  p = subprocess.run([sys.executable, "-m", "mha_jax.cli", *argv], cwd=root, text=True,
                     capture_output=True, timeout=timeout, env={**os.environ, **(env or {})})
  return p.returncode, p.stdout, p.stderr


def _truncate_params(wd, step):
  from test_faults import _largest
  for f in _largest(os.path.join(wd, "checkpoints", str(step), "params")):
    open(f, "r+b").truncate(100)


def test_the_checkpoint_fallback_prints_its_warnings_and_no_asyncio_tracebacks(run8,
                                                                              tmp_path):
  wd = _copy(run8, tmp_path)
  _truncate_params(wd, 8)
  rc, out, err = _cli("eval", "--workdir", wd, "--split", "valid")
  assert rc == 0 and json.loads(out)["step"] == 4
  lines = err.strip().splitlines()
  assert len(lines) == 2 and "checkpoints/8 is unreadable" in lines[0], err[:3000]
  _truncate_params(wd, 4)                                      # every checkpoint bad
  rc, out, err = _cli("eval", "--workdir", wd)
  assert rc == 2 and "Traceback" not in err and "Event loop is closed" not in err, err[:3000]
  assert err.strip().splitlines()[-1].startswith("mha-jax: error: every checkpoint in")
