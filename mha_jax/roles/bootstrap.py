"""Text-based role scores that hold still: each head scored on many text windows, with a
bootstrap interval over windows (issue 46, item 7).

The taxonomy scores its text roles (copy_suppression, attention_sink) on its first
`text_windows` windows. Here each head's score comes from the same detectors on each of
n windows spread evenly across the test split, one window at a time; the score is the
mean over windows with a percentile bootstrap interval (windows resampled with
replacement), and a head qualifies only when the interval's lower end clears the
role's threshold (copy suppression also needs a negative `ov_self`, as the taxonomy
asks).

  spread_windows(task, n, text_len)       (n', text_len + 1) windows spread over the split
  per_window(task, params, windows, sample)   {role: (W, L, H_max)} each window's score
  intervals(x_WLH, draws, level, seed)    (mean, lo, hi), each (L, H_max)
  stability(task, params, heads, ...)     {"windows", ..., "roles": {role: {"heads": {head:
                                          {"mean", "lo", "hi", "point", "stable"}},
                                          "qualifies"}}}
"""

from __future__ import annotations

import numpy as np

from mha_jax.errors import UserError
from mha_jax.roles import detectors

TEXT_ROLES = ("copy_suppression", "attention_sink")


def spread_windows(task, n: int, text_len: int) -> tuple[np.ndarray, list[int], int]:
  """(tokens (n', text_len + 1), their indices, windows in the split): n windows of the
  test split's evaluation rows (task.eval_batches, padding left out) at evenly spread
  indices (n' <= n when the split has fewer)."""
  if int(n) < 1:
    raise UserError(f"bootstrap_windows must be >= 1 to spread windows; got {n}",
                    setting="bootstrap_windows")
  rows = [np.asarray(b["tokens"])[np.asarray(w) > 0]
          for b, w in task.eval_batches("test", 16)]
  allw = np.concatenate(rows)[:, :text_len + 1]
  if allw.shape[1] < 3:
    raise UserError(f"text_len: the model's evaluation windows have {allw.shape[1]} tokens",
                    setting="text_len")
  pick = np.unique(np.linspace(0, len(allw) - 1, min(int(n), len(allw))).astype(int))
  return allw[pick], [int(i) for i in pick], len(allw)


def per_window(task, params, windows: np.ndarray, sample: np.ndarray,
               roles=TEXT_ROLES, log=None) -> dict[str, np.ndarray]:
  """{role: (W, L, H_max)}: the taxonomy's detectors on each window (T + 1,) alone, for
  the text roles named (one program per detector, a window per batch)."""
  fns = {"copy_suppression": lambda t: detectors.copy_suppression_text(
             task, params, t, sample, per_window=True),
         "attention_sink": lambda t: detectors.sink_scores(task, params, t, per_window=True)}
  out = {}
  for r in roles:
    out[r] = fns[r](np.asarray(windows))
    if log is not None:
      log(f"  bootstrap: {r} on {len(windows)} windows")
  return out


def intervals(x_WLH: np.ndarray, draws: int, level: float, seed: int):
  """(mean (L, H), lo (L, H), hi (L, H)): the mean over windows (axis 0) and its
  two-sided `level` percentile bootstrap interval over `draws` resamples of the
  windows with replacement (NaN cells, heads a layer lacks, stay NaN)."""
  if not 0.0 < float(level) < 1.0:
    raise UserError(f"bootstrap_level must be in (0, 1); got {level}", setting="bootstrap_level")
  x = np.asarray(x_WLH, np.float64)
  rng = np.random.default_rng(seed)
  idx = rng.integers(0, x.shape[0], size=(int(draws), x.shape[0]))
  boots = x[idx].mean(1)                                   # (draws, L, H)
  a = (1 - float(level)) / 2
  return (x.mean(0), np.nanquantile(boots, a, axis=0), np.nanquantile(boots, 1 - a, axis=0))


def stability(task, params, heads, thresholds: dict, point: dict, ov_self: dict | None,
              sample: np.ndarray, n: int, text_len: int, draws: int = 2000,
              level: float = 0.9, seed: int = 0, roles_=TEXT_ROLES, log=None) -> dict:
  """The text roles' (roles_) bootstrap over n spread windows (see the module docstring)
  for heads ("lm.L.H"): per head its "mean", interval "lo"/"hi", the taxonomy's "point"
  score (point[role][head]) and "stable" (the interval clears the threshold, and for
  copy suppression ov_self[head] < 0); per role the heads that qualify."""
  bad = [r for r in roles_ if r not in TEXT_ROLES]
  if bad:
    raise UserError(f"the bootstrap scores the text roles {', '.join(TEXT_ROLES)}; got "
                    f"{', '.join(bad)}", setting="roles")
  windows, pick, total = spread_windows(task, n, text_len)
  scores = per_window(task, params, windows, sample, roles_, log)
  roles = {}
  for role in roles_:
    mean, lo, hi = intervals(scores[role], draws, level, seed)
    table = {}
    for h in heads:
      layer, head = (int(v) for v in h.split(".")[1:])
      ok = bool(lo[layer, head] >= thresholds[role])
      if role == "copy_suppression":
        ok = ok and ov_self[h] < 0
      table[h] = {"mean": float(mean[layer, head]), "lo": float(lo[layer, head]),
                  "hi": float(hi[layer, head]), "point": point.get(role, {}).get(h),
                  "stable": ok}
    roles[role] = {"threshold": thresholds[role], "heads": table,
                   "qualifies": [h for h, v in table.items() if v["stable"]]}
  return {"windows": pick, "windows_in_split": total, "text_len": int(text_len),
          "draws": int(draws), "level": float(level), "seed": int(seed), "roles": roles}
