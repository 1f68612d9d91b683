"""Weight-based circuit scores (Elhage et al. 2021), from the params pytree.

Convention. This codebase uses ROW vectors: a residual x (1 x D) is projected as x @ W.
Per head h, from params wq, wk, wv (D, H, K) and wo (H, K, D):
    q = x Wq_h,  k = x Wk_h,  v = x Wv_h,  out = v Wo_h
    score(i, j) = x_i (Wq_h Wk_h^T) x_j^T        QK_row = Wq_h Wk_h^T       (D x D)
    write(j)    = x_j (Wv_h Wo_h)                 OV_row = Wv_h Wo_h         (D x D)
The papers use COLUMN vectors (x as D x 1, W x): their W_QK = W_Q^T W_K equals QK_row, and
their W_OV = W_O W_V equals OV_row^T. So, in the papers' notation and ours:
    Q-composition (h1 -> h2):  |W_QK^h2^T W_OV^h1|  =  |QK_row^h2^T OV_row^h1^T|
    K-composition (h1 -> h2):  |W_QK^h2   W_OV^h1|  =  |QK_row^h2 OV_row^h1^T|
    V-composition (h1 -> h2):  |W_OV^h2   W_OV^h1|  =  |OV_row^h1 OV_row^h2|^T
each divided by the product of the two matrices' Frobenius norms. All are computed on
D x D matrices (never vocab x vocab); eigenvalues go through the small K x K factor.
"""

from __future__ import annotations

import numpy as np

from mha_jax.errors import UserError
from mha_jax.models import common as C


def head_matrices(attn_params, h: int) -> dict[str, np.ndarray]:
  """Row-convention factors of query head h, float64: Wq, Wk, Wv (D, K), Wo (K, D).
  With grouped-query attention (wk, wv of G < H heads) Wk and Wv are those of the
  key/value head h // (H // G) that query head h reads."""
  n_h, n_kv = int(attn_params["wq"].shape[1]), int(attn_params["wk"].shape[1])
  kv = h // (n_h // n_kv)
  return {"Wq": np.asarray(attn_params["wq"][:, h], np.float64),
          "Wk": np.asarray(attn_params["wk"][:, kv], np.float64),
          "Wv": np.asarray(attn_params["wv"][:, kv], np.float64),
          "Wo": np.asarray(attn_params["wo"][h], np.float64)}


def unembed_matrix(params) -> np.ndarray:
  """(D, V): params["unembed"], or embed.T when the embeddings are tied."""
  if "unembed" in params:
    return np.asarray(params["unembed"], np.float64)
  return np.asarray(params["embed"], np.float64).T


def qk_row(m) -> np.ndarray:
  return m["Wq"] @ m["Wk"].T


def ov_row(m) -> np.ndarray:
  return m["Wv"] @ m["Wo"]


def _fro(x) -> float:
  return float(np.linalg.norm(x))


def composition(a: np.ndarray, b: np.ndarray) -> float:
  """|A B|_F / (|A|_F |B|_F), the paper's composition score of a pair of matrices."""
  den = _fro(a) * _fro(b)
  return _fro(a @ b) / den if den > 0 else 0.0


def pair_matrices(kind: str, early, late) -> tuple[np.ndarray, np.ndarray]:
  """The (A, B) whose product measures `kind` composition, in the papers' notation."""
  if kind == "q":
    return qk_row(late).T, ov_row(early).T
  if kind == "k":
    return qk_row(late), ov_row(early).T
  if kind == "v":
    return ov_row(late).T, ov_row(early).T
  raise UserError(f"kind must be 'q', 'k' or 'v'; got {kind!r}")


def _factors(kind: str, early, late):
  """(L, M, R) with A B = L M R^T, and A, B as (L_a, R_a), (L_b, R_b) with A = L_a R_a^T:
  the rank-K forms of pair_matrices, so no D x D product is ever formed."""
  if kind == "q":    # A = Wk2 Wq2^T, B = Wo1^T Wv1^T
    a, b, m = (late["Wk"], late["Wq"]), (early["Wo"].T, early["Wv"]), late["Wq"].T @ early["Wo"].T
    return (late["Wk"], m, early["Wv"]), a, b
  if kind == "k":    # A = Wq2 Wk2^T
    a, b = (late["Wq"], late["Wk"]), (early["Wo"].T, early["Wv"])
    return (late["Wq"], late["Wk"].T @ early["Wo"].T, early["Wv"]), a, b
  if kind == "v":    # A = Wo2^T Wv2^T
    a, b = (late["Wo"].T, late["Wv"]), (early["Wo"].T, early["Wv"])
    return (late["Wo"].T, late["Wv"].T @ early["Wo"].T, early["Wv"]), a, b
  raise ValueError(f"kind must be 'q', 'k' or 'v'; got {kind!r}")


def _fro2(l, r, m=None) -> float:
  """|L M R^T|_F^2 (M = I when None) through K x K Gram matrices."""
  gl, gr = l.T @ l, r.T @ r
  if m is None:
    return float(np.trace(gl @ gr))
  return float(np.trace(gl @ m @ gr @ m.T))


def composition_factored(kind: str, early, late) -> float:
  """composition(*pair_matrices(kind, early, late)), computed on K x K matrices: what
  real models (D = 576, hundreds of heads) need."""
  (l, m, r), a, b = _factors(kind, early, late)
  den = np.sqrt(_fro2(*a) * _fro2(*b))
  return float(np.sqrt(max(_fro2(l, r, m), 0.0)) / den) if den > 0 else 0.0


def random_baseline(kind: str, d: int, k_early: int, k_late: int, samples: int = 200,
                    seed: int = 0) -> float:
  """Mean composition score of random Gaussian heads of the same shapes (the paper's
  baseline, subtracted by default)."""
  rng = np.random.default_rng(seed)
  out = []
  for _ in range(samples):
    e = {n: rng.standard_normal(s) for n, s in (("Wq", (d, k_early)), ("Wk", (d, k_early)),
                                               ("Wv", (d, k_early)), ("Wo", (k_early, d)))}
    l = {n: rng.standard_normal(s) for n, s in (("Wq", (d, k_late)), ("Wk", (d, k_late)),
                                               ("Wv", (d, k_late)), ("Wo", (k_late, d)))}
    out.append(composition_factored(kind, e, l))
  return float(np.mean(out))


def composition_scores(params, stack: str = "lm", samples: int = 200) -> dict:
  """Q-, K- and V-composition between every earlier and every later head.

  Returns {"raw": {kind: {(early, late): score}}, "baseline": {kind: value},
  "corrected": {...}} with heads named "stack.layer.head".
  """
  blocks = [(i, p) for s, i, p in C.attention_blocks(params) if s == stack]
  heads = [(f"{stack}.{i}.{h}", head_matrices(p, h)) for i, p in blocks
           for h in range(int(p["wq"].shape[1]))]
  layer_of = {n: int(n.split(".")[1]) for n, _ in heads}
  raw = {k: {} for k in ("q", "k", "v")}
  for ne, me in heads:
    for nl, ml in heads:
      if layer_of[nl] <= layer_of[ne]:
        continue
      for kind in raw:
        raw[kind][(ne, nl)] = composition(*pair_matrices(kind, me, ml))
  d = int(params[C.STACKS[stack][0]]["layer_0"][C.STACKS[stack][1]]["wq"].shape[0])
  k = int(blocks[0][1]["wq"].shape[2]) if blocks else 1
  base = {kind: random_baseline(kind, d, k, k, samples) for kind in raw}
  corrected = {kind: {pair: v - base[kind] for pair, v in raw[kind].items()} for kind in raw}
  return {"raw": raw, "baseline": base, "corrected": corrected}


def positivity(eigenvalues: np.ndarray) -> float:
  """sum(lambda) / sum(|lambda|): +1 for a copying (positive) matrix, -1 for negative."""
  ev = np.asarray(eigenvalues)
  den = np.abs(ev).sum()
  return float(np.real(ev.sum()) / den) if den > 0 else 0.0


def ov_positivity(params, stack: str = "lm", layer: int = 0, head: int = 0) -> float:
  """Eigenvalue positivity of the full OV circuit E Wv Wo U (V x V), through its K x K
  factor Wo U E Wv (same non-zero eigenvalues), in float64."""
  m = head_matrices(_block(params, stack, layer), head)
  e = np.asarray(params["embed"], np.float64)                 # (V, D)
  u = unembed_matrix(params)                                  # (D, V)
  small = (m["Wo"] @ u) @ (e @ m["Wv"])                       # (K, K)
  return positivity(np.linalg.eigvals(small))


def k_composition_positivity(params, early: tuple[int, int], late: tuple[int, int],
                             stack: str = "lm") -> float:
  """Positivity of the same-token matching term: queries as tokens (E), keys as tokens
  moved by the earlier head's OV: E Wq2 Wk2^T (E Wv1 Wo1)^T (V x V), through the
  K x K factor Wk2^T Wo1^T Wv1^T E^T E Wq2."""
  m1 = head_matrices(_block(params, stack, early[0]), early[1])
  m2 = head_matrices(_block(params, stack, late[0]), late[1])
  e = np.asarray(params["embed"], np.float64)
  small = m2["Wk"].T @ m1["Wo"].T @ m1["Wv"].T @ e.T @ e @ m2["Wq"]
  return positivity(np.linalg.eigvals(small))


def k_composition_partners(params, late: tuple[int, int], stack: str = "lm",
                           baseline: float | None = None, samples: int = 50) -> dict:
  """{"stack.layer.head": K-composition score minus the random baseline} of every head
  in an earlier layer into `late` (factored; GQA-aware through head_matrices)."""
  blocks = {i: p for s, i, p in C.attention_blocks(params) if s == stack}
  m2 = head_matrices(blocks[late[0]], late[1])
  if baseline is None:
    d, k = m2["Wq"].shape
    baseline = random_baseline("k", d, k, k, samples)
  out = {}
  for i in sorted(blocks):
    if i >= late[0]:
      break
    for h in range(int(blocks[i]["wq"].shape[1])):
      out[f"{stack}.{i}.{h}"] = composition_factored(
          "k", head_matrices(blocks[i], h), m2) - baseline
  return out


def _block(params, stack, layer):
  top, attn = C.STACKS[stack]
  return params[top][f"layer_{layer}"][attn]
