"""The reference kernel: explicit (B, H, T, S) weights, what every analysis reads.

It is the building blocks of blocks.py (scores, softmax, mix) in sequence.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from mha_jax import blocks


def reference_kernel(q_BTHK: jax.Array, k_BSGK: jax.Array, v_BSGK: jax.Array,
                     mask_BHTS: jax.Array | None, bias_BHTS: jax.Array | None = None,
                     softcap: float | None = None, sigmoid_bias: float | None = None,
                     sink_H: jax.Array | None = None):
  """(o (B, T, H, V), w (B, H, T, S) float32); G key/value heads dividing H. softcap:
  the scores become softcap * tanh(scores / softcap) before the bias (Gemma 2).
  sigmoid_bias: w = sigmoid(scores + b), masked entries 0, no normalisation (sigmoid
  attention). sink_H (H,): a softmax whose denominator also holds exp(sink_H[h]); w's
  rows then sum to 1 minus the sink's weight."""
  k_BSGK, v_BSGK = blocks.drop_masked_keys(k_BSGK, v_BSGK, mask_BHTS)
  s_BHTS = blocks.attention_scores(q_BTHK, k_BSGK)
  if softcap is not None:
    s_BHTS = blocks.soft_cap(s_BHTS, softcap)
  if bias_BHTS is not None:
    s_BHTS = s_BHTS + bias_BHTS.astype(s_BHTS.dtype)
  if sigmoid_bias is not None or sink_H is not None:   # fully masked rows come out 0
    w_BHTS = (blocks.sigmoid_weights(s_BHTS, mask_BHTS, sigmoid_bias) if sink_H is None
              else blocks.sink_softmax(s_BHTS, mask_BHTS, sink_H))
    return blocks.mix_values(w_BHTS, v_BSGK), w_BHTS
  w_BHTS, live = blocks.masked_softmax(s_BHTS, mask_BHTS)
  o_BTHK = blocks.mix_values(w_BHTS, v_BSGK)
  if live is None:
    return o_BTHK, w_BHTS
  # Rows with no allowed key: zero weights and a zero output, the latter applied to the
  # small (B, T, H, K) output rather than the (B, H, T, S) weights (unused in training).
  live_BTH1 = jnp.swapaxes(jnp.broadcast_to(live, (*live.shape[:2], o_BTHK.shape[1], 1)),
                           1, 2)
  return o_BTHK * live_BTH1, w_BHTS * live
