"""Shared test helpers: an independent NumPy oracle for multi-head attention."""

import jax
import numpy as np

# On GPU/TPU, float32 matmuls default to lower precision; tests compare at 1e-5.
jax.config.update("jax_default_matmul_precision", "highest")


def numpy_mha(params, x, context=None, mask=None, causal=False, gates=None, bias=None):
  """Per-head loop in float64 NumPy, written from the paper, not from mha_jax.

  Returns (out (B, T, D), weights (B, H, T, S)).
  """
  p = {k: np.asarray(v, np.float64) for k, v in params.items()}
  x = np.asarray(x, np.float64)
  c = x if context is None else np.asarray(context, np.float64)
  B, T, D = x.shape
  S = c.shape[1]
  _, H, K = p["wq"].shape
  allowed = np.ones((B, H, T, S), bool)
  if mask is not None:
    m = np.asarray(mask)
    if m.ndim == 2:
      m = m[None, None]
    allowed &= np.broadcast_to(m, (B, H, T, S))
  if causal:
    allowed &= np.tril(np.ones((T, S), bool))[None, None]
  heads = np.zeros((B, T, H, K))
  weights = np.zeros((B, H, T, S))
  for b in range(B):
    for h in range(H):
      q = x[b] @ p["wq"][:, h, :] + (p["bq"][h] if "bq" in p else 0)
      k = c[b] @ p["wk"][:, h, :] + (p["bk"][h] if "bk" in p else 0)
      v = c[b] @ p["wv"][:, h, :] + (p["bv"][h] if "bv" in p else 0)
      s = q @ k.T / np.sqrt(K)
      if bias is not None:
        s = s + np.broadcast_to(np.asarray(bias, np.float64), (B, H, T, S))[b, h]
      for t in range(T):
        ok = allowed[b, h, t]
        if not ok.any():
          continue
        e = np.exp(s[t][ok] - s[t][ok].max())
        weights[b, h, t, ok] = e / e.sum()
      o = weights[b, h] @ v
      if gates is not None:
        g = np.asarray(gates, np.float64)
        o = o * (g[h] if g.ndim == 1 else g[b, h])
      heads[b, :, h, :] = o
  out = np.einsum("bthk,hkd->btd", heads, p["wo"]) + (p["bo"] if "bo" in p else 0)
  return out, weights
