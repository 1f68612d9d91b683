"""Memory plans of the studies' programs: chunk sizes chosen from shapes and a budget,
before anything compiles (never by catching an out-of-memory error).

    shapes = memory.PatchShapes(layers=16, heads=32, kv_heads=8, head_dim=64,
                                d_model=2048, d_mlp=8192, vocab=128256, t=20, pairs=4,
                                dtype_bytes=2)
    plan = memory.patch_plan(shapes, interventions=512, budget=4 * 10**9)
    plan.interventions_per_group, plan.pairs_per_batch, plan.bytes

A byte model is an upper bound of what one program holds at once (forward only): per
pair, the source run's sites and the base run's residual stream that every
intervention reads; per (intervention, pair) row, one layer's activations (the stream
and norms in float32, q/k/v/z, the float32 scores and weights, the MLP's hidden
units), the row's logits and its copy of the patched sites. The plan takes the most
pairs per batch (all of them when they fit with one intervention), then the most
interventions per group that fit. A budget below one pair and one intervention is
refused, naming the minimum.

`map_rows(fn, arrays, rows)` runs a program over its rows a planned number at a time in
one compiled shape (the last group padded with rows that weigh 0).

`budget(text)` reads `--memory-budget` ("4GB", "512MiB", "3e9", or None: the free memory,
`kernels.dispatch.memory_limit()` less the params a device holds: `params_bytes`).
"""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np

from mha_jax.errors import UserError
from mha_jax.kernels import dispatch
from mha_jax.settings import setting

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
# of the free memory a default budget takes (the rest: XLA's own buffers, fragmentation)
DEFAULT_FRACTION = 0.5


def parse_bytes(text: str, name: str = "memory_budget") -> int:
  """Bytes of "4GB" (10^9), "4GiB" (2^30), "512MB", "3e9" or "1000"; refused by name."""
  m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([kmgt]i?b|b)?\s*", str(text).lower())
  if not m:
    raise UserError(f"{name} must be a size such as 4GB, 512MiB or 3e9 (bytes); got "
                    f"{text!r}", setting=name)
  n = int(float(m.group(1)) * _UNITS[m.group(2) or ""])
  if n <= 0:
    raise UserError(f"{name} must be more than 0 bytes; got {text!r}", setting=name)
  return n


def budget(text: str | None, params_bytes: int = 0) -> tuple[int, str]:
  """(bytes, what they are): `text` parsed, else DEFAULT_FRACTION of the device's memory
  (dispatch.memory_limit) less the params."""
  if text is not None:
    return parse_bytes(text), f"--memory-budget {text}"
  limit, what = dispatch.memory_limit()
  free = max(0, limit - int(params_bytes))
  return int(free * DEFAULT_FRACTION), f"{DEFAULT_FRACTION:g} of {what} less the params"


@dataclasses.dataclass(frozen=True)
class PatchShapes:
  """What a patching sweep's memory depends on. t: the positions each run computes (after
  a shared prefix); t_keys: the keys they attend (the whole prompt); sites: the sites
  every layer patches in one program (one per sweep); dtype_bytes: the params'."""
  layers: int
  heads: int
  kv_heads: int
  head_dim: int
  d_model: int
  d_mlp: int
  vocab: int
  t: int
  pairs: int
  dtype_bytes: int = 4
  t_keys: int | None = None
  sites: int = 1

  def per_pair(self) -> int:
    """Bytes each pair holds for the whole program: the source run's sites of every layer
    and the base run's stream entering each layer (depth sharing), both runs' keys and
    values (a shared prefix's cache)."""
    tk = self.t_keys or self.t
    site = self.sites * self.layers * self.t * self.heads * self.head_dim
    stream = self.layers * self.t * self.d_model
    kv = 2 * 2 * self.layers * tk * self.kv_heads * self.head_dim
    return self.dtype_bytes * (site + stream + kv)

  def per_row(self) -> int:
    """Bytes one (intervention, pair) row of a group holds: one layer's activations
    (float32 stream and norms, q/k/v/z, float32 scores and weights, the MLP's hidden
    units), its logits and log-probs (float32) and its copy of the patched sites and
    of the stream (the group's rows are folded into the batch)."""
    b = self.dtype_bytes
    layer = layer_bytes(self, 1)
    logits = 4 * 2 * self.vocab
    copies = b * (self.sites * self.layers * self.t * self.heads * self.head_dim
                  + self.layers * self.t * self.d_model)
    return layer + logits + copies


@dataclasses.dataclass(frozen=True)
class Plan:
  """Chunk sizes of a sweep: interventions per group, pairs per batch, and the bytes one
  group's program holds at those sizes (<= budget)."""
  interventions_per_group: int
  pairs_per_batch: int
  bytes: int
  budget: int


def patch_bytes(shapes: PatchShapes, interventions: int, pairs: int) -> int:
  """Bytes one group of `interventions` on a batch of `pairs` holds."""
  return pairs * shapes.per_pair() + interventions * pairs * shapes.per_row()


def patch_plan(shapes: PatchShapes, interventions: int, budget: int,
               setting: str = "memory_budget") -> Plan:
  """The chunk sizes of a patching sweep of `interventions` over shapes.pairs pairs in
  `budget` bytes: the most pairs per batch that fit with one intervention, then the most
  interventions per group. A budget below one pair and one intervention is refused."""
  if interventions < 1:
    raise ValueError(f"interventions must be >= 1; got {interventions}")
  one = patch_bytes(shapes, 1, 1)
  if budget < one:
    raise _too_small(setting, budget, one, "one intervention on one pair of this sweep")
  pairs = min(shapes.pairs, budget // (shapes.per_pair() + shapes.per_row()))
  per_group = (budget - pairs * shapes.per_pair()) // (pairs * shapes.per_row())
  c = int(max(1, min(interventions, per_group)))
  return Plan(c, int(pairs), patch_bytes(shapes, c, pairs), int(budget))


def _too_small(setting: str, budget: int, one: int, what: str, more: str = "") -> UserError:
  return UserError(f"{setting} of {budget:,} bytes ({budget / 2**20:.1f} MiB) is too small "
                   f"for {what}: it needs at least {one:,} bytes ({one / 2**20:.1f} MiB)"
                   + more, setting=setting)


def layer_bytes(s: PatchShapes, rows: int, t_keys: int | None = None) -> int:
  """Bytes one layer's activations of `rows` rows hold (PatchShapes.per_row's layer
  term): the float32 stream and norms, q/k/v/z, float32 scores and weights, the MLP."""
  tk = t_keys or s.t_keys or s.t
  b = s.dtype_bytes
  return rows * (4 * 4 * s.t * s.d_model + b * s.t * (2 * s.heads + 2 * s.kv_heads) * s.head_dim
                 + 4 * 2 * s.heads * s.t * tk + b * 3 * s.t * s.d_mlp)


@dataclasses.dataclass(frozen=True)
class EapShapes:
  """What an EAP / EAP-IG gradient program's memory depends on: the model's PatchShapes
  (t: the positions run, pairs: the batch B), the graph's nodes and ends, and the
  program: "eap" (one backward), "ig" (EAP-IG on the inputs: the gradients summed over
  the steps, a carry beside each step's) or "activations" (EAP-IG on the edge mask: no
  end gradients kept). data, model: the mesh axes the node values (B, T, N_nodes, D) are
  split over on one device's share (the pairs over data, D over model; 1 where an axis
  does not divide them: edges.EdgeStudy.node_axes); the end gradients split over data."""
  model: PatchShapes
  nodes: int
  ends: int
  program: str = "eap"
  data: int = 1
  model_axis: int = 1

  def rows(self) -> int:
    """Pairs on one device (the pairs over the data axis)."""
    return -(-self.model.pairs // self.data)

  def fixed(self) -> int:
    """Bytes of a chunk's program on one device whatever its ends: the clean and ablated
    node values and their difference (B, T, N_nodes, D) float32, split over the mesh
    (data, model_axis), and, for the backward, every layer's activations and the float32
    logits (a bound: not split)."""
    s = self.model
    nodes = 3 * 4 * self.rows() * s.t * self.nodes * -(-s.d_model // self.model_axis)
    return nodes + s.layers * layer_bytes(s, s.pairs) + 4 * 2 * s.pairs * s.vocab

  def per_end(self) -> int:
    """Bytes each end of a chunk adds: its zero delta and its gradient (B, T, D) float32
    (B over data; and the steps' carry for "ig"), and its column of the scores."""
    s = self.model
    if self.program == "activations":
      return 0
    store = (3 if self.program == "ig" else 2) * 4 * self.rows() * s.t * s.d_model
    return store + 4 * self.nodes


EAP_PROGRAMS = ("eap", "ig", "activations")


@dataclasses.dataclass(frozen=True)
class EapPlan:
  """Ends per gradient chunk, the chunks ((lo, hi) end ranges, in end order) and the
  bytes one chunk's program holds (<= budget)."""
  ends_per_chunk: int
  chunks: tuple
  bytes: int
  budget: int


def eap_bytes(shapes: EapShapes, ends: int) -> int:
  """Bytes one chunk of `ends` ends' gradients holds."""
  return shapes.fixed() + ends * shapes.per_end()


def eap_plan(shapes: EapShapes, budget: int, setting: str = "memory_budget") -> EapPlan:
  """The most ends per gradient chunk that fit `budget` (every end when they do); a
  budget below one end is refused, naming the minimum and, when fewer pairs would fit,
  the most that do (eap_pairs_that_fit)."""
  if shapes.program not in EAP_PROGRAMS:
    raise ValueError(f"program must be one of {EAP_PROGRAMS}; got {shapes.program!r}")
  one = eap_bytes(shapes, 1)
  if budget < one:
    fit = eap_pairs_that_fit(shapes, budget)
    fewer = (f"; at most {fit} of its {shapes.model.pairs} pairs fit it (fewer pairs: "
             f"circuit --n-pairs {fit}, plan --batch {fit})") if fit else ""
    raise _too_small(setting, budget, one, f"one end's gradient of this {shapes.program} "
                     "program", fewer)
  c = shapes.ends if shapes.per_end() == 0 else min(
      shapes.ends, (budget - shapes.fixed()) // shapes.per_end())
  c = int(max(1, c))
  chunks = tuple((lo, min(lo + c, shapes.ends)) for lo in range(0, shapes.ends, c))
  return EapPlan(c, chunks, eap_bytes(shapes, c), int(budget))


def eap_pairs_that_fit(shapes: EapShapes, budget: int) -> int:
  """The most pairs whose one-end chunk fits `budget` (split over the data axis where
  it divides them); 0 when not even one pair does."""
  for b in range(shapes.model.pairs, 0, -1):
    s = dataclasses.replace(shapes, model=dataclasses.replace(shapes.model, pairs=b),
                            data=shapes.data if b % shapes.data == 0 else 1)
    if eap_bytes(s, 1) <= budget:
      return b
  return 0


@dataclasses.dataclass(frozen=True)
class RowsPlan:
  """Rows (sequences) per batch of a forward-only program, and the bytes one batch holds."""
  rows_per_batch: int
  bytes: int
  budget: int


def forward_bytes(s: PatchShapes, rows: int, kept_per_row: int = 0,
                  logits_positions: int = 1) -> int:
  """Bytes a forward of `rows` sequences of s.t tokens holds: one layer's activations,
  the float32 logits (and log-probs) at `logits_positions` positions, and what it keeps
  per row (`kept_per_row` bytes: captured sites)."""
  return (layer_bytes(s, rows) + rows * 4 * 2 * logits_positions * s.vocab
          + rows * kept_per_row)


def rows_plan(s: PatchShapes, rows: int, budget: int, *, kept_per_row: int = 0,
              logits_positions: int = 1, what: str = "one sequence",
              setting: str = "memory_budget") -> RowsPlan:
  """The most of `rows` sequences per batch whose forward (forward_bytes) fits budget;
  a budget below one sequence is refused, naming the minimum."""
  one = forward_bytes(s, 1, kept_per_row, logits_positions)
  if budget < one:
    raise _too_small(setting, budget, one, what)
  r = max(1, min(rows, budget // one))
  return RowsPlan(int(r), forward_bytes(s, r, kept_per_row, logits_positions), int(budget))


def map_rows(fn, arrays: tuple, rows: int | None):
  """fn(*row_arrays, weight (rows,)) -> pytree, over the arrays' leading axis (N rows),
  `rows` at a time (None: all at once) in one compiled shape (jax.lax.map): the last
  group is padded with copies of row 0 whose weight is 0. Returns the pytree stacked
  over the groups (each leaf (groups, ...)); jit-traceable."""
  n = int(np.shape(arrays[0])[0])
  rows = n if rows is None else max(1, min(int(rows), n))
  g = -(-n // rows)
  pad = g * rows - n
  w = (jnp.arange(g * rows) < n).astype(jnp.float32).reshape(g, rows)
  xs = tuple(jnp.concatenate([jnp.asarray(a), jnp.repeat(jnp.asarray(a)[:1], pad, 0)])
             .reshape((g, rows) + tuple(np.shape(a)[1:])) for a in arrays)
  return jax.lax.map(lambda c: fn(*c), xs + (w,))


def mlp_width(params, d_model: int) -> int:
  """The widest MLP (its w_up's output width) of the params; 4 * d_model without one."""
  widths = [int(np.shape(x)[-1]) for path, x in jax.tree_util.tree_flatten_with_path(params)[0]
            if getattr(path[-1], "key", None) == "w_up"]
  return max(widths, default=4 * d_model)


def dtype_bytes(params) -> int:
  """Bytes per element of the params' largest array (their dtype's size)."""
  import jax
  import numpy as np
  leaves = [x for x in jax.tree.leaves(params) if hasattr(x, "dtype")]
  big = max(leaves, key=lambda x: int(np.prod(np.shape(x))))
  return int(np.dtype(big.dtype).itemsize)


DTYPES = ("float32", "bfloat16")


def budget_setting(holds: str, chosen: str):
  """A study's `memory_budget` setting: the bytes `holds` may hold; `chosen` is what is
  chosen from it before compiling."""
  return setting(None, metavar="BYTES", help=f"bytes {holds} may hold, e.g. 4GB or 512MiB: "
                 f"{chosen} chosen from it before compiling (default: half the device's "
                 "free memory less the params it holds)")


def dtype_setting():
  """A study's `dtype` setting: the params' dtype for the study."""
  return setting(None, choices=DTYPES, help="the params' dtype for the study (default: as "
                 "stored); softmax, norms, logits and metrics stay float32")


def mesh_setting():
  """A study's `mesh` setting (train.sharding.study_mesh reads it)."""
  return setting(None, metavar="data=D,model=M", help="run on a mesh of every device: "
                 "pairs and interventions over data, heads over model (D x M must be the "
                 "device count; default: one device)")


def params_bytes(params, dtype: str | None = None, mesh=None) -> int:
  """Bytes of the params' arrays on one device (their floating ones in `dtype` when given,
  as `cast` makes them); with a (data, model) mesh, each array's shard as a study places
  it (train.sharding.shardings: heads and hidden units over "model")."""
  shards = None
  if mesh is not None:
    from mha_jax.train import sharding
    shards = sharding.shardings(params, mesh)

  def size(x, sh=None):
    if not hasattr(x, "dtype"):
      return 0
    dt = jnp.dtype(x.dtype)
    if dtype is not None and jnp.issubdtype(dt, jnp.floating):
      dt = jnp.dtype(dtype)
    shape = np.shape(x) if sh is None else sh.shard_shape(np.shape(x))
    return int(np.prod(shape)) * dt.itemsize
  sizes = jax.tree.map(size, params) if shards is None else jax.tree.map(size, params, shards)
  return int(sum(jax.tree.leaves(sizes)))


def cast(params, dtype: str | None, setting: str = "dtype"):
  """The params' floating arrays in `dtype` (None: as they are). The forward keeps
  float32 where precision matters whatever the params' dtype: softmax and its weights,
  the norms, the logits (and so the metric), the metrics' pair means."""
  import jax
  import jax.numpy as jnp
  if dtype is None:
    return params
  if dtype not in DTYPES:
    raise UserError(f"{setting} must be one of {DTYPES}; got {dtype!r}", setting=setting)
  dt = jnp.dtype(dtype)
  return jax.tree.map(lambda x: x.astype(dt) if hasattr(x, "dtype") and jnp.issubdtype(
      x.dtype, jnp.floating) else x, params)
