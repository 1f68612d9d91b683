"""jax.nn.dot_product_attention: XLA's fused attention, and cuDNN's on NVIDIA GPUs.

On a mesh neither needs shard_map: XLA partitions the fused path like any other ops, and
JAX gives cuDNN's custom call partitioning rules (batch and heads; jax._src.cudnn's
custom_partitioning)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from mha_jax import blocks
from mha_jax.kernels import target as target_lib


def gpu_available() -> bool:
  try:
    return any(d.platform == "gpu" for d in jax.devices())
  except RuntimeError:
    return False


def check_cudnn_supported(q_BTHK: jax.Array, platform: str | None = None) -> None:
  """Raises ValueError when cuDNN's attention cannot serve q on the target platform
  (None: the current target's, kernels/target.py): platform, dtype, width."""
  platform = target_lib.current_target().platform if platform is None else platform
  if platform != "gpu":
    raise ValueError(f"impl='cudnn' needs an NVIDIA GPU; the target's platform is "
                     f"{platform!r}. Use impl='auto', 'xla' or 'reference'")
  if q_BTHK.dtype not in (jnp.bfloat16, jnp.float16):
    raise ValueError(f"impl='cudnn' needs bfloat16 or float16 inputs; got dtype "
                     f"{q_BTHK.dtype}. Cast x and params, or use impl='xla'")
  k = q_BTHK.shape[-1]
  if k % 8 or k > 256:
    raise ValueError(f"impl='cudnn' needs a head width K that is a multiple of 8 and "
                     f"at most 256; got K={k}")


def causal_mask(t: int, s: int) -> jax.Array:
  """(1, 1, T, S): query i may attend to keys j <= i (top-left aligned, as jax.nn)."""
  return jnp.tril(jnp.ones((t, s), jnp.bool_))[None, None]


def fused_kernel(q_BTHK, k_BSGK, v_BSGK, mask_BHTS, causal, implementation,
                 bias_BHTS=None):
  """(B, T, H, K) output of jax.nn.dot_product_attention with the zero-row contract.

  jax.nn takes G key/value heads dividing H in the project's order (query head i
  reads kv head i // (H // G)). implementation: 'xla' or 'cudnn'.
  """
  if bias_BHTS is not None:
    bias_BHTS = bias_BHTS.astype(q_BTHK.dtype)
  k_BSGK, v_BSGK = blocks.drop_masked_keys(k_BSGK, v_BSGK, mask_BHTS)
  o_BTHK = jax.nn.dot_product_attention(
      q_BTHK, k_BSGK, v_BSGK, bias=bias_BHTS, mask=mask_BHTS, is_causal=causal,
      scale=1.0 / math.sqrt(q_BTHK.shape[-1]), implementation=implementation)
  if mask_BHTS is not None:
    # jax.nn spreads a fully masked row uniformly; the contract is a zero output.
    full = mask_BHTS
    if causal:
      full = full & causal_mask(q_BTHK.shape[1], k_BSGK.shape[1])
    live_BHT = jnp.any(full, axis=-1)
    o_BTHK = jnp.where(jnp.swapaxes(live_BHT, 1, 2)[..., None], o_BTHK, 0)
  return o_BTHK
