"""Behavioural scores on repeated random tokens with BOS, from the model's own forward.

  prefix matching  attention to the token after earlier copies of the current token
                   (the induction score of `roles.role_scores.lm_scores`)
  previous token   attention to the previous position
  copying          the head's direct effect on the logit of the token it attends to,
                   minus its mean effect over the vocabulary (row convention:
                   head output @ Wo_h @ U; exact for models without a final LayerNorm),
                   at the queries whose most-attended key is not position 0 (BOS, where
                   a head rests: what it writes against BOS's logit is not copying)
  ICL score        loss at a late position minus loss at an early one (Olsson et al.):
                   on repeated tokens (icl_score) and on the run's own text
                   (text_icl_score: token 500, or the last the context holds, minus 50)
"""

from __future__ import annotations

import numpy as np
import optax
import jax.numpy as jnp

from mha_jax.toolkit import capture
from mha_jax.roles import role_scores
from mha_jax.toolkit import composition as scores
from mha_jax.errors import UserError
from mha_jax.tasks import jitted


def eval_tokens(loaded, batch: int = 64, seed_offset: int = 7_000_003):
  """(tokens (B, 1 + 2n), copy lengths m (B,)): repeated random tokens held out from
  training. A model trained on text gets them over its own vocabulary (BOS is id 0 in
  both), with n as long as its context allows, as the papers evaluate text models."""
  if not loaded.task.decoder_only:
    raise UserError(f"repeated-token scores need a decoder-only model; this run has task "
                    f"{loaded.task.name!r}")
  return loaded.task.repeated_eval_tokens(batch, seed_offset)


def head_scores(loaded, tokens: np.ndarray) -> dict[str, dict[str, float]]:
  """{"lm.layer.head": {prefix_matching, previous_token, duplicate_token, copying}}."""
  cap = capture.captured(loaded.task, loaded.params, {"tokens": tokens})
  x = tokens[:, :-1]
  u = scores.unembed_matrix(loaded.params)                             # (D, V)
  out = {}
  for layer, r in enumerate(cap["lm"]):
    w = np.asarray(r.weights)
    s = role_scores.lm_scores(w, x)
    attn = loaded.params["lm"][f"layer_{layer}"]["attn"]
    wo = np.asarray(attn["wo"], np.float64)
    heads = np.asarray(r.heads, np.float64)                         # (B, T, H, K)
    for h in range(w.shape[1]):
      out[f"lm.{layer}.{h}"] = {"prefix_matching": float(s["induction"][h]),
                                "previous_token": float(s["previous_token"][h]),
                                "duplicate_token": float(s["duplicate_token"][h]),
                                "copying": copying(heads[:, :, h] @ wo[h], w[:, h], x, u)}
  return out


def copying(write_BTD: np.ndarray, weights_BTS: np.ndarray, tokens_BT: np.ndarray,
            u_DV: np.ndarray) -> float:
  """A head's copying score (see the module docstring): what it writes (B, T, D), dotted
  with the unembedding column (u (D, V)) of the token at its most-attended key, less
  its mean over the vocabulary, averaged over the queries t >= 1 whose most-attended
  key is not 0; 0.0 for a head that only ever attends to key 0."""
  keys = np.asarray(weights_BTS).argmax(-1)                               # (B, T)
  attended = np.take_along_axis(np.asarray(tokens_BT), keys, axis=1)     # (B, T)
  own = np.einsum("btd,dbt->bt", write_BTD, u_DV[:, attended])          # logit of attended
  effect = own - write_BTD @ u_DV.mean(1)
  keep = keys > 0
  keep[:, 0] = False
  return float(effect[keep].mean()) if keep.any() else 0.0


def icl_score(loaded, tokens: np.ndarray, lengths: np.ndarray) -> dict[str, float]:
  """Loss at a late position minus loss at an early one (negative = in-context learning):
  the prediction of the 2nd token of the first copy against that of the last token of
  the second copy (row by row, as copy lengths vary)."""
  fwd = jitted(loaded.task, "logits", lambda p, b: loaded.task.apply(p, b))
  logits = np.asarray(fwd(loaded.params, {"tokens": tokens}))
  nll = np.asarray(optax.softmax_cross_entropy_with_integer_labels(
      jnp.asarray(logits), jnp.asarray(tokens[:, 1:])))               # (B, T-1)
  rows = np.arange(len(tokens))
  early = nll[:, 1]
  late = nll[rows, 2 * np.asarray(lengths) - 1]
  return {"loss_early": float(early.mean()), "loss_late": float(late.mean()),
          "icl_score": float(late.mean() - early.mean())}


def text_icl_score(loaded, windows: np.ndarray, early: int = 50, late: int = 500
                   ) -> dict[str, float]:
  """Olsson et al.'s in-context learning score on natural text: the mean loss of token
  `late` (capped at the last one the windows hold) minus that of token `early` (capped
  at a fifth of `late`, for short contexts), over windows (B, T + 1) of [BOS] + text.
  Token n is the n-th after BOS."""
  t = windows.shape[1] - 1
  if t < 2:
    raise UserError(f"text_icl_score needs windows of at least 2 tokens after BOS; got {t}")
  late = min(late, t)
  early = min(early, max(1, late // 5))
  fwd = jitted(loaded.task, "logits", lambda p, b: loaded.task.apply(p, b))
  logits = np.asarray(fwd(loaded.params, {"tokens": windows}))
  nll = np.asarray(optax.softmax_cross_entropy_with_integer_labels(
      jnp.asarray(logits), jnp.asarray(windows[:, 1:])))               # (B, T)
  e, l = float(nll[:, early - 1].mean()), float(nll[:, late - 1].mean())
  return {"text_loss_early": e, "text_loss_late": l, "text_icl_score": l - e,
          "text_early_token": early, "text_late_token": late}
