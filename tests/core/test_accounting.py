"""Cost accounting against the real param pytrees and XLA's own FLOP count."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mha_jax import accounting
from mha_jax import attention


@pytest.mark.parametrize("h", [1, 2, 4, 8, 16, 32, 64])
@pytest.mark.parametrize("use_bias", [False, True])
def test_param_count_matches_pytree_and_is_flat_in_h(h, use_bias):
  d = 64
  p = jax.eval_shape(lambda k: attention.init_attention_params(k, d, h, use_bias=use_bias),
                     jax.random.PRNGKey(0))
  n = sum(int(np.prod(a.shape)) for a in jax.tree.leaves(p))
  assert n == accounting.attention_params(d, h, use_bias=use_bias)
  assert n == 4 * d * d + (4 * d if use_bias else 0)


@pytest.mark.parametrize("h,g", [(8, 1), (8, 2), (12, 3), (64, 8)])
@pytest.mark.parametrize("use_bias", [False, True])
def test_gqa_param_count_matches_pytree(h, g, use_bias):
  d = 128 if h != 12 else 96
  p = jax.eval_shape(lambda k: attention.init_attention_params(k, d, h, use_bias=use_bias,
                                                        num_kv_heads=g), jax.random.PRNGKey(0))
  n = sum(int(np.prod(a.shape)) for a in jax.tree.leaves(p))
  assert n == accounting.attention_params(d, h, use_bias=use_bias, num_kv_heads=g)
  k = d // h
  assert n == 2 * d * h * k + 2 * d * g * k + ((h * k + 2 * g * k + d) if use_bias else 0)
  assert accounting.attention_params(d, h, num_kv_heads=h) == accounting.attention_params(d, h)


def test_kv_cache_bytes_match_the_cache_pytree():
  for b, t, g, k, dtype in ((1, 16, 8, 128, jnp.bfloat16), (3, 5, 1, 64, jnp.float32)):
    c = jax.eval_shape(lambda: attention.init_kv_cache(b, t, g, k, dtype))
    n = sum(a.size * a.dtype.itemsize for a in (c["k"], c["v"]))
    assert n == accounting.kv_cache_bytes(t, g, k, batch=b, dtype=dtype)
  # LLaMA-2 70B: 80 layers, 8 kv heads of 128, bf16, 4096 tokens = 1.25 GiB per sequence.
  assert accounting.kv_cache_bytes(4096, 8, 128, num_layers=80, dtype=jnp.bfloat16) == \
      2 * 80 * 4096 * 8 * 128 * 2 == 1.25 * 2**30
  with pytest.raises(ValueError, match="num_kv_heads must be a positive integer; got 0"):
    accounting.kv_cache_bytes(16, 0, 64)


def _xla_flops(fn, *args):
  cost = jax.jit(fn).lower(*args).compile().cost_analysis()
  if isinstance(cost, (list, tuple)):
    cost = cost[0]
  return float(cost["flops"])


@pytest.mark.parametrize("d,h,t,s", [(128, 4, 64, 64), (128, 16, 64, 64), (256, 8, 128, 128),
                                     (128, 8, 32, 96)])
def test_flops_match_xla_within_5_percent(d, h, t, s):
  p = attention.init_attention_params(jax.random.PRNGKey(0), d, h)
  x = jnp.zeros((2, t, d))
  c = jnp.zeros((2, s, d))
  want = accounting.attention_flops(d, t, kv_len=s, batch=2)["total"]
  for impl in ("reference", "xla"):
    got = _xla_flops(lambda p, x, c: attention.multi_head_attention(p, x, c, impl=impl), p, x, c)
    assert abs(got - want) / want < 0.05, (impl, got, want)


def test_gqa_flops_match_xla_within_5_percent():
  d, h, g, t, s = 256, 8, 2, 32, 96
  p = attention.init_attention_params(jax.random.PRNGKey(0), d, h, num_kv_heads=g)
  x, c = jnp.zeros((2, t, d)), jnp.zeros((2, s, d))
  want = accounting.attention_flops(d, t, kv_len=s, batch=2, num_heads=h, num_kv_heads=g)
  mha = accounting.attention_flops(d, t, kv_len=s, batch=2)
  assert want["scores"] == mha["scores"] and want["mixing"] == mha["mixing"]
  assert mha["projections"] - want["projections"] == 2 * 4 * s * d * (d - g * d // h)
  for impl in ("reference", "xla"):
    got = _xla_flops(lambda p, x, c: attention.multi_head_attention(p, x, c, impl=impl), p, x, c)
    assert abs(got - want["total"]) / want["total"] < 0.05, (impl, got, want)


def test_flops_do_not_depend_on_h_but_score_memory_does():
  d, t = 256, 64
  counts = []
  for h in (1, 4, 16, 64, 256):
    p = attention.init_attention_params(jax.random.PRNGKey(0), d, h)
    counts.append(_xla_flops(lambda p, x: attention.multi_head_attention(p, x, impl="reference"),
                             p, jnp.zeros((1, t, d))))
  base = accounting.attention_flops(d, t)["total"]
  # XLA adds softmax elementwise work (a few ops per score), which grows with h.
  assert all(abs(c - base) / base < 0.05 for c in counts[:4]), counts
  mem = [accounting.score_memory_bytes(2, h, 128) for h in (8, 16, 96)]
  assert mem == [2 * h * 128 * 128 * 4 for h in (8, 16, 96)]
  params = jax.eval_shape(lambda k: attention.init_attention_params(k, 256, 16), jax.random.PRNGKey(0))
  w = jax.eval_shape(lambda p, x: attention.multi_head_attention(p, x, return_weights=True).weights,
                     params, jax.ShapeDtypeStruct((2, 128, 256), jnp.float32))
  assert int(np.prod(w.shape)) * 4 == accounting.score_memory_bytes(2, 16, 128)


def test_zoo_rows_and_bad_input():
  rows = {r["model"]: r for r in accounting.zoo_rows(seq_len=1024)}
  assert rows["GPT-3 175B"]["d_k"] == 128 and rows["Transformer-base"]["d_k"] == 64
  assert rows["GPT-2 XL"]["d_k"] == 64 and rows["LLaMA 33B"]["d_k"] == 128
  assert rows["LLaMA 7B"]["params"] == 4 * 4096**2
  assert (rows["LLaMA-2 70B"]["heads"], rows["LLaMA-2 70B"]["kv_heads"]) == (64, 8)
  assert rows["LLaMA-2 70B"]["params"] == 2 * 8192**2 + 2 * 8192 * 8 * 128
  assert rows["LLaMA-3 8B"]["kv_cache_mib"] == 2 * 1024 * 8 * 128 * 4 / 2**20
  assert rows["LLaMA 65B"]["kv_cache_mib"] == 8 * rows["LLaMA-2 70B"]["kv_cache_mib"]
  with pytest.raises(ValueError, match="num_kv_heads=3 does not divide num_heads=8"):
    accounting.attention_params(64, 8, num_kv_heads=3)
  with pytest.raises(ValueError, match="num_heads=5 does not divide d_model=64"):
    accounting.attention_params(64, 5)
  with pytest.raises(ValueError, match="seq_len must be a positive integer; got 0"):
    accounting.attention_flops(64, 0)


@pytest.mark.parametrize("variant", ["softmax", "gated", "gated_head", "differential",
                                     "sigmoid", "sink", "qk_norm"])
def test_variant_params_match_init_and_flops_match_xla(variant):
  """Counted params equal init_attention_params' leaves; counted FLOPs equal XLA's
  matmul count of the reference forward (elementwise work aside, within 10%)."""
  import jax
  from mha_jax import attention
  d, h, t = 64, 4, 16
  shapes = jax.eval_shape(lambda k: attention.init_attention_params(k, d, h, variant=variant,
                                                            use_bias=True),
                          jax.random.PRNGKey(0))
  assert sum(int(np.prod(a.shape)) for a in jax.tree.leaves(shapes)) == \
      accounting.attention_params(d, h, use_bias=True, variant=variant)
  p = attention.init_attention_params(jax.random.PRNGKey(0), d, h, variant=variant)
  x = jax.numpy.ones((1, t, d))
  cost = jax.jit(lambda p, x: attention.multi_head_attention(p, x, variant=variant,
                                                     impl="reference")).lower(
      p, x).compile().cost_analysis()
  cost = cost[0] if isinstance(cost, list) else cost
  want = accounting.attention_flops(d, t, num_heads=h, variant=variant)["total"]
  assert want <= cost["flops"] <= 1.1 * want, (cost["flops"], want)
  base = accounting.score_memory_bytes(1, h, t)
  assert accounting.score_memory_bytes(1, h, t, variant=variant) == (
      2 * base if variant == "differential" else base)
