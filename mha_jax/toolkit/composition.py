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
from mha_jax.models import common


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


def _stacked(blocks, dtype):
  """Per layer, its query heads' factors stacked (H, D, K) / (H, K, D), kv heads
  repeated to their query heads (head_matrices' GQA rule)."""
  out = []
  for _, p in blocks:
    n_h, n_kv = int(p["wq"].shape[1]), int(p["wk"].shape[1])
    per = n_h // n_kv if n_kv else 0     # a layer with every head pruned has none
    rep = lambda w: np.repeat(np.moveaxis(np.asarray(w, dtype), 1, 0), per, 0)
    out.append({"Wq": np.moveaxis(np.asarray(p["wq"], dtype), 1, 0), "Wk": rep(p["wk"]),
                "Wv": rep(p["wv"]), "Wo": np.asarray(p["wo"], dtype)})
  return out


def composition_batched(params, kind: str, stack: str = "lm", dtype=np.float64
                        ) -> dict[tuple[str, str], float]:
  """composition_factored(kind, early, late) for every earlier/later head pair, one
  later layer at a time as batched K x K products (no D x D matrix, no Python loop over
  pairs): what 30-layer models with 270 heads need. Its cost is one (earlier heads x K)
  x D x (later heads x K) product per later layer; float32 halves it."""
  if kind not in ("q", "k", "v"):
    raise UserError(f"kind must be 'q', 'k' or 'v'; got {kind!r}")
  blocks = [(i, p) for s, i, p in common.attention_blocks(params) if s == stack]
  fs = _stacked(blocks, dtype)
  out = {}
  for li in range(1, len(fs)):
    late, early = fs[li], {n: np.concatenate([f[n] for f in fs[:li]]) for n in fs[0]}
    # A B = L M R^T with L, X the later head's (q: Wk, Wq; k: Wq, Wk; v: Wo^T, Wv),
    # M = X^T Wo1^T, R = Wv1. With L = Q RL and Wv1 = Q' RV (QR), |A B| = |RL M RV^T|
    # = |Z Y| for Y = X RL^T (D, K) and Z = RV Wo1 (K, D): one matmul for all pairs.
    # |A|^2 = |RL X^T|^2, |B|^2 = |RV Wo1|^2.
    lf = {"q": late["Wk"], "k": late["Wq"], "v": np.swapaxes(late["Wo"], 1, 2)}[kind]
    xf = {"q": late["Wq"], "k": late["Wk"], "v": late["Wv"]}[kind]
    hl, d, k = xf.shape
    he = early["Wo"].shape[0]
    y = xf @ np.swapaxes(np.linalg.qr(lf, mode="r"), 1, 2)          # (Hl, D, K)
    z = np.linalg.qr(early["Wv"], mode="r") @ early["Wo"]          # (He, K, D)
    zy = z.reshape(he * k, d) @ np.moveaxis(y, 1, 0).reshape(d, hl * k)
    num = (zy.reshape(he, k, hl, k) ** 2).sum((1, 3)).T           # (Hl, He)
    den = np.sqrt(np.outer((y ** 2).sum((1, 2)), (z ** 2).sum((1, 2))))
    val = np.where(den > 0, np.sqrt(num) / np.where(den > 0, den, 1), 0.0)
    names_e = [f"{stack}.{i}.{h}" for i, p in blocks[:li] for h in range(int(p["wq"].shape[1]))]
    il = blocks[li][0]
    for h in range(hl):
      for j, ne in enumerate(names_e):
        out[(ne, f"{stack}.{il}.{h}")] = float(val[h, j])
  return out


def composition_scores(params, stack: str = "lm", samples: int = 200,
                       dtype=np.float64) -> dict:
  """Q-, K- and V-composition between every earlier and every later head.

  Returns {"raw": {kind: {(early, late): score}}, "baseline": {kind: value},
  "corrected": {...}} with heads named "stack.layer.head". Computed by
  composition_batched (equal to the D x D formula; tests/circuits/test_circuits.py).
  """
  blocks = [(i, p) for s, i, p in common.attention_blocks(params) if s == stack]
  raw = {kind: composition_batched(params, kind, stack, dtype) for kind in ("q", "k", "v")}
  d = int(params[common.STACKS[stack][0]]["layer_0"][common.STACKS[stack][1]]["wq"].shape[0])
  k = int(blocks[0][1]["wq"].shape[2]) if blocks else 1
  base = {kind: random_baseline(kind, d, k, k, samples) for kind in raw}
  corrected = {kind: {pair: v - base[kind] for pair, v in raw[kind].items()} for kind in raw}
  return {"raw": raw, "baseline": base, "corrected": corrected}


def fold_norms(params) -> dict:
  """A copy of a decoder's params with the norm scales that sit on the attention's
  linear paths folded into the weights the weight-based scores read: ln1's scale into
  the rows of wq, wk, wv; q_norm / k_norm's (per head) scale into the columns of wq /
  wk; ln1_post's into the columns of wo. (ln_final's goes into token_grams.) Gemma's
  (1 + w) scales are stored as 1 + w, so one rule serves every family. What cannot be
  folded is left out, so the scores describe the attention-only path through the
  residual stream, an approximation for real LMs: the per-token 1/rms factors (of ln1,
  q_norm, k_norm, ln1_post), LayerNorm's mean and bias, and every MLP."""
  out = {**params, "lm": dict(params["lm"])}
  for name in common.layers_of(params["lm"]):
    layer = params["lm"][name]
    a = {k: np.asarray(v, np.float64) for k, v in layer["attn"].items()}
    g1 = layer.get("ln1", {}).get("scale")
    if g1 is not None:
      g1 = np.asarray(g1, np.float64)[:, None, None]
      a.update(wq=a["wq"] * g1, wk=a["wk"] * g1, wv=a["wv"] * g1)
    for w, nrm in (("wq", "q_norm"), ("wk", "k_norm")):
      if nrm in a:                        # (K,) shared, or (H, K) / (G, K) per head
        a[w] = a[w] * a[nrm][None] if a[nrm].ndim == 2 else a[w] * a[nrm]
    gp = layer.get("ln1_post", {}).get("scale")
    if gp is not None:
      a["wo"] = a["wo"] * np.asarray(gp, np.float64)
    out["lm"][name] = {**layer, "attn": a}
  return out


def token_grams(params, chunk: int = 16384) -> dict[str, np.ndarray]:
  """{"ue": U E, "ete": E^T E}, (D, D) float64, accumulated in float32 over vocabulary
  chunks (a 262k-token vocabulary never becomes a float64 copy). U is the unembedding
  with ln_final's scale folded into its rows; for tied embeddings U E = diag(g) E^T E."""
  e = params["embed"]
  g = params["lm"].get("ln_final", {}).get("scale")
  g = np.ones(e.shape[1]) if g is None else np.asarray(g, np.float64)
  ete = np.zeros((e.shape[1],) * 2)
  ue = None if "unembed" not in params else np.zeros_like(ete)
  for i in range(0, e.shape[0], chunk):
    ec = np.asarray(e[i:i + chunk], np.float32)
    ete += ec.T @ ec
    if ue is not None:
      ue += np.asarray(params["unembed"][:, i:i + chunk], np.float32) @ ec
  return {"ete": ete, "ue": g[:, None] * (ete if ue is None else ue)}


def positivity(eigenvalues: np.ndarray) -> float:
  """sum(lambda) / sum(|lambda|): +1 for a copying (positive) matrix, -1 for negative."""
  ev = np.asarray(eigenvalues)
  den = np.abs(ev).sum()
  return float(np.real(ev.sum()) / den) if den > 0 else 0.0


def ov_positivity(params, stack: str = "lm", layer: int = 0, head: int = 0,
                  grams: dict | None = None) -> float:
  """Eigenvalue positivity of the full OV circuit E Wv Wo U (V x V), through its K x K
  factor Wo U E Wv (same non-zero eigenvalues), in float64. With `grams`
  (token_grams(params)) U E is read from there: one pass over the vocabulary per model,
  not per head."""
  m = head_matrices(_block(params, stack, layer), head)
  if grams is not None:
    small = m["Wo"] @ grams["ue"] @ m["Wv"]
    return positivity(np.linalg.eigvals(small))
  e = np.asarray(params["embed"], np.float64)                 # (V, D)
  u = unembed_matrix(params)                                  # (D, V)
  small = (m["Wo"] @ u) @ (e @ m["Wv"])                       # (K, K)
  return positivity(np.linalg.eigvals(small))


def k_composition_positivity(params, early: tuple[int, int], late: tuple[int, int],
                             stack: str = "lm", grams: dict | None = None) -> float:
  """Positivity of the same-token matching term: queries as tokens (E), keys as tokens
  moved by the earlier head's OV: E Wq2 Wk2^T (E Wv1 Wo1)^T (V x V), through the
  K x K factor Wk2^T Wo1^T Wv1^T E^T E Wq2 (E^T E from `grams` when given)."""
  m1 = head_matrices(_block(params, stack, early[0]), early[1])
  m2 = head_matrices(_block(params, stack, late[0]), late[1])
  if grams is not None:
    ete = grams["ete"]
  else:
    e = np.asarray(params["embed"], np.float64)
    ete = e.T @ e
  small = m2["Wk"].T @ m1["Wo"].T @ m1["Wv"].T @ ete @ m2["Wq"]
  return positivity(np.linalg.eigvals(small))


def k_composition_partners(params, late: tuple[int, int], stack: str = "lm",
                           baseline: float | None = None, samples: int = 50) -> dict:
  """{"stack.layer.head": K-composition score minus the random baseline} of every head
  in an earlier layer into `late` (factored; GQA-aware through head_matrices)."""
  blocks = {i: p for s, i, p in common.attention_blocks(params) if s == stack}
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
  top, attn = common.STACKS[stack]
  return params[top][f"layer_{layer}"][attn]
