"""Head-role detectors for decoder LMs: one score per head, on documented inputs, through
the one decoder forward (`task.apply`) and the interventions' read sites.

  successor        Gould et al. 2024, "Successor Heads": the succession score. Each item
                   of an ordinal sequence (digits, number words, days, months, letters),
                   as its effective embedding (the residual after layer 0 on [BOS, item]:
                   the paper's MLP0 of the embedding), through the head's OV circuit and
                   the unembedding; the share of items (all but each sequence's last)
                   whose successor gets the largest logit among the sequence's items.
  copy_suppression McDougall et al. 2023, "Copy Suppression": on windows of the built-in
                   text, at each query t >= 2 the key j in 1..t-1 the head attends to most
                   (weight w), and the head's direct effect on the logit of the token at
                   j, as a z-score against its effect on a fixed sample of the vocabulary;
                   the score is -sum(w z) / sum(w) (positive: the head lowers the logits of
                   the tokens it attends to). `ov_self` is the second check, from the
                   weights: the mean z-score of each frequent token's own logit in the
                   head's OV circuit on the effective embeddings (negative: suppression).
  sink             the share of attention on key 0 (the first token), over queries 1..
                   (role_scores.first_token_share), on text windows.
  name movers, S-inhibition (Wang et al. 2022) live in taxonomy.ioi_scores (patching's
  DLA and path patching); retrieval (Wu et al. 2025) in retrieval_scores below.

A direct effect on a logit is the head's `result` (B, T, H, D) times the final norm's
scale (and Gemma's post-attention norm's) dotted with the unembedding column: the
per-token 1/rms factors are positive and common to every token of a row, so they cancel
in the z-scores and in every argmax here.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from mha_jax import interventions
from mha_jax.roles import role_scores
from mha_jax.toolkit import composition, memory
from mha_jax.errors import UserError
from mha_jax.models import common

# Ordinal sequences (Gould et al.'s tasks); an item is kept where it is one token.
ORDINAL_SEQUENCES = {
    "digits": [str(i) for i in range(10)],
    "number_words": ["one", "two", "three", "four", "five", "six", "seven", "eight", "nine",
                     "ten"],
    "days": ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"],
    "months": ["January", "February", "March", "April", "May", "June", "July", "August",
               "September", "October", "November", "December"],
    "letters": [chr(c) for c in range(ord("A"), ord("Z") + 1)],
}


def _forward(task, params, tokens_BT, edits=None, read=()):
  """(logits (B, T-1, V), values read) of task.apply on tokens (the last is a target)."""
  return interventions.run_with_hook(lambda hook: task.apply(params, {"tokens": tokens_BT}, hook=hook), edits, read)


def bos_of(task) -> list[int]:
  """[the model's BOS id] where it has one, else []."""
  return [int(task.bos_id)] if task.bos_id >= 0 else []


def ordinal_ids(task, min_items: int = 3) -> dict[str, list[int]]:
  """{sequence: [token ids]} of ORDINAL_SEQUENCES in the model's vocabulary: each item as
  " item" (one token) where every item of that form is one token, else "item"; items
  that are not one token end the sequence there (it must stay consecutive). Sequences
  with fewer than `min_items` items are left out; none left is refused."""
  from mha_jax.toolkit import pairs as pairs_lib
  out = {}
  for name, items in ORDINAL_SEQUENCES.items():
    best: list[int] = []
    for prefix in (" ", ""):
      ids = []
      for it in items:
        t = pairs_lib.single_token(task, prefix + it)
        if t is None:
          break
        ids.append(t)
      if len(ids) > len(best):
        best = ids
    if len(best) >= min_items:
      out[name] = best
  if not out:
    raise UserError("role successor: no ordinal sequence (digits, number words, days, "
                    f"months, letters) has {min_items} consecutive single tokens in this "
                    "model's vocabulary")
  return out


def embedding_tokens(task, ids: Sequence[int]) -> np.ndarray:
  """(N, len(BOS) + 2) int32: [BOS, token, token] per id (the last is a target)."""
  bos = bos_of(task)
  return np.stack([np.asarray(bos + [int(i), int(i)], np.int32) for i in ids]).reshape(
      len(ids), len(bos) + 2)


def embeddings_program(task, rows: int | None):
  """fn(params, embedding_tokens (N, len(BOS) + 2)) -> (G, rows, D): the residual after
  layer 0 at the token, `rows` tokens per group (memory.map_rows; padding after N)."""
  at = len(bos_of(task))

  def group(p, tok):
    return _forward(task, p, tok, read=("lm.0.resid_post",))[1]["lm.0.resid_post"][:, at]
  return lambda p, tok: memory.map_rows(lambda c, _: group(p, c), (tok,), rows)


def effective_embeddings(task, params, ids: Sequence[int], rows: int | None = None
                         ) -> np.ndarray:
  """(N, D) float64: the residual after layer 0 at each token, on [BOS, token] (or the
  token alone without a BOS): Gould et al.'s effective embedding (MLP0 of the embedding);
  `rows` tokens per batch (None: all at once; head_taxonomy.plan chooses it)."""
  x = np.asarray(jax.jit(embeddings_program(task, rows))(
      params, embedding_tokens(task, ids)), np.float64)            # (G, rows, D)
  return x.reshape(-1, x.shape[-1])[:len(ids)]


def _unembed_g(params, columns, xp=np):
  """(D, M): the unembedding's `columns` (M,), the final norm's scale folded into its
  rows; float64 NumPy (xp=np) or float32 traced (xp=jnp, params may be abstract)."""
  cols = np.asarray(columns)
  dt = np.float64 if xp is np else jnp.float32
  u = (xp.asarray(params["unembed"][:, cols], dt) if "unembed" in params else
       xp.asarray(params["embed"][cols], dt).T)
  g = params["lm"].get("ln_final", {}).get("scale")
  return u if g is None else xp.asarray(g, dt)[:, None] * u


def ov_logits(params, x_ND: np.ndarray, columns: np.ndarray) -> list[np.ndarray]:
  """Per layer, (H, N, M): each head's OV circuit on the inputs x (N, D) (RMS-normalised,
  the norm scales folded in: toolkit.composition.fold_norms), read at the unembedding's
  `columns` (M,). Query head h reads key/value head h // (H / G)."""
  f = composition.fold_norms(params)
  ug = _unembed_g(params, columns)                              # (D, M)
  x = np.asarray(x_ND, np.float64)
  x = x / np.sqrt((x * x).mean(-1, keepdims=True) + 1e-12)
  out = []
  for name in common.layers_of(f["lm"]):
    a = f["lm"][name]["attn"]
    h, g = a["wq"].shape[1], a["wv"].shape[1]
    v = np.einsum("nd,dgk->ngk", x, a["wv"])[:, np.arange(h) // (h // g)]   # (N, H, K)
    o = np.einsum("nhk,hkd->hnd", v, a["wo"])
    out.append(o @ ug)
  return out


def succession_scores(params, x_by_seq: Mapping[str, np.ndarray],
                      ids_by_seq: Mapping[str, Sequence[int]]) -> np.ndarray:
  """(L, H_max) succession score (NaN past a layer's heads): over every sequence s and
  item i < n_s - 1, the share where the head's OV logits over s's items (from the item's
  input `x_by_seq[s][i]`) are largest at item i + 1."""
  hits, total = None, 0
  for name, ids in ids_by_seq.items():
    per_layer = ov_logits(params, x_by_seq[name], np.asarray(ids))   # [(H, n, n)]
    n = len(ids)
    if hits is None:
      hmax = max(p.shape[0] for p in per_layer)
      hits = np.zeros((len(per_layer), hmax))
    for l, lg in enumerate(per_layer):
      top = lg[:, :n - 1].argmax(-1)                                 # (H, n - 1)
      hits[l, :lg.shape[0]] += (top == np.arange(1, n)[None]).sum(-1)
    total += n - 1
  out = hits / max(total, 1)
  for l, h in enumerate(common.head_counts(params)["lm"]):
    out[l, h:] = np.nan
  return out


def successor_scores(task, params, min_items: int = 3, rows: int | None = None
                     ) -> tuple[np.ndarray, dict]:
  """((L, H_max) succession scores, {sequence: [ids]}) on the model's ordinal sequences
  (their effective embeddings `rows` tokens per batch)."""
  ids = ordinal_ids(task, min_items)
  every = effective_embeddings(task, params, [i for v in ids.values() for i in v], rows)
  ends = np.cumsum([len(v) for v in ids.values()])[:-1]              # one program for all
  x = dict(zip(ids, np.split(every, ends)))
  return succession_scores(params, x, ids), ids


def ov_self_scores(params, x_ND: np.ndarray, ids: Sequence[int]) -> np.ndarray:
  """(L, H_max): the mean over tokens t of ids of the z-score of t's own logit among the
  logits of ids, in the head's OV circuit on t's input x (N, D). Negative: the head
  writes against the token it reads (copy suppression); positive: it copies."""
  per_layer = ov_logits(params, x_ND, np.asarray(ids))
  hmax = max(p.shape[0] for p in per_layer)
  out = np.full((len(per_layer), hmax), np.nan)
  for l, lg in enumerate(per_layer):                                  # (H, N, N)
    diag = np.diagonal(lg, axis1=1, axis2=2)
    z = (diag - lg.mean(-1)) / np.maximum(lg.std(-1), 1e-12)
    out[l, :lg.shape[0]] = z.mean(-1)
  return out


def by_layer(per_layer: Sequence[np.ndarray]) -> np.ndarray:
  """(L, H_max) float64 of per-layer (H_l,) scores, NaN past a layer's heads."""
  arr = np.full((len(per_layer), max(len(x) for x in per_layer)), np.nan)
  for i, x in enumerate(per_layer):
    arr[i, :len(x)] = np.asarray(x, np.float64)
  return arr


def copy_suppression_program(task, layers: int, sample: np.ndarray, rows: int | None):
  """fn(params, tokens (B, T + 1)) -> per layer (numerator (G, H), denominator (G, H)):
  copy suppression's weighted sums (see `copy_suppression_text`) of each group of `rows`
  windows (memory.map_rows; G groups); every weight is read from the params inside the
  program, so `mha-jax plan --job taxonomy` compiles it from shapes."""
  read = tuple(f"lm.{i}.attn.{s}" for i in range(layers) for s in ("pattern", "result"))

  def group(p, tok, wt_row):
    _, vals = _forward(task, p, tok, read=read)
    ug_r = _unembed_g(p, sample, jnp)                                   # (D, M)
    u = p["unembed"].T if "unembed" in p else p["embed"]                # (V, D)
    g = p["lm"].get("ln_final", {}).get("scale")
    inp = tok[:, :-1]
    t = inp.shape[1]
    uk = u[inp].astype(jnp.float32)                                     # (B, S, D) key tokens
    if g is not None:
      uk = uk * g.astype(jnp.float32)
    keys = (jnp.arange(t)[None, :] >= 1) & (jnp.arange(t)[None, :] < jnp.arange(t)[:, None])
    out = []
    for i, name in enumerate(common.layers_of(p["lm"])):
      w = jnp.where(keys[None, None], vals[f"lm.{i}.attn.pattern"], -1.0)  # (B, H, T, S)
      a = w.argmax(-1)
      wt = jnp.take_along_axis(w, a[..., None], -1)[..., 0].clip(0.0)     # (B, H, T)
      r = vals[f"lm.{i}.attn.result"].astype(jnp.float32)                # (B, T, H, D)
      post = p["lm"][name].get("ln1_post", {}).get("scale")              # Gemma's
      if post is not None:
        r = r * post.astype(jnp.float32)
      eff_k = jnp.einsum("bthd,bsd->bhts", r, uk)        # effect on each key token's logit
      eff_s = jnp.take_along_axis(eff_k, a[..., None], -1)[..., 0]
      eff_r = jnp.einsum("bthd,dm->bhtm", r, ug_r)
      z = (eff_s - eff_r.mean(-1)) / jnp.maximum(eff_r.std(-1), 1e-12)
      wt = wt * (jnp.arange(t) >= 2)[None, None] * wt_row[:, None, None]
      out.append((-(wt * z).sum((0, 2)), wt.sum((0, 2))))
    return out
  return lambda p, tok: memory.map_rows(lambda c, w: group(p, c, w), (tok,), rows)


def copy_suppression_text(task, params, tokens_BT: np.ndarray, sample: np.ndarray,
                          rows: int | None = None, per_window: bool = False) -> np.ndarray:
  """(L, H_max) copy-suppression score on text windows tokens (B, T + 1) (see the module
  docstring): the head's direct effect on the logit of the token it attends to most,
  as a z-score against its effect on the `sample` tokens (M,), negated and averaged
  over queries t >= 2 weighted by that attention weight; `rows` windows per batch (None:
  all at once), their weighted sums added. per_window: (B, L, H_max), each window's own
  score, from the same program at one window per batch."""
  layers = len(common.layers_of(params["lm"]))
  fn = jax.jit(copy_suppression_program(task, layers, sample, 1 if per_window else rows))
  sums = [(np.asarray(num, np.float64), np.asarray(den, np.float64))
          for num, den in fn(params, jnp.asarray(tokens_BT))]          # (G, H) each
  ratio = lambda num, den: num / np.maximum(den, 1e-12)               # noqa: E731
  if per_window:
    return np.stack([by_layer([ratio(n[w], d[w]) for n, d in sums])
                     for w in range(len(tokens_BT))])
  return by_layer([ratio(n.sum(0), d.sum(0)) for n, d in sums])


def sink_program(task, layers: int, rows: int | None):
  """fn(params, tokens (B, T + 1)) -> per layer (G, rows, H, T, 1): the attention on key 0
  of each window (memory.map_rows; the rows after the B-th are padding)."""
  read = tuple(f"lm.{i}.attn.pattern" for i in range(layers))

  def key0(p, tok):
    vals = _forward(task, p, tok, read=read)[1]
    return [vals[r][..., :1] for r in read]
  return lambda p, tok: memory.map_rows(lambda c, _: key0(p, c), (tok,), rows)


def sink_scores(task, params, tokens_BT: np.ndarray, rows: int | None = None,
                per_window: bool = False) -> np.ndarray:
  """(L, H_max): role_scores.first_token_share (attention on key 0 over queries 1..) on tokens
  (B, T + 1), `rows` windows per batch (None: all at once; every row weighs the same).
  per_window: (B, L, H_max), each window's own share."""
  layers, n = len(common.layers_of(params["lm"])), len(tokens_BT)
  cols = [np.asarray(x).reshape((-1,) + x.shape[2:])[:n] for x in
          jax.jit(sink_program(task, layers, rows))(params, jnp.asarray(tokens_BT))]
  if per_window:
    return np.stack([by_layer([role_scores.first_token_share(c[w:w + 1]) for c in cols])
                     for w in range(n)])
  return by_layer([role_scores.first_token_share(c) for c in cols])


def frequent_tokens(tokens: np.ndarray, n: int, exclude: Sequence[int] = ()) -> np.ndarray:
  """The n most frequent token ids of `tokens`, `exclude` left out."""
  ids, counts = np.unique(np.asarray(tokens).ravel(), return_counts=True)
  keep = ~np.isin(ids, np.asarray(list(exclude), ids.dtype))
  ids, counts = ids[keep], counts[keep]
  return ids[np.argsort(-counts, kind="stable")[:n]]


# ------------------------------------------------------------------ retrieval (Wu et al. 2025)

NEEDLE = " The secret passphrase of the blue door is purple otter seventeen."
QUESTION = " Question: what is the secret passphrase of the blue door? Answer:"


def window_of(task) -> int:
  """The model's context window (config model.max_len)."""
  return int(task.window)


def check_window(task, length: int) -> None:
  """Refuses role retrieval where the haystack is longer than the model's window."""
  w = window_of(task)
  if length > w:
    raise UserError(f"role retrieval: the haystack of {length} tokens is longer than this "
                    f"model's window ({w} tokens); use a shorter retrieval_len")


def needle_inputs(task, stream: np.ndarray, length: int, depths: Sequence[float],
                  needle_ids: Sequence[int], question_ids: Sequence[int]):
  """(tokens (N, T + 1), needle start (N,), answer start (N,)): [BOS] haystack (text from
  `stream`) with the needle inserted at each depth, the question, then the needle again
  (teacher-forced: the answer), T + 1 = length tokens in all."""
  bos = bos_of(task)
  nd, qd = list(needle_ids), list(question_ids)
  hay = length - len(bos) - 2 * len(nd) - len(qd)
  if hay < 8 or len(stream) < hay:
    raise UserError(f"role retrieval: retrieval_len {length} leaves {hay} haystack "
                    f"tokens; it must leave at least 8 (and the text has {len(stream)})")
  rows, starts, answers = [], [], []
  for d in depths:
    at = int(round(float(d) * hay))
    text = [int(x) for x in stream[:hay]]
    rows.append(bos + text[:at] + nd + text[at:] + qd + nd)
    starts.append(len(bos) + at)
    answers.append(len(bos) + hay + len(nd) + len(qd))
  return np.asarray(rows, np.int32), np.asarray(starts), np.asarray(answers)


def retrieval_program(task, params, tokens_NT, needle_start, answer_start, needle_len: int):
  """fn(edits) -> ((L, H_max) copy-paste score, needle recall), compiled once for these
  inputs (every edit set of one structure reuses it; see `retrieval_scores`). The inputs
  run one at a time (lax.map), each head's attention reduced to its rows at the answer
  positions inside the layer's loop and the logits computed there only (`logits_at`),
  so memory grows with T^2 x heads of one layer, not with the whole model's patterns."""
  layers = len(common.layers_of(params["lm"]))
  read = tuple(f"lm.{i}.attn.pattern" for i in range(layers))
  heads = common.head_counts(params)["lm"]
  tok = jnp.asarray(tokens_NT)
  k = jnp.arange(needle_len)
  q_pos = jnp.asarray(answer_start)[:, None] - 1 + k[None]             # (N, n)
  src = jnp.asarray(needle_start)[:, None] + k[None]                   # (N, n)
  target = jnp.take_along_axis(tok, q_pos + 1, 1)                      # (N, n)

  def one(p, edits, row):
    t, q, sr, tg = row                                                 # (T,), (n,), (n,), (n,)
    logits, vals = interventions.run_with_hook(lambda hook: task.apply(
        p, {"tokens": t[None], "logits_at": q[None]}, hook=hook), edits, read)
    gen = logits[0].argmax(-1) == tg                                   # (n,)
    hits = []
    for n, h in zip(read, heads):
      w = vals[n][0][:, q]                                             # (H, n, S)
      hit = w.argmax(-1) == sr[None]
      hits.append(jnp.pad((hit & gen[None]).mean(-1), (0, max(heads) - h)))
    return jnp.stack(hits), gen.mean()

  @jax.jit
  def fn(p, edits):
    per, recall = jax.lax.map(lambda row: one(p, edits, row), (tok, q_pos, src, target))
    return per.mean(0), recall.mean()

  def run(edits=None):
    per, recall = fn(params, edits or {})
    arr = np.asarray(per, np.float64)
    for l, h in enumerate(heads):
      arr[l, h:] = np.nan
    return arr, float(recall)
  return run


def retrieval_scores(task, params, tokens_NT, needle_start, answer_start, needle_len: int,
                     edits=None) -> tuple[np.ndarray, float]:
  """((L, H_max) copy-paste score, needle recall). At each answer position p predicting
  needle token k (the input at p is needle token k - 1, or the question's end), the model
  "generates" token k when its argmax is that token; a head copies and pastes it when its
  top attention at p falls on token k of the inserted needle. Score: the share of the
  needle's tokens (over the inputs) the head copy-pastes; recall: the share generated."""
  return retrieval_program(task, params, tokens_NT, needle_start, answer_start,
                           needle_len)(edits)
