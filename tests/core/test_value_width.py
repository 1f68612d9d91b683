"""Value heads of another width than the query/key heads (V != K, DeepSeek's MLA) in the
one attention function, against the float64 NumPy oracle: forward on the kernels that
serve it, gradients (central differences of the oracle), and decoding with a KV cache."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mha_jax import attention
from oracles import numpy_mha, rel_err

D, H, G, K, V = 24, 4, 2, 6, 10


def _params(rng, g=G):
  shapes = attention.param_shapes(D, H, K, g, V)
  assert shapes["wv"] == (D, g, V) and shapes["wo"] == (H, V, D) and shapes["bv"] == (g, V)
  return {n: jnp.asarray(rng.standard_normal(shapes[n]) * (0.4 if n[0] == "w" else 0.2),
                         jnp.float32) for n in ("wq", "wk", "wv", "wo", "bq", "bk", "bv", "bo")}


@pytest.mark.parametrize("impl", [pytest.param("reference", marks=pytest.mark.slow),
                                  pytest.param("blocked", marks=pytest.mark.slow), "auto"])
def test_v_wider_than_k_matches_the_oracle(impl):
  rng = np.random.default_rng(0)
  p = _params(rng)
  x = jnp.asarray(rng.standard_normal((2, 9, D)), jnp.float32)
  rope = attention.RoPE(base=100.0, dim=4, layout="interleaved")
  want, w = numpy_mha(p, x, causal=True, rope=(100.0, "interleaved", 4))
  out = attention.multi_head_attention(p, x, causal=True, impl=impl, rope=rope,
                                       return_weights=impl == "reference")
  got = out.out if impl == "reference" else out
  assert rel_err(got, want) < 1e-5
  if impl == "reference":
    assert out.heads.shape == (2, 9, H, V) and rel_err(out.weights, w) < 1e-5


def test_kernels_that_need_equal_widths_are_refused_by_name():
  rng = np.random.default_rng(1)
  p = _params(rng)
  x = jnp.asarray(rng.standard_normal((1, 4, D)), jnp.float32)
  with pytest.raises(ValueError, match="V=10 != K=6"):
    attention.multi_head_attention(p, x, impl="xla")
  with pytest.raises(ValueError, match="wv"):
    attention.multi_head_attention({**p, "wo": p["wo"][:, :K]}, x)


@pytest.mark.slow
def test_gradients_equal_the_oracle_s_central_differences():
  """d sum(out * ct) / d x and / d wv (a few entries) of the float32 function (reference
  and blocked) against central differences of the float64 oracle."""
  rng = np.random.default_rng(2)
  p = _params(rng)
  x = jnp.asarray(rng.standard_normal((1, 5, D)), jnp.float32)
  ct = rng.standard_normal((1, 5, D))

  def oracle(p64, x64):
    return float(np.sum(numpy_mha(p64, x64, causal=True)[0] * ct))
  p64 = {k: np.asarray(v, np.float64) for k, v in p.items()}
  x64 = np.asarray(x, np.float64)
  eps = 1e-6
  picks = [(0, 1, 3), (0, 4, 20), (0, 2, 0)]
  want_x = []
  for ix in picks:
    hi, lo = x64.copy(), x64.copy()
    hi[ix] += eps
    lo[ix] -= eps
    want_x.append((oracle(p64, hi) - oracle(p64, lo)) / (2 * eps))
  wv_picks = [(3, 1, 9), (10, 0, 2)]
  want_wv = []
  for ix in wv_picks:
    hi, lo = dict(p64), dict(p64)
    hi["wv"], lo["wv"] = p64["wv"].copy(), p64["wv"].copy()
    hi["wv"][ix] += eps
    lo["wv"][ix] -= eps
    want_wv.append((oracle(hi, x64) - oracle(lo, x64)) / (2 * eps))
  for impl in ("reference", "blocked"):
    def loss(p, x):
      y = attention.multi_head_attention(p, x, causal=True, impl=impl)
      return jnp.sum(y * jnp.asarray(ct, jnp.float32))
    gp, gx = jax.grad(loss, argnums=(0, 1))(p, x)
    np.testing.assert_allclose([gx[ix] for ix in picks], want_x, rtol=2e-3, atol=1e-4)
    np.testing.assert_allclose([gp["wv"][ix] for ix in wv_picks], want_wv, rtol=2e-3,
                               atol=1e-4)


@pytest.mark.slow  # default run: test_mla_with_the_kv_cache_equals_the_oracle_forward_and_gradients
def test_kv_cache_holds_values_of_their_own_width():
  rng = np.random.default_rng(3)
  p = _params(rng)
  x = jnp.asarray(rng.standard_normal((1, 8, D)), jnp.float32)
  want, _ = numpy_mha(p, x, causal=True)
  cache = attention.init_kv_cache(1, 10, G, K, v_dim=V)
  assert cache["v"].shape == (1, 10, G, V)
  y, cache = attention.multi_head_attention(p, x[:, :5], causal=True, cache=cache)
  outs = [y]
  for i in range(5, 8):
    y, cache = attention.multi_head_attention(p, x[:, i:i + 1], causal=True, cache=cache)
    outs.append(y)
  assert rel_err(jnp.concatenate(outs, 1), want) < 1e-5
  with pytest.raises(ValueError, match=r"cache\['v'\]"):
    attention.multi_head_attention(p, x[:, :1], causal=True,
                                   cache=attention.init_kv_cache(1, 10, G, K))


# ------------------------------------------------------------- multi-head latent attention

C, R, KN, CQ = 7, 4, 6, 9     # latent, rotary and non-rotary widths, low-rank query width


def _mla_weights(rng, low_rank_q=True):
  """DeepSeek's MLA weights in its own form (per head: W_q, W_kb, W_vb; shared W_kv_a,
  W_k_rope), and the house params built from them (wk / wv as block matrices over the
  latent [C normed; R rotary])."""
  n = lambda *s: rng.standard_normal(s) * 0.4  # noqa: E731
  w = {"wkv_a": n(D, C), "kv_a_norm": 1 + 0.2 * n(C), "wk_rope": n(D, R),
       "wk_b": n(C, H, KN), "wv_b": n(C, H, V), "wo": n(H, V, D)}
  if low_rank_q:
    w.update({"wq_a": n(D, CQ), "q_a_norm": 1 + 0.2 * n(CQ), "wq": n(CQ, H, R + KN)})
  else:
    w["wq"] = n(D, H, R + KN)
  wk = np.zeros((C + R, H, R + KN))
  wv = np.zeros((C + R, H, V))
  for h in range(H):
    wk[C:, h, :R] = np.eye(R)
    wk[:C, h, R:] = w["wk_b"][:, h]
    wv[:C, h] = w["wv_b"][:, h]
  house = {k: v for k, v in w.items() if k not in ("wk_b", "wv_b")}
  house.update(wk=wk, wv=wv)
  return w, {k: jnp.asarray(v, jnp.float32) for k, v in house.items()}


def _rope_il(x_TK, base=50.0):
  """Interleaved RoPE of every feature pair at positions 0..T-1 (float64)."""
  t, k = x_TK.shape
  ang = np.arange(t)[:, None] * base ** (-np.arange(0, k, 2) / k)[None]
  a, b = x_TK[:, 0::2], x_TK[:, 1::2]
  out = np.empty_like(x_TK)
  out[:, 0::2], out[:, 1::2] = a * np.cos(ang) - b * np.sin(ang), b * np.cos(ang) + a * np.sin(ang)
  return out


def mla_oracle(w, x):
  """DeepSeek-V2's attention as its paper writes it, float64, causal, per head."""
  def rms(y, g):
    return y / np.sqrt(np.mean(y * y, -1, keepdims=True) + 1e-6) * g
  x = np.asarray(x, np.float64)
  out = np.zeros_like(x)
  for b in range(x.shape[0]):
    xq = rms(x[b] @ w["wq_a"], w["q_a_norm"]) if "wq_a" in w else x[b]
    lat = rms(x[b] @ w["wkv_a"], w["kv_a_norm"])
    k_pe = _rope_il(x[b] @ w["wk_rope"])
    t = x.shape[1]
    for h in range(H):
      q = xq @ w["wq"][:, h]
      q_pe, q_nope = _rope_il(q[:, :R]), q[:, R:]
      s = (q_nope @ (lat @ w["wk_b"][:, h]).T + q_pe @ k_pe.T) / np.sqrt(R + KN)
      s = np.where(np.tril(np.ones((t, t), bool)), s, -np.inf)
      p = np.exp(s - s.max(-1, keepdims=True))
      p /= p.sum(-1, keepdims=True)
      out[b] += (p @ (lat @ w["wv_b"][:, h])) @ w["wo"][h]
  return out


MLA_ROPE = attention.RoPE(base=50.0, dim=R, layout="interleaved")


@pytest.mark.parametrize("low_rank_q", [True, pytest.param(False, marks=pytest.mark.slow)])
def test_mla_equals_deepseek_s_attention_in_float64(low_rank_q):
  rng = np.random.default_rng(4)
  w, p = _mla_weights(rng, low_rank_q)
  x = jnp.asarray(rng.standard_normal((2, 9, D)), jnp.float32)
  want = mla_oracle(w, x)
  for impl in ("reference", "blocked", "auto"):
    got = attention.multi_head_attention(p, x, causal=True, rope=MLA_ROPE, impl=impl)
    assert rel_err(got, want) < 1e-5, impl


def _central_differences(w, x64, ct, picks, eps=1e-6):
  """d sum(oracle(x) * ct) / dx at the picked entries, by central differences (float64)."""
  out = []
  for ix in picks:
    hi, lo = x64.copy(), x64.copy()
    hi[ix] += eps
    lo[ix] -= eps
    out.append((np.sum(mla_oracle(w, hi) * ct) - np.sum(mla_oracle(w, lo) * ct)) / (2 * eps))
  return out


@pytest.mark.slow
def test_mla_gradients_on_every_kernel_that_serves_it():
  rng = np.random.default_rng(5)
  w, p = _mla_weights(rng)
  x = jnp.asarray(rng.standard_normal((1, 6, D)), jnp.float32)
  ct = rng.standard_normal((1, 6, D))
  picks = [(0, 1, 3), (0, 5, 20), (0, 3, 7)]
  want = _central_differences(w, np.asarray(x, np.float64), ct, picks)
  for impl in ("reference", "blocked"):
    gx = jax.grad(lambda x: jnp.sum(attention.multi_head_attention(
        p, x, causal=True, rope=MLA_ROPE, impl=impl) * jnp.asarray(ct, jnp.float32)))(x)
    np.testing.assert_allclose([gx[ix] for ix in picks], want, rtol=2e-3, atol=1e-4)
  with pytest.raises(ValueError, match="MLA"):
    attention.multi_head_attention({**p, "wk_rope": p["wk_rope"][:, :2]}, x)


def _cached_decode(p, x, prefill: int):
  """x's outputs decoded with a KV cache: the first `prefill` tokens in one call, then
  one token per call (the cache holds each head's decompressed key and value)."""
  b, t, _ = x.shape
  cache = attention.init_kv_cache(b, t + 2, H, R + KN, v_dim=V)
  assert cache["k"].shape == (b, t + 2, H, R + KN) and cache["v"].shape == (b, t + 2, H, V)
  y, cache = attention.multi_head_attention(p, x[:, :prefill], causal=True, rope=MLA_ROPE,
                                            cache=cache)
  outs = [y]
  for i in range(prefill, t):
    y, cache = attention.multi_head_attention(p, x[:, i:i + 1], causal=True, rope=MLA_ROPE,
                                              cache=cache)
    outs.append(y)
  assert cache["length"].shape == ()
  return jnp.concatenate(outs, 1)


def test_mla_with_the_kv_cache_equals_the_oracle_forward_and_gradients():
  """MLA (V != K) decoded through the KV cache (a prefill, then one token a step) equals
  DeepSeek's attention written per head in float64, and so do the gradients taken
  through the cached calls (central differences of the oracle)."""
  rng = np.random.default_rng(6)
  w, p = _mla_weights(rng)
  x = jnp.asarray(rng.standard_normal((2, 6, D)), jnp.float32)
  decode = jax.jit(lambda x: _cached_decode(p, x, 3))
  assert rel_err(decode(x), mla_oracle(w, x)) < 1e-5
  ct = rng.standard_normal((2, 6, D))
  picks = [(0, 1, 3), (1, 4, 20), (0, 5, 7), (1, 0, 11)]   # prefill and decoded tokens
  want = _central_differences(w, np.asarray(x, np.float64), ct, picks)
  gx = jax.jit(jax.grad(lambda x: jnp.sum(decode(x) * jnp.asarray(ct, jnp.float32))))(x)
  np.testing.assert_allclose([gx[ix] for ix in picks], want, rtol=2e-3, atol=1e-4)
