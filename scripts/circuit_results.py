"""A committed results file from `mha-jax circuit`'s output, with the heads' places in it.

    python scripts/circuit_results.py OUT_DIR RESULT_DIR [--patching DIR]

Writes RESULT_DIR/circuit.json (circuit.json with its 300 strongest edges, not all) and
its figures, and a "roles" table: for the heads with the most |score| in their edges,
the edge to the logits, the strongest edges out and in, and, when --patching names a
`mha-jax patch` output of the same model and task, the head's activation-patching
recovery and DLA (what the docs use to name name movers, S-inhibition and the rest).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shutil

from mha_jax.machine import machine


def roles(doc: dict, patching: str | None, group: int, top: int = 12) -> dict:
  """group: query heads per key/value head (an end lm.i.g.k feeds heads g*group ..)."""
  mass = collections.Counter()
  out_e, in_e = collections.defaultdict(list), collections.defaultdict(list)
  for e in doc["edges"]:
    if e["from"] not in ("embed",) and not e["from"].endswith(".mlp"):
      mass[e["from"]] += abs(e["score"])
      out_e[e["from"]].append((e["to"], e["score"]))
    if e["to"] == "logits" or e["to"].endswith(".mlp"):
      continue
    _, i, j, c = e["to"].split(".")
    fed = [int(j)] if c == "q" else range(int(j) * group, (int(j) + 1) * group)
    for h in fed:         # a kv end counts for every query head reading it
      mass[f"lm.{i}.{h}"] += abs(e["score"]) / len(fed)
      in_e[f"lm.{i}.{h}"].append((e["from"], e["to"], e["score"]))
  act = dla = {}
  if patching:
    act = json.load(open(os.path.join(patching, "patching.json")))["scores"]["head_out"]
    dla = json.load(open(os.path.join(patching, "dla.json")))["heads"]
  table = {}
  for h, m in mass.most_common(top):
    outs = sorted(out_e[h], key=lambda t: -abs(t[1]))
    table[h] = {"edge_mass": round(m, 4),
                "to_logits": next((s for t, s in outs if t == "logits"), None),
                "top_out": [[t, round(s, 4)] for t, s in outs[:3]],
                "top_in": [[f, t, round(s, 4)] for f, t, s in
                           sorted(in_e[h], key=lambda t: -abs(t[2]))[:3]],
                "activation_patching": act.get(h), "dla": dla.get(h)}
  return table


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("out")
  p.add_argument("result")
  p.add_argument("--patching", default=None)
  p.add_argument("--group", type=int, required=True,
                 help="query heads per key/value head (SmolLM2 3, Gemma 3 270M 4)")
  args = p.parse_args(argv)
  doc = json.load(open(os.path.join(args.out, "circuit.json")))
  doc["roles"] = roles(doc, args.patching, args.group)
  doc["edges_total"] = len(doc["edges"])
  doc["edges"] = doc["edges"][:300]
  doc["machine"] = machine()
  os.makedirs(args.result, exist_ok=True)
  with open(os.path.join(args.result, "circuit.json"), "w") as f:
    json.dump(doc, f, indent=1)
  for name in ("faithfulness.png", "circuit.png"):
    shutil.copy(os.path.join(args.out, name), os.path.join(args.result, name))
  print(json.dumps(doc["roles"], indent=1))


if __name__ == "__main__":
  main()
