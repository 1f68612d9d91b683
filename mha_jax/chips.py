"""The accelerator chips the project compiles for: one table of their published numbers.

Each entry is one JAX device (a TPU v4 or v5p chip as one megacore device; a TPU v2 or v3
core, as JAX counts them; one GPU), with the data sheet it comes from:
  peak_flops     dense bf16 FLOP/s (None where the page gives none per JAX device);
  hbm_bandwidth  bytes/s of its HBM;
  hbm_bytes      its HBM: the capacity the page lists (TPU), or the memory the driver
                 reports, a little under the marketed size (GPU);
  device_kinds   the names JAX gives such a device (`jax.Device.device_kind`).

Who reads it: the kernel choice (kernels/target.py `hbm_bytes`, the score-memory
budget), `mha-jax plan` (the roofline and `fits`) and gpu_targets (the target
descriptions XLA compiles a GPU program for).
"""

from __future__ import annotations

import dataclasses
import re


@dataclasses.dataclass(frozen=True)
class Chip:
  """One accelerator as one JAX device (the module's docstring says what each field is)."""
  name: str
  platform: str
  device_kinds: tuple[str, ...]
  peak_flops: float | None
  hbm_bandwidth: float | None
  hbm_bytes: int
  source: str

  @property
  def device_kind(self) -> str:
    """The name JAX gives this device (the first of device_kinds)."""
    return self.device_kinds[0]


_TPU_PAGES = "Cloud TPU system architecture, https://cloud.google.com/tpu/docs/"
GiB = 2**30

CHIPS: dict[str, Chip] = {c.name: c for c in (
    Chip("v2", "tpu", ("TPU v2",), None, None, 8 * GiB,
         _TPU_PAGES + "system-architecture-tpu-vm: 16 GiB HBM per chip of two cores "
         "(JAX's device is a core)"),
    Chip("v3", "tpu", ("TPU v3",), None, None, 16 * GiB,
         _TPU_PAGES + "system-architecture-tpu-vm: 32 GiB HBM per chip of two cores "
         "(JAX's device is a core)"),
    Chip("v4", "tpu", ("TPU v4",), 275e12, 1200e9, 32 * GiB,
         _TPU_PAGES + "v4: 275 TFLOP/s bf16, 32 GiB HBM2 at 1,200 GB/s per chip"),
    Chip("v5e", "tpu", ("TPU v5 lite", "TPU v5e"), 197e12, 819e9, 16 * GiB,
         _TPU_PAGES + "v5e: 197 TFLOP/s bf16, 16 GiB HBM2 at 819 GB/s per chip"),
    Chip("v5p", "tpu", ("TPU v5", "TPU v5p"), 459e12, 2765e9, 95 * GiB,
         _TPU_PAGES + "v5p: 459 TFLOP/s bf16, 95 GiB HBM2e at 2,765 GB/s per chip"),
    Chip("v6e", "tpu", ("TPU v6 lite", "TPU v6e"), 918e12, 1638e9, 32 * GiB,
         _TPU_PAGES + "v6e: 918 TFLOP/s bf16, 32 GiB HBM at 1,640 GB/s per chip"),
    Chip("h100", "gpu", ("NVIDIA H100 80GB HBM3",), 989.4e12, 3.35e12, 84_978_434_048,
         "NVIDIA H100 Tensor Core GPU datasheet, H100 SXM5 80GB: 989.4 TFLOP/s bf16 "
         "dense, 3.35 TB/s HBM3; memory as the driver reports it"),
    Chip("h200", "gpu", ("NVIDIA H200",), 989e12, 4.8e12, 143_771 * 2**20,
         "NVIDIA H200 Tensor Core GPU datasheet, H200 SXM 141GB: 989 TFLOP/s bf16 "
         "dense, 4.8 TB/s HBM3e; memory 143,771 MiB as nvidia-smi lists it"),
    Chip("a100", "gpu", ("NVIDIA A100-SXM4-80GB",), 312e12, 2.039e12, 85_100_068_864,
         "NVIDIA A100 Tensor Core GPU datasheet, A100 SXM4 80GB: 312 TFLOP/s bf16 "
         "dense, 2,039 GB/s HBM2e; memory as the driver reports it"),
    Chip("a100-40gb", "gpu", ("NVIDIA A100-SXM4-40GB", "NVIDIA A100"), 312e12, 1.555e12,
         40 * 10**9, "NVIDIA A100 Tensor Core GPU datasheet, A100 40GB: 312 TFLOP/s "
         "bf16 dense, 1,555 GB/s HBM2"),
)}


def of_kind(device_kind: str) -> Chip | None:
  """The chip whose devices JAX names `device_kind`, or None. An NVIDIA kind not in the
  table that names its memory ('NVIDIA A100-PCIE-80GB') is a chip of that memory with
  no published rates."""
  for c in CHIPS.values():
    if device_kind in c.device_kinds:
      return c
  m = re.search(r"(\d+)\s*GB", device_kind)
  if device_kind.startswith("NVIDIA") and m:
    return Chip(device_kind, "gpu", (device_kind,), None, None, int(m.group(1)) * 10**9,
                "the memory named in the device kind")
  return None
