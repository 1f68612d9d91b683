"""Views drawn here as plain HTML and SVG (no script): bars, a roles table coloured by
role, curves, a params pytree. Hovering a bar, a cell or a point shows its value (its
`title`); every value is also in a `data-value` attribute."""

from __future__ import annotations

import html
import math
from typing import Mapping, Sequence

import numpy as np

PALETTE = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2",
           "#17becf")


class View:
  """HTML that a notebook shows inline (`_repr_html_`): a self-contained fragment, no
  request leaves it. `html` holds it; `save(path)` writes it to a file; `text`, where
  set, is what a terminal prints instead (a params tree)."""

  def __init__(self, html_text: str, title: str = "", text: str | None = None):
    self.html, self.title, self.text = html_text, title, text

  def _repr_html_(self) -> str:
    return self.html

  def __add__(self, other: "View") -> "View":
    return View(self.html + other.html, self.title or other.title)

  def __repr__(self):
    return f"View({self.title!r}, {len(self.html)} characters of HTML)"

  def save(self, path: str) -> str:
    from mha_jax import storage
    storage.write_text(path, f'<meta charset="utf-8">\n{self.html}\n')
    return path


def _esc(x) -> str:
  return html.escape(str(x), quote=True)


def _box(title: str, body: str, kind: str) -> str:
  return (f'<div class="mha-jax-view mha-jax-{kind}" style="font-family:sans-serif;'
          f'font-size:12px;margin:6px 0"><div style="font-weight:bold;margin-bottom:4px">'
          f'{_esc(title)}</div>{body}</div>')


def bars(table: Mapping[str, float], title: str = "", top: int = 20, width: int = 240) -> View:
  """Horizontal bars of the `top` entries of {name: value} by |value| (red positive, blue
  negative), each with its value on hover."""
  items = [(k, float(v)) for k, v in table.items() if v is not None and math.isfinite(v)]
  items = sorted(items, key=lambda kv: -abs(kv[1]))[:top]
  lim = max([abs(v) for _, v in items] + [1e-12])
  rows = []
  for name, v in items:
    w = round(width * abs(v) / lim)
    colour = "#b2182b" if v >= 0 else "#2166ac"
    rows.append(f'<tr class="bar" data-name="{_esc(name)}" data-value="{v!r}" '
                f'title="{_esc(name)}: {v:+.4f}"><td style="padding:1px 6px">{_esc(name)}</td>'
                f'<td style="width:{width}px"><div style="height:11px;width:{w}px;'
                f'background:{colour}"></div></td><td style="font-family:monospace;'
                f'text-align:right">{v:+.4f}</td></tr>')
  body = f'<table style="border-collapse:collapse">{"".join(rows)}</table>'
  return View(_box(title or f"top {len(items)} by |value|", body, "bars"), title)


def _grid(stack: str, assigned: Mapping[str, str], colors: Mapping[str, str]) -> str:
  """One stack's layers x heads table of roles."""
  mine = [n.rsplit(".", 2) for n in assigned if n.rsplit(".", 2)[0] == stack]
  layers = 1 + max(int(p[1]) for p in mine)
  heads = 1 + max(int(p[2]) for p in mine)
  head_row = "".join(f'<th style="font-weight:normal;color:#555">{h}</th>' for h in range(heads))
  rows = [f"<tr><th>layer \\ head</th>{head_row}</tr>"]
  for layer in range(layers):
    cells = []
    for h in range(heads):
      name = f"{stack}.{layer}.{h}"
      role = assigned.get(name)
      colour = colors.get(role, "#c7c7c7") if role else "#fff"
      cells.append(f'<td class="role" data-name="{name}" data-role="{_esc(role or "")}" '
                   f'title="{name}: {_esc(role or "")}" style="width:18px;height:14px;'
                   f'background:{colour};border:1px solid #fff"></td>')
    rows.append(f'<tr><th style="font-weight:normal;color:#555">{stack}.{layer}</th>'
                f'{"".join(cells)}</tr>')
  return f'<table style="border-collapse:collapse;margin:4px 0">{"".join(rows)}</table>'


def roles_table(assigned: Mapping[str, str], colors: Mapping[str, str],
                title: str = "head roles") -> View:
  """A layers x heads table per stack of {head name ("stack.layer.head"): role}, each
  cell coloured by its role (the role and head on hover), with a legend counting each
  role."""
  if not assigned:
    raise ValueError("roles_table: no head has a role (an empty table)")
  counts: dict[str, int] = {}
  for r in assigned.values():
    counts[r] = counts.get(r, 0) + 1
  stacks = list(dict.fromkeys(n.rsplit(".", 2)[0] for n in assigned))
  legend = " ".join(f'<span class="legend" style="background:{colors.get(r, "#c7c7c7")};'
                    f'color:#fff;padding:1px 5px">{_esc(r)} ({n})</span>'
                    for r, n in sorted(counts.items(), key=lambda kv: -kv[1]))
  body = (f'<div style="margin-bottom:4px">{legend}</div>'
          + "".join(_grid(s, assigned, colors) for s in stacks))
  return View(_box(title, body, "roles"), title)


def _ticks(lo: float, hi: float) -> list[float]:
  return [lo + (hi - lo) * i / 4 for i in range(5)]


def curves(series: Mapping[str, Sequence[tuple[float, float]]], title: str = "",
           xlabel: str = "x", ylabel: str = "y", log_x: bool = False, size=(420, 260)) -> View:
  """A line plot of {label: [(x, y), ...]} as SVG: axes with ticks, one colour per
  series, each point's values on hover."""
  pts = [(x, y) for s in series.values() for x, y in s if y is not None and math.isfinite(y)]
  if not pts:
    raise ValueError("curves: no finite point to draw")
  fx = (lambda x: math.log10(max(x, 1e-12))) if log_x else float
  xs, ys = [fx(x) for x, _ in pts], [y for _, y in pts]
  x0, x1 = min(xs), max(xs) + (1e-9 if max(xs) == min(xs) else 0)
  y0, y1 = min(ys), max(ys) + (1e-9 if max(ys) == min(ys) else 0)
  w, h, m = size[0], size[1], 46
  sx = lambda x: m + (fx(x) - x0) / (x1 - x0) * (w - m - 12)  # noqa: E731
  sy = lambda y: h - m + 10 - (y - y0) / (y1 - y0) * (h - m - 10)  # noqa: E731
  out = [f'<line x1="{m}" y1="{h - m + 10}" x2="{w - 12}" y2="{h - m + 10}" stroke="#555"/>',
         f'<line x1="{m}" y1="10" x2="{m}" y2="{h - m + 10}" stroke="#555"/>']
  for t in _ticks(x0, x1):
    label = f"{10 ** t:.3g}" if log_x else f"{t:.3g}"
    px = m + (t - x0) / (x1 - x0) * (w - m - 12)
    out.append(f'<text x="{px:.1f}" y="{h - m + 24}" text-anchor="middle">{label}</text>')
  for t in _ticks(y0, y1):
    out.append(f'<text x="{m - 4}" y="{sy(t) + 3:.1f}" text-anchor="end">{t:.3g}</text>')
  out.append(f'<text x="{(w + m) / 2}" y="{h - 6}" text-anchor="middle">{_esc(xlabel)}</text>')
  out.append(f'<text x="12" y="{h / 2}" transform="rotate(-90 12 {h / 2})" '
             f'text-anchor="middle">{_esc(ylabel)}</text>')
  legend = []
  for k, (label, s) in enumerate(series.items()):
    c = PALETTE[k % len(PALETTE)]
    s = [(x, y) for x, y in s if y is not None and math.isfinite(y)]
    path = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in s)
    out.append(f'<polyline points="{path}" fill="none" stroke="{c}" stroke-width="1.5"/>')
    out += [f'<circle class="point" cx="{sx(x):.1f}" cy="{sy(y):.1f}" r="3" fill="{c}" '
            f'data-series="{_esc(label)}" data-x="{x!r}" data-value="{y!r}"><title>'
            f'{_esc(label)}: {xlabel} {x:.4g}, {ylabel} {y:.4g}</title></circle>' for x, y in s]
    legend.append(f'<span style="color:{c}">&#9632; {_esc(label)}</span>')
  svg = (f'<svg width="{w}" height="{h}" style="font-size:10px;font-family:sans-serif">'
         f'{"".join(out)}</svg>')
  return View(_box(title, f'<div>{" ".join(legend)}</div>{svg}', "curves"), title)


def params_text(params) -> str:
  """Every leaf of a params pytree as `path  shape  dtype`, one a line, and the total."""
  import jax
  lines, total = [], 0
  for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
    a = np.asarray(leaf) if not hasattr(leaf, "shape") else leaf
    name = "/".join(str(getattr(p, "key", getattr(p, "idx", p))) for p in path)
    lines.append(f"{name}  {tuple(a.shape)}  {a.dtype}")
    total += int(np.prod(a.shape))
  return "\n".join(lines + [f"{len(lines)} arrays, {total:,} numbers"])


def params_html(params, title: str = "params") -> View:
  """A params pytree: treescope's interactive tree where treescope is installed, else
  params_text in a <pre>."""
  text = params_text(params)
  try:
    import treescope
  except ImportError:
    return View(_box(title, f"<pre>{_esc(text)}</pre>", "params"), title, text)
  return View(f'<div class="mha-jax-view mha-jax-params">{treescope.render_to_html(params)}'
              f'</div>', title, text)
