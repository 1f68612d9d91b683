"""`mha-jax ablate`: a checkpoint evaluated with heads ablated: named heads together, each
head alone, or the top induction heads against random ones from the same layers."""

from __future__ import annotations

import dataclasses
from typing import Callable

from mha_jax import settings, storage
from mha_jax.errors import UserError
from mha_jax.settings import setting
from mha_jax.tasks.base import SPLITS
from mha_jax.toolkit import importance, plots
from mha_jax.roles import head_roles


@dataclasses.dataclass(frozen=True, kw_only=True)
class AblateOptions:
  """The settings of `ablate`: one of `heads`, `each` or `induction_vs_random`."""
  heads: str = setting("", help="e.g. encoder.2.5,decoder_cross.0.1")
  each: bool = setting(False, help="every single-head ablation")
  mode: str = setting("zero", choices=importance.MODES,
                      help="an ablated head's output: 0 or its mean (default: zero)")
  split: str = setting("test", choices=SPLITS, help="the data split (default: test)")
  induction_vs_random: bool = setting(False, help="the top `top` induction heads together "
                                      "vs `draws` sets of random heads from the same "
                                      "layers (language models)")
  top: int = setting(5, lo=1, help="induction_vs_random: the top heads ablated")
  draws: int = setting(5, lo=1, help="induction_vs_random: the random sets drawn")


def check(opts: AblateOptions) -> AblateOptions:
  """The settings in range, and one of heads, each, induction_vs_random asked."""
  settings.check(opts)
  if not opts.each and not opts.heads and not opts.induction_vs_random:
    raise UserError("give heads stack.layer.head[,...], each or induction_vs_random",
                    setting=("heads", "each", "induction_vs_random"))
  return opts


def ablate(loaded, out: str, opts: AblateOptions, *,
           log: Callable[[str], None] = print) -> dict:
  """Writes OUT/ablation[_each]_{mode}.json and .png (or ablation_induction_{mode}.json);
  returns what the CLI prints: the result without the per-head list (the ten largest
  effects instead), or the induction summary."""
  check(opts)
  if opts.induction_vs_random:
    return _induction(loaded, out, opts)
  heads = None if opts.each else importance.parse_heads(loaded.params, opts.heads)
  is_tr = loaded.task.reports_bleu                 # names checked above, before this pass
  storage.makedirs(out)
  base = loaded.task.evaluate(loaded.params, opts.split, bleu=is_tr, bleu_limit=0)
  if loaded.task.decoder_only and not loaded.task.trainable:   # as importance.ablate's
    base.update(importance.repeated_loss(loaded))
  if opts.each:
    rows = importance.leave_one_out(loaded, split=opts.split, mode=opts.mode, bleu_limit=0,
                                    base=base)
    result = {"mode": opts.mode, "split": opts.split, "base": base, "each": rows}
  else:
    res = importance.ablate(loaded, heads, mode=opts.mode, split=opts.split, bleu_limit=0)
    delta = {k: res[k] - base[k] for k in res}
    rows = [{"head": opts.heads, **res, **{f"delta_{k}": v for k, v in delta.items()}}]
    result = {"mode": opts.mode, "split": opts.split, "heads": opts.heads, "base": base,
              "ablated": res, "delta": delta}
  name = "ablation_each" if opts.each else "ablation"
  storage.write_json(storage.join(out, f"{name}_{opts.mode}.json"), result)
  key = "delta_bleu" if is_tr else "delta_loss"
  plots.bars([r["head"] for r in rows], [r[key] for r in rows],
                   storage.join(out, f"{name}_{opts.mode}.png"), key)
  if opts.each:   # the full list is in the JSON file; the ten largest effects
    result = {k: v for k, v in result.items() if k != "each"}
    result["largest"] = sorted(rows, key=lambda r: r[key] if is_tr else -r[key])[:10]
  return result


def _induction(loaded, out: str, opts: AblateOptions) -> dict:
  if not loaded.task.decoder_only:
    raise UserError(f"induction_vs_random needs a language model; {loaded.workdir!r} has "
                    f"task {loaded.config.task!r}", setting="induction_vs_random")
  rows = head_roles.saved_or_head_roles(loaded, opts.split)
  scores = {r["head"]: r["induction"] for r in rows if "induction" in r}
  res = importance.induction_vs_random(loaded, scores, top=opts.top, draws=opts.draws,
                                       mode=opts.mode, split=opts.split)
  storage.makedirs(out)
  storage.write_json(storage.join(out, f"ablation_induction_{opts.mode}.json"), res)
  return {k: res[k] for k in ("mode", "top_heads", "top_scores", "top_delta",
                              "random_delta_mean")}
