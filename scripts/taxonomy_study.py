"""The head taxonomy of an imported LM: roles.json + taxonomy.png into OUT, and the
seconds of each detector; the roles next to the IOI circuit's heads (CIRCUIT.json).

  python scripts/taxonomy_study.py WORKDIR OUT [CIRCUIT.json]
"""

import sys
import time

from mha_jax import load, storage
from mha_jax.toolkit import head_roles
from mha_jax.analysis import taxonomy


def main(argv):
  wd, out = argv[0], argv[1]
  loaded = load(wd)
  t0 = time.perf_counter()
  rows = head_roles.real_lm_roles(loaded)
  doc = taxonomy.taxonomy(loaded, rows, taxonomy.Settings(), log=lambda m: print(m, flush=True),
                   on_scores=lambda d: finish(d, wd, out, argv[2:], t0))
  finish(doc, wd, out, argv[2:], t0)
  print(taxonomy.format_summary(doc))
  print(doc["seconds"])


def finish(doc, wd, out, circuit, t0):
  """roles.json and taxonomy.png, with the circuit's heads next to the IOI roles."""
  doc["seconds"]["total"] = time.perf_counter() - t0
  doc["workdir"] = wd
  if circuit:
    circ = storage.read_json(circuit[0])
    heads = circ["nodes"]["heads"]
    doc["circuit"] = {"source": circuit[0], "heads": heads,
                      "ioi_roles_in_circuit": {
                          r: [h for h in doc["qualifies"].get(r, []) if h in heads]
                          for r in taxonomy.IOI_ROLES},
                      "top3_in_circuit": {
                          r: [h for h, _ in sorted(doc["lm_roles"][r].items(),
                                                   key=lambda kv: -kv[1])[:3] if h in heads]
                          for r in taxonomy.IOI_ROLES if r in doc["lm_roles"]}}
  taxonomy.write(doc, out, f"head roles, {wd}")


if __name__ == "__main__":
  main(sys.argv[1:])
