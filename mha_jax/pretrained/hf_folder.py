"""A Hugging Face folder (config.json + model.safetensors or shards with
model.safetensors.index.json + tokenizer.json) of a decoder family
(mha_jax/pretrained/adapters.py) or bert -> mha-jax params, config and tokenizer.

HF linear weights are (out, in); the attention params here are (D, H, K) / (H, K, D).
HF LLaMA checkpoints keep RoPE in the half-split layout: no permutation to undo.
"""

from __future__ import annotations

import json
import os

import numpy as np

from mha_jax.errors import UserError
from mha_jax.pretrained import adapters
from mha_jax.pretrained.adapters import check_size


def _load_config(folder: str) -> dict:
  path = os.path.join(folder, "config.json")
  if not os.path.isfile(path):
    raise UserError(f"file {folder!r}: no config.json (expected the Hugging Face layout: "
                     f"config.json, model.safetensors, tokenizer.json)", setting="file")
  return read_json(path, dict)


def read_json(path: str, kind: type = dict):
  """A JSON file of the folder that must hold a `kind` (dict or list); one UserError
  naming it when it cannot be read, is not UTF-8 JSON or holds something else."""
  try:
    with open(path, encoding="utf-8") as f:
      out = json.load(f)
  except (OSError, ValueError, RecursionError) as e:   # JSONDecodeError, UnicodeDecodeError
    raise UserError(f"file {path!r} cannot be read as JSON: {e}", setting="file") from None
  if not isinstance(out, kind):
    raise UserError(f"file {path!r} must hold a JSON {'object' if kind is dict else 'list'}; "
                     f"it holds {type(out).__name__}", setting="file")
  return out


def load_safetensors(path: str) -> dict[str, np.ndarray]:
  from safetensors.numpy import load_file
  if not os.path.isfile(path):
    raise UserError(f"file {os.path.dirname(path)!r}: no {os.path.basename(path)}", setting="file")
  try:
    return load_file(path)
  except Exception as e:  # noqa: BLE001 - SafetensorError and friends
    raise UserError(f"file {path!r} is not a readable safetensors file (corrupt or "
                     f"truncated?): {type(e).__name__}: {e}", setting="file") from None


def architecture(cfg: dict) -> str:
  mt = cfg.get("model_type", "")
  archs = cfg.get("architectures") or []
  fam = adapters.family_of(cfg)
  if fam is not None:
    return fam.name
  if not mt and any(a.startswith("Llama") for a in archs):
    return "llama"
  if mt == "bert" or any(a.startswith("Bert") for a in archs):
    return "bert"
  return mt or (archs[0] if archs else "unknown")


INDEX = "model.safetensors.index.json"


def weight_files(folder: str) -> list[str]:
  """The safetensors files of a folder: model.safetensors, or the shards its
  model.safetensors.index.json names (in order)."""
  index = os.path.join(folder, INDEX)
  if os.path.isfile(index):
    wm = read_json(index).get("weight_map")
    if not isinstance(wm, dict) or not all(isinstance(v, str) for v in wm.values()):
      raise UserError(f"file {index!r}: weight_map must map tensor names to shard file "
                       f"names", setting="file")
    files = sorted(set(wm.values()))
    outside = [f for f in files if os.path.basename(f) != f or f in ("", ".", "..")]
    if outside:
      raise UserError(f"file {index!r} names shards outside its folder: {outside[:3]}",
                       setting="file")
    missing = [f for f in files if not os.path.isfile(os.path.join(folder, f))]
    if missing:
      raise UserError(f"file {folder!r}: {INDEX} names shards that are not there: "
                       f"{missing[:3]}", setting="file")
    return [os.path.join(folder, f) for f in files]
  path = os.path.join(folder, "model.safetensors")
  if not os.path.isfile(path):
    pickles = [n for n in PICKLES if os.path.isfile(os.path.join(folder, n))]
    if pickles:
      raise UserError(f"file {folder!r}: no model.safetensors (nor {INDEX}), only "
                       f"{', '.join(pickles)}: a pickle, which is never read (unpickling "
                       f"runs whatever code the file holds). Convert it to safetensors "
                       f"where you trust it, e.g. with transformers' save_pretrained",
                       setting="file")
    raise UserError(f"file {folder!r}: no model.safetensors (nor {INDEX})", setting="file")
  return [path]


# PyTorch's pickled checkpoints: refused by name, never opened.
PICKLES = ("pytorch_model.bin", "pytorch_model.bin.index.json", "model.pt", "model.pth",
           "model.ckpt")


# safetensors dtype names -> NumPy's (BF16: ml_dtypes.bfloat16)
_ST_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "I64": "int64",
              "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool"}


def _st_dtype(name: str):
  if name == "BF16":
    import ml_dtypes
    return np.dtype(ml_dtypes.bfloat16)
  return np.dtype(_ST_DTYPES[name]) if name in _ST_DTYPES else None


class Weights:
  """Tensors of one or more safetensors files, read one at a time (streaming: a tensor
  is in memory only while it is converted). Each tensor's bytes are read from the file
  (`np.fromfile` at its offset), not through a memory map: mapped pages a read touches
  stay in the process's resident memory while the file is open, the whole model over an
  import. bf16 tensors come as ml_dtypes bfloat16."""

  def __init__(self, files: list[str]):
    from safetensors import safe_open
    self.where = {}
    self.handles = []
    for path in files:
      try:
        h = safe_open(path, framework="numpy")      # validates the header
        names = list(h.keys())
        with open(path, "rb") as f:
          n = int.from_bytes(f.read(8), "little")
          header = json.loads(f.read(n))
      except Exception as e:  # noqa: BLE001 - SafetensorError and friends
        raise UserError(f"file {path!r} is not a readable safetensors file (corrupt or "
                         f"truncated?): {type(e).__name__}: {e}", setting="file") from None
      self.handles.append((path, h))
      for nm in names:
        self.where[nm] = (path, h, 8 + n, header.get(nm))
    self.dtypes = {}

  def names(self):
    return list(self.where)

  def __call__(self, name):
    path, h, base, entry = self.where[name]
    try:
      dt = _st_dtype(entry["dtype"]) if entry else None
      if dt is None:       # a dtype NumPy has no name for: safetensors reads it
        x = h.get_tensor(name)
      else:
        start, end = entry["data_offsets"]
        shape = tuple(entry["shape"])
        x = np.fromfile(path, dtype=dt, count=(end - start) // dt.itemsize,
                        offset=base + start).reshape(shape)
    except Exception as e:  # noqa: BLE001
      raise UserError(f"file {path!r}: tensor {name!r} cannot be read (corrupt or "
                       f"truncated?): {type(e).__name__}: {e}", setting="file") from None
    self.dtypes[str(x.dtype)] = self.dtypes.get(str(x.dtype), 0) + 1
    return x


def read(folder: str, dtype: str = "float32", place=None):
  """(params, model config, tokenizers.Tokenizer, tokenizer config, info). place:
  adapters.build_params's (decoder families; each tensor placed as it is converted)."""
  from mha_jax.data import tokenizer_json
  cfg = _load_config(folder)
  where = os.path.join(folder, "config.json")
  for key, kind in (("model_type", str), ("architectures", list)):
    v = cfg.get(key)
    if v is not None and (not isinstance(v, kind) or kind is list and not all(
        isinstance(a, str) for a in v)):
      raise UserError(f"{where}: {key}={v!r} must be a {'string' if kind is str else 'list of strings'}",
                      setting="file")
  arch = architecture(cfg)
  if arch not in adapters.FAMILIES and arch != "bert":
    raise UserError(f"file {folder!r}: config.json says model_type={cfg.get('model_type')!r}"
                     f" / architectures={cfg.get('architectures')}; supported: "
                     f"{sorted(adapters.FAMILIES) + ['bert']}", setting="file")
  tok_path = os.path.join(folder, "tokenizer.json")
  if arch in adapters.FAMILIES:
    fam = adapters.FAMILIES[arch]
    if not cfg.get("model_type"):
      cfg = dict(cfg, model_type=fam.model_types[0])
    settings = adapters.read_config(cfg, fam, where)   # refusals before any tensor
    files = weight_files(folder)
    weights = Weights(files)
    if not os.path.isfile(tok_path):
      raise UserError(f"file {folder!r}: no tokenizer.json", setting="file")
    t = adapters.Tensors(weights, weights.names(), os.path.join(folder, os.path.basename(
        files[0]) if len(files) == 1 else INDEX), fam.prefixes, numpy_dtype(dtype))
    params = adapters.build_params(fam, settings, t, numpy_dtype(dtype), place=place)
    mcfg = adapters.model_config(settings, fam)
    tok = tokenizer_json.from_tokenizer_json(tok_path)
    tok_cfg = dict(bos_id=_token_id(cfg.get("bos_token_id"), "bos_token_id", where),
                   eos_id=_token_id(_first(cfg.get("eos_token_id"), None), "eos_token_id",
                                    where),
                   pad_id=_token_id(cfg.get("pad_token_id"), "pad_token_id", where),
                   add_bos=False, chat_template="")
    info = dict(format="safetensors", files=[os.path.basename(f) for f in files],
                tensor_dtypes=weights.dtypes)
    if settings.get("skipped"):      # recorded in the workdir's config (source.skipped)
      info["skipped"] = settings["skipped"]
    return params, mcfg, tok, tok_cfg, info
  if place is not None:
    raise UserError(f"file {folder!r}: a BERT model is read whole; mesh places the "
                     f"decoder families' tensors as they stream (import it without mesh)",
                     setting=("file", "mesh", "mesh"))
  for key in _BERT_SIZES:
    check_size(cfg.get(key), key, where)
  weight_files(folder)             # a pickle alone is refused by name
  cfg_where, where = where, os.path.join(folder, "model.safetensors")
  weights = load_safetensors(where)
  if not os.path.isfile(tok_path):
    raise UserError(f"file {folder!r}: no tokenizer.json", setting="file")
  try:
    params, mcfg = _bert(cfg, weights, where)
  except UserError:
    raise
  except (TypeError, ValueError, ArithmeticError, AttributeError, KeyError) as e:
    raise UserError(f"{cfg_where}: a value cannot be read as the "
                     f"setting it is for ({type(e).__name__}: {' '.join(str(e).split())[:200]})"
                     ) from None
  max_seq = mcfg["max_len"]
  st = os.path.join(folder, "sentence_bert_config.json")
  if os.path.isfile(st):
    max_seq = check_size(read_json(st).get("max_seq_length", max_seq), "max_seq_length", st)
  tok = tokenizer_json.from_tokenizer_json(tok_path, max_len=max_seq)
  tok_cfg = dict(pad_id=max(_token_id(cfg.get("pad_token_id"), "pad_token_id", cfg_where), 0),
                 max_seq_len=max_seq,
                 normalize=os.path.isdir(os.path.join(folder, "2_Normalize")) or
                 _lists_normalize(folder))
  return params, mcfg, tok, tok_cfg, dict(format="safetensors", files=["model.safetensors"])


DTYPES = ("float32", "bfloat16", "float16")


def numpy_dtype(name: str):
  """The NumPy dtype of a `dtype` setting (float32, bfloat16, float16); else a UserError."""
  if name not in DTYPES:
    raise UserError(f"dtype must be one of {DTYPES}; got {name!r}", setting="dtype")
  if name == "bfloat16":
    import ml_dtypes
    return ml_dtypes.bfloat16
  return np.dtype(name)


_BERT_SIZES = ("hidden_size", "num_attention_heads", "intermediate_size", "num_hidden_layers",
               "vocab_size", "max_position_embeddings")


def _token_id(x, key: str, where: str) -> int:
  """A token id of config.json, -1 if unset (or set to -1, as some configs do)."""
  return -1 if x is None else check_size(x, key, where, lo=-1)


def _first(x, default):
  if isinstance(x, list):
    return x[0] if x else default
  return default if x is None else x


def _lists_normalize(folder: str) -> bool:
  path = os.path.join(folder, "modules.json")
  if not os.path.isfile(path):
    return False
  return any(isinstance(m, dict) and str(m.get("type", "")).endswith("Normalize")
             for m in read_json(path, list))


class _Take:
  def __init__(self, weights, where, prefixes=("",)):
    self.w, self.where = dict(weights), where
    self.prefixes = prefixes

  def __call__(self, name, shape=None):
    for p in self.prefixes:
      if p + name in self.w:
        x = np.asarray(self.w.pop(p + name), np.float32)
        if shape is not None and x.shape != tuple(shape):
          raise UserError(f"{self.where}: tensor {p + name!r} has shape {x.shape}, "
                           f"expected {tuple(shape)}")
        return np.ascontiguousarray(x)
    raise UserError(f"{self.where}: tensor {name!r} is missing")


def _bert(cfg, weights, where):
  d, h = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
  f, n = int(cfg["intermediate_size"]), int(cfg["num_hidden_layers"])
  k = d // h
  if cfg.get("hidden_act", "gelu") != "gelu":
    raise UserError(f"{where}: hidden_act={cfg['hidden_act']!r}; only 'gelu' (exact) is "
                     f"supported")
  if cfg.get("position_embedding_type", "absolute") != "absolute":
    raise UserError(f"{where}: position_embedding_type="
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
    raise UserError(f"{where}: tensors this importer does not know: {sorted(left)[:5]}")


def _f32(tree):
  if isinstance(tree, dict):
    return {k: _f32(v) for k, v in tree.items()}
  return np.ascontiguousarray(tree, np.float32)
