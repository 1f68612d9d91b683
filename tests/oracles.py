"""Independent references the tests compare against, written from the papers and
formulas in float64 NumPy, not from mha_jax: attention per head (grouped heads, masks,
biases, gates, RoPE in both layouts) and a tiny LLaMA's forward with explicit
substitution at every site (`from oracles import numpy_mha`)."""

import jax
import numpy as np

from mha_jax.models import llama


EPS32 = float(np.finfo(np.float32).eps)     # 2^-23: one float32 ulp at 1.0
F32_ULPS = 64     # the float32 rounding two computations of one value may differ by


def assert_f32_close(got, want, ulps: int = F32_ULPS, what: str = "",
                     scale: float | None = None) -> None:
  """|got - want| <= `ulps` float32 ulps at the array's scale (max |want|, or `scale`:
  the computation's, for an array that is 0 analytically and holds only noise). Two float32
  computations of the same values (another summation order, another program, another
  CPU's instruction set: FMA, vector width, XLA's exp and log) agree to a few dozen ulps
  of their scale, never bit for bit across machines: a golden file, a NumPy oracle or a
  second program is compared with this; bit-identity only within one process or machine
  (a resume, a cache hit, a program run twice)."""
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  assert got.shape == want.shape, (what, got.shape, want.shape)
  if not want.size:
    return
  scale = max(float(np.max(np.abs(want))) if scale is None else scale,
              np.finfo(np.float32).tiny)
  err = float(np.max(np.abs(got - want)))
  assert err <= ulps * EPS32 * scale, (f"{what}: max error {err:.3g} > {ulps} float32 ulps "
                                       f"of the scale {scale:.3g} ({ulps * EPS32 * scale:.3g})")


def rel_err(a, ref) -> float:
  """max |a - ref| / max |ref| over the compared entries, in float64."""
  a, ref = np.asarray(a, np.float64), np.asarray(ref, np.float64)
  return float(np.max(np.abs(a - ref)) / np.max(np.abs(ref)))


def numpy_rope(x_TK, pos_T, base=10000.0, layout="half", dim=None):
  """Rotary embedding of one head's (T, K) rows, from the formula (Su et al. 2021).

  Pair i (i < dim/2) turns by the angle pos * base**(-2i/dim). "half" pairs feature i
  with i + dim/2 (Hugging Face rotate_half); "interleaved" pairs 2i with 2i+1.
  Features from dim on pass through.
  """
  x = np.array(x_TK, np.float64)
  dim = x.shape[-1] if dim is None else dim
  out = x.copy()
  for t in range(x.shape[0]):
    for i in range(dim // 2):
      a, b = (i, i + dim // 2) if layout == "half" else (2 * i, 2 * i + 1)
      ang = float(pos_T[t]) * base ** (-2.0 * i / dim)
      c, s = np.cos(ang), np.sin(ang)
      out[t, a] = x[t, a] * c - x[t, b] * s
      out[t, b] = x[t, b] * c + x[t, a] * s
  return out


def numpy_mha(params, x, context=None, mask=None, causal=False, gates=None, bias=None,
              rope=None, positions=None, kv_positions=None):
  """Per-head loop in float64 NumPy, written from the paper, not from mha_jax.

  Grouped-query attention: params["wk"] may have G heads, G dividing H; query head h
  reads key/value head h // (H // G). rope: (base, layout, dim) rotates q and k of
  every head by numpy_rope at positions (B, T) (default arange(T)) and kv_positions
  (B, S) (default: positions for self-attention, arange(S) for context).

  Returns (out (B, T, D), weights (B, H, T, S)).
  """
  p = {k: np.asarray(v, np.float64) for k, v in params.items()}
  x = np.asarray(x, np.float64)
  c = x if context is None else np.asarray(context, np.float64)
  B, T, D = x.shape
  S = c.shape[1]
  _, H, K = p["wq"].shape
  G = p["wk"].shape[1]
  if rope is not None:
    pos = np.broadcast_to(np.arange(T) if positions is None else np.asarray(positions),
                          (B, T))
    if kv_positions is not None:
      kv_pos = np.broadcast_to(np.asarray(kv_positions), (B, S))
    else:
      kv_pos = pos if context is None else np.broadcast_to(np.arange(S), (B, S))
  allowed = np.ones((B, H, T, S), bool)
  if mask is not None:
    m = np.asarray(mask)
    if m.ndim == 2:
      m = m[None, None]
    allowed &= np.broadcast_to(m, (B, H, T, S))
  if causal:
    allowed &= np.tril(np.ones((T, S), bool))[None, None]
  heads = np.zeros((B, T, H, p["wv"].shape[2]))     # V: the value heads' width
  weights = np.zeros((B, H, T, S))
  for b in range(B):
    for h in range(H):
      j = h // (H // G)                 # this query head's key/value head
      q = x[b] @ p["wq"][:, h, :] + (p["bq"][h] if "bq" in p else 0)
      k = c[b] @ p["wk"][:, j, :] + (p["bk"][j] if "bk" in p else 0)
      v = c[b] @ p["wv"][:, j, :] + (p["bv"][j] if "bv" in p else 0)
      if rope is not None:
        q = numpy_rope(q, pos[b], *rope)
        k = numpy_rope(k, kv_pos[b], *rope)
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


SPEC = llama.llama_spec(rope_base=10000.0)


def tiny_llama_pairs(corrupt_cols: slice, length):
  """A tiny LLaMA of SPEC (D, H, G, K, L; weights x3 for sharper heads) and 3 pairs of
  7 tokens whose corrupt prompts differ in `corrupt_cols`: (params, Pairs)."""
  from mha_jax.toolkit.pairs import Pairs
  params = llama.init(jax.random.PRNGKey(3), vocab_size=37, d_model=D, num_heads=H,
                      num_kv_heads=G, head_dim=K, num_layers=L, d_ff=24)
  params = jax.tree.map(lambda a: a * 3.0 if a.ndim == 3 else a, params)
  rng = np.random.default_rng(5)
  clean = rng.integers(0, 37, (3, 7)).astype(np.int32)
  corrupt = clean.copy()
  width = corrupt_cols.stop - corrupt_cols.start
  corrupt[:, corrupt_cols] = rng.integers(0, 37, (3, width))
  return params, Pairs(clean, corrupt, np.asarray([3, 8, 11]), np.asarray([4, 9, 20]),
                       np.asarray(length), [{}] * 3)


class LlamaTask:
  """The slice of the Task protocol the studies use, over a tiny LLaMA of SPEC."""
  vocab_size = 37

  def apply(self, params, batch, *, gates=None, capture=False, key=None, hook=None):
    return llama.apply(params, SPEC, batch["tokens"][:, :-1], hook=hook,
                       logits_at=batch.get("logits_at"))
H, G, K, D, L = 4, 2, 4, 16, 2


class CachedLlamaTask(LlamaTask):
  """LlamaTask with what imported LMs have: a shared prefix's KV cache (`prefix_cache`)
  and resuming at a layer (start, stream), so Studies share prefix and depth."""

  def apply(self, params, batch, *, gates=None, capture=False, key=None, hook=None):
    kw = dict(hook=hook, logits_at=batch.get("logits_at"), start=batch.get("start"),
              stream=batch.get("stream"))
    if "cache" in batch:
      return llama.apply(params, SPEC, batch["tokens"][:, :-1], cache=batch["cache"],
                         **kw)[0]
    return llama.apply(params, SPEC, batch["tokens"][:, :-1], **kw)

  def prefix_cache(self, params, tokens_BT, max_len):
    cache = llama.init_cache(params, tokens_BT.shape[0], max_len)
    return llama.apply(params, SPEC, tokens_BT, cache=cache, last_only=True)[1]


def numpy_llama(params, tokens, patch=None):
  """Float64 LLaMA forward written from the formulas, with explicit substitution:
  patch {(layer, site): fn(value) -> value} at "q", "z" (B, T, H, K), "k", "v"
  (B, T, G, K), "k_q", "v_q" (B, T, H, K), "resid_pre", "mlp_out", "resid_post"
  (B, T, D). Returns (logits, {(layer, site): value}; "final_scale": 1/rms)."""
  p = jax.tree.map(lambda a: np.asarray(a, np.float64), params)
  patch = patch or {}
  seen = {}

  def site(i, name, v):
    v = patch[(i, name)](v) if (i, name) in patch else v
    seen[(i, name)] = v
    return v

  def rms(s, x):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + SPEC.norm_eps) * s

  x = p["embed"][np.asarray(tokens)]
  b, t, _ = x.shape
  for i in range(L):
    lp = p["lm"][f"layer_{i}"]
    x = site(i, "resid_pre", x)
    h = rms(lp["ln1"]["scale"], x)
    a = lp["attn"]
    q = np.einsum("btd,dhk->bthk", h, a["wq"])
    k = np.einsum("btd,dgk->btgk", h, a["wk"])
    v = np.einsum("btd,dgk->btgk", h, a["wv"])
    for bb in range(b):
      for hh in range(H):
        q[bb, :, hh] = numpy_rope(q[bb, :, hh], np.arange(t), SPEC.rope_base)
      for g in range(G):
        k[bb, :, g] = numpy_rope(k[bb, :, g], np.arange(t), SPEC.rope_base)
    k, v, q = site(i, "k", k), site(i, "v", v), site(i, "q", q)
    kq = site(i, "k_q", np.repeat(k, H // G, axis=2))    # as each query head reads them
    vq = site(i, "v_q", np.repeat(v, H // G, axis=2))
    z = np.zeros((b, t, H, K))
    for bb in range(b):
      for hh in range(H):
        s = q[bb, :, hh] @ kq[bb, :, hh].T / np.sqrt(K)
        s = np.where(np.tril(np.ones((t, t), bool)), s, -np.inf)
        w = np.exp(s - s.max(-1, keepdims=True))
        w /= w.sum(-1, keepdims=True)
        z[bb, :, hh] = w @ vq[bb, :, hh]
    z = site(i, "z", z)
    x = x + np.einsum("bthk,hkd->btd", z, a["wo"])
    m = lp["mlp"]
    h2 = rms(lp["ln2"]["scale"], x)
    g1 = h2 @ m["w_gate"]
    mo = site(i, "mlp_out", ((g1 / (1 + np.exp(-g1))) * (h2 @ m["w_up"])) @ m["w_down"])
    x = site(i, "resid_post", x + mo)
  seen["final_scale"] = 1 / np.sqrt((x * x).mean(-1, keepdims=True) + SPEC.norm_eps)
  x = rms(p["lm"]["ln_final"]["scale"], x)
  return x @ p["embed"].T, seen
