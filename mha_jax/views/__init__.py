"""Views that draw themselves in a notebook (Jupyter, JupyterLab, VS Code): each is a
`View`, whose `_repr_html_` is self-contained and offline (no CDN, no request).

  frames.py     the explorer page (mha_jax/assets/explorer.*) in an iframe: a trace's
                attention patterns, patching results as a heatmap, a circuit
  charts.py     drawn here as SVG / HTML: bars (DLA), a roles table coloured by role,
                curves (pruning, faithfulness), a params pytree with shapes

The studies' results are drawn from the JSON they write (`mha_jax.show(out)`), so a
committed result is drawn without its model. Everything here is pure: data in, HTML out.
"""

from mha_jax.views.charts import (View, bars, curves, params_html, params_text,
                                  roles_table)
from mha_jax.views.frames import attention_html, explorer_html, trace_data

__all__ = ["View", "attention_html", "bars", "curves", "explorer_html", "params_html",
           "params_text", "roles_table", "trace_data"]
