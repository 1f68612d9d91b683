"""A toy task where every position needs two different tokens at once, and a tiny
trainer for it, on the project's own decoder-only model (`mha_jax.models.lm`).

Tokens are uniform over 0..V-1; ids V/2..V-1 are "nouns". At position t the model must
output two things:
  A = x[t-1]                          the previous token (a positional target)
  B = x[j], j the latest noun at or before t-2   (a content target, like a head's
                                                  syntactic partner: its distance varies)
The model is one attention-only layer (no LayerNorm, learned positions) whose
unembedding has 2V outputs: logits[:V] predict A, logits[V:] predict B. Its parameter
count is the same for every h (4 D^2 in the attention block), so h = 1, 2, 4 compare at
equal parameters.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax

from mha_jax.errors import UserError
from mha_jax.models import common
from mha_jax.models import lm as lm_model


def two_target_batch(seed: int, batch: int, length: int, vocab: int):
  """tokens (B, T) int32, targets A and B (B, T) int32, masks (B, T) float32 (1 where
  the target exists), and partner positions (B, T) (-1 where none)."""
  if vocab < 4 or vocab % 2:
    raise UserError(f"vocab must be an even number >= 4; got {vocab}")
  rng = np.random.default_rng(seed)
  x = rng.integers(0, vocab, size=(batch, length)).astype(np.int32)
  a = np.zeros_like(x)
  a[:, 1:] = x[:, :-1]
  mask_a = np.zeros(x.shape, np.float32)
  mask_a[:, 1:] = 1.0
  partner = np.full(x.shape, -1, np.int64)
  noun = x >= vocab // 2
  last = np.full(batch, -1)
  for t in range(length):
    partner[:, t] = last                       # latest noun at <= t - 2
    if t >= 1:
      last = np.where(noun[:, t - 1], t - 1, last)
  b = np.take_along_axis(x, np.maximum(partner, 0), axis=1)
  mask_b = (partner >= 0).astype(np.float32)
  return {"tokens": x, "a": a, "b": b, "mask_a": mask_a, "mask_b": mask_b,
          "partner": partner}


def spec() -> common.ModelSpec:
  return common.ModelSpec(kind="lm", layer_norm=False, attn_only=True, pos="learned",
                     impl="reference")


def init(key, *, vocab: int, d_model: int, heads: int, length: int) -> dict:
  return lm_model.init(key, vocab_size=2 * vocab, d_model=d_model, num_heads=heads,
                       num_layers=1, d_ff=0, max_len=length, layer_norm=False,
                       attn_only=True, pos="learned")


def losses(params, batch, vocab: int):
  """(loss A, loss B) in nats per target, from the model's own forward pass."""
  logits = lm_model.apply(params, spec(), batch["tokens"]).astype(jnp.float32)
  la = optax.softmax_cross_entropy_with_integer_labels(logits[..., :vocab], batch["a"])
  lb = optax.softmax_cross_entropy_with_integer_labels(logits[..., vocab:], batch["b"])
  return ((la * batch["mask_a"]).sum() / batch["mask_a"].sum(),
          (lb * batch["mask_b"]).sum() / batch["mask_b"].sum())


def train(*, heads: int, d_model: int = 32, vocab: int = 16, length: int = 12,
          steps: int = 300, batch: int = 64, lr: float = 1e-2, seed: int = 0) -> dict:
  """Trains the one-layer model on the two-target task; returns params and the
  held-out losses."""
  params = init(jax.random.PRNGKey(seed), vocab=vocab, d_model=d_model, heads=heads,
                length=length)
  opt = optax.adam(optax.warmup_cosine_decay_schedule(0.0, lr, 30, steps, lr * 0.1))
  state = opt.init(params)

  @jax.jit
  def step(params, state, b):
    loss, grads = jax.value_and_grad(lambda p: sum(losses(p, b, vocab)))(params)
    updates, state = opt.update(grads, state, params)
    return optax.apply_updates(params, updates), state, loss

  for i in range(steps):
    b = two_target_batch(seed * 100_003 + i, batch, length, vocab)
    params, state, _ = step(params, state, {k: jnp.asarray(v) for k, v in b.items()
                                            if k != "partner"})
  test = held_out(vocab, length)
  la, lb = jax.jit(lambda p, b: losses(p, b, vocab))(
      params, {k: jnp.asarray(v) for k, v in test.items() if k != "partner"})
  return {"params": params, "loss_a": float(la), "loss_b": float(lb),
          "loss": float(la + lb), "heads": heads, "d_model": d_model, "vocab": vocab,
          "length": length, "steps": steps}


def held_out(vocab: int, length: int, batch: int = 256) -> dict:
  return two_target_batch(987_654_321, batch, length, vocab)


def weights(params, tokens) -> np.ndarray:
  """(B, H, T, T) attention weights of the layer, from the model's capture path."""
  _, cap = lm_model.apply(params, spec(), jnp.asarray(tokens), capture=True)
  return np.asarray(cap["lm"][0].weights)


def target_weights(w_BHTT: np.ndarray, partner_BT: np.ndarray) -> dict[str, np.ndarray]:
  """Per head (H,): mean weight on t-1 and on the partner (over positions where both
  exist and differ), and the mean peak weight there."""
  b, h, t, _ = w_BHTT.shape
  rows, cols = np.nonzero((partner_BT >= 0) & (np.arange(t)[None, :] >= 2))
  prev = w_BHTT[rows, :, cols, cols - 1]                      # (N, H)
  part = w_BHTT[rows, :, cols, partner_BT[rows, cols]]
  peak = w_BHTT[rows, :, cols].max(-1)
  return {"previous": prev.mean(0), "partner": part.mean(0), "peak": peak.mean(0)}
