"""`mha-jax plan`: a job's programs compiled ahead of time for a named topology, from
shapes alone (no weights, no accelerator), with their memory, FLOPs, kernels and time.

    plan = make_plan(PlanOptions(topology="v5e:2x2", job="train"), config="configs/lm.py")

A topology is a TPU slice under its standard name (`v5e:2x2`, `v5p:2x2x1`, `v4:2x2x1`,
`v6e:2x4`; TOPOLOGIES), compiled for through libtpu's compile-only devices
(`jax.experimental.topologies`, the `tpu` extra), `h100:N`, `h200:N` or `a100:N` (N
compile-only GPUs through mha_jax.gpu_targets, the CUDA plugin; FLOPs from its
`cost_analysis`, the custom calls it cannot count listed in `uncounted`), or `cpu:N`
(N host devices). Params
come from `jax.eval_shape` (a config trained here), from the family adapter's tensor
table (a Hugging Face config.json) or from a checkpoint's metadata (a workdir); every
argument is a `jax.ShapeDtypeStruct` with its NamedSharding on a (data, model) mesh of
the topology's devices, laid out as training lays it out (`train/sharding.py`).

Per program (the train step, the eval step, the forward, a study's sweep):
  per_device   bytes on one device: arguments, outputs, temps, total (= arguments +
               outputs + temps - the outputs aliased onto donated arguments) and the
               chip's HBM. Temps are read from the compiled program's buffer assignment
               (XLA's dump of it), summed over every memory space: on TPU v5e and v6e
               XLA places a program's temporaries in VMEM (memory space 1), which
               `memory_analysis().temp_size_in_bytes` (memory space 0 only) leaves out
               (it reads 0 there); `memory_spaces` gives the split.
  flops        per device: XLA's cost analysis (`xla_flops`), which counts a while
               loop's body once whatever its trip count (a scan, a fori_loop, the blocked
               kernel's key blocks), with the dots of each loop body added for its other
               iterations, counted from the optimised HLO (`matmul_flops`); `loops` lists
               the trip counts (None: unknown, counted once). The loops' other ops
               (elementwise) and bytes_accessed stay as XLA counts them, once a body.
  bytes_accessed   the compiled program's cost analysis, per device.
  est_seconds  max(flops / peak bf16 FLOP/s, bytes accessed / HBM bandwidth)
               (a roofline bound from mha_jax.chips, the one table of published chip numbers;
               None on CPU, which has no published peak).
  mosaic_calls  the Pallas TPU kernel calls (Mosaic custom calls) in the compiled
               program; 0 on other platforms.
  attention_kernels   the kernels dispatch chose while the program was traced: every
               program is lowered inside `dispatch.compile_target(mesh)`, so the choice is
               the one the topology's own devices make (kernels/target.py).
A program whose arguments alone (a train step's: with its gradients, which global-norm
clipping holds at once) pass the HBM is not compiled: fits false from its shapes
(`compiled: false`, `ruled_out`; total is that least). A job that does not fit is a plan
with fits false and `suggestion`: the first of the same topology with a model axis over
the heads, then the next larger slices of the same generation, on which every program
fits: the candidates ruled out from shapes are skipped uncompiled, the others compiled
(at most --search), each until its first program that does not fit.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import datetime
import functools
import glob
import importlib.util
import math
import os
import re
import tempfile
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from mha_jax import chips
from mha_jax import config as mc
from mha_jax import gpu_targets
from mha_jax import machine
from mha_jax import storage
from mha_jax.errors import UserError
from mha_jax.kernels import dispatch
from mha_jax.settings import setting
from mha_jax.train import sharding

JOBS = ("train", "forward", "patch", "circuit", "taxonomy")
DTYPES = ("float32", "bfloat16")


# The slice shapes Cloud TPU offers, smallest first (chips = the product).
_2D = ("1x1", "2x2", "2x4", "4x4", "4x8", "8x8", "8x16", "16x16")
_3D = ("2x2x1", "2x2x2", "2x2x4", "2x4x4", "4x4x4", "4x4x8", "4x8x8", "8x8x8", "8x8x16",
       "8x16x16")
SLICES = {"v4": _3D, "v5e": _2D, "v5p": _3D, "v6e": _2D}
TOPOLOGIES = tuple(f"{g}:{s}" for g, shapes in SLICES.items() for s in shapes)
TPU_EXTRA = "pip install 'mha-jax[tpu]'"


@dataclasses.dataclass(frozen=True, kw_only=True)
class PlanOptions:
  """The settings of `plan`."""
  topology: str = setting(help="a TPU slice (v5e:2x2, v5p:2x2x1, v4:2x2x1, v6e:2x4, ...) "
                          "or cpu:N (N host devices)")
  job: str = setting("train", choices=JOBS, help="the programs planned: train (train and "
                     "eval steps), forward, patch (the patching sweep), circuit (EAP) or "
                     "taxonomy (the head taxonomy's causal checks and detectors)")
  hf_config: str | None = setting(None, path=True, help="a Hugging Face config.json of a "
                                  "supported decoder family (instead of --config)")
  batch: int | None = setting(None, lo=1, help="the batch (pairs for patch and circuit; "
                              "default: the config's train.batch_size, else 8)")
  seq: int | None = setting(None, lo=2, help="the sequence length T (default: the config's "
                            "model.max_len, else 2048; 32 for patch and circuit)")
  mesh: str | None = setting(None, help="data=D,model=M (default: the config's mesh, else "
                             "every device on data)")
  dtype: str = setting("float32", choices=DTYPES, help="the params' dtype (a Hugging "
                       "Face config's, as `import --dtype`)")
  search: int = setting(3, lo=0, help="when a job does not fit: how many other meshes or "
                        "larger slices to compile for the smallest that fits")
  memory_budget: str | None = setting(None, metavar="BYTES", help="bytes a study program "
                                      "(patch, circuit, taxonomy) may hold on one device, e.g. "
                                      "4GB: its chunk sizes are chosen from it (default: half "
                                      "the chip's HBM less the params per device)")


# ------------------------------------------------------------------ topologies

@dataclasses.dataclass
class Topology:
  """Devices to compile for: name, platform, device_kind, devices, chip (None on CPU),
  hbm (bytes per device: the chip's, or the host's memory shared by the N devices)."""
  name: str
  platform: str
  device_kind: str
  devices: list
  chip: chips.Chip | None
  hbm: int


def _refuse_topology(name) -> None:
  gpus = ", ".join(f"{g}:N" for g in gpu_targets.GPUS)
  raise UserError(f"topology must be cpu:N, {gpus} (N GPUs) or one of "
                  f"{', '.join(TOPOLOGIES)}; got {name!r}", setting="topology")


def _gpu_topology(name: str, gpu: str, n: int) -> Topology:
  """n compile-only GPUs (gpu_targets: needs the CUDA plugin, refused with its install
  line without it)."""
  try:
    gpu_targets.topology_shape(n)
    devs = gpu_targets.gpu_devices(gpu, n)
  except ValueError as e:
    raise UserError(f"topology {name!r}: {e}", setting="topology") from None
  except gpu_targets.GpuTargetsUnavailable as e:
    raise UserError(f"topology {name!r}: {e}", setting="topology") from None
  chip = gpu_targets.chip(gpu)
  return Topology(name, "gpu", devs[0].device_kind, devs, chip, chip.hbm_bytes)


def _host_memory() -> int:
  with open("/proc/meminfo") as f:
    for line in f:
      if line.startswith("MemTotal:"):
        return int(line.split()[1]) * 1024
  return dispatch.memory_limit()[0]


def _cpu_devices(n: int) -> list:
  """n host devices: asks JAX for them when its backends have not started yet."""
  with contextlib.suppress(RuntimeError):    # started: the devices it has
    jax.config.update("jax_num_cpu_devices", max(n, jax.config.jax_num_cpu_devices))
  have = jax.devices("cpu")
  if len(have) < n:
    raise UserError(f"topology cpu:{n} needs {n} host devices; this process has "
                    f"{len(have)} (start it with XLA_FLAGS="
                    f"--xla_force_host_platform_device_count={n})", setting="topology")
  return have[:n]


def topology(name: str) -> Topology:
  """The devices of a topology name (refused by name, with the list, when unknown)."""
  m = re.fullmatch(r"cpu:(\d+)", str(name))
  if m:
    n = int(m.group(1))
    if n < 1:
      _refuse_topology(name)
    devs = _cpu_devices(n)
    return Topology(name, "cpu", devs[0].device_kind, devs, None, _host_memory() // n)
  gen, _, shape = str(name).partition(":")
  if gen in gpu_targets.GPUS and re.fullmatch(r"\d+", shape):
    return _gpu_topology(name, gen, int(shape))
  if gen not in SLICES or shape not in SLICES[gen]:
    _refuse_topology(name)
  if importlib.util.find_spec("libtpu") is None:
    raise UserError(f"topology {name!r} compiles with the TPU compiler (libtpu), which is "
                    f"not installed: {TPU_EXTRA}", setting="topology")
  from jax.experimental import topologies
  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")   # compile only: no TPU is opened
  kw = {"chip_config_name": "megacore"} if gen in ("v4", "v5p") else {}
  if math.prod(int(x) for x in shape.split("x")) == 1:
    kw["chips_per_host_bounds"] = (1, 1, 1)
  devs = list(topologies.get_topology_desc(topology_name=name, platform="tpu", **kw).devices)
  chip = chips.CHIPS[gen]
  return Topology(name, "tpu", devs[0].device_kind, devs, chip, chip.hbm_bytes)


def larger(name: str) -> list[str]:
  """The slices of the same generation after `name`, smallest first."""
  gen, _, shape = name.partition(":")
  if gen not in SLICES:
    return []
  shapes = SLICES[gen]
  return [f"{gen}:{s}" for s in shapes[shapes.index(shape) + 1:]]


# ------------------------------------------------------------------ one program

_ALLOC = re.compile(r"^allocation \d+: size (\d+)(?:, color (\d+))?(.*):$", re.M)
_SPACE = re.compile(r"^Memory Space: (\S+) \(color=(\d+)\)", re.M)


def temp_bytes(dump_dir: str) -> dict[str, int]:
  """{memory space: bytes} of the temporaries in XLA's buffer assignment dumped into
  dump_dir: every allocation that is not a parameter, an output, a constant or
  thread-local, by memory space (color; named from the memory-usage report)."""
  files = [f for f in glob.glob(os.path.join(dump_dir, "*buffer-assignment.txt"))]
  if not files:
    raise RuntimeError(f"XLA wrote no buffer assignment into {dump_dir}")
  best: dict[str, int] = {}
  for path in files:
    with open(path) as f:
      text = f.read()
    names = {}
    report = path.replace("buffer-assignment.txt", "memory-usage-report.txt")
    if os.path.exists(report):
      with open(report) as f:
        names = {c: n for n, c in _SPACE.findall(f.read())}
    out: dict[str, int] = {}
    for size, color, tags in _ALLOC.findall(text):
      if any(t in tags for t in ("parameter", "live-out", "constant", "thread-local")):
        continue
      color = color or "0"
      space = names.get(color, "default" if color == "0" else f"color {color}")
      out[space] = out.get(space, 0) + int(size)
    if sum(out.values()) >= sum(best.values()):
      best = out
  return best


@contextlib.contextmanager
def _no_compile_cache():
  """Every compile runs (an executable from the persistent cache comes without its
  buffer assignment); JAX decides once whether it uses the cache, so it is reset to
  decide again, before and after."""
  from jax.experimental.compilation_cache import compilation_cache
  was = jax.config.jax_enable_compilation_cache
  jax.config.update("jax_enable_compilation_cache", False)
  compilation_cache.reset_cache()
  try:
    yield
  finally:
    jax.config.update("jax_enable_compilation_cache", was)
    compilation_cache.reset_cache()


def _cost(compiled, platform: str) -> dict:
  if platform == "gpu":    # the CUDA plugin has no cost analysis
    return gpu_targets.cost_analysis(compiled)
  c = compiled.cost_analysis()
  c = c[0] if isinstance(c, (list, tuple)) else c
  return c or {}


_COMP = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s+\(.*\)\s+->\s+.*\{\s*$")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%([\w.\-]+)\s*=\s*\w+\[([\d,]*)\]\S*\s+([\w\-]+)"
                    r"\(([^)]*)\)(.*)$")
_CALLS = re.compile(r"\b(calls|to_apply|body|condition|true_computation|false_computation)"
                    r"=%([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_TRIPS = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')


def _dims(text: str) -> list[int]:
  return [int(x) for x in text.split(",") if x]


def _dot_flops(out: str, operands: str, attrs: str, shapes: dict) -> int:
  """2 x output elements x contracted size of one dot."""
  lhs = shapes.get(operands.split(",")[0].strip().lstrip("%"))
  m = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", attrs)
  if lhs is None or m is None:
    return 0
  return 2 * math.prod(_dims(out)) * math.prod(lhs[i] for i in _dims(m.group(1)))


def _window(attrs: str, n: int) -> list[dict]:
  """A convolution's window, per spatial dimension: size, stride, pad (low), lhs and rhs
  dilation (XLA's `window={size=AxB stride=.. pad=lo_hi.. lhs_dilate=.. rhs_dilate=..}`)."""
  m = re.search(r"window=\{([^}]*)\}", attrs)
  fields = dict(f.split("=", 1) for f in (m.group(1).split() if m else []))
  get = lambda key, d: [int(x.split("_")[0]) for x in fields[key].split("x")] if key in fields \
      else [d] * n
  return [dict(size=a, stride=b, pad=c, lhs=d, rhs=e) for a, b, c, d, e in zip(
      get("size", 1), get("stride", 1), get("pad", 0), get("lhs_dilate", 1),
      get("rhs_dilate", 1))]


def _valid_taps(w: dict, lhs: int, out: int) -> int:
  """The (output position, window tap) pairs of one spatial dimension that read an input
  element (not padding, not a hole of the lhs dilation): a dot written as a convolution
  with a dilated or padded window does no work on the others (XLA counts the same)."""
  pos = (np.arange(out)[:, None] * w["stride"] + np.arange(w["size"])[None] * w["rhs"]
         - w["pad"])
  return int(np.sum((pos >= 0) & (pos % w["lhs"] == 0) & (pos // w["lhs"] < lhs)))


def _conv_flops(out: str, operands: str, attrs: str, shapes: dict) -> int:
  """2 x (batch x output features) x input features per group x the valid window taps of
  one convolution (the TPU compiler writes dots as convolutions, batched ones with
  dilated windows: dim_labels=01bf_01oi->01bf)."""
  names = [o.strip().lstrip("%") for o in operands.split(",")]
  m = re.search(r"dim_labels=(\w+)_(\w+)->(\w+)", attrs)
  if len(names) < 2 or m is None or names[0] not in shapes:
    return 0
  lhs, o = shapes[names[0]], _dims(out)
  ll, ol = m.group(1), m.group(3)
  spatial = sorted(c for c in ll if c.isdigit())
  groups = re.search(r"feature_group_count=(\d+)", attrs)
  taps = math.prod(_valid_taps(w, lhs[ll.index(c)], o[ol.index(c)])
                   for c, w in zip(spatial, _window(attrs, len(spatial))))
  feats = lhs[ll.index("f")] // (int(groups.group(1)) if groups else 1)
  return 2 * o[ol.index("b")] * o[ol.index("f")] * feats * taps


_CONST = re.compile(r"^\s*%([\w.\-]+)\s*=\s*s32\[\]\S*\s+constant\((-?\d+)\)")
_BOUND = re.compile(r"^\s*ROOT\s+%[\w.\-]+\s*=\s*pred\[\]\S*\s+compare\(%[\w.\-]+,\s*"
                    r"%([\w.\-]+)\),\s*direction=LT")


def _hlo_graph(hlo: str):
  """(entry, {computation: (dot FLOPs, [(callee, trip count or None for a while body;
  1 otherwise)])}, the while loops' trip counts) of an HLO module's text. A loop's trip
  count is XLA's known_trip_count where it gives one (CPU, GPU), else its condition's
  `i < constant` bound (TPU; a scan, map or fori_loop from 0 by 1)."""
  graph, shapes, entry, cur, whiles, consts, bound = {}, {}, None, None, [], {}, {}
  for line in hlo.splitlines():
    m = _COMP.match(line)
    if m:
      cur = m.group(2)
      graph[cur] = [0, []]
      entry = cur if m.group(1) else entry
      continue
    if cur is None:
      continue
    c, b = _CONST.match(line), _BOUND.match(line)
    if c:
      consts[(cur, c.group(1))] = int(c.group(2))
    if b and (cur, b.group(1)) in consts:
      bound[cur] = consts[(cur, b.group(1))]
    i = _INSTR.match(line)
    if i:
      shapes[i.group(1)] = _dims(i.group(2))
      flops = {"dot": _dot_flops, "convolution": _conv_flops}.get(i.group(3))
      if flops:
        graph[cur][0] += flops(i.group(2), i.group(4), i.group(5), shapes)
    trips = _TRIPS.search(line)
    calls = dict((kind, callee) for kind, callee in _CALLS.findall(line))
    for kind, callee in _CALLS.findall(line):
      if kind == "body":
        whiles.append((cur, len(graph[cur][1]), calls.get("condition"),
                       int(trips.group(1)) if trips else None))
      graph[cur][1].append((callee, 1))
    for br in _BRANCHES.findall(line):
      graph[cur][1].extend((c.strip().lstrip("%"), 1) for c in br.split(","))
  loops = []
  for caller, at, cond, n in whiles:
    n = n if n is not None else bound.get(cond)
    graph[caller][1][at] = (graph[caller][1][at][0], n)
    loops.append(n)
  return entry, graph, loops


def matmul_flops(hlo: str) -> dict:
  """The dots of an optimised HLO module's text, counted two ways: `once` (every
  computation once, as XLA's cost analysis counts a while body) and `counted` (a while
  body times its known trip count; an unknown one once); `loops`: the trip counts of
  its while loops (None: unknown)."""
  entry, graph, loops = _hlo_graph(hlo)

  @functools.cache
  def total(comp: str, trips: bool) -> int:
    own, calls = graph.get(comp, (0, []))
    return own + sum(total(c, trips) * ((n or 1) if trips else 1) for c, n in calls)
  if entry is None:
    return {"once": 0, "counted": 0, "loops": loops}
  return {"once": total(entry, False), "counted": total(entry, True), "loops": loops}


_OOM_TEMPS = re.compile(r"required for HLO temporaries \(([\d.]+)([KMGT]?)\)")
_UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def shard_bytes(tree) -> int:
  """Bytes on one device of a tree of ShapeDtypeStructs (their sharding's shard shape;
  the whole array without one)."""
  def one(a):
    sh = getattr(a, "sharding", None)
    shape = sh.shard_shape(a.shape) if sh is not None else a.shape
    return math.prod(shape) * jnp.dtype(a.dtype).itemsize
  return int(sum(one(a) for a in jax.tree.leaves(tree) if hasattr(a, "shape")))


def _out_of_memory(name, message, args, lowered, donate, topo, mesh, chosen) -> dict:
  """A program the compiler refused for want of memory (libtpu does, when the
  temporaries pass the HBM): fits false, arguments and outputs from the shapes, temps
  from the compiler's message (None when it gives none); no FLOPs."""
  m = _OOM_TEMPS.search(message)
  temps = None if m is None else int(float(m.group(1)) * _UNITS[m.group(2)])
  arguments, outputs = shard_bytes(args), shard_bytes(lowered.out_info)
  donated = shard_bytes([args[i] for i in donate])
  total = arguments + outputs - min(donated, outputs) + (temps or 0)
  return {"name": name, "mesh": dict(mesh.shape), "flops": None, "xla_flops": None,
          "loops": [], "bytes_accessed": None,
          "per_device": {"arguments": arguments, "outputs": outputs, "temps": temps,
                         "total": total, "hbm": int(topo.hbm)},
          "memory_spaces": {}, "fits": False, "attention_kernels": sorted(set(chosen)),
          "est_seconds": None, "compiler": message.splitlines()[0][:300]}


# How compile_program runs in `suggest`: None (compile every program), or {"bounds_only":
# True} (rule candidates out from shapes, nothing compiled), or {"bounds_only": False,
# "missed": bool} (compile until the first program that does not fit).
_MODE: contextvars.ContextVar = contextvars.ContextVar("plan_mode", default=None)


def _ruled_out(name: str, args: tuple, floor: int, topo: Topology, mesh, why: str) -> dict:
  """A program not compiled: its arguments' bytes per device from their shapes, plus the
  temporaries known from shapes alone (floor), are its least total; fits false when that
  passes the HBM, None (unknown) otherwise."""
  arguments = shard_bytes(args)
  least = arguments + floor
  return {"name": name, "mesh": dict(mesh.shape), "flops": None, "xla_flops": None,
          "loops": [], "bytes_accessed": None,
          "per_device": {"arguments": arguments, "outputs": None, "temps": floor or None,
                         "total": least, "hbm": int(topo.hbm)},
          "memory_spaces": {}, "fits": False if least > topo.hbm else None,
          "attention_kernels": [], "est_seconds": None, "compiled": False, "ruled_out": why}


def compile_program(name: str, fn: Callable, args: tuple, topo: Topology, mesh, *,
                    donate: tuple = (), out_shardings=None, floor: int = 0) -> dict:
  """One program of a plan: `fn` jitted, traced under the topology's kernel choice,
  compiled for its devices from `args` (ShapeDtypeStructs), measured. floor: bytes per
  device of temporaries the program must hold at once, known from shapes (a train
  step's gradients). When the arguments and the floor alone pass the HBM, the program is
  not lowered nor compiled: fits false from shapes (`_ruled_out`)."""
  mode = _MODE.get()
  if shard_bytes(args) + floor > topo.hbm:
    return _ruled_out(name, args, floor, topo, mesh, "its arguments and gradients alone "
                      "pass the HBM" if floor else "its arguments alone pass the HBM")
  if mode is not None and (mode["bounds_only"] or mode["missed"]):
    return _ruled_out(name, args, floor, topo, mesh, "searching: " + (
        "bounds only" if mode["bounds_only"] else "an earlier program does not fit"))
  out = _compile(name, fn, args, topo, mesh, donate, out_shardings)
  if mode is not None and not out["fits"]:
    mode["missed"] = True
  return out


def _compile(name: str, fn: Callable, args: tuple, topo: Topology, mesh, donate,
             out_shardings) -> dict:
  t0, c0 = time.time(), time.process_time()
  jitted = jax.jit(fn, donate_argnums=donate, out_shardings=out_shardings)
  with dispatch.compile_target(mesh) as chosen:
    lowered = jitted.lower(*args)
  with tempfile.TemporaryDirectory(prefix="mha-jax-plan-") as d, _no_compile_cache():
    try:
      compiled = lowered.compile(compiler_options={"xla_dump_to": d})
    except jax.errors.JaxRuntimeError as e:
      if "RESOURCE_EXHAUSTED" not in str(e):
        raise
      return _out_of_memory(name, str(e), args, lowered, donate, topo, mesh, chosen)
    spaces = temp_bytes(d)
  took = {"compile_wall_s": round(time.time() - t0, 1),
          "compile_cpu_s": round(time.process_time() - c0, 1)}
  mem = compiled.memory_analysis()
  temps = sum(spaces.values())
  total = (mem.argument_size_in_bytes + mem.output_size_in_bytes + temps
           - mem.alias_size_in_bytes)
  cost = _cost(compiled, topo.platform)
  xla_flops, accessed = float(cost.get("flops", 0.0)), float(cost.get("bytes accessed", 0.0))
  text = compiled.as_text()
  mm = matmul_flops(text)
  flops = xla_flops + mm["counted"] - mm["once"]   # the loops' dots times their trips
  est = None
  if topo.chip is not None:
    est = max(flops / topo.chip.peak_flops, accessed / topo.chip.hbm_bandwidth)
  return {"name": name, "mesh": dict(mesh.shape), "flops": flops, "xla_flops": xla_flops,
          "loops": mm["loops"], "bytes_accessed": accessed,
          "per_device": {"arguments": int(mem.argument_size_in_bytes),
                         "outputs": int(mem.output_size_in_bytes), "temps": int(temps),
                         "total": int(total), "hbm": int(topo.hbm)},
          "memory_spaces": spaces, "fits": bool(total <= topo.hbm),
          "attention_kernels": sorted(set(chosen)), "est_seconds": est,
          "mosaic_calls": text.count('custom_call_target="tpu_custom_call"'), **took,
          **({"uncounted": cost["uncounted"]} if cost.get("uncounted") else {})}


# ------------------------------------------------------------------ what is planned

@dataclasses.dataclass
class Source:
  """The model a plan compiles: its config (cfg), task, params (ShapeDtypeStructs),
  head count, the train group its train step uses, and the batch shapes of its steps
  ({"train", "eval", "forward"}: dicts of ShapeDtypeStructs without shardings)."""
  cfg: object
  task: object
  params: dict
  heads: int
  train: object
  batches: dict
  where: str


def _sds(shape, dtype) -> jax.ShapeDtypeStruct:
  return jax.ShapeDtypeStruct(tuple(int(x) for x in shape), jnp.dtype(dtype))


def _of(tree) -> dict:
  """ShapeDtypeStructs of a tree of arrays (numpy or abstract)."""
  return jax.tree.map(lambda x: _sds(np.shape(x), x.dtype), tree)


def _rows_batch(batch: dict, rows: int) -> dict:
  return {k: _sds((rows,) + tuple(v.shape[1:]), v.dtype) for k, v in batch.items()}


def from_training_config(spec: str, overrides, opts: PlanOptions) -> Source:
  """A config trained here (configs/*.py with --config.KEY=VALUE overrides): params from
  its init under eval_shape, batches shaped as its task's."""
  from mha_jax import tasks
  cfg = mc.load_config(spec)
  rest = mc.apply_overrides(cfg, overrides)
  if rest:
    raise UserError(f"unrecognized arguments: {' '.join(rest)}")
  mc.validate(cfg)
  if opts.seq is not None:
    raise UserError(f"seq is set by the config (model.max_len, data); got --seq {opts.seq} "
                    f"with --config {spec}", setting="seq")
  task = tasks.build(cfg, None, read_only=True)
  return from_config_task(cfg, task, opts, spec)


# The leaves of the decoder families' params (mha_jax/pretrained/adapters.py's targets):
# their shapes from the family's settings s (d, h, g, k, f, v, max_len).
def _leaf_shape(leaf: str, kind: str, s: dict) -> tuple:
  d, h, g, k, f, v = s["d"], s["h"], s["g"], s["k"], s["f"], s["v"]
  if leaf in ("q_norm", "k_norm"):
    return {"head_norm": (k,), "whole_q": (h, k), "whole_k": (g, k)}[kind]
  return {"wq": (d, h, k), "wk": (d, g, k), "wv": (d, g, k), "wo": (h, k, d), "bq": (h, k),
          "bk": (g, k), "bv": (g, k), "bo": (d,), "w_gate": (d, f), "w_up": (d, f),
          "w_down": (f, d), "b_gate": (f,), "b_up": (f,), "b_down": (d,), "scale": (d,),
          "bias": (d,), "embed": (v, d), "pos_embed": (s["max_len"], d),
          "unembed": (d, v)}[leaf]


_FUSED = {"qkv": ("wq", "wk", "wv"), "neox_qkv": ("wq", "wk", "wv"),
          "gpt2_qkv": ("wq", "wk", "wv"), "gate_up": ("w_gate", "w_up")}


def hf_param_shapes(family, s: dict, dtype) -> dict:
  """The params `adapters.build_params` makes for a family's settings, as
  ShapeDtypeStructs (no tensor is read: the family's table says which it takes)."""
  flags = dict(attn_bias=s.get("attn_bias", False), o_bias=s.get("o_bias", False),
               mlp_bias=s.get("mlp_bias", False), untied=not s["tied"])

  def rows(table, out):
    for name, kind, target, cond in table:
      if cond is not None and not flags[cond]:
        continue
      subs = _FUSED.get(kind, ("",))
      if name.endswith(".bias") and kind in _FUSED:
        subs = ("q", "k", "v")
      for sub in subs:
        path = target + (sub if target.endswith(".b") else ("." + sub if sub else ""))
        *parents, leaf = path.split(".")
        node = out
        for p in parents:
          node = node.setdefault(p, {})
        node[leaf] = _sds(_leaf_shape(leaf, kind, s), dtype)
    return out

  params = rows(family.top, {})
  lm = params.setdefault("lm", {})
  for i in range(s["n"]):
    lm[f"layer_{i}"] = rows(family.layer, {})
  return params


def _imported_cfg(mcfg: dict, dtype: str, where: str):
  from mha_jax.pretrained import importer
  d = {"task": "pretrained_lm", "model": {**mcfg, "impl": "auto", "dtype": dtype},
       "tokenizer": {"bos_id": -1, "eos_id": -1, "pad_id": -1, "add_bos": False,
                     "chat_template": ""},
       "source": {"name": "", "path": where, "sha256": ""},
       "data": {"kind": "text", "text_files": []},
       "eval": dict(importer.EVAL_DEFAULTS["pretrained_lm"])}
  cfg = mc.from_dict(d)
  mc.validate(cfg)
  return cfg


def _token_batches(task, rows: int, seq: int) -> dict:
  tokens = {"tokens": _sds((rows, seq + 1), np.int32)}
  return {"train": tokens, "forward": tokens,
          "eval": dict(tokens, weight=_sds((rows,), np.float32))}


def from_hf_config(path: str, opts: PlanOptions) -> Source:
  """A Hugging Face config.json of a decoder family: its params' shapes from the
  family's adapter, the model as `mha-jax import` would make it (no weights read)."""
  from mha_jax.pretrained import adapters, hf_folder
  from mha_jax.tasks import pretrained_lm
  if not storage.isfile(path):
    raise UserError(f"hf_config {path!r}: no such file", setting="hf_config")
  try:
    hf = storage.read_json(path)
  except ValueError as e:
    raise UserError(f"hf_config {path!r} is not valid JSON: {e}", setting="hf_config") from None
  arch = hf_folder.architecture(hf)
  if arch not in adapters.FAMILIES:
    raise UserError(f"hf_config {path!r}: model_type={hf.get('model_type')!r} is not a "
                    f"decoder family plan knows; supported: {sorted(adapters.FAMILIES)}",
                    setting="hf_config")
  fam = adapters.FAMILIES[arch]
  hf = dict(hf, model_type=hf.get("model_type") or fam.model_types[0])
  s = adapters.read_config(hf, fam, path)
  cfg = _imported_cfg(adapters.model_config(s, fam), opts.dtype, path)
  task = pretrained_lm.PretrainedLMTask(cfg, None)
  params = hf_param_shapes(fam, s, opts.dtype)
  return _imported_source(cfg, task, params, opts, path)


def _imported_source(cfg, task, params, opts: PlanOptions, where: str) -> Source:
  study = opts.job in ("patch", "circuit", "taxonomy")
  rows, seq = opts.batch or 8, opts.seq or (32 if study else min(2048, int(cfg.model.max_len)))
  train = mc.train_defaults()
  return Source(cfg, task, params, int(cfg.model.num_heads), train,
                _token_batches(task, rows, seq), where)


def _plain_shapes(meta):
  """A checkpoint's param metadata (orbax's tree, whose own pytree nodes do not survive
  jit's flatten and unflatten) as plain dicts of ShapeDtypeStructs."""
  if hasattr(meta, "shape") and hasattr(meta, "dtype"):
    return _sds(meta.shape, meta.dtype)
  return {k: _plain_shapes(v) for k, v in meta.items()}


def from_workdir(workdir: str, opts: PlanOptions) -> Source:
  """A run's workdir (trained here or imported): its config, and its params' shapes
  from the newest checkpoint's metadata (nothing is restored)."""
  from mha_jax import tasks
  from mha_jax.train import checkpoint as ckpt_lib
  path = storage.join(workdir, "config.json")
  if not storage.isfile(path):
    raise UserError(f"workdir {workdir!r} has no config.json", setting="workdir")
  cfg = mc.from_dict(storage.read_json(path))
  ckpts = ckpt_lib.Checkpoints(workdir, read_only=True, this_process_only=True)
  try:
    step = ckpts.latest_step()
    if step is None:
      raise UserError(f"workdir {workdir!r} has no checkpoint", setting="workdir")
    meta = ckpts.manager.item_metadata(step)["params"]
  finally:
    ckpts.close()
  params = _plain_shapes(meta)
  task = tasks.build(cfg, workdir, read_only=True)
  if cfg.task == "pretrained_lm":
    return _imported_source(cfg, task, params, opts, workdir)
  src = from_config_task(cfg, task, opts, workdir)
  return dataclasses.replace(src, params=params)


def from_config_task(cfg, task, opts: PlanOptions, where: str) -> Source:
  """Batches of a run trained here (its task's own shapes)."""
  train = _of(task.train_batch(0))
  rows = opts.batch or cfg.train.batch_size
  ev, w = next(iter(task.eval_batches("valid", opts.batch or cfg.eval.batch_size)))
  evb = dict(_of(ev), weight=_sds(w.shape, np.float32))
  params = jax.eval_shape(task.init_params, jax.random.PRNGKey(0))
  return Source(cfg, task, params, int(cfg.model.num_heads), cfg.train,
                {"train": _rows_batch(train, rows), "eval": evb,
                 "forward": _rows_batch(train, rows)}, where)


# ------------------------------------------------------------------ the programs

def placed(tree, shardings):
  return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                      tree, shardings)


def batch_on(batch: dict, mesh) -> dict:
  """A batch's ShapeDtypeStructs with their rows over the mesh's data axis."""
  n = mesh.shape["data"]
  for k, v in batch.items():
    if v.shape[0] % n:
      raise UserError(f"batch: {v.shape[0]} rows ({k!r}) do not split over the mesh's "
                      f"data axis of {n} devices", setting="batch")
  return {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=NamedSharding(
      mesh, P("data", *[None] * (len(v.shape) - 1)))) for k, v in batch.items()}


def _step_cfg(src: Source):
  """What make_train_step reads of a config (an imported model's has no dropout)."""
  import ml_collections
  if "dropout" in src.cfg.model:
    return src.cfg
  return ml_collections.ConfigDict({"train": src.train, "model": {"dropout": 0.0}})


def train_programs(src: Source, topo: Topology, mesh) -> list[dict]:
  """The training loop's step (donating params and optimizer state, as train/loop.py
  jits it) and the evaluation's metrics step."""
  from mha_jax.train import loop
  opt = loop.make_optimizer(src.train)
  state = (src.params, jax.eval_shape(opt.init, src.params))
  shard = sharding.shardings(state, mesh)
  rep = NamedSharding(mesh, P())
  step = loop.make_train_step(src.task, opt, _step_cfg(src))
  args = (*placed(state, shard), batch_on(src.batches["train"], mesh),
          jax.ShapeDtypeStruct((), jnp.int32, sharding=rep),
          jax.ShapeDtypeStruct((2,), jnp.uint32, sharding=rep))
  # global-norm clipping needs every gradient before any update: all held at once
  grads = shard_bytes(placed(src.params, shard[0])) if src.train.clip > 0 else 0
  train = compile_program("train_step", step, args, topo, mesh, donate=(0, 1),
                          out_shardings=(*shard, rep), floor=grads)

  def eval_step(params, batch):
    b = {k: v for k, v in batch.items() if k != "weight"}
    return src.task.loss(params, b, example_weight=batch["weight"])[1]
  evaluate = compile_program("eval_step", eval_step,
                             (placed(src.params, shard[0]),
                              batch_on(src.batches["eval"], mesh)), topo, mesh)
  return [train, evaluate]


def forward_programs(src: Source, topo: Topology, mesh) -> list[dict]:
  """The model's forward: logits (B, T, V) of a batch."""
  shard = sharding.shardings(src.params, mesh)
  return [compile_program("forward", lambda p, b: src.task.apply(p, b),
                          (placed(src.params, shard), batch_on(src.batches["forward"], mesh)),
                          topo, mesh)]


def job_programs(src: Source, topo: Topology, mesh, job: str,
                 opts: PlanOptions | None = None) -> list[dict]:
  if job == "train":
    if not getattr(src.task, "trainable", True) and src.cfg.task != "pretrained_lm":
      raise UserError(f"job train: task {src.cfg.task!r} is not trained", setting="job")
    return train_programs(src, topo, mesh)
  if job == "forward":
    return forward_programs(src, topo, mesh)
  return study_programs(src, topo, mesh, job, opts or PlanOptions(topology=topo.name))


def study_budget(opts: PlanOptions, topo: Topology, mesh, src: Source) -> int:
  """Bytes a study program may hold on one device of the target: --memory-budget, else
  memory.DEFAULT_FRACTION (as a study's own default) of the HBM less the params' bytes
  per device. The studies' byte models count a whole program on one device, an upper
  bound of one device's share on a mesh."""
  from mha_jax.toolkit import memory
  if opts.memory_budget is not None:
    return memory.parse_bytes(opts.memory_budget)
  params = shard_bytes(placed(src.params, sharding.shardings(src.params, mesh)))
  return int(memory.DEFAULT_FRACTION * max(0, topo.hbm - params))


def _study(src: Source, mesh, budget: int):
  """A patching Study of the job's pairs (rows x seq tokens) from shapes alone: params
  ShapeDtypeStructs placed as training places them, the unpatched runs not run. The
  clean and corrupt prompts differ at every position (no shared prefix: the most
  work)."""
  from mha_jax.toolkit import activation_patching, pairs as pairs_lib
  tokens = src.batches["forward"]["tokens"]
  n, t = tokens.shape[0], tokens.shape[1] - 1
  z = np.zeros(n, np.int32)
  pairs = pairs_lib.Pairs(np.zeros((n, t), np.int32), np.ones((n, t), np.int32), z, z + 1,
                          np.full(n, t, np.int32), [{}] * n)
  base = {r: {"ld": np.zeros(n), "logp": np.zeros(n)} for r in ("clean", "corrupt")}
  params = placed(src.params, sharding.shardings(src.params, mesh))
  return activation_patching.Study(src.task, params, pairs, baseline=base,
                                   memory_budget=budget)


def _shapes(args, mesh) -> tuple:
  """Program arguments as ShapeDtypeStructs: those already one kept, the rest (tokens,
  indices, node values) replicated over the mesh."""
  rep = NamedSharding(mesh, P())
  return jax.tree.map(lambda a: a if isinstance(a, jax.ShapeDtypeStruct) else
                      jax.ShapeDtypeStruct(np.shape(a), a.dtype, sharding=rep), args)


def study_programs(src: Source, topo: Topology, mesh, job: str, opts: PlanOptions
                   ) -> list[dict]:
  """patch: the activation-patching sweep of `patch --sites head_out` (Study.patch_many
  at the chunk its memory budget gives); circuit: the EAP and EAP-IG (5 steps on the
  inputs) gradient programs of `circuit` (circuits/edges.py) on the corrupt ablation,
  one chunk of ends each (the study's budget's: ends_per_chunk, chunks; a run is
  `chunks` of them); taxonomy: taxonomy_programs. The budget: study_budget. When the
  default budget is below one item (the study would refuse it), the job is a plan that
  does not fit (`_too_small`); a --memory-budget too small is refused, as the study
  refuses it."""
  budget = study_budget(opts, topo, mesh, src)
  try:
    return _study_programs(src, topo, mesh, job, budget)
  except UserError as e:
    if opts.memory_budget is not None or "memory_budget" not in e.settings:
      raise
    return [_too_small(job, e, budget, src, topo, mesh)]


_NEEDS = re.compile(r"needs at least ([\d,]+) bytes")
_FEWER = re.compile(r"at most (\d+) of its \d+ pairs fit")


def _too_small(job: str, e: UserError, budget: int, src: Source, topo: Topology, mesh) -> dict:
  """The study's default budget is below one item: not compiled, fits false; total: the
  params per device and the least bytes one item needs (the study's byte model)."""
  params = placed(src.params, sharding.shardings(src.params, mesh))
  m = _NEEDS.search(str(e))
  need = int(m.group(1).replace(",", "")) if m else 0
  out = _ruled_out(job, (params,), need, topo, mesh, f"the study's default memory budget "
                   f"({budget:,} bytes: half the HBM less the params) is below one item: "
                   f"{e} (--memory-budget sets it)")
  fewer = _FEWER.search(str(e))
  return dict(out, fits=False, memory_budget=budget,
              **({"pairs_that_fit": int(fewer.group(1))} if fewer else {}))


def _study_programs(src: Source, topo: Topology, mesh, job: str, budget: int) -> list[dict]:
  # host arrays, outside the target's mesh (a TPU compile-only client runs nothing);
  # the programs are traced for the target in compile_program
  if job == "taxonomy":
    return taxonomy_programs(src, topo, mesh, budget)
  with jax.default_device(jax.devices("cpu")[0]):
    study = _study(src, mesh, budget)
  if job == "patch":
    with jax.default_device(jax.devices("cpu")[0]):
      prog = study.sweep_program([("z", False)])
    out = compile_program("patch_sweep", prog["fn"], _shapes(prog["args"], mesh), topo, mesh)
    return [dict(out, chunk=prog["chunk"], groups=prog["groups"], memory_budget=budget)]
  from mha_jax.circuits import edges
  with jax.default_device(jax.devices("cpu")[0]):
    es = edges.EdgeStudy(study, run=False, mesh=mesh)
    progs = (("eap", es.eap_program(), es.plan("eap")),
             ("eap_ig", es.eap_ig_program(), es.plan("ig")))
  split = dict(zip(("data", "model"), es.node_axes()))
  return [dict(compile_program(name, prog["fn"], _shapes(prog["args"], mesh), topo, mesh),
               ends_per_chunk=chunks.ends_per_chunk, chunks=len(chunks.chunks),
               memory_budget=chunks.budget, node_values_split=split)
          for name, prog, chunks in progs]


def taxonomy_programs(src: Source, topo: Topology, mesh, budget: int) -> list[dict]:
  """The head taxonomy's causal checks (roles.head_taxonomy.plan_programs: repeat loss,
  IOI logit difference, context logit, text loss, top-k heads mean-ablated) and its
  detectors (sink, copy suppression, effective embeddings) at the job's rows x seq
  tokens, their rows per batch from `budget`."""
  import types
  from mha_jax.roles import head_taxonomy as taxonomy
  tokens = src.batches["forward"]["tokens"]
  with jax.default_device(jax.devices("cpu")[0]):
    params = placed(src.params, sharding.shardings(src.params, mesh))
    progs = taxonomy.plan_programs(types.SimpleNamespace(task=src.task, params=params),
                                   tokens.shape[0], tokens.shape[1] - 1, budget)
  return [dict(compile_program(name, fn, _shapes(args, mesh), topo, mesh), rows_per_batch=r,
               memory_budget=budget) for name, fn, args, r in progs]


# ------------------------------------------------------------------ the plan

def _mesh_shape(opts: PlanOptions, src: Source) -> tuple[int, int]:
  if opts.mesh is not None:
    return sharding.parse_mesh(opts.mesh, "mesh")
  if "mesh" in src.cfg:
    return int(src.cfg.mesh.data), int(src.cfg.mesh.model)
  return 0, 1


def versions() -> dict:
  from importlib import metadata
  try:
    libtpu = metadata.version("libtpu")
  except metadata.PackageNotFoundError:
    libtpu = None
  return {"jax": jax.__version__, "libtpu": libtpu}


def load_source(opts: PlanOptions, config: str | None, overrides, workdir: str | None
                ) -> Source:
  """The model planned: exactly one of --config, --hf-config and --workdir."""
  given = [n for n, v in (("config", config), ("hf_config", opts.hf_config),
                          ("workdir", workdir)) if v]
  if len(given) != 1:
    raise UserError(f"plan needs one of --config, --hf-config and --workdir; got "
                    f"{given or 'none'}", setting="config")
  if config:
    return from_training_config(config, overrides, opts)
  if overrides:
    raise UserError(f"{overrides[0]} overrides a key of --config FILE; none given")
  if opts.hf_config:
    return from_hf_config(opts.hf_config, opts)
  return from_workdir(workdir, opts)


def make_plan(opts: PlanOptions, *, config: str | None = None, overrides=(),
              workdir: str | None = None, topo: Topology | None = None) -> dict:
  """The plan of a job (see the module docstring): plan.json's dict. topo: the
  topology of opts.topology when already made."""
  topo = topo or topology(opts.topology)
  src = load_source(opts, config, list(overrides), workdir)
  data, model = _mesh_shape(opts, src)
  mesh = sharding.make_mesh(data, model, devices=topo.devices)
  programs = job_programs(src, topo, mesh, opts.job, opts)
  leaves = jax.tree.leaves(src.params)
  plan = {"topology": topo.name, "platform": topo.platform, "device_kind": topo.device_kind,
          "devices": len(topo.devices), "mesh": dict(mesh.shape), "job": opts.job,
          "params": {"count": int(sum(math.prod(x.shape) for x in leaves)),
                     "bytes": int(sum(math.prod(x.shape) * x.dtype.itemsize for x in leaves))},
          "programs": programs, "fits": all(p["fits"] for p in programs),
          "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
          **versions()}
  plan["source"] = src.where
  plan["machine"] = machine.machine()     # the machine that compiled the plan
  if topo.chip is not None:
    plan["chip"] = dataclasses.asdict(topo.chip)
  if not plan["fits"]:
    plan["suggestion"] = suggest(src, opts, topo, mesh)
  return plan


def _model_axis(n: int, heads: int) -> int:
  """The largest model axis over n devices that divides the heads."""
  return max(m for m in range(1, n + 1) if n % m == 0 and heads % m == 0)


def suggest(src: Source, opts: PlanOptions, topo: Topology, mesh) -> dict:
  """The first of: this topology with the largest model axis over the heads, then the
  larger slices of its generation (each with its largest model axis), on which every
  program fits. A candidate whose arguments (and a train step's gradients) alone pass the
  HBM is ruled out from shapes, uncompiled and uncounted (`ruled_out` in tried); the others
  are compiled, at most opts.search of them, each until its first program that does not
  fit. {"fits": false, "tried": [...]} when none did, with `next`: the smallest candidate
  not ruled out and not compiled (--search spent), its least total from shapes."""
  rows = min(v.shape[0] for b in src.batches.values() for v in b.values())
  tried, compiled = [], 0
  for name in [topo.name] + larger(topo.name):
    t = topo if name == topo.name else topology(name)
    n = len(t.devices)
    model = _model_axis(n, src.heads)
    data = math.gcd(rows, n // model)
    if name == topo.name and (data, model) == (mesh.shape["data"], mesh.shape["model"]):
      continue
    m = sharding.make_mesh(data, model, devices=t.devices)
    row = {"topology": name, "mesh": dict(m.shape), "hbm": t.hbm}
    programs = _searching(True, lambda: job_programs(src, t, m, opts.job, opts))
    if any(p["fits"] is False for p in programs):
      tried.append(dict(row, total=max(p["per_device"]["total"] for p in programs),
                        ruled_out=True))
      continue
    if compiled >= opts.search:
      least = max(p["per_device"]["total"] for p in programs)
      return {"fits": False, "tried": tried, "next": dict(row, total=least)}
    compiled += 1
    programs = _searching(False, lambda: job_programs(src, t, m, opts.job, opts))
    tried.append(dict(row, total=max(p["per_device"]["total"] for p in programs)))
    if all(p["fits"] for p in programs):
      return {"fits": True, **tried[-1], "tried": tried[:-1]}
  return {"fits": False, "tried": tried}


def _searching(bounds_only: bool, run: Callable):
  token = _MODE.set({"bounds_only": bounds_only, "missed": False})
  try:
    return run()
  finally:
    _MODE.reset(token)


def _gib(b) -> str:
  """Bytes in GiB, 3 significant digits at least."""
  g = b / 2**30
  return f"{g:.0f}" if g >= 100 else f"{g:.3g}" if g >= 0.01 else f"{g:.1e}"


def format_plan(plan: dict) -> str:
  """The plan as a text table, one line per program."""
  mesh = ",".join(f"{k}={v}" for k, v in plan["mesh"].items())
  lines = [f"{plan['job']} on {plan['topology']} ({plan['devices']} x {plan['device_kind']}, "
           f"mesh {mesh}); params {plan['params']['count']:,} "
           f"({_gib(plan['params']['bytes'])} GiB)",
           f"{'program':<14} {'args':>8} {'outs':>8} {'temps':>8} {'total':>8} {'HBM':>7} "
           f"{'fits':>4} {'TFLOP':>9} {'GB acc.':>8} {'est ms':>9}  kernels",
           "  (GiB per device; FLOPs and bytes accessed per device)"]
  for p in plan["programs"]:
    d = p["per_device"]
    est = "-" if p["est_seconds"] is None else f"{p['est_seconds'] * 1e3:.2f}"
    tf = "-" if p["flops"] is None else f"{p['flops'] / 1e12:.3f}"
    acc = "-" if p["bytes_accessed"] is None else f"{p['bytes_accessed'] / 1e9:.2f}"
    temps = "-" if d["temps"] is None else _gib(d["temps"])
    outs = "-" if d["outputs"] is None else _gib(d["outputs"])
    lines.append(f"{p['name']:<14} {_gib(d['arguments']):>8} {outs:>8} "
                 f"{temps:>8} {_gib(d['total']):>8} {_gib(d['hbm']):>7} "
                 f"{'yes' if p['fits'] else 'NO':>4} {tf:>9} {acc:>8} {est:>9}  "
                 f"{','.join(p['attention_kernels']) or '-'}")
    if p.get("compiled") is False:
      lines.append(f"  {p['name']}: not compiled, {p['ruled_out']} (total: at least that)")
  s = plan.get("suggestion")
  if s is not None and s["fits"]:
    mesh = ",".join(f"{k}={v}" for k, v in s["mesh"].items())
    lines.append(f"does not fit; fits on {s['topology']} with mesh {mesh} "
                 f"({_gib(s['total'])} of {_gib(s['hbm'])} GiB per device)")
  elif s is not None:
    tried = "; ".join(f"{t['topology']} {t['mesh']}: "
                      f"{'at least ' if t.get('ruled_out') else ''}{_gib(t['total'])} GiB"
                      for t in s["tried"])
    lines.append(f"does not fit; nor on what was tried ({tried or 'nothing'})")
    if s.get("next"):
      n = s["next"]
      mesh = ",".join(f"{k}={v}" for k, v in n["mesh"].items())
      lines.append(f"next, not compiled (--search spent): {n['topology']} with mesh {mesh}, "
                   f"at least {_gib(n['total'])} of {_gib(n['hbm'])} GiB per device")
  return "\n".join(lines)


def write_plan(plan: dict, out: str) -> str:
  """out/plan.json; returns its path."""
  storage.makedirs(out)
  path = storage.join(out, "plan.json")
  storage.write_json(path, plan)
  return path
