"""A LLaMA-architecture GGUF file -> mha-jax llama params, config and tokenizer.

Tensors are dequantized with `gguf` (F32, F16, BF16, Q4_0, Q4_1, Q8_0, ... whatever
gguf.quants can dequantize). GGUF stores a linear layer as (out, in), like torch.
llama.cpp's converter permutes the rows of Q and K within each head, turning Hugging
Face's half-split RoPE layout (pairs (j, j + K/2)) into its own interleaved one (pairs
(2j, 2j + 1)): rows (h, half, j) are stored as (h, j, half). `unpermute_rope_rows` undoes
that, so the model applies RoPE in the half-split layout.
"""

from __future__ import annotations

import os

import numpy as np

SUPPORTED_ARCH = ("llama",)


def unpermute_rope_rows(w_OI: np.ndarray, num_heads: int) -> np.ndarray:
  """Inverse of the converter's permutation of Q/K rows: (H, K/2, 2, in) -> (H, 2, K/2, in)."""
  out, inp = w_OI.shape
  k = out // num_heads
  return w_OI.reshape(num_heads, k // 2, 2, inp).swapaxes(1, 2).reshape(out, inp)


def _field(reader, key, default=None, *, path, required=False):
  f = reader.fields.get(key)
  if f is None:
    if required:
      raise ValueError(f"--file {path!r}: GGUF metadata has no {key!r}")
    return default
  return f.contents()


def open_reader(path: str):
  import gguf
  if not os.path.isfile(path):
    raise ValueError(f"--file {path!r}: no such file")
  try:
    return gguf.GGUFReader(path, "r")
  except Exception as e:  # noqa: BLE001 - gguf raises ValueError, IndexError, struct errors...
    raise ValueError(f"--file {path!r} is not a readable GGUF file (corrupt or truncated?): "
                     f"{type(e).__name__}: {e}") from None


def read(path: str):
  """(params as float32 NumPy, model config dict, tokenizers.Tokenizer, info dict)."""
  import gguf
  from mha_jax.pretrained import tokenizer as tk
  reader = open_reader(path)
  arch = _field(reader, "general.architecture", path=path, required=True)
  if arch not in SUPPORTED_ARCH:
    raise ValueError(f"--file {path!r}: general.architecture is {arch!r}; only "
                     f"{SUPPORTED_ARCH} GGUF files are supported")

  def meta(key, default=None, required=True):
    return _field(reader, f"{arch}.{key}", default, path=path,
                  required=required and default is None)

  d = int(meta("embedding_length"))
  h = int(meta("attention.head_count"))
  h_kv = int(meta("attention.head_count_kv", h))
  k = int(meta("attention.key_length", d // h))
  rot = int(meta("rope.dimension_count", k))
  scaling = _field(reader, f"{arch}.rope.scaling.type", None, path=path)
  if rot != k or (scaling not in (None, "none")):
    raise ValueError(f"--file {path!r}: partial or scaled RoPE (rope.dimension_count={rot}, "
                     f"head width {k}, rope.scaling.type={scaling!r}) is not supported")
  n_layers = int(meta("block_count"))
  cfg = dict(family="llama", d_model=d, num_heads=h, num_kv_heads=h_kv, head_dim=k,
             num_layers=n_layers, d_ff=int(meta("feed_forward_length")),
             norm_eps=float(meta("attention.layer_norm_rms_epsilon")),
             rope_base=float(meta("rope.freq_base", 10000.0)),
             max_len=int(meta("context_length", 2048)))

  qtypes: dict[str, int] = {}
  tensors = {}
  for t in reader.tensors:
    try:
      w = np.asarray(gguf.quants.dequantize(np.asarray(t.data), t.tensor_type), np.float32)
    except Exception as e:  # noqa: BLE001
      raise ValueError(f"--file {path!r}: tensor {t.name!r} of type {t.tensor_type.name} "
                       f"cannot be dequantized: {e}") from None
    expect = tuple(int(n) for n in reversed(t.shape))
    if w.shape != expect:
      raise ValueError(f"--file {path!r}: tensor {t.name!r} has {w.shape} values, header "
                       f"says {expect} (truncated file?)")
    tensors[t.name] = w
    qtypes[t.tensor_type.name] = qtypes.get(t.tensor_type.name, 0) + 1

  def take(name):
    if name not in tensors:
      raise ValueError(f"--file {path!r}: tensor {name!r} is missing")
    return tensors.pop(name)

  def linear(name, out, inp):
    w = take(name)
    if w.shape != (out, inp):
      raise ValueError(f"--file {path!r}: tensor {name!r} has shape {w.shape}, expected "
                       f"{(out, inp)} (out, in)")
    return w

  embed = take("token_embd.weight")
  v = embed.shape[0]
  cfg["vocab_size"] = v
  layers = {}
  for i in range(n_layers):
    b = f"blk.{i}."
    wq = unpermute_rope_rows(linear(b + "attn_q.weight", h * k, d), h)
    wk = unpermute_rope_rows(linear(b + "attn_k.weight", h_kv * k, d), h_kv)
    wv = linear(b + "attn_v.weight", h_kv * k, d)
    wo = linear(b + "attn_output.weight", d, h * k)
    layers[f"layer_{i}"] = {
        "ln1": {"scale": take(b + "attn_norm.weight")},
        "attn": {"wq": wq.T.reshape(d, h, k), "wk": wk.T.reshape(d, h_kv, k),
                 "wv": wv.T.reshape(d, h_kv, k), "wo": wo.T.reshape(h, k, d)},
        "ln2": {"scale": take(b + "ffn_norm.weight")},
        "mlp": {"w_gate": linear(b + "ffn_gate.weight", cfg["d_ff"], d).T,
                "w_up": linear(b + "ffn_up.weight", cfg["d_ff"], d).T,
                "w_down": linear(b + "ffn_down.weight", d, cfg["d_ff"]).T}}
  layers["ln_final"] = {"scale": take("output_norm.weight")}
  params = {"embed": embed, "lm": layers}
  if "output.weight" in tensors:
    params["unembed"] = linear("output.weight", v, d).T
  cfg["tie_embeddings"] = "unembed" not in params
  if tensors:
    raise ValueError(f"--file {path!r}: tensors this importer does not know: "
                     f"{sorted(tensors)[:5]} (biases, RoPE frequency tables?)")
  params = _contiguous(params)

  tokens = _field(reader, "tokenizer.ggml.tokens", path=path, required=True)
  model = _field(reader, "tokenizer.ggml.model", path=path, required=True)
  if model != "gpt2":
    raise ValueError(f"--file {path!r}: tokenizer.ggml.model={model!r}; only byte-level BPE "
                     f"('gpt2') tokenizers are supported")
  tok = tk.from_gguf_vocab(tokens, _field(reader, "tokenizer.ggml.merges", [], path=path),
                           _field(reader, "tokenizer.ggml.token_type", None, path=path),
                           _field(reader, "tokenizer.ggml.pre", "default", path=path),
                           f"--file {path!r}")
  if len(tokens) != v:
    raise ValueError(f"--file {path!r}: {len(tokens)} tokens but the embedding has {v} rows")

  def tid(key):
    x = _field(reader, f"tokenizer.ggml.{key}", None, path=path)
    return -1 if x is None else int(x)

  tok_cfg = dict(bos_id=tid("bos_token_id"), eos_id=tid("eos_token_id"),
                 pad_id=tid("padding_token_id"),
                 add_bos=bool(_field(reader, "tokenizer.ggml.add_bos_token", False, path=path)),
                 chat_template=str(_field(reader, "tokenizer.chat_template", "", path=path)))
  info = dict(format="gguf", name=str(_field(reader, "general.name", "", path=path)),
              tensor_types=qtypes)
  return params, cfg, tok, tok_cfg, info


def _contiguous(tree):
  if isinstance(tree, dict):
    return {k: _contiguous(v) for k, v in tree.items()}
  return np.ascontiguousarray(tree, np.float32)


