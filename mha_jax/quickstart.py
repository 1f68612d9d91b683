"""`mha-jax quickstart`: train the translation config at a CPU-friendly size, evaluate
BLEU on the test split next to a copy-the-source baseline, find the heads' roles and
importance, prune 75 % of the encoder heads with L0 gates, write a summary."""

from __future__ import annotations

import time
from typing import Sequence

from mha_jax import storage
from mha_jax.errors import UserError
from mha_jax import config as mc
from mha_jax.models import common

CONFIG = "configs/translation.py:quickstart"


def quickstart(workdir: str, extra: Sequence[str] = (), log=print, analyze: bool = True,
               prune: bool = True) -> dict:
  from mha_jax.loader import load
  from mha_jax.train import loop
  t0 = time.time()
  cfg = mc.load_config(CONFIG)
  rest = mc.apply_overrides(cfg, list(extra))
  if rest:
    raise UserError(f"unrecognized arguments: {' '.join(rest)}")
  m = cfg.model
  log(f"quickstart: {m.enc_layers}+{m.dec_layers} layers x {m.num_heads} heads, "
      f"d_model={m.d_model}, {cfg.train.steps} steps, workdir {workdir}")
  summary = loop.train(cfg, workdir, log=log)
  if summary["status"] != "done":
    return summary
  loaded = load(workdir)
  test = loaded.task.evaluate(loaded.params, "test", bleu=True)
  result = {
      "workdir": workdir, "step": loaded.step,
      "model": {"d_model": m.d_model, "heads": m.num_heads, "enc_layers": m.enc_layers,
                "dec_layers": m.dec_layers},
      "test": test, "copy_baseline_bleu": loaded.task.copy_baseline_bleu("test"),
  }
  log(f"\ntest BLEU {test['bleu']:.1f}  (copy-the-source baseline "
      f"{result['copy_baseline_bleu']:.1f}), test loss {test['loss']:.3f}, "
      f"accuracy {test['accuracy']:.3f}")
  if analyze:
    from mha_jax.analysis import analyze as analyze_lib
    log("\nanalysis: head roles and importance (ablations: `mha-jax analyze`) ...")
    a = analyze_lib.analyze(loaded, None, analyze_lib.AnalyzeOptions(ablations=False),
                            log=lambda s: None)
    result["analysis"] = a
    for stack, counts in a["role_counts"].items():
      log(f"  {stack:<13} " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())))
    log("  most important heads (Michel et al.): " +
        ", ".join(f"{h} {v:.3f}" for h, v in a["top_importance"]))
    log(f"  explorer: {storage.join(workdir, 'analysis', 'explorer.html')}")
  if prune:
    from mha_jax.pruning import prune as prune_lib
    out = storage.join(workdir, "pruned_l0")
    if storage.exists(out):
      log(f"\npruning: {out} exists already, kept as it is")
    else:
      total = sum(common.head_counts(loaded.params)["encoder"])
      keep = max(1, total // 4)
      log(f"\npruning: L0 gates (Voita et al.), keep {keep} of {total} encoder heads ...")
      opts = prune_lib.PruneOptions(method="l0", l0_lambda=0.05, keep=keep, steps=60)
      info = prune_lib.prune(loaded, out, opts, log=lambda s: None, base=test)
      result["pruning"] = {k: info[k] for k in ("kept", "kept_heads", "base", "after")}
      log(f"  test BLEU {info['base']['bleu']:.1f} with all heads -> "
          f"{info['after']['bleu']:.1f} with {info['kept']} encoder heads "
          f"({', '.join(info['kept_heads'])})")
  result["seconds"] = time.time() - t0
  storage.write_json(storage.join(workdir, "quickstart.json"), result)
  log(f"wrote {storage.join(workdir, 'quickstart.json')} in {result['seconds']:.0f} s")
  return result
