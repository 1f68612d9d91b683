"""Tests of mha_jax.attention: values, the seed's worked example, impls, bad input."""

import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from oracles import assert_f32_close, numpy_mha, numpy_rope
from mha_jax import attention



def _setup(d=32, h=4, b=2, t=6, s=None, bias=True, seed=0, g=None):
  """Params in the layout of init_attention_params (LeCun-normal weights, non-zero
  biases so they are really tested), drawn with NumPy: no compile per new shape."""
  rng = np.random.default_rng(seed)
  shapes = attention.param_shapes(d, h, d // h, g)
  fan_in = {"wq": d, "wk": d, "wv": d, "wo": d}
  names = ("wq", "wk", "wv", "wo") + (("bq", "bk", "bv", "bo") if bias else ())
  p = {n: jnp.asarray(rng.standard_normal(shapes[n]) * (fan_in[n] ** -0.5 if n in fan_in
                                                        else 0.1), jnp.float32)
       for n in names}
  x = jnp.asarray(rng.standard_normal((b, t, d)), jnp.float32)
  ctx = None if s is None else jnp.asarray(rng.standard_normal((b, s, d)), jnp.float32)
  return p, x, ctx


def _bern(seed, prob, shape):
  """A random boolean mask (NumPy)."""
  return jnp.asarray(np.random.default_rng(seed).random(shape) < prob)


def _normal(seed, shape):
  return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), jnp.float32)


# ---------------------------------------------------------------- the seed's example

def test_seed_worked_example_building_blocks():
  q = jnp.array([1.0, 0.0, 2.0])[None, None, None, :]              # (B=1, T=1, H=1, K=3)
  k = jnp.array([[2.0, 1, 1], [0, 3, 0], [1, 1, 1]])[None, :, None, :]
  v = jnp.array([[2.0, 5, 1], [0, 1, 3], [4, 0, 2]])[None, :, None, :]
  s = attention.attention_scores(q, k, scale=1.0)
  np.testing.assert_allclose(s[0, 0, 0], [4.0, 0.0, 3.0])
  plain = s / s.sum(-1, keepdims=True)  # the article's simplification of softmax
  np.testing.assert_allclose(plain[0, 0, 0], [4 / 7, 0, 3 / 7], rtol=1e-6)
  mixed = attention.mix_values(plain, v)
  np.testing.assert_allclose(mixed[0, 0, 0], [20 / 7, 20 / 7, 10 / 7], rtol=1e-6)
  np.testing.assert_allclose(mixed[0, 0, 0], [2.857, 2.857, 1.429], atol=1e-3)
  # Real softmax of the scaled scores: divide by sqrt(d_k) = sqrt(3).
  w = attention.attention_weights(attention.attention_scores(q, k))
  e = np.exp(np.array([4.0, 0.0, 3.0]) / math.sqrt(3))
  assert_f32_close(w[0, 0, 0], e / e.sum())         # XLA's exp against NumPy's
  np.testing.assert_allclose(attention.mix_values(w, v)[0, 0, 0], (e / e.sum()) @ np.array(
      [[2.0, 5, 1], [0, 1, 3], [4, 0, 2]]), rtol=1e-6)


# ---------------------------------------------------------------- building blocks

def test_split_heads_is_a_reshape_of_feature_slices():
  x = jnp.arange(2 * 3 * 12, dtype=jnp.float32).reshape(2, 3, 12)
  y = attention.split_heads(x, 4)
  assert y.shape == (2, 3, 4, 3)
  for i in range(4):
    np.testing.assert_array_equal(y[:, :, i], x[:, :, 3 * i:3 * (i + 1)])
  np.testing.assert_array_equal(attention.merge_heads(y), x)


def test_scale_is_the_heads_own_width():
  p, x, _ = _setup(d=64, h=16, bias=False)
  got = attention.multi_head_attention(p, x, impl="reference", return_weights=True).weights
  q = jnp.einsum("btd,dhk->bthk", x, p["wq"])
  k = jnp.einsum("btd,dhk->bthk", x, p["wk"])
  dots = jnp.einsum("bthk,bshk->bhts", q, k)
  np.testing.assert_allclose(got, jax.nn.softmax(dots / math.sqrt(4), -1), atol=1e-6)
  wrong = jax.nn.softmax(dots / math.sqrt(64), -1)  # sqrt(d_model): flatter
  assert float(jnp.abs(got - wrong).max()) > 1e-2
  assert float(got.max(-1).mean()) > float(wrong.max(-1).mean())


def test_weights_are_float32_for_bfloat16_inputs():
  p, x, _ = _setup(bias=False)
  p16 = jax.tree.map(lambda a: a.astype(jnp.bfloat16), p)
  r = attention.multi_head_attention(p16, x.astype(jnp.bfloat16), return_weights=True)
  assert r.weights.dtype == jnp.float32
  assert r.out.dtype == jnp.bfloat16
  np.testing.assert_allclose(r.weights.sum(-1), 1.0, atol=1e-6)


def test_fully_masked_row_gives_zero_weights_output_and_finite_grads():
  p, x, _ = _setup(bias=False)
  mask = jnp.ones((2, 1, 6, 6), bool).at[1, 0, 2].set(False)
  for impl in ("reference", "xla", "blocked"):
    out = attention.multi_head_attention(p, x, mask=mask, impl=impl)
    np.testing.assert_array_equal(out[1, 2], 0.0)
    assert np.all(np.isfinite(out))
  r = attention.multi_head_attention(p, x, mask=mask, return_weights=True)
  np.testing.assert_array_equal(r.weights[1, :, 2], 0.0)
  g = jax.grad(lambda p: jnp.sum(attention.multi_head_attention(p, x, mask=mask) ** 2))(p)
  assert all(np.all(np.isfinite(v)) for v in jax.tree.leaves(g))
  s = jnp.zeros((1, 1, 2, 3))
  w = attention.attention_weights(s, jnp.zeros((1, 1, 2, 3), bool))
  np.testing.assert_array_equal(w, 0.0)


# ---------------------------------------------------------------- against the oracle

CASES = dict(
    plain=dict(),
    causal=dict(causal=True),
    mask=dict(mask="random"),
    mask_causal=dict(mask="random", causal=True),
    gates=dict(gates="h"),
    batch_gates_mask=dict(gates="bh", mask="random"),
    cross=dict(s=9, mask="random"),
    cross_causal=dict(s=9, causal=True),
    bias=dict(bias="bhts"),
    bias_mask_causal=dict(bias="hts", mask="random", causal=True),
    cross_bias_2d=dict(s=9, bias="ts"),
)


@pytest.mark.parametrize("impl", ["reference", "xla", "blocked", "auto"])
@pytest.mark.parametrize("case", list(CASES))
def test_matches_numpy_oracle(impl, case):
  c = CASES[case]
  p, x, ctx = _setup(s=c.get("s"))
  b, t, s = 2, 6, c.get("s") or 6
  mask = gates = None
  if c.get("mask"):
    mask = jax.random.bernoulli(jax.random.PRNGKey(7), 0.6, (b, 1, t, s))
  if c.get("gates") == "h":
    gates = jnp.array([1.0, 0.0, 0.5, 2.0])
  elif c.get("gates") == "bh":
    gates = jax.random.uniform(jax.random.PRNGKey(8), (b, 4))
  bias = None
  if c.get("bias"):
    shape = {"bhts": (b, 4, t, s), "hts": (1, 4, t, s), "ts": (t, s)}[c["bias"]]
    bias = 2.0 * jax.random.normal(jax.random.PRNGKey(9), shape)
  got = attention.multi_head_attention(p, x, ctx, mask=mask, causal=c.get("causal", False),
                               head_gates=gates, bias=bias, impl=impl)
  want, _ = numpy_mha(p, x, ctx, mask, c.get("causal", False), gates, bias)
  np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)


def test_all_impls_agree_and_weights_match_oracle(monkeypatch):
  from mha_jax.kernels import dispatch
  p, x, _ = _setup(d=48, h=6, t=10)
  mask = jax.random.bernoulli(jax.random.PRNGKey(3), 0.7, (2, 6, 10, 10))
  gates = jnp.linspace(0, 1, 6)
  # At this size auto would take the reference path (comparing it with itself): lower
  # the threshold so that auto takes the blocked path, as it does at real sizes.
  monkeypatch.setattr(dispatch, "BLOCKED_FROM_SCORES", 0)
  assert dispatch.resolve_impl("auto", jnp.zeros((2, 10, 6, 8)), False) == "blocked"
  outs = {i: attention.multi_head_attention(p, x, mask=mask, head_gates=gates, causal=True, impl=i)
          for i in ("reference", "xla", "blocked", "auto")}
  want, _ = numpy_mha(p, x, None, mask, True, gates)
  for impl, out in outs.items():
    np.testing.assert_allclose(out, want, atol=1e-5, err_msg=impl)
  r = attention.multi_head_attention(p, x, mask=mask, head_gates=gates, causal=True,
                             return_weights=True)
  _, w = numpy_mha(p, x, None, mask, True, gates)
  np.testing.assert_allclose(r.weights, w, atol=1e-6)
  np.testing.assert_allclose(r.out, outs["reference"], atol=1e-6)


def test_gate_zero_equals_physically_removing_the_head():
  p, x, _ = _setup(d=32, h=4)
  gated = attention.multi_head_attention(p, x, head_gates=jnp.array([1.0, 0.0, 1.0, 0.0]))
  keep = np.array([0, 2])
  pruned = {k: (v[:, keep] if k in ("wq", "wk", "wv") else v[keep] if k in
                ("wo", "bq", "bk", "bv") else v) for k, v in p.items()}
  assert pruned["wq"].shape == (32, 2, 8)
  np.testing.assert_allclose(attention.multi_head_attention(pruned, x), gated, atol=1e-6)


def test_zero_heads_leaves_only_the_output_bias():
  p, x, _ = _setup(d=32, h=4)
  empty = {k: (v[:, :0] if k in ("wq", "wk", "wv") else v[:0] if k in
               ("wo", "bq", "bk", "bv") else v) for k, v in p.items()}
  out = attention.multi_head_attention(empty, x)
  np.testing.assert_allclose(out, jnp.broadcast_to(p["bo"], out.shape))
  r = attention.multi_head_attention(empty, x, return_weights=True)
  assert r.weights.shape == (2, 0, 6, 6) and r.heads.shape == (2, 6, 0, 8)


def test_head_outputs_are_independent_mixtures():
  """Changing one head's W_Q leaves every other head's weights and output unchanged."""
  p, x, _ = _setup(d=32, h=4, bias=False)
  r1 = attention.multi_head_attention(p, x, return_weights=True)
  p2 = dict(p, wq=p["wq"].at[:, 1].multiply(-3.0))
  r2 = attention.multi_head_attention(p2, x, return_weights=True)
  others = np.array([0, 2, 3])
  np.testing.assert_allclose(r1.weights[:, others], r2.weights[:, others], atol=1e-7)
  np.testing.assert_allclose(r1.heads[:, :, others], r2.heads[:, :, others], atol=1e-7)
  assert float(jnp.abs(r1.weights[:, 1] - r2.weights[:, 1]).max()) > 1e-2


def test_one_head_two_jobs_compromises():
  """The seed's claim: a head mixing two targets has its peak weight lowest at 50/50."""
  t, d = 8, 16
  prev = np.roll(np.eye(t), 1, axis=1)          # attend to token i-1
  partner = np.roll(np.eye(t), 3, axis=1)       # attend to token i-3
  x = jnp.asarray(np.eye(t, d)[None])           # one-hot tokens
  peaks = []
  for alpha in np.linspace(0, 1, 11):
    # One head: query-key matrix W_QK = 8 * (alpha*prev + (1-alpha)*partner).
    wqk = 8.0 * (alpha * prev + (1 - alpha) * partner)
    wq = np.zeros((d, 1, t)); wq[:t, 0] = wqk
    wk = np.zeros((d, 1, t)); wk[:t, 0] = np.eye(t) * math.sqrt(t)
    p = {"wq": jnp.asarray(wq), "wk": jnp.asarray(wk),
         "wv": jnp.asarray(wk), "wo": jnp.zeros((1, t, d))}
    w = attention.multi_head_attention(p, x, return_weights=True).weights
    peaks.append(float(w.max(-1).mean()))
  assert int(np.argmin(peaks)) == 5          # alpha = 0.5
  assert peaks[5] < 0.55 and peaks[0] > 0.9 and peaks[-1] > 0.9


# ---------------------------------------------------------------- grouped-query attention

GQA_CASES = dict(   # g: key/value heads of the 4 query heads
    mqa_causal=dict(g=1, causal=True),
    mask_gates_bias=dict(g=2, mask="bh", gates="bh", bias="hts", causal=True),
    mqa_cross_mask=dict(g=1, s=9, mask="b", gates="h"),
    rel_bias=dict(g=2, rel=True, mask="b"),
)


def _gqa_call(case, impl, h=4, seed=0):
  c = GQA_CASES[case]
  g = c["g"]
  p, x, ctx = _setup(d=32, h=h, s=c.get("s"), g=g, seed=seed)
  b, t, s = 2, 6, c.get("s") or 6
  mask = gates = bias = None
  if c.get("mask"):
    shape = (b, h, t, s) if c["mask"] == "bh" else (b, 1, t, s)
    mask = _bern(7, 0.6, shape).at[..., 0].set(True)
  if c.get("gates") == "h":
    gates = jnp.linspace(0.0, 2.0, h)
  elif c.get("gates") == "bh":
    gates = jnp.asarray(np.random.default_rng(8).random((b, h)), jnp.float32)
  if c.get("bias"):
    bias = 2.0 * _normal(9, (1, h, t, s))
  if c.get("rel"):
    p = dict(p, rel_bias=_normal(10, (h, 5)))
  kw = dict(mask=mask, causal=c.get("causal", False), head_gates=gates, bias=bias)
  return p, x, ctx, kw


@pytest.mark.parametrize("impl", ["reference", "xla"])
@pytest.mark.parametrize("case", list(GQA_CASES))
def test_gqa_matches_numpy_oracle(case, impl):
  p, x, ctx, kw = _gqa_call(case, impl)
  g = GQA_CASES[case]["g"]
  assert p["wk"].shape == (32, g, 8) and attention.num_kv_heads_of(p) == g
  got = attention.multi_head_attention(p, x, ctx, impl=impl, **kw)
  bias = kw["bias"]
  if "rel_bias" in p:
    off = np.clip(np.arange(6)[None] - np.arange(6)[:, None], -2, 2) + 2
    bias = np.asarray(p["rel_bias"])[:, off][None]
  oracle_p = {k: v for k, v in p.items() if k != "rel_bias"}
  want, w = numpy_mha(oracle_p, x, ctx, kw["mask"], kw["causal"], kw["head_gates"], bias)
  np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
  if impl == "reference":  # auto is the reference path here, and the only one with weights
    r = attention.multi_head_attention(p, x, ctx, return_weights=True, impl="auto", **kw)
    assert r.weights.shape == w.shape and r.heads.shape == (2, 6, 4, 8)
    np.testing.assert_allclose(r.weights, w, atol=1e-6)
    np.testing.assert_allclose(r.out, want, atol=1e-5, rtol=1e-5)


def test_gqa_building_blocks_equal_repeated_kv_heads():
  """G key/value heads act as H heads that repeat each kv head H/G times in a row (the
  Hugging Face repeat_kv order); the blocks take the G heads without that copy."""
  p, x, _ = _setup(d=48, h=6, g=2, t=7)
  q = jnp.einsum("btd,dhk->bthk", x, p["wq"])
  k = jnp.einsum("btd,dhk->bthk", x, p["wk"])
  np.testing.assert_allclose(attention.attention_scores(q, k),
                             attention.attention_scores(q, jnp.repeat(k, 3, axis=2)), atol=1e-5)
  w = jax.nn.softmax(attention.attention_scores(q, k), -1)
  np.testing.assert_allclose(attention.mix_values(w, k), attention.mix_values(w, jnp.repeat(k, 3, axis=2)),
                             atol=1e-5)


def test_gqa_rope_gradients_agree_across_impls_and_with_finite_differences():
  g, rope = 2, attention.RoPE(base=100.0, layout="interleaved")
  p, x, _ = _setup(d=16, h=4, t=5, g=g)
  mask = _bern(2, 0.7, (2, 4, 5, 5)).at[..., 0].set(True)
  gates = jnp.array([1.0, 0.5, 0.0, 2.0])

  def loss(p, x, impl):
    y = attention.multi_head_attention(p, x, mask=mask, causal=True, head_gates=gates, impl=impl,
                               rope=rope)
    return jnp.sum(jnp.sin(y))

  grad = jax.jit(jax.grad(loss, argnums=(0, 1)), static_argnums=2)
  gr, gx = grad(p, x, "reference"), grad(p, x, "xla")
  chex.assert_trees_all_close(gr, gx, atol=1e-5)
  assert gr[0]["wk"].shape == (16, g, 4)
  assert float(jnp.abs(gr[0]["wk"]).max()) > 1e-3
  # Central finite differences along random directions (what check_grads does, without
  # compiling another backward pass).
  f = jax.jit(lambda p, x: loss(p, x, "reference"))
  rng = np.random.default_rng(0)
  for _ in range(2):
    u = jax.tree.map(lambda a: rng.standard_normal(a.shape).astype(np.float32), (p, x))
    eps = 1e-2
    plus = jax.tree.map(lambda a, d: a + eps * d, (p, x), u)
    minus = jax.tree.map(lambda a, d: a - eps * d, (p, x), u)
    numeric = (f(*plus) - f(*minus)) / (2 * eps)
    analytic = sum(jnp.vdot(a, b) for a, b in zip(jax.tree.leaves(gr), jax.tree.leaves(u)))
    np.testing.assert_allclose(numeric, analytic, rtol=2e-2, atol=1e-2)


def test_gqa_zero_query_heads_still_runs():
  p, x, _ = _setup(d=32, h=4, g=2)
  empty = {k: (v[:, :0] if k == "wq" else v[:0] if k in ("wo", "bq") else v)
           for k, v in p.items()}
  out = attention.multi_head_attention(empty, x)
  np.testing.assert_allclose(out, jnp.broadcast_to(p["bo"], out.shape))


def test_gqa_init_shapes_and_named_errors():
  p = jax.eval_shape(lambda: attention.init_attention_params(jax.random.PRNGKey(0), 64, 8,
                                                     num_kv_heads=2, use_bias=True))
  assert {k: v.shape for k, v in p.items()} == {
      "wq": (64, 8, 8), "wk": (64, 2, 8), "wv": (64, 2, 8), "wo": (8, 8, 64),
      "bq": (8, 8), "bk": (2, 8), "bv": (2, 8), "bo": (64,)}
  assert attention.check_attention_params(p) == (64, 8, 8)
  assert attention.num_kv_heads_of(p) == 2 and attention.num_heads_of(p) == 8
  assert attention.param_shapes(64, 8, 8, 2)["wk"] == (64, 2, 8)
  with pytest.raises(ValueError, match=r"G=3 must divide the number of query heads H=8"):
    attention.init_attention_params(jax.random.PRNGKey(0), 64, 8, num_kv_heads=3)
  with pytest.raises(ValueError, match=r"num_kv_heads must be a positive integer; got 0"):
    attention.init_attention_params(jax.random.PRNGKey(0), 64, 8, num_kv_heads=0)
  bad = dict(p, wk=jnp.zeros((64, 3, 8)), wv=jnp.zeros((64, 3, 8)))
  with pytest.raises(ValueError, match=r"params\['wk'\] \(64, 3, 8\) has G=3 key/value "
                     r"heads, which must divide the H=8 query heads"):
    attention.multi_head_attention(bad, jnp.zeros((1, 2, 64)))
  with pytest.raises(ValueError, match=r"params\['wv'\] must have shape \(64, 2, 8\)"):
    attention.multi_head_attention(dict(p, wv=jnp.zeros((64, 8, 8))), jnp.zeros((1, 2, 64)))
  with pytest.raises(ValueError, match=r"G=3 must divide the number of query heads H=4"):
    attention.attention_scores(jnp.zeros((1, 2, 4, 8)), jnp.zeros((1, 2, 3, 8)))
  with pytest.raises(ValueError, match=r"G=3 must divide the number of query heads H=4"):
    attention.mix_values(jnp.zeros((1, 4, 2, 2)), jnp.zeros((1, 2, 3, 8)))


def test_non_float_inputs_are_refused():
  p, x, ctx = _setup(s=5, bias=False)
  with pytest.raises(ValueError, match=r"x must be a float array.*got dtype int32"):
    attention.multi_head_attention(p, jnp.ones((2, 6, 32), jnp.int32))
  with pytest.raises(ValueError, match=r"context must be a float array.*got dtype int32"):
    attention.multi_head_attention(p, x, jnp.ones((2, 5, 32), jnp.int32))
  with pytest.raises(ValueError, match=r"value_input must be a float array.*got dtype bool"):
    attention.multi_head_attention(p, x, ctx, value_input=jnp.ones((2, 5, 32), bool))


# ---------------------------------------------------------------- rotary positions

@pytest.mark.parametrize("rope", [attention.RoPE(), attention.RoPE(base=100.0, layout="interleaved"),
                                  attention.RoPE(base=500.0, layout="half", dim=4),
                                  attention.RoPE(layout="interleaved", dim=6)])
def test_apply_rope_matches_numpy_rotation(rope):
  x = _normal(0, (2, 5, 3, 8))
  pos = jnp.array([[0, 1, 2, 3, 4], [7, 3, 100, 2047, 0]])
  got = attention.apply_rope(x, pos, rope)
  assert got.shape == x.shape and got.dtype == x.dtype
  for b in range(2):
    for h in range(3):
      want = numpy_rope(x[b, :, h], pos[b], rope.base, rope.layout, rope.dim)
      np.testing.assert_allclose(got[b, :, h], want, atol=2e-5, rtol=1e-5)
  if rope.dim:   # features from dim on pass through untouched
    np.testing.assert_array_equal(got[..., rope.dim:], x[..., rope.dim:])
  # (T,) positions broadcast over the batch; position 0 is the identity.
  np.testing.assert_allclose(attention.apply_rope(x, pos[0], rope)[1],
                             attention.apply_rope(x[1:], pos[:1], rope)[0], atol=1e-6)
  np.testing.assert_allclose(attention.apply_rope(x, jnp.zeros(5, jnp.int32), rope), x, atol=1e-6)
  # bfloat16 in, bfloat16 out (angles in float32)
  assert attention.apply_rope(x.astype(jnp.bfloat16), pos, rope).dtype == jnp.bfloat16


RoPE_CASES = dict(
    self_gqa_causal=dict(g=2, causal=True, rope=attention.RoPE(base=100.0)),
    self_positions_mask=dict(g=4, mask=True, positions="bt",
                             rope=attention.RoPE(base=1000.0, layout="interleaved")),
    self_partial_mqa=dict(g=1, causal=True, positions="t", rope=attention.RoPE(layout="half", dim=4)),
    cross_kv_positions=dict(g=2, s=9, positions="bt", kv_positions=True,
                            rope=attention.RoPE(base=50.0, layout="interleaved")),
    cross_default=dict(g=4, s=7, rope=attention.RoPE(base=30.0)),
)


@pytest.mark.parametrize("impl", ["reference", "xla"])
@pytest.mark.parametrize("case", list(RoPE_CASES))
def test_rope_attention_matches_numpy_oracle(case, impl):
  c = RoPE_CASES[case]
  p, x, ctx = _setup(d=32, h=4, s=c.get("s"), g=c["g"])
  b, t, s = 2, 6, c.get("s") or 6
  mask = positions = kv_positions = None
  if c.get("mask"):
    mask = _bern(7, 0.6, (b, 1, t, s)).at[..., 0].set(True)
  if c.get("positions") == "bt":
    positions = jnp.array([[3, 4, 5, 6, 7, 8], [20, 19, 40, 2, 2, 0]])
  elif c.get("positions") == "t":
    positions = jnp.arange(6) + 11
  if c.get("kv_positions"):
    kv_positions = jnp.arange(s)[::-1] * 3
  rope = c["rope"]
  got = attention.multi_head_attention(p, x, ctx, mask=mask, causal=c.get("causal", False),
                               rope=rope, positions=positions, kv_positions=kv_positions,
                               impl=impl)
  want, _ = numpy_mha(p, x, ctx, mask, c.get("causal", False), rope=(
      rope.base, rope.layout, rope.dim), positions=positions, kv_positions=kv_positions)
  np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
  plain, _ = numpy_mha(p, x, ctx, mask, c.get("causal", False))
  assert np.abs(plain - want).max() > 1e-3      # the rotation really changed something


@pytest.mark.parametrize("layout", ["half", "interleaved"])
def test_rope_scores_depend_only_on_position_differences(layout):
  p, x, _ = _setup(d=32, h=4, t=6, g=2, bias=False)
  rope = attention.RoPE(base=100.0, layout=layout)
  pos = jnp.array([[0, 1, 2, 3, 4, 5], [4, 0, 9, 2, 2, 30]])
  w = lambda pos: attention.multi_head_attention(p, x, rope=rope, positions=pos,
                                         return_weights=True).weights
  np.testing.assert_allclose(w(pos + 7), w(pos), atol=1e-5)
  np.testing.assert_allclose(w(pos + 1000), w(pos), atol=1e-4)
  # Not invariant to a change of differences: swapping two positions moves the weights.
  assert float(jnp.abs(w(pos.at[:, 0].set(5).at[:, 5].set(0)) - w(pos)).max()) > 1e-3


def test_rope_half_and_interleaved_differ_by_a_feature_permutation():
  """half(x) = interleaved(x[perm])[inverse perm], perm = 0, K/2, 1, K/2+1, ...; so a
  checkpoint in one layout runs in the other once W_Q and W_K columns are permuted."""
  k = 8
  perm = np.stack([np.arange(k // 2), np.arange(k // 2) + k // 2], -1).reshape(-1)
  x = _normal(0, (2, 5, 3, k))
  pos = jnp.arange(5) * 3
  half = attention.apply_rope(x, pos, attention.RoPE(layout="half"))
  inter = attention.apply_rope(x[..., perm], pos, attention.RoPE(layout="interleaved"))
  np.testing.assert_allclose(half, inter[..., np.argsort(perm)], atol=1e-6)
  assert float(jnp.abs(half - attention.apply_rope(x, pos, attention.RoPE(layout="interleaved"))).max()) > 1e-2
  p, xx, _ = _setup(d=32, h=4, g=2)
  pp = {n: (v[..., perm] if n in ("wq", "wk", "bq", "bk") else v) for n, v in p.items()}
  np.testing.assert_allclose(
      attention.multi_head_attention(p, xx, causal=True, rope=attention.RoPE(layout="half")),
      attention.multi_head_attention(pp, xx, causal=True, rope=attention.RoPE(layout="interleaved")),
      atol=1e-5)


def test_rope_bad_input_is_named():
  p, x, ctx = _setup(s=5, bias=False)
  with pytest.raises(ValueError, match=r"RoPE layout must be one of \('half', 'interleaved'\); got 'neox'"):
    attention.RoPE(layout="neox")
  with pytest.raises(ValueError, match=r"RoPE dim .* must be an even integer >= 2 or None; got 5"):
    attention.RoPE(dim=5)
  with pytest.raises(ValueError, match=r"RoPE base must be a positive number; got 0"):
    attention.RoPE(base=0)
  with pytest.raises(ValueError, match=r"RoPE dim=16 exceeds the head width K=8"):
    attention.multi_head_attention(p, x, rope=attention.RoPE(dim=16))
  with pytest.raises(ValueError, match=r"positions must be integer positions; got dtype float32"):
    attention.multi_head_attention(p, x, rope=attention.RoPE(), positions=jnp.arange(6.0))
  with pytest.raises(ValueError, match=r"positions must have shape \(T,\) = \(6,\) or \(B, T\) = \(2, 6\); got \(5,\)"):
    attention.multi_head_attention(p, x, rope=attention.RoPE(), positions=jnp.arange(5))
  with pytest.raises(ValueError, match=r"kv_positions must have shape \(S,\) = \(5,\)"):
    attention.multi_head_attention(p, x, ctx, rope=attention.RoPE(), kv_positions=jnp.arange(6))
  with pytest.raises(ValueError, match=r"pass rope=attention.RoPE"):
    attention.multi_head_attention(p, x, positions=jnp.arange(6))
  with pytest.raises(ValueError, match=r"kv_positions are for cross-attention"):
    attention.multi_head_attention(p, x, rope=attention.RoPE(), kv_positions=jnp.arange(6))
  with pytest.raises(ValueError, match=r"rope must be an attention.RoPE or None; got 10000"):
    attention.multi_head_attention(p, x, rope=10000)
  odd, _, _ = _setup(d=12, h=4, bias=False)     # K = 3
  with pytest.raises(ValueError, match=r"head width K=3 is odd"):
    attention.multi_head_attention(odd, jnp.zeros((1, 2, 12)), rope=attention.RoPE())
  assert hash(attention.RoPE()) == hash(attention.RoPE(10000.0, "half", None))   # a static jit argument


def test_gqa_and_rope_match_torch_and_hugging_face_llama():
  """An outside reference for the two conventions: Hugging Face LLaMA's rotary embedding
  (rotate_half) and repeat_kv, with torch's scaled_dot_product_attention."""
  torch = pytest.importorskip("torch")
  hf = pytest.importorskip("transformers.models.llama.modeling_llama")
  from transformers import LlamaConfig
  p, x, _ = _setup(d=32, h=4, g=2, t=7, bias=False)
  pos = np.array([[0, 1, 2, 3, 4, 5, 6], [5, 6, 7, 8, 9, 10, 11]])
  cfg = LlamaConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                    rope_theta=500.0)
  t = lambda a: torch.tensor(np.asarray(a, np.float64))
  xt = t(x)
  q = torch.einsum("btd,dhk->bhtk", xt, t(p["wq"]))
  k = torch.einsum("btd,dhk->bhtk", xt, t(p["wk"]))
  v = torch.einsum("btd,dhk->bhtk", xt, t(p["wv"]))
  cos, sin = hf.LlamaRotaryEmbedding(cfg)(xt, torch.tensor(pos))
  q, k = hf.apply_rotary_pos_emb(q, k, cos, sin)
  o = torch.nn.functional.scaled_dot_product_attention(
      q, hf.repeat_kv(k, 2), hf.repeat_kv(v, 2), is_causal=True)
  want = torch.einsum("bhtk,hkd->btd", o, t(p["wo"])).numpy()
  got = attention.multi_head_attention(p, x, causal=True, rope=attention.RoPE(base=500.0),
                               positions=jnp.asarray(pos))
  np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
  np.testing.assert_allclose(
      attention.apply_rope(jnp.einsum("btd,dhk->bthk", x, p["wk"]), jnp.asarray(pos), attention.RoPE(500.0)),
      k.permute(0, 2, 1, 3).numpy(), atol=1e-5)


# ---------------------------------------------------------------- KV cache

def _decoder_params(g=2, rel=True):
  p, x, _ = _setup(d=32, h=4, t=8, g=g, seed=3)
  if rel:
    p = dict(p, rel_bias=_normal(11, (4, 7)))
  return p, x


@pytest.mark.parametrize("impl", ["reference", pytest.param("xla", marks=pytest.mark.slow),
                                  pytest.param("blocked", marks=pytest.mark.slow)])
def test_kv_cache_decoding_token_by_token_equals_one_causal_pass(impl):
  p, x = _decoder_params()
  rope = attention.RoPE(base=100.0)
  full = attention.multi_head_attention(p, x, causal=True, rope=rope, impl=impl)
  chex.clear_trace_counter()   # the same step function under each parameter

  @jax.jit
  @chex.assert_max_traces(n=1)
  def step(p, x_B1D, cache):
    return attention.multi_head_attention(p, x_B1D, causal=True, rope=rope, impl=impl, cache=cache)

  cache = attention.init_kv_cache(2, 11, 2, 8)
  outs = []
  for i in range(8):
    y, cache = step(p, x[:, i:i + 1], cache)
    outs.append(y)
  np.testing.assert_allclose(jnp.concatenate(outs, 1), full, atol=1e-5, rtol=1e-5)
  assert int(cache["length"]) == 8
  # The cache holds the rotated keys at slots 0..7 and zeros beyond.
  k_full = attention.apply_rope(jnp.einsum("btd,dgk->btgk", x, p["wk"]) + p["bk"], jnp.arange(8), rope)
  np.testing.assert_allclose(cache["k"][:, :8], k_full, atol=1e-5)
  np.testing.assert_array_equal(cache["k"][:, 8:], 0.0)


@pytest.mark.slow  # default run: test_kv_cache_decoding_token_by_token_equals_one_causal_pass
def test_kv_cache_in_chunks_with_padding_mask_and_weights():
  """Prompt of 5 (the first example left-padded by 2), then 1 token at a time."""
  p, x = _decoder_params(g=1)
  rope = attention.RoPE(layout="interleaved")
  s_max = 12
  keep_BS = jnp.ones((2, s_max), bool).at[0, :2].set(False)      # padding slots
  pos_BT = jnp.stack([jnp.maximum(jnp.arange(8) - 2, 0), jnp.arange(8)])
  full = attention.multi_head_attention(p, x, causal=True, rope=rope, positions=pos_BT,
                                mask=keep_BS[:, None, None, :8], return_weights=True)

  @jax.jit
  @chex.assert_max_traces(n=2)   # one trace for the prompt's shape, one for single tokens
  def step(p, x, pos, cache):
    return attention.multi_head_attention(p, x, causal=True, rope=rope, positions=pos, cache=cache,
                                  mask=keep_BS[:, None, None, :], return_weights=True)

  cache = attention.init_kv_cache(2, s_max, 1, 8)
  r, cache = step(p, x[:, :5], pos_BT[:, :5], cache)
  outs, weights = [r.out], [r.weights]
  for i in range(5, 8):
    r, cache = step(p, x[:, i:i + 1], pos_BT[:, i:i + 1], cache)
    outs.append(r.out)
    weights.append(r.weights)
  assert r.weights.shape == (2, 4, 1, s_max)
  np.testing.assert_allclose(jnp.concatenate(outs, 1), full.out, atol=1e-5, rtol=1e-5)
  w = jnp.concatenate(weights, 2)
  np.testing.assert_allclose(w[..., :8], full.weights, atol=1e-6)
  np.testing.assert_array_equal(w[..., 8:], 0.0)      # empty slots get no weight
  np.testing.assert_array_equal(w[0, :, :, :2], 0.0)  # nor do the padding slots


@pytest.mark.slow  # default run: test_kv_cache_decoding_token_by_token_equals_one_causal_pass
def test_kv_cache_without_causal_sees_every_filled_slot_and_keeps_rel_bias():
  p, x = _decoder_params()
  cache = attention.init_kv_cache(2, 9, 2, 8)
  _, cache = attention.multi_head_attention(p, x[:, :5], cache=cache)
  r, cache = attention.multi_head_attention(p, x[:, 5:], cache=cache, return_weights=True)
  full = attention.multi_head_attention(p, x, return_weights=True)
  np.testing.assert_allclose(r.out, full.out[:, 5:], atol=1e-5)
  np.testing.assert_allclose(r.weights[..., :8], full.weights[:, :, 5:], atol=1e-6)
  np.testing.assert_array_equal(r.weights[..., 8:], 0.0)


def test_kv_cache_bad_input_and_overflow():
  p, x = _decoder_params()
  cache = attention.init_kv_cache(2, 6, 2, 8)
  assert {k: v.shape for k, v in cache.items()} == {"k": (2, 6, 2, 8), "v": (2, 6, 2, 8),
                                                    "length": ()}
  assert cache["length"].dtype == jnp.int32
  with pytest.raises(ValueError, match=r"cache is for self-attention"):
    attention.multi_head_attention(p, x[:, :2], x[:, :2], cache=cache)
  with pytest.raises(ValueError, match=r"x has T=8 tokens, more than the cache holds \(S_max=6\)"):
    attention.multi_head_attention(p, x, cache=cache)
  with pytest.raises(ValueError, match=r"cache\['length'\]=5 plus T=2 new tokens exceeds"):
    attention.multi_head_attention(p, x[:, :2], cache=dict(cache, length=jnp.int32(5)))
  with pytest.raises(ValueError, match=r"cache\['k'\] must have shape \(B, S_max, G, K\) = "
                     r"\(2, S_max, 2, 8\) for x and params; got \(2, 6, 4, 8\)"):
    attention.multi_head_attention(p, x[:, :2], cache=attention.init_kv_cache(2, 6, 4, 8))
  with pytest.raises(ValueError, match=r"cache must be a dict with keys"):
    attention.multi_head_attention(p, x[:, :2], cache={"k": cache["k"]})
  with pytest.raises(ValueError, match=r"mask of shape \(1, 1, 1, 8\).*S dimension is 8"):
    attention.multi_head_attention(p, x[:, :2], cache=cache, mask=jnp.ones((1, 1, 1, 8), bool))
  with pytest.raises(ValueError, match=r"max_len must be a positive integer; got 0"):
    attention.init_kv_cache(1, 0, 1, 8)
  # Under jit the length is traced: a write past S_max gives NaN, not a silent clamp.
  step = jax.jit(lambda c: attention.multi_head_attention(p, x[:, :2], cache=c))
  y, _ = step(dict(cache, length=jnp.int32(5)))
  assert np.all(np.isnan(y))
  y, c2 = step(dict(cache, length=jnp.int32(4)))
  assert np.all(np.isfinite(y)) and int(c2["length"]) == 6


def test_kv_cache_with_zero_query_heads_still_fills_the_cache():
  p, x = _decoder_params(rel=False)
  empty = {k: (v[:, :0] if k == "wq" else v[:0] if k in ("wo", "bq") else v)
           for k, v in p.items()}
  y, cache = attention.multi_head_attention(empty, x[:, :3], cache=attention.init_kv_cache(2, 4, 2, 8))
  np.testing.assert_allclose(y, jnp.broadcast_to(p["bo"], y.shape))
  assert int(cache["length"]) == 3 and float(jnp.abs(cache["v"][:, :3]).max()) > 0


# ---------------------------------------------------------------- jit and retracing

class VariantsTest(chex.TestCase):

  @chex.variants(with_jit=True, without_jit=True)
  def test_variants_match_oracle(self):
    p, x, _ = _setup()
    mask = jax.random.bernoulli(jax.random.PRNGKey(1), 0.7, (2, 1, 6, 6))
    f = self.variant(lambda p, x, m: attention.multi_head_attention(p, x, mask=m, impl="reference"))
    want, _ = numpy_mha(p, x, None, mask)
    np.testing.assert_allclose(f(p, x, mask), want, atol=1e-5)

  def test_no_retrace_for_same_shapes(self):
    p, x, _ = _setup()

    @jax.jit
    @chex.assert_max_traces(n=1)
    def f(p, x):
      return attention.multi_head_attention(p, x, causal=True)

    for i in range(4):
      f(p, x + i)
    f(jax.tree.map(lambda a: a * 2, p), x)
    with self.assertRaises(AssertionError):  # a new shape does retrace, and is caught
      f(p, x[:, :3])


# ---------------------------------------------------------------- bad input

def test_init_rejects_bad_head_counts():
  with pytest.raises(ValueError, match=r"num_heads=5 does not divide d_model=32"):
    attention.init_attention_params(jax.random.PRNGKey(0), 32, 5)
  with pytest.raises(ValueError, match=r"num_heads must be a positive integer; got 0"):
    attention.init_attention_params(jax.random.PRNGKey(0), 32, 0)
  with pytest.raises(ValueError, match=r"num_heads must be a positive integer; got -2"):
    attention.init_attention_params(jax.random.PRNGKey(0), 32, -2)
  p = attention.init_attention_params(jax.random.PRNGKey(0), 32, 5, head_dim=8)
  assert p["wq"].shape == (32, 5, 8)


def test_bad_inputs_name_the_argument():
  p, x, _ = _setup(bias=False)
  q = jnp.zeros((1, 3, 2, 4))
  with pytest.raises(ValueError, match=r"same head width K; got q K=4.*k K=5"):
    attention.attention_scores(q, jnp.zeros((1, 3, 2, 5)))
  with pytest.raises(ValueError, match=r"mask must be boolean.*float32"):
    attention.multi_head_attention(p, x, mask=jnp.ones((2, 1, 6, 6)))
  with pytest.raises(ValueError, match=r"mask of shape \(2, 1, 5, 6\).*T dimension is 5"):
    attention.multi_head_attention(p, x, mask=jnp.ones((2, 1, 5, 6), bool))
  with pytest.raises(ValueError, match=r"mask must have rank 4.*\(2, 6, 6\)"):
    attention.multi_head_attention(p, x, mask=jnp.ones((2, 6, 6), bool))
  with pytest.raises(ValueError, match=r"x must be a rank-3 array.*\(6, 32\)"):
    attention.multi_head_attention(p, x[0])
  with pytest.raises(ValueError, match=r"x has d_model=16"):
    attention.multi_head_attention(p, x[..., :16])
  with pytest.raises(ValueError, match=r"head_gates must have shape \(H,\) = \(4,\).*\(3,\)"):
    attention.multi_head_attention(p, x, head_gates=jnp.ones(3))
  with pytest.raises(ValueError, match=r"head_gates.*\(2, 3\)"):
    attention.multi_head_attention(p, x, head_gates=jnp.ones((2, 3)))
  with pytest.raises(ValueError, match=r"impl must be one of .*got 'flash'"):
    attention.multi_head_attention(p, x, impl="flash")
  with pytest.raises(ValueError, match=r"impl='xla' does not expose attention weights"):
    attention.multi_head_attention(p, x, impl="xla", return_weights=True)
  with pytest.raises(ValueError, match=r"params\['wo'\] must have shape \(4, 8, 32\)"):
    attention.multi_head_attention(dict(p, wo=jnp.zeros((4, 4, 32))), x)
  with pytest.raises(ValueError, match=r"params is missing \['wv'\]"):
    attention.multi_head_attention({k: v for k, v in p.items() if k != "wv"}, x)
  with pytest.raises(ValueError, match=r"num_heads=5 does not divide the last dimension 32"):
    attention.split_heads(x, 5)
  with pytest.raises(ValueError, match=r"params\['rel_bias'\] must have shape \(H, 2R \+ 1\) = \(4, odd\); got \(4, 6\)"):
    attention.multi_head_attention(dict(p, rel_bias=jnp.zeros((4, 6))), x)
  with pytest.raises(ValueError, match=r"max_rel must be an integer >= 0; got -1"):
    attention.init_attention_params(jax.random.PRNGKey(0), 32, 4, max_rel=-1)
  with pytest.raises(ValueError, match=r"bias must be a float array.*bool"):
    attention.multi_head_attention(p, x, bias=jnp.ones((6, 6), bool))
  with pytest.raises(ValueError, match=r"bias of shape \(1, 3, 6, 6\).*H dimension is 3"):
    attention.multi_head_attention(p, x, bias=jnp.zeros((1, 3, 6, 6)))
  with pytest.raises(ValueError, match=r"bias must have rank 4.*\(6,\)"):
    attention.multi_head_attention(p, x, bias=jnp.zeros((6,)))


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="tests the CPU/TPU error")
def test_cudnn_without_gpu_is_a_clear_error():
  p, x, _ = _setup(bias=False)
  with pytest.raises(ValueError, match=r"impl='cudnn' needs an NVIDIA GPU; .*'cpu'"):
    attention.multi_head_attention(p, x, impl="cudnn")
  assert attention.resolve_impl("auto", jnp.zeros((1, 2, 2, 8), jnp.bfloat16), False) == "reference"


def test_head_width_one_leaves_only_two_directions():
  """At d_k = 1 a query and a key are single numbers: every row's argmax is the key with
  the largest or the smallest k, whatever the query. No error, just nothing to say."""
  p, x, _ = _setup(d=16, h=16, t=12, bias=False)
  r = attention.multi_head_attention(p, x, return_weights=True)
  k_BSH = jnp.einsum("bsd,dh->bsh", x, p["wk"][..., 0])
  top = np.asarray(r.weights.argmax(-1))                    # (B, H, T)
  hi = np.asarray(k_BSH.argmax(1))[:, :, None]              # (B, H, 1)
  lo = np.asarray(k_BSH.argmin(1))[:, :, None]
  assert np.all((top == hi) | (top == lo))
  distinct = lambda top: max(len(np.unique(top[b, h])) for b in range(top.shape[0])
                             for h in range(top.shape[1]))
  assert distinct(top) <= 2
  # At d_k = 4 (same D) a head's rows are free to pick other keys.
  p4, _, _ = _setup(d=16, h=4, t=12, bias=False)
  w4 = attention.multi_head_attention(p4, x, return_weights=True).weights
  assert distinct(np.asarray(w4.argmax(-1))) > 2


def test_value_input_projects_values_from_another_input():
  """Positions in Q and K only (Shortformer): keys from context, values from value_input."""
  p, x, ctx = _setup(s=6, bias=False)
  vin = jax.random.normal(jax.random.PRNGKey(9), ctx.shape)
  r = attention.multi_head_attention(p, x, ctx, value_input=vin, return_weights=True)
  _, w = numpy_mha(p, x, ctx)
  v = np.einsum("bsd,dhk->bshk", np.asarray(vin, np.float64), np.asarray(p["wv"], np.float64))
  want = np.einsum("bthk,hkd->btd", np.einsum("bhts,bshk->bthk", w, v), np.asarray(p["wo"]))
  np.testing.assert_allclose(r.out, want, atol=1e-5)
  np.testing.assert_allclose(r.weights, w, atol=1e-6)        # the pattern ignores values
  np.testing.assert_allclose(attention.multi_head_attention(p, x, ctx, value_input=vin, impl="xla"),
                             want, atol=1e-5)
  with pytest.raises(ValueError, match=r"value_input must have the keys' input shape"):
    attention.multi_head_attention(p, x, ctx, value_input=vin[:, :3])


def test_bias_shifts_scores_before_the_softmax():
  """A bias of +b on one key per row equals multiplying that key's softmax term by e^b."""
  p, x, _ = _setup(d=16, h=2, t=5)
  r0 = attention.multi_head_attention(p, x, return_weights=True)
  bias = jnp.zeros((5, 5)).at[:, 0].set(1.5)
  r1 = attention.multi_head_attention(p, x, bias=bias, return_weights=True)
  w0 = np.asarray(r0.weights, np.float64)
  boosted = w0.copy()
  boosted[..., 0] *= math.exp(1.5)
  np.testing.assert_allclose(r1.weights, boosted / boosted.sum(-1, keepdims=True), atol=1e-6)
  # gradients reach the bias (it is a learned parameter in relative-position models)
  g = jax.grad(lambda b: attention.multi_head_attention(p, x, bias=b).sum())(bias)
  assert float(jnp.abs(g).max()) > 1e-4


def test_rel_bias_is_a_per_head_offset_bias_and_slices_with_the_heads():
  p, x, _ = _setup(d=16, h=2, t=6, bias=False)
  table = jax.random.normal(jax.random.PRNGKey(4), (2, 7))       # R = 3
  want = attention.multi_head_attention(p, x, bias=attention.relative_bias(table, 6, 6), return_weights=True)
  got = attention.multi_head_attention(dict(p, rel_bias=table), x, return_weights=True)
  np.testing.assert_allclose(got.weights, want.weights, atol=1e-6)
  off = np.clip(np.arange(6)[None] - np.arange(6)[:, None], -3, 3) + 3
  _, w = numpy_mha(p, x, bias=np.asarray(table)[:, off][None])
  np.testing.assert_allclose(got.weights, w, atol=1e-5)
  # Removing head 0 = slicing every per-head param, rel_bias included.
  gated = attention.multi_head_attention(dict(p, rel_bias=table), x, head_gates=jnp.array([0.0, 1.0]))
  one = {k: (v[:, 1:] if k in ("wq", "wk", "wv") else v[1:]) for k, v in p.items()}
  np.testing.assert_allclose(attention.multi_head_attention(dict(one, rel_bias=table[1:]), x), gated,
                             atol=1e-5)
  assert attention.init_attention_params(jax.random.PRNGKey(0), 16, 2, max_rel=3)["rel_bias"].shape == (2, 7)
