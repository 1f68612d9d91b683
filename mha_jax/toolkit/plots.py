"""Every figure the studies write, one implementation each (matplotlib, Agg backend):
heat maps, bars, role grids, score grids, the pruning and faithfulness curves, the
circuit graphs, the stability plots and the sweep's grid. Each saves through
`mha_jax.storage.savefig` (local paths and cloud URIs alike)."""

from __future__ import annotations

from typing import Sequence

import numpy as np

from mha_jax import storage
from mha_jax.roles.role_scores import ROLE_COLORS


def _pyplot():
  """matplotlib.pyplot on the Agg backend (files only, no display), imported when first
  drawn: the studies import this module without paying for matplotlib."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  return plt


def score_grids(rows, path, keys, title=""):
  """One layer x head heat map per score (missing values blank)."""
  plt = _pyplot()
  keys = [k for k in keys if any(k in r for r in rows)]
  if not rows or not keys:
    return no_heads(path, title)
  n_l = max(r["layer"] for r in rows) + 1
  n_h = max(r["index"] for r in rows) + 1
  fig, axes = plt.subplots(1, len(keys), figsize=(1.0 + 0.32 * n_h * len(keys) + 1.2 *
                                                  len(keys), 1.0 + 0.16 * n_l + 1),
                           squeeze=False)
  for ax, k in zip(axes[0], keys):
    grid = np.full((n_l, n_h), np.nan)
    for r in rows:
      if k in r and r[k] is not None:
        grid[r["layer"], r["index"]] = r[k]
    im = ax.imshow(grid, aspect="auto", cmap="viridis", interpolation="nearest")
    ax.set_title(k, fontsize=9)
    ax.set_xlabel("head")
    ax.set_ylabel("layer")
    fig.colorbar(im, ax=ax, fraction=0.05)
  fig.suptitle(title, fontsize=9)
  fig.tight_layout()
  storage.savefig(fig, path, dpi=100)
  plt.close(fig)


def no_heads(path, title: str = "") -> None:
  """The figure of a model without attention heads (every head pruned: an ablation
  baseline): a note in place of a plot."""
  plt = _pyplot()
  fig, ax = plt.subplots(figsize=(4, 1.6))
  ax.axis("off")
  ax.text(0.5, 0.5, "no attention heads in this model", ha="center", va="center")
  if title:
    fig.suptitle(title, fontsize=9)
  storage.savefig(fig, path, dpi=100)
  plt.close(fig)


def role_grid(rows, path, title):
  """Each stack's layer x head grid of squares coloured by role (roles.ROLE_COLORS)."""
  if not rows:
    return no_heads(path, title)
  plt = _pyplot()
  stacks = list(dict.fromkeys(r["stack"] for r in rows))
  fig, axes = plt.subplots(1, len(stacks), figsize=(3.2 * len(stacks), 3.2), squeeze=False)
  for ax, stack in zip(axes[0], stacks):
    rs = [r for r in rows if r["stack"] == stack]
    for r in rs:
      ax.add_patch(plt.Rectangle((r["index"], r["layer"]), 0.95, 0.95,
                                 color=ROLE_COLORS.get(r["role"], "#c7c7c7")))
    ax.set_xlim(0, max(r["index"] for r in rs) + 1)
    ax.set_ylim(max(r["layer"] for r in rs) + 1, 0)
    ax.set_xlabel("head")
    ax.set_ylabel("layer")
    ax.set_title(stack)
  handles = [plt.Rectangle((0, 0), 1, 1, color=c) for r, c in ROLE_COLORS.items()
             if any(x["role"] == r for x in rows)]
  labels = [r for r in ROLE_COLORS if any(x["role"] == r for x in rows)]
  fig.legend(handles, labels, loc="lower center", ncol=len(labels), fontsize=8)
  fig.suptitle(title)
  fig.tight_layout(rect=(0, 0.08, 1, 1))
  storage.savefig(fig, path, dpi=110)
  plt.close(fig)


def bars(names, values, path, ylabel, top=20):
  """Bars of the `top` largest |values|, named, largest first."""
  plt = _pyplot()
  order = np.argsort(-np.abs(np.asarray(values)))[:top]
  fig, ax = plt.subplots(figsize=(8, 3.2))
  ax.bar(range(len(order)), [values[i] for i in order])
  ax.set_xticks(range(len(order)), [names[i] for i in order], rotation=70, fontsize=7)
  ax.set_ylabel(ylabel)
  fig.tight_layout()
  storage.savefig(fig, path, dpi=110)
  plt.close(fig)


def heatmap(arr, title: str, path: str, xlabel: str = "head", cmap: str = "RdBu_r") -> None:
  """A (rows, heads) heat map, centred at 0 for diverging maps."""
  plt = _pyplot()
  a = np.asarray(arr, np.float64)
  lim = np.nanmax(np.abs(a)) if np.isfinite(a).any() else 1.0
  fig, ax = plt.subplots(figsize=(max(3.5, 0.35 * a.shape[1] + 2), max(3, 0.22 * a.shape[0] + 1.2)))
  im = ax.imshow(a, cmap=cmap, vmin=-lim, vmax=lim, aspect="auto", interpolation="nearest")
  ax.set_xlabel(xlabel)
  ax.set_ylabel("layer")
  ax.set_title(title, fontsize=9)
  fig.colorbar(im, ax=ax)
  fig.tight_layout()
  storage.savefig(fig, path, dpi=110)
  plt.close(fig)


def stability_roles(rep: dict, path: str, roles: Sequence[str] | None = None) -> None:
  """Per stack: heads of each role per layer, mean over seeds with std error bars; the
  number over a bar is how many seeds have the role in that layer."""
  plt = _pyplot()
  roles = [r for r in (roles or rep["roles"]) if r in rep["roles"] and r != "other"]
  stacks = list(rep["totals"])
  fig, axes = plt.subplots(1, len(stacks), figsize=(4.2 * len(stacks), 3.4), squeeze=False)
  by = {(r["stack"], r["layer"], r["role"]): r for r in rep["layers"]}
  width = 0.8 / max(len(roles), 1)
  for ax, stack in zip(axes[0], stacks):
    layers = sorted({r["layer"] for r in rep["layers"] if r["stack"] == stack})
    for j, role in enumerate(roles):
      xs = np.arange(len(layers)) + (j - (len(roles) - 1) / 2) * width
      rs = [by[(stack, l, role)] for l in layers]
      ax.bar(xs, [r["heads_mean"] for r in rs], width, yerr=[r["heads_std"] for r in rs],
             capsize=2, color=ROLE_COLORS.get(role, "#7f7f7f"), label=role)
      for x, r in zip(xs, rs):
        ax.text(x, r["heads_mean"] + r["heads_std"] + 0.05, str(r["seeds_with_role"]),
                ha="center", va="bottom", fontsize=6)
    ax.set_ylim(0, max([1.0] + [r["heads_mean"] + r["heads_std"] + 0.3 for r in rep["layers"]
                                if r["stack"] == stack and r["role"] in roles]))
    ax.set_xticks(range(len(layers)), [str(l) for l in layers])
    ax.set_xlabel("layer")
    ax.set_ylabel("heads (mean ± std over seeds)")
    ax.set_title(stack)
  handles, labels = axes[0][0].get_legend_handles_labels()
  if handles:
    fig.legend(handles, labels, loc="lower center", ncol=len(labels), fontsize=8)
  fig.suptitle(f"head roles over {rep['n_seeds']} seeds (number: seeds with the role)",
               fontsize=9)
  fig.tight_layout(rect=(0, 0.08, 1, 1))
  storage.savefig(fig, path, dpi=110)
  plt.close(fig)


def stability_curve(rep: dict, path: str) -> None:
  plt = _pyplot()
  fig, ax = plt.subplots(figsize=(5.2, 3.6))
  for method in dict.fromkeys(r["method"] for r in rep["rows"]):
    rs = sorted((r for r in rep["rows"] if r["method"] == method), key=lambda r: r["kept"])
    ax.errorbar([r["kept"] for r in rs], [r["mean"] for r in rs],
                yerr=[r["std"] for r in rs], fmt="o-", capsize=3, label=method)
  ax.set_xlabel("heads kept")
  ax.set_ylabel(f"test {rep['metric']} (mean ± std, {rep['n_seeds']} seeds)")
  ax.legend()
  fig.tight_layout()
  storage.savefig(fig, path, dpi=120)
  plt.close(fig)


def pruning_curve(rows, path, metric):
  """The pruning curve: the metric against the heads kept, one line per method."""
  plt = _pyplot()
  fig, ax = plt.subplots(figsize=(5, 3.5))
  for method in ("l0", "michel", "random"):
    rs = sorted((r for r in rows if r["method"] == method), key=lambda r: r["kept"])
    ax.plot([r["kept"] for r in rs], [r[metric] for r in rs], "o-", label=method)
  ax.set_xlabel("heads kept")
  ax.set_ylabel(f"test {metric}")
  ax.legend()
  fig.tight_layout()
  storage.savefig(fig, path, dpi=120)
  plt.close(fig)


def real_model_induction(result, path):
  """A real model's heads: induction score against previous-token score."""
  plt = _pyplot()
  heads = result["heads"]
  fig, ax = plt.subplots(figsize=(5, 4))
  x = [v["previous_token"] for v in heads.values()]
  y = [v["prefix_matching"] for v in heads.values()]
  ax.scatter(x, y, s=10, color="C7")
  for r in result["top_induction_heads"]:
    ax.annotate(r["head"][3:], (r["previous_token"], r["prefix_matching"]), fontsize=7)
  ax.set_xlabel("previous-token score")
  ax.set_ylabel("prefix matching (induction) score")
  ax.set_title("heads on repeated random tokens", fontsize=9)
  fig.tight_layout()
  storage.savefig(fig, path, dpi=110)
  plt.close(fig)


def circuit_figures(result, out_dir):
  """The circuits study's composition.png, positivity.png and icl.png."""
  plt = _pyplot()
  heads = result["heads"]
  names = sorted(heads, key=lambda n: tuple(int(v) for v in n.split(".")[1:]))
  pos = {n: (int(n.split(".")[2]), -int(n.split(".")[1])) for n in names}
  fig, ax = plt.subplots(figsize=(5, 3.5))
  colors = {"q": "C0", "k": "C3", "v": "C2"}
  for kind, m in result["composition"].items():
    for pair, v in m.items():
      e, l = pair.split("->")
      if v > 0:
        ax.plot([pos[e][0], pos[l][0]], [pos[e][1], pos[l][1]], color=colors[kind],
                lw=12 * v, alpha=0.6)
  for n in names:
    ax.scatter(*pos[n], s=200, color="white", edgecolor="black", zorder=3)
    ax.annotate(n.split(".", 1)[1], pos[n], ha="center", va="center", fontsize=7, zorder=4)
  ax.set_title("composition (line width = score - random baseline)\nQ blue, K red, V green",
               fontsize=9)
  ax.axis("off")
  fig.tight_layout()
  storage.savefig(fig, storage.join(out_dir, "composition.png"), dpi=120)
  plt.close(fig)
  fig, ax = plt.subplots(figsize=(4.5, 4))
  ind = {r["head"] for r in result["induction_heads"]}
  for n in names:
    if "k_comp_positivity" in heads[n]:
      ax.scatter(heads[n]["ov_positivity"], heads[n]["k_comp_positivity"],
                 color="C3" if n in ind else "C7", s=40)
      ax.annotate(n, (heads[n]["ov_positivity"], heads[n]["k_comp_positivity"]), fontsize=7)
  ax.set_xlim(-1.05, 1.05)
  ax.set_ylim(-1.05, 1.05)
  ax.axhline(0, color="k", lw=0.5)
  ax.axvline(0, color="k", lw=0.5)
  ax.set_xlabel("OV circuit eigenvalue positivity (copying)")
  ax.set_ylabel(f"K-composition QK positivity with {result['previous_token_head']}")
  ax.set_title("induction heads in red", fontsize=9)
  fig.tight_layout()
  storage.savefig(fig, storage.join(out_dir, "positivity.png"), dpi=120)
  plt.close(fig)
  if result.get("over_steps"):    # the phase change: ICL score and the best heads
    rows = result["over_steps"]
    steps = [r["step"] for r in rows]
    fig, (a0, a1) = plt.subplots(1, 2, figsize=(9, 3.2))
    a0.plot(steps, [r["icl_score"] for r in rows], "o-", label="repeated random tokens")
    if "text_icl_score" in rows[0]:
      r0 = rows[0]
      a0.plot(steps, [r["text_icl_score"] for r in rows], "s-",
              label=f"text: token {r0['text_late_token']} - token {r0['text_early_token']}")
    a0.axhline(0, color="k", lw=0.5)
    a0.set_xlabel("training step")
    a0.set_ylabel("ICL score (late - early loss, nats)")
    a0.legend(fontsize=7)
    for key, label in (("max_prefix_matching", "best prefix matching"),
                       ("max_previous_token", "best previous-token")):
      a1.plot(steps, [np.nan if r[key] is None else r[key] for r in rows], "o-",
              label=label)
    a1.set_ylim(0, 1)
    a1.set_xlabel("training step")
    a1.set_ylabel("attention share")
    a1.legend(fontsize=7)
    fig.tight_layout()
    storage.savefig(fig, storage.join(out_dir, "icl.png"), dpi=120)
    plt.close(fig)


def faithfulness_curve(points, target, path, title) -> None:
  plt = _pyplot()
  fig, ax = plt.subplots(figsize=(5, 3.4))
  x = [max(p["fraction"], 1e-5) for p in points]
  ax.plot(x, [p["faithfulness"] for p in points], "o-", ms=3)
  ax.axhline(target, color="gray", ls=":", lw=1)
  ax.axhline(1.0, color="black", lw=0.5)
  ax.set_xscale("log")
  ax.set_xlabel("fraction of edges kept")
  ax.set_ylabel("faithfulness")
  ax.set_title(title, fontsize=9)
  fig.tight_layout()
  storage.savefig(fig, path, dpi=110)
  plt.close(fig)


def circuit_graph(graph, keep, scores, edges, path) -> None:
  """Nodes at (position in layer, layer): embed at the bottom, logits at the top; the
  kept edges, red where ablating them lowers the metric, blue where it raises it."""
  plt = _pyplot()
  L = graph.layers
  width = max(graph.heads) + 1
  pos = {0: ((width - 1) / 2, 0.0)}
  off = graph.node_offsets()
  for i in range(L):
    for h in range(graph.heads[i]):
      pos[off[i] + h] = (h, 1.0 + i)
    if graph.mlp[i]:
      pos[off[i] + graph.heads[i]] = (width - 0.3, 1.4 + i)
  top = (float(width - 1) / 2, L + 1.0)
  fig, ax = plt.subplots(figsize=(max(4, 0.5 * width + 2), max(4, 0.28 * L + 2)))
  score = {(int(u), int(e)): float(v) for (u, e), v in zip(edges, scores)}
  lim = max((abs(score[(u, e)]) for u, e in zip(*np.nonzero(keep))), default=1.0) or 1.0
  used = set()
  for u, e in zip(*np.nonzero(keep)):
    fed = graph.end_node(int(e))
    targets = [pos[n] for n in fed] if fed else [top]
    v = score.get((int(u), int(e)), 0.0)
    for tx, ty in targets:
      ax.plot([pos[u][0], tx], [pos[u][1], ty], color="tab:red" if v < 0 else "tab:blue",
              lw=0.3 + 2.5 * abs(v) / lim, alpha=0.6)
    used.add(int(u))
    used.update(fed)
  names = graph.nodes
  for n, (x, y) in pos.items():
    on = n in used
    ax.plot(x, y, "o", color="black" if on else "0.85", ms=5 if on else 2)
    if on and n:
      ax.annotate(names[n].split(".", 1)[1], (x, y), fontsize=6, xytext=(2, 2),
                  textcoords="offset points")
  ax.plot(*top, "s", color="black")
  ax.annotate("logits", top, fontsize=7, xytext=(4, 0), textcoords="offset points")
  ax.annotate("embed", pos[0], fontsize=7, xytext=(4, 0), textcoords="offset points")
  ax.set_xlabel("head (MLP on the right)")
  ax.set_ylabel("layer + 1")
  ax.set_title(f"circuit: {int(np.sum(keep))} edges", fontsize=9)
  fig.tight_layout()
  storage.savefig(fig, path, dpi=110)
  plt.close(fig)


def sweep_grid(rows: list[dict], path: str) -> None:
  plt = _pyplot()
  done = [r for r in rows if r["valid_loss"] is not None]
  if not done:
    return
  has_bleu = any(r["valid_bleu"] is not None for r in done)
  fig, axes = plt.subplots(1, 2 if has_bleu else 1, figsize=(9 if has_bleu else 5, 3.5))
  axes = list(axes) if has_bleu else [axes]
  hs = [r["heads"] for r in done]
  axes[0].plot(hs, [r["valid_loss"] for r in done], "o-")
  axes[0].set_ylabel("valid loss")
  if has_bleu:
    axes[1].plot(hs, [r["valid_bleu"] or 0 for r in done], "o-", color="C1")
    axes[1].set_ylabel("valid BLEU")
  for ax in axes:
    ax.set_xscale("log", base=2)
    ax.set_xlabel("heads h (d_k = d_model / h)")
    ax.set_xticks(hs, [f"{h}\n(d_k={r['d_k']})" for h, r in zip(hs, done)], fontsize=7)
  fig.tight_layout()
  storage.savefig(fig, path, dpi=120)
  plt.close(fig)


AGAINST_HEADS = (("first_token_share", "first-token share (mean over heads)"),
                 ("loss", "test loss (nats)"), ("heads_kept", "heads kept after L0 pruning"),
                 ("phase_change_step", "induction phase-change step"))


def against_heads(rows: list[dict], path: str, tolerance_text: str = "") -> None:
  """compare-runs' four panels against h (log 2), one line per variant (seeds
  averaged): the first-token share, the loss, the heads kept, the phase-change step."""
  plt = _pyplot()
  fig, axes = plt.subplots(1, len(AGAINST_HEADS), figsize=(4 * len(AGAINST_HEADS), 3.4))
  variants = list(dict.fromkeys(r["variant"] for r in rows))
  for ax, (key, label) in zip(axes, AGAINST_HEADS):
    for i, v in enumerate(variants):
      pts = {}
      for r in rows:
        if r["variant"] == v and r.get(key) is not None:
          pts.setdefault(r["heads"], []).append(r[key])
      if pts:
        hs = sorted(pts)
        ax.plot(hs, [np.mean(pts[h]) for h in hs], "o-", color=f"C{i}", label=v, ms=4)
    if not ax.lines:
      ax.text(0.5, 0.5, "no run reached it", ha="center", va="center",
              transform=ax.transAxes, fontsize=9)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("heads h")
    ax.set_ylabel(label if key != "heads_kept" else label + tolerance_text, fontsize=8)
  next((a for a in axes if a.lines), axes[0]).legend(fontsize=7)
  fig.tight_layout()
  storage.savefig(fig, path, dpi=120)
  plt.close(fig)
