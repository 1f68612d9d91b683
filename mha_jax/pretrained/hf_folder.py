"""A Hugging Face folder (config.json + model.safetensors + tokenizer.json) of the llama or
bert architecture -> mha-jax params, config and tokenizer.

HF linear weights are (out, in); the attention params here are (D, H, K) / (H, K, D).
HF LLaMA checkpoints keep RoPE in the half-split layout: no permutation to undo.
"""

from __future__ import annotations

import json
import os

import numpy as np


def _load_config(folder: str) -> dict:
  path = os.path.join(folder, "config.json")
  if not os.path.isfile(path):
    raise ValueError(f"--file {folder!r}: no config.json (expected the Hugging Face layout: "
                     f"config.json, model.safetensors, tokenizer.json)")
  try:
    with open(path) as f:
      return json.load(f)
  except (OSError, json.JSONDecodeError) as e:
    raise ValueError(f"--file {folder!r}: config.json cannot be read: {e}") from None


def load_safetensors(path: str) -> dict[str, np.ndarray]:
  from safetensors.numpy import load_file
  if not os.path.isfile(path):
    raise ValueError(f"--file {os.path.dirname(path)!r}: no {os.path.basename(path)}")
  try:
    return load_file(path)
  except Exception as e:  # noqa: BLE001 - SafetensorError and friends
    raise ValueError(f"--file {path!r} is not a readable safetensors file (corrupt or "
                     f"truncated?): {type(e).__name__}: {e}") from None


def architecture(cfg: dict) -> str:
  mt = cfg.get("model_type", "")
  archs = cfg.get("architectures") or []
  if mt == "llama" or any(a.startswith("Llama") for a in archs):
    return "llama"
  if mt == "bert" or any(a.startswith("Bert") for a in archs):
    return "bert"
  return mt or (archs[0] if archs else "unknown")


def read(folder: str):
  """(params, model config, tokenizers.Tokenizer, tokenizer config, info)."""
  from mha_jax.pretrained import tokenizer as tk
  cfg = _load_config(folder)
  arch = architecture(cfg)
  if arch not in ("llama", "bert"):
    raise ValueError(f"--file {folder!r}: config.json says model_type={cfg.get('model_type')!r}"
                     f" / architectures={cfg.get('architectures')}; only llama and bert are "
                     f"supported")
  weights = load_safetensors(os.path.join(folder, "model.safetensors"))
  where = os.path.join(folder, "model.safetensors")
  tok_path = os.path.join(folder, "tokenizer.json")
  if not os.path.isfile(tok_path):
    raise ValueError(f"--file {folder!r}: no tokenizer.json")
  if arch == "llama":
    params, mcfg = _llama(cfg, weights, where)
    tok = tk.from_tokenizer_json(tok_path)
    tok_cfg = dict(bos_id=int(cfg.get("bos_token_id") or -1),
                   eos_id=int(_first(cfg.get("eos_token_id"), -1)),
                   pad_id=int(cfg.get("pad_token_id") or -1), add_bos=False, chat_template="")
  else:
    params, mcfg = _bert(cfg, weights, where)
    max_seq = mcfg["max_len"]
    st = os.path.join(folder, "sentence_bert_config.json")
    if os.path.isfile(st):
      with open(st) as f:
        max_seq = int(json.load(f).get("max_seq_length", max_seq))
    tok = tk.from_tokenizer_json(tok_path, max_len=max_seq)
    tok_cfg = dict(pad_id=int(cfg.get("pad_token_id") or 0), max_seq_len=max_seq,
                   normalize=os.path.isdir(os.path.join(folder, "2_Normalize")) or
                   _lists_normalize(folder))
  return params, mcfg, tok, tok_cfg, dict(format="safetensors")


def _first(x, default):
  if isinstance(x, list):
    return x[0] if x else default
  return default if x is None else x


def _lists_normalize(folder: str) -> bool:
  path = os.path.join(folder, "modules.json")
  if not os.path.isfile(path):
    return False
  with open(path) as f:
    return any(m.get("type", "").endswith("Normalize") for m in json.load(f))


class _Take:
  def __init__(self, weights, where, prefixes=("",)):
    self.w, self.where = dict(weights), where
    self.prefixes = prefixes

  def __call__(self, name, shape=None):
    for p in self.prefixes:
      if p + name in self.w:
        x = np.asarray(self.w.pop(p + name), np.float32)
        if shape is not None and x.shape != tuple(shape):
          raise ValueError(f"{self.where}: tensor {p + name!r} has shape {x.shape}, "
                           f"expected {tuple(shape)}")
        return np.ascontiguousarray(x)
    raise ValueError(f"{self.where}: tensor {name!r} is missing")


def _llama(cfg, weights, where):
  d, h = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
  h_kv = int(cfg.get("num_key_value_heads") or h)
  k = int(cfg.get("head_dim") or d // h)
  f, n = int(cfg["intermediate_size"]), int(cfg["num_hidden_layers"])
  if cfg.get("rope_scaling"):
    raise ValueError(f"{where}: rope_scaling={cfg['rope_scaling']} is not supported")
  if cfg.get("hidden_act", "silu") != "silu":
    raise ValueError(f"{where}: hidden_act={cfg['hidden_act']!r}; llama needs 'silu'")
  if cfg.get("attention_bias") or cfg.get("mlp_bias"):
    raise ValueError(f"{where}: attention/MLP biases are not supported")
  take = _Take(weights, where, ("model.", ""))
  v = int(cfg["vocab_size"])
  layers = {}
  for i in range(n):
    b = f"layers.{i}."
    layers[f"layer_{i}"] = {
        "ln1": {"scale": take(b + "input_layernorm.weight", (d,))},
        "attn": {"wq": take(b + "self_attn.q_proj.weight", (h * k, d)).T.reshape(d, h, k),
                 "wk": take(b + "self_attn.k_proj.weight", (h_kv * k, d)).T.reshape(d, h_kv, k),
                 "wv": take(b + "self_attn.v_proj.weight", (h_kv * k, d)).T.reshape(d, h_kv, k),
                 "wo": take(b + "self_attn.o_proj.weight", (d, h * k)).T.reshape(h, k, d)},
        "ln2": {"scale": take(b + "post_attention_layernorm.weight", (d,))},
        "mlp": {"w_gate": take(b + "mlp.gate_proj.weight", (f, d)).T,
                "w_up": take(b + "mlp.up_proj.weight", (f, d)).T,
                "w_down": take(b + "mlp.down_proj.weight", (d, f)).T}}
  layers["ln_final"] = {"scale": take("norm.weight", (d,))}
  params = {"embed": take("embed_tokens.weight", (v, d)), "lm": layers}
  tied = bool(cfg.get("tie_word_embeddings", False))
  if "lm_head.weight" in take.w:
    head = take("lm_head.weight", (v, d))
    if not tied:
      params["unembed"] = np.ascontiguousarray(head.T)
  elif not tied:
    raise ValueError(f"{where}: tie_word_embeddings is false but lm_head.weight is missing")
  _no_leftovers(take, where, ignore=("rotary_emb.inv_freq",))
  mcfg = dict(family="llama", d_model=d, num_heads=h, num_kv_heads=h_kv, head_dim=k,
              num_layers=n, d_ff=f, vocab_size=v, norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
              rope_base=float(cfg.get("rope_theta", 10000.0)),
              max_len=int(cfg.get("max_position_embeddings", 2048)),
              tie_embeddings="unembed" not in params)
  return _f32(params), mcfg


def _bert(cfg, weights, where):
  d, h = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
  f, n = int(cfg["intermediate_size"]), int(cfg["num_hidden_layers"])
  k = d // h
  if cfg.get("hidden_act", "gelu") != "gelu":
    raise ValueError(f"{where}: hidden_act={cfg['hidden_act']!r}; only 'gelu' (exact) is "
                     f"supported")
  if cfg.get("position_embedding_type", "absolute") != "absolute":
    raise ValueError(f"{where}: position_embedding_type="
                     f"{cfg['position_embedding_type']!r}; only 'absolute' is supported")
  take = _Take(weights, where, ("", "bert."))
  v, p = int(cfg["vocab_size"]), int(cfg["max_position_embeddings"])

  def ln(prefix):
    return {"scale": take(prefix + ".weight", (d,)), "bias": take(prefix + ".bias", (d,))}

  layers = {}
  for i in range(n):
    b = f"encoder.layer.{i}."
    att = b + "attention."

    def qkv(name):
      return (take(att + f"self.{name}.weight", (d, d)).T.reshape(d, h, k),
              take(att + f"self.{name}.bias", (d,)).reshape(h, k))

    (wq, bq), (wk, bk), (wv, bv) = qkv("query"), qkv("key"), qkv("value")
    layers[f"layer_{i}"] = {
        "self_attn": {"wq": wq, "wk": wk, "wv": wv, "bq": bq, "bk": bk, "bv": bv,
                      "wo": take(att + "output.dense.weight", (d, d)).T.reshape(h, k, d),
                      "bo": take(att + "output.dense.bias", (d,))},
        "ln1": ln(att + "output.LayerNorm"),
        "mlp": {"w1": take(b + "intermediate.dense.weight", (f, d)).T,
                "b1": take(b + "intermediate.dense.bias", (f,)),
                "w2": take(b + "output.dense.weight", (d, f)).T,
                "b2": take(b + "output.dense.bias", (d,))},
        "ln2": ln(b + "output.LayerNorm")}
  t = int(cfg.get("type_vocab_size", 2))
  params = {"embed": take("embeddings.word_embeddings.weight", (v, d)),
            "pos_embed": take("embeddings.position_embeddings.weight", (p, d)),
            "type_embed": take("embeddings.token_type_embeddings.weight", (t, d)),
            "ln_embed": ln("embeddings.LayerNorm"), "encoder": layers}
  # Not part of the encoder's hidden states: the pooler (unused by sentence-transformers'
  # mean pooling), the position-id buffer, and any pretraining heads.
  _no_leftovers(take, where, ignore=("embeddings.position_ids", "pooler.", "cls."))
  mcfg = dict(family="bert", d_model=d, num_heads=h, head_dim=k, num_layers=n, d_ff=f,
              vocab_size=v, max_len=p, type_vocab_size=t,
              norm_eps=float(cfg.get("layer_norm_eps", 1e-12)))
  return _f32(params), mcfg


def _no_leftovers(take, where, ignore):
  left = [n for n in take.w if not any(i in n for i in ignore)]
  if left:
    raise ValueError(f"{where}: tensors this importer does not know: {sorted(left)[:5]}")


def _f32(tree):
  if isinstance(tree, dict):
    return {k: _f32(v) for k, v in tree.items()}
  return np.ascontiguousarray(tree, np.float32)
