"""Tests of the fused q/k/v projection and of the attention variants (gated, gated_head,
differential, sigmoid, sink, qk_norm) against float64 NumPy oracles."""

import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mha_jax import attention as A

sys.path.insert(0, os.path.dirname(__file__))
import golden_cases  # noqa: E402

_GOLDEN = os.path.join(os.path.dirname(__file__), "data", "attention_softmax_golden.npz")


def _close(got, want, rtol=1e-6, what=""):
  """|got - want| <= rtol * max|want| (float32 sums in another order)."""
  got, want = np.asarray(got), np.asarray(want)
  assert got.shape == want.shape, what
  scale = max(float(np.max(np.abs(want))), 1e-30)
  err = float(np.max(np.abs(got - want))) if want.size else 0.0
  assert err <= rtol * scale, f"{what}: max error {err:.3g} > {rtol} * {scale:.3g}"


# ---------------------------------------------------------------- the fused projection

@pytest.mark.parametrize("h,g", [(1, 1), (8, 8), (96, 96), (8, 2), (12, 1)])
def test_fused_qkv_projection_equals_three_matmuls_with_gradients(h, g):
  """Self-attention projects q, k and v with one matmul of the concatenated weights;
  passing the same values as a distinct context array takes the unfused path (three
  matmuls). Outputs and gradients agree to 1e-6 of their scale."""
  rng = np.random.default_rng(h * 100 + g)
  d, k = 96, 96 // h
  shapes = A.param_shapes(d, h, k, g)
  p = {n: jnp.asarray(rng.standard_normal(shapes[n]) * (d ** -0.5 if n[0] == "w" else 0.1),
                      jnp.float32) for n in ("wq", "wk", "wv", "wo", "bq", "bk", "bv", "bo")}
  x = jnp.asarray(rng.standard_normal((2, 3, d)), jnp.float32)
  mask = jnp.asarray(rng.random((2, 1, 3, 3)) < 0.8)

  def fused(p, x):
    return A.multi_head_attention(p, x, mask=mask, causal=True)

  def unfused(p, x):   # x + 0: equal values, another array: one matmul per projection
    return A.multi_head_attention(p, x, x + 0.0, mask=mask, causal=True)

  def both(p, x):
    loss = lambda f: lambda p, x: jnp.sum(jnp.sin(f(p, x)))
    return (fused(p, x), unfused(p, x), jax.grad(loss(fused), argnums=(0, 1))(p, x),
            jax.grad(loss(unfused), argnums=(0, 1))(p, x))

  yf, yu, gf, gu = jax.jit(both)(p, x)
  _close(yf, yu, what="out")
  for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(gf)[0], jax.tree.leaves(gu)):
    if "bk" in jax.tree_util.keystr(path):   # analytically 0: float noise either way
      np.testing.assert_allclose(a, b, atol=1e-6)
    else:
      _close(a, b, what=jax.tree_util.keystr(path))


def test_softmax_is_bit_identical_to_the_code_before_the_variants():
  """The golden file holds outputs and gradients of the default (softmax) attention from
  before the variants existed (scripts/make_attention_golden.py, the tests' XLA flags)."""
  want = np.load(_GOLDEN)
  got = golden_cases.compute_all()
  assert sorted(got) == sorted(want.files)
  for name in want.files:
    np.testing.assert_array_equal(got[name], want[name], err_msg=name)
