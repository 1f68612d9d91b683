"""Fixed small calls of multi_head_attention (softmax): their outputs and gradients were
written by scripts/make_attention_golden.py with the code as it was before the variants
(tests/core/data/attention_softmax_golden.npz); test_attention_variants compares."""

import jax
import jax.numpy as jnp
import numpy as np

from mha_jax import attention


def _params(d, h, g, bias, seed, qk_norm=False):
  rng = np.random.default_rng(seed)
  shapes = attention.param_shapes(d, h, d // h, g)
  names = ("wq", "wk", "wv", "wo") + (("bq", "bk", "bv", "bo") if bias else ())
  p = {n: jnp.asarray(rng.standard_normal(shapes[n]) * (d ** -0.5 if n[0] == "w" else 0.1),
                      jnp.float32) for n in names}
  if qk_norm:
    p["q_norm"] = jnp.asarray(1 + 0.1 * rng.standard_normal(d // h), jnp.float32)
    p["k_norm"] = jnp.asarray(1 + 0.1 * rng.standard_normal(d // h), jnp.float32)
  return p


def _x(seed, shape):
  return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), jnp.float32)


def _cases():
  """name -> (params, fn(params, x) -> y, x)."""
  pad = jnp.asarray(np.arange(6)[None, :] < np.array([[6], [4]]))[:, None, None, :]
  rope = attention.RoPE()
  ctx = _x(9, (2, 7, 16))
  xmask = jnp.asarray(np.random.default_rng(3).random((2, 1, 6, 7)) < 0.7)
  return {
      "plain": (_params(16, 4, 4, True, 0), lambda p, x: attention.multi_head_attention(p, x),
                _x(1, (2, 6, 16))),
      "gqa_rope_causal_mask": (
          _params(16, 4, 2, True, 1),
          lambda p, x: attention.multi_head_attention(p, x, mask=pad, causal=True, rope=rope),
          _x(2, (2, 6, 16))),
      "cross_mask": (_params(16, 2, 2, True, 2),
                     lambda p, x: attention.multi_head_attention(p, x, ctx, mask=xmask),
                     _x(4, (2, 6, 16))),
      "blocked_causal": (_params(16, 4, 4, False, 3),
                         lambda p, x: attention.multi_head_attention(p, x, causal=True,
                                                             impl="blocked"),
                         _x(5, (2, 6, 16))),
      "qk_norm_window_softcap": (
          _params(16, 4, 1, False, 4, qk_norm=True),
          lambda p, x: attention.multi_head_attention(p, x, causal=True, window=3, softcap=5.0,
                                              rope=rope),
          _x(6, (2, 6, 16))),
      "weights": (_params(16, 4, 4, True, 5),
                  lambda p, x: attention.multi_head_attention(p, x, causal=True,
                                                      return_weights=True).weights,
                  _x(7, (2, 6, 16))),
      "cache": (_params(16, 4, 2, True, 6), _cached, _x(8, (2, 5, 16))),
  }


def _cached(p, x):
  cache = attention.init_kv_cache(2, 8, 2, 4)
  y1, cache = attention.multi_head_attention(p, x[:, :3], causal=True, rope=attention.RoPE(), cache=cache)
  y2, _ = attention.multi_head_attention(p, x[:, 3:], causal=True, rope=attention.RoPE(), cache=cache)
  return jnp.concatenate([y1, y2], axis=1)


def compute_all() -> dict[str, np.ndarray]:
  """{case/out, case/dx, case/d<param>} as float32 NumPy arrays (one jit per case)."""
  out = {}
  for name, (p, fn, x) in _cases().items():
    def both(p, x, fn=fn):
      loss = lambda p, x: jnp.sum(jnp.sin(fn(p, x)))
      return fn(p, x), jax.grad(loss, argnums=(0, 1))(p, x)
    y, (dp, dx) = jax.jit(both)(p, x)
    out[f"{name}/out"] = np.asarray(y)
    out[f"{name}/dx"] = np.asarray(dx)
    for k, v in dp.items():
      out[f"{name}/d{k}"] = np.asarray(v)
  return out
