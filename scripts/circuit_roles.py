"""The roles of a circuit's heads, beside activation patching's ranking.

    python scripts/circuit_roles.py DIR --workdir W [--top 12]

DIR is a `mha-jax circuit` output; its pairs are made again from circuit.json (task,
seed 0, the same pairs left out). For every head: its edge mass (the sum of |score| over
its edges in circuit.json, as sender or through its query), its edge to the logits, its
direct logit attribution on the clean prompts and its activation-patching recovery (head
output, corrupt -> clean) on the same pairs (toolkit.activation_patching.Study), and its attention on
repeated random tokens (circuits.behaviour.head_scores: previous token, prefix matching,
duplicate token). The top heads by edge mass get a role by the rule in ROLE_RULE. Writes
DIR/roles.json (with the machine and date) and prints a table.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

ROLE_RULE = ("attention first: previous-token if >= 0.5 of its attention is on t-1, "
             "induction if prefix matching >= 0.3, duplicate-token if >= 0.3 on earlier "
             "copies of its own token; else by its place: mover if its edge to the logits "
             "carries the metric (ablating it lowers the metric) and its DLA is positive, "
             "negative mover if ablating that edge raises the metric and its DLA is "
             "negative, upstream otherwise (its edges go into other nodes)")


def role(h: dict) -> str:
  if h["previous_token"] >= 0.5:
    return "previous-token"
  if h["prefix_matching"] >= 0.3:
    return "induction"
  if h["duplicate_token"] >= 0.3:
    return "duplicate-token"
  if h["logit_edge"] < 0 and h["dla"] > 0:
    return "mover"
  if h["logit_edge"] > 0 and h["dla"] < 0:
    return "negative mover"
  return "upstream"


def edge_mass(doc: dict) -> tuple[dict, dict]:
  """({head: sum |score| as sender or via its query}, {head: score of head -> logits})."""
  mass, logit = {}, {}
  for e in doc["edges"]:
    a = abs(e["score"])
    mass[e["from"]] = mass.get(e["from"], 0.0) + a
    to = e["to"]
    if to.endswith(".q"):
      mass[to[:-2]] = mass.get(to[:-2], 0.0) + a
    if to == "logits":
      logit[e["from"]] = e["score"]
  return mass, logit


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("out")
  p.add_argument("--workdir", required=True)
  p.add_argument("--top", type=int, default=12)
  a = p.parse_args(argv)
  sys.path.insert(0, ROOT)
  from experiments import bench
  from mha_jax import storage
  from mha_jax.circuits import behaviour, circuit
  from mha_jax.loader import load
  doc = storage.read_json(os.path.join(a.out, "circuit.json"))
  run = load(a.workdir)
  n = doc["pairs"] + len(doc["failing"])
  s, _, _, _ = circuit.prepare(run, doc["task"], None, n, 0, False, log=lambda m: None)
  t0 = time.perf_counter()
  dla = s.dla()["heads"]
  rec = s.patch("z")["recovery"]
  tokens, _ = behaviour.eval_tokens(run, 8)
  att = behaviour.head_scores(run, tokens)
  mass, logit = edge_mass(doc)
  circ = set(doc["nodes"]["heads"])
  heads = {}
  for name, sc in att.items():
    l, h = (int(v) for v in name.split(".")[1:])
    heads[name] = {"edge_mass": mass.get(name, 0.0), "logit_edge": logit.get(name, 0.0),
                   "dla": float(dla[l, h]), "patching_recovery": float(rec[l, h]),
                   "in_circuit": name in circ,
                   **{k: sc[k] for k in ("previous_token", "prefix_matching",
                                         "duplicate_token")}}
  top = sorted(heads, key=lambda k: -heads[k]["edge_mass"])[:a.top]
  for k in top:
    heads[k]["role"] = role(heads[k])
  by_patch = sorted(heads, key=lambda k: -abs(heads[k]["patching_recovery"]))[:10]
  res = {"circuit": os.path.join(a.out, "circuit.json"), "task": doc["task"],
         "workdir": a.workdir, "rule": ROLE_RULE,
         "top_by_edge_mass": [{"head": k, **heads[k]} for k in top],
         "patching_top10": by_patch,
         "patching_top10_in_circuit": [k for k in by_patch if k in circ],
         "patching_top10_in_top_by_edge_mass": [k for k in by_patch if k in top],
         "seconds": round(time.perf_counter() - t0, 1), "date": time.strftime("%Y-%m-%d"),
         "machine": platform.machine(), "processor": platform.processor(),
         "cpu_count": os.cpu_count(), "load_average": os.getloadavg()}
  print("| head | edge mass | -> logits | DLA | patching | prev | prefix | dup | role |")
  print("|---|---|---|---|---|---|---|---|---|")
  for r in res["top_by_edge_mass"]:
    print(f"| {r['head']} | {r['edge_mass']:.3f} | {r['logit_edge']:+.3f} | {r['dla']:+.3f} | "
          f"{r['patching_recovery']:+.3f} | {r['previous_token']:.2f} | "
          f"{r['prefix_matching']:.2f} | {r['duplicate_token']:.2f} | {r['role']} |")
  print("activation patching's top 10:", ", ".join(by_patch))
  print(f"  in the circuit: {len(res['patching_top10_in_circuit'])}; in the top {a.top} by "
        f"edge mass: {len(res['patching_top10_in_top_by_edge_mass'])}")
  bench.write_json(res, os.path.join(a.out, "roles.json"))
  return res


if __name__ == "__main__":
  main()
