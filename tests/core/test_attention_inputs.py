"""Attention's hard inputs: NaN or inf in masked keys or values never reach real queries;
reference scores too big to fit are explained before any allocation."""


import numpy as np
import pytest

from oracles import numpy_mha


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


def test_reference_scores_that_cannot_fit_are_explained_before_any_allocation(monkeypatch):
  import jax
  import jax.numpy as jnp
  from mha_jax import attention
  from mha_jax.kernels import dispatch
  monkeypatch.setattr(dispatch, "memory_limit",
                      lambda target=None: (8 * 2**30, "the process's address-space limit (RLIMIT_AS)"),
                      raising=False)
  params = attention.init_attention_params(jax.random.PRNGKey(0), 16, 8)
  x = jax.ShapeDtypeStruct((1, 16384, 16), jnp.float32)       # never allocated
  call = lambda impl, **k: jax.eval_shape(
      lambda x: attention.multi_head_attention(params, x, causal=True, impl=impl, **k), x)
  with pytest.raises(ValueError, match=r"impl='reference' holds the \(B, H, T, S\) = "
                                       r"\(1, 8, 16384, 16384\) attention scores whole: "
                                       r"16.0 GiB .* more than the process's address-space "
                                       r"limit \(RLIMIT_AS\) \(8.0 GiB\)\. Use impl='blocked' "
                                       r"\(or 'auto', which picks it at this size\)"):
    call("reference")
  with pytest.raises(ValueError, match=r"Attention weights \(return_weights=True\) are this tensor"):
    call("auto", return_weights=True)
  assert call("blocked").shape == (1, 16384, 16)
  assert call("auto").shape == (1, 16384, 16)
