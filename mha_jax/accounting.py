"""What one attention layer costs, and how that depends (or not) on the head count h.

For self-attention over T tokens of width D with h heads of width d_k = D / h:
  params  = 4 D^2 weights (+ 4 D biases)         independent of h
  FLOPs   = 8 T D^2 (projections) + 4 T^2 D      independent of h (per sequence)
  scores  = B h T^2 numbers                      grows with h
FLOPs count a multiply-add as 2. Softmax adds a few elementwise operations per score,
so XLA's own count sits a few percent above the matmul FLOPs and grows with h.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from mha_jax.errors import UserError


@dataclasses.dataclass(frozen=True)
class ZooEntry:
  name: str
  d_model: int
  num_heads: int

  @property
  def head_dim(self) -> int:
    return self.d_model // self.num_heads


# Published widths and head counts. d_k = d_model / h.
ZOO = (
    ZooEntry("Transformer-base", 512, 8),
    ZooEntry("Transformer-big", 1024, 16),
    ZooEntry("BERT-base / GPT-2 small", 768, 12),
    ZooEntry("GPT-2 XL", 1600, 25),
    ZooEntry("LLaMA 7B", 4096, 32),
    ZooEntry("LLaMA 13B", 5120, 40),
    ZooEntry("LLaMA 33B", 6656, 52),
    ZooEntry("LLaMA 65B", 8192, 64),
    ZooEntry("GPT-3 175B", 12288, 96),
)


def _positive(name, value):
  if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 1:
    raise UserError(f"{name} must be a positive integer; got {value!r}")


def attention_params(d_model: int, num_heads: int, *, use_bias: bool = False) -> int:
  """Parameter count of one attention layer: 4 D^2 (+ 4 D), for every h dividing D."""
  _positive("d_model", d_model)
  _positive("num_heads", num_heads)
  if d_model % num_heads:
    raise UserError(f"num_heads={num_heads} does not divide d_model={d_model}")
  return 4 * d_model * d_model + (4 * d_model if use_bias else 0)


def attention_flops(d_model: int, seq_len: int, *, kv_len: int | None = None,
                    batch: int = 1) -> dict[str, int]:
  """Matmul FLOPs of one forward pass (2 per multiply-add).

  Returns a dict with "projections" (Q and output: 2 T D^2 each; K and V: 2 S D^2
  each), "scores" (2 T S D), "mixing" (2 T S D) and "total". None depends on h.
  """
  _positive("d_model", d_model)
  _positive("seq_len", seq_len)
  _positive("batch", batch)
  s = seq_len if kv_len is None else kv_len
  _positive("kv_len", s)
  t, d = seq_len, d_model
  proj = batch * (4 * t * d * d + 4 * s * d * d)
  scores = batch * 2 * t * s * d
  mixing = batch * 2 * t * s * d
  return {"projections": proj, "scores": scores, "mixing": mixing,
          "total": proj + scores + mixing}


def score_memory_bytes(batch: int, num_heads: int, seq_len: int, *,
                       kv_len: int | None = None, dtype=jnp.float32) -> int:
  """Bytes of the (B, h, T, S) score (or weight) tensor: B h T S bytes-per-element."""
  for name, val in (("batch", batch), ("num_heads", num_heads), ("seq_len", seq_len)):
    _positive(name, val)
  s = seq_len if kv_len is None else kv_len
  return batch * num_heads * seq_len * s * jnp.dtype(dtype).itemsize


def zoo_rows(seq_len: int = 2048, batch: int = 1) -> list[dict]:
  """One dict per zoo model: d_model, h, d_k, params, FLOPs and score memory at seq_len."""
  rows = []
  for e in ZOO:
    rows.append({
        "model": e.name, "d_model": e.d_model, "heads": e.num_heads, "d_k": e.head_dim,
        "params": attention_params(e.d_model, e.num_heads),
        "gflops": attention_flops(e.d_model, seq_len, batch=batch)["total"] / 1e9,
        "score_mib": score_memory_bytes(batch, e.num_heads, seq_len) / 2**20,
    })
  return rows


def format_zoo(seq_len: int = 2048, batch: int = 1) -> str:
  """The zoo as a text table."""
  head = (f"{'model':<24} {'d_model':>7} {'h':>3} {'d_k':>4} {'params/layer':>13} "
          f"{'GFLOP/layer':>11} {'scores MiB':>10}")
  lines = [f"One self-attention layer, T={seq_len}, batch={batch}, float32 scores", head,
           "-" * len(head)]
  for r in zoo_rows(seq_len, batch):
    lines.append(f"{r['model']:<24} {r['d_model']:>7} {r['heads']:>3} {r['d_k']:>4} "
                 f"{r['params']:>13,} {r['gflops']:>11.1f} {r['score_mib']:>10.0f}")
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
