"""Tests of the fused q/k/v projection and of the attention variants (gated, gated_head,
differential, sigmoid, sink, qk_norm) against float64 NumPy oracles."""

import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mha_jax import attention

sys.path.insert(0, os.path.dirname(__file__))
import golden_cases  # noqa: E402
from oracles import assert_f32_close  # noqa: E402

_GOLDEN = os.path.join(os.path.dirname(__file__), "data", "attention_softmax_golden.npz")


def _close(got, want, rtol=None, what=""):
  """|got - want| <= rtol * max|want| (float32 sums in another order); rtol None: the
  float32 ulps another CPU may round by (oracles.assert_f32_close)."""
  if rtol is None:
    return assert_f32_close(got, want, what=what)
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
  matmuls). Outputs and gradients agree to float32 ulps of their scale."""
  rng = np.random.default_rng(h * 100 + g)
  d, k = 96, 96 // h
  shapes = attention.param_shapes(d, h, k, g)
  p = {n: jnp.asarray(rng.standard_normal(shapes[n]) * (d ** -0.5 if n[0] == "w" else 0.1),
                      jnp.float32) for n in ("wq", "wk", "wv", "wo", "bq", "bk", "bv", "bo")}
  x = jnp.asarray(rng.standard_normal((2, 3, d)), jnp.float32)
  mask = jnp.asarray(rng.random((2, 1, 3, 3)) < 0.8)

  def fused(p, x):
    return attention.multi_head_attention(p, x, mask=mask, causal=True)

  def unfused(p, x):   # x + 0: equal values, another array: one matmul per projection
    return attention.multi_head_attention(p, x, x + 0.0, mask=mask, causal=True)

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


@pytest.mark.slow  # default run: the golden softmax file (test_attention.py)
def test_softmax_equals_the_code_before_the_variants_to_float32_rounding():
  """The golden file holds outputs and gradients of the default (softmax) attention from
  before the variants existed (scripts/make_attention_golden.py, the tests' XLA flags),
  written on one machine: another CPU's instruction set rounds float32 otherwise (3.6e-7
  on an AMD EPYC), so they agree to float32 ulps of their scale, and bit for bit only
  with a second computation in this process."""
  want = np.load(_GOLDEN)
  got = golden_cases.compute_all()
  assert sorted(got) == sorted(want.files)
  case = {}                  # each case's scale: its largest output or gradient
  for name in want.files:
    c = name.split("/")[0]
    case[c] = max(case.get(c, 0.0), float(np.max(np.abs(want[name]))))
  for name in want.files:     # d/dbk is 0 (softmax ignores a shift of every score): noise
    assert_f32_close(got[name], want[name], what=name,
                     scale=case[name.split("/")[0]] if name.endswith("/dbk") else None)
  again = golden_cases.compute_all()
  for name in want.files:
    np.testing.assert_array_equal(again[name], got[name], err_msg=name)


# ---------------------------------------------------------------- the variants

from oracles import numpy_rope  # noqa: E402
from mha_jax import interventions  # noqa: E402
from mha_jax.kernels import blocked as blocked_lib  # noqa: E402

VARIANTS = attention.VARIANTS
B, T, D, H, G = 2, 6, 16, 4, 2


def _variant_params(variant, g=G, seed=0):
  """init_attention_params plus non-zero biases and variant params that are not at
  their initial values (so that every one of them is really tested)."""
  p = dict(attention.init_attention_params(jax.random.PRNGKey(seed), D, H, num_kv_heads=g,
                                   use_bias=True, variant=variant))
  rng = np.random.default_rng(seed + 1)
  for name in p:
    if name[0] == "b" or name in ("sink_logit", "diff_norm", "q_norm", "k_norm"):
      base = 1.0 if name in ("diff_norm", "q_norm", "k_norm") else 0.0
      p[name] = jnp.asarray(base + 0.3 * rng.standard_normal(p[name].shape), jnp.float32)
    elif name.startswith("lambda_"):
      p[name] = jnp.asarray(0.4 * rng.standard_normal(p[name].shape), jnp.float32)
  return p


def _allowed(mask, causal, b, h, t, s):
  ok = np.ones((b, h, t, s), bool)
  if mask is not None:
    ok &= np.broadcast_to(np.asarray(mask), (b, h, t, s))
  if causal:
    ok &= np.tril(np.ones((t, s), bool))[None, None]
  return ok


def _np_rope(x_BTHK, halves):
  """RoPE (base 10000, half layout) of every head, or of every half-head."""
  x = np.asarray(x_BTHK, np.float64)
  b, t, n, k = x.shape
  if halves:
    x = x.reshape(b, t, 2 * n, k // 2)
  out = np.stack([np.stack([numpy_rope(x[i, :, j], np.arange(t)) for j in range(x.shape[2])],
                           axis=1) for i in range(b)])
  return out.reshape(b, t, n, k)


def _np_softmax_map(s, ok):
  s = np.where(ok, s, -np.inf)
  m = np.max(s, axis=-1, keepdims=True)
  e = np.where(ok, np.exp(s - np.where(np.isfinite(m), m, 0)), 0.0)
  z = e.sum(-1, keepdims=True)
  return np.where(z > 0, e / np.where(z > 0, z, 1), 0.0)


def numpy_variant(params, x, variant, mask=None, causal=False, rope=False,
                  sigmoid_bias=None, layer=0, qk_eps=1e-6):
  """float64 NumPy oracle written from the papers' equations, not from mha_jax.
  Returns (y (B, T, D), first map (B, H, T, S))."""
  p = {n: np.asarray(v, np.float64) for n, v in params.items()}
  x = np.asarray(x, np.float64)
  b, t, _ = x.shape
  h, k, g = p["wq"].shape[1], p["wq"].shape[2], p["wk"].shape[1]
  q = np.einsum("btd,dhk->bthk", x, p["wq"]) + p["bq"]
  kk = np.repeat(np.einsum("btd,dgk->btgk", x, p["wk"]) + p["bk"], h // g, axis=2)
  v = np.repeat(np.einsum("btd,dgk->btgk", x, p["wv"]) + p["bv"], h // g, axis=2)
  if variant == "qk_norm":   # RMSNorm per head, then RoPE
    q = q / np.sqrt(np.mean(q ** 2, -1, keepdims=True) + qk_eps) * p["q_norm"]
    kk = kk / np.sqrt(np.mean(kk ** 2, -1, keepdims=True) + qk_eps) * p["k_norm"]
  halves = variant == "differential"
  if rope:
    q, kk = _np_rope(q, halves), _np_rope(kk, halves)
  ok = _allowed(mask, causal, b, h, t, t)

  def scores(qh, kh):
    return np.einsum("bthk,bshk->bhts", qh, kh) / np.sqrt(qh.shape[-1])

  if variant == "differential":   # Ye et al. 2025, eq. (1)-(3)
    half = k // 2
    w1 = _np_softmax_map(scores(q[..., :half], kk[..., :half]), ok)
    w2 = _np_softmax_map(scores(q[..., half:], kk[..., half:]), ok)
    lam_init = 0.8 - 0.6 * np.exp(-0.3 * layer)
    lam = (np.exp(np.sum(p["lambda_q1"] * p["lambda_k1"], -1))
           - np.exp(np.sum(p["lambda_q2"] * p["lambda_k2"], -1)) + lam_init)
    o = np.einsum("bhts,bshk->bthk", w1 - lam[None, :, None, None] * w2, v)
    o = o / np.sqrt(np.mean(o ** 2, -1, keepdims=True) + 1e-5) * p["diff_norm"]
    o = o * (1 - lam_init)
    w = w1
  else:
    s = scores(q, kk)
    if variant == "sigmoid":   # Ramapuram et al. 2025: sigmoid(s + b), b = -log n
      bias = -np.log(t) if sigmoid_bias is None else sigmoid_bias
      w = np.where(ok, 1 / (1 + np.exp(-(s + bias))), 0.0)
    elif variant == "sink":    # exp(s_j) / (exp(c_h) + sum_k exp(s_k))
      c = p["sink_logit"][None, :, None, None]
      m = np.maximum(np.max(np.where(ok, s, -np.inf), -1, keepdims=True), c)
      e = np.where(ok, np.exp(s - m), 0.0)
      w = e / (e.sum(-1, keepdims=True) + np.exp(c - m))
    else:
      w = _np_softmax_map(s, ok)
    o = np.einsum("bhts,bshk->bthk", w, v)
  if variant == "gated":       # Qiu et al. 2025: after SDPA, elementwise, per head
    o = o / (1 + np.exp(-(np.einsum("btd,dhk->bthk", x, p["wg"]) + p["bg"])))
  elif variant == "gated_head":
    o = o / (1 + np.exp(-(np.einsum("btd,dh->bth", x, p["wg"]) + p["bg"])))[..., None]
  return np.einsum("bthk,hkd->btd", o, p["wo"]) + p["bo"], w


def _pad_mask():
  return jnp.asarray(np.arange(T)[None, :] < np.array([[T], [T - 2]]))[:, None, None, :]


@pytest.mark.parametrize("variant", VARIANTS)
def test_variant_matches_numpy_oracle_with_mask_gqa_rope_and_gradients(variant):
  """Reference and blocked kernels (those that serve the variant, else reference
  twice), forward and the directional derivative of a loss along a random direction
  (against central differences of the float64 oracle)."""
  p = _variant_params(variant)
  x = jnp.asarray(np.random.default_rng(5).standard_normal((B, T, D)), jnp.float32)
  mask = _pad_mask()
  r = jnp.asarray(np.random.default_rng(6).standard_normal((B, T, D)), jnp.float32)
  kw = dict(mask=mask, causal=True, rope=attention.RoPE(), variant=variant, layer=2)

  def run(p, x):
    outs = []
    for impl in ("reference", "blocked"):
      loss = lambda p, x, impl=impl: jnp.sum(r * attention.multi_head_attention(p, x, impl=impl,
                                                                        **kw))
      outs.append((attention.multi_head_attention(p, x, impl=impl, **kw),
                   jax.grad(loss, argnums=(0, 1))(p, x)))
    w = attention.multi_head_attention(p, x, return_weights=True, **kw).weights
    return outs, w

  outs, w = jax.jit(run)(p, x)
  want, want_w = numpy_variant(p, x, variant, mask=mask, causal=True, rope=True, layer=2)
  _close(w, want_w, rtol=1e-5, what="weights")
  rng = np.random.default_rng(7)
  u = {n: rng.standard_normal(a.shape) for n, a in p.items()}
  ux = rng.standard_normal(x.shape)
  eps = 1e-5
  f = lambda sgn: np.sum(np.asarray(r, np.float64) * numpy_variant(
      {n: np.asarray(a, np.float64) + sgn * eps * u[n] for n, a in p.items()},
      np.asarray(x, np.float64) + sgn * eps * ux, variant, mask=mask, causal=True, rope=True,
      layer=2)[0])
  want_dir = (f(1) - f(-1)) / (2 * eps)
  for impl, (y, (gp, gx)) in zip(("reference", "blocked"), outs):
    _close(y, want, rtol=1e-5, what=f"{impl} out")
    got_dir = sum(float(np.sum(np.asarray(gp[n], np.float64) * u[n])) for n in p) + float(
        np.sum(np.asarray(gx, np.float64) * ux))
    assert abs(got_dir - want_dir) <= 1e-4 * max(1.0, abs(want_dir)), (impl, got_dir, want_dir)


@pytest.mark.parametrize("kind", ["sigmoid", "sink"])
def test_blocked_kernel_equals_reference_over_many_blocks(kind):
  """sigmoid and sink change the kernels' sums: blocked with blocks of 2 x 3 and steps
  of one (batch row, kv head) pair against the reference kernel, with GQA, a padding
  mask, causal and gradients (the sink logit's too)."""
  from mha_jax.kernels import reference as reference_lib
  rng = np.random.default_rng(8)
  q = jnp.asarray(rng.standard_normal((B, 7, H, 4)), jnp.float32)
  k = jnp.asarray(rng.standard_normal((B, 7, G, 4)), jnp.float32)
  v = jnp.asarray(rng.standard_normal((B, 7, G, 4)), jnp.float32)
  sink = jnp.asarray(rng.standard_normal(H), jnp.float32)
  mask = jnp.asarray(np.arange(7)[None, :] < np.array([[7], [3]]))[:, None, None, :]
  full = mask & jnp.tril(jnp.ones((7, 7), bool))[None, None]
  extra = dict(sigmoid_bias=-1.5) if kind == "sigmoid" else {}

  def blocked(q, k, v, sink):
    sk = dict(sink_H=sink) if kind == "sink" else {}
    return blocked_lib.blocked_attention(q, k, v, mask, causal=True, block_q=2, block_k=3,
                                         block_heads=1, **extra, **sk)

  def ref(q, k, v, sink):
    sk = dict(sink_H=sink) if kind == "sink" else {}
    return reference_lib.reference_kernel(q, k, v, full, **extra, **sk)[0]

  def both(*a):
    loss = lambda f: lambda *a: jnp.sum(jnp.sin(f(*a)))
    return (blocked(*a), ref(*a), jax.grad(loss(blocked), argnums=(0, 1, 2, 3))(*a),
            jax.grad(loss(ref), argnums=(0, 1, 2, 3))(*a))

  ob, orf, gb, gr = jax.jit(both)(q, k, v, sink)
  _close(ob, orf, rtol=1e-5, what="out")
  for name, a, b in zip(("dq", "dk", "dv", "dsink"), gb, gr):
    _close(a, b, rtol=1e-5, what=name)


@pytest.mark.slow  # default run: test_variant_matches_numpy_oracle_with_mask_gqa_rope_and_gradients
def test_gate_held_at_one_and_lambda_zero_reduce_to_softmax():
  x = jnp.asarray(np.random.default_rng(9).standard_normal((B, T, D)), jnp.float32)
  base = _variant_params("softmax")
  kw = dict(causal=True, mask=_pad_mask())
  want = attention.multi_head_attention(base, x, **kw)
  # gated: wg = 0 and a large bias put sigmoid at 1 (to float32), per element and per head
  for variant, shape in (("gated", (D, H, D // H)), ("gated_head", (D, H))):
    p = {**base, "wg": jnp.zeros(shape), "bg": jnp.full(shape[1:], 40.0)}
    np.testing.assert_array_equal(attention.multi_head_attention(p, x, variant=variant, **kw), want)
  # differential with lambda = 0: the first map alone, through the per-head RMS norm and
  # the (1 - lambda_init) scale. exp(q2 . k2) = exp(q1 . k1) + lambda_init gives 0.
  lam_init = attention.diff_lambda_init(0)
  k = D // H
  q2 = jnp.zeros((H, k // 2)).at[:, 0].set(np.sqrt(np.log(1 + lam_init)))
  p = {**base, "lambda_q1": jnp.zeros((H, k // 2)), "lambda_k1": jnp.zeros((H, k // 2)),
       "lambda_q2": q2, "lambda_k2": q2, "diff_norm": jnp.ones((k,))}
  got = attention.multi_head_attention(p, x, variant="differential", return_weights=True, **kw)
  # A softmax layer whose queries and keys are the first halves (times 2^(1/4) each:
  # the scale 1 / sqrt(K/2)), padded with zeros: the same map, the same values.
  pad = lambda w: jnp.concatenate([w[..., :k // 2] * 2 ** 0.25, jnp.zeros_like(w[..., k // 2:])],
                                  axis=-1)
  sm = {**base, "wq": pad(base["wq"]), "wk": pad(base["wk"]), "bq": pad(base["bq"]),
        "bk": pad(base["bk"])}
  heads = attention.multi_head_attention(sm, x, return_weights=True, **kw).heads
  ms = jnp.mean(heads ** 2, -1, keepdims=True)
  _close(got.heads, heads / jnp.sqrt(ms + attention.DIFF_NORM_EPS) * (1 - lam_init), what="heads")


@pytest.mark.slow  # default run: test_attention.py's KV-cache tests, test_value_width.py's MLA cache
def test_kv_cache_decoding_equals_one_pass_for_every_variant():
  x = jnp.asarray(np.random.default_rng(10).standard_normal((B, 5, D)), jnp.float32)

  def both(variant):
    p = _variant_params(variant)
    kw = dict(causal=True, rope=attention.RoPE(), variant=variant,
              sigmoid_bias=-2.0 if variant == "sigmoid" else None)
    full = attention.multi_head_attention(p, x, **kw)
    cache = attention.init_kv_cache(B, 8, G, D // H)
    y1, cache = attention.multi_head_attention(p, x[:, :3], cache=cache, **kw)
    y2, _ = attention.multi_head_attention(p, x[:, 3:], cache=cache, **kw)
    return full, jnp.concatenate([y1, y2], axis=1)

  for variant in VARIANTS:
    full, steps = jax.jit(both, static_argnums=0)(variant)
    _close(steps, full, rtol=1e-5, what=variant)


def test_variant_sites_read_and_edit():
  x = jnp.asarray(np.random.default_rng(11).standard_normal((B, T, D)), jnp.float32)
  kw = dict(causal=True, mask=_pad_mask())

  def run(p, variant, edits=None, read=()):
    return interventions.run_with_hook(lambda hook: attention.multi_head_attention(
        p, x, variant=variant, site=interventions.scope(hook, "lm.0.attn"), **kw), edits, read)

  # gate: read it (sigmoid of x wg + bg); a gate replaced by 1 is softmax attention.
  p = _variant_params("gated")
  _, got = run(p, "gated", read=["lm.0.attn.gate"])
  want = 1 / (1 + np.exp(-(np.einsum("btd,dhk->bthk", x, p["wg"]) + p["bg"])))
  _close(got["lm.0.attn.gate"], want, rtol=1e-5, what="gate")
  ones, _ = run(p, "gated", edits={"lm.0.attn.gate": interventions.replace(1.0)})
  plain = {n: a for n, a in p.items() if n not in ("wg", "bg")}
  _close(ones, attention.multi_head_attention(plain, x, **kw), what="gate = 1")
  # gated_head: ablating head 1's gate is removing head 1.
  p = _variant_params("gated_head")
  y0, got = run(p, "gated_head", edits={"lm.0.attn.gate": interventions.replace(0.0, heads=1)},
                read=["lm.0.attn.gate"])
  assert got["lm.0.attn.gate"].shape == (B, T, H)
  np.testing.assert_array_equal(got["lm.0.attn.gate"][:, :, 1], 0.0)
  gates = jnp.ones(H).at[1].set(0.0)
  _close(y0, attention.multi_head_attention(p, x, variant="gated_head", head_gates=gates, **kw),
         what="gate ablation")
  # sink: the weight is 1 minus the pattern's rows; replaced by 0 it is plain softmax.
  p = _variant_params("sink")
  _, got = run(p, "sink", read=["lm.0.attn.sink_weight", "lm.0.attn.pattern"])
  _close(got["lm.0.attn.sink_weight"], 1 - got["lm.0.attn.pattern"].sum(-1), what="sink")
  assert float(got["lm.0.attn.sink_weight"].min()) > 0
  y, _ = run(p, "sink", edits={"lm.0.attn.sink_weight": interventions.replace(0.0)})
  plain = {n: a for n, a in p.items() if n != "sink_logit"}
  _close(y, attention.multi_head_attention(plain, x, **kw), rtol=1e-5, what="sink weight 0")
  # differential: pattern2 is the second map; zeroed, lambda no longer matters.
  p = _variant_params("differential")
  _, got = run(p, "differential", read=["lm.0.attn.pattern2", "lm.0.attn.pattern"])
  _close(got["lm.0.attn.pattern2"].sum(-1)[0], np.ones((H, T)), what="pattern2 rows")
  assert float(jnp.abs(got["lm.0.attn.pattern2"] - got["lm.0.attn.pattern"]).max()) > 1e-3
  y1, _ = run(p, "differential", edits={"lm.0.attn.pattern2": interventions.replace(0.0)})
  p2 = {**p, "lambda_q1": -p["lambda_q1"]}
  y2, _ = run(p2, "differential", edits={"lm.0.attn.pattern2": interventions.replace(0.0)})
  _close(y1, y2, what="lambda without its map")


def test_unknown_variant_and_unsupported_kernels_are_refused_by_name():
  x = jnp.ones((1, 3, D))
  p = _variant_params("softmax")
  with pytest.raises(ValueError, match="variant must be one of .*'nope'"):
    attention.multi_head_attention(p, x, variant="nope")
  with pytest.raises(ValueError, match="variant must be one of"):
    attention.init_attention_params(jax.random.PRNGKey(0), D, H, variant="nope")
  for variant in ("sigmoid", "sink", "differential"):
    pv = _variant_params(variant)
    for impl in ("xla", "pallas"):
      with pytest.raises(ValueError, match=f"impl='{impl}' does not serve variant='{variant}'"):
        attention.multi_head_attention(pv, x, variant=variant, impl=impl)
  with pytest.raises(ValueError, match=r"'wg'.*variant='softmax'"):
    attention.multi_head_attention(_variant_params("gated"), x)
  with pytest.raises(ValueError, match=r"variant='sink' needs params\['sink_logit'\]"):
    attention.multi_head_attention(p, x, variant="sink")
  with pytest.raises(ValueError, match="sigmoid_bias"):
    attention.multi_head_attention(p, x, sigmoid_bias=-1.0)
  with pytest.raises(ValueError, match="K=3 must be even"):
    attention.init_attention_params(jax.random.PRNGKey(0), 12, 4, variant="differential")


def test_variant_param_shapes_are_documented_and_slice_with_heads():
  for variant in VARIANTS:
    p = attention.init_attention_params(jax.random.PRNGKey(0), D, H, variant=variant)
    want = attention.variant_param_shapes(variant, D, H, D // H)
    assert {n: tuple(p[n].shape) for n in want} == want
    assert set(p) == {"wq", "wk", "wv", "wo"} | set(want)
  # Head i of every per-head param is its row: two heads kept is slicing.
  p = _variant_params("gated", g=H)
  keep = np.array([0, 2])
  sl = {n: (a[:, keep] if n in ("wq", "wk", "wv", "wg") else a[keep] if n in
            ("bq", "bk", "bv", "bg", "wo") else a) for n, a in p.items()}
  x = jnp.asarray(np.random.default_rng(12).standard_normal((1, 4, D)), jnp.float32)
  gates = jnp.zeros(H).at[keep].set(1.0)
  _close(attention.multi_head_attention(sl, x, variant="gated"),
         attention.multi_head_attention(p, x, variant="gated", head_gates=gates), what="sliced")


@pytest.mark.slow
def test_bench_variants_times_every_variant_against_softmax(tmp_path):
  from mha_jax.harness import bench
  r = bench.run_variants(d_model=16, seq_len=8, batch=1, heads=(2,), rounds=1,
                         variants=("gated", "sink"), log=lambda s: None)
  got = {(row["variant"], row["mode"]): row for row in r["rows"]}
  assert set(got) == {(v, m) for v in ("softmax", "gated", "sink")
                      for m in ("forward", "forward+backward")}
  assert got[("softmax", "forward")]["ratio_to_softmax"] == 1.0
  assert got[("sink", "forward")]["kernel"] in ("reference", "blocked")
  assert "| 2 | sink |" in bench.format_variants(r)
  with pytest.raises(Exception, match="unknown"):
    bench.run_variants(variants=("nope",))
