"""The head taxonomy of an imported LM: roles.json + head_taxonomy.png into OUT, and the
seconds of each detector; the roles next to the IOI circuit's heads (CIRCUIT.json).

  python scripts/taxonomy_study.py WORKDIR OUT [CIRCUIT.json] [SETTING=VALUE ...]

SETTING=VALUE sets a field of roles.head_taxonomy.ClassifyOptions (roles=retrieval,
retrieval_len=1024, depths=0.25,0.5,0.75). With roles= a subset and OUT/roles.json
already there, the new roles are merged into it (head_taxonomy.merge: the other roles kept,
every head assigned again).
"""

import dataclasses
import os
import sys
import time

from mha_jax import load, storage
from mha_jax.roles import head_roles
from mha_jax.roles import head_taxonomy
from mha_jax.machine import machine
from mha_jax.harness import bench


def settings_of(pairs) -> head_taxonomy.ClassifyOptions:
  """head_taxonomy.ClassifyOptions from ["name=value", ...], each value cast to the field's default's
  type (tuples: comma-separated)."""
  fields = {f.name: f.default for f in dataclasses.fields(head_taxonomy.ClassifyOptions)}
  kw = {}
  for p in pairs:
    name, _, value = p.partition("=")
    if name not in fields:
      raise SystemExit(f"unknown setting {name!r}; the settings are {', '.join(fields)}")
    d = fields[name]
    kw[name] = (head_taxonomy.parse_roles(value) if name == "roles" else
                tuple(type(d[0])(v) for v in value.split(",")) if isinstance(d, tuple) else
                type(d)(value))
  return head_taxonomy.ClassifyOptions(**kw)


def main(argv):
  wd, out = argv[0], argv[1]
  circuit = [a for a in argv[2:3] if "=" not in a]
  settings = settings_of([a for a in argv[2:] if "=" in a])
  old = storage.join(out, "roles.json")
  base = storage.read_json(old) if set(settings.roles) != set(head_taxonomy.DEFAULT_ROLES) \
      and os.path.exists(old) else None
  loaded = load(wd)
  rate = bench.matmul_gflops(rounds=10)
  t0 = time.perf_counter()
  needs_rows = {"previous_token", "induction", "duplicate_token"} & set(settings.roles)
  rows = head_roles.real_lm_roles(loaded) if needs_rows else None
  doc = head_taxonomy.classify(loaded, rows, settings, log=lambda m: print(m, flush=True),
                          on_scores=lambda d: finish(d, wd, out, circuit, t0, base))
  after = bench.matmul_gflops(rounds=10)           # the rate before the study and after it
  doc["machine"] = {**machine(matmul_gflops=round(rate, 1)),
                    "matmul_gflops_after": round(after, 1)}
  doc = finish(doc, wd, out, circuit, t0, base)
  print(head_taxonomy.format_summary(doc))
  print(doc["seconds"])


def finish(doc, wd, out, circuit, t0, base=None):
  """roles.json and head_taxonomy.png (merged into `base` where given), with the circuit's
  heads next to the IOI roles."""
  doc["seconds"]["total"] = time.perf_counter() - t0
  doc["workdir"] = wd
  if base is not None:
    doc = head_taxonomy.merge(base, doc)
  if circuit:
    circ = storage.read_json(circuit[0])
    heads = circ["nodes"]["heads"]
    doc["circuit"] = {"source": circuit[0], "heads": heads,
                      "ioi_roles_in_circuit": {
                          r: [h for h in doc["qualifies"].get(r, []) if h in heads]
                          for r in head_taxonomy.IOI_ROLES},
                      "top3_in_circuit": {
                          r: [h for h, _ in sorted(doc["lm_roles"][r].items(),
                                                   key=lambda kv: -kv[1])[:3] if h in heads]
                          for r in head_taxonomy.IOI_ROLES if r in doc["lm_roles"]}}
  head_taxonomy.write(doc, out, f"head roles, {wd}")
  return doc


if __name__ == "__main__":
  main(sys.argv[1:])
