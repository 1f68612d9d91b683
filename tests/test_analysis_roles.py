"""Role detectors on heads planted by hand: each must be classified exactly."""

import jax
import jax.numpy as jnp
import numpy as np

from mha_jax import attention
from mha_jax.analysis import roles


def _sentences(n=40, seed=0):
  """Random 'sentences' with gold arcs: token 0 heads everything else, alternating rels."""
  rng = np.random.default_rng(seed)
  out = []
  for _ in range(n):
    ln = int(rng.integers(5, 10))
    root = int(rng.integers(0, ln))
    heads = [root if i != root else -1 for i in range(ln)]
    rels = [("amod" if i % 2 else "nsubj") if i != root else "root" for i in range(ln)]
    rarest = int(rng.integers(0, ln))
    out.append((ln, {"heads": heads, "rels": rels}, rarest))
  return out


def _one_hot_rows(targets, ln, s):
  w = np.zeros((ln, s))
  w[np.arange(ln), targets] = 1.0
  return w


def test_planted_heads_are_classified_exactly():
  sents = _sentences()
  rng = np.random.default_rng(1)
  s = 12
  stats = roles.EncoderRoleStats(num_layers=1, num_heads=[4], max_len=s)
  for ln, arcs, rarest in sents:
    w = np.zeros((4, s, s))
    w[0, :ln] = _one_hot_rows(np.maximum(np.arange(ln) - 1, 0), ln, s)     # previous token
    w[1, :ln] = _one_hot_rows(np.full(ln, rarest), ln, s)                  # rarest token
    partner = [h if h >= 0 else i for i, h in enumerate(arcs["heads"])]
    w[2, :ln] = _one_hot_rows(np.array(partner), ln, s)                    # dependency head
    w[3, :ln, :ln] = 1.0 / ln + 1e-6 * rng.random((ln, ln))                # uniform
    stats.update([w[None]], np.array([ln]), [arcs], np.array([rarest]))
  rows = stats.results("encoder")
  assert [r["role"] for r in rows] == ["positional", "rare", "syntactic", "other"]
  assert rows[0]["positional_offset"] == -1 and rows[0]["positional_share"] > 0.9
  assert rows[1]["rare_share"] == 1.0 and rows[1]["rare_chance"] < 0.25
  assert rows[2]["syntactic_margin"] >= 0.10 and rows[2]["syntactic_best"].endswith("_dh")
  assert abs(rows[3]["confidence"] - np.mean([1 / ln for ln, _, _ in sents])) < 0.05
  assert rows[0]["confidence"] == 1.0


def test_lm_scores_on_planted_patterns_through_the_attention_function():
  """A previous-token head built from weights: one-hot positions, W_QK = shift."""
  t, d = 10, 10
  x = jnp.asarray(np.eye(t, d)[None])                      # position one-hot as input
  shift = np.zeros((d, d))
  shift[np.arange(1, t), np.arange(t - 1)] = 20.0          # query i prefers key i-1
  wq = jnp.asarray(shift)[:, None, :]                      # (D, 1, K=d)
  wk = jnp.asarray(np.eye(d))[:, None, :] * np.sqrt(d)
  p = {"wq": wq, "wk": wk, "wv": wk, "wo": jnp.zeros((1, d, d))}
  w = attention.multi_head_attention(p, x, causal=True, return_weights=True).weights
  tokens = np.array([[0, 5, 6, 7, 5, 6, 7, 5, 6, 7]])
  s = roles.lm_scores(np.asarray(w), tokens)
  assert s["previous_token"][0] > 0.99
  # Hand-made induction head: attends to the token after the previous copy.
  ind = np.zeros((1, 1, t, t))
  for q in range(t):
    cands = [j for j in range(1, q) if tokens[0, j - 1] == tokens[0, q]]
    ind[0, 0, q, cands[-1] if cands else 0] = 1.0
  si = roles.lm_scores(ind, tokens)
  assert si["induction"][0] == 1.0 and si["previous_token"][0] < 0.2
  dup = np.zeros((1, 1, t, t))
  for q in range(t):
    cands = [j for j in range(q) if tokens[0, j] == tokens[0, q]]
    dup[0, 0, q, cands[-1] if cands else 0] = 1.0
  assert roles.lm_scores(dup, tokens)["duplicate_token"][0] == 1.0
