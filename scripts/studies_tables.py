"""Markdown tables of the issue-13 studies from docs/results/real_models/ (the site's results
pages are made by scripts/docs_results.py; this prints the tables to a terminal).

python scripts/studies_tables.py [DIR]
"""
import json
import os
import sys

D = sys.argv[1] if len(sys.argv) > 1 else "docs/results/real_models"


def load(name):
  path = os.path.join(D, name)
  if not os.path.exists(path):
    return None
  with open(path) as f:
    return json.load(f)


heads = (load("smol_analysis_heads.json") or {}).get("heads")      # {"heads": [...], "machine", ...}
circ = load("smol_circuits_circuits.json")
if heads:
  by = {r["head"]: r for r in heads}
  partners = {r["head"]: r for r in (circ or {}).get("top_induction_heads", [])}
  print("| head | induction | prev-token | sink | copying | OV positivity | strongest "
        "K-composition partners (score - baseline; P = previous-token head) |")
  print("|---|---:|---:|---:|---:|---:|---|")
  for r in sorted(heads, key=lambda r: -r["induction"])[:10]:
    c = partners.get(r["head"], {})
    ps = ", ".join(f"{p['head']} {p['k_composition']:+.3f}{' P' if p['is_previous_token_head'] else ''}"
                   for p in c.get("k_partners", []))
    cop = f"{c['copying']:.2f}" if c else ""
    ov = f"{c['ov_positivity']:+.2f}" if c else ""
    print(f"| {r['head']} | {r['induction']:.3f} | {r['previous_token']:.3f} | "
          f"{r['sink_share']:.2f} | {cop} | {ov} | {ps} |")
  print()
for mode in ("zero", "mean"):
  a = load(f"smol_analysis_ablation_induction_{mode}.json")
  if a:
    print(f"{mode} ablation: base text loss {a['base']['loss']:.3f}, repeat loss "
          f"{a['base']['loss_repeat']:.3f}; top-5 induction {a['top_heads']}: "
          f"text {a['top_delta']['loss']:+.3f}, repeat {a['top_delta']['loss_repeat']:+.3f}; "
          f"5 random heads of the same layers (mean of {len(a['random_draws'])} draws): text "
          f"{a['random_delta_mean']['loss']:+.3f}, repeat "
          f"{a['random_delta_mean']['loss_repeat']:+.3f}")
print()
for name in ("smol_curve_curve.md", "minilm_curve_curve.md"):
  p = os.path.join(D, name)
  if os.path.exists(p):
    print(name)
    print(open(p).read())
bert = load("minilm_analysis_summary.json")
if bert:
  print("BERT role counts:", bert["role_counts"])
bheads = (load("minilm_analysis_heads.json") or {}).get("heads")
if bheads and any(r.get("syntactic_best") for r in bheads):
  syn = sorted((r for r in bheads if r["role"] == "syntactic"),
               key=lambda r: -r["syntactic_margin"])
  print(f"BERT syntactic heads ({len(syn)}): " + ", ".join(
      f"{r['head']} {r['syntactic_best']} {r['syn_' + r['syntactic_best']]:.2f} "
      f"(+{r['syntactic_margin']:.2f})" for r in syn))
ex = load("smol_pruned135_export.json")
if ex:
  f = ex["forward_speed"]
  print(f"export ({ex.get('method')}, {ex.get('kept')} heads kept): query heads per layer "
        f"{ex['head_counts']['lm']}, kv heads {ex['kv_head_counts']['lm']}; max |logit diff| "
        f"vs masked {ex['max_abs_diff_vs_masked']:.2e}; forward on {f['batch_shapes']}: "
        f"{f['masked_tokens_per_s']:.0f} -> {f['exported_tokens_per_s']:.0f} tokens/s, "
        f"x{f['speedup']:.3f} (median of {f['rounds']} interleaved rounds)")
for name in ("smol_curve_curve.json", "minilm_curve_curve.json"):
  c = load(name)
  if not c:
    continue
  rows = c["rows"]
  metric = "cosine_to_full" if "cosine_to_full" in rows[0] else "perplexity"
  last = c["l0_history"][-1]
  print(f"{name}: L0 gates {c['steps']} steps, lambda {c['lambda']}, batch "
        f"{c.get('gate_batch_shape')}, loss at the end {last['loss']:.3f} (mean of the "
        f"last {c['steps'] // 5} steps {last.get('loss_mean', float('nan')):.3f}); wall "
        + ", ".join(f"{k} {v / 60:.1f} min" for k, v in c.get("seconds", {}).items()))
  print(f"{metric} (test split; random: mean of {c.get('random_draws', 1)} draws) and the "
        f"roles of the heads kept")
  print("| heads kept | " + " | ".join(f"{m} {metric}" for m in ("l0", "michel", "random"))
        + " | roles kept: l0 / michel / random |")
  print("|---:|---:|---:|---:|---|")
  by = {(r["method"], r["kept"]): r for r in rows}
  for k in sorted({r["kept"] for r in rows}, reverse=True):
    roles = " / ".join(", ".join(f"{a} {n}" for a, n in sorted(by[(m, k)]["roles"].items())
                                 if a != "other") or "-" for m in ("l0", "michel", "random"))
    rnd = by[("random", k)]
    spread = ""
    if "draws" in rnd:
      v = [d[metric] for d in rnd["draws"]]
      spread = f" ({min(v):.4g}-{max(v):.4g})"
    print(f"| {k} | " + " | ".join(f"{by[(m, k)][metric]:.4g}" for m in ("l0", "michel"))
          + f" | {rnd[metric]:.4g}{spread} | {roles} |")
  print()
