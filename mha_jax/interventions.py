"""Named activations inside the one forward: read them, replace them, add to them, scale them.

Every model calls `at(hook, name, x)` at its layer-level sites and hands the attention
function a `scope(hook, prefix)` for the sites inside attention. With no hook (None) the
forward is exactly what it was; a hook is built fresh inside each (jit-)traced call,
so everything here is pure and jit/vmap/grad-compatible: edits carry arrays, and what
is read comes back as arrays of the same trace.

Site names (stable; `{i}` is the layer index, the stack is `lm`, `encoder`,
`decoder_self` or `decoder_cross`):

  {stack}.{i}.attn.q        (B, T, H, K)  queries after bias and RoPE, per query head
  {stack}.{i}.attn.k, .v    (B, S, G, K)  keys (after RoPE), values, per key/value head
  {stack}.{i}.attn.k_q,.v_q (B, S, H, K)  keys, values as each query head reads them
                                          (GQA/MQA: head h reads kv head h // (H/G))
  {stack}.{i}.attn.pattern  (B, H, T, S)  attention weights (float32; reference kernel)
  {stack}.{i}.attn.z        (B, T, H, K)  each head's output before W_O, after gates
  {stack}.{i}.attn.result   (B, T, H, D)  each head's output after W_O
  {stack}.{i}.attn.gate     (B, T, H, K)  the gated variant's sigmoid gate ((B, T, H):
                                          gated_head)
  {stack}.{i}.attn.pattern2 (B, H, T, S)  differential attention's second map
  {stack}.{i}.attn.sink_weight (B, H, T)  the sink variant's weight on its logit
  {stack}.{i}.attn_out      (B, T, D)     the attention block's output (all heads + bo)
  lm.{i}.resid_pre          (B, T, D)     the residual stream entering layer i
  lm.{i}.resid_mid          (B, T, D)     after the attention block's residual add
  lm.{i}.mlp_out            (B, T, D)     the MLP's output
  lm.{i}.mlp.router         (B, T, E)     a mixture-of-experts MLP's expert weights per
                                          token (float32; 0 outside the top-k): read
                                          the router's choices, replace them to fix them
  lm.{i}.resid_post         (B, T, D)     after the MLP's residual add (= lm.{i+1}.resid_pre)
  lm.{i}.attn.in_q          (B, T, H, D)  the residual stream as query head h reads it, before
                                          the layer's norm (edge ends; computed only when
                                          asked: the heads' inputs then run per head)
  lm.{i}.attn.in_k, .in_v   (B, S, G, D)  the same for each key/value head's k and v inputs
  lm.{i}.mlp_in             (B, T, D)     the residual as the MLP reads it, before its norm
                                          (what flows on in the stream is not changed)
  lm.ln_final.scale         (B, T, 1)     the final norm's 1 / rms (or 1 / std): replace it
                                          with a clean run's value to freeze the norm
  lm.{i}.ln1_post.scale     (B, T, 1)     the post-attention norm's 1 / rms (Gemma 2/3 only)
(BERT's layers use `encoder.{i}.{resid_pre,resid_mid,mlp_out,resid_post}` as well, after
its post-norms.) The head axis is per query head; k and v have the key/value-head axis.

Edits: `replace(value)`, `add(value)`, `scale(value)`; `value` broadcasts to the site's
shape and the edit applies where the selections hold: `rows` (batch), `positions`
(the site's token axis; the query axis of the pattern), `heads` (query heads; kv heads
on k and v) and, on the pattern, `key_positions`. A selection is None (all), an int, a
sequence of ints, or a boolean vector (traced values welcome: a vmap over a head index
is one compiled program). `where`, a boolean array of the site's rank broadcasting to its
shape, picks any set of elements (interventions folded into the rows, each row its own
heads and positions). Several edits of one site apply in order. A read site records
the value after its edits, i.e. what flows on.

  logits, acts = run_with_hook(lambda hook: model.apply(params, batch, hook=hook),
                               edits={"lm.3.attn.z": replace(clean_z, heads=5)},
                               read=["lm.*.attn.pattern", "lm.7.resid_post"])
"""

from __future__ import annotations

import dataclasses
import fnmatch
from typing import Any, Callable, Iterable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

ATTN_SITES = ("q", "k", "v", "k_q", "v_q", "pattern", "z", "result")
LAYER_SITES = ("resid_pre", "attn_out", "resid_mid", "mlp_out", "resid_post")   # forward order
OPS = ("replace", "add", "scale")

# The axes a selection picks on each kind of site.
_HEAD_AXES = {"rows": 0, "positions": 1, "heads": 2}
# Sites of the attention variants (multi_head_attention(..., variant=...)): "gate"
# (B, T, H, K) gated or (B, T, H) gated_head; "pattern2" (B, H, T, S) differential's
# second map; "sink_weight" (B, H, T) the sink's weight (sink).
_AXES = {**{s: _HEAD_AXES for s in ("q", "k", "v", "k_q", "v_q", "z", "result", "gate")},
         "pattern": {"rows": 0, "heads": 1, "positions": 2, "key_positions": 3},
         "pattern2": {"rows": 0, "heads": 1, "positions": 2, "key_positions": 3},
         "sink_weight": {"rows": 0, "heads": 1, "positions": 2}}
_STREAM_AXES = {"rows": 0, "positions": 1}


@dataclasses.dataclass
class Edit:
  """One edit of a site: op ("replace", "add", "scale"), a value broadcasting to the
  site's shape, and where it applies (None = everywhere along that axis)."""
  op: str
  value: Any
  rows: Any = None
  positions: Any = None
  heads: Any = None
  key_positions: Any = None
  where: Any = None

  def __post_init__(self):
    if self.op not in OPS:
      raise ValueError(f"op must be one of {OPS}; got {self.op!r}")


jax.tree_util.register_dataclass(
    Edit, data_fields=["value", "rows", "positions", "heads", "key_positions", "where"],
    meta_fields=["op"])


def replace(value, **where) -> Edit:
  """The site takes `value` (broadcast) where the selections hold."""
  return Edit("replace", value, **where)


def add(value, **where) -> Edit:
  """The site's value plus `value` where the selections hold."""
  return Edit("add", value, **where)


def scale(value, **where) -> Edit:
  """The site's value times `value` where the selections hold (a gate, an ablation)."""
  return Edit("scale", value, **where)


def axes_of(name: str) -> dict[str, int]:
  """{selection: axis} of a site name (see the module docstring)."""
  leaf = name.rsplit(".", 1)[-1]
  return _AXES.get(leaf, _STREAM_AXES)


def _axis_mask(sel, n: int, what: str) -> jax.Array:
  sel = jnp.asarray(sel)
  if sel.dtype == jnp.bool_:
    if sel.shape != (n,):
      raise ValueError(f"{what}: a boolean selection must have shape ({n},); got {sel.shape}")
    return sel
  if not jnp.issubdtype(sel.dtype, jnp.integer) or sel.ndim > 1:
    raise ValueError(f"{what}: a selection is None, an int, a sequence of ints or a "
                     f"boolean vector; got dtype {sel.dtype} shape {sel.shape}")
  return jnp.zeros((n,), bool).at[sel].set(True, mode="drop")


def apply_edit(edit: Edit, name: str, x: jax.Array) -> jax.Array:
  """x with `edit` applied (the site's name says which axes the selections pick)."""
  value = jnp.asarray(edit.value)
  try:
    np.broadcast_shapes(value.shape, x.shape)
  except ValueError:
    raise ValueError(f"edit of {name!r}: value of shape {value.shape} does not broadcast "
                     f"to the site's shape {x.shape}") from None
  if edit.op == "replace":
    new = jnp.broadcast_to(value.astype(x.dtype), x.shape)
  elif edit.op == "add":
    new = x + value.astype(x.dtype)
  else:
    new = x * value.astype(x.dtype)
  if new.shape != x.shape:
    raise ValueError(f"edit of {name!r}: value of shape {value.shape} would change the "
                     f"site's shape {x.shape}")
  mask = None
  for sel_name, axis in axes_of(name).items():
    sel = getattr(edit, sel_name)
    if sel is None:
      continue
    m = _axis_mask(sel, x.shape[axis], f"edit of {name!r}: {sel_name}")
    m = m.reshape([-1 if a == axis else 1 for a in range(x.ndim)])
    mask = m if mask is None else mask & m
  if edit.where is not None:
    w = jnp.asarray(edit.where)
    ok = w.dtype == jnp.bool_ and w.ndim == x.ndim
    try:
      ok = ok and np.broadcast_shapes(w.shape, x.shape) == x.shape
    except ValueError:
      ok = False
    if not ok:
      raise ValueError(f"edit of {name!r}: where must be a boolean array of {x.ndim} axes "
                       f"broadcasting to the site's shape {x.shape}; got dtype {w.dtype} "
                       f"shape {w.shape}")
    mask = w if mask is None else mask & w
  for sel_name in ("heads", "key_positions"):
    if getattr(edit, sel_name) is not None and sel_name not in axes_of(name):
      raise ValueError(f"edit of {name!r}: this site has no {sel_name} axis")
  return new if mask is None else jnp.where(mask, new, x)


class Hook:
  """What the forward carries: edits by site name, the sites to read, what was read.

  edits: {site name: Edit or [Edit, ...]}.
  read: site names or fnmatch patterns ("lm.*.attn.z").
  After the forward, `values` holds {site name: array} of every read site, and
  `check()` refuses edits of sites the model never reached.
  """

  def __init__(self, edits: Mapping[str, Any] | None = None, read: Iterable[str] = ()):
    self.edits: dict[str, list[Edit]] = {}
    for name, e in (edits or {}).items():
      es = list(e) if isinstance(e, (list, tuple)) else [e]
      for one in es:
        if not isinstance(one, Edit):
          raise ValueError(f"edits[{name!r}] must be an Edit (replace/add/scale); got "
                           f"{type(one).__name__}")
      self.edits[name] = es
    if isinstance(read, str):
      read = [read]
    self.read = tuple(read)
    self.values: dict[str, jax.Array] = {}
    self.visited: set[str] = set()
    self._wants: dict[str, bool] = {}

  def reads(self, name: str) -> bool:
    if name not in self._wants:
      self._wants[name] = any(name == p or fnmatch.fnmatchcase(name, p) for p in self.read)
    return self._wants[name]

  def wants(self, name: str) -> bool:
    """Whether the site is edited or read (sites computed only when asked look here)."""
    return name in self.edits or self.reads(name)

  def at(self, name: str, x: jax.Array) -> jax.Array:
    self.visited.add(name)
    for e in self.edits.get(name, ()):
      if callable(e.value):     # a value computed from the sites read so far
        e = dataclasses.replace(e, value=e.value(self.values))
      x = apply_edit(e, name, x)
    if self.reads(name):
      self.values[name] = x
    return x

  def prepend(self, name: str, edit: Edit) -> None:
    """An edit applied before the user's (head gates)."""
    self.edits.setdefault(name, []).insert(0, edit)

  def check(self) -> None:
    missing = sorted(set(self.edits) - self.visited)
    if missing:
      near = sorted(self.visited)[:4]
      raise ValueError(f"edits name sites this forward does not have: {missing[:5]}; "
                       f"its sites look like {near}")


class _Scoped:
  """The attention function's view of a hook: site("q", x) is hook.at(prefix + ".q", x)."""

  def __init__(self, hook: Hook, prefix: str):
    self.hook, self.prefix = hook, prefix

  def __call__(self, name: str, x):
    return self.hook.at(f"{self.prefix}.{name}", x)

  def wants(self, name: str) -> bool:
    return self.hook.wants(f"{self.prefix}.{name}")


def at(hook: Hook | None, name: str, x):
  """The models' call at a site: x itself without a hook."""
  return x if hook is None else hook.at(name, x)


def scope(hook: Hook | None, prefix: str):
  """What a model passes as multi_head_attention(..., site=...): None without a hook."""
  return None if hook is None else _Scoped(hook, prefix)


def run_with_hook(forward: Callable[[Hook], Any], edits: Mapping[str, Any] | None = None,
                  read: Iterable[str] = ()):
  """(forward's output, {site name: value read}) of forward(hook). Call it inside jit,
  vmap or grad as any pure function; edits of sites the forward lacks are refused."""
  hook = Hook(edits, read)
  out = forward(hook)
  hook.check()
  return out, hook.values


# --------------------------------------------------------------------------
# Head gates and capture, as uses of the mechanism (what the models call).
# --------------------------------------------------------------------------


def gate_edit(gate) -> Edit:
  """Head gates (H,) or (B, H) as a scale of the z site (B, T, H, K)."""
  g = jnp.asarray(gate)
  if g.ndim == 1:
    return scale(g[None, None, :, None])
  if g.ndim == 2:
    return scale(g[:, None, :, None])
  raise ValueError(f"head gates must have shape (H,) or (B, H); got {g.shape}")


def model_hook(hook: Hook | None, gates: Mapping | None = None, capture: bool = False,
               stacks: Sequence[str] = ("lm",)) -> Hook | None:
  """The hook a model's forward runs with: the user's, plus gates {stack: [(H,)|(B, H)
  per layer]} as scale edits of `{stack}.{i}.attn.z` (applied first), plus the capture
  reads. None when there is nothing to do (the plain forward)."""
  if hook is None and gates is None and not capture:
    return None
  unknown = sorted(set(gates or {}) - set(stacks))
  if unknown:
    raise ValueError(f"gates: keys must be stacks of this model {list(stacks)}; got "
                     f"{unknown} (edits go in a Hook, not in the gates)")
  hook = Hook() if hook is None else hook
  for stack in stacks:
    for i, g in enumerate((gates or {}).get(stack) or ()):
      if g is not None:
        hook.prepend(f"{stack}.{i}.attn.z", gate_edit(g))
  if capture:
    hook.read = hook.read + tuple(f"{s}.*.{n}" for s in stacks
                                  for n in ("attn.pattern", "attn.z", "attn_out"))
    hook._wants.clear()
  return hook


def captured(hook: Hook, stack: str, num_layers: int, out_type) -> list:
  """[out_type(out, weights, heads) per layer] of a stack from a capture hook."""
  v = hook.values
  return [out_type(v[f"{stack}.{i}.attn_out"], v[f"{stack}.{i}.attn.pattern"],
                   v[f"{stack}.{i}.attn.z"]) for i in range(num_layers)]


def site_names(params: Mapping) -> list[str]:
  """Every site of a decoder-only model (`lm` stack) or encoder: names in forward order."""
  out = []
  for stack, top, _attn in (("lm", "lm", "attn"), ("encoder", "encoder", "self_attn")):
    if top not in params or stack == "encoder" and "decoder" in params:
      continue
    layers = sorted((k for k in params[top] if k.startswith("layer_")),
                    key=lambda k: int(k.split("_")[1]))
    for i, _ in enumerate(layers):
      out.append(f"{stack}.{i}.{LAYER_SITES[0]}")
      out += [f"{stack}.{i}.attn.{s}" for s in ATTN_SITES]
      after = [f"{stack}.{i}.{s}" for s in LAYER_SITES[1:]]
      if "router" in params[top][layers[i]].get("mlp", {}):
        after.insert(after.index(f"{stack}.{i}.mlp_out"), f"{stack}.{i}.mlp.router")
      out += after
    if stack == "lm":
      out.append("lm.ln_final.scale")
  return out
