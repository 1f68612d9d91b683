#!/usr/bin/env bash
# The studies of issue 13 on the two real models, through the ordinary commands; outputs
# copied to docs/results/real_models/. On 2 shared CPU cores this takes about an hour.
# Evaluation windows are set small in each workdir's config.json "eval", the gate-training
# batch in its "prune" section (see the README).
set -euo pipefail
W=${W:-workdirs}
OUT=${OUT:-docs/results/real_models}
mkdir -p "$OUT"
mha() { python -m mha_jax.cli "$@"; }
set_eval() {  # workdir section batch seq_len [windows]
  python - "$@" <<'PY'
import json, sys
p = sys.argv[1] + "/config.json"; c = json.load(open(p))
c[sys.argv[2]] = {"batch_size": int(sys.argv[3]), "seq_len": int(sys.argv[4]),
                  **({"windows": int(sys.argv[5])} if len(sys.argv) > 5 else {})}
json.dump(c, open(p, "w"), indent=1)
PY
}
[ -d "$W/smol" ] || { mha import smollm2-135m --workdir "$W/smol"; set_eval "$W/smol" eval 4 128 16
                      set_eval "$W/smol" prune 4 64; }
[ -d "$W/minilm" ] || { mha import minilm-l6 --workdir "$W/minilm"; set_eval "$W/minilm" eval 16 128 64; }

# SmolLM2-135M: roles, circuits, ablation, pruning curve, export of a pruned model
mha analyze --workdir "$W/smol"
mha circuits --workdir "$W/smol"
mha ablate --workdir "$W/smol" --induction-vs-random --mode zero --draws 4
mha ablate --workdir "$W/smol" --induction-vs-random --mode mean --draws 4
mha prune-curve --workdir "$W/smol" --stacks lm --counts 270,200,135,68,34 \
  --l0-lambda 0.01 --steps 200 --random-draws 5 --save-workdirs 135 --out "$W/smol_curve"
# the best method at 135 heads (lowest perplexity), exported: fewer heads for real
best=$(python -c "import json; r=[x for x in json.load(open('$W/smol_curve/curve.json'))['rows'] if x['kept'] == 135]; print(min(r, key=lambda x: x['perplexity'])['method'])")
mha export-pruned --workdir "$W/smol_curve/${best}_k135" --out "$W/smol_${best}135_exported"
mha-jax bench pruned --dense "$W/smol" --pruned "$W/smol_${best}135_exported" \
  --batch 16 --seq-len 128 --rounds 9 --out "$OUT/smol_${best}135_bench_pruned.json"

# all-MiniLM-L6-v2: roles (syntactic ones on the hand-written CoNLL-U sample), pruning
# curve (cosine to the dense model's embeddings)
mha analyze --workdir "$W/minilm" --conllu docs/data/sentences_en.conllu
mha prune-curve --workdir "$W/minilm" --stacks encoder --counts 72,54,36,18,9 \
  --l0-lambda 0.01 --steps 200 --random-draws 5 --out "$W/minilm_curve"

for f in smol/analysis/{heads.json,summary.json,scores.png,roles.png,importance.png} \
         smol/analysis/ablation_induction_{zero,mean}.json \
         smol/circuits/{circuits.json,induction.png} smol_curve/{curve.json,curve.md,curve.png} \
         minilm/analysis/{heads.json,summary.json,scores.png,roles.png,importance.png} \
         minilm_curve/{curve.json,curve.md,curve.png}; do
  cp "$W/$f" "$OUT/$(echo "$f" | tr / _)"
done
python - "$W/smol_${best}135_exported/pruning.json" "$OUT/smol_pruned135_export.json" <<'PY'
import json, sys
i = json.load(open(sys.argv[1]))
keys = ("method", "kept", "kept_heads", "head_counts", "kv_head_counts",
        "max_abs_diff_vs_masked", "max_abs_output_masked", "relative_diff_vs_masked",
        "forward_speed", "after")
json.dump({k: i[k] for k in keys if k in i}, open(sys.argv[2], "w"), indent=1)
PY
python scripts/studies_tables.py
