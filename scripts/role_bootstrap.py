"""Text-based role scores with bootstrap intervals over windows (issue 46, item 7).

    python scripts/role_bootstrap.py --workdir W --roles docs/results/taxonomy/NAME/roles.json
        [--windows 16] [--draws 2000] [--level 0.9] [--out .../roles_bootstrap.json]

The taxonomy scores its text-based roles (copy_suppression, attention_sink) on the first
`text_windows` windows of the test split (2 by default: 258 tokens of one markdown table
on SmolLM2). Here each head's score is computed by the taxonomy's own detectors
(analysis.detectors.copy_suppression_text, .sink_scores) on each of --windows windows
spread evenly across the split, one window at a time; the head's score is the mean over
windows, with a percentile bootstrap interval over windows (--draws resamples, --level
two-sided). A head qualifies only when the interval's lower end clears the role's
threshold from roles.json (copy suppression also needs its OV circuit to suppress,
roles.json's extra.ov_self < 0, as the taxonomy asks). The roles are then assigned by
the taxonomy's own `assign` with every other role's qualifying heads as in roles.json,
and the heads whose role changes are counted.

Writes --out (default: roles_bootstrap.json beside --roles) with the machine record.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np


TEXT_ROLES = ("copy_suppression", "attention_sink")


def per_window(run, windows, text_len: int, seed: int) -> dict[str, np.ndarray]:
  """{role: (W, L, H_max)} each window's score by the taxonomy's detectors."""
  from mha_jax.roles import detectors, head_taxonomy as taxonomy
  sample = taxonomy.vocab_sample(run.task, seed)     # the taxonomy's own sample
  out = {r: [] for r in TEXT_ROLES}
  for i, w in enumerate(windows):
    tok = np.asarray(w[None, :text_len + 1])
    out["copy_suppression"].append(detectors.copy_suppression_text(run.task, run.params, tok,
                                                                   sample))
    out["attention_sink"].append(detectors.sink_scores(run.task, run.params, tok))
    print(f"window {i + 1}/{len(windows)}", flush=True)
  return {r: np.stack(v) for r, v in out.items()}


def intervals(x_WLH: np.ndarray, draws: int, level: float, seed: int):
  """(mean (L, H), lo (L, H), hi (L, H)): the mean over windows and its percentile
  bootstrap interval (windows resampled with replacement)."""
  rng = np.random.default_rng(seed)
  w = x_WLH.shape[0]
  idx = rng.integers(0, w, size=(draws, w))
  boots = x_WLH[idx].mean(1)                                  # (draws, L, H)
  a = (1 - level) / 2
  return (x_WLH.mean(0), np.nanquantile(boots, a, axis=0),
          np.nanquantile(boots, 1 - a, axis=0))


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--workdir", required=True)
  p.add_argument("--roles", required=True, help="the taxonomy's roles.json for this model")
  p.add_argument("--windows", type=int, default=16)
  p.add_argument("--draws", type=int, default=2000)
  p.add_argument("--level", type=float, default=0.9)
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--out", default=None)
  args = p.parse_args(argv)
  from mha_jax import loader
  from mha_jax.roles import head_taxonomy as taxonomy
  from mha_jax.machine import machine
  doc = json.load(open(args.roles))
  text_len = int(doc["settings"]["text_len"])
  run = loader.load(args.workdir)
  allw = np.asarray(run.task.windows("test"))
  pick = np.unique(np.linspace(0, len(allw) - 1, min(args.windows, len(allw))).astype(int))
  t0 = time.perf_counter()
  scores = per_window(run, allw[pick], text_len, doc["settings"]["seed"])
  seconds = time.perf_counter() - t0
  heads = list(doc["assigned"])
  qualifies = {r: list(v) for r, v in doc["qualifies"].items()}
  roles_out = {}
  for role in TEXT_ROLES:
    th = doc["thresholds"][role]
    mean, lo, hi = intervals(scores[role], args.draws, args.level, args.seed)
    table = {}
    for h in heads:
      layer, head = (int(v) for v in h.split(".")[1:])
      table[h] = {"mean": float(mean[layer, head]), "lo": float(lo[layer, head]),
                  "hi": float(hi[layer, head]),
                  "two_window_score": float(doc["lm_roles"][role][h])}
    ok = [h for h, v in table.items() if v["lo"] >= th]
    if role == "copy_suppression":
      ok = [h for h in ok if doc["extra"]["ov_self"][h] < 0]
    roles_out[role] = {"threshold": th, "qualifies_before": doc["qualifies"].get(role, []),
                       "qualifies_after": ok, "heads": table}
    qualifies[role] = ok
  new = taxonomy.assign(heads, qualifies)
  changed = {h: [doc["assigned"][h], new[h]] for h in heads if new[h] != doc["assigned"][h]}
  result = {"workdir": args.workdir, "roles_file": args.roles, "windows": [int(i) for i in pick],
            "windows_in_split": int(len(allw)), "text_len": text_len, "draws": args.draws,
            "level": args.level, "roles": roles_out, "assigned_after": new,
            "changed": changed, "n_changed": len(changed), "seconds": round(seconds, 1),
            "machine": machine()}
  out = args.out or os.path.join(os.path.dirname(args.roles), "roles_bootstrap.json")
  with open(out, "w") as f:
    json.dump(result, f, indent=1)
  for role, r in roles_out.items():
    print(f"{role}: threshold {r['threshold']}; qualifying heads {len(r['qualifies_before'])} "
          f"(2 windows, point score) -> {len(r['qualifies_after'])} ({len(pick)} windows, "
          f"{args.level:.0%} interval clears it)")
  print(f"assignments changed: {len(changed)} of {len(heads)}")
  print(f"wrote {out}")


if __name__ == "__main__":
  main()
