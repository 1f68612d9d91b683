"""Text-based role scores with bootstrap intervals over windows (issue 46, item 7).

    python scripts/role_bootstrap.py --workdir W --roles docs/results/taxonomy/NAME/roles.json
        [--windows 16] [--draws 2000] [--level 0.9] [--out .../roles_bootstrap.json]

The taxonomy scores its text-based roles (copy_suppression, attention_sink) on the first
`text_windows` windows of the test split (2 by default: 258 tokens of one markdown table
on SmolLM2). This applies the taxonomy's own bootstrap (roles.bootstrap.stability, what
`mha-jax taxonomy --bootstrap-windows N` runs inside the study) to a roles.json already
written, without running the rest again: each head scored on each of --windows windows
spread evenly across the split, the mean with a percentile bootstrap interval over
windows (--draws resamples, --level two-sided), a head qualifying only when the
interval's lower end clears the role's threshold from roles.json (copy suppression also
needs roles.json's extra.ov_self < 0). The roles are then assigned by the taxonomy's own
`assign` with every other role's qualifying heads as in roles.json, and the heads whose
role changes are counted.

Writes --out (default: roles_bootstrap.json beside --roles) with the machine record.
"""

from __future__ import annotations

import argparse
import json
import os
import time


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
  from mha_jax.roles import bootstrap, head_taxonomy as taxonomy
  from mha_jax.machine import machine
  doc = json.load(open(args.roles))
  st = doc["settings"]
  run = loader.load(args.workdir)
  heads = list(doc["assigned"])
  t0 = time.perf_counter()
  boot = bootstrap.stability(run.task, run.params, heads, doc["thresholds"], doc["lm_roles"],
                             doc["extra"].get("ov_self"),
                             taxonomy.vocab_sample(run.task, st["seed"]), args.windows,
                             int(st["text_len"]), args.draws, args.level, args.seed,
                             log=print)
  seconds = time.perf_counter() - t0
  qualifies = {r: list(v) for r, v in doc["qualifies"].items()}
  for role, r in boot["roles"].items():
    r["qualifies_point"] = doc["qualifies"].get(role, [])
    qualifies[role] = r["qualifies"]
  new = taxonomy.assign(heads, qualifies)
  changed = {h: [doc["assigned"][h], new[h]] for h in heads if new[h] != doc["assigned"][h]}
  result = {"workdir": args.workdir, "roles_file": args.roles, **boot,
            "assigned_after": new, "changed": changed, "n_changed": len(changed),
            "seconds": round(seconds, 1), "machine": machine()}
  out = args.out or os.path.join(os.path.dirname(args.roles), "roles_bootstrap.json")
  with open(out, "w") as f:
    json.dump(result, f, indent=1)
  for role, r in boot["roles"].items():
    print(f"{role}: threshold {r['threshold']}; qualifying heads {len(r['qualifies_point'])} "
          f"(point score) -> {len(r['qualifies'])} ({len(boot['windows'])} windows, "
          f"{args.level:.0%} interval clears it)")
  print(f"assignments changed: {len(changed)} of {len(heads)}")
  print(f"wrote {out}")


if __name__ == "__main__":
  main()
