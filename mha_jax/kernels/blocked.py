"""Blocked (flash-style) attention in pure JAX: memory linear in T and S.

The (T, S) score matrix is never held whole. Queries are cut into blocks of
``block_q`` rows and keys into blocks of ``block_k`` columns; for each query block a
loop runs over the key blocks keeping a running row maximum, row sum and weighted
value sum (the online softmax). The backward pass (``jax.custom_vjp``) keeps only
the output and the per-row log-sum-exp and recomputes each block's weights from
them (Rabe & Staats 2021; Dao et al. 2022). The (batch row, head) pairs are walked
in steps too, a few heads at a time, so that a step's scores stay in cache. Peak
memory is O(B * H * (T + S) * K + pairs * block_q * block_k), whatever T and S are.

Shapes: q (B, T, H, K); k (B, S, G, K); v (B, S, G, V) with G (key/value heads)
dividing H: query head i reads key/value head i // (H // G) (grouped-query
attention; G = H is ordinary multi-head attention).

Everything about the call's masks follows mha_jax.attention: boolean masks,
True = may attend; causal is top-left aligned (key j <= query i); a query row with
no key to attend to gives a zero output, never NaN. Key blocks that no query of a
block may see are never visited: above the diagonal (causal) and outside a sliding
window (window: i - j < window), so a windowed call costs O(T * window), not O(T * S).
Soft-capping (softcap * tanh(s / softcap), Gemma 2) is applied to each block's scores.

On a mesh (the mesh in context, jax.set_mesh, or ``mesh=``) of more than one device the
kernel runs inside ``shard_map``: batch rows over every axis but "model", heads over
"model" (shard_specs). Its steps slice q, k and v by a loop counter, which XLA cannot
partition over a sharded axis: left to XLA, every device gathered the whole batch and
ran every step. Traced with no mesh in context, that is still what XLA does.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from mha_jax.blocks import drop_masked_keys, relative_index, soft_cap
from mha_jax.kernels import target as target_lib

# Default block sizes: one block up to these lengths; measured on the 2-core CPU
# (docs/results/bench_attention_*.json): fewer, larger blocks win there because each
# loop step costs a few separate XLA kernels.
DEFAULT_BLOCK_Q = 512
DEFAULT_BLOCK_K = 512
# Target size of one step's float32 score block (pairs * R * block_q * block_k * 4,
# pairs = (batch row, key/value head) pairs per step). Steps walk over the pairs as
# well as over T and S, so a step's scores stay in the CPU's caches: measured at
# d_model 768, T 512, forward+backward, 4 MiB steps (4 heads) against all heads at
# once: h = 8 129 -> 125 ms, h = 96 508 -> 179 ms; 1 MiB and 16 MiB steps slower.
STEP_BYTES = 4 * 2**20


def _largest_divisor(n: int, at_most: int) -> int:
  return max(d for d in range(1, min(n, max(at_most, 1)) + 1) if n % d == 0)


def choose_blocks(b: int, g: int, r: int, t: int, s: int, block_q: int | None = None,
                  block_k: int | None = None, block_heads: int | None = None
                  ) -> tuple[int, int, int, int]:
  """(block_q, block_k, batch rows per step, kv heads per step); given values win.

  b, g, r: batch, key/value heads, query heads per key/value head (H = G * R).
  Key blocks are min(S, 512); query blocks min(T, 512), halved (down to 32) while one
  key/value head's float32 block R * block_q * block_k * 4 exceeds STEP_BYTES. A step
  then takes as many (batch row, kv head) pairs as fit in STEP_BYTES (or
  block_heads pairs): kv heads of one batch row first, then whole batch rows; counts
  round down to divisors of G and B.
  """
  for name, val in (("block_q", block_q), ("block_k", block_k),
                    ("block_heads", block_heads)):
    if val is not None and (not isinstance(val, (int, np.integer)) or isinstance(val, bool)
                            or val < 1):
      raise ValueError(f"{name} must be a positive integer or None; got {val!r}")
  bk = int(block_k) if block_k is not None else min(s, DEFAULT_BLOCK_K)
  if block_q is not None:
    bq = int(block_q)
  else:
    bq = min(t, DEFAULT_BLOCK_Q)
    while bq > 32 and r * bq * bk * 4 > STEP_BYTES:
      bq //= 2
  bq, bk = max(1, min(bq, t)), max(1, min(bk, s))
  pairs = (int(block_heads) if block_heads is not None
           else max(1, STEP_BYTES // (r * bq * bk * 4)))
  if pairs >= b * g:
    return bq, bk, b, g
  if pairs >= g:
    return bq, bk, _largest_divisor(b, pairs // g), g
  return bq, bk, 1, _largest_divisor(g, pairs)


def _to_blocks(x, n, blk, axis):
  """Pads `axis` to n * blk and splits it into (n, blk); n moves to the front."""
  pad = n * blk - x.shape[axis]
  if pad:
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, pad)
    x = jnp.pad(x, widths)
  x = x.reshape(x.shape[:axis] + (n, blk) + x.shape[axis + 1:])
  return jnp.moveaxis(x, axis, 0)


def _block_extra(arr, b, g, r, t, s, nq, nk, bq, bk):
  """(B|1, H|1, T|1, S|1) -> (nq|1, nk|1, B|1, G|1, R|1, bq|1, bk|1) blocks."""
  if arr is None:
    return None
  ab, ah, at, as_ = arr.shape
  if ah == 1:
    arr = arr.reshape(ab, 1, 1, at, as_)
  else:
    arr = arr.reshape(ab, g, r, at, as_)
  # Axes: (B, G, R, T, S). Split S then T; keep singletons as blocks of one.
  if as_ > 1:
    arr = _to_blocks(arr, nk, bk, 4)              # (nk, B, G, R, T, bk)
  else:
    arr = arr[None]
  if at > 1:
    arr = _to_blocks(arr, nq, bq, 4)              # (nq, nk, B, G, R, bq, bk)
  else:
    arr = arr[None]
  return arr


def _pick(arr, i, j):
  """Block (i, j) of a blocked extra array; singleton block axes broadcast."""
  ii = i if arr.shape[0] > 1 else 0
  jj = j if arr.shape[1] > 1 else 0
  return jax.lax.dynamic_index_in_dim(
      jax.lax.dynamic_index_in_dim(arr, ii, 0, keepdims=False), jj, 0, keepdims=False)


class _Static(NamedTuple):
  """Shapes of the call; _step_static's copy has one step's b, h and g."""
  b: int        # batch rows
  t: int
  s: int
  h: int        # query heads
  g: int        # key/value heads
  bq: int
  bk: int
  nq: int
  nk: int
  scale: float
  causal: bool
  nbc: int = 1  # steps along B
  ngc: int = 1  # steps along G
  softcap: float | None = None   # scores -> softcap * tanh(scores / softcap)
  window: int | None = None      # query i reads key j only when i - j < window
  sigmoid_bias: float | None = None   # weights sigmoid(scores + b), no normalisation
  sink: bool = False             # one more logit per head in the softmax's denominator


def _step_start(st, c) -> tuple:
  """(first batch row, first kv head) of step c; st is the call's _Static."""
  return (c // st.ngc) * (st.b // st.nbc), (c % st.ngc) * (st.g // st.ngc)


def _step_extra(arr, st, c, axis_b, axis_g):
  """The part of a blocked extra array (or table) that step c's pairs see."""
  if arr is None:
    return None
  starts = dict(zip((axis_b, axis_g), _step_start(st, c)))
  sizes = {axis_b: st.b // st.nbc, axis_g: st.g // st.ngc}
  for ax in (axis_b, axis_g):
    if ax is not None and arr.shape[ax] > 1:
      arr = jax.lax.dynamic_slice_in_dim(arr, starts[ax], sizes[ax], ax)
  return arr


def _step_add(full, part, st, c, axis_b, axis_g):
  """full with step c's gradient `part` added where _step_extra took it from."""
  if full is None:
    return None
  starts = dict(zip((axis_b, axis_g), _step_start(st, c)))
  start = [starts[ax] if ax in (axis_b, axis_g) and ax is not None and full.shape[ax] > 1
           else 0 for ax in range(full.ndim)]
  cur = jax.lax.dynamic_slice(full, start, part.shape)
  return jax.lax.dynamic_update_slice(full, cur + part, start)


def _block_logits(st, q_i, k_j, i, j, mask_bl, bias_bl, table_GRO):
  """Scores of query block i against key block j, and where they may attend.

  Returns s (B, G, R, bq, bk) float32 (soft-capped, then bias added), ok (bool,
  broadcastable) and the soft-cap's derivative 1 - tanh^2 (None without a cap).
  """
  r = st.h // st.g
  s_ = jnp.einsum("bgmk,bgsk->bgms", q_i, k_j, preferred_element_type=jnp.float32)
  s_ = s_.reshape(st.b, st.g, r, st.bq, st.bk)
  dcap = None
  if st.softcap is not None:
    s_ = soft_cap(s_, st.softcap)
    dcap = 1.0 - jnp.square(s_ / st.softcap)
  qpos = i * st.bq + jnp.arange(st.bq)[:, None]
  kpos = j * st.bk + jnp.arange(st.bk)[None, :]
  ok = None
  if st.s % st.bk:
    ok = kpos < st.s
  if st.causal:
    c = kpos <= qpos
    ok = c if ok is None else ok & c
  if st.window is not None:
    w = qpos - kpos < st.window
    ok = w if ok is None else ok & w
  if ok is not None:
    ok = jnp.broadcast_to(ok, (st.bq, st.bk))
  if mask_bl is not None:
    m = _pick(mask_bl, i, j)
    ok = m if ok is None else m & ok
  if bias_bl is not None:
    s_ = s_ + _pick(bias_bl, i, j).astype(jnp.float32)
  if table_GRO is not None:
    off = relative_index(qpos, kpos, (table_GRO.shape[-1] - 1) // 2)      # (bq, bk)
    s_ = s_ + table_GRO[:, :, off].astype(jnp.float32)[None]
  return s_, ok, dcap


def _live_k(st, i):
  """Key blocks query block i can see: all, or up to the diagonal when causal."""
  if not st.causal:
    return st.nk
  return jnp.minimum(st.nk, ((i + 1) * st.bq - 1) // st.bk + 1)


def _first_k(st, i):
  """First key block query block i can see: 0, or the window's first (keys j >
  i * bq - window)."""
  if st.window is None:
    return 0
  return jnp.maximum(0, i * st.bq - st.window + 1) // st.bk


def _first_q(st, j):
  """First query block that sees key block j (0 unless causal)."""
  if not st.causal:
    return 0
  return jnp.minimum(st.nq, (j * st.bk) // st.bq)


def _end_q(st, j):
  """One past the last query block that sees key block j: nq, or the window's end
  (queries i < (j + 1) * bk - 1 + window)."""
  if st.window is None:
    return st.nq
  return jnp.minimum(st.nq, ((j + 1) * st.bk + st.window - 2) // st.bq + 1)


def _sink_rows(st, sink_GR):
  """(1, G, M) float32: each query row's sink logit (rows are R heads x bq queries)."""
  r = st.h // st.g
  rows = jnp.broadcast_to(sink_GR.astype(jnp.float32)[:, :, None], (st.g, r, st.bq))
  return rows.reshape(1, st.g, r * st.bq)


def _forward(st, qb, kb, vb, mask_bl, bias_bl, table_GRO, sink_GR=None):
  """Online softmax over key blocks (with the sink's logit as the running maximum's
  start), or the plain sum of sigmoid weights. Returns o (nq, B, G, M, V) and
  lse (nq, B, G, M) (zeros for sigmoid)."""
  r = st.h // st.g
  m_rows = r * st.bq
  dv = vb.shape[-1]

  def one_sigmoid_block(args):
    i, q_i = args

    def body(j, acc):
      s_, ok, _ = _block_logits(st, q_i, kb[j], i, j, mask_bl, bias_bl, table_GRO)
      p = jax.nn.sigmoid(s_ + st.sigmoid_bias)
      if ok is not None:
        p = jnp.where(ok, p, 0.0)
      p = p.reshape(st.b, st.g, m_rows, st.bk)
      return acc + jnp.einsum("bgms,bgsv->bgmv", p.astype(vb.dtype), vb[j],
                              preferred_element_type=jnp.float32)

    acc = jax.lax.fori_loop(_first_k(st, i), _live_k(st, i), body,
                            jnp.zeros((st.b, st.g, m_rows, dv), jnp.float32))
    return acc, jnp.zeros((st.b, st.g, m_rows), jnp.float32)

  def one_q_block(args):
    i, q_i = args

    def body(j, carry):
      m, l, acc = carry
      s_, ok, _ = _block_logits(st, q_i, kb[j], i, j, mask_bl, bias_bl, table_GRO)
      if ok is not None:
        s_ = jnp.where(ok, s_, -jnp.inf)
      s_ = s_.reshape(st.b, st.g, m_rows, st.bk)
      m_new = jnp.maximum(m, jnp.max(s_, axis=-1))
      m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
      p = jnp.exp(s_ - m_safe[..., None])          # exp(-inf) = 0 on masked entries
      corr = jnp.exp(m - m_safe)
      l = l * corr + jnp.sum(p, axis=-1)
      acc = acc * corr[..., None] + jnp.einsum(
          "bgms,bgsv->bgmv", p.astype(vb.dtype), vb[j], preferred_element_type=jnp.float32)
      return m_new, l, acc

    if st.sink:   # the sink as a key of weight exp(c - m) and value 0
      init = (jnp.broadcast_to(_sink_rows(st, sink_GR), (st.b, st.g, m_rows)),
              jnp.ones((st.b, st.g, m_rows), jnp.float32))
    else:
      init = (jnp.full((st.b, st.g, m_rows), -jnp.inf, jnp.float32),
              jnp.zeros((st.b, st.g, m_rows), jnp.float32))
    init = init + (jnp.zeros((st.b, st.g, m_rows, dv), jnp.float32),)
    m, l, acc = jax.lax.fori_loop(_first_k(st, i), _live_k(st, i), body, init)
    live = l > 0
    o = acc / jnp.where(live, l, 1.0)[..., None]
    lse = jnp.where(live, m + jnp.log(jnp.where(live, l, 1.0)), jnp.inf)
    return o, lse

  one = one_q_block if st.sigmoid_bias is None else one_sigmoid_block
  if st.nq == 1:
    o, lse = one((0, qb[0]))
    return o[None], lse[None]
  return jax.lax.map(one, (jnp.arange(st.nq), qb))


def _backward(st, qb, kb, vb, mask_bl, bias_bl, table_GRO, delta, lse, dob):
  """Gradients for q, k, v (blocked), the bias blocks and the rel-bias table.

  delta (nq, B, G, M): rowsum(do * o), the softmax backward's row term."""
  r = st.h // st.g
  m_rows = r * st.bq
  # dk and dv are accumulated transposed, (K, bk): XLA:CPU runs q^T @ ds as a fast
  # matmul but ds^T @ q (contracting ds's rows) 3x slower (h = 96: 59 of 313 ms).
  qT = jnp.swapaxes(qb, -1, -2)       # (nq, B, G, K, M)
  doT = jnp.swapaxes(dob, -1, -2)     # (nq, B, G, V, M)

  def one_k_block(j, carry):
    dq, dbias, dtab = carry
    k_j, v_j = kb[j], vb[j]

    def body(i, inner):
      dkT_j, dvT_j, dq, dbias, dtab = inner
      q_i, do_i = qb[i], dob[i]
      s_, ok, dcap = _block_logits(st, q_i, k_j, i, j, mask_bl, bias_bl, table_GRO)
      s_ = s_.reshape(st.b, st.g, m_rows, st.bk)
      if st.sigmoid_bias is None:
        p = jnp.exp(s_ - lse[i][..., None])
      else:
        p = jax.nn.sigmoid(s_ + st.sigmoid_bias)
      if ok is not None:
        okm = jnp.broadcast_to(ok, (st.b, st.g, r, st.bq, st.bk)).reshape(p.shape)
        p = jnp.where(okm, p, 0.0)
      dvT_j = dvT_j + jnp.einsum("bgvm,bgms->bgvs", doT[i], p.astype(do_i.dtype),
                                 preferred_element_type=jnp.float32)
      dp = jnp.einsum("bgmv,bgsv->bgms", do_i, v_j, preferred_element_type=jnp.float32)
      if st.sigmoid_bias is None:
        ds = p * (dp - delta[i][..., None])        # d(capped scores + bias)
      else:
        ds = dp * p * (1.0 - p)
      dsq = ds if dcap is None else ds * dcap.reshape(ds.shape)   # d(q . k)
      dq = dq.at[i].add(jnp.einsum("bgms,bgsk->bgmk", dsq.astype(k_j.dtype), k_j,
                                   preferred_element_type=jnp.float32))
      dkT_j = dkT_j + jnp.einsum("bgkm,bgms->bgks", qT[i], dsq.astype(q_i.dtype),
                                 preferred_element_type=jnp.float32)
      ds5 = ds.reshape(st.b, st.g, r, st.bq, st.bk)
      if dbias is not None:
        shape = dbias.shape[2:]
        red = tuple(ax for ax in range(5) if shape[ax] == 1 and ds5.shape[ax] != 1)
        blk = jnp.sum(ds5, axis=red, keepdims=True)
        ii = i if dbias.shape[0] > 1 else 0
        jj = j if dbias.shape[1] > 1 else 0
        dbias = dbias.at[ii, jj].add(blk)
      if dtab is not None:
        qpos = i * st.bq + jnp.arange(st.bq)[:, None]
        kpos = j * st.bk + jnp.arange(st.bk)[None, :]
        off = relative_index(qpos, kpos, (dtab.shape[-1] - 1) // 2).reshape(-1)
        per = jnp.sum(ds5, axis=0).reshape(st.g, r, st.bq * st.bk)
        dtab = dtab.at[:, :, off].add(per)
      return dkT_j, dvT_j, dq, dbias, dtab

    init = (jnp.zeros(jnp.swapaxes(k_j, -1, -2).shape, jnp.float32),
            jnp.zeros(jnp.swapaxes(v_j, -1, -2).shape, jnp.float32), dq, dbias, dtab)
    dkT_j, dvT_j, dq, dbias, dtab = jax.lax.fori_loop(_first_q(st, j), _end_q(st, j), body,
                                                      init)
    return (dq, dbias, dtab), (jnp.swapaxes(dkT_j, -1, -2), jnp.swapaxes(dvT_j, -1, -2))

  dq0 = jnp.zeros(qb.shape, jnp.float32)
  dbias0 = None if bias_bl is None else jnp.zeros(bias_bl.shape, jnp.float32)
  dtab0 = None if table_GRO is None else jnp.zeros(table_GRO.shape, jnp.float32)
  (dq, dbias, dtab), (dk, dv) = jax.lax.scan(
      lambda c, j: one_k_block(j, c), (dq0, dbias0, dtab0), jnp.arange(st.nk))
  return dq, dk, dv, dbias, dtab


def _step_static(st):
  return st._replace(b=st.b // st.nbc, g=st.g // st.ngc, h=st.h // st.ngc)


def _rows_in(st, c, x_BTHX, n, blk, per_g):
  """Step c's rows of x (B, T, G * per_g, ...) as blocks (n, b, g, per_g * blk, ...)."""
  sc = _step_static(st)
  b0, g0 = _step_start(st, c)
  x = jax.lax.dynamic_slice_in_dim(x_BTHX, b0, sc.b, 0)
  x = jax.lax.dynamic_slice_in_dim(x, g0 * per_g, sc.g * per_g, 2)
  x = _to_blocks(x, n, blk, 1)                            # (n, b, blk, g * per_g, ...)
  x = x.reshape(n, sc.b, blk, sc.g, per_g, *x.shape[4:])
  x = jnp.moveaxis(x, 2, 4)                               # (n, b, g, per_g, blk, ...)
  return x.reshape(n, sc.b, sc.g, per_g * blk, *x.shape[5:])


def _rows_out(st, c, full_BTHX, xb, blk, per_g):
  """full with step c's blocks xb (n, b, g, per_g * blk, ...) written in (inverse of
  _rows_in)."""
  sc = _step_static(st)
  n = xb.shape[0]
  x = xb.reshape(n, sc.b, sc.g, per_g, blk, *xb.shape[4:])
  x = jnp.moveaxis(x, 4, 2)                               # (n, b, blk, g, per_g, ...)
  x = jnp.moveaxis(x, 0, 1).reshape(sc.b, n * blk, sc.g * per_g, *xb.shape[4:])
  x = x[:, :full_BTHX.shape[1]].astype(full_BTHX.dtype)
  b0, g0 = _step_start(st, c)
  start = (b0, 0, g0 * per_g) + (0,) * (full_BTHX.ndim - 3)
  return jax.lax.dynamic_update_slice(full_BTHX, x, start)


def _steps(fn, init, n_steps):
  """(carry, ys stacked over steps) of fn(carry, c) for c in range(n_steps), as
  lax.scan; one step is one plain call (no loop)."""
  if n_steps == 1:
    carry, y = fn(init, 0)
    return carry, jax.tree.map(lambda a: a[None], y)
  return jax.lax.scan(fn, init, jnp.arange(n_steps))


def _forward_steps(st, q, k, v, mask_bl, bias_bl, table_GRO, sink_GR):
  """_forward over the steps: o (B, T, H, V) in v's dtype, lse (C, nq, b, g, M)."""
  sc = _step_static(st)
  r = st.h // st.g

  def one(o, c):
    ob, lse = _forward(sc, _rows_in(st, c, q, st.nq, st.bq, r),
                       _rows_in(st, c, k, st.nk, st.bk, 1), _rows_in(st, c, v, st.nk, st.bk, 1),
                       _step_extra(mask_bl, st, c, 2, 3), _step_extra(bias_bl, st, c, 2, 3),
                       _step_extra(table_GRO, st, c, None, 0),
                       _step_extra(sink_GR, st, c, None, 0))
    return _rows_out(st, c, o, ob, st.bq, r), lse

  return _steps(one, jnp.zeros(q.shape[:3] + v.shape[3:], v.dtype), st.nbc * st.ngc)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _core(st, q, k, v, mask_bl, bias_bl, table_GRO, sink_GR):
  return _forward_steps(st, q, k, v, mask_bl, bias_bl, table_GRO, sink_GR)[0]


def _core_fwd(st, q, k, v, mask_bl, bias_bl, table_GRO, sink_GR):
  o, lse = _forward_steps(st, q, k, v, mask_bl, bias_bl, table_GRO, sink_GR)
  return o, (q, k, v, mask_bl, bias_bl, table_GRO, sink_GR, o, lse)


def _sink_grad(st, sink_GR, lse, delta_rows):
  """d loss / d sink (g, R) of one step: -sum over rows of the sink's weight
  exp(c - lse) times delta (its value is 0, so only the normaliser moves)."""
  sc = _step_static(st)
  r = st.h // st.g
  w = jnp.exp(_sink_rows(sc, sink_GR)[None] - lse)          # (nq, b, g, M)
  per = -jnp.sum(w * delta_rows, axis=(0, 1)).reshape(sc.g, r, sc.bq)
  return jnp.sum(per, axis=-1)


def _core_bwd(st, res, do):
  q, k, v, mask_bl, bias_bl, table_GRO, sink_GR, o, lse = res
  sc = _step_static(st)
  r = st.h // st.g
  # rowsum(do * o) (B, T, H) for every step at once, as a matrix-vector product:
  # written as a sum, XLA:CPU fused it into a matmul (the dp matmul inside the loop,
  # the W_O backward outside) and ran that matmul at half speed (h = 8: 12 ms of 130).
  delta = jnp.einsum("...v,v->...", do.astype(jnp.float32) * o.astype(jnp.float32),
                     jnp.ones(do.shape[-1], jnp.float32))

  def one(carry, c):
    dq, dk, dv, dbias, dtab, dsink = carry
    delta_c = _rows_in(st, c, delta, st.nq, st.bq, r)
    dq_c, dk_c, dv_c, db, dt = _backward(
        sc, _rows_in(st, c, q, st.nq, st.bq, r), _rows_in(st, c, k, st.nk, st.bk, 1),
        _rows_in(st, c, v, st.nk, st.bk, 1), _step_extra(mask_bl, st, c, 2, 3),
        _step_extra(bias_bl, st, c, 2, 3), _step_extra(table_GRO, st, c, None, 0),
        delta_c, lse[c], _rows_in(st, c, do, st.nq, st.bq, r))
    if dsink is not None:
      dsink = _step_add(dsink, _sink_grad(st, _step_extra(sink_GR, st, c, None, 0), lse[c],
                                          delta_c), st, c, None, 0)
    return (_rows_out(st, c, dq, dq_c, st.bq, r), _rows_out(st, c, dk, dk_c, st.bk, 1),
            _rows_out(st, c, dv, dv_c, st.bk, 1), _step_add(dbias, db, st, c, 2, 3),
            _step_add(dtab, dt, st, c, None, 0), dsink), None

  init = tuple(None if a is None else jnp.zeros(a.shape, jnp.float32 if i > 2 else a.dtype)
               for i, a in enumerate((q, k, v, bias_bl, table_GRO, sink_GR)))
  (dq, dk, dv, dbias, dtab, dsink), _ = _steps(one, init, st.nbc * st.ngc)
  # q was scaled before the kernel; the chain rule through the scale happens outside.
  return (dq, dk, dv, None, None if dbias is None else dbias.astype(bias_bl.dtype),
          None if dtab is None else dtab.astype(table_GRO.dtype),
          None if dsink is None else dsink.astype(sink_GR.dtype))


_core.defvjp(_core_fwd, _core_bwd)


def _check_extra(name, arr, b, h, t, s):
  if arr is None:
    return None
  arr = jnp.asarray(arr)
  if arr.ndim == 2:
    arr = arr[None, None]
  if arr.ndim != 4 or any(got not in (1, want) for got, want in zip(arr.shape, (b, h, t, s))):
    raise ValueError(f"{name} of shape {arr.shape} does not broadcast to (B, H, T, S) = "
                     f"{(b, h, t, s)}")
  return arr


def _on_mesh(local, mesh, free, split, q, k, v, mask, bias, rel_bias_HR, sink_H):
  """local(q, k, v, mask, bias, rel_bias_HR=, sink_H=) inside shard_map over `mesh`:
  batch rows and heads as shard_specs says (masks and biases split where they are
  full-size), so that no loop of the kernel slices a sharded axis (XLA would gather it
  whole onto every device and run every device's rows on each)."""
  batch, heads, repeat = split
  b, h = q.shape[0], q.shape[2]
  if repeat:
    k, v = (jnp.repeat(x, h // x.shape[2], axis=2) for x in (k, v))
  qkv = P(batch, None, heads, None)
  full = lambda x: P(batch if x.shape[0] == b and b > 1 else None,
                     heads if x.shape[1] == h and h > 1 else None, None, None)
  opt = {"mask": (mask, full), "bias": (bias, full),
         "rel_bias_HR": (rel_bias_HR, lambda _: P(heads, None)),
         "sink_H": (sink_H, lambda _: P(heads))}
  names = [n for n, (x, _) in opt.items() if x is not None]

  def inner(q, k, v, *rest):
    got = dict(zip(names, rest))
    return local(q, k, v, got.get("mask"), got.get("bias"),
                 rel_bias_HR=got.get("rel_bias_HR"), sink_H=got.get("sink_H"))

  args = [jnp.asarray(opt[n][0]) for n in names]
  specs = (qkv, qkv, qkv) + tuple(opt[n][1](a) for n, a in zip(names, args))
  # check_vma=False: the loops' carries start unvarying; the transpose then psums the
  # gradients of what a shard saw whole (the table, the sink, a broadcast bias).
  return jax.shard_map(inner, mesh=mesh, in_specs=specs, out_specs=qkv,
                       axis_names=set(free), check_vma=False)(q, k, v, *args)


def blocked_attention(q_BTHK: jax.Array, k_BSHK: jax.Array, v_BSHK: jax.Array,
                      mask_BHTS: jax.Array | None = None,
                      bias_BHTS: jax.Array | None = None, *, causal: bool = False,
                      rel_bias_HR: jax.Array | None = None, scale: float | None = None,
                      block_q: int | None = None, block_k: int | None = None,
                      block_heads: int | None = None, softcap: float | None = None,
                      window: int | None = None, sigmoid_bias: float | None = None,
                      sink_H: jax.Array | None = None, mesh=None) -> jax.Array:
  """Attention output without the (T, S) weights, in O(T + S) memory.

  Args:
    q_BTHK: queries (B, T, H, K).
    k_BSHK: keys (B, S, G, K), G dividing H (grouped-query attention).
    v_BSHK: values (B, S, G, V).
    mask_BHTS: boolean, True = may attend; (B|1, H|1, T|1, S|1) or (T, S).
    bias_BHTS: float, added to the scaled scores; (B|1, H|1, T|1, S|1) or (T, S).
      A full (T, S) bias is itself O(T * S): prefer rel_bias_HR for positions.
    causal: key j may be seen by query i only when j <= i (top-left aligned);
      key blocks above the diagonal are skipped.
    rel_bias_HR: (H, 2R + 1) table, bias table[h, R + clip(j - i, -R, R)] built per
      block from the offsets.
    scale: multiplies q . k; None means 1 / sqrt(K).
    block_q, block_k: block sizes; None chooses them from the shapes (choose_blocks).
    block_heads: (batch row, kv head) pairs per step; None chooses (choose_blocks).
    softcap: attention-logit soft-capping (Gemma 2): the scaled scores become
      softcap * tanh(scores / softcap) before the bias.
    window: a sliding window: query i reads key j only when i - j < window; key
      blocks wholly outside it are skipped (forward and backward), so the cost grows
      with T * window rather than T * S.
    sigmoid_bias: sigmoid attention: the weights are sigmoid(scores + sigmoid_bias),
      not normalised over the keys (a plain blocked sum; no log-sum-exp).
    sink_H: (H,) one logit per head in the softmax's denominator, mixing no value (the
      running maximum starts at it); not with sigmoid_bias.
    mesh: a Mesh or AbstractMesh to run on; None: the mesh in context (jax.set_mesh),
      if any. On a mesh of more than one device the kernel runs inside shard_map
      (shard_specs): each device blocks its own batch rows and heads.

  Returns:
    o_BTHK: (B, T, H, V) in v's dtype. Differentiable in q, k, v, bias, the table and
    the sink logits.
  """
  for name, x in (("q_BTHK", q_BTHK), ("k_BSHK", k_BSHK), ("v_BSHK", v_BSHK)):
    if not hasattr(x, "ndim") or x.ndim != 4:
      raise ValueError(f"{name} must be a rank-4 array; got shape {getattr(x, 'shape', x)}")
  b, t, h, dk = q_BTHK.shape
  bk_, s, g, dk2 = k_BSHK.shape
  if v_BSHK.shape[:3] != k_BSHK.shape[:3]:
    raise ValueError(f"v_BSHK {v_BSHK.shape} and k_BSHK {k_BSHK.shape} must agree on "
                     f"(B, S, G)")
  if dk2 != dk or bk_ != b:
    raise ValueError(f"q_BTHK {q_BTHK.shape} and k_BSHK {k_BSHK.shape} must agree on B and K")
  if g < 1 or h % g:
    raise ValueError(f"key/value heads G={g} must divide query heads H={h} "
                     f"(k_BSHK shape {k_BSHK.shape})")
  if not isinstance(causal, (bool, np.bool_)):
    raise ValueError(f"causal must be a bool; got {causal!r}")
  mask = _check_extra("mask_BHTS", mask_BHTS, b, h, t, s)
  if mask is not None and mask.dtype != jnp.bool_:
    raise ValueError(f"mask_BHTS must be boolean (True = may attend); got dtype {mask.dtype}")
  bias = _check_extra("bias_BHTS", bias_BHTS, b, h, t, s)
  if rel_bias_HR is not None:
    rel_bias_HR = jnp.asarray(rel_bias_HR)
    if rel_bias_HR.ndim != 2 or rel_bias_HR.shape[0] != h or rel_bias_HR.shape[1] % 2 != 1:
      raise ValueError(f"rel_bias_HR must have shape (H, 2R + 1) = ({h}, odd); got "
                       f"{rel_bias_HR.shape}")
  r = h // g
  bq, bk, cb, cg = choose_blocks(b, g, r, t, s, block_q, block_k, block_heads)
  nq, nk = -(-t // bq), -(-s // bk)
  nbc, ngc = b // cb, g // cg
  if scale is None:
    scale = 1.0 / math.sqrt(dk)
  for name, num in (("softcap", softcap), ("window", window)):
    if num is not None and (isinstance(num, bool) or not isinstance(
        num, (int, float, np.number)) or not num > 0):
      raise ValueError(f"{name} must be a positive number or None; got {num!r}")
  if window is not None and int(window) != window:
    raise ValueError(f"window must be a positive integer or None; got {window!r}")
  if sigmoid_bias is not None and sink_H is not None:
    raise ValueError("sigmoid_bias (sigmoid attention) and sink_H (a softmax's sink "
                     "logit) exclude each other")
  if sink_H is not None and tuple(jnp.shape(sink_H)) != (h,):
    raise ValueError(f"sink_H must have shape (H,) = ({h},); got {jnp.shape(sink_H)}")
  mesh, free = target_lib.mesh_axes(mesh)
  split = target_lib.shard_specs(dict(mesh.shape), free, b, h, g) if free else (None, None, False)
  if split[:2] != (None, None):
    local = functools.partial(
        blocked_attention, causal=causal, scale=scale, block_q=block_q, block_k=block_k,
        block_heads=block_heads, softcap=softcap, window=window,
        sigmoid_bias=sigmoid_bias)
    return _on_mesh(local, mesh, free, split, q_BTHK, k_BSHK, v_BSHK, mask, bias,
                    rel_bias_HR, sink_H)
  k_BSHK, v_BSHK = drop_masked_keys(k_BSHK, v_BSHK, mask)
  st = _Static(b, t, s, h, g, bq, bk, nq, nk, float(scale), bool(causal), nbc, ngc,
               None if softcap is None else float(softcap),
               None if window is None else int(window),
               None if sigmoid_bias is None else float(sigmoid_bias), sink_H is not None)

  # Steps C = nbc * ngc, each over cb batch rows and cg kv heads, slice q, k, v where
  # they lie and cut their slices into blocks (M = R * bq rows of queries per kv head).
  qs = q_BTHK * jnp.asarray(scale, q_BTHK.dtype)
  mask_bl = _block_extra(mask, b, g, r, t, s, nq, nk, bq, bk)
  bias_bl = _block_extra(bias, b, g, r, t, s, nq, nk, bq, bk)
  table = None if rel_bias_HR is None else rel_bias_HR.reshape(g, r, -1)
  sink_GR = None if sink_H is None else jnp.asarray(sink_H).reshape(g, r)
  return _core(st, qs, k_BSHK, v_BSHK, mask_bl, bias_bl, table, sink_GR)
