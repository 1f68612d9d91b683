"""Compile-only GPU targets (mha_jax.gpu_targets): the target descriptions, and programs
compiled for an H100 on a machine without a GPU.

The `gpu_compile` tests need the CUDA plugin (jax-cuda12-plugin, jax-cuda12-pjrt and
nvidia-cudnn-cu12 of this jax's version) and are skipped without it:
  JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 VENV/bin/python -m pytest -p no:xdist -m gpu_compile \
    tests/kernels/test_gpu_targets.py
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from mha_jax import attention, gpu_targets

needs_plugin = pytest.mark.skipif(not gpu_targets.plugin_installed(),
                                  reason="the CUDA plugin is not installed")


@pytest.mark.parametrize("name", gpu_targets.GPUS)
def test_target_config_carries_the_chip(name):
  chip, spec = gpu_targets.chip(name), gpu_targets.SPECS[name]
  text = gpu_targets.target_config(name)
  field = lambda key: re.search(rf"\b{key}: ([0-9.e+]+)", text).group(1)
  assert int(field("device_memory_size")) == chip.hbm_bytes
  assert int(field("memory_bandwidth")) == int(chip.hbm_bandwidth)
  assert int(field("core_count")) == spec.sm_count
  assert int(field("major")) == spec.compute_capability[0]
  assert f'device_description_str: "{chip.device_kind}"' in text
  assert chip.source and chip.peak_flops > 1e14


def test_bad_names_and_counts_are_refused_by_name():
  with pytest.raises(ValueError, match=r"one of \('h100', 'h200', 'a100'\); got 'v100'"):
    gpu_targets.gpu_devices("v100")
  assert gpu_targets.topology_shape(1) == "1x1x1"
  assert gpu_targets.topology_shape(8) == "1x1x8"
  assert gpu_targets.topology_shape(16) == "1x2x8"
  with pytest.raises(ValueError, match="n=12"):
    gpu_targets.topology_shape(12)
  with pytest.raises(ValueError, match="got 0"):
    gpu_targets.topology_shape(0)


@pytest.mark.skipif(gpu_targets.plugin_installed(), reason="the CUDA plugin is installed")
def test_without_the_plugin_the_error_says_what_to_install():
  with pytest.raises(gpu_targets.GpuTargetsUnavailable, match="jax-cuda12-plugin=="):
    gpu_targets.gpu_devices("h100")


def _struct(shape, dtype, sharding):
  return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)


def _compile(fn, *structs):
  return jax.jit(fn).lower(*structs).compile()


@needs_plugin
@pytest.mark.gpu_compile
@pytest.mark.parametrize("name", gpu_targets.GPUS)
def test_attention_train_step_compiles_for_the_gpu(name):
  """multi_head_attention's forward+backward (blocked kernel, bf16) compiled for the GPU:
  the devices are the chip's; argument and output bytes are the shapes' bytes."""
  (dev,) = gpu_targets.gpu_devices(name, 1)
  assert dev.platform == "gpu" and dev.device_kind == gpu_targets.chip(name).device_kind
  b, t, d, h = 2, 256, 256, 4
  sh = jax.sharding.SingleDeviceSharding(dev)
  params = jax.eval_shape(lambda: attention.init_attention_params(jax.random.key(0), d, h))
  params = jax.tree.map(lambda a: _struct(a.shape, jnp.bfloat16, sh), params)
  x = _struct((b, t, d), jnp.bfloat16, sh)
  loss = lambda p, x: attention.multi_head_attention(
      p, x, causal=True, impl="blocked").astype(jnp.float32).sum()
  compiled = _compile(jax.value_and_grad(loss), params, x)
  mem = compiled.memory_analysis()
  param_bytes = sum(2 * int(np.prod(a.shape)) for a in jax.tree.leaves(params))
  assert mem.argument_size_in_bytes == param_bytes + 2 * b * t * d
  assert param_bytes + 4 <= mem.output_size_in_bytes <= param_bytes + 1024
  assert mem.temp_size_in_bytes > 0
  cost = gpu_targets.cost_analysis(compiled)
  # At least the 9 projection matmuls: 4 forward, 4 weight gradients, 1 through W_O.
  assert cost["flops"] >= 9 * 2 * b * t * d * d and cost["uncounted"] == []


@needs_plugin
@pytest.mark.gpu_compile
def test_cudnn_and_pallas_attention_compile_for_h100_on_a_mesh():
  """The kernels behind impl='cudnn' (jax.nn's cuDNN flash attention) and impl='pallas'
  (jax's Pallas GPU flash kernel, Triton) compile for two H100s, the batch sharded."""
  from jax.experimental.pallas.ops.gpu import attention as pallas_gpu
  mesh = Mesh(np.array(gpu_targets.gpu_devices("h100", 2)), ("data",))
  b, t, h, k = 4, 256, 4, 64
  q = _struct((b, t, h, k), jnp.bfloat16, NamedSharding(mesh, P("data")))
  cudnn = lambda q, kk, v: jax.nn.dot_product_attention(
      q, kk, v, is_causal=True, implementation="cudnn").astype(jnp.float32).sum()
  compiled = _compile(jax.grad(cudnn, argnums=(0, 1, 2)), q, q, q)
  assert "__cudnn$fmhaSoftmaxBackward" in gpu_targets.cost_analysis(compiled)["uncounted"]
  assert compiled.memory_analysis().argument_size_in_bytes == 3 * 2 * b * t * h * k // 2
  blocks = pallas_gpu.BlockSizes(block_q=64, block_k=64, block_q_dkv=32,
                                 block_kv_dkv=32, block_q_dq=32, block_kv_dq=32)
  flash = lambda q, kk, v: pallas_gpu.mha(q, kk, v, None, causal=True,
                                          block_sizes=blocks).astype(jnp.float32).sum()
  mesh1 = Mesh(np.array(gpu_targets.gpu_devices("h100", 1)), ("data",))
  q1 = _struct((b, t, h, k), jnp.bfloat16, NamedSharding(mesh1, P()))
  compiled = _compile(jax.grad(flash, argnums=(0, 1, 2)), q1, q1, q1)
  assert "__gpu$xla.gpu.triton" in gpu_targets.cost_analysis(compiled)["uncounted"]
