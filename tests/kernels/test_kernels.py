"""Tests of mha_jax.kernels: the blocked (flash-style) path and the Pallas wrappers.

Every kernel is compared with the explicit-weights path built from attention.py's
building blocks (scores, softmax, mix), forward at 1e-5 and gradients at 1e-4.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mha_jax import attention
from mha_jax.kernels import blocked, pallas


def reference(q, k, v, mask=None, bias=None, causal=False, table=None, softcap=None,
              window=None):
  """Explicit weights from attention.py's building blocks; GQA by repeating k, v;
  soft-capping written out (cap * tanh(s / cap)) and the window as a band mask."""
  t, h, s, g = q.shape[1], q.shape[2], k.shape[1], k.shape[2]
  k, v = jnp.repeat(k, h // g, axis=2), jnp.repeat(v, h // g, axis=2)
  sc = attention.attention_scores(q, k)
  if softcap is not None:
    sc = softcap * jnp.tanh(sc / softcap)
  if window is not None:
    band = (jnp.arange(t)[:, None] - jnp.arange(s)[None, :] < window)[None, None]
    mask = band if mask is None else mask & band
  if bias is not None:
    sc = sc + bias
  if table is not None:
    sc = sc + attention.relative_bias(table, t, s)
  if causal:
    cm = jnp.tril(jnp.ones((t, s), bool))[None, None]
    mask = cm if mask is None else mask & cm
  return attention.mix_values(attention.attention_weights(sc, mask), v)


def _inputs(b, t, s, h, g, dk, seed=0, dv=None):
  ks = jax.random.split(jax.random.PRNGKey(seed), 3)
  return (jax.random.normal(ks[0], (b, t, h, dk)), jax.random.normal(ks[1], (b, s, g, dk)),
          jax.random.normal(ks[2], (b, s, g, dv or dk)))


def _extras(kind, b, h, t, s, seed=1):
  ks = jax.random.split(jax.random.PRNGKey(seed), 3)
  mask = bias = table = None
  if "pad" in kind:    # key padding, and one example with every key masked
    mask = (jnp.arange(s)[None, None, None, :] < jnp.array([s - 2, 0, s - 1, 1])[:b, None, None, None])
  if "rand" in kind:   # per (b, h, t, s), one fully masked row
    mask = jax.random.bernoulli(ks[0], 0.6, (b, h, t, s)).at[0, 0, 1].set(False)
  if "bias" in kind:
    bias = 0.5 * jax.random.normal(ks[1], (1, h, t, s))
  if "rel" in kind:
    table = jax.random.normal(ks[2], (h, 7))
  return mask, bias, table


def _check(f, g, args, grad_argnums):
  f, g = jax.jit(f), jax.jit(g)
  o1, o2 = f(*args), g(*args)
  np.testing.assert_allclose(o1, o2, atol=1e-5, rtol=1e-5)
  assert bool(jnp.all(jnp.isfinite(o1)))
  ct = jax.random.normal(jax.random.PRNGKey(7), o1.shape)
  loss = lambda fn: (lambda *a: jnp.sum(fn(*a) * ct))
  g1 = jax.jit(jax.grad(loss(f), argnums=grad_argnums))(*args)
  g2 = jax.jit(jax.grad(loss(g), argnums=grad_argnums))(*args)
  for a, c in zip(g1, g2):
    np.testing.assert_allclose(a, c, atol=1e-4, rtol=1e-4)
  return o1


# (b, t, s, h, g, dk, causal, extras, block_q, block_k, block_heads): blocks that do
# not divide; steps over kv heads (cg < G), over batch rows (cb = 1 or 2) and both.
GRID = [
    (2, 9, 13, 4, 4, 8, True, "pad", 4, 5, 2),         # steps: 2 rows x 2 of 2 heads
    (1, 16, 5, 3, 3, 4, False, "rand bias", 5, 3, 1),  # 3 steps, one head each
    (2, 12, 12, 8, 2, 4, True, "rel", 5, 4, 1),        # GQA 8/2, 4 steps (row, kv head)
    (4, 6, 6, 2, 2, 4, False, "pad bias", 3, 3, 4),    # 2 steps of 2 rows x 2 heads
    pytest.param(2, 7, 7, 1, 1, 8, False, "", 3, 2, None, marks=pytest.mark.slow),
    pytest.param(2, 10, 6, 6, 1, 8, False, "pad bias rel", None, None, 1,  # MQA
                 marks=pytest.mark.slow),
    pytest.param(1, 11, 11, 4, 2, 8, True, "rand rel", 11, 11, None,      # one block
                 marks=pytest.mark.slow),
]


@pytest.mark.parametrize("b,t,s,h,g,dk,causal,kind,bq,bk,bh", GRID)
def test_blocked_matches_reference(b, t, s, h, g, dk, causal, kind, bq, bk, bh):
  q, k, v = _inputs(b, t, s, h, g, dk)
  mask, bias, table = _extras(kind, b, h, t, s)
  f = lambda q, k, v, bias, table: blocked.blocked_attention(
      q, k, v, mask, bias, causal=causal, rel_bias_HR=table, block_q=bq, block_k=bk,
      block_heads=bh)
  r = lambda q, k, v, bias, table: reference(q, k, v, mask, bias, causal, table)
  argn = (0, 1, 2) + ((3,) if bias is not None else ()) + ((4,) if table is not None else ())
  out = _check(f, r, (q, k, v, bias, table), argn)
  if mask is not None:  # rows with no key give zero output
    full = jnp.broadcast_to(mask, (b, h, t, s))
    if causal:
      full = full & jnp.tril(jnp.ones((t, s), bool))
    dead = ~jnp.any(full, -1)                     # (B, H, T)
    assert bool(jnp.any(dead))
    np.testing.assert_array_equal(jnp.where(dead.transpose(0, 2, 1)[..., None], out, 0.0),
                                  jnp.zeros_like(out))


# (b, t, s, h, g, causal, extras, block_q, block_k, softcap, window): windows smaller
# than, equal to and larger than the blocks; ragged T (blocks that do not divide);
# soft-capping with and without; masks and biases; GQA.
WINDOW_GRID = [
    (2, 13, 13, 4, 2, True, "pad", 4, 4, 2.0, 3),         # window < block, ragged T
    pytest.param(1, 16, 16, 2, 2, True, "rand bias", 4, 4, None, 4,   # window = block
                 marks=pytest.mark.slow),
    (2, 11, 11, 4, 1, True, "", 3, 4, 1.5, 9),            # window > block, MQA
    pytest.param(1, 10, 14, 2, 2, False, "pad", 4, 3, 3.0, 5,   # not causal, T != S
                 marks=pytest.mark.slow),
    pytest.param(2, 9, 9, 4, 4, True, "rand", 4, 4, 2.5, None,  # soft-cap alone
                 marks=pytest.mark.slow),
    pytest.param(1, 12, 12, 2, 1, False, "bias", 5, 5, 2.0, None, marks=pytest.mark.slow),
]


@pytest.mark.parametrize("b,t,s,h,g,causal,kind,bq,bk,cap,window", WINDOW_GRID)
@pytest.mark.slow  # default run: test_softcap_and_window_through_the_layer_in_every_kernel
def test_blocked_window_and_softcap_match_reference(b, t, s, h, g, causal, kind, bq, bk,
                                                    cap, window):
  """Forward and gradients (q, k, v, bias) against the reference with the cap written
  out and the window as a dense band mask."""
  q, k, v = _inputs(b, t, s, h, g, 8)
  q = 3.0 * q          # scores well past the cap
  mask, bias, _ = _extras(kind, b, h, t, s)
  f = lambda q, k, v, bias: blocked.blocked_attention(
      q, k, v, mask, bias, causal=causal, block_q=bq, block_k=bk, softcap=cap,
      window=window)
  r = lambda q, k, v, bias: reference(q, k, v, mask, bias, causal, softcap=cap,
                                      window=window)
  _check(f, r, (q, k, v, bias), (0, 1, 2) + ((3,) if bias is not None else ()))
  if cap is not None:   # the cap changes the answer (the test can fail)
    plain = reference(q, k, v, mask, bias, causal, window=window)
    assert float(jnp.max(jnp.abs(plain - r(q, k, v, bias)))) > 1e-2


@pytest.mark.slow  # default run: test_softcap_and_window_through_the_layer_in_every_kernel
def test_blocked_window_skips_the_blocks_outside_it():
  """Key blocks wholly outside every query's window are never read: NaN values there
  reach only the queries whose window covers them (a dense band mask would read them,
  and 0 * NaN is NaN), forward and backward."""
  t, bq, window = 16, 4, 4
  q, k, v = _inputs(1, t, t, 2, 2, 8)
  v = v.at[:, :4].set(jnp.nan)          # key block 0: seen by queries 0..6 only
  f = lambda q, k, v: blocked.blocked_attention(q, k, v, causal=True, block_q=bq,
                                                block_k=bq, window=window)
  o = jax.jit(f)(q, k, v)
  assert bool(jnp.all(jnp.isnan(o[:, :4])))
  assert bool(jnp.all(jnp.isfinite(o[:, 8:])))
  ct = jnp.zeros_like(o).at[:, 8:].set(1.0)
  dq = jax.grad(lambda q: jnp.sum(jnp.nan_to_num(f(q, k, v)) * ct))(q)
  assert bool(jnp.all(jnp.isfinite(dq[:, 8:])))
  dense = jnp.tril(jnp.ones((t, t), bool)) & (
      jnp.arange(t)[:, None] - jnp.arange(t)[None, :] < window)
  o_dense = blocked.blocked_attention(q, k, v, dense[None, None], block_q=bq, block_k=bq)
  assert bool(jnp.any(jnp.isnan(o_dense[:, 8:])))    # what skipping avoids


@pytest.mark.slow  # default run: test_value_width.py::test_v_wider_than_k_matches_the_oracle[auto]
def test_blocked_value_width_may_differ_and_bfloat16_runs():
  q, k, v = _inputs(1, 9, 9, 2, 2, 8, dv=5)
  _check(lambda q, k, v: blocked.blocked_attention(q, k, v, block_q=4, block_k=4),
         reference, (q, k, v), (0, 1, 2))
  o = jax.jit(blocked.blocked_attention)(*(x.astype(jnp.bfloat16) for x in (q, k, v)))
  assert o.dtype == jnp.bfloat16
  np.testing.assert_allclose(o.astype(jnp.float32), reference(q, k, v), atol=5e-2)


def test_blocked_memory_is_linear_in_t():
  """No (T, S)-sized buffer in the compiled forward+backward at T = S = 4096."""
  b, t, h, dk = 1, 4096, 2, 16
  q = jax.ShapeDtypeStruct((b, t, h, dk), jnp.float32)
  grad = jax.jit(jax.grad(lambda q, k, v: jnp.sum(blocked.blocked_attention(
      q, k, v, causal=True, block_q=256, block_k=256)), argnums=(0, 1, 2)))
  mem = grad.lower(q, q, q).compile().memory_analysis()
  if mem is None:
    pytest.skip("no memory analysis on this backend")
  scores = b * h * t * t * 4
  assert mem.temp_size_in_bytes < scores / 8, mem.temp_size_in_bytes


def test_choose_blocks():
  step = blocked.STEP_BYTES
  # T = 512: one block of T x S; as many heads per step as fit in STEP_BYTES.
  per_head = 512 * 512 * 4
  assert blocked.choose_blocks(4, 8, 1, 512, 512) == (512, 512, 1, step // per_head)
  assert blocked.choose_blocks(4, 96, 1, 512, 512)[2:] == (1, step // per_head)
  # Few heads: whole batch rows per step (a divisor of B).
  assert step // per_head == 4
  assert blocked.choose_blocks(6, 1, 1, 512, 512)[2:] == (3, 1)
  # Long T, GQA: the query block shrinks until one kv head's block fits.
  bq, bk, cb, cg = blocked.choose_blocks(1, 12, 8, 32768, 32768)
  assert bk == 512 and 8 * bq * bk * 4 <= step and (cb, cg) == (1, 1)
  assert blocked.choose_blocks(2, 2, 1, 7, 5, block_q=3) == (3, 5, 2, 2)
  assert blocked.choose_blocks(2, 2, 1, 7, 5, block_q=30, block_k=30) == (7, 5, 2, 2)
  assert blocked.choose_blocks(4, 6, 1, 7, 5, block_heads=4) == (7, 5, 1, 3)
  assert blocked.choose_blocks(4, 6, 1, 7, 5, block_heads=13) == (7, 5, 2, 6)


def test_blocked_bad_input_names_the_argument():
  q, k, v = _inputs(1, 4, 4, 4, 3, 8)
  with pytest.raises(ValueError, match="G=3 must divide"):
    blocked.blocked_attention(q, k, v)
  q, k, v = _inputs(1, 4, 4, 4, 4, 8)
  with pytest.raises(ValueError, match="mask_BHTS"):
    blocked.blocked_attention(q, k, v, jnp.ones((1, 4, 4, 4), jnp.int32))
  with pytest.raises(ValueError, match="bias_BHTS"):
    blocked.blocked_attention(q, k, v, None, jnp.ones((1, 3, 4, 4)))
  with pytest.raises(ValueError, match="rel_bias_HR"):
    blocked.blocked_attention(q, k, v, rel_bias_HR=jnp.ones((4, 4)))
  with pytest.raises(ValueError, match="block_q"):
    blocked.blocked_attention(q, k, v, block_q=0)
  with pytest.raises(ValueError, match="block_heads must be a positive integer.*2.5"):
    blocked.blocked_attention(q, k, v, block_heads=2.5)


# ---------------------------------------------------------------- Pallas, interpret mode

@pytest.mark.parametrize("causal", [True, pytest.param(False, marks=pytest.mark.slow)])
def test_pallas_gpu_kernel_interpret_matches_reference(causal):
  q, k, v = _inputs(1, 32, 32, 2, 1, 16)           # GQA: kv heads repeated
  if True:
    f = lambda q, k, v: pallas.pallas_attention(q, k, v, causal=causal, kernel="gpu",
                                                interpret=True)
    _check(f, lambda q, k, v: reference(q, k, v, causal=causal), (q, k, v), (0, 1, 2))


@pytest.mark.slow
@pytest.mark.parametrize("kernel", ["tpu_flash", "tpu_splash"])
def test_pallas_tpu_kernels_interpret_match_reference(kernel):
  q, k, v = _inputs(1, 128, 128, 2, 2, 32)
  table = 0.3 * jax.random.normal(jax.random.PRNGKey(3), (2, 9))
  for causal in (False, True):
    use_rel = kernel == "tpu_flash" and causal
    rel = attention.relative_bias(table, 128, 128) if use_rel else None     # dense (1, H, T, S)
    f = lambda q, k, v: pallas.pallas_attention(q, k, v, None, rel, causal=causal,
                                                kernel=kernel, interpret=True)
    r = lambda q, k, v: reference(q, k, v, causal=causal, table=table if use_rel else None)
    with pallas.pallas_tpu_interpret():
      _check(f, r, (q, k, v), (0, 1, 2))


@pytest.mark.slow
def test_pallas_tpu_splash_softcap_interpret_matches_reference():
  q, k, v = _inputs(1, 128, 128, 2, 2, 32)
  q = 3.0 * q
  f = lambda q, k, v: pallas.pallas_attention(q, k, v, causal=True, kernel="tpu_splash",
                                              interpret=True, softcap=2.0)
  with pallas.pallas_tpu_interpret():
    _check(f, lambda q, k, v: reference(q, k, v, causal=True, softcap=2.0), (q, k, v),
           (0, 1, 2))


def test_pallas_refuses_what_it_cannot_serve():
  q, k, v = _inputs(1, 32, 32, 2, 2, 16)
  for kernel in ("gpu", "tpu_flash"):
    with pytest.raises(ValueError, match="no attention-logit soft-capping.*tpu_splash"):
      pallas.pallas_attention(q, k, v, kernel=kernel, interpret=True, softcap=2.0)
  with pytest.raises(ValueError, match="needs a GPU"):
    pallas.pallas_attention(q, k, v, kernel="gpu")
  with pytest.raises(ValueError, match="needs a GPU or TPU"):
    pallas.pallas_attention(q, k, v)
  with pytest.raises(ValueError, match="no boolean mask"):
    pallas.pallas_attention(q, k, v, jnp.ones((1, 1, 32, 32), bool), kernel="gpu",
                            interpret=True)
  with pytest.raises(ValueError, match="no score bias"):
    pallas.pallas_attention(q, k, v, None, jnp.ones((32, 32)), kernel="gpu", interpret=True)
  with pytest.raises(ValueError, match="multiple of 128"):
    pallas.pallas_attention(q, k, v, kernel="tpu_flash", interpret=True)
  with pytest.raises(ValueError, match="one dtype"):
    pallas.pallas_attention(q.astype(jnp.int32), k, v, kernel="gpu", interpret=True)
  with pytest.raises(ValueError, match="multiple of"):
    pallas.pallas_attention(*_inputs(1, 48, 48, 2, 2, 16)[:1], *_inputs(1, 200, 200, 2, 2, 16)[1:],
                            kernel="gpu", interpret=True)
  with pytest.raises(ValueError, match="kernel must be one of"):
    pallas.pallas_attention(q, k, v, kernel="triton", interpret=True)


# ---------------------------------------------------------------- through the layer

def _layer_case(h, g, t, s, kind, seed=0):
  d = 8 * h
  ks = jax.random.split(jax.random.PRNGKey(seed), 6)
  p = attention.init_attention_params(ks[0], d, h, use_bias=True, num_kv_heads=g,
                              max_rel=3 if "rel" in kind else 0)
  if "rel" in kind:
    p["rel_bias"] = jax.random.normal(ks[5], p["rel_bias"].shape)
  x = jax.random.normal(ks[1], (2, t, d))
  ctx = None if s == t else jax.random.normal(ks[2], (2, s, d))
  mask = jax.random.bernoulli(ks[3], 0.7, (2, 1, t, s)).at[0, 0, 0].set(False) \
      if "mask" in kind else None
  bias = 0.5 * jax.random.normal(ks[4], (1, h, t, s)) if "bias" in kind else None
  gates = jnp.linspace(0.0, 1.5, h) if "gates" in kind else None
  return p, x, ctx, dict(mask=mask, bias=bias, head_gates=gates, causal="causal" in kind)


# (h, g, t, s, kind): GQA, cross-attention with T != S, every extra.
LAYER_GRID = [
    (4, 4, 6, 6, "mask causal gates"),
    pytest.param(6, 2, 5, 9, "mask bias rel", marks=pytest.mark.slow),
    pytest.param(1, 1, 7, 7, "causal rel", marks=pytest.mark.slow),
    pytest.param(8, 1, 9, 4, "mask gates bias", marks=pytest.mark.slow),
]


@pytest.mark.parametrize("h,g,t,s,kind", LAYER_GRID)
def test_every_impl_agrees_with_reference_through_the_layer(h, g, t, s, kind):
  p, x, ctx, kw = _layer_case(h, g, t, s, kind)

  def f(impl):
    return jax.jit(lambda p, x, c: attention.multi_head_attention(p, x, c, impl=impl, **kw))

  def loss(impl):
    return jax.jit(jax.grad(lambda p, x, c: jnp.sum(jnp.sin(
        attention.multi_head_attention(p, x, c, impl=impl, **kw))), argnums=(0, 1)))

  want, gwant = f("reference")(p, x, ctx), loss("reference")(p, x, ctx)
  for impl in ("xla", "blocked", "auto"):
    np.testing.assert_allclose(f(impl)(p, x, ctx), want, atol=1e-5, rtol=1e-5)
    got = loss(impl)(p, x, ctx)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-4, rtol=1e-4),
                 got, gwant)


@pytest.mark.parametrize("kind", ["mask causal", pytest.param("mask gates",
                                                             marks=pytest.mark.slow)])
def test_softcap_and_window_through_the_layer_in_every_kernel(kind):
  """softcap with a window, causal or not, with a mask: xla, blocked and auto give the
  reference's outputs and gradients; cudnn refuses the cap by name."""
  from mha_jax.kernels import dispatch
  p, x, ctx, kw = _layer_case(4, 2, 11, 11, kind)
  p = dict(p, wq=3.0 * p["wq"])
  kw = dict(kw, softcap=1.5, window=4)

  def f(impl):
    return jax.jit(lambda p, x: attention.multi_head_attention(p, x, impl=impl, **kw))

  def loss(impl):
    return jax.jit(jax.grad(lambda p, x: jnp.sum(jnp.sin(
        attention.multi_head_attention(p, x, impl=impl, **kw))), argnums=(0, 1)))

  want, gwant = f("reference")(p, x), loss("reference")(p, x)
  no_cap = attention.multi_head_attention(p, x, impl="reference", **dict(kw, softcap=None))
  assert float(jnp.max(jnp.abs(no_cap - want))) > 1e-2
  for impl in ("xla", "blocked", "auto"):
    np.testing.assert_allclose(f(impl)(p, x), want, atol=1e-5, rtol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-4, rtol=1e-4),
                 loss(impl)(p, x), gwant)
  q = jnp.zeros((1, 4, 2, 8))
  with pytest.raises(ValueError, match="softcap.*cudnn"):
    dispatch.run_kernel("cudnn", q, q, q, None, True, None, softcap=2.0)


def test_auto_picks_by_memory_and_weights():
  from mha_jax.kernels import dispatch
  q = jax.ShapeDtypeStruct((1, 32768, 8, 64), jnp.float32)
  assert dispatch.resolve_impl("auto", q, False) == "blocked"        # 34 GB of scores
  assert dispatch.resolve_impl("auto", q, True) == "reference"       # weights asked for
  small = jax.ShapeDtypeStruct((2, 8, 4, 8), jnp.float32)
  assert dispatch.resolve_impl("auto", small, False) == "reference"  # below the threshold
  # A budget too small for the scores sends even a small call to blocked.
  assert dispatch.resolve_impl("auto", small, False, budget=1024) == "blocked"
  with pytest.raises(ValueError, match="does not expose attention weights"):
    dispatch.resolve_impl("blocked", small, True)
  with pytest.raises(ValueError, match="impl must be one of"):
    dispatch.resolve_impl("flash", small, False)
  with pytest.raises(ValueError, match="needs a GPU or TPU"):
    p, x, _, _ = _layer_case(2, 2, 4, 4, "")
    attention.multi_head_attention(p, x, impl="pallas")


# ---------------------------------------------------------------- training uses it

@pytest.mark.slow   # about 30 s of CPU: two short training runs
def test_training_with_auto_gives_the_reference_loss_curve(tmp_path, monkeypatch):
  """The tiny translation model trains to the same losses (1e-4) whether attention runs
  on the reference path or, through impl=auto, on the blocked path."""
  from builders import TINY_TRANSLATION, tiny
  from mha_jax.kernels import dispatch
  from mha_jax.train import loop
  from mha_jax.train.metrics import read_metrics

  def curve(impl, name):
    cfg = tiny("configs/translation.py", TINY_TRANSLATION, "--config.train.steps=8",
               "--config.train.log_every=1", "--config.train.eval_every=8",
               "--config.train.schedule=constant", "--config.train.lr=5e-3",
               f"--config.model.impl={impl}")
    loop.train(cfg, str(tmp_path / name), log=lambda s: None)
    return [r["loss"] for r in read_metrics(str(tmp_path / name)) if r["split"] == "train"]

  ref = curve("reference", "ref")
  # At these tiny shapes auto would pick reference; lower the threshold so it picks
  # blocked, the path it takes at real sizes.
  monkeypatch.setattr(dispatch, "BLOCKED_FROM_SCORES", 0)
  assert dispatch.resolve_impl("auto", jnp.zeros((8, 12, 4, 4)), False) == "blocked"
  auto = curve("auto", "auto")
  assert len(ref) == 8 and ref[-1] < ref[0]
  np.testing.assert_allclose(auto, ref, rtol=1e-4, atol=1e-4)
