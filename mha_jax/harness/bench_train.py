"""Training-step benchmark: the quickstart model's step, ours next to flax.linen's.

Both models are the same encoder-decoder (pre-LN, relative-position score bias per
head, GELU MLP, shared embedding tied to the output, label-smoothed cross-entropy) on
the same batch with the same optimizer (loop.make_optimizer); the flax.linen one is
built from nn.LayerNorm, nn.Dense and nn.MultiHeadDotProductAttention. Rounds are
interleaved in one process; we report medians, XLA's FLOP count of our step and the
rate against the machine's measured matmul rate.
"""

from __future__ import annotations

import dataclasses
import functools
import statistics
import time
from typing import Callable, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from mha_jax.errors import UserError
from mha_jax.machine import machine
from mha_jax.harness import bench
from mha_jax import tasks
from mha_jax.settings import setting
from mha_jax import config as mc
from mha_jax.data import vocab
from mha_jax.train import loop


class _LinenBlock(nn.Module):
  """One pre-LN block: self-attention with a learned relative bias, optional
  cross-attention, MLP."""
  num_heads: int
  d_ff: int
  max_rel: int
  cross: bool

  @nn.compact
  def __call__(self, x, enc=None, self_mask=None, cross_mask=None):
    t = x.shape[1]
    table = self.param("rel_bias", nn.initializers.zeros, (self.num_heads, 2 * self.max_rel + 1))
    off = np.clip(np.arange(t)[None, :] - np.arange(t)[:, None], -self.max_rel,
                  self.max_rel) + self.max_rel
    bias = table[:, off][None]
    attn_fn = functools.partial(nn.dot_product_attention, bias=bias)
    h = nn.LayerNorm(epsilon=1e-6)(x)
    x = x + nn.MultiHeadDotProductAttention(num_heads=self.num_heads, use_bias=False,
                                            attention_fn=attn_fn)(h, mask=self_mask)
    if self.cross:
      h = nn.LayerNorm(epsilon=1e-6)(x)
      x = x + nn.MultiHeadDotProductAttention(num_heads=self.num_heads, use_bias=False)(
          h, enc, mask=cross_mask)
    h = nn.LayerNorm(epsilon=1e-6)(x)
    h = nn.Dense(x.shape[-1])(nn.gelu(nn.Dense(self.d_ff)(h)))
    return x + h


class LinenSeq2Seq(nn.Module):
  """The quickstart encoder-decoder from flax.linen modules."""
  vocab_size: int
  d_model: int
  num_heads: int
  d_ff: int
  enc_layers: int
  dec_layers: int
  max_rel: int

  @nn.compact
  def __call__(self, src_BS, tgt_in_BT):
    embed = nn.Embed(self.vocab_size, self.d_model)
    scale = self.d_model ** 0.5
    src_mask = (src_BS != vocab.PAD_ID)[:, None, None, :]
    x = embed(src_BS) * scale
    for _ in range(self.enc_layers):
      x = _LinenBlock(self.num_heads, self.d_ff, self.max_rel, False)(x, self_mask=src_mask)
    enc = nn.LayerNorm(epsilon=1e-6)(x)
    y = embed(tgt_in_BT) * scale
    causal = nn.make_causal_mask(tgt_in_BT)
    for _ in range(self.dec_layers):
      y = _LinenBlock(self.num_heads, self.d_ff, self.max_rel, True)(
          y, enc, self_mask=causal, cross_mask=src_mask)
    return embed.attend(nn.LayerNorm(epsilon=1e-6)(y))


@dataclasses.dataclass(frozen=True, kw_only=True)
class BenchTrainOptions:
  """The settings of `bench train`."""
  rounds: int = setting(10, lo=1, help="timed rounds")
  warmup: int = setting(2, lo=0, help="untimed rounds first")
  matmul_size: int = setting(2048, lo=1, help="n of the n x n matmul that measures the "
                             "machine's rate")


def _smoothed_loss(logits, targets, smoothing):
  """The task's objective (tasks.token_losses) over non-pad targets."""
  mask = (targets != vocab.PAD_ID).astype(jnp.float32)
  obj = tasks.token_losses(logits, targets, smoothing)[1]
  return (obj * mask).sum() / jnp.maximum(mask.sum(), 1.0)


def build_steps(cfg, workdir: str) -> tuple[dict[str, tuple[Callable, list, dict]],
                                            dict[str, float]]:
  """name -> (compiled step, [params, opt_state], its batch), and name -> XLA's GFLOP count
  of our step on that batch (flax.linen: the padded batch's, the same maths).

  "mha_jax" and "flax.linen" take the same padded batch; "mha_jax packed" takes the
  same sentence pairs packed into rows as `train` packs them (data/packing.py)."""
  task = tasks.build(cfg, workdir)
  t = cfg.train
  optimizer = loop.make_optimizer(t)
  batch = {k: jnp.asarray(v) for k, v in task.train_batch(0, 0, 1).items()}

  def make(loss_fn, params):      # the flax.linen peer's step
    def step(params, opt_state, batch):
      obj, grads = jax.value_and_grad(loss_fn)(params, batch)
      updates, opt_state = optimizer.update(grads, opt_state, params)
      return optax.apply_updates(params, updates), opt_state, obj
    return jax.jit(step, donate_argnums=(0, 1)), [params, optimizer.init(params)], batch

  ours = task.init_params(jax.random.PRNGKey(cfg.seed))
  train_step = loop.make_train_step(task, optimizer, cfg)     # the step `train` runs
  key = jax.random.PRNGKey(cfg.seed)
  ours_fn = jax.jit(lambda p, o, b: train_step(p, o, b, jnp.int32(0), key),
                    donate_argnums=(0, 1))
  steps = {"mha_jax": (ours_fn, [ours, optimizer.init(ours)], batch)}
  m = cfg.model
  linen = LinenSeq2Seq(vocab_size=task.vocab_size, d_model=m.d_model,
                       num_heads=m.num_heads, d_ff=m.d_ff, enc_layers=m.enc_layers,
                       dec_layers=m.dec_layers, max_rel=m.max_rel)
  src, tgt = batch["src"], batch["tgt"]
  lp = linen.init(jax.random.PRNGKey(cfg.seed), src, tgt[:, :-1])
  steps["flax.linen"] = make(
      lambda p, b: _smoothed_loss(linen.apply(p, b["src"], b["tgt"][:, :-1]),
                                  b["tgt"][:, 1:], t.label_smoothing), lp)
  if t.get("pack", False):
    ladder = loop.packing_ladder([task], t, 1)[0]
    packed = {k: jnp.asarray(v) for k, v in loop.packed_batches([task], 0, ladder)[0].items()}
    steps["mha_jax packed"] = (ours_fn, [jax.tree.map(jnp.copy, ours),
                                         optimizer.init(ours)], packed)
  gflop = {}
  for name, (fn, state, b) in list(steps.items()):   # compiled once, timed as compiled
    compiled = fn.lower(*state, b).compile()
    steps[name] = (compiled, state, b)
    cost = compiled.cost_analysis()
    gflop[name] = float((cost if isinstance(cost, dict) else cost[0])["flops"]) / 1e9
  gflop["flax.linen"] = gflop["mha_jax"]
  return steps, gflop


def run_train_steps(config: str = "configs/translation.py:quickstart", overrides: Sequence[str] = (),
                    rounds: int = 10, warmup: int = 2, workdir: str = "workdirs/bench_train",
                    matmul_size: int = 2048, log: Callable[[str], None] = print) -> dict:
  """Times one training step of each model; returns the result dict."""
  cfg = mc.load_config(config)
  mc.apply_overrides(cfg, list(overrides))
  mc.validate(cfg)
  if cfg.task != "translation":
    raise UserError(f"--config must be a translation config (the quickstart model); got "
                     f"task {cfg.task!r}")
  steps, gflop = build_steps(cfg, workdir)
  log("measuring the matmul rate ...")
  rate = bench.matmul_gflops(matmul_size)

  def once(name):
    fn, state, batch = steps[name]
    t0 = time.perf_counter()
    state[0], state[1], obj = fn(state[0], state[1], batch)
    jax.block_until_ready(obj)
    return time.perf_counter() - t0

  for name in steps:
    for _ in range(warmup):
      once(name)
  times = {name: [] for name in steps}
  for _ in range(rounds):          # interleaved rounds
    for name in steps:
      times[name].append(once(name))
  rows = []
  for name, ts in times.items():
    ms = statistics.median(ts) * 1e3
    rows.append({"model": name, "step_ms": ms, "gflop": gflop[name],
                 "gflop_per_s": gflop[name] / (ms / 1e3),
                 "pct_matmul": 100 * gflop[name] / (ms / 1e3) / rate,
                 "batch_shapes": {k: list(v.shape) for k, v in steps[name][2].items()}})
  ref = next(r["step_ms"] for r in rows if r["model"] == "flax.linen")
  for r in rows:
    r["vs_flax_linen"] = r["step_ms"] / ref
  return {"config": config, "overrides": list(overrides), "rounds": rounds,
          "machine": machine(matmul_gflops=rate), "rows": rows}


def format_table(res: dict) -> str:
  lines = [f"{res['config']} {' '.join(res['overrides'])}: one training step (fwd + bwd + "
           f"AdamW), median of {res['rounds']} interleaved rounds; {res['machine']['backend']}, "
           f"matmul {res['machine']['matmul_gflops']:.1f} GFLOP/s",
           "", "| model | batch (src, tgt) | step ms | vs flax.linen | GFLOP (XLA, ours) | "
           "GFLOP/s | % matmul |", "|---|---|---:|---:|---:|---:|---:|"]
  for r in res["rows"]:
    shapes = r.get("batch_shapes", res.get("batch_shapes", {}))
    batch = ", ".join("x".join(map(str, shapes[k])) for k in ("src", "tgt") if k in shapes)
    lines.append(f"| {r['model']} | {batch} | {r['step_ms']:.1f} | {r['vs_flax_linen']:.2f} "
                 f"| {r['gflop']:.2f} | {r['gflop_per_s']:.1f} | {r['pct_matmul']:.1f} |")
  return "\n".join(lines)

