"""Compile-only NVIDIA GPU devices: lower and compile a program for an H100, H200 or A100
on a machine that has none (the GPU counterpart of a TPU topology).

XLA compiles for a GPU it does not have from a target description, a
`stream_executor.GpuTargetConfigProto` in text form. The CUDA PJRT plugin (the
`jax-cuda12-plugin` and `jax-cuda12-pjrt` wheels of this jax's version, plus
`nvidia-cudnn-cu12`, which jax reads for its cuDNN attention checks) builds a topology of
compile-only devices from it:

  jax.experimental.topologies.get_topology_desc(
      platform="cuda", target_config=TEXTPROTO, topology="1x1xN")

(`topology` is partitions x hosts per partition x devices per host). The devices make a
`jax.sharding.Mesh`; `jax.jit(f).lower(*shape_structs).compile()` then runs XLA's GPU
pipeline, Triton included (a Pallas GPU kernel is compiled to PTX for the chip), and
`compiled.memory_analysis()` gives the bytes per device. What a compile-only program
does not have: gemm autotuning (default tilings), cuDNN's graph (built when the program
is first run on the GPU; its workspace is 0 here) and `compiled.cost_analysis()`, which
the plugin does not implement (`cost_analysis` below counts the optimised HLO instead).

The target descriptions are written here from the published numbers (mha_jax.chips, with
their sources, and SPECS); the same fields as the device specs XLA keeps for its own ahead-of-time tests
(xla/tools/hlo_opt/gpu_specs/, e.g. h100_sxm.txtpb, a100_sxm_80.txtpb).
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import os
import re

import jax

from mha_jax import chips

PLUGIN = "jax_plugins.xla_cuda12"
INSTALL = (f'pip install "jax-cuda12-plugin=={jax.__version__}" '
           f'"jax-cuda12-pjrt=={jax.__version__}" nvidia-cudnn-cu12')
DEVICES_PER_HOST = 8  # an HGX/DGX node


@dataclasses.dataclass(frozen=True)
class GpuSpec:
  """What XLA's GPU compiler reads of one GPU model beyond mha_jax.chips' published
  numbers (peak FLOP/s, HBM size and bandwidth, device kind, which `chip` reads there):
  the GpuDeviceInfoProto fields, from NVIDIA's tuning guides."""
  compute_capability: tuple[int, int]
  sm_count: int
  fpus_per_sm: int
  shared_memory_per_sm: int
  shared_memory_per_block_optin: int
  l2_bytes: int
  clock_ghz: float
  source: str


_HOPPER = GpuSpec(compute_capability=(9, 0), sm_count=132, fpus_per_sm=128,
                  shared_memory_per_sm=228 * 1024, shared_memory_per_block_optin=227 * 1024,
                  l2_bytes=50 * 2**20, clock_ghz=1.98,
                  source="SMs, shared memory and L2 from the Hopper tuning guide (CUDA 12)")

SPECS: dict[str, GpuSpec] = {
    "h100": _HOPPER,
    "h200": _HOPPER,   # the H100's GH100 (132 SMs) with more, faster memory
    "a100": GpuSpec(compute_capability=(8, 0), sm_count=108, fpus_per_sm=64,
                    shared_memory_per_sm=164 * 1024, shared_memory_per_block_optin=163 * 1024,
                    l2_bytes=40 * 2**20, clock_ghz=1.41,
                    source="SMs, shared memory and L2 from the Ampere tuning guide"),
}
GPUS = tuple(SPECS)


class GpuTargetsUnavailable(RuntimeError):
  """The CUDA plugin that compiles for a GPU is not installed or cannot register."""


def target_config(name: str) -> str:
  """The GpuTargetConfigProto text XLA compiles for, for GPU `name` (one of GPUS)."""
  c, g = chip(name), SPECS[name]
  major, minor = g.compute_capability
  info = {"threads_per_block_limit": 1024, "threads_per_warp": 32,
          "shared_memory_per_block": 48 * 1024, "shared_memory_per_core":
          g.shared_memory_per_sm, "threads_per_core_limit": 2048, "core_count": g.sm_count,
          "fpus_per_core": g.fpus_per_sm, "block_dim_limit_x": 2**31 - 1,
          "block_dim_limit_y": 65535, "block_dim_limit_z": 65535,
          "memory_bandwidth": int(c.hbm_bandwidth), "l2_cache_size": g.l2_bytes,
          "clock_rate_ghz": g.clock_ghz, "device_memory_size": c.hbm_bytes,
          "shared_memory_per_block_optin": g.shared_memory_per_block_optin,
          "registers_per_core_limit": 65536, "registers_per_block_limit": 65536}
  lines = [f"  {k}: {v}" for k, v in info.items()]
  lines.append(f"  cuda_compute_capability {{ major: {major} minor: {minor} }}")
  return ("gpu_device_info {\n" + "\n".join(lines) + "\n}\n"
          f'platform_name: "CUDA"\ndevice_description_str: "{c.device_kind}"\n')


def chip(name: str) -> chips.Chip:
  """mha_jax.chips.CHIPS[name] for a GPU of GPUS, refusing another name with the list."""
  if name not in SPECS:
    raise ValueError(f"GPU name must be one of {GPUS}; got {name!r}")
  return chips.CHIPS[name]


def topology_shape(n: int) -> str:
  """'1xHxD': one partition of H hosts with D devices each (D <= DEVICES_PER_HOST)."""
  if not isinstance(n, int) or n < 1:
    raise ValueError(f"the number of GPUs n must be an integer >= 1; got {n!r}")
  if n <= DEVICES_PER_HOST:
    return f"1x1x{n}"
  if n % DEVICES_PER_HOST:
    raise ValueError(f"more than {DEVICES_PER_HOST} GPUs come in whole hosts of "
                     f"{DEVICES_PER_HOST}; got n={n}")
  return f"1x{n // DEVICES_PER_HOST}x{DEVICES_PER_HOST}"


def plugin_installed() -> bool:
  """Whether the CUDA plugin (the package that compiles for a GPU) is importable."""
  try:
    return importlib.util.find_spec(PLUGIN) is not None
  except ImportError:
    return False


def _topology_devices(config: str, shape: str) -> list:
  from jax.experimental import topologies
  topo = topologies.get_topology_desc(platform="cuda", target_config=config, topology=shape)
  return list(topo.devices)


def gpu_devices(name: str, n: int = 1) -> list:
  """n compile-only devices of GPU `name` ('h100', 'h200', 'a100'), in one process.

  They build a jax.sharding.Mesh and serve as the shardings of the shape structs that
  `jax.jit(f).lower(...)` takes; `.compile()` then compiles for that GPU without one.
  Raises GpuTargetsUnavailable without the CUDA plugin (saying what to install).
  """
  config, shape = target_config(name), topology_shape(n)
  if not plugin_installed():
    raise GpuTargetsUnavailable(f"compiling for a GPU needs the CUDA plugin, not "
                                f"installed here: {INSTALL}")
  # Without a GPU the plugin's CUDA version check fails (cuInit) and jax skips the
  # plugin; the check is for running, not compiling. The variable works before jax
  # discovers its plugins; after a failed discovery the plugin is registered again.
  os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
  try:
    return _topology_devices(config, shape)
  except NotImplementedError:  # "topology not implemented for cuda": not registered
    pass
  try:
    importlib.import_module(PLUGIN).initialize()
    return _topology_devices(config, shape)
  except (NotImplementedError, RuntimeError) as e:
    raise GpuTargetsUnavailable(f"the CUDA plugin is installed but did not register in "
                                f"this process ({type(e).__name__}: {e}); start the "
                                f"process with JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1") from e


def cost_analysis(compiled) -> dict:
  """{'flops', 'bytes accessed', 'uncounted': custom-call targets} of a compiled program.

  For a compile-only GPU program `compiled.cost_analysis()` is None (the plugin does not
  implement it); this runs XLA's HLO cost model (through the CPU client) over the
  optimised GPU module. Custom calls count nothing there: cuDNN's attention
  ('__cudnn$fmha...') and Triton kernels ('__gpu$xla.gpu.triton', Pallas) are listed in
  'uncounted', for the caller to add their FLOPs (mha_jax.accounting.attention_flops).
  """
  from jax._src import xla_bridge
  from jax._src.lib import _jax  # XLA's HLO cost model has no public entry point
  exe = compiled.runtime_executable()
  modules = exe.hlo_modules()
  total: dict[str, float] = {}
  for m in modules:
    for k, v in _jax.hlo_module_cost_analysis(xla_bridge.get_backend("cpu"), m).items():
      total[k] = total.get(k, 0.0) + float(v)
  text = "\n".join(m.to_string() for m in modules)
  uncounted = sorted(set(re.findall(r'custom_call_target="([^"]+)"', text)))
  return {"flops": total.get("flops", 0.0),
          "bytes accessed": total.get("bytes accessed", 0.0), "uncounted": uncounted}
