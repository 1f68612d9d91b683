"""A GGUF file (llama, qwen2, qwen3, gemma3 architectures) -> mha-jax decoder params,
config and tokenizer.

Tensors are dequantized with `gguf` (F32, F16, BF16, Q4_0, Q4_1, Q8_0, ... whatever
gguf.quants can dequantize). GGUF stores a linear layer as (out, in), like torch.
llama.cpp's converter permutes the rows of Q and K within each head, turning Hugging
Face's half-split RoPE layout (pairs (j, j + K/2)) into its own interleaved one (pairs
(2j, 2j + 1)): rows (h, half, j) are stored as (h, j, half). `unpermute_rope_rows` undoes
that, so the model applies RoPE in the half-split layout.
"""

from __future__ import annotations

import dataclasses
import os

import numpy as np

from mha_jax.errors import UserError



def unpermute_rope_rows(w_OI: np.ndarray, num_heads: int) -> np.ndarray:
  """Inverse of the converter's permutation of Q/K rows: (H, K/2, 2, in) -> (H, 2, K/2, in)."""
  out, inp = w_OI.shape
  k = out // num_heads
  return w_OI.reshape(num_heads, k // 2, 2, inp).swapaxes(1, 2).reshape(out, inp)


def _field(reader, key, default=None, *, path, required=False):
  f = reader.fields.get(key)
  if f is None:
    if required:
      raise UserError(f"--file {path!r}: GGUF metadata has no {key!r}")
    return default
  return f.contents()


def open_reader(path: str):
  import gguf
  if not os.path.isfile(path):
    raise UserError(f"--file {path!r}: no such file")
  try:
    return gguf.GGUFReader(path, "r")
  except Exception as e:  # noqa: BLE001 - gguf raises ValueError, IndexError, struct errors...
    raise UserError(f"--file {path!r} is not a readable GGUF file (corrupt or truncated?): "
                     f"{type(e).__name__}: {e}") from None


# llama.cpp's tensor names per architecture -> (param path, kind) of the decoder layout.
# kinds: as adapters.py ("vec", "lin", "q", "kv", "o", "bq", "bkv", "head_norm"); "q*"
# and "kv*" are Q and K rows that llama.cpp's converter permuted (llama only).
_NORMS = (("attn_norm.weight", "vec", "ln1.scale"), ("ffn_norm.weight", "vec", "ln2.scale"))
_QKVO = (("attn_q.weight", "q", "attn.wq"), ("attn_k.weight", "kv", "attn.wk"),
         ("attn_v.weight", "kv", "attn.wv"), ("attn_output.weight", "o", "attn.wo"))
_QK_NORM = (("attn_q_norm.weight", "head_norm", "attn.q_norm"),
            ("attn_k_norm.weight", "head_norm", "attn.k_norm"))
_MLP = (("ffn_gate.weight", "lin", "mlp.w_gate"), ("ffn_up.weight", "lin", "mlp.w_up"),
        ("ffn_down.weight", "lin", "mlp.w_down"))
_GGUF_LAYER = {
    "llama": _NORMS + (("attn_q.weight", "q*", "attn.wq"), ("attn_k.weight", "kv*", "attn.wk"))
             + _QKVO[2:] + _MLP,
    "qwen2": _NORMS + _QKVO + (("attn_q.bias", "bq", "attn.bq"), ("attn_k.bias", "bkv", "attn.bk"),
                               ("attn_v.bias", "bkv", "attn.bv")) + _MLP,
    "qwen3": _NORMS + _QKVO + _QK_NORM + _MLP,
    # Gemma 3: llama.cpp stores the norms as 1 + w already; no Q/K permutation.
    "gemma3": (("attn_norm.weight", "vec", "ln1.scale"),
               ("post_attention_norm.weight", "vec", "ln1_post.scale"),
               ("ffn_norm.weight", "vec", "ln2.scale"),
               ("post_ffw_norm.weight", "vec", "ln2_post.scale")) + _QKVO + _QK_NORM + _MLP,
}
SUPPORTED_ARCH = tuple(_GGUF_LAYER)
# Metadata keys read per architecture (besides general.* and tokenizer.*); any other
# "{arch}.*" key is refused by name.
_GGUF_KEYS = ("context_length", "embedding_length", "block_count", "feed_forward_length",
              "attention.head_count", "attention.head_count_kv", "attention.key_length",
              "attention.value_length", "attention.layer_norm_rms_epsilon",
              "rope.freq_base", "rope.dimension_count", "rope.scaling.type",
              "rope.scaling.factor", "attention.sliding_window", "vocab_size",
              "rope.scaling.original_context_length", "rope.scaling.finetuned")


def read(path: str, dtype: str = "float32", place=None):
  """(params as NumPy, model config dict, tokenizers.Tokenizer, tokenizer config, info).
  place: adapters.build_params's (each tensor placed as it is converted).

  Architectures: llama (SmolLM2, Llama 3, Mistral's GGUFs), qwen2, qwen3, gemma3."""
  import gguf
  from mha_jax.pretrained import adapters, hf_folder
  from mha_jax.pretrained import tokenizer as tk
  reader = open_reader(path)
  arch = _field(reader, "general.architecture", path=path, required=True)
  if arch not in SUPPORTED_ARCH:
    raise UserError(f"--file {path!r}: general.architecture is {arch!r}; only "
                     f"{SUPPORTED_ARCH} GGUF files are supported")
  for key in reader.fields:
    if key.startswith(arch + ".") and key[len(arch) + 1:] not in _GGUF_KEYS:
      raise UserError(f"--file {path!r}: GGUF metadata key {key!r} "
                       f"(= {_field(reader, key, path=path)!r}) is not implemented for "
                       f"{arch}; refused rather than ignored")

  def meta(key, default=None, required=True):
    return _field(reader, f"{arch}.{key}", default, path=path,
                  required=required and default is None)

  d = int(meta("embedding_length"))
  h = int(meta("attention.head_count"))
  h_kv = int(meta("attention.head_count_kv", h))
  k = int(meta("attention.key_length", d // h))
  if int(meta("attention.value_length", k)) != k:
    raise UserError(f"--file {path!r}: attention.value_length differs from key_length {k}")
  rot = int(meta("rope.dimension_count", k))
  scaling = _field(reader, f"{arch}.rope.scaling.type", None, path=path)
  n_layers = int(meta("block_count"))
  base = float(meta("rope.freq_base", 1e6 if arch == "gemma3" else 10000.0))
  rope = {"type": "default", "base": base, "dim": rot}
  if scaling == "linear":
    rope = dict(rope, type="linear", factor=float(meta("rope.scaling.factor")))
  elif scaling not in (None, "none"):
    raise UserError(f"--file {path!r}: {arch}.rope.scaling.type={scaling!r} is not "
                     f"implemented (linear is)")
  if rot % 2 or rot > k:
    raise UserError(f"--file {path!r}: rope.dimension_count={rot} with head width {k}")
  s = dict(d=d, h=h, g=h_kv, k=k, n=n_layers, f=int(meta("feed_forward_length")),
           eps=float(meta("attention.layer_norm_rms_epsilon")),
           max_len=int(meta("context_length", 2048)), act="silu", tied=True)
  window = meta("attention.sliding_window", 0)
  if arch == "gemma3":
    # llama.cpp's Gemma 3: every 6th layer global (base rope.freq_base, scaling), the
    # others local with a sliding window and base 10000; scores scaled by 1 / sqrt(K);
    # embeddings by sqrt(D); GELU (tanh).
    s["layer_types"] = ["sliding_attention" if (i + 1) % 6 else "full_attention"
                        for i in range(n_layers)]
    s["window"] = int(window)
    s["rope"] = {"full_attention": rope,
                 "sliding_attention": {"type": "default", "base": 10000.0, "dim": rot}}
    s.update(act="gelu_tanh", scale=k ** -0.5, embed_scale=float(np.float32(d ** 0.5)))
  else:
    if window:
      raise UserError(f"--file {path!r}: {arch}.attention.sliding_window={window} is not "
                       f"implemented for {arch} GGUF files")
    s["layer_types"], s["window"] = ["full_attention"] * n_layers, None
    s["rope"] = {"full_attention": rope}
  np_dtype = hf_folder._np_dtype(dtype)

  qtypes: dict[str, int] = {}
  by_name = {t.name: t for t in reader.tensors}

  def get(name):
    t = by_name[name]
    try:
      w = _dequantize_rows(gguf, t)
    except Exception as e:  # noqa: BLE001
      raise UserError(f"--file {path!r}: tensor {name!r} of type {t.tensor_type.name} "
                       f"cannot be dequantized: {e}") from None
    expect = tuple(int(n) for n in reversed(t.shape))
    if w.shape != expect:
      raise UserError(f"--file {path!r}: tensor {name!r} has {w.shape} values, header "
                       f"says {expect} (truncated file?)")
    qtypes[t.tensor_type.name] = qtypes.get(t.tensor_type.name, 0) + 1
    if name.endswith("attn_q.weight") and arch == "llama":
      w = unpermute_rope_rows(w, h)
    elif name.endswith("attn_k.weight") and arch == "llama":
      w = unpermute_rope_rows(w, h_kv)
    return w

  embed_t = by_name.get("token_embd.weight")
  if embed_t is None:
    raise UserError(f"--file {path!r}: tensor 'token_embd.weight' is missing")
  s["v"] = int(embed_t.shape[1])
  s["tied"] = "output.weight" not in by_name
  layer_rows = tuple((n, kind.rstrip("*"), target, None) for n, kind, target in _GGUF_LAYER[arch])
  fam = adapters.Family(arch, (), {}, (("token_embd.weight", "vec", "embed", None),
                                       ("output_norm.weight", "vec", "lm.ln_final.scale", None),
                                       ("output.weight", "lin", "unembed", "untied")),
                        layer_rows, prefixes=("",), layer_prefix="blk.{i}.", ignore_tensors=())
  t = adapters.Tensors(get, list(by_name), f"--file {path!r}", ("",), np_dtype)
  params = adapters.build_params(fam, s, t, np_dtype, place=place)
  family = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma3": "gemma3"}[arch]
  cfg = adapters.model_config(s, dataclasses.replace(fam, name=family))

  tokens = _field(reader, "tokenizer.ggml.tokens", path=path, required=True)
  model = _field(reader, "tokenizer.ggml.model", path=path, required=True)
  types = _field(reader, "tokenizer.ggml.token_type", None, path=path)
  if model == "gpt2":
    tok = tk.from_gguf_vocab(tokens, _field(reader, "tokenizer.ggml.merges", [], path=path),
                             types, _field(reader, "tokenizer.ggml.pre", "default", path=path),
                             f"--file {path!r}")
  elif model == "llama" and arch == "gemma3":
    tok = tk.from_gguf_gemma(tokens, types, f"--file {path!r}")
  else:
    raise UserError(f"--file {path!r}: tokenizer.ggml.model={model!r} is not supported for "
                     f"{arch} (byte-level BPE 'gpt2', or Gemma's SentencePiece 'llama')")
  if len(tokens) != s["v"]:
    raise UserError(f"--file {path!r}: {len(tokens)} tokens but the embedding has "
                     f"{s['v']} rows")

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


def _dequantize_rows(gguf, t, rows_per_chunk: int = 8192) -> np.ndarray:
  """A tensor dequantized to float32 a block of rows at a time into one output array: the
  library's temporaries stay the size of a block, not of the tensor (a 262,144-row
  embedding would otherwise peak at several copies of itself)."""
  data = np.asarray(t.data)
  if data.ndim < 2 or data.shape[0] <= rows_per_chunk:
    return np.asarray(gguf.quants.dequantize(data, t.tensor_type), np.float32)
  first = np.asarray(gguf.quants.dequantize(data[:rows_per_chunk], t.tensor_type), np.float32)
  out = np.empty((data.shape[0],) + first.shape[1:], np.float32)
  out[:rows_per_chunk] = first
  for a in range(rows_per_chunk, data.shape[0], rows_per_chunk):
    out[a:a + rows_per_chunk] = gguf.quants.dequantize(data[a:a + rows_per_chunk],
                                                       t.tensor_type)
  return out


def _contiguous(tree):
  if isinstance(tree, dict):
    return {k: _contiguous(v) for k, v in tree.items()}
  return np.ascontiguousarray(tree, np.float32)


