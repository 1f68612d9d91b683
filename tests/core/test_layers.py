"""The Flax layer and the converters to and from Flax's own attention."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from mha_jax import attention, layers


@pytest.mark.parametrize("use_bias", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_layer_owns_params_in_the_documented_layout(use_bias):
  x = jnp.ones((2, 5, 48))
  m = layers.MultiHeadAttention(num_heads=6, use_bias=use_bias)
  v = m.init(jax.random.PRNGKey(0), x)
  shapes = jax.tree.map(jnp.shape, v["params"])
  want = {"wq": (48, 6, 8), "wk": (48, 6, 8), "wv": (48, 6, 8), "wo": (6, 8, 48)}
  if use_bias:
    want.update(bq=(6, 8), bk=(6, 8), bv=(6, 8), bo=(48,))
  assert shapes == want
  # The layer is the pure function on its own params.
  x = jax.random.normal(jax.random.PRNGKey(1), x.shape)
  np.testing.assert_allclose(m.apply(v, x, causal=True),
                             attention.multi_head_attention(v["params"], x, causal=True),
                             atol=1e-6)


def test_layer_rejects_heads_not_dividing_width():
  with pytest.raises(ValueError, match="num_heads=5 does not divide d_model=48"):
    layers.MultiHeadAttention(num_heads=5).init(jax.random.PRNGKey(0), jnp.ones((1, 2, 48)))


@pytest.mark.parametrize("use_bias", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_same_output_as_flax_linen_on_the_same_weights(use_bias):
  x = jax.random.normal(jax.random.PRNGKey(1), (2, 7, 64))
  ctx = jax.random.normal(jax.random.PRNGKey(2), (2, 9, 64))
  mask = jax.random.bernoulli(jax.random.PRNGKey(3), 0.7, (2, 1, 7, 9)).at[..., 0].set(True)
  flax_mod = nn.MultiHeadDotProductAttention(num_heads=8, use_bias=use_bias)
  fv = flax_mod.init(jax.random.PRNGKey(0), x, ctx)
  if use_bias:  # Flax inits biases to zero; make them count
    fv = jax.tree_util.tree_map_with_path(
        lambda path, a: a + 0.1 if path[-1].key == "bias" else a, fv)
  ours = layers.from_flax_linen(fv)
  assert set(ours) == ({"wq", "wk", "wv", "wo"} | ({"bq", "bk", "bv", "bo"} if use_bias else set()))
  want = flax_mod.apply(fv, x, ctx, mask=mask)
  for impl in ("reference", "xla"):
    got = attention.multi_head_attention(ours, x, ctx, mask=mask, impl=impl)
    np.testing.assert_allclose(got, want, atol=1e-5)
  # And back: our layer's params run inside Flax's module.
  ov = layers.MultiHeadAttention(8, use_bias=use_bias).init(jax.random.PRNGKey(5), x, ctx)
  np.testing.assert_allclose(
      flax_mod.apply({"params": layers.to_flax_linen(ov["params"])}, x, ctx, mask=mask),
      layers.MultiHeadAttention(8, use_bias=use_bias).apply(ov, x, ctx, mask=mask),
      atol=1e-5)
  assert jax.tree.all(jax.tree.map(
      jnp.array_equal, layers.from_flax_linen(layers.to_flax_linen(ov["params"])),
      dict(ov["params"])))


def test_same_output_as_flax_nnx_on_the_same_weights():
  x = jax.random.normal(jax.random.PRNGKey(1), (2, 7, 32))
  model = nnx.MultiHeadAttention(4, 32, decode=False, rngs=nnx.Rngs(0))
  state = nnx.to_pure_dict(nnx.state(model, nnx.Param))
  ours = layers.from_flax_linen(state)
  np.testing.assert_allclose(attention.multi_head_attention(ours, x), model(x), atol=1e-5)


@pytest.mark.slow  # default run: test_attention.py::test_gqa_rope_gradients_agree_across_impls_and_with_finite_differences
def test_layer_with_grouped_kv_heads_and_rope():
  x = jax.random.normal(jax.random.PRNGKey(1), (2, 5, 48))
  rope = attention.RoPE(layout="interleaved")
  m = layers.MultiHeadAttention(num_heads=6, num_kv_heads=2, use_bias=True, rope=rope)
  v = m.init(jax.random.PRNGKey(0), x)
  shapes = jax.tree.map(jnp.shape, v["params"])
  assert shapes == {"wq": (48, 6, 8), "wk": (48, 2, 8), "wv": (48, 2, 8), "wo": (6, 8, 48),
                    "bq": (6, 8), "bk": (2, 8), "bv": (2, 8), "bo": (48,)}
  pos = jnp.arange(5) + 3
  np.testing.assert_allclose(
      m.apply(v, x, causal=True, positions=pos),
      attention.multi_head_attention(v["params"], x, causal=True, rope=rope, positions=pos),
      atol=1e-6)
  with pytest.raises(ValueError, match=r"2 key/value heads for 6 query heads.*cannot express"):
    layers.to_flax_linen(v["params"])
  with pytest.raises(ValueError, match=r"num_kv_heads=4 does not divide num_heads=6"):
    layers.MultiHeadAttention(num_heads=6, num_kv_heads=4).init(jax.random.PRNGKey(0), x)


def test_converter_errors_name_what_is_missing():
  with pytest.raises(ValueError, match=r"flax_params is missing \['out'\]"):
    layers.from_flax_linen({"query": {}, "key": {}, "value": {}})
