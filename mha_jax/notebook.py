"""`mha_jax.show(x)`: any result drawn inline in a notebook (mha_jax.views).

  a Trace (`loaded.run(...)`)      its attention patterns (layer and head selectors)
  a study's output folder           what it wrote: patching (heatmap + DLA bars), a circuit
                                    (circuit view + faithfulness curve), roles (table
                                    coloured by role), a pruning curve
  a study's returned document       a circuit's (`circuit(...)`), roles (`taxonomy`), rows
                                    of a pruning curve
  {name: value}                     bars (a head table, DLA)
  {head name: role}                 a roles table coloured by role
  a Loaded run or a params pytree   the tree with shapes (treescope where installed)

In IPython the view is displayed (and None returned); elsewhere it is returned (a
`views.View`: `.html`, `.save(path)`), and params are printed as text.
"""

from __future__ import annotations

import numbers
import os

from mha_jax import storage, views
from mha_jax.errors import UserError
from mha_jax.roles.role_scores import ROLE_COLORS


def _read(out: str, name: str):
  path = storage.join(out, name)
  return storage.read_json(path) if storage.exists(path) else None


def patching_view(out: str) -> views.View:
  """A `mha-jax patch` folder: the explorer's heatmap of every score table (values on
  hover; the attention of the first pairs when the folder has it) and DLA bars."""
  from mha_jax.patching import patch_explorer
  data = {**(_read(out, "attention_view.json") or {}), "patching": patch_explorer.patching_data(out)}
  doc = data["patching"].get("patching") or data["patching"]["dla"]
  view = views.explorer_html(data, f"{doc.get('task', '')} on {doc.get('workdir', '')}")
  dla = data["patching"].get("dla")
  if dla:
    view = view + views.bars(dla["heads"], "direct logit attribution: the heads with the "
                             "largest |DLA|")
  return view


def circuit_view(out: str) -> views.View:
  """A `mha-jax circuit` folder: the circuit view (and its pairs' attention) and the
  faithfulness curve."""
  from mha_jax.circuits import circuit
  doc = _read(out, "circuit.json")
  data = _read(out, circuit.VIEW_FILE)
  view = faithfulness_view(doc)
  if data is not None:
    view = views.explorer_html(data, f"circuit of {doc['task']}") + view
  return view


def faithfulness_view(doc: dict) -> views.View:
  """A circuit document's faithfulness against its edge count."""
  pts = [(p["edges"], p["faithfulness"]) for p in doc["curve"]]
  return views.curves({doc.get("chosen") or doc.get("method", "circuit"): pts},
                      f"faithfulness of {doc.get('task', '')} circuits", "edges",
                      "faithfulness", log_x=True)


def curve_view(rows: list) -> views.View:
  """A pruning curve's rows: the metric of each method against the heads kept."""
  from mha_jax.pruning import prune_curve
  metric = prune_curve.curve_metric(rows, "bleu" in (rows[0] if rows else {}))
  series: dict[str, list] = {}
  for r in rows:
    series.setdefault(r["method"], []).append((r["kept"], r.get(metric)))
  return views.curves({k: sorted(v) for k, v in series.items()}, f"pruning: {metric}",
                      "heads kept", metric)


def folder_view(out: str) -> views.View:
  """The views of whatever a study wrote in the folder `out`."""
  if _read(out, "patching.json") is not None or _read(out, "dla.json") is not None:
    return patching_view(out)
  if _read(out, "circuit.json") is not None:
    return circuit_view(out)
  roles = _read(out, "roles.json")
  if roles is not None:
    return views.roles_table(roles["assigned"], ROLE_COLORS)
  curve = _read(out, "curve.json")
  if curve is not None:
    return curve_view(curve["rows"])
  raise UserError(f"x: {out!r} holds no result a study writes (patching.json, dla.json, "
                  f"circuit.json, roles.json, curve.json)", setting="x")


def view_of(x) -> views.View:
  """The View of x (see the module docstring)."""
  from mha_jax import loader, traces
  if isinstance(x, views.View):
    return x
  if isinstance(x, traces.Trace):
    return views.attention_html(views.trace_data(x))
  if isinstance(x, loader.Loaded):
    return views.params_html(x.params, x.workdir)
  if isinstance(x, (str, os.PathLike)):
    return folder_view(os.fspath(x))
  if isinstance(x, dict) and "curve" in x and "nodes" in x:
    return faithfulness_view(x)
  if isinstance(x, dict) and "assigned" in x:
    return views.roles_table(x["assigned"], ROLE_COLORS)
  if isinstance(x, dict) and x and all(isinstance(v, numbers.Real) for v in x.values()):
    return views.bars(x)
  if isinstance(x, dict) and x and all(isinstance(v, str) for v in x.values()):
    return views.roles_table(x, ROLE_COLORS)
  if isinstance(x, list) and x and isinstance(x[0], dict) and "kept" in x[0]:
    return curve_view(x)
  if isinstance(x, dict):
    return views.params_html(x)
  raise UserError(f"x: show draws a Trace, a study's folder or document, {{name: value}}, "
                  f"a Loaded run or a params pytree; got {type(x).__name__}", setting="x")


def _in_ipython() -> bool:
  try:
    from IPython import get_ipython
  except ImportError:
    return False
  return get_ipython() is not None


def show(x):
  """Draws x inline (see the module docstring): displayed in IPython, returned
  elsewhere (a params tree printed as text)."""
  view = view_of(x)
  if _in_ipython():
    from IPython.display import display
    display(view)
    return None
  if view.text is not None:
    print(view.text)
    return None
  return view
