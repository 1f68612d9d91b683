"""The explorer page (mha_jax/assets/explorer.{html,css,js}) as an inline view: the whole
page in an iframe's srcdoc, so its scripts and element ids stay its own when a notebook
shows several views."""

from __future__ import annotations

import html

import numpy as np

from mha_jax import assets
from mha_jax.views.charts import View


def explorer_html(data: dict, title: str = "", height: int = 720) -> View:
  """The explorer page of `data` (what the studies write: "weights" for the attention
  view, "patching", "circuit") as a View."""
  page = assets.page("explorer", data, title=html.escape(title))
  frame = (f'<iframe class="mha-jax-view" title="{html.escape(title, quote=True)}" '
           f'srcdoc="{html.escape(page, quote=True)}" style="width:100%;height:{height}px;'
           f'border:1px solid #ddd" onload="try{{this.style.height=Math.max({height // 2},'
           f'this.contentWindow.document.body.scrollHeight+30)+\'px\'}}catch(e){{}}">'
           f'</iframe>')
  return View(frame, title)


def trace_data(trace, rows=None, digits: int = 3, roles: dict | None = None,
               colors: dict | None = None) -> dict:
  """The attention view's data of a Trace (`loaded.run(..., capture=["attn.pattern"])`):
  each prompt's tokens and `weights[row][stack][layer][head][query][key]` over its real
  tokens, to `digits` places. roles {head name: role} and colors {role: colour} colour
  the head buttons (none by default)."""
  stacks = [s for s in trace.stacks if trace.layers("attn.pattern", s)]
  if not stacks:
    raise ValueError("the trace holds no attention pattern: run it with "
                     "capture=['attn.pattern']")
  rows = range(len(trace.tokens)) if rows is None else rows
  sents, weights = [], []
  for b in rows:
    n = int(trace.lengths[b])
    sents.append({"tokens": list(trace.tokens[b]), "label": f"prompt {b}"})
    weights.append({s: [np.round(np.asarray(trace[f"{s}.{i}.attn.pattern"][b], np.float64)
                                 [:, :n, :n], digits).tolist()
                        for i in range(trace.layers("attn.pattern", s))] for s in stacks})
  return {"sentences": sents, "weights": weights, "stacks": stacks, "roles": roles or {},
          "colors": colors or {}}


def attention_html(data: dict, title: str = "attention patterns") -> View:
  """The attention view of `trace_data`'s data (layer selector, head buttons, the model
  view of every head, hover over tokens)."""
  return explorer_html(data, title)
