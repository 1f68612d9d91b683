"""Verdict rules: each claim's verdict is computed from its numbers by one of these.

A rule is a function numbers -> "holds" | "does not hold" | "inconclusive" whose text
(`rule.text`) is printed in the report next to the verdict. Thresholds are stated in
the text; nothing is written in by hand.
"""

from __future__ import annotations

from typing import Callable, Mapping

HOLDS, FAILS, INCONCLUSIVE = "holds", "does not hold", "inconclusive"


def rule(text: str) -> Callable:
  def wrap(fn):
    fn.text = text
    return fn
  return wrap


@rule("inconclusive if the best multi-head model's loss is above half the chance loss "
      "(nothing learned); holds if the h=1 loss exceeds the best of h=2, 4 by >= 0.1 nats "
      "and the single head puts >= 0.15 of its weight on each target (it splits); "
      "else does not hold")
def one_head_compromises(n: Mapping) -> str:
  best = min(n["loss_h2"], n["loss_h4"])
  if best > 0.5 * n["chance_loss"]:
    return INCONCLUSIVE
  split = min(n["h1_weight_previous"], n["h1_weight_partner"]) >= 0.15
  return HOLDS if n["loss_h1"] >= best + 0.1 and split else FAILS


@rule("holds if the peak weight at the 50/50 mix is >= 0.05 below both pure patterns' "
      "peaks and the lowest peak lies at a mix ratio in [0.3, 0.7]; else does not hold")
def mixture_dip(n: Mapping) -> str:
  dip = n["peak_at_half"] <= min(n["peak_at_0"], n["peak_at_1"]) - 0.05
  return HOLDS if dip and 0.3 <= n["argmin_mix"] <= 0.7 else FAILS


@rule("holds if, for every h tried, every head's q has a non-zero gradient (|g| > 1e-9 "
      "of the largest) with respect to all d_model input features; else does not hold")
def whole_token(n: Mapping) -> str:
  return HOLDS if min(n["min_share_of_features_read"].values()) >= 1.0 else FAILS


@rule("holds if with 1/sqrt(d_model) the peak weight at d_k=1 is <= 0.8x the right "
      "divisor's and its entropy higher (it flattens as d_k shrinks), and with "
      "1/sqrt(d_k) the peak's spread over d_k (max/min - 1) is under a third of the "
      "wrong divisor's (flat by comparison); else does not hold")
def divisor(n: Mapping) -> str:
  right = n["peak"]["1/sqrt(d_k)"]
  wrong = n["peak"]["1/sqrt(d_model)"]
  spread = lambda v: max(v) / min(v) - 1.0
  flat = spread(right) < spread(wrong) / 3
  flattened = (wrong[0] <= 0.8 * right[0] and
               n["entropy"]["1/sqrt(d_model)"][0] > n["entropy"]["1/sqrt(d_k)"][0])
  return HOLDS if flat and flattened else FAILS


@rule("holds if at initialisation with 1/sqrt(d_k) the mean entropy of the heads varies "
      "by <= 5 % over h = 8..96 at d_model 768, and dividing by sqrt(d_model) instead "
      "gives a higher entropy at h = 96 (flatter); else does not hold")
def divisor_real_widths(n: Mapping) -> str:
  right = n["entropy"]["1/sqrt(d_k)"]
  wrong = n["entropy"]["1/sqrt(d_model)"]
  flat = max(right) / min(right) <= 1.05
  return HOLDS if flat and wrong[-1] > right[-1] else FAILS


@rule("holds if the parameter count is 4 d_model^2 for every h, XLA's FLOPs are within "
      "5 % of 8 T D^2 + 4 T^2 D for every h, score bytes / h is the same for every h, "
      "and the d_model 768 numbers equal GPT-2 small's (2,359,296 attention weights per "
      "layer); else does not hold")
def cost(n: Mapping) -> str:
  d = n["d_model"]
  params_ok = all(p == 4 * d * d for p in n["params"])
  flops_ok = all(abs(f - n["flops_formula"]) / n["flops_formula"] <= 0.05
                 for f in n["flops_xla"])
  per_head = {b // h for b, h in zip(n["score_bytes"], n["heads"])}
  mem_ok = len(per_head) == 1 and all(b % h == 0 for b, h in zip(n["score_bytes"],
                                                                  n["heads"]))
  gpt2 = n["gpt2_small_params"] == 2_359_296
  return HOLDS if params_ok and flops_ok and mem_ok and gpt2 else FAILS


@rule("does not hold if fewer than 99 % of (query, head) rows of the trained d_k=1 "
      "model put their argmax on the key with the largest (q > 0) or smallest (q < 0) "
      "scalar key; holds if >= 99 % do and the sweep's loss at d_k=1 is >= 5 % above "
      "the best h's; else inconclusive")
def dk1(n: Mapping) -> str:
  if n["argmax_at_extreme_share"] < 0.99:
    return FAILS
  return HOLDS if n["loss_dk1"] >= 1.05 * n["best_loss"] else INCONCLUSIVE


@rule("holds if, in the trained layer, the mean share of a head's output (its norm "
      "squared after W_O) that lands outside its own d_k slot is >= 0.5 (a "
      "block-diagonal W_O gives 0); else does not hold")
def wo_mixes(n: Mapping) -> str:
  return HOLDS if n["mean_share_outside_slot"] >= 0.5 else FAILS


@rule("holds if the heads kept (10 of the encoder's) are richer in specialised roles "
      "(positional, syntactic, rare) than all the encoder's heads, the last 3 left "
      "include a specialised one, and keeping 10 costs <= 3 BLEU; else does not hold")
def pruning(n: Mapping) -> str:
  richer = n["specialised_share_kept"] >= n["specialised_share_all"]
  last = any(r in ("positional", "syntactic", "rare") for r in n["last_heads_roles"])
  cheap = n["bleu_all"] - n["bleu_kept"] <= 3.0
  return HOLDS if richer and last and cheap else FAILS


@rule("holds if the scores, the weights (plain division, the article's simplification) "
      "and the output equal the seed's exact values (4, 0, 3), (4/7, 0, 3/7), "
      "(20/7, 20/7, 10/7) within 1e-5; else does not hold")
def worked_example(n: Mapping) -> str:
  ok = all(abs(a - b) <= 1e-5 for key in ("scores", "weights", "output")
           for a, b in zip(n[key], n[f"{key}_expected"]))
  return HOLDS if ok else FAILS


@rule("holds if a layer-0 head puts >= 0.9 of its attention on t-1, a layer-1 head "
      "has prefix matching >= 0.8, and that head's largest K-composition (minus the "
      "random baseline) is with the previous-token head and >= 3x the median of its "
      "row; does not hold if the largest K-composition is with another head; else "
      "inconclusive (the circuit is there but soft)")
def induction_k_composition(n: Mapping) -> str:
  if n["k_partner"] != n["previous_token_head"]:
    return FAILS
  med = n["k_row_median"]
  ratio_ok = n["k_partner_score"] >= 3 * med if med > 0 else n["k_partner_score"] > 0
  if n["previous_token_score"] >= 0.9 and n["prefix_matching"] >= 0.8 and ratio_ok:
    return HOLDS
  return INCONCLUSIVE


@rule("holds if the later-layer heads with OV positivity > 0.5 and K-composition "
      "positivity > 0.5 are exactly the induction heads (prefix matching >= 0.3, "
      "copying > 0) and there is at least one; else does not hold")
def positivity_corner(n: Mapping) -> str:
  corner, ind = set(n["corner_heads"]), set(n["induction_heads"])
  return HOLDS if ind and corner == ind else FAILS


@rule("holds if >= 60 % of all Q/K/V composition scores lie within 0.05 of the random "
      "baseline and the largest is >= 0.1 above it (a few strong links); else does not "
      "hold")
def composition_sparse(n: Mapping) -> str:
  return HOLDS if n["share_near_baseline"] >= 0.6 and n["max_over_baseline"] >= 0.1 \
      else FAILS


@rule("holds if removing the virtual-head terms costs <= 25 % of what removing the "
      "virtual and single-head terms costs (most of the effect is in single heads); "
      "inconclusive if the heads do not help at all (cost <= 0.05 nats); else does not "
      "hold")
def term_importance(n: Mapping) -> str:
  total = n["loss_direct"] - n["loss_full"]
  if total <= 0.05:
    return INCONCLUSIVE
  virtual = n["loss_direct_single"] - n["loss_full"]
  return HOLDS if virtual <= 0.25 * total else FAILS


@rule("holds if, at positions whose token has not appeared before, the induction head "
      "puts >= 0.5 of its attention on the first token (BOS) on average, more than on "
      "any other position; else does not hold")
def rests_on_first_token(n: Mapping) -> str:
  return HOLDS if n["weight_on_bos"] >= 0.5 and n["weight_on_bos"] > \
      n["max_weight_elsewhere"] else FAILS
