"""Shape contracts over the model zoo, h = 8 ... 96.

At the real widths every intermediate is checked through jax.eval_shape (no memory is
spent); real numbers are computed at a reduced width with the same h.
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from oracles import numpy_mha
from mha_jax import accounting
from mha_jax import attention

ZOO = {e.name: e for e in accounting.ZOO}
T, B = 128, 2


@pytest.mark.parametrize("name", list(ZOO))
def test_every_intermediate_shape_at_real_width(name):
  e = ZOO[name]
  d, h, k, g = e.d_model, e.num_heads, e.d_model // e.num_heads, e.kv_heads
  params = jax.eval_shape(lambda key: attention.init_attention_params(key, d, h, use_bias=True,
                                                              num_kv_heads=g),
                          jax.random.PRNGKey(0))
  chex.assert_trees_all_equal_shapes(params, {n: jax.ShapeDtypeStruct(s, jnp.float32) for n, s
                                              in attention.param_shapes(d, h, k, g).items()})
  # Each of W_Q, W_O holds d_model x d_model numbers, whatever h is; W_K, W_V too
  # unless the key/value heads are grouped (then h_kv / h of that).
  assert all(np.prod(params[n].shape) == d * d for n in ("wq", "wo"))
  assert all(np.prod(params[n].shape) == d * d * g // h for n in ("wk", "wv"))
  x = jax.ShapeDtypeStruct((B, T, d), jnp.float32)
  ctx = jax.ShapeDtypeStruct((B, 2 * T, d), jnp.float32)
  q = jax.eval_shape(lambda x: attention.split_heads(x, h), x)
  kk = jax.eval_shape(lambda c: attention.split_heads(c[..., :g * k], g), ctx)
  s = jax.eval_shape(attention.attention_scores, q, kk)
  w = jax.eval_shape(attention.attention_weights, s)
  o = jax.eval_shape(attention.mix_values, w, kk)
  m = jax.eval_shape(attention.merge_heads, o)
  assert (q.shape, kk.shape, s.shape, w.shape, o.shape, m.shape) == (
      (B, T, h, k), (B, 2 * T, g, k), (B, h, T, 2 * T), (B, h, T, 2 * T), (B, T, h, k),
      (B, T, d))
  assert w.dtype == jnp.float32
  for impl in ("reference", "xla", "blocked", "auto"):
    out = jax.eval_shape(lambda p, x, c: attention.multi_head_attention(p, x, c, impl=impl), params,
                         x, ctx)
    assert out.shape == (B, T, d)
  r = jax.eval_shape(lambda p, x: attention.multi_head_attention(p, x, causal=True,
                                                         return_weights=True), params, x)
  assert (r.out.shape, r.weights.shape, r.heads.shape) == ((B, T, d), (B, h, T, T), (B, T, h, k))


@pytest.mark.parametrize("name", [n for n, e in ZOO.items() if e.num_kv_heads is None])
def test_gqa_variants_at_real_width(name):
  """Multi-query (h_kv = 1) and h_kv = h/4 of every multi-head zoo entry: params, the
  decode step with a KV cache and RoPE, weights per query head, through eval_shape."""
  e = ZOO[name]
  d, h, k = e.d_model, e.num_heads, e.head_dim
  for g in sorted({1, h // 4 if h % 4 == 0 else 1}):
    params = jax.eval_shape(lambda key: attention.init_attention_params(key, d, h, num_kv_heads=g),
                            jax.random.PRNGKey(0))
    assert (params["wk"].shape, params["wv"].shape) == ((d, g, k), (d, g, k))
    cache = jax.eval_shape(lambda: attention.init_kv_cache(B, T, g, k))
    x1 = jax.ShapeDtypeStruct((B, 1, d), jnp.float32)
    (r, new) = jax.eval_shape(lambda p, x, c: attention.multi_head_attention(
        p, x, causal=True, rope=attention.RoPE(), cache=c, return_weights=True), params, x1, cache)
    assert (r.out.shape, r.weights.shape, r.heads.shape) == ((B, 1, d), (B, h, 1, T),
                                                             (B, 1, h, k))
    chex.assert_trees_all_equal_shapes_and_dtypes(new, cache)


# LLaMA-3 8B (32 / 8 heads) has LLaMA-2 70B's grouping at a smaller h: shapes only. The
# default run computes the ends of the range and the grouped one (h = 8, 64 over 8 key/value
# heads, 96); every h between is the same code at another h, `slow` (the shapes above run
# at every h by default).
_NUMBERS_BY_DEFAULT = ("Transformer-base", "LLaMA-2 70B", "GPT-3 175B")


@pytest.mark.parametrize("name", [
    n if n in _NUMBERS_BY_DEFAULT else pytest.param(n, marks=pytest.mark.slow)
    for n in ZOO if n != "LLaMA-3 8B"])
def test_real_numbers_at_reduced_width_same_heads(name):
  h, g = ZOO[name].num_heads, ZOO[name].kv_heads
  d = 2 * h                                   # d_k = 2, same h and h_kv
  p = attention.init_attention_params(jax.random.PRNGKey(h), d, h, use_bias=True, num_kv_heads=g)
  x = jax.random.normal(jax.random.PRNGKey(1), (2, 5, d))
  mask = jnp.tril(jnp.ones((5, 5), bool))
  r = jax.jit(lambda p, x: attention.multi_head_attention(p, x, mask=mask, return_weights=True))(p, x)
  want_out, want_w = numpy_mha(p, x, mask=mask)
  np.testing.assert_allclose(r.out, want_out, atol=1e-5)
  np.testing.assert_allclose(r.weights, want_w, atol=1e-6)
  np.testing.assert_allclose(jax.jit(lambda p, x: attention.multi_head_attention(
      p, x, mask=mask, impl="xla"))(p, x), want_out, atol=1e-5)
