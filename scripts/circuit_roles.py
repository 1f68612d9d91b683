"""The roles of a circuit's heads, beside activation patching's ranking.

    python scripts/circuit_roles.py DIR --workdir W [--top 12]
    python scripts/circuit_roles.py DIR --relabel

DIR is a `mha-jax circuit` output; its pairs are made again from circuit.json (task,
seed 0, the same pairs left out). For every head: its edge mass (the sum of |score| over
its edges in circuit.json, as sender or through its query), its edge to the logits, its
direct logit attribution on the clean prompts and its activation-patching recovery (head
output, corrupt -> clean) on the same pairs (toolkit.activation_patching.Study), and its attention on
repeated random tokens (roles.behaviour.head_scores: previous token, prefix matching,
duplicate token). The top heads by edge mass get a role by role_rule, at the taxonomy's
attention thresholds. Writes DIR/roles.json (with the machine and date) and prints a
table. --relabel names the heads of an existing DIR/roles.json again from its scores.
"""

from __future__ import annotations

import argparse
import os
import time



def thresholds() -> dict:
  """The taxonomy's attention thresholds (mha_jax.roles.head_taxonomy.ClassifyOptions)."""
  from mha_jax.roles import head_taxonomy
  t = head_taxonomy.ClassifyOptions().thresholds()
  return {k: t[k] for k in ("previous_token", "induction", "duplicate_token")}


def role_rule(t: dict) -> str:
  return (f"attention first, at the taxonomy's thresholds: previous-token if >= "
          f"{t['previous_token']} of its attention is on t-1, induction if prefix matching "
          f">= {t['induction']}, duplicate-token if >= {t['duplicate_token']} on earlier "
          "copies of its own token; else by its place: mover if its edge to the logits "
          "carries the metric (ablating it lowers the metric) and its DLA is positive, "
          "negative mover if ablating that edge raises the metric and its DLA is "
          "negative, upstream otherwise (its edges go into other nodes)")


def role(h: dict, t: dict) -> str:
  if h["previous_token"] >= t["previous_token"]:
    return "previous-token"
  if h["prefix_matching"] >= t["induction"]:
    return "induction"
  if h["duplicate_token"] >= t["duplicate_token"]:
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


def relabel(out: str) -> dict:
  """DIR/roles.json's top heads named again at the current thresholds, from the scores
  it holds (nothing runs; the scores, their machine and date stay)."""
  from mha_jax.harness import bench
  from mha_jax import storage
  path = os.path.join(out, "roles.json")
  res = storage.read_json(path)
  th = thresholds()
  for h in res["top_by_edge_mass"]:
    h["role"] = role(h, th)
  res.update(rule=role_rule(th), thresholds=th,
             relabelled=time.strftime("%Y-%m-%d"))
  bench.write_json(res, path)
  for h in res["top_by_edge_mass"]:
    print(f"{h['head']}: {h['role']}")
  return res


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("out")
  p.add_argument("--workdir", help="the model's workdir (not with --relabel)")
  p.add_argument("--top", type=int, default=12)
  p.add_argument("--relabel", action="store_true",
                 help="only name DIR/roles.json's heads again at the current thresholds")
  a = p.parse_args(argv)
  if a.relabel:
    return relabel(a.out)
  if not a.workdir:
    p.error("--workdir is required (unless --relabel)")
  from mha_jax.harness import bench
  from mha_jax import storage
  from mha_jax.circuits import circuit
  from mha_jax.roles import behaviour
  from mha_jax.loader import load
  from mha_jax.machine import machine
  doc = storage.read_json(os.path.join(a.out, "circuit.json"))
  if len(doc["edges"]) < doc["graph"]["edges"]:
    p.error(f"{a.out}/circuit.json holds {len(doc['edges'])} of the graph's "
            f"{doc['graph']['edges']} edges (a results copy: scripts/circuit_results.py "
            "keeps the strongest); edge mass needs them all: give the circuit command's "
            "own output folder")
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
  th = thresholds()
  for k in top:
    heads[k]["role"] = role(heads[k], th)
  by_patch = sorted(heads, key=lambda k: -abs(heads[k]["patching_recovery"]))[:10]
  res = {"circuit": os.path.join(a.out, "circuit.json"), "task": doc["task"],
         "workdir": a.workdir, "rule": role_rule(th), "thresholds": th,
         "top_by_edge_mass": [{"head": k, **heads[k]} for k in top],
         "patching_top10": by_patch,
         "patching_top10_in_circuit": [k for k in by_patch if k in circ],
         "patching_top10_in_top_by_edge_mass": [k for k in by_patch if k in top],
         "seconds": round(time.perf_counter() - t0, 1), "machine": machine()}
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
