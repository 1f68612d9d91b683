"""ALiBi (BLOOM's linear score bias, params["alibi"]) in the one attention function,
against the float64 NumPy oracle with the bias written out densely: every kernel,
gradients (blocked against reference), and decoding with a KV cache."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mha_jax import attention
from oracles import numpy_mha, rel_err


def _params(rng, d=32, h=6, g=6, k=8):
  shapes = attention.param_shapes(d, h, k, g)
  p = {n: jnp.asarray(rng.standard_normal(shapes[n]) * (0.4 if n[0] == "w" else 0.2),
                      jnp.float32) for n in ("wq", "wk", "wv", "wo", "bq", "bk", "bv", "bo")}
  p["alibi"] = jnp.asarray(attention.alibi_slopes(h))
  return p


def _dense_alibi(slopes, t, s, offset=0):
  """(1, H, T, S) slope_h * (j - i), query i at position offset + i."""
  off = np.arange(s)[None, :] - (offset + np.arange(t))[:, None]
  return np.asarray(slopes, np.float64)[None, :, None, None] * off[None, None]


def test_alibi_slopes_are_bloom_s():
  """2^(-8 i / n) for a power of two; H = 6 takes n = 4 and 2 odd steps of the n = 8
  sequence (Press et al.'s recipe), written out here by hand."""
  want4 = [2 ** -2, 2 ** -4, 2 ** -6, 2 ** -8]
  np.testing.assert_allclose(attention.alibi_slopes(4), want4, rtol=1e-7)
  np.testing.assert_allclose(attention.alibi_slopes(6), want4 + [2 ** -1, 2 ** -3], rtol=1e-7)


@pytest.mark.parametrize("impl", ["reference", "blocked", "xla"])
def test_alibi_matches_the_dense_bias_oracle(impl):
  rng = np.random.default_rng(0)
  p = _params(rng)
  x = jnp.asarray(rng.standard_normal((2, 40, 32)), jnp.float32)
  mask = np.ones((2, 1, 1, 40), bool)
  mask[1, ..., :5] = False                    # left padding on row 1
  want, _ = numpy_mha(p, x, mask=mask, causal=True,
                      bias=_dense_alibi(p["alibi"], 40, 40))
  got = attention.multi_head_attention(p, x, causal=True, mask=jnp.asarray(mask), impl=impl)
  assert rel_err(got, want) < 1e-5
  without = attention.multi_head_attention({k: v for k, v in p.items() if k != "alibi"}, x,
                                           causal=True, mask=jnp.asarray(mask), impl=impl)
  assert rel_err(without, want) > 1e-2        # the bias matters at this length


@pytest.mark.slow
def test_alibi_gradients_blocked_equal_reference():
  rng = np.random.default_rng(1)
  p = _params(rng)
  x = jnp.asarray(rng.standard_normal((2, 48, 32)), jnp.float32)
  ct = jnp.asarray(rng.standard_normal((2, 48, 32)), jnp.float32)

  def loss(p, x, impl):
    return jnp.sum(attention.multi_head_attention(p, x, causal=True, impl=impl) * ct)
  gr = jax.grad(loss, argnums=(0, 1))(p, x, "reference")
  gb = jax.grad(loss, argnums=(0, 1))(p, x, "blocked")
  for name in ("wq", "wk", "wv", "alibi"):
    assert rel_err(gb[0][name], gr[0][name]) < 1e-4, name
  assert rel_err(gb[1], gr[1]) < 1e-4


@pytest.mark.slow  # default run: test_alibi_matches_the_dense_bias_oracle
def test_alibi_with_a_kv_cache_equals_the_full_oracle():
  """A prompt of 7 then 5 single steps through the cache: each step's output equals the
  oracle's row of the full 12-token call."""
  rng = np.random.default_rng(2)
  p = _params(rng, h=4, g=2)
  x = jnp.asarray(rng.standard_normal((1, 12, 32)), jnp.float32)
  want, _ = numpy_mha(p, x, causal=True, bias=_dense_alibi(p["alibi"], 12, 12))
  cache = attention.init_kv_cache(1, 16, 2, 8)
  y, cache = attention.multi_head_attention(p, x[:, :7], causal=True, cache=cache)
  outs = [y]
  for i in range(7, 12):
    y, cache = attention.multi_head_attention(p, x[:, i:i + 1], causal=True, cache=cache)
    outs.append(y)
  assert rel_err(jnp.concatenate(outs, 1), want) < 1e-5


def test_alibi_shape_and_rel_bias_together_are_refused():
  p = _params(np.random.default_rng(3))
  x = jnp.zeros((1, 4, 32), jnp.float32)
  with pytest.raises(ValueError, match="alibi"):
    attention.multi_head_attention({**p, "alibi": p["alibi"][:3]}, x)
  with pytest.raises(ValueError, match="alibi.*rel_bias"):
    attention.multi_head_attention({**p, "rel_bias": jnp.zeros((6, 5))}, x)
