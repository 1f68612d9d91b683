"""Pallas flash-attention kernels from jax.experimental, behind one signature.

- GPU: ``jax.experimental.pallas.ops.gpu.attention.mha`` (Triton). Takes causal
  attention and nothing else: no mask, no score bias; q, k, v of one head width.
- TPU: ``jax.experimental.pallas.ops.tpu.flash_attention`` (takes a dense score bias,
  so ``bias`` and ``rel_bias``, as attention.relative_bias's dense form, are served, at
  O(T * S) memory for the bias) and the
  splash kernel ``...tpu.splash_attention`` (causal or full, no bias; the only one of
  the three that takes attention-logit soft-capping, ``attn_logits_soft_cap``).

Each wrapper takes the project's layout, q (B, T, H, K), k and v (B, S, G, K) with G
dividing H (grouped-query attention: key/value heads are repeated to H here), and
returns (B, T, H, K). What a kernel cannot serve raises ValueError before tracing.

On a mesh (the mesh in context, kernels/target.py, or ``mesh=``) with more than one
device the kernel runs inside ``shard_map``: Mosaic (TPU) and Triton (GPU) kernels are
custom calls XLA cannot partition. The batch is split over every mesh axis but "model"
(when they divide it), the heads over "model": with G key/value heads in blocks of G / m
per shard, so each key/value head's query heads stay on its shard (or, when m does not
divide G but divides H, the key/value heads repeated to H first); what an axis does not
divide stays whole on each device of it. Gradients go through the same shard_map.

``interpret=True`` runs a kernel on CPU in Pallas interpret mode (the tests do; it
is slow, for correctness only). For the TPU kernels the caller must trace the whole
computation, gradients included, inside ``pallas_tpu_interpret()``: the backward
kernels are traced after the forward returns.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from mha_jax.kernels import target as target_lib

KERNELS = ("gpu", "tpu_flash", "tpu_splash")
_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)
_TPU_BLOCK = 128


def pallas_tpu_interpret():
  """Context under which TPU Pallas kernels run in interpret mode on CPU."""
  from jax.experimental.pallas import tpu as pltpu
  return pltpu.force_tpu_interpret_mode()


def kernel_for(platform: str, has_bias: bool) -> str:
  """The Pallas kernel a target platform runs: 'gpu'; on a TPU 'tpu_flash' with a score
  bias, else 'tpu_splash'. A CPU has none (ValueError)."""
  if platform == "gpu":
    return "gpu"
  if platform == "tpu":
    return "tpu_flash" if has_bias else "tpu_splash"
  raise ValueError(f"impl='pallas' needs a GPU or TPU; the target's platform is "
                   f"{platform!r}. Use impl='blocked' or 'reference'")


def check_supported(kernel: str, q_BTHK, k_BSHK, v_BSHK, mask_BHTS=None, bias_BHTS=None,
                    interpret: bool = False, softcap: float | None = None,
                    platform: str | None = None) -> None:
  """Raises ValueError naming what `kernel` cannot serve in this call, on the target
  platform (None: the current target's, kernels/target.py)."""
  if kernel not in KERNELS:
    raise ValueError(f"kernel must be one of {KERNELS}; got {kernel!r}")
  want = "gpu" if kernel == "gpu" else "tpu"
  platform = target_lib.current_target().platform if platform is None else platform
  if not interpret and platform != want:
    raise ValueError(f"Pallas kernel {kernel!r} needs a {want.upper()}; the target's "
                     f"platform is {platform!r}. Use impl='blocked' or 'reference' "
                     f"(or interpret=True for a slow CPU check)")
  if q_BTHK.dtype not in _DTYPES or k_BSHK.dtype != q_BTHK.dtype or v_BSHK.dtype != q_BTHK.dtype:
    raise ValueError(f"Pallas kernel {kernel!r} needs q, k, v of one dtype among float32, "
                     f"bfloat16, float16; got {q_BTHK.dtype}, {k_BSHK.dtype}, {v_BSHK.dtype}")
  b, t, h, dk = q_BTHK.shape
  s, g = k_BSHK.shape[1], k_BSHK.shape[2]
  if v_BSHK.shape[-1] != dk or k_BSHK.shape[-1] != dk:
    raise ValueError(f"Pallas kernel {kernel!r} needs one head width for q, k and v; got "
                     f"q {q_BTHK.shape}, k {k_BSHK.shape}, v {v_BSHK.shape}")
  if g < 1 or h % g:
    raise ValueError(f"key/value heads G={g} must divide query heads H={h}")
  if mask_BHTS is not None:
    raise ValueError(f"Pallas kernel {kernel!r} takes no boolean mask (only causal); got a "
                     f"mask of shape {tuple(mask_BHTS.shape)}. Use impl='blocked'")
  if softcap is not None and kernel != "tpu_splash":
    raise ValueError(f"Pallas kernel {kernel!r} takes no attention-logit soft-capping "
                     f"(softcap={softcap}); only 'tpu_splash' does. Use impl='blocked'")
  if kernel in ("gpu", "tpu_splash") and bias_BHTS is not None:
    raise ValueError(f"Pallas kernel {kernel!r} takes no score bias (bias or rel_bias). "
                     f"Use impl='blocked' (or 'tpu_flash' on TPU)")
  if kernel == "gpu":
    # Triton lowers only arrays whose sizes are powers of 2: the head width and every
    # block (min(128, n) and min(32, n) of T and S; found by compiling for an H100)
    if dk > 256 or dk & (dk - 1):
      raise ValueError(f"Pallas GPU kernel needs head width K a power of 2 <= 256; got K={dk}")
    for name, n in (("T", t), ("S", s)):
      if n % 128 and n & (n - 1):
        raise ValueError(f"Pallas GPU kernel needs {name} a multiple of 128 or a power of 2 "
                         f"below it; got {name}={n}")
  else:
    for name, n in (("T", t), ("S", s)):
      if n % _TPU_BLOCK:
        raise ValueError(f"Pallas TPU kernel {kernel!r} needs {name} a multiple of "
                         f"{_TPU_BLOCK}; got {name}={n}")


def _repeat_kv(x_BSGK, h):
  g = x_BSGK.shape[2]
  return x_BSGK if g == h else jnp.repeat(x_BSGK, h // g, axis=2)


def _dense_bias(bias_BHTS, b, h, t, s, dtype, full: bool = True):
  """The bias as 4-D (B or 1, H or 1, T, S) in `dtype`; full: broadcast to (B, H, T, S)."""
  if bias_BHTS is None:
    return None
  bias = bias_BHTS.astype(jnp.float32)
  bias = bias.reshape((1,) * (4 - bias.ndim) + bias.shape)
  if full:
    bias = jnp.broadcast_to(bias, (b, h, t, s))
  return bias.astype(dtype)


def pallas_attention(q_BTHK, k_BSHK, v_BSHK, mask_BHTS=None, bias_BHTS=None, *,
                     causal: bool = False, scale: float | None = None,
                     kernel: str | None = None, interpret: bool = False,
                     softcap: float | None = None, platform: str | None = None,
                     mesh=None):
  """Attention output (B, T, H, K) through a Pallas kernel.

  Args:
    q_BTHK, k_BSHK, v_BSHK: (B, T, H, K), (B, S, G, K), (B, S, G, K).
    mask_BHTS: must be None (the kernels take causal masking only).
    bias_BHTS: score bias (a relative-position table comes as its dense bias,
      attention.relative_bias), served by 'tpu_flash' only.
    causal: key j <= query i (top-left aligned).
    scale: None means 1 / sqrt(K).
    kernel: 'gpu', 'tpu_flash' or 'tpu_splash'; None picks by the platform
      (kernel_for).
    interpret: run in Pallas interpret mode (CPU, slow; tests).
    softcap: the scaled scores become softcap * tanh(scores / softcap) ('tpu_splash'
      only).
    platform: the target's platform; None: the current target's (kernels/target.py).
    mesh: a Mesh or AbstractMesh to shard_map over; None: the mesh in context, if any.
  """
  platform = target_lib.current_target().platform if platform is None else platform
  if kernel is None:
    kernel = kernel_for(platform, bias_BHTS is not None)
  check_supported(kernel, q_BTHK, k_BSHK, v_BSHK, mask_BHTS, bias_BHTS, interpret, softcap,
                  platform)
  b, t, h, dk = q_BTHK.shape
  s = k_BSHK.shape[1]
  scale = 1.0 / math.sqrt(dk) if scale is None else scale
  bias = _dense_bias(bias_BHTS, b, h, t, s, q_BTHK.dtype, full=False)
  call = lambda q, k, v, bias: _local_attention(q, k, v, bias, kernel, causal, scale,
                                                interpret, softcap)
  mesh = target_lib.context_mesh() if mesh is None else mesh
  free = _free_axes(mesh)
  if not free or math.prod(mesh.shape[a] for a in free) == 1:
    return call(q_BTHK, k_BSHK, v_BSHK, bias)
  return _sharded(call, mesh, free, q_BTHK, k_BSHK, v_BSHK, bias)


def _free_axes(mesh) -> tuple[str, ...]:
  """The mesh's axes that are not already manual (inside another shard_map)."""
  if mesh is None:
    return ()
  manual = set(getattr(mesh, "manual_axes", ()) or ())
  return tuple(a for a in mesh.axis_names if a not in manual)


def _sharded(call, mesh, free, q_BTHK, k_BSHK, v_BSHK, bias):
  """call(q, k, v, bias) inside shard_map over `mesh` (module docstring)."""
  b, _, h, _ = q_BTHK.shape
  batch, heads, repeat = target_lib.shard_specs(dict(mesh.shape), free, b, h, k_BSHK.shape[2])
  if repeat:
    k_BSHK, v_BSHK = _repeat_kv(k_BSHK, h), _repeat_kv(v_BSHK, h)
  qkv = P(batch, None, heads, None)
  in_specs = (qkv, qkv, qkv)
  args = (q_BTHK, k_BSHK, v_BSHK)
  if bias is not None:
    in_specs += (P(batch if bias.shape[0] == b and b > 1 else None,
                   heads if bias.shape[1] == h and h > 1 else None, None, None),)
    args += (bias,)
  inner = lambda q, k, v, *rest: call(q, k, v, rest[0] if rest else None)
  return jax.shard_map(inner, mesh=mesh, in_specs=in_specs, out_specs=qkv,
                       axis_names=set(free), check_vma=False)(*args)


def _local_attention(q_BTHK, k_BSHK, v_BSHK, bias, kernel, causal, scale, interpret,
                     softcap):
  """The kernel's call on one device's share: (B, T, H, K)."""
  b, t, h, _ = q_BTHK.shape
  s = k_BSHK.shape[1]
  k_BSHK, v_BSHK = _repeat_kv(k_BSHK, h), _repeat_kv(v_BSHK, h)
  if kernel == "gpu":
    from jax.experimental.pallas.ops.gpu import attention as gpu_attention
    blocks = gpu_attention.BlockSizes(block_q=min(128, t), block_k=min(128, s),
                                      block_q_dkv=min(32, t), block_kv_dkv=min(32, s),
                                      block_q_dq=min(32, t), block_kv_dq=min(32, s))
    return gpu_attention.mha(q_BTHK, k_BSHK, v_BSHK, None, sm_scale=float(scale),
                             causal=bool(causal), block_sizes=blocks, interpret=interpret)
  to_bhtk = lambda x: jnp.swapaxes(x, 1, 2)
  q, k, v = to_bhtk(q_BTHK), to_bhtk(k_BSHK), to_bhtk(v_BSHK)
  if kernel == "tpu_flash":
    from jax.experimental.pallas.ops.tpu import flash_attention as tpu_flash
    ab = _dense_bias(bias, b, h, t, s, q.dtype)
    # The kernel scales (q . k + ab): scale q instead so that the bias is not scaled.
    o = tpu_flash.flash_attention(q * jnp.asarray(scale, q.dtype), k, v, ab,
                                  causal=bool(causal), sm_scale=1.0)
    return to_bhtk(o)
  from jax.experimental.pallas.ops.tpu.splash_attention import (
      splash_attention_kernel as splash, splash_attention_mask as splash_mask)
  one = splash_mask.CausalMask((t, s)) if causal else splash_mask.FullMask((t, s))
  # The batch folded into the kernel's head axis, not vmapped: interpret mode (jax
  # 0.10.2) fails on a vmapped splash kernel with more than one row.
  kern = splash.make_splash_mha_single_device(
      splash_mask.MultiHeadMask([one] * (b * h)), interpret=interpret,
      block_sizes=splash_blocks(q.shape[-1]),
      attn_logits_soft_cap=None if softcap is None else float(softcap))
  fold = lambda x: x.reshape(b * h, *x.shape[2:])
  o = kern(fold(q * jnp.asarray(scale, q.dtype)), fold(k), fold(v))
  return to_bhtk(o.reshape(b, h, t, -1))


def splash_blocks(head_dim: int):
  """The splash kernel's block sizes (its defaults, 128) and the physical layout of q, k
  and v. A TPU array's minor dimension is tiled to 128 lanes, so (heads, T, K) with K = 8
  takes 16x its bytes in HBM (q, k, v, their residuals and gradients); (heads, K, T)
  (SEQ_MINOR) puts T, a multiple of 128 here, on the lanes. So the head dimension goes
  minor only when it fills whole lanes. The logical shapes do not change (the kernel
  transposes), nor the output's layout (always (heads, T, K))."""
  from jax.experimental.pallas.ops.tpu.splash_attention import (
      splash_attention_kernel as splash)
  layout = (splash.QKVLayout.HEAD_DIM_MINOR if head_dim % _TPU_BLOCK == 0
            else splash.QKVLayout.SEQ_MINOR)
  return dataclasses.replace(splash.BlockSizes.get_default(), q_layout=layout,
                             k_layout=layout, v_layout=layout)
