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
