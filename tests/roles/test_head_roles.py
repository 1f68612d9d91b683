"""Role detectors on heads planted by hand: each must be classified exactly."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mha_jax import attention
from mha_jax.roles import role_scores


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
  stats = role_scores.RoleStats(num_layers=1, num_heads=[4], max_len=s)
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
  s = role_scores.lm_scores(np.asarray(w), tokens)
  assert s["previous_token"][0] > 0.99
  # Hand-made induction head: attends to the token after the previous copy.
  ind = np.zeros((1, 1, t, t))
  for q in range(t):
    cands = [j for j in range(1, q) if tokens[0, j - 1] == tokens[0, q]]
    ind[0, 0, q, cands[-1] if cands else 0] = 1.0
  si = role_scores.lm_scores(ind, tokens)
  assert si["induction"][0] == 1.0 and si["previous_token"][0] < 0.2
  dup = np.zeros((1, 1, t, t))
  for q in range(t):
    cands = [j for j in range(q) if tokens[0, j] == tokens[0, q]]
    dup[0, 0, q, cands[-1] if cands else 0] = 1.0
  assert role_scores.lm_scores(dup, tokens)["duplicate_token"][0] == 1.0


@pytest.mark.slow
def test_planted_model_through_the_report_pipeline(tmp_path_factory):
  """A real encoder whose layer-0 heads are set by hand, analysed from its workdir by
  `head_roles.translation_roles` (capture -> detectors), like any checkpoint:
    head 0: previous token (rel_bias +50 at offset -1, Q = K = 0);
    head 1: the sentence's rarest token (a constant query against a key holding
            -log(1 + training frequency));
    head 2: the next noun (a constant query against an "is a noun" key, rel_bias
            forbidding offsets <= 0 and preferring the nearest): the gold head of every
            det and amod dependent;
    head 3: uniform (all zero).
  """
  import dataclasses
  import json
  import os

  from mha_jax.roles import head_roles
  from mha_jax.data import synthetic_translation as st
  from builders import trained_translation

  loaded = trained_translation(tmp_path_factory, "planted", "--config.model.num_heads=4",
                            "--config.model.layer_norm=false", "--config.model.max_rel=8",
                            "--config.train.steps=2", "--config.train.eval_every=2")
  cfg = loaded.task.cfg
  lex = st.Grammar(st.GrammarConfig(**dict(cfg.data.grammar)), cfg.data.seed).lex
  nouns = {lex.src_noun(n, p) for n in lex.nouns for p in (0, 1)}
  with open(os.path.join(loaded.workdir, "data", "train_freqs.json")) as f:
    freqs = json.load(f)
  tokens = loaded.task.vocab.tokens
  d = cfg.model.d_model
  feats = np.zeros((len(tokens), d), np.float32)
  feats[:, 0] = 1.0                                                  # constant
  feats[:, 1] = [-np.log1p(freqs.get(t, 0)) if i > 3 else -20.0      # rarity (specials: never)
                 for i, t in enumerate(tokens)]
  feats[:, 2] = [float(t in nouns) for t in tokens]                  # is a noun
  params = jax.tree.map(lambda x: x, loaded.params)
  params["embed"] = jnp.asarray(feats / np.sqrt(d))                  # the model scales by sqrt(D)
  blk = {k: jnp.zeros_like(v) for k, v in params["encoder"]["layer_0"]["self_attn"].items()}
  r = (blk["rel_bias"].shape[1] - 1) // 2
  offsets = np.arange(-r, r + 1)
  wq, wk = np.zeros(blk["wq"].shape), np.zeros(blk["wk"].shape)
  rel = np.zeros(blk["rel_bias"].shape)
  rel[0, offsets == -1] = 50.0
  wq[0, 1, 0], wk[1, 1, 0] = 1000.0, 1.0
  wq[0, 2, 0], wk[2, 2, 0] = 200.0, 1.0
  rel[2] = np.where(offsets > 0, -offsets, -1e4)
  blk.update(wq=jnp.asarray(wq, jnp.float32), wk=jnp.asarray(wk, jnp.float32),
             rel_bias=jnp.asarray(rel, jnp.float32))
  params["encoder"]["layer_0"]["self_attn"] = blk
  planted = dataclasses.replace(loaded, params=params)

  rows = {r["head"]: r for r in head_roles.translation_roles(planted, "train", limit=200)}
  got = [rows[f"encoder.0.{h}"] for h in range(4)]
  assert [r["role"] for r in got] == ["positional", "rare", "syntactic", "other"]
  assert got[0]["positional_offset"] == -1 and got[0]["positional_share"] == 1.0
  assert got[1]["rare_share"] == 1.0 and got[1]["rare_chance"] < 0.3
  assert got[2]["syn_amod_dh"] == 1.0 and got[2]["syntactic_margin"] >= 0.1
  assert got[3]["confidence"] < 0.35 and got[3]["positional_share"] < 0.5
