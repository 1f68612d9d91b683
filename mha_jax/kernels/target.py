"""The devices a program is compiled for: what the kernel choice reads, never the
process's default backend.

A trace decides for, in this order:
  1. the target of an active `compile_target(mesh_or_devices)` in this thread (how a
     program is lowered ahead of time for a topology it does not run on);
  2. the mesh in context (`jax.set_mesh(mesh)`, `jax.sharding.use_abstract_mesh`): its
     abstract device names the platform and device kind, on a TPU VM as on a laptop that
     lowers for a TPU topology;
  3. else `jax.devices()[0]`, one device.

`context_mesh()` is the mesh the Pallas kernels run `shard_map` over (kernels/pallas.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import threading
from typing import Iterator

import jax
import numpy as np
from jax.sharding import AbstractDevice, AbstractMesh, Mesh

from mha_jax import chips

PLATFORMS = ("cpu", "gpu", "tpu")


@dataclasses.dataclass(frozen=True)
class Target:
  """What a program is compiled for: platform 'cpu', 'gpu' or 'tpu'; the device kind as
  JAX names it ('TPU v5 lite', 'NVIDIA H100 80GB HBM3', 'cpu'); the devices it spans."""
  platform: str
  device_kind: str
  num_devices: int

  def __post_init__(self):
    if self.platform not in PLATFORMS:
      raise ValueError(f"Target.platform must be one of {PLATFORMS}; got {self.platform!r}")
    if not isinstance(self.num_devices, int) or self.num_devices < 1:
      raise ValueError(f"Target.num_devices must be an integer >= 1; got {self.num_devices!r}")


def _platform(name: str) -> str:
  name = str(name).lower()
  return "gpu" if name in ("cuda", "rocm") else name


def target_of(devices_or_mesh) -> Target:
  """The Target of a jax.sharding.Mesh, an AbstractMesh that names its device, or a
  sequence of devices (process devices or compile-only topology devices from
  jax.experimental.topologies.get_topology_desc(...).devices)."""
  if isinstance(devices_or_mesh, AbstractMesh):
    dev = devices_or_mesh.abstract_device
    if dev is None:
      raise ValueError(f"devices_or_mesh: the abstract mesh {devices_or_mesh} names no "
                       f"device; pass a Mesh or a sequence of devices")
    return Target(_platform(dev.platform), dev.device_kind, max(1, devices_or_mesh.size))
  devices = (list(devices_or_mesh.devices.flat) if isinstance(devices_or_mesh, Mesh)
             else list(devices_or_mesh))
  if not devices or not all(hasattr(d, "platform") and hasattr(d, "device_kind")
                            for d in devices):
    raise ValueError(f"devices_or_mesh must be a Mesh or a non-empty sequence of devices; "
                     f"got {devices_or_mesh!r}")
  return Target(_platform(devices[0].platform), devices[0].device_kind, len(devices))


class _Active(threading.local):
  def __init__(self):
    self.stack: list[tuple[Target, list[str]]] = []


_active = _Active()


@contextlib.contextmanager
def compile_target(mesh_or_devices) -> Iterator[list[str]]:
  """Traces in this thread decide for `mesh_or_devices`' target; yields the list to which
  every kernel choice (dispatch.resolve_impl) made meanwhile is appended.

  The mesh is also put in context, so that the Pallas kernels run shard_map over it and
  the jit caches keep this trace apart from one for other devices (the abstract mesh,
  device kind included, is part of their key): a Mesh through jax.set_mesh, an
  AbstractMesh through jax.sharding.use_abstract_mesh, and a sequence of devices as a
  one-axis ("data",) mesh over them.
  """
  target = target_of(mesh_or_devices)
  chosen: list[str] = []
  _active.stack.append((target, chosen))
  try:
    with _mesh_context(mesh_or_devices):
      yield chosen
  finally:
    _active.stack.pop()


def _mesh_context(mesh_or_devices):
  if isinstance(mesh_or_devices, Mesh):
    return jax.set_mesh(mesh_or_devices)
  if isinstance(mesh_or_devices, AbstractMesh):
    return jax.sharding.use_abstract_mesh(mesh_or_devices)
  devices = list(mesh_or_devices)
  if all(isinstance(d, jax.Device) for d in devices):
    return jax.set_mesh(Mesh(np.asarray(devices), ("data",)))
  t = target_of(devices)    # device-like descriptions (tests): the abstract mesh only
  return jax.sharding.use_abstract_mesh(AbstractMesh(
      (len(devices),), ("data",), abstract_device=AbstractDevice(
          device_kind=t.device_kind, num_cores=None, platform=t.platform)))


def record(kernel: str) -> None:
  """Appends a kernel choice to the active compile_target's list, if any."""
  if _active.stack:
    _active.stack[-1][1].append(kernel)


def context_mesh() -> AbstractMesh | None:
  """The mesh in context (jax.set_mesh or use_abstract_mesh), or None."""
  mesh = jax.sharding.get_abstract_mesh()
  return None if mesh.empty else mesh


def current_target() -> Target:
  """The target a trace now decides for (the module's docstring says which)."""
  if _active.stack:
    return _active.stack[-1][0]
  mesh = context_mesh()
  if mesh is not None and mesh.abstract_device is not None:
    return target_of(mesh)
  d = jax.devices()[0]
  return Target(_platform(d.platform), d.device_kind, mesh.size if mesh is not None else 1)


def mesh_axes(mesh=None) -> tuple:
  """(mesh, its axes not already manual) of `mesh`, or of the mesh in context when None;
  (None, ()) without one."""
  mesh = context_mesh() if mesh is None else mesh
  if mesh is None or mesh.empty:
    return None, ()
  manual = set(getattr(mesh, "manual_axes", ()) or ())
  return mesh, tuple(a for a in mesh.axis_names if a not in manual and mesh.shape[a] > 1)


def shard_specs(mesh_shape: dict, free: tuple[str, ...], b: int, h: int, g: int):
  """(batch axes or None, head axis or None, repeat kv to H): how a call is split over
  a mesh of axis sizes `mesh_shape` whose axes `free` are not yet manual. The batch
  goes over every free axis but "model" (when their product divides B), the heads over
  "model": G key/value heads in blocks of G / m, so each key/value head's query heads
  stay on its shard, or, when m does not divide G but divides H, the key/value heads
  repeated to H first. What an axis does not divide stays whole on each of its devices.
  """
  batch = tuple(a for a in free if a != "model" and mesh_shape[a] > 1)
  if not batch or b % math.prod(mesh_shape[a] for a in batch):
    batch = None
  m = mesh_shape.get("model", 1) if "model" in free else 1
  if m > 1 and g % m == 0:
    return batch, "model", False
  if m > 1 and h % m == 0:
    return batch, "model", True
  return batch, None, False


def hbm_bytes(device_kind: str) -> int | None:
  """The memory of one device of this kind (mha_jax.chips, the one table of published
  chip numbers), or None when unknown. The kernel choice reads this, not the device's
  own report, so that a laptop lowering for a TPU and the TPU VM choose the same."""
  chip = chips.of_kind(device_kind)
  return None if chip is None else chip.hbm_bytes
