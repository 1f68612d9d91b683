"""A 2-D device mesh ("data", "model") and Megatron-style param shardings.

Batches are split over "data". Over "model", every attention block's head axis is split
(wq, wk, wv (D, H, K) on H; wo (H, K, D) on H; bq, bk, bv, rel_bias on H) and every MLP's
hidden axis (w1 (D, F) and b1 on F, w2 (F, D) on F), so a head and its slice of W_O live
on one device and each layer needs one all-reduce after W_O and one after the MLP. The
model code is unchanged: XLA's sharding propagation (GSPMD) follows the params' layout.
A dimension that the model axis does not divide stays replicated.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from mha_jax.errors import UserError

# Param name -> the axis that holds heads (attention) or hidden units (MLP: own models'
# w1 / w2, the decoder families' w_gate / w_up / w_down).
_HEAD_AXIS = {"wq": 1, "wk": 1, "wv": 1, "wo": 0, "bq": 0, "bk": 0, "bv": 0, "rel_bias": 0, "alibi": 0}
_MLP_AXIS = {"w1": 1, "b1": 0, "w2": 0, "w_gate": 1, "w_up": 1, "b_gate": 0, "b_up": 0,
             "w_down": 0}


def make_mesh(data: int = 0, model: int = 1, devices=None) -> Mesh:
  """A (data, model) mesh over the first data * model devices; data=0 means all of them
  divided by `model`."""
  devices = list(jax.devices() if devices is None else devices)
  n = len(devices)
  for name, val, low in (("mesh.data", data, 0), ("mesh.model", model, 1)):
    if not isinstance(val, (int, np.integer)) or isinstance(val, bool) or val < low:
      raise UserError(f"{name} must be an integer >= {low}; got {val!r}")
  if data == 0:
    if n % model:
      raise UserError(f"mesh.model={model} does not divide the {n} devices")
    data = n // model
  if data * model > n:
    raise UserError(f"mesh.data x mesh.model = {data} x {model} needs {data * model} "
                     f"devices; this process sees {n}")
  return Mesh(np.asarray(devices[:data * model]).reshape(data, model), ("data", "model"))


def study_mesh(text: str | None, flag: str = "mesh") -> Mesh | None:
  """None (text None: one device), or the (data, model) mesh of "data=2,model=4"
  (parse_mesh) over every device this process sees; refused by name unless data x model
  is the device count (data=0 or left out: the devices left over model)."""
  if text is None:
    return None
  data, model = parse_mesh(text, flag)
  n = jax.device_count()
  if data == 0 and n % model == 0:
    data = n // model
  if data * model != n:
    raise UserError(f"{flag}={text!r} asks for {data or '?'} x {model} devices; this "
                    f"process sees {n} (a study's mesh uses every device)", setting=flag)
  return make_mesh(data, model)


def _names(path) -> list[str]:
  return [str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path]


def param_spec(path, shape, model_size: int) -> P:
  """The PartitionSpec of one param (or optimizer moment of it) from its path."""
  return spec_of_names(_names(path), shape, model_size)


def spec_of_names(names: list[str], shape, model_size: int) -> P:
  """The PartitionSpec of a param named by its path's keys (["lm", "layer_0", "attn",
  "wq"]): heads / hidden units over "model" where model_size divides them."""
  if not names:
    return P()
  axis = _HEAD_AXIS.get(names[-1])
  if axis is None and len(names) > 1 and names[-2] == "mlp":
    axis = _MLP_AXIS.get(names[-1])
  if axis is None or len(shape) <= axis or shape[axis] % model_size or model_size == 1:
    return P()
  spec = [None] * len(shape)
  spec[axis] = "model"
  return P(*spec)


def parse_mesh(text: str, flag: str = "mesh") -> tuple[int, int]:
  """(data, model) from "model=4" or "data=2,model=4" (data=0: every device left)."""
  out = {"data": 0, "model": 1}
  for part in str(text).split(","):
    key, eq, val = part.strip().partition("=")
    if not eq or key not in out or not val.strip().isdigit():
      raise UserError(f"{flag} must look like model=4 or data=2,model=4 (axes data and "
                      f"model, whole numbers); got {text!r}", setting=flag)
    out[key] = int(val)
  if out["model"] < 1:
    raise UserError(f"{flag}: model must be >= 1; got {text!r}", setting=flag)
  return out["data"], out["model"]


def shardings(tree, mesh: Mesh):
  """NamedShardings for every leaf of `tree` (params, optimizer state, or their shapes)."""
  m = mesh.shape["model"]
  return jax.tree_util.tree_map_with_path(
      lambda path, x: NamedSharding(mesh, param_spec(path, np.shape(x), m)), tree)
