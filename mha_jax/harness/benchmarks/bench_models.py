"""Speed of a real model: SmolLM2-135M forward and greedy generation, mha-jax vs
transformers.

    mha-jax bench models [--workdir DIR] [--out results/bench_models.json]

Forward: tokens/s of one full forward (B x T tokens, logits at every position).
Generation: a prompt of T tokens, then N new tokens greedily with the KV cache; decode
tokens/s = B * (N - 1) / (time to generate N tokens - time to generate 1 token), so each
library's own prefill cancels out. The same numbers for the
same float32 weights run by `transformers`' LlamaForCausalLM (torch, CPU) when that is
installed (an optional extra, never a dependency). Medians over --rounds after a warm-up
(compilation excluded). float32 everywhere.
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import tempfile
import time

import numpy as np

from mha_jax.settings import setting


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelsOptions:
  """The settings of `bench models`."""
  workdir: str | None = setting(None, path=True, help="an imported Llama-family model "
                                "(default: import smollm2-135m into a temporary folder)")
  batches: tuple[int, ...] = setting((1, 8), lo=1, help="the batch sizes B")
  seq_lens: tuple[int, ...] = setting((128, 512), lo=1, help="the prompt lengths T")
  new_tokens: int = setting(32, lo=2, help="N, the tokens generated")
  rounds: int = setting(2, lo=1, help="timed rounds after a warm-up")
  transformers: bool = setting(True, help="also time transformers' LlamaForCausalLM "
                               "when it is installed")
  cores: int = setting(0, lo=0, help="pin the process to this many cores, torch threads "
                       "to match (0: all); on a shared machine 1 keeps OpenMP from "
                       "thrashing")
  out: str = setting("results/bench_models.json", path=True, help="the JSON file")


def _tokens(rng, vocab: int, b: int, t: int):
  """(b, t) token ids in [100, 40000), within the vocabulary (a small model's: from 0)."""
  lo = 100 if vocab > 40000 else 0
  return rng.integers(lo, min(40000, vocab), (b, t))


def _median_time(fn, rounds: int) -> float:
  fn()                                   # warm-up (compiles)
  times = []
  for _ in range(rounds):
    t0 = time.perf_counter()
    fn()
    times.append(time.perf_counter() - t0)
  return statistics.median(times)


def bench_mha_jax(loaded, b, t, new_tokens, rounds):
  import jax
  from mha_jax.models import llama
  model, params = loaded.task, loaded.params
  fwd = jax.jit(lambda p, t: llama.apply(p, model.spec, t))
  rng = np.random.default_rng(0)
  rows = []
  if True:
    tokens = jax.numpy.asarray(_tokens(rng, params["embed"].shape[0], b, t), jax.numpy.int32)
    t_fwd = _median_time(lambda: fwd(params, tokens).block_until_ready(), rounds)
    t_1, t_n = (_median_time(lambda n=n: llama.generate(params, model.spec, tokens, n), rounds)
                for n in (1, new_tokens))
    rows.append(_row("mha-jax", b, t, new_tokens, t_fwd, t_1, t_n))
    print(_fmt(rows[-1]), flush=True)
  return rows


def to_transformers(loaded):
  """transformers' LlamaForCausalLM holding the same float32 weights (HF layout)."""
  import torch
  from transformers import LlamaConfig, LlamaForCausalLM
  m, p = loaded.config.model, loaded.params
  cfg = LlamaConfig(vocab_size=m.vocab_size, hidden_size=m.d_model,
                    intermediate_size=m.d_ff, num_hidden_layers=m.num_layers,
                    num_attention_heads=m.num_heads, num_key_value_heads=m.num_kv_heads,
                    head_dim=m.head_dim, rms_norm_eps=m.norm_eps, rope_theta=m.rope_base,
                    max_position_embeddings=m.max_len, tie_word_embeddings=m.tie_embeddings,
                    torch_dtype="float32")
  model = LlamaForCausalLM(cfg).eval()
  d = m.d_model

  def t(x):
    return torch.from_numpy(np.array(x, np.float32))    # a writable copy

  sd = {"model.embed_tokens.weight": t(p["embed"]),
        "model.norm.weight": t(p["lm"]["ln_final"]["scale"])}
  for i in range(m.num_layers):
    L, pre = p["lm"][f"layer_{i}"], f"model.layers.{i}."
    a = L["attn"]
    sd.update({
        pre + "input_layernorm.weight": t(L["ln1"]["scale"]),
        pre + "post_attention_layernorm.weight": t(L["ln2"]["scale"]),
        pre + "self_attn.q_proj.weight": t(np.asarray(a["wq"]).reshape(d, -1).T),
        pre + "self_attn.k_proj.weight": t(np.asarray(a["wk"]).reshape(d, -1).T),
        pre + "self_attn.v_proj.weight": t(np.asarray(a["wv"]).reshape(d, -1).T),
        pre + "self_attn.o_proj.weight": t(np.asarray(a["wo"]).reshape(-1, d).T),
        pre + "mlp.gate_proj.weight": t(np.asarray(L["mlp"]["w_gate"]).T),
        pre + "mlp.up_proj.weight": t(np.asarray(L["mlp"]["w_up"]).T),
        pre + "mlp.down_proj.weight": t(np.asarray(L["mlp"]["w_down"]).T)})
  if "unembed" in p:
    sd["lm_head.weight"] = t(np.asarray(p["unembed"]).T)
  missing, unexpected = model.load_state_dict(sd, strict=False)
  if unexpected or [k for k in missing if k != "lm_head.weight"]:
    raise RuntimeError(f"state dict mismatch: missing {missing}, unexpected {unexpected}")
  if m.tie_embeddings:
    model.tie_weights()
  return model


def bench_transformers(model, b, t, new_tokens, rounds):
  import torch
  rng = np.random.default_rng(0)
  rows = []
  if True:
    tokens = torch.from_numpy(_tokens(rng, model.config.vocab_size, b, t))
    with torch.inference_mode():
      t_fwd = _median_time(lambda: model(tokens, use_cache=False).logits, rounds)
      t_1, t_n = (_median_time(lambda n=n: model.generate(
          tokens, attention_mask=torch.ones_like(tokens), max_new_tokens=n,
          min_new_tokens=n, do_sample=False, pad_token_id=2), rounds)
          for n in (1, new_tokens))
    rows.append(_row("transformers", b, t, new_tokens, t_fwd, t_1, t_n))
    print(_fmt(rows[-1]), flush=True)
  return rows


def _row(impl, b, t, n, t_fwd, t_1, t_n):
  return dict(impl=impl, batch=b, seq_len=t, forward_s=t_fwd, forward_tok_s=b * t / t_fwd,
              generate_1_s=t_1, generate_n_s=t_n,
              decode_tok_s=b * (n - 1) / max(t_n - t_1, 1e-9))


def logit_agreement(loaded, hf_model, text="The capital of France is Paris, and"):
  """max |mha-jax - transformers| / max |transformers| of the logits on one prompt."""
  import torch
  ids = loaded.task.tokenizer.encode(text)
  ours = np.asarray(loaded.task.logits(loaded.params, ids[None]))[0]
  with torch.inference_mode():
    theirs = hf_model(torch.from_numpy(ids[None].astype(np.int64))).logits[0].numpy()
  return float(np.abs(ours - theirs).max() / np.abs(theirs).max())


def _fmt(r):
  return (f"{r['impl']:>12}  B={r['batch']:<2} T={r['seq_len']:<4}  forward "
          f"{r['forward_tok_s']:9.0f} tok/s  decode {r['decode_tok_s']:7.1f} tok/s")


def table(rows) -> str:
  by = {(r["batch"], r["seq_len"], r["impl"]): r for r in rows}
  out = ["| B | T | forward tok/s mha-jax | transformers | ratio | decode tok/s mha-jax | "
         "transformers | ratio |", "|---|---|---|---|---|---|---|---|"]
  for b, t in sorted({(r["batch"], r["seq_len"]) for r in rows}):
    ours, hf = by.get((b, t, "mha-jax")), by.get((b, t, "transformers"))
    cells = [str(b), str(t)]
    for key in ("forward_tok_s", "decode_tok_s"):
      cells.append(f"{ours[key]:.0f}" if ours else "-")
      cells.append(f"{hf[key]:.0f}" if hf else "-")
      cells.append(f"{ours[key] / hf[key]:.2f}x" if ours and hf else "-")
    out.append("| " + " | ".join(cells) + " |")
  return "\n".join(out)


def _write(out, rows, args, extra) -> dict:
  from mha_jax.machine import machine     # cores_used: the cores main pinned
  result = {"model": "smollm2-135m (SmolLM2-135M-Instruct Q4_1 GGUF, dequantized to f32)",
            "new_tokens": args.new_tokens, "rounds": args.rounds, "rows": rows,
            "machine": machine(), **extra}
  os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
  with open(out, "w") as f:
    json.dump(result, f, indent=1)
  return result


def run(args: ModelsOptions) -> int:
  cores = sorted(os.sched_getaffinity(0))
  if args.cores:                     # before JAX starts its thread pool
    cores = cores[:args.cores]
    os.sched_setaffinity(0, set(cores))
  import jax  # noqa: F401 - JAX's CPU backend starts after the cores are pinned
  import mha_jax
  from mha_jax.pretrained import importer
  shapes = [(b, t) for b in args.batches for t in args.seq_lens]
  tmp = None
  workdir = args.workdir
  if workdir is None:
    tmp = tempfile.TemporaryDirectory()
    workdir = os.path.join(tmp.name, "smollm2")
    importer.import_model(workdir, name="smollm2-135m")
  loaded = mha_jax.load(workdir)
  extra, hf_model = {}, None
  if args.transformers:
    try:
      import torch
      import transformers
    except ImportError:
      print("transformers/torch not installed: mha-jax only")
    else:
      torch.set_num_threads(len(cores))
      hf_model = to_transformers(loaded)
      extra = {"transformers": transformers.__version__, "torch": torch.__version__,
               "torch_threads": torch.get_num_threads(),
               "logits_rel_err_vs_transformers": logit_agreement(loaded, hf_model)}
  rows = []
  for b, t in shapes:          # the two libraries alternate, so both see the same load
    rows += bench_mha_jax(loaded, b, t, args.new_tokens, args.rounds)
    if hf_model is not None:
      rows += bench_transformers(hf_model, b, t, args.new_tokens, args.rounds)
    _write(args.out, rows, args, extra)     # after every shape: a partial run keeps its rows
  _write(args.out, rows, args, extra)
  print()
  print(table(rows))
  if "logits_rel_err_vs_transformers" in extra:
    print(f"\nlogits vs transformers: max relative difference "
          f"{extra['logits_rel_err_vs_transformers']:.2e}")
  print(f"wrote {args.out}")
  if tmp:
    tmp.cleanup()
  return 0
