"""Pieces shared by the models: layer norm, MLP, embeddings, head gates, stack names.

Models are pure functions over plain nested dicts. Attention blocks live at stable
paths, and a head is named "stack.layer.head":

  stack           param path                          model
  encoder         encoder/layer_{i}/self_attn/...     seq2seq
  decoder_self    decoder/layer_{i}/self_attn/...     seq2seq
  decoder_cross   decoder/layer_{i}/cross_attn/...    seq2seq
  lm              lm/layer_{i}/attn/...               decoder-only LM
"""

from __future__ import annotations

import dataclasses
import math
from typing import Iterator, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from mha_jax import attention
from mha_jax import interventions
from mha_jax.data.vocab import PAD_ID
from mha_jax.errors import UserError

STACKS = {"encoder": ("encoder", "self_attn"), "decoder_self": ("decoder", "self_attn"),
          "decoder_cross": ("decoder", "cross_attn"), "lm": ("lm", "attn")}


@dataclasses.dataclass(frozen=True)
class ModelSpec:
  """Static (hashable) model settings that the params' shapes do not already say."""
  kind: str                  # "seq2seq" or "lm"
  layer_norm: bool = True
  attn_only: bool = False
  dropout: float = 0.0
  impl: str = "auto"
  pos: str = "sinusoidal"    # "sinusoidal", "relative"; LM also "learned", "qk", "qk_sinusoidal", "rope"
  pad_id: int = PAD_ID       # <pad> of the word vocabulary (data/vocab.py)
  ln_position: str = "pre"   # "pre" (x + f(LN(x))) or "post" (LN(x + f(x)))
  attention: str = "softmax"  # the attention variant (mha_jax.attention.VARIANTS)


def check_token_ids(ids, vocab_size: int, what: str = "tokens") -> None:
  """Refuses ids outside 0..vocab_size-1 (JAX would clamp the embedding gather and give
  finite, wrong logits), naming the largest id and the vocabulary size. Ids traced under
  jit are not checked here: they are checked where they enter (batches, tokenizers)."""
  if ids is None or isinstance(ids, jax.core.Tracer):
    return
  a = np.asarray(ids)
  if a.size == 0:
    return
  hi, lo = int(a.max()), int(a.min())
  if hi >= vocab_size:
    raise UserError(f"{what}: token id {hi} is not in the vocabulary of {vocab_size} "
                    f"tokens (ids 0..{vocab_size - 1})")
  if lo < 0:
    raise UserError(f"{what}: token id {lo} is negative (ids 0..{vocab_size - 1})")


def at_positions(x_BTD, positions):
  """x (B, T, D) at positions (B,) -> (B, 1, D), or at positions (B, n) -> (B, n, D)
  (an LM's `logits_at`: the logits only where they are read)."""
  p = jnp.asarray(positions)
  return jnp.take_along_axis(x_BTD, (p[:, None] if p.ndim == 1 else p)[..., None], axis=1)


def layer_norm(p, x, eps=1e-6, *, hook=None, site=None):
  """(x - mean) / sqrt(var + eps) * scale + bias (no bias where p has none: Cohere); the
  factor 1 / sqrt(var + eps) (..., 1) is the intervention site `site` when named
  (lm.ln_final.scale)."""
  mean = x.mean(-1, keepdims=True)
  var = ((x - mean) ** 2).mean(-1, keepdims=True)
  inv = jax.lax.rsqrt(var + eps)
  if site is not None:
    inv = interventions.at(hook, site, inv)
  y = (x - mean) * inv * p["scale"]
  return y + p["bias"] if "bias" in p else y


def init_layer_norm(d):
  return {"scale": jnp.ones((d,), jnp.float32), "bias": jnp.zeros((d,), jnp.float32)}


def mlp(p, x):
  """GELU MLP over (..., D), as 2-D matmuls (see attention.py's projections)."""
  x2 = x.reshape(-1, x.shape[-1])
  return (jax.nn.gelu(x2 @ p["w1"] + p["b1"]) @ p["w2"] + p["b2"]).reshape(x.shape)


def init_mlp(key, d, f):
  k1, k2 = jax.random.split(key)
  init = jax.nn.initializers.lecun_normal()
  return {"w1": init(k1, (d, f)), "b1": jnp.zeros((f,)), "w2": init(k2, (f, d)),
          "b2": jnp.zeros((d,))}


QK_POS = ("qk", "qk_sinusoidal")   # LM positions that enter Q and K only (Shortformer)
SCORE_POS = (*QK_POS, "relative", "rope")  # positions that reach only the attention scores


def sinusoidal(length: int, d: int) -> jax.Array:
  """(length, d) sinusoidal positions (Vaswani et al. 2017)."""
  pos = np.arange(length)[:, None]
  i = np.arange(0, d, 2)[None, :]
  angle = pos / np.power(10000.0, i / d)
  out = np.zeros((length, d), np.float32)
  out[:, 0::2] = np.sin(angle)
  out[:, 1::2] = np.cos(angle[:, : d // 2])
  return jnp.asarray(out)


def key_stream(key):
  """Endless fresh keys from `key` (or Nones when key is None: no dropout)."""
  i = 0
  while True:
    yield None if key is None else jax.random.fold_in(key, i)
    i += 1


def dropout(key, rate, x):
  if key is None or rate == 0.0:
    return x
  keep = jax.random.bernoulli(key, 1.0 - rate, x.shape)
  return jnp.where(keep, x / (1.0 - rate), 0.0)


def layers_of(stack_params: Mapping) -> list[str]:
  """["layer_0", "layer_1", ...] in numeric order."""
  names = [k for k in stack_params if k.startswith("layer_")]
  return sorted(names, key=lambda k: int(k.split("_")[1]))


def attention_blocks(params: Mapping) -> Iterator[tuple[str, int, Mapping]]:
  """(stack, layer index, attention params) for every attention block in the model."""
  for stack, (top, attn) in STACKS.items():
    if top not in params:
      continue
    for i, name in enumerate(layers_of(params[top])):
      if attn in params[top][name]:
        yield stack, i, params[top][name][attn]


def head_counts(params: Mapping) -> dict[str, list[int]]:
  """{stack: [heads in layer 0, heads in layer 1, ...]}, read from the shapes."""
  out: dict[str, list[int]] = {}
  for stack, _, p in attention_blocks(params):
    out.setdefault(stack, []).append(attention.num_heads_of(p))
  return out


def head_names(params: Mapping) -> list[str]:
  """Every head as "stack.layer.head", e.g. "encoder.2.5"."""
  return [f"{s}.{i}.{h}" for s, counts in head_counts(params).items()
          for i, n in enumerate(counts) for h in range(n)]


def ones_head_gates(params: Mapping) -> dict[str, list[jax.Array]]:
  """Gates of 1 for every head: {stack: [(H_0,), (H_1,), ...]}."""
  return {s: [jnp.ones((n,), jnp.float32) for n in counts]
          for s, counts in head_counts(params).items()}


def embed_scale(d: int) -> float:
  return math.sqrt(d)
