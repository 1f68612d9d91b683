"""What one attention layer costs, and how that depends (or not) on the head count h.

For self-attention over T tokens of width D with h heads of width d_k = D / h:
  params  = 4 D^2 weights (+ 4 D biases)         independent of h
  FLOPs   = 8 T D^2 (projections) + 4 T^2 D      independent of h (per sequence)
  scores  = B h T^2 numbers                      grows with h
FLOPs count a multiply-add as 2. Softmax adds a few elementwise operations per score,
so XLA's own count sits a few percent above the matmul FLOPs and grows with h.

With grouped-query attention (h_kv key/value heads shared by h query heads) W_K and
W_V shrink to D x h_kv d_k: params 2 D^2 + 2 D h_kv d_k, the K and V projections
shrink alike, scores and mixing stay per query head, and the KV cache a decoder keeps
(2 L T h_kv d_k numbers per sequence) shrinks by h / h_kv.

The attention variants add what their registry entries declare
(mha_jax/attention_variants.py: params, flops, maps; variant_extra_params,
attention_flops(variant=...), score_memory_bytes(variant=...)). The built-in ones:
  gated         params + D^2 + D (wg, bg)       FLOPs + 2 T D^2 (the gate's projection)
  gated_head    params + D h + h                FLOPs + 2 T D h
  differential  params + 2 D + d_k (lambdas of (h, d_k / 2), diff_norm (d_k,))
                FLOPs: scores the same (two maps over half-width heads), mixing x 2;
                scores memory x 2 (two maps)
  sigmoid       nothing added
  sink          params + h (one logit per head)
  qk_norm       params + 2 d_k (q_norm, k_norm)
Elementwise work (sigmoids, norms) is not counted, as for the softmax.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from mha_jax import attention_variants as variants
from mha_jax.errors import UserError
from mha_jax.settings import setting


@dataclasses.dataclass(frozen=True)
class ZooEntry:
  name: str
  d_model: int
  num_heads: int
  num_kv_heads: int | None = None     # None: h (multi-head attention)

  @property
  def head_dim(self) -> int:
    return self.d_model // self.num_heads

  @property
  def kv_heads(self) -> int:
    return self.num_heads if self.num_kv_heads is None else self.num_kv_heads


# Published widths and head counts (query / key-value heads). d_k = d_model / h.
ZOO = (
    ZooEntry("Transformer-base", 512, 8),
    ZooEntry("Transformer-big", 1024, 16),
    ZooEntry("BERT-base / GPT-2 small", 768, 12),
    ZooEntry("GPT-2 XL", 1600, 25),
    ZooEntry("LLaMA 7B", 4096, 32),
    ZooEntry("LLaMA 13B", 5120, 40),
    ZooEntry("LLaMA 33B", 6656, 52),
    ZooEntry("LLaMA 65B", 8192, 64),
    ZooEntry("LLaMA-2 70B", 8192, 64, 8),
    ZooEntry("LLaMA-3 8B", 4096, 32, 8),
    ZooEntry("GPT-3 175B", 12288, 96),
)


def _positive(name, value):
  if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 1:
    raise UserError(f"{name} must be a positive integer; got {value!r}")


def _kv_width(d_model: int, num_heads: int | None, num_kv_heads: int | None) -> int:
  """h_kv d_k, the width of W_K and W_V's output (D without GQA)."""
  if num_kv_heads is None:
    return d_model
  if num_heads is None:
    raise UserError("num_kv_heads needs num_heads (d_k = d_model / num_heads)")
  _positive("num_heads", num_heads)
  _positive("num_kv_heads", num_kv_heads)
  if d_model % num_heads:
    raise UserError(f"num_heads={num_heads} does not divide d_model={d_model}")
  if num_heads % num_kv_heads:
    raise UserError(f"num_kv_heads={num_kv_heads} does not divide num_heads={num_heads}")
  return num_kv_heads * (d_model // num_heads)


def _variant(name) -> variants.Variant:
  """The registry's entry, an unknown name refused as a UserError."""
  try:
    return variants.get(name)
  except ValueError as e:
    raise UserError(str(e)) from None


def variant_extra_params(variant: str, d_model: int, num_heads: int) -> int:
  """Params a variant adds to one layer: its registry entry's params at d_k = D / h."""
  return _variant(variant).param_count(d_model, num_heads, d_model // num_heads)


def attention_params(d_model: int, num_heads: int, *, use_bias: bool = False,
                     num_kv_heads: int | None = None, variant: str = "softmax") -> int:
  """Parameter count of one attention layer.

  4 D^2 (+ 4 D) for every h dividing D; with h_kv key/value heads (GQA)
  2 D^2 + 2 D h_kv d_k (+ 2 D + 2 h_kv d_k); plus variant_extra_params.
  """
  _positive("d_model", d_model)
  _positive("num_heads", num_heads)
  if d_model % num_heads:
    raise UserError(f"num_heads={num_heads} does not divide d_model={d_model}")
  kv = _kv_width(d_model, num_heads, num_kv_heads)
  return (2 * d_model * d_model + 2 * d_model * kv + (2 * d_model + 2 * kv if use_bias else 0)
          + variant_extra_params(variant, d_model, num_heads))


def attention_flops(d_model: int, seq_len: int, *, kv_len: int | None = None,
                    batch: int = 1, num_heads: int | None = None,
                    num_kv_heads: int | None = None,
                    variant: str = "softmax") -> dict[str, int]:
  """Matmul FLOPs of one forward pass (2 per multiply-add).

  Returns a dict with "projections" (Q and output: 2 T D^2 each; K and V: 2 S D^2
  each, or 2 S D h_kv d_k each with num_kv_heads), "scores" (2 T S D), "mixing"
  (2 T S D) and "total". Without GQA none depends on h; scores and mixing are per
  query head, so GQA changes only the K and V projections. variant: gated adds its
  gate's projection (2 T D^2), gated_head 2 T D h (needs num_heads); differential
  mixes values with two maps (mixing 4 T S D): the registry entry's flops and maps.
  """
  var = _variant(variant)
  _positive("d_model", d_model)
  _positive("seq_len", seq_len)
  _positive("batch", batch)
  s = seq_len if kv_len is None else kv_len
  _positive("kv_len", s)
  t, d = seq_len, d_model
  kv = _kv_width(d, num_heads, num_kv_heads)
  try:
    extra = var.flops(t, s, d, num_heads)
  except ValueError as e:   # e.g. a gate of D x h without num_heads
    raise UserError(str(e)) from None
  proj = batch * (4 * t * d * d + 4 * s * d * kv + extra)
  scores = batch * 2 * t * s * d
  mixing = batch * 2 * t * s * d * var.maps
  return {"projections": proj, "scores": scores, "mixing": mixing,
          "total": proj + scores + mixing}


def score_memory_bytes(batch: int, num_heads: int, seq_len: int, *,
                       kv_len: int | None = None, dtype=jnp.float32,
                       variant: str = "softmax") -> int:
  """Bytes of the (B, h, T, S) score (or weight) tensor: B h T S bytes-per-element;
  twice that for variant="differential" (two maps per head)."""
  for name, val in (("batch", batch), ("num_heads", num_heads), ("seq_len", seq_len)):
    _positive(name, val)
  maps = _variant(variant).maps
  s = seq_len if kv_len is None else kv_len
  return maps * batch * num_heads * seq_len * s * jnp.dtype(dtype).itemsize


def kv_cache_bytes(seq_len: int, num_kv_heads: int, head_dim: int, *, num_layers: int = 1,
                   batch: int = 1, dtype=jnp.float32) -> int:
  """Bytes of a decoder's KV cache: 2 L T h_kv d_k bytes-per-element per sequence.

  Matches attention.init_kv_cache(batch, seq_len, num_kv_heads, head_dim, dtype) per
  layer (its int32 length aside).
  """
  for name, val in (("seq_len", seq_len), ("num_kv_heads", num_kv_heads),
                    ("head_dim", head_dim), ("num_layers", num_layers), ("batch", batch)):
    _positive(name, val)
  return 2 * num_layers * batch * seq_len * num_kv_heads * head_dim * jnp.dtype(dtype).itemsize


def zoo_rows(seq_len: int = 2048, batch: int = 1) -> list[dict]:
  """One dict per zoo model: d_model, h, h_kv, d_k, params, FLOPs, score and KV-cache
  memory (float32, one layer) at seq_len."""
  rows = []
  for e in ZOO:
    rows.append({
        "model": e.name, "d_model": e.d_model, "heads": e.num_heads,
        "kv_heads": e.kv_heads, "d_k": e.head_dim,
        "params": attention_params(e.d_model, e.num_heads, num_kv_heads=e.kv_heads),
        "gflops": attention_flops(e.d_model, seq_len, batch=batch, num_heads=e.num_heads,
                                  num_kv_heads=e.kv_heads)["total"] / 1e9,
        "score_mib": score_memory_bytes(batch, e.num_heads, seq_len) / 2**20,
        "kv_cache_mib": kv_cache_bytes(seq_len, e.kv_heads, e.head_dim,
                                       batch=batch) / 2**20,
    })
  return rows


def format_zoo(seq_len: int = 2048, batch: int = 1) -> str:
  """The zoo as a text table."""
  head = (f"{'model':<24} {'d_model':>7} {'h':>3} {'h_kv':>4} {'d_k':>4} "
          f"{'params/layer':>13} {'GFLOP/layer':>11} {'scores MiB':>10} {'KV cache MiB':>12}")
  lines = [f"One self-attention layer, T={seq_len}, batch={batch}, float32 scores and KV "
           f"cache", head, "-" * len(head)]
  for r in zoo_rows(seq_len, batch):
    lines.append(f"{r['model']:<24} {r['d_model']:>7} {r['heads']:>3} {r['kv_heads']:>4} "
                 f"{r['d_k']:>4} {r['params']:>13,} {r['gflops']:>11.1f} "
                 f"{r['score_mib']:>10.0f} {r['kv_cache_mib']:>12.0f}")
  return "\n".join(lines)


def format_head_sweep(d_model: int, seq_len: int = 2048, batch: int = 1) -> str:
  """Every h dividing d_model at fixed width: params and FLOPs flat, d_k and scores move."""
  _positive("d_model", d_model)
  head = f"{'h':>5} {'d_k':>5} {'params':>13} {'GFLOP':>9} {'scores MiB':>10}"
  lines = [f"One self-attention layer at d_model={d_model}, T={seq_len}, batch={batch}",
           head, "-" * len(head)]
  flops = attention_flops(d_model, seq_len, batch=batch)["total"] / 1e9
  for h in [h for h in range(1, d_model + 1) if d_model % h == 0]:
    lines.append(f"{h:>5} {d_model // h:>5} {attention_params(d_model, h):>13,} "
                 f"{flops:>9.1f} {score_memory_bytes(batch, h, seq_len) / 2**20:>10.2f}")
  return "\n".join(lines)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ZooOptions:
  """The settings of `zoo`."""
  seq_len: int = setting(2048, lo=1, help="the sequence length T")
  batch: int = setting(1, lo=1, help="the batch size")
  d_model: int | None = setting(None, lo=1, help="instead of the zoo, every h dividing "
                                "this width")


def zoo(opts: ZooOptions = ZooOptions()) -> str:
  """`mha-jax zoo`: the zoo's table (or every h of `opts.d_model`) and what it shows."""
  if opts.d_model is not None:
    return (format_head_sweep(opts.d_model, seq_len=opts.seq_len, batch=opts.batch)
            + "\n\nAt d_k = 1 a query and a key are single numbers: a head can then only "
              "favour the key with the largest or the smallest k.")
  return (format_zoo(seq_len=opts.seq_len, batch=opts.batch)
          + "\n\nParams and FLOPs are the same for every h at a given d_model; the score "
            "tensor grows with h. Grouped-query attention (h_kv < h) shrinks W_K, W_V and "
            "the KV cache by h / h_kv.")
