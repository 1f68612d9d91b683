"""DIR/primer.html: the first seed document's figures, interactive and offline.

Every number on the page is computed here by the project's own code (the attention
function and its building blocks, the accounting, the trained toy models of the claims
run) and embedded as JSON; the page's script only draws and looks up precomputed grids
as sliders move. No network request: inline script and style, no external resource.
The page itself is mha_jax/assets/primer.{html,css,js}.
"""

from __future__ import annotations

import jax
import numpy as np

from mha_jax import assets, storage
from mha_jax import accounting
from mha_jax import attention as A
from mha_jax.claims import experiments as E


def _r(x, nd: int = 4):
  return np.round(np.asarray(x, np.float64), nd).tolist()


def page_data(ctx: E.Context) -> dict:
  params, x, r, names = E.sentence_layer()
  w = np.asarray(r.weights)[0]                                       # (H, T, S)
  heads = np.asarray(r.heads)[0]                                     # (T, H, K)
  wo = np.asarray(params["wo"])
  data = {"sentence": list(E.SENTENCE), "head_names": names, "weights": _r(w),
          "head_outputs": _r(heads), "signal": E.SIGNAL}
  mix = E.mixture_curve()
  grid = np.linspace(0, 1, 21)
  rows_by_query = []
  for q in range(len(E.SENTENCE)):
    rows_by_query.append(_r(E.mixture_curve(q, grid)["rows"]))
  data["mixture"] = {"ratios": _r(mix["ratios"]), "peak": _r(mix["peak"]),
                     "rows_by_query": rows_by_query}
  d = 8
  cuts = {}
  xq = jax.random.normal(jax.random.PRNGKey(3), (d,))
  wq = E.init_params(jax.random.PRNGKey(1), d, 1)["wq"]
  for h in (1, 2, 4, 8):
    shapes = A.param_shapes(d, h, d // h)
    cuts[str(h)] = {"d_k": d // h, "shapes": {k: list(v) for k, v in shapes.items()},
                    "params": accounting.attention_params(d, h),
                    "reads": _r(E.q_jacobian({"wq": wq.reshape(d, h, d // h)}, xq) > 0, 0)}               # (D, H)
  data["cuts"] = {"d_model": d, "by_h": cuts}
  data["divisor"] = _r_tree(ctx.cache.get("divisor_curves") or E.divisor_curves())
  slider = E.wo_slider(heads[4], wo, head=0)
  data["wo"] = {"token": E.SENTENCE[4], "trained": ctx.cache.get("wo_slider") is not None,
                "sentence": _r_tree(slider)}
  if ctx.cache.get("wo_slider"):
    data["wo"]["trained_layer"] = _r_tree(ctx.cache["wo_slider"])
  cost = ctx.cache.get("cost_table")
  if cost is None:                                    # formulas + pytrees, no compile
    hs = list(E.COST_HEADS)
    cost = {"d_model": 768, "seq_len": 256, "heads": hs,
            "params": [accounting.attention_params(768, h) for h in hs],
            "flops_xla": None,
            "flops_formula": accounting.attention_flops(768, 256)["total"],
            "score_bytes": [accounting.score_memory_bytes(1, h, 256) for h in hs]}
  data["cost"] = _r_tree(cost)
  if ctx.cache.get("compromise_example") is not None:
    data["compromise"] = _r_tree(ctx.cache["compromise_example"])
  dk1 = ctx.cache.get("dk1_example")
  if dk1 is not None:
    data["dk1"] = _r_tree(dk1)
  return data


def _r_tree(x):
  if isinstance(x, dict):
    return {k: _r_tree(v) for k, v in x.items()}
  if isinstance(x, (list, tuple, np.ndarray)):
    return [_r_tree(v) for v in x]
  if isinstance(x, (float, np.floating)):
    return round(float(x), 5)
  if isinstance(x, np.integer):
    return int(x)
  return x


def write(ctx: E.Context, path: str) -> dict:
  data = page_data(ctx)
  storage.write_text(path, assets.page("primer", data))
  return data


