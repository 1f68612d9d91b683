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


def why(rule_fn: Callable, n: Mapping) -> str:
  """What in `n` keeps `rule_fn` from holding, as the rule's own conditions with the
  numbers (WHY[rule name]); "" when the rule has no such sentence."""
  fn = WHY.get(rule_fn.__name__)
  return fn(n) if fn else ""


def _f(x) -> str:
  return f"{x:.3g}" if isinstance(x, float) else str(x)


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


@rule("the induction head is the head of layers >= 1 with the best prefix matching; "
      "its K-composition row (minus the random baseline) spans every head of the layers "
      "below it. Does not hold if its strongest partner is no previous-token head "
      "(< 0.4 of its attention on t-1); holds if that partner puts >= 0.9 on t-1, the "
      "induction head's prefix matching is >= 0.8 and the partner's score is >= 3x "
      "the median of the row; else inconclusive (the circuit is there but soft)")
def induction_k_composition(n: Mapping) -> str:
  if n["k_partner_previous_token"] < 0.4:
    return FAILS
  med = n["k_row_median"]
  ratio_ok = n["k_partner_score"] >= 3 * med if med > 0 else n["k_partner_score"] > 0
  if n["k_partner_previous_token"] >= 0.9 and n["prefix_matching"] >= 0.8 and ratio_ok:
    return HOLDS
  return INCONCLUSIVE


def induction_k_causal_one(n: Mapping) -> str:
  """One receiver's verdict (see induction_k_causal)."""
  prev, other = n["path_k_effect"], n["best_other_effect"]
  if other > prev:
    return FAILS
  if prev >= 0.05 and prev >= 2 * max(other, 0.0):
    return HOLDS
  return INCONCLUSIVE


@rule("noising path patching on induction pairs: each sender head of the previous-token "
      "head's layer from the corrupt run, into the induction head's key input in the "
      "clean run; effect = the share of the clean-corrupt logit difference lost. Per "
      "induction head (the best by prefix matching, and up to 3 in all of those at >= "
      "0.3), with its previous-token head (the best previous-token score in the layers "
      "below): holds if that head's effect is the largest of its layer, >= 0.05 and >= "
      "2x the next head's; does not hold if another head of that layer's is larger; "
      "else inconclusive. The setting's verdict: holds (does not hold) if a majority of "
      "its induction heads hold (do not hold); else inconclusive")
def induction_k_causal(n: Mapping) -> str:
  rec = n.get("receivers") or [n]
  votes = [induction_k_causal_one(r) for r in rec]
  for v in (HOLDS, FAILS):
    if votes.count(v) * 2 > len(votes):
      return v
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


@rule("heads removed one at a time in Michel et al.'s importance order (I_h on the "
      "valid split, all heads on); holds if >= 20 % of the heads go with the mean "
      "cosine similarity of the embeddings to the full model's still >= 0.99 (Michel "
      "et al. removed 20-40 % of BERT's heads at a small cost); does not hold if fewer "
      "than 20 % go before it drops below 0.95; else inconclusive")
def michel(n: Mapping) -> str:
  if n["share_at_0.99"] >= 0.2:
    return HOLDS
  return FAILS if n["share_at_0.95"] < 0.2 else INCONCLUSIVE


def _no_sink(n: Mapping) -> bool:
  """The softmax model has no sink to remove: its first-token share is below twice what
  evenly spread causal attention puts on the first token."""
  return n["softmax_first_token_share"] < 2 * n["uniform_share"]


@rule("compares the gated and the softmax model at the same h and seed (first-token "
      "share: the mean over heads and queries 1.. of the weight on the first token, on "
      "held-out text); inconclusive if softmax's share is below twice the share of evenly "
      "spread causal attention (no sink to remove); holds if gated's share is <= 1/5 of "
      "softmax's (it falls at least 5-fold); else does not hold")
def gating_removes_sink(n: Mapping) -> str:
  if _no_sink(n):
    return INCONCLUSIVE
  return HOLDS if n["gated_first_token_share"] <= n["softmax_first_token_share"] / 5 \
      else FAILS


@rule("compares the differential and the softmax model at the same h and seed: the "
      "differential model's effective map (pattern - lambda_h pattern2) against "
      "softmax's pattern, first-token share as in gating_removes_sink; inconclusive if "
      "softmax has no sink (below twice the even share); holds if the effective share "
      "is <= 1/2 of softmax's (the subtraction cancels the common-mode weight); does "
      "not hold if it is >= softmax's; else inconclusive")
def differential_less_sink(n: Mapping) -> str:
  if _no_sink(n):
    return INCONCLUSIVE
  eff, soft = n["differential_effective_first_token_share"], n["softmax_first_token_share"]
  if eff <= soft / 2:
    return HOLDS
  return FAILS if eff >= soft else INCONCLUSIVE


@rule("compares the sink-logit and the softmax model at the same h and seed; "
      "inconclusive if softmax has no sink (below twice the even share); holds if the "
      "sink model's first-token share is <= 1/2 of softmax's and its sink logit takes "
      ">= 1/2 of the weight softmax put on the first token (the weight moved to the "
      "logit); else does not hold")
def sink_takes_first_token(n: Mapping) -> str:
  if _no_sink(n):
    return INCONCLUSIVE
  soft = n["softmax_first_token_share"]
  moved = n["sink_logit_weight"] >= soft / 2
  return HOLDS if n["sink_first_token_share"] <= soft / 2 and moved else FAILS


def _why_variant(variant: str, key: str, what: str):
  def fn(n):
    soft = n["softmax_first_token_share"]
    if _no_sink(n):
      return (f"softmax's first-token share {_f(soft)} at h={n['h']} is below twice the "
              f"even share {_f(n['uniform_share'])}: no sink to remove")
    out = (f"at h={n['h']} {what} {_f(n[key])} against softmax's first-token share "
           f"{_f(soft)} ({_f(n[key] / soft)}x)")
    if variant == "sink":
      out += (f"; first-token share {_f(n['sink_first_token_share'])} "
              f"({_f(n['sink_first_token_share'] / soft)}x; rule: <= 0.5x each way)")
    return out
  return fn


def _why_induction(n):
  out = []
  if n["k_partner_previous_token"] < 0.9:
    out.append(f"the strongest K-composition partner of {n['induction_head']} is "
               f"{n['k_partner']}, with {_f(n['k_partner_previous_token'])} of its "
               f"attention on t-1 (rule: >= 0.9; the best previous-token head below is "
               f"{n['previous_token_head']} at {_f(n['previous_token_score'])})")
  if n["prefix_matching"] < 0.8:
    out.append(f"prefix matching of {n['induction_head']} is "
               f"{_f(n['prefix_matching'])} (rule: >= 0.8)")
  if n["k_row_median"] > 0 and n["k_partner_score"] < 3 * n["k_row_median"]:
    out.append(f"its partner's K-composition {_f(n['k_partner_score'])} is "
               f"{_f(n['k_partner_score'] / n['k_row_median'])}x the row's median "
               f"{_f(n['k_row_median'])} (rule: >= 3x)")
  return "; ".join(out)


def _why_corner(n):
  ind, corner = set(n["induction_heads"]), set(n["corner_heads"])
  if not ind:
    return "no head has prefix matching >= 0.3 and positive copying"
  extra, missing = sorted(corner - ind), sorted(ind - corner)
  out = []
  if extra:
    out.append(f"{len(extra)} non-induction heads in the corner "
               f"({', '.join(extra[:6])}{', ...' if len(extra) > 6 else ''})")
  if missing:
    out.append(f"{len(missing)} of {len(ind)} induction heads outside it "
               f"({', '.join(missing[:6])}{', ...' if len(missing) > 6 else ''})")
  return "; ".join(out)


def _why_sparse(n):
  out = []
  if n["share_near_baseline"] < 0.6:
    out.append(f"{_f(n['share_near_baseline'])} of {n['pairs']} scores lie within 0.05 "
               f"of the baseline (rule: >= 0.6)")
  if n["max_over_baseline"] < 0.1:
    out.append(f"the largest is {_f(n['max_over_baseline'])} over it (rule: >= 0.1)")
  return "; ".join(out)


def _why_pruning(n):
  out = []
  if n["specialised_share_kept"] < n["specialised_share_all"]:
    out.append(f"{_f(n['specialised_share_kept'])} of the kept heads are specialised "
               f"against {_f(n['specialised_share_all'])} of all heads")
  if not any(r in ("positional", "syntactic", "rare") for r in n["last_heads_roles"]):
    out.append(f"the last 3 heads are {', '.join(n['last_heads_roles'])}")
  if n["bleu_all"] - n["bleu_kept"] > 3.0:
    out.append(f"BLEU {_f(n['bleu_all'])} -> {_f(n['bleu_kept'])} (rule: <= 3 lost)")
  return "; ".join(out)


def _why_bos(n):
  return (f"{n['induction_head']} puts {_f(n['weight_on_bos'])} on the first token at "
          f"unseen tokens (rule: >= 0.5), {_f(n['max_weight_elsewhere'])} at most "
          f"elsewhere")


def _why_michel(n):
  return (f"{_f(n['share_at_0.99'])} of the {n['heads']} heads go before the cosine "
          f"drops below 0.99, {_f(n['share_at_0.95'])} before 0.95 (rule: >= 0.2)")


def _why_terms(n):
  total = n["loss_direct"] - n["loss_full"]
  return (f"removing the virtual-head terms costs {_f(n['loss_direct_single'] - n['loss_full'])}"
          f" nats of the {_f(total)} that removing every head term costs (rule: <= 25 %)")


def _why_causal(n):
  return "; ".join(
      f"path patching into {r['induction_head']}'s keys loses {_f(r['path_k_effect'])} "
      f"of the gap through the previous-token head {r['previous_token_head']}, "
      f"{_f(r['best_other_effect'])} through {r['best_other']} of the same layer"
      for r in (n.get("receivers") or [n])) + " (rule: the largest, >= 0.05 and >= 2x)"


WHY = {"induction_k_causal": _why_causal, "induction_k_composition": _why_induction, "positivity_corner": _why_corner,
       "composition_sparse": _why_sparse, "pruning": _why_pruning,
       "rests_on_first_token": _why_bos, "michel": _why_michel,
       "term_importance": _why_terms,
       "gating_removes_sink": _why_variant("gated", "gated_first_token_share",
                                           "gated's first-token share is"),
       "differential_less_sink": _why_variant(
           "differential", "differential_effective_first_token_share",
           "the differential effective map's first-token share is"),
       "sink_takes_first_token": _why_variant("sink", "sink_logit_weight",
                                              "the sink logit takes")}
