"""The public function: multi_head_attention, the seven lines in order.

Its arguments are checked here (check_call, each refused by name), then it runs
params.py (line 1, the projections), heads.py (line 2: heads, QK-norm, RoPE, cache),
scores.py (lines 3-5: the kernel) and mixing.py (lines 6-7: gates and W_O).
"""

from __future__ import annotations

import math
from typing import Any, Mapping

import chex
import jax
import jax.numpy as jnp
import numpy as np

from mha_jax import attention_variants as variants
from mha_jax.attention.heads import (RoPE, check_cache, check_positions, prepare_qkv,
                                     write_cache)
from mha_jax.attention.mixing import AttentionOutput, output, zero_heads
from mha_jax.attention.params import (Call, Params, check_attention_params, mla_inputs,
                                      num_kv_heads_of)
from mha_jax.attention.scores import IMPLS, attend
from mha_jax.blocks import check_rank

def _check_4d(name: str, arr: jax.Array, b: int, h: int, t: int, s: int) -> jax.Array:
  """(T, S) -> (1, 1, T, S); refuses what does not broadcast to (B, H, T, S)."""
  if arr.ndim == 2:
    arr = arr[None, None]
  if arr.ndim != 4:
    raise ValueError(f"{name} must have rank 4 (B, H, T, S) or rank 2 (T, S); got shape "
                     f"{arr.shape}. For a per-example (B, T, S) {name} pass {name}[:, None]")
  for got, want, letter in zip(arr.shape, (b, h, t, s), "BHTS"):
    if got not in (1, want):
      raise ValueError(f"{name} of shape {arr.shape} does not broadcast to (B, H, T, S) = "
                       f"{(b, h, t, s)}: its {letter} dimension is {got}")
  return arr


def _check_float(name: str, arr: Any) -> None:
  if not jnp.issubdtype(arr.dtype, jnp.floating):
    raise ValueError(f"{name} must be a float array (embeddings, not token ids); got dtype "
                     f"{arr.dtype}")


def _check_mask(mask: Any, b: int, h: int, t: int, s: int) -> jax.Array:
  mask = jnp.asarray(mask)
  if mask.dtype != jnp.bool_:
    raise ValueError(f"mask must be boolean (True = may attend); got dtype {mask.dtype}")
  return _check_4d("mask", mask, b, h, t, s)


def _check_bias(bias: Any, b: int, h: int, t: int, s: int) -> jax.Array:
  bias = jnp.asarray(bias)
  if not jnp.issubdtype(bias.dtype, jnp.floating):
    raise ValueError(f"bias must be a float array added to the scores; got dtype {bias.dtype}")
  return _check_4d("bias", bias, b, h, t, s)


def _check_gates(head_gates: Any, b: int, h: int) -> jax.Array:
  g = jnp.asarray(head_gates)
  if g.ndim == 1 and g.shape[0] == h:
    return g[None, None, :, None]
  if g.ndim == 2 and g.shape == (b, h):
    return g[:, None, :, None]
  raise ValueError(f"head_gates must have shape (H,) = ({h},) or (B, H) = ({b}, {h}); "
                   f"got {g.shape}")


def _check_inputs(x, context, value_input, d: int):
  """(keys' input, values' input) after checking x, context and value_input."""
  check_rank("x", x, 3, "B, T, D")
  _check_float("x", x)
  if context is not None:
    check_rank("context", context, 3, "B, S, D")
    _check_float("context", context)
  ctx = x if context is None else context
  if x.shape[-1] != d:
    raise ValueError(f"x has d_model={x.shape[-1]} (shape {x.shape}) but params['wq'] "
                     f"expects D={d}")
  if ctx.shape[-1] != d:
    raise ValueError(f"context has d_model={ctx.shape[-1]} (shape {ctx.shape}) but "
                     f"params['wk'] expects D={d}")
  if ctx.shape[0] != x.shape[0]:
    raise ValueError(f"context batch {ctx.shape[0]} differs from x batch {x.shape[0]}")
  val = ctx if value_input is None else value_input
  if value_input is not None and (not hasattr(val, "shape") or val.shape != ctx.shape):
    raise ValueError(f"value_input must have the keys' input shape {tuple(ctx.shape)}; "
                     f"got {getattr(val, 'shape', val)}")
  if value_input is not None:
    _check_float("value_input", value_input)
  return ctx, val


def _check_options(impl, window, scale, softcap, rope, positions, kv_positions, context,
                   variant, sigmoid_bias) -> None:
  if impl not in IMPLS:
    raise ValueError(f"impl must be one of {IMPLS}; got {impl!r}")
  if window is not None and (isinstance(window, bool) or not isinstance(
      window, (int, np.integer)) or window < 1):
    raise ValueError(f"window must be a positive integer or None; got {window!r}")
  for name, num in (("scale", scale), ("softcap", softcap)):
    if num is not None and (isinstance(num, bool) or not isinstance(
        num, (int, float, np.number)) or not num > 0):
      raise ValueError(f"{name} must be a positive number or None; got {num!r}")
  if rope is not None and not isinstance(rope, RoPE):
    raise ValueError(f"rope must be an attention.RoPE or None; got {rope!r}")
  if rope is None and (positions is not None or kv_positions is not None):
    raise ValueError("positions and kv_positions only place the rotary embedding; pass "
                     "rope=attention.RoPE(...) with them")
  if kv_positions is not None and context is None:
    raise ValueError("kv_positions are for cross-attention (with context); in "
                     "self-attention the keys use the queries' positions")
  if sigmoid_bias is not None and "sigmoid_bias" not in variant.options:
    takers = [n for n in variants.NAMES if "sigmoid_bias" in variants.get(n).options]
    raise ValueError(f"sigmoid_bias is an option of variant {' or '.join(takers)}; got it "
                     f"with variant={variant.name!r}")
  if sigmoid_bias is not None and (isinstance(sigmoid_bias, bool) or not isinstance(
      sigmoid_bias, (int, float, np.number)) or not math.isfinite(sigmoid_bias)):
    raise ValueError(f"sigmoid_bias must be a finite number or None; got {sigmoid_bias!r}")


def _check_call(params, x, context, value_input, mask, causal, bias, head_gates, impl,
                rope, positions, kv_positions, cache, window, scale, softcap, variant,
                sigmoid_bias, layer) -> Call:
  """Every argument of multi_head_attention checked, bad ones refused by name."""
  var = variants.get(variant)
  d, h, k = check_attention_params(params, var.name)
  ctx, val = _check_inputs(x, context, value_input, d)
  if not isinstance(causal, (bool, np.bool_)):
    raise ValueError(f"causal must be a bool; got {causal!r}")
  b, t, _ = x.shape
  s = ctx.shape[1]
  g = num_kv_heads_of(params)
  length = 0
  if cache is not None:
    if context is not None or value_input is not None:
      raise ValueError("cache is for self-attention (decoding); got it together with "
                       "context or value_input")
    s, length = check_cache(cache, b, g, k, t, params["wv"].shape[2])
  if mask is not None:
    mask = _check_mask(mask, b, h, t, s)
  gates = None if head_gates is None else _check_gates(head_gates, b, h)
  if bias is not None:
    bias = _check_bias(bias, b, h, t, s)
  _check_options(impl, window, scale, softcap, rope, positions, kv_positions, context,
                 var, sigmoid_bias)
  if isinstance(layer, bool) or not isinstance(layer, (int, np.integer)) or layer < 0:
    raise ValueError(f"layer must be an integer >= 0; got {layer!r}")
  q_pos = k_pos = None
  if rope is not None:
    rope.rotated_dim(k // var.maps)
    q_pos = (length + jnp.arange(t)[None] if positions is None
             else check_positions("positions", positions, b, t))
    if context is None:
      k_pos = q_pos
    else:
      k_pos = (jnp.arange(s)[None] if kv_positions is None
               else check_positions("kv_positions", kv_positions, b, s, "S"))
  return Call(d, h, k, g, b, t, s, ctx, val, length, mask, bias, gates, q_pos, k_pos, var,
              sigmoid_bias, int(layer))


def _check_head_inputs(inputs, q_shape, kv_shape, context, params) -> None:
  if context is not None or "wq_rest" in params or "wk_rest" in params:
    raise ValueError("head_inputs are for self-attention without removed heads' QK-norm "
                     "statistics")
  if not isinstance(inputs, (tuple, list)) or len(inputs) != 3:
    raise ValueError("head_inputs must be (q (B, T, H, D), k (B, S, G, D), v (B, S, G, D))")
  for name, arr, shape in zip("qkv", inputs, (q_shape, kv_shape, kv_shape)):
    if tuple(arr.shape) != shape:
      raise ValueError(f"head_inputs {name} must have shape {shape}; got {tuple(arr.shape)}")


def multi_head_attention(params: Params, x: jax.Array, context: jax.Array | None = None, *,
                         value_input: jax.Array | None = None,
                         mask: jax.Array | None = None, causal: bool = False,
                         bias: jax.Array | None = None,
                         head_gates: jax.Array | None = None, impl: str = "auto",
                         return_weights: bool = False, rope: RoPE | None = None,
                         positions: jax.Array | None = None,
                         kv_positions: jax.Array | None = None,
                         cache: Mapping[str, jax.Array] | None = None,
                         window: int | None = None, scale: float | None = None,
                         softcap: float | None = None, qk_norm_eps: float = 1e-6,
                         variant: str = "softmax", sigmoid_bias: float | None = None,
                         layer: int = 0, site: Any = None, head_inputs: Any = None):
  """Multi-head attention of x over itself, or over `context` (cross-attention).

  Args:
    params: {"wq": (D, H, K), "wk": (D, G, K), "wv": (D, G, V), "wo": (H, V, D)},
      optional {"bq": (H, K), "bk": (G, K), "bv": (G, V), "bo": (D,)}, optional
      "rel_bias" (H, 2R + 1) or "alibi" (H,). V, the value heads' width, is K unless
      the model says otherwise (DeepSeek's MLA); V != K runs on the reference and
      blocked kernels (auto picks among them) and not with gated / differential.
      H, G and K are read from the shapes; G (key/value heads) divides H, and query
      head i reads key/value head i // (H // G) (grouped-query attention).
    x: (B, T, D) queries' input.
    context: (B, S, D) keys' and values' input; None means x (self-attention).
    value_input: (B, S, D) values' input when it differs from the keys' (e.g. positions
      in Q and K only, as in Shortformer); None means context.
    mask: boolean, True = may attend; (B|1, H|1, T|1, S|1) or (T, S). H is per
      query head, as are bias, head_gates and the returned weights and heads.
    causal: also forbid attending to later positions (key j > query i).
    bias: float, added to the scaled scores before the softmax; (B|1, H|1, T|1, S|1)
      or (T, S) (e.g. ALiBi). A params["rel_bias"] table adds its relative-position
      bias on top.
    head_gates: (H,) or (B, H); multiplies each head's output before W_O.
    impl: "reference" (explicit weights), "xla" (jax.nn.dot_product_attention),
      "cudnn" (GPU, bf16/f16), "blocked" (flash-style, pure JAX, O(T) memory),
      "pallas" (Pallas flash kernels on GPU/TPU), or "auto": reference when weights
      are asked for, else the fastest that can serve the call on this backend and
      never one whose scores would not fit in memory (mha_jax/kernels/dispatch.py).
    return_weights: also return the weights and the per-head outputs.
    rope: a RoPE: rotary position embedding of q and k after their projections and
      biases (values are not rotated). None: no rotation.
    positions: integer absolute positions of the queries, (B, T) or (T,); default
      arange(T). Only with rope. In self-attention the keys use them too.
    kv_positions: integer positions of the keys with `context`, (B, S) or (S,);
      default arange(S). Only with rope and context.
    cache: a KV cache from init_kv_cache (self-attention only). x's keys and values
      (rotated at positions, default length + arange(T)) are written at
      [length, length + T); the T queries attend over the whole cache: key slot j
      counts when j < length + T and, with causal, when j <= length + i. mask and
      bias then have S = S_max (e.g. a prompt's padding). Works under jit with a
      traced length; a write past S_max raises when length is concrete and gives NaN
      outputs when it is traced.
    window: a sliding window (Mistral, Gemma 2/3): query i may read key j only when
      i - j < window (in slots: with a cache, the query's slot is length + i), on top
      of mask and causal. Every kernel serves it: blocked skips the key blocks wholly
      outside it (cost ~ T * window), the others read it as a boolean band mask.
    scale: multiplies the dot products q . k; None means 1 / sqrt(K) (Gemma's
      query_pre_attn_scalar ** -0.5, GPT-2's 1 / (sqrt(K) * (layer + 1)) differ).
    softcap: attention-logit soft-capping (Gemma 2): the scaled scores become
      softcap * tanh(scores / softcap) before bias and mask. Served by reference,
      blocked and xla (which then runs the building blocks: jax.nn's fused attention
      takes no cap), pallas through TPU splash only; cudnn refuses it.
    qk_norm_eps: epsilon of the QK-norm when params hold "q_norm" / "k_norm" (RMSNorm of
      each head's query and key, scale (K,), or of the whole projection, scale (H, K)
      and (G, K)), applied after the projections' biases and before RoPE.
    variant: one of VARIANTS (mha_jax/attention_variants.py gives each one's equation):
      "softmax" (the default), "gated", "gated_head", "differential", "sigmoid",
      "sink", "qk_norm"; params must hold that variant's params
      (init_attention_params(..., variant=...)). differential, sigmoid and sink run in
      the reference and blocked kernels only (auto picks among those; the others
      refuse them by name); the rest in every kernel. With return_weights, weights are
      the sigmoid weights (sigmoid), the keys' softmax weights summing to 1 minus the
      sink's (sink), the first map (differential).
    sigmoid_bias: b of variant="sigmoid"; None means -log(S), S the number of key
      positions of the call (with a cache, S_max: pass b to decode as the model was
      trained).
    layer: the layer's index from 0, read by variant="differential" only:
      lambda_init = 0.8 - 0.6 exp(-0.3 layer) (diff_lambda_init).
    site: None, or a hook (mha_jax/interventions.py; the core imports nothing for it):
      an object with `site(name, x) -> x` and `site.wants(name) -> bool`. It is called
      with "k", "v" (B, S, G, K) and "q" (B, T, H, K) after their biases and RoPE;
      "k_q", "v_q" (B, S, H, K), the keys and values as each query head reads them
      (repeat_kv order), only when wanted (the rest then runs with G = H); "pattern"
      (B, H, T, S), only when wanted (it forces the reference kernel; an edited pattern
      is what mixes the values); by variant, also only when wanted: "pattern2"
      (B, H, T, S) differential's second map, "sink_weight" (B, H, T) the sink's
      weight (an edit rescales the pattern's row to 1 minus it), both forcing the
      reference kernel, and "gate" (B, T, H, K) (gated) or (B, T, H) (gated_head) the
      sigmoid gate; "z" (B, T, H, K) after the gates; "result"
      (B, T, H, D), each head's output after W_O, only when wanted (the layer's output
      is then their sum plus bo). Whatever it returns flows on.
    head_inputs: None, or (q (B, T, H, D), k (B, S, G, D), v (B, S, G, D)): each head's
      own input to its projection in place of x / context / value_input (edge patching:
      every head reads its own residual); self-attention (with a cache: the T new
      tokens' inputs, S = T).

  Returns:
    y_BTD (B, T, D), or AttentionOutput(out, weights (B, H, T, S), heads (B, T, H, K))
    when return_weights is True. With a cache: (that, new_cache), new_cache's length
    being length + T, and S = S_max.
  """
  c = _check_call(params, x, context, value_input, mask, causal, bias, head_gates, impl,
                  rope, positions, kv_positions, cache, window, scale, softcap, variant,
                  sigmoid_bias, layer)
  if c.h == 0 and cache is None:
    return zero_heads(params, x, c, site, return_weights)
  if head_inputs is not None:    # edge patching: each head reads its own input
    _check_head_inputs(head_inputs, (c.b, c.t, c.h, c.d),   # with a cache: the T new keys
                       (c.b, c.t if cache is not None else c.s, c.g, c.d), context, params)
    x = head_inputs[0]
    c = c._replace(ctx=head_inputs[1], val=head_inputs[2])
  x_q = x
  if "wkv_a" in params:
    x_q, ctx, val = mla_inputs(params, x, c.ctx, c.val)
    c = c._replace(ctx=ctx, val=val)
  q_BTHK, k_BSGK, v_BSGK, gate_BTHK = prepare_qkv(params, x_q, c, rope, qk_norm_eps, site)
  mask, new_cache = c.mask, None
  if cache is not None:
    k_BSGK, v_BSGK, mask, causal, new_cache = write_cache(cache, k_BSGK, v_BSGK, c, causal,
                                                           window)
  # Without a cache, a window goes to the kernels that skip the blocks outside it
  # (TAKES_WINDOW); the others get it as a band mask once the kernel is known.

  def finish(result):
    return result if new_cache is None else (result, new_cache)

  if c.h == 0:  # still keeps the cache up to date (the keys are the kv heads')
    return finish(zero_heads(params, x, c, site, return_weights))
  o_BTHK, w_BHTS = attend(params, q_BTHK, k_BSGK, v_BSGK, c, mask, causal, impl,
                           return_weights, window, scale, softcap, site,
                           cached=new_cache is not None)
  y_BTD, o_BTHK = output(params, x, o_BTHK, gate_BTHK, c, site)
  if new_cache is not None:  # a write past S_max (traced length) poisons the output
    y_BTD = jnp.where(c.length + c.t <= c.s, y_BTD, jnp.nan)
  chex.assert_shape(y_BTD, (c.b, c.t, c.d))
  chex.assert_shape(o_BTHK, (c.b, c.t, c.h, params["wv"].shape[2]))
  if return_weights:
    return finish(AttentionOutput(y_BTD, w_BHTS, o_BTHK))
  return finish(y_BTD)
