"""A variant added through the registry alone (mha_jax.attention_variants.register): it
runs through multi_head_attention, its sites, accounting, dispatch and the config
checks, checked against a float64 NumPy forward and XLA's own FLOP count."""

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from mha_jax import accounting, attention, attention_variants, config, interventions
from mha_jax.errors import UserError
from mha_jax.kernels import dispatch

D, H, T, B = 16, 4, 5, 2
NAME = "toy_tanh_gate"


def _tanh_gate(params, x, logits):
  """(B, T, H): tanh(x u), one scalar per token and head."""
  b, t, d = x.shape
  return jnp.tanh(x.reshape(b * t, d) @ params["u"].astype(x.dtype)).reshape(b, t, -1)


TOY = attention_variants.Variant(
    NAME, "each head's output times tanh(x u_h)",
    params=lambda d, h, k: {"u": (d, h)},
    init={"u": lambda key, shape, dtype: 0.5 * jax.random.normal(key, shape, dtype)},
    sites=("gate",), gate=_tanh_gate, kernels=("reference", "blocked"),
    flops=lambda t, s, d, h: 2 * t * d * h)


@pytest.fixture
def toy():
  attention_variants.register(TOY)
  try:
    yield TOY
  finally:
    attention_variants.unregister(NAME)


def _oracle(p, x):
  """The toy in float64 NumPy: causal softmax attention per head, each head's output
  times tanh(x u_h), then W_O."""
  p = {n: np.asarray(a, np.float64) for n, a in p.items()}
  x = np.asarray(x, np.float64)
  q, k, v = (np.einsum("btd,dhk->bthk", x, p[n]) for n in ("wq", "wk", "wv"))
  s = np.einsum("bthk,bshk->bhts", q, k) / np.sqrt(q.shape[-1])
  s = np.where(np.tril(np.ones((T, T), bool)), s, -np.inf)
  w = np.exp(s - s.max(-1, keepdims=True))
  w /= w.sum(-1, keepdims=True)
  o = np.einsum("bhts,bshk->bthk", w, v) * np.tanh(x @ p["u"])[..., None]
  return np.einsum("bthk,hkd->btd", o, p["wo"]), o


def test_a_registered_variant_runs_through_attention_and_its_gate_site(toy):
  p = attention.init_attention_params(jax.random.PRNGKey(0), D, H, variant=NAME)
  plain = attention.init_attention_params(jax.random.PRNGKey(0), D, H)
  assert set(p) == set(plain) | {"u"} and p["u"].shape == (D, H)
  np.testing.assert_array_equal(p["wq"], plain["wq"])   # the variant draws its own key
  assert NAME in attention.VARIANTS and NAME in dispatch.VARIANT_KERNELS
  x = jnp.asarray(np.random.default_rng(0).standard_normal((B, T, D)), jnp.float32)
  want, heads = _oracle(p, x)
  for impl in ("reference", "blocked", "auto"):
    got = attention.multi_head_attention(p, x, causal=True, variant=NAME, impl=impl)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, err_msg=impl)
  r = attention.multi_head_attention(p, x, causal=True, variant=NAME, return_weights=True)
  np.testing.assert_allclose(r.heads, heads, rtol=1e-5, atol=1e-5)
  with pytest.raises(ValueError, match=f"impl='xla' does not serve variant='{NAME}'"):
    attention.multi_head_attention(p, x, variant=NAME, impl="xla")
  with pytest.raises(ValueError, match=r"'u'.*variant='softmax'"):
    attention.multi_head_attention(p, x)
  # Its gate is a site like the built-in gates': read it, and a gate of 1 is softmax.
  _, got = interventions.run_with_hook(lambda hook: attention.multi_head_attention(
      p, x, causal=True, variant=NAME, site=interventions.scope(hook, "lm.0.attn")),
      None, ["lm.0.attn.gate"])
  np.testing.assert_allclose(got["lm.0.attn.gate"], np.tanh(np.asarray(x, np.float64)
                                                            @ np.asarray(p["u"])), rtol=1e-5)
  y1, _ = interventions.run_with_hook(lambda hook: attention.multi_head_attention(
      p, x, causal=True, variant=NAME, site=interventions.scope(hook, "lm.0.attn")),
      {"lm.0.attn.gate": interventions.replace(1.0)}, ())
  np.testing.assert_allclose(y1, attention.multi_head_attention(plain, x, causal=True),
                             rtol=1e-5, atol=1e-6)


def test_a_registered_variant_is_counted_and_dispatched(toy):
  d, h, t = 64, 4, 16
  assert accounting.attention_params(d, h, variant=NAME) == 4 * d * d + d * h
  shapes = jax.eval_shape(lambda k: attention.init_attention_params(k, d, h, variant=NAME),
                          jax.random.PRNGKey(0))
  assert sum(int(np.prod(a.shape)) for a in jax.tree.leaves(shapes)) == 4 * d * d + d * h
  flops = accounting.attention_flops(d, t, num_heads=h, variant=NAME)
  assert flops["projections"] == 8 * t * d * d + 2 * t * d * h
  assert flops["total"] == flops["projections"] + 4 * t * t * d
  p = attention.init_attention_params(jax.random.PRNGKey(0), d, h, variant=NAME)
  cost = jax.jit(lambda p, x: attention.multi_head_attention(
      p, x, variant=NAME, impl="reference")).lower(p, jnp.ones((1, t, d))).compile()
  cost = cost.cost_analysis()
  cost = cost[0] if isinstance(cost, list) else cost
  assert flops["total"] <= cost["flops"] <= 1.1 * flops["total"]
  assert accounting.score_memory_bytes(1, h, t, variant=NAME) == 4 * h * t * t
  assert dispatch.VARIANT_KERNELS[NAME] == ("reference", "blocked")
  q = jnp.ones((1, 4096, h, 16))    # large: auto's choice among the two
  assert dispatch.resolve_impl("auto", q, False, variant=NAME) == "blocked"
  with pytest.raises(ValueError, match=f"impl='pallas' does not serve variant='{NAME}'"):
    dispatch.resolve_impl("pallas", q, False, variant=NAME)
  cfg = ml_collections.ConfigDict({"model": {"impl": "xla", "attention": NAME}})
  with pytest.raises(UserError, match=f"model.impl='xla' does not serve model.attention='{NAME}'"):
    config.check_impl(cfg)
  cfg.model.impl = "blocked"
  config.check_impl(cfg)


def test_the_registry_refuses_a_second_name_and_keeps_the_built_in_ones():
  assert NAME not in attention.VARIANTS
  with pytest.raises(ValueError, match="already registered"):
    attention_variants.register(attention_variants.get("gated"))
  with pytest.raises(ValueError, match="built in"):
    attention_variants.unregister("gated")
  with pytest.raises(UserError, match=f"variant must be one of .*'{NAME}'"):
    accounting.attention_params(64, 4, variant=NAME)
  assert tuple(attention.VARIANTS) == attention_variants.BUILT_IN
