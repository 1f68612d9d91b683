"""Every decoder family from a Hugging Face folder: tiny random models built with
transformers inside the test (seeded, every weight perturbed so that a wrong switch
shows), saved as ordinary HF folders, imported with `mha-jax import --file`, and their
logits compared with transformers' at 1e-4 relative, on inputs longer than the sliding
window. Plus: a test per config key that it is implemented exactly (a parity case sets
it to a non-default value) or refused by name; transformers-4 and -5 spellings of the
RoPE settings; sharded and bf16 folders; roles and export-pruned on a GQA and an MQA
family; the KV cache across sliding windows.

torch and transformers are test-only references (setup.cfg's test extra).
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os

import gguf
import numpy as np
import pytest
from builders import with_devices
from oracles import rel_err
from hf_models import B, CASES, T, TINY_LLAMA_KW, V, WINDOW, build_hf, save_folder, tokenizer_json  # noqa: F401

import mha_jax
from mha_jax.pretrained import adapters, importer

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.xdist_group("families")

RTOL = 1e-4
def hf_logits(model, tokens):
  with torch.no_grad():
    return model(torch.as_tensor(tokens, dtype=torch.long)).logits.double().numpy()


TOKENS = np.random.default_rng(5).integers(0, V, (B, T)).astype(np.int32)


PARITY = {}   # case -> max relative error (printed as the parity table)

# The default run: one case per mechanism (the `imported` fixture of conftest.py builds
# each once per session); every other case of hf_models.CASES runs with `-m slow`.
DEFAULT_CASES = (
    "llama",          # GQA, head_dim != D/H, biases, transformers-5 rope_parameters
    "gemma3",         # MQA, (1 + w) QK-norm, local / global RoPE, sliding layers
    "mistral",        # sliding window (every kernel: test_sliding_windows_...)
    "dynamic_rope",   # RoPE that depends on the length
    "olmo2",          # post-norms, whole-projection QK-norm
    "gpt2",           # learned positions, LayerNorm, Conv1D
    "opt",            # position offset, ReLU MLP
    "phi",            # partial rotary (half-split), parallel block with one LayerNorm,
                      # logit bias (interleaved RoPE: deepseek_v2's MLA)
    "falcon",         # Falcon's grouped KV layout, two LayerNorms in parallel
    "granite",        # embedding / residual / score / logit multipliers
    "smollm3",        # NoPE layers
    "bloom",          # ALiBi
    "mixtral",        # MoE
    "gpt_oss",        # sink logits, clamped SwiGLU experts
    "deepseek_v2",    # MLA, shared experts, group-limited routing
    "deepseek_v3",    # sigmoid routing with the correction bias, group top-2 sums
)


def _cases(default):
  return [c if c in default else pytest.param(c, marks=pytest.mark.slow) for c in sorted(CASES)]


@pytest.mark.parametrize("case", _cases(DEFAULT_CASES))
def test_logits_match_transformers(imported, case):
  model, loaded, _ = imported(case)
  ref = hf_logits(model, TOKENS)
  got = np.asarray(loaded.task.logits(loaded.params, TOKENS))
  err = rel_err(got, ref)
  PARITY[case] = err
  print(f"\n{case}: max relative logit error vs transformers = {err:.1e}")
  assert err < RTOL, err


@pytest.mark.slow  # default run: test_logits_match_transformers (windowed families)
def test_sliding_windows_matter_and_every_kernel_serves_them(imported):
  """The windowed families really use the window (T > window), and the blocked and xla
  kernels give the reference's logits."""
  from mha_jax.models import decoder
  for case, want in (("qwen2_sliding", (None, WINDOW)), ("phi3", (WINDOW, WINDOW)),
                     ("gemma2", (WINDOW, None, WINDOW)), ("gemma3", (WINDOW, None, WINDOW)),
                     ("qwen2", (None, None))):
    assert _spec_of_config(case).window == want, case
  model, loaded, _ = imported("mistral")
  spec = loaded.task.spec
  assert set(spec.window) == {WINDOW}
  ref = np.asarray(decoder.apply(loaded.params, dataclasses.replace(spec, impl="reference"),
                                 TOKENS))
  no_window = np.asarray(decoder.apply(loaded.params, dataclasses.replace(
      spec, impl="reference", window=None), TOKENS))
  assert rel_err(no_window, ref) > 1e-3
  for impl in ("blocked", "xla"):
    got = np.asarray(decoder.apply(loaded.params, dataclasses.replace(spec, impl=impl), TOKENS))
    assert rel_err(got, ref) < RTOL, impl


@pytest.mark.slow  # default run: test_logits_match_transformers[bloom]
def test_alibi_on_every_kernel_and_with_left_padding_matches_transformers(imported):
  """BLOOM's ALiBi: the blocked kernel (the slopes as a per-block table, no dense bias)
  and xla give the reference's logits; a left-padded batch matches transformers with
  its attention mask (bias from the real tokens' positions) on the real tokens."""
  from mha_jax.models import decoder
  model, loaded, _ = imported("bloom")
  spec = loaded.task.spec
  ref = hf_logits(model, TOKENS)
  for impl in ("reference", "blocked", "xla"):
    got = decoder.apply(loaded.params, dataclasses.replace(spec, impl=impl), TOKENS)
    assert rel_err(np.asarray(got), ref) < RTOL, impl
  mask = np.ones((B, T), bool)
  mask[1, :5] = False
  with torch.no_grad():
    want = model(torch.as_tensor(TOKENS, dtype=torch.long),
                 attention_mask=torch.as_tensor(mask, dtype=torch.long)).logits.double().numpy()
  got = np.asarray(decoder.apply(loaded.params, spec, TOKENS, mask_BT=mask))
  assert rel_err(got[mask], want[mask]) < RTOL


@pytest.mark.parametrize("case", [pytest.param("gemma3", marks=pytest.mark.slow), "deepseek_v3"])
def test_kv_cache_decoding_matches_transformers_generate_and_the_uncached_forward(
    imported, case):
  """Greedy decoding with the KV cache gives transformers' generate tokens and logits
  and the logits of the uncached forward over the same tokens. gemma3: past the sliding
  window (MQA, QK-norm, local/global RoPE); deepseek_v3: MLA, whose cache holds each
  head's decompressed key (B, S, H, R + Kn) and value (B, S, H, V), with MoE layers."""
  from mha_jax.models import decoder
  model, loaded, _ = imported(case)
  spec = loaded.task.spec
  prompt = TOKENS[:1, :6]
  new, logits = decoder.generate(loaded.params, spec, prompt, 12, return_logits=True)
  model.generation_config.eos_token_id = None    # no stop, no eos suppression
  with torch.no_grad():
    out = model.generate(torch.as_tensor(prompt, dtype=torch.long), max_new_tokens=12,
                         do_sample=False, return_dict_in_generate=True, output_logits=True)
  np.testing.assert_array_equal(new[0], out.sequences[0, 6:].numpy())
  full = np.concatenate([prompt, new], 1)
  errs = {"generate": rel_err(logits[0], torch.stack(out.logits, 1)[0].double().numpy()),
          "uncached": rel_err(logits[0], np.asarray(decoder.apply(
              loaded.params, spec, full))[0, 5:-1]),
          "forward": rel_err(logits[0], hf_logits(model, full)[0, 5:-1])}
  if case == "deepseek_v3":
    cache = decoder.init_cache(loaded.params, 1, 18)
    attn = loaded.params["lm"]["layer_0"]["attn"]
    h, k, v = attn["wq"].shape[1], attn["wq"].shape[2], attn["wv"].shape[2]
    assert k != v and cache["layer_0"]["k"].shape == (1, 18, h, k)
    assert cache["layer_0"]["v"].shape == (1, 18, h, v)
  print(f"\n{case}: max relative logit error of cached decoding {errs}")
  assert max(errs.values()) < RTOL, errs


@pytest.mark.parametrize("case", ["dynamic_rope", pytest.param("phi3_longrope",
                                                                marks=pytest.mark.slow)])
def test_rope_by_length_under_and_over_the_switch_and_in_generate(imported, case):
  """Dynamic NTK and LongRoPE change the frequencies with the call's length: logits
  match transformers under the switch length (16) and over it, and greedy decoding with
  the KV cache across it gives transformers' generate tokens and logits (LongRoPE: the
  cache rebuilt at the switch, as Phi-3 does)."""
  from mha_jax.models import decoder
  model, loaded, _ = imported(case)
  spec = loaded.task.spec
  assert 16 == spec.layer("rope", 0).max_positions
  errs = {}
  for t in (12, T):   # the short call first: it resets transformers' dynamic state
    ref = hf_logits(model, TOKENS[:, :t])
    errs[t] = rel_err(np.asarray(loaded.task.logits(loaded.params, TOKENS[:, :t])), ref)
  fixed = dataclasses.replace(spec, rope=tuple(
      dataclasses.replace(r, dynamic_factor=None, long_inv_freq=None, max_positions=None)
      for r in spec.rope))     # the short frequencies at every length: differs past 16
  assert rel_err(np.asarray(decoder.apply(loaded.params, fixed, TOKENS)),
                 hf_logits(model, TOKENS)) > 1e-3
  prompt = TOKENS[:1, :10]
  new, logits = decoder.generate(loaded.params, spec, prompt, 12, return_logits=True)
  model.generation_config.eos_token_id = None    # no stop, no eos suppression
  with torch.no_grad():
    out = model.generate(torch.as_tensor(prompt, dtype=torch.long), max_new_tokens=12,
                         do_sample=False, return_dict_in_generate=True, output_logits=True)
  np.testing.assert_array_equal(new[0], out.sequences[0, 10:].numpy())
  errs["generate"] = rel_err(logits[0], torch.stack(out.logits, 1)[0].double().numpy())
  print(f"\n{case}: max relative logit error vs transformers {errs}")
  assert max(errs.values()) < RTOL, errs


# --------------------------------------------------------------------------
# Config keys: a test per key.
# --------------------------------------------------------------------------

# Which parity case exercises each implemented key of each family with a value that
# matters (non-default), checked against transformers above: the CASES entry of the
# family's own name (adding a family: its Family in adapters.py and that case).
IMPLEMENTED_BY = {f: f for f in adapters.FAMILIES}   # the case named after the family


def test_every_family_has_a_parity_case_of_its_name():
  missing = sorted(f for f in adapters.FAMILIES if f not in CASES)
  assert not missing, f"add a case named after each family to hf_models.CASES: {missing}"


def _saved_config(case) -> dict:
  """config.json as save_pretrained writes it for the case (its diff from the defaults),
  without building the model."""
  cfg_cls, _, kw = CASES[case]
  return getattr(transformers, cfg_cls)(**kw).to_diff_dict()


def _spec_of_config(case):
  """The decoder spec the import makes of the case's config (no weights read)."""
  from mha_jax.models import decoder
  cfg_cls, _, kw = CASES[case]
  cfg = getattr(transformers, cfg_cls)(**kw).to_dict()
  fam = adapters.family_of(cfg)
  s = adapters.read_config(cfg, fam, "config.json")
  return decoder.spec_from_config(adapters.model_config(s, fam))


def _hf_keys(family):
  cfg_cls = CASES[IMPLEMENTED_BY[family]][0]
  full = getattr(transformers, cfg_cls)().to_dict()
  base = transformers.PretrainedConfig().to_dict()
  return sorted(set(full) - set(base))


@pytest.mark.parametrize("family", sorted(adapters.FAMILIES))
def test_every_key_transformers_defines_is_in_the_adapters_table(family):
  """A key transformers adds to the family's config shows up here (it would be refused
  until the table says what it does)."""
  table = {**adapters.COMMON, **adapters.FAMILIES[family].keys}
  missing = [k for k in _hf_keys(family) if k not in table]
  assert not missing, missing


@pytest.mark.parametrize("family", sorted(adapters.FAMILIES))
def test_every_implemented_key_is_exercised_by_a_parity_case(family):
  """Each USE key appears in the config.json that the family's parity case saves (whose
  logits match transformers), so its implementation is checked against the reference."""
  saved = _saved_config(IMPLEMENTED_BY[family])
  table = adapters.FAMILIES[family].keys
  # Keys with transformers-4 or alternative spellings that the 5.x save does not write;
  # those are checked by test_transformers4_spellings_give_the_same_model.
  legacy = {"hidden_act", "rope_local_base_freq", "sliding_window_pattern",
            "rotary_pct", "rotary_emb_base", "partial_rotary_factor", "max_window_layers",
            "use_sliding_window", "_sliding_window_pattern", "head_dim", "layer_types",
            "original_max_position_embeddings", "n_inner", "scale_attn_weights",
            "sliding_window", "attention_bias", "mlp_bias", "query_pre_attn_scalar",
            "final_logit_softcapping", "attn_logit_softcapping", "hidden_activation",
            "num_experts"}   # Qwen3-MoE's checkpoints' name; transformers 5 saves the alias
  used = [k for k, v in table.items() if v == adapters.USE]
  absent = [k for k in used if k not in saved and k not in legacy]
  assert not absent, absent


def _refusal_cases():
  out = []
  for fam_name, fam in sorted(adapters.FAMILIES.items()):
    for key, rule in sorted({**adapters.COMMON, **fam.keys}.items()):
      if isinstance(rule, tuple):
        out.append((fam_name, key, "not-an-allowed-value"))
    out.append((fam_name, "some_new_key", 1))
  return out


def _base_config(family):
  case = IMPLEMENTED_BY[family]
  cfg_cls, _, kw = CASES[case]
  d = getattr(transformers, cfg_cls)(**kw).to_dict()
  return d


@pytest.mark.parametrize("family,key,value", _refusal_cases())
def test_keys_with_unimplemented_values_are_refused_by_name(family, key, value, tmp_path):
  cfg = _base_config(family)
  cfg[key] = value
  with pytest.raises(ValueError, match=key):
    adapters.read_config(cfg, adapters.FAMILIES[family], "config.json")


ROPE_REFUSALS = [
    ({"rope_type": "dynamic", "factor": 2.0, "original_max_position_embeddings": 8},
     "original_max_position_embeddings"),
    ({"rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [1.0] * 8},
     "rope_type.*longrope.*Phi-3"),
    ({"rope_type": "default", "mrope_section": [2, 2]}, "mrope_section"),
    ({"rope_type": "linear"}, "factor"),
    ({"rope_type": "llama3", "factor": 8.0}, "low_freq_factor"),
    ({"rope_type": "mystery"}, "mystery"),
]


@pytest.mark.parametrize("where", ["rope_parameters", "rope_scaling"])
@pytest.mark.parametrize("rope,match", ROPE_REFUSALS)
def test_unimplemented_rope_settings_are_refused_from_either_place(where, rope, match):
  cfg = _base_config("llama")
  cfg.pop("rope_parameters")
  cfg[where] = dict(rope, rope_theta=10000.0)
  with pytest.raises(ValueError, match=match):
    adapters.read_config(cfg, adapters.FAMILIES["llama"], "config.json")


def test_transformers5_rope_parameters_give_the_base_and_scaling():
  """The bug of issues 22/25: rope_parameters' theta was not read (10,000 used)."""
  cfg = _base_config("llama")          # rope_parameters {"rope_theta": 500000.0}
  assert "rope_theta" not in cfg
  s = adapters.read_config(cfg, adapters.FAMILIES["llama"], "config.json")
  assert s["rope"]["full_attention"]["base"] == 500000.0
  cfg = _base_config("llama")
  cfg["rope_parameters"] = CASES["llama3_rope"][2]["rope_parameters"]
  s = adapters.read_config(cfg, adapters.FAMILIES["llama"], "config.json")
  assert s["rope"]["full_attention"]["type"] == "llama3"


def _as_transformers4(cfg: dict) -> dict:
  """The same model as transformers 4.x wrote it: rope_theta at the top level, scaling
  under rope_scaling ("type" spelling), Gemma 3's local base as rope_local_base_freq,
  NeoX's rotary_pct / rotary_emb_base, Phi-3's partial_rotary_factor."""
  cfg = dict(cfg)
  rp = cfg.pop("rope_parameters")
  mt = cfg["model_type"]
  if mt == "gemma3_text":
    full, local = dict(rp["full_attention"]), rp["sliding_attention"]
    cfg["rope_theta"] = full.pop("rope_theta")
    cfg["rope_local_base_freq"] = local["rope_theta"]
    kind = full.pop("rope_type")
    cfg["rope_scaling"] = None if kind == "default" else dict(full, type=kind)
    cfg.pop("layer_types")
    cfg["sliding_window_pattern"] = 2
    return cfg
  rp = dict(rp)
  theta = rp.pop("rope_theta")
  partial = rp.pop("partial_rotary_factor", None)
  if mt == "gpt_neox":
    cfg["rotary_emb_base"], cfg["rotary_pct"] = theta, partial
  else:
    cfg["rope_theta"] = theta
    if partial is not None:
      cfg["partial_rotary_factor"] = partial
  kind = rp.pop("rope_type")
  cfg["rope_scaling"] = None if kind == "default" else dict(rp, type=kind)
  return cfg


@pytest.mark.parametrize("case", ["llama3_rope"] + [
    pytest.param(c, marks=pytest.mark.slow) for c in ("gemma3", "llama", "yarn_rope",
                                                      "gpt_neox", "phi3")])
def test_transformers4_spellings_give_the_same_model(imported, case, tmp_path):
  """config.json as transformers 4.x wrote it imports to the same logits."""
  model, loaded, folder = imported(case)
  with open(os.path.join(folder, "config.json")) as f:
    cfg = json.load(f)
  old = tmp_path / "hf4"
  old.mkdir()
  for name in os.listdir(folder):
    if name != "config.json":
      os.symlink(os.path.join(folder, name), old / name)
  cfg4 = _as_transformers4(cfg)
  if case == "gemma3":   # layer_types [s, f, s] is pattern 2 only for 2 of 3 layers
    cfg4.pop("sliding_window_pattern")
    cfg4["layer_types"] = cfg["layer_types"]
  (old / "config.json").write_text(json.dumps(cfg4))
  importer.import_model(str(tmp_path / "w"), file=str(old))
  run4 = mha_jax.load(str(tmp_path / "w"))
  assert run4.task.spec == loaded.task.spec
  got = np.asarray(run4.task.logits(run4.params, TOKENS))
  assert rel_err(got, hf_logits(model, TOKENS)) < RTOL


# --------------------------------------------------------------------------
# Sources: shards, bf16.
# --------------------------------------------------------------------------


def test_sharded_folder_with_an_index(tmp_path):
  model = build_hf("qwen3", seed=3)
  folder = save_folder(model, tmp_path / "hf", max_shard_size="40KB")
  assert os.path.isfile(os.path.join(folder, "model.safetensors.index.json"))
  assert len([f for f in os.listdir(folder) if f.endswith(".safetensors")]) > 2
  cfg = importer.import_model(str(tmp_path / "w"), file=folder)
  assert len(cfg["source"]["files"]) > 2
  loaded = mha_jax.load(str(tmp_path / "w"))
  assert rel_err(loaded.task.logits(loaded.params, TOKENS), hf_logits(model, TOKENS)) < RTOL


def test_bf16_folder_and_dtype_bfloat16(tmp_path):
  """A bf16 checkpoint imports exactly (to float32 by default); --dtype bfloat16 keeps
  the weights in bf16 (logits then within bf16 rounding)."""
  import jax.numpy as jnp
  import copy
  model = build_hf("llama", seed=4)
  half = copy.deepcopy(model).to(torch.bfloat16)
  folder = save_folder(half, tmp_path / "hf")
  cfg = importer.import_model(str(tmp_path / "w"), file=folder)
  assert cfg["source"]["tensor_dtypes"] == {"bfloat16": len(half.state_dict())}
  loaded = mha_jax.load(str(tmp_path / "w"))
  # The reference: the bf16-rounded weights in a float32 model (model.to(bfloat16) would
  # also round transformers' own RoPE frequency buffer).
  model.load_state_dict({k: v.float() for k, v in half.state_dict().items()})
  ref = hf_logits(model, TOKENS)
  assert rel_err(loaded.task.logits(loaded.params, TOKENS), ref) < RTOL
  importer.import_model(str(tmp_path / "wb"), file=folder, dtype="bfloat16")
  runb = mha_jax.load(str(tmp_path / "wb"))
  assert runb.params["lm"]["layer_0"]["attn"]["wq"].dtype == jnp.bfloat16
  assert rel_err(runb.task.logits(runb.params, TOKENS), ref) < 5e-2


# --------------------------------------------------------------------------
# Import onto a device mesh: each tensor placed sharded as it streams.
# --------------------------------------------------------------------------

_MESH_SCRIPT = r"""
import json, sys
import jax, numpy as np
from mha_jax import cli
from mha_jax.models import decoder
from mha_jax.pretrained import importer
from mha_jax.train import sharding
folder, workdir, tokens = sys.argv[1], sys.argv[2], np.asarray(json.loads(sys.argv[3]))
mesh = sharding.make_mesh(*sharding.parse_mesh("model=2"))
params, cfg, _ = importer.read_model(file=folder, mesh=mesh)
specs, shards = {}, {}
for name, a in params["lm"]["layer_0"]["attn"].items():
  specs[name] = [str(x) for x in a.sharding.spec]
  shards[name] = sorted({tuple(s.data.shape) for s in a.addressable_shards})
specs["mlp.w_up"] = [str(x) for x in params["lm"]["layer_0"]["mlp"]["w_up"].sharding.spec]
spec = decoder.spec_from_config(cfg["model"])
logits = jax.jit(decoder.apply, static_argnums=1)(params, spec, tokens)
cli.main(["import", "--file", folder, "--mesh", "model=2", "--workdir", workdir])
print("RESULT" + json.dumps({"devices": len(jax.devices()), "mesh": dict(mesh.shape),
                             "specs": specs, "shards": shards,
                             "logits": np.asarray(logits).tolist()}))
"""


def test_import_onto_a_mesh_places_heads_over_model(imported, tmp_path):
  """4 CPU devices, --mesh model=2 (data 2): q/k/v heads and W_O's rows split over
  "model" as each tensor loads; the sharded params' logits equal the plain import's, and
  `mha-jax import --mesh` writes a workdir with the same logits."""
  import subprocess
  import sys
  from mha_jax.train import sharding
  model, loaded, folder = imported("llama")          # H = 4 query heads, G = 2 kv heads
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  env = with_devices(4)
  r = subprocess.run([sys.executable, "-c", _MESH_SCRIPT, folder, str(tmp_path / "w"),
                      json.dumps(TOKENS.tolist())], env=env, cwd=root, capture_output=True,
                     text=True, timeout=600)
  assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
  res = json.loads(r.stdout.split("RESULT")[1])
  assert res["devices"] == 4 and res["mesh"] == {"data": 2, "model": 2}
  heads = ["None", "model", "None"]
  assert res["specs"]["wq"] == res["specs"]["wk"] == res["specs"]["wv"] == heads
  assert res["specs"]["wo"] == ["model", "None", "None"]
  assert res["specs"]["bq"] == ["model", "None"] and res["specs"]["mlp.w_up"] == [
      "None", "model"]
  assert res["shards"]["wq"] == [[64, 2, 24]] and res["shards"]["wk"] == [[64, 1, 24]]
  assert res["shards"]["wo"] == [[2, 24, 64]]
  plain = np.asarray(loaded.task.logits(loaded.params, TOKENS))
  err = rel_err(np.asarray(res["logits"]), plain)
  print(f"\nsharded import (4 devices, model=2) vs plain import: max rel logit error {err:.1e}")
  assert err < 1e-5
  run_w = mha_jax.load(str(tmp_path / "w"))
  assert rel_err(np.asarray(run_w.task.logits(run_w.params, TOKENS)), plain) < 1e-6
  for bad in ("model=x", "heads=2", "model=0", "4"):
    with pytest.raises(ValueError, match="mesh"):
      sharding.parse_mesh(bad)


# --------------------------------------------------------------------------
# Studies on a GQA and an MQA family.
# --------------------------------------------------------------------------


# The default run's export on a grouped family: SmolLM2's own export test is slow.
@pytest.mark.parametrize("case,h,g", [("llama", 4, 2),
                                      pytest.param("gemma3", 4, 1, marks=pytest.mark.slow)])
def test_roles_and_export_pruned_on_gqa_and_mqa(imported, case, h, g):
  from mha_jax.roles import head_roles
  from mha_jax.models import common
  from mha_jax.toolkit import head_masks
  _, loaded, _ = imported(case)
  assert loaded.params["lm"]["layer_0"]["attn"]["wk"].shape[1] == g
  rows = head_roles.real_lm_roles(loaded, "test", batches=1, batch_size=2, half_len=8,
                              text_windows=1)
  assert len(rows) == len(loaded.head_names) == h * len(common.layers_of(loaded.params["lm"]))
  n = len(common.layers_of(loaded.params["lm"]))
  mask = {"lm": [np.ones(h, np.float32) for _ in range(n)]}
  mask["lm"][0][[0, 1]] = 0
  mask["lm"][1][:] = 0
  masked = head_masks.mask_params(loaded.params, mask)
  pruned = head_masks.export_pruned(masked, mask)
  kv = [int(p["wk"].shape[1]) for _, _, p in common.attention_blocks(pruned)]
  assert kv[1] == 0 and kv[0] == (1 if g == 2 else 1)
  a = np.asarray(loaded.task.logits(masked, TOKENS))
  b = np.asarray(loaded.task.logits(pruned, TOKENS))
  assert rel_err(b, a) < RTOL
  # uneven groups: head 0 goes alone, so its group keeps fewer heads than the others
  # (padded with zero-output heads); every key/value head stays
  uneven = {"lm": [np.ones(h, np.float32) for _ in range(n)]}
  uneven["lm"][0][0] = 0
  masked = head_masks.mask_params(loaded.params, uneven)
  pruned = head_masks.export_pruned(masked, uneven)
  assert [int(p["wk"].shape[1]) for _, _, p in common.attention_blocks(pruned)][0] == g
  # kept heads, then the padding, group by group: {1, pad}, {2, 3} (GQA); {1, 2, 3} (MQA)
  want = [1, 0, 1, 1] if g == 2 else [1, 1, 1]
  assert [int(x) for x in head_masks.exported_head_mask(masked, uneven)["lm"][0]] == want
  a = np.asarray(loaded.task.logits(masked, TOKENS))
  b = np.asarray(loaded.task.logits(pruned, TOKENS))
  assert rel_err(b, a) < RTOL


# --------------------------------------------------------------------------
# GGUF round trips: tiny models written as llama.cpp's converter writes them (names,
# layouts, metadata; tests/hf_models.py), in mixed tensor types, imported with --file.
# --------------------------------------------------------------------------

# The architectures transformers' own GGUF reader loads (an independent reading of the
# file's tensor names and layouts), and the settings the file carries that its reader
# leaves at config defaults (context_length goes to GPT-2's unused n_ctx; Phi-3's
# rope.dimension_count, LongRoPE and window, Gemma 2's softcaps are not read; llama.cpp's
# Gemma 2 scale is 1 / sqrt(K)): copied from the written model's config.
TRANSFORMERS_READS = {
    "gpt2": ("n_positions",),
    "phi3": ("sliding_window", "rope_parameters", "original_max_position_embeddings",
             "pad_token_id"),
    "gemma2": ("query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping"),
    "gemma3": ("query_pre_attn_scalar", "layer_types", "rope_parameters"),
    # (Falcon: only the multi-query layout, where [q; k; v] is also HF's order: the
    # reader does not undo the grouped layout's reordering)
    "bloom": ("tie_word_embeddings",), "falcon:mq": (), "stablelm": ("rope_parameters",),
    # llama.cpp renormalises qwen3moe's top-k weights; transformers' reader leaves
    # norm_topk_prob at its default (false) and does not read the experts' width
    "qwen3moe": ("norm_topk_prob", "head_dim", "moe_intermediate_size")}
GGUF_PARITY = {}   # arch -> (tensor types, references and their max relative errors)


def transformers_from_gguf(path, overrides):
  """transformers' model as its own GGUF reader builds it from the file (config, tensors
  and their conventions), with `overrides` set on the config."""
  from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint
  meta = load_gguf_checkpoint(str(path), return_tensors=False)["config"]
  kw = {k: v for k, v in meta.items() if k not in ("model_type", "architectures")}
  cfg = transformers.AutoConfig.for_model(meta["model_type"], **{**kw, **overrides})
  cfg._attn_implementation = "eager"
  model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
  tensors = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model)["tensors"]
  as_t = lambda v: v if isinstance(v, torch.Tensor) else torch.from_numpy(np.array(v))  # noqa: E731
  missing = model.load_state_dict({k: as_t(v) for k, v in tensors.items()},
                                  strict=False).missing_keys
  assert set(missing) <= {"lm_head.weight"}, missing     # tied to the embedding
  model.tie_weights()
  return model


@pytest.fixture(scope="module")
def gguf_imported(tmp_path_factory):
  """arch -> (transformers model holding the file's dequantized weights, the import, the
  file); built once per architecture."""
  from hf_models import build_hf_for_gguf, load_held, write_gguf
  cache = {}

  def get(arch):
    if arch not in cache:
      base = tmp_path_factory.mktemp(f"gguf_{arch.replace(':', '_')}")
      model = build_hf_for_gguf(arch)
      path = base / "model" / f"{arch.replace(':', '_')}.gguf"
      path.parent.mkdir()
      got_arch, held = write_gguf(model, path)
      assert got_arch == arch.split(":")[0]
      importer.import_model(str(base / "w"), file=str(path))
      loaded = mha_jax.load(str(base / "w"))
      cache[arch] = (load_held(model, held), loaded, path)
    return cache[arch]

  return get


# The default run: one file per mechanism the GGUF reader undoes (llama's permuted
# rows with experts, ALiBi with BLOOM's reordered QKV, Gemma's 1 + w norms with its
# fixed layer pattern, GPT-2's transposed Conv1D, MLA and gpt-oss with YaRN, Granite's
# permuted biases); every other architecture in the slow run.
GGUF_DEFAULT = ("llama:mixtral", "bloom", "gemma3", "gpt2", "deepseek2:yarn", "gpt-oss:yarn",
                "granite:bias")
GGUF_SLOW = ("gemma2", "gptneox", "olmo2", "phi3", "qwen3", "qwen3moe", "olmoe", "stablelm",
             "stablelm:parallel", "phi2", "falcon", "falcon:mq", "command-r",
             "granite", "smollm3", "deepseek2", "deepseek2:lite", "gpt-oss")


@pytest.mark.parametrize("arch", list(GGUF_DEFAULT) + [
    pytest.param(a, marks=pytest.mark.slow) for a in GGUF_SLOW])
def test_gguf_round_trip_matches_transformers(gguf_imported, arch):
  """The import of the GGUF file matches transformers running the weights the file holds
  (dequantized); where transformers reads that architecture's GGUF itself, it matches
  that too."""
  from hf_models import GGUF_CASES
  model, loaded, path = gguf_imported(arch)
  assert loaded.config.model.family == adapters.family_of(
      {"model_type": model.config.model_type}).name
  types = sorted({t.tensor_type.name for t in gguf.GGUFReader(str(path)).tensors})
  assert {"Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "F16", "BF16", "F32"} <= set(types)
  if arch.startswith("gpt-oss"):      # the experts in MXFP4, dequantized by gguf
    assert "MXFP4" in types
  got = np.asarray(loaded.task.logits(loaded.params, TOKENS))
  err = rel_err(got, hf_logits(model, TOKENS))
  refs = [f"transformers ({GGUF_CASES[arch][0]}) on the dequantized weights {err:.1e}"]
  assert err < RTOL, err
  if arch in TRANSFORMERS_READS:
    theirs = transformers_from_gguf(
        path, {k: getattr(model.config, k) for k in TRANSFORMERS_READS[arch]})
    err2 = rel_err(got, hf_logits(theirs, TOKENS))
    refs.append(f"transformers' GGUF reader {err2:.1e}")
    assert err2 < RTOL, err2
  GGUF_PARITY[arch] = (types, refs)
  print(f"\n{arch} GGUF round trip: {'; '.join(refs)}")


def test_granite_gguf_reads_llama_cpp_s_zero_scales_and_rope_switch(tmp_path):
  """llama.cpp's granite graph: attention.scale, embedding_scale and residual_scale of 0
  mean its defaults (1 / sqrt(K), 1, 1), and rope.scaling.finetuned false runs no RoPE:
  the import matches transformers' Granite with those defaults and its rotary
  frequencies zeroed (cos 1, sin 0: no rotation)."""
  from hf_models import build_hf_for_gguf, load_held, write_gguf
  model = build_hf_for_gguf("granite")
  c = model.config
  want = dict(attention_multiplier=(c.hidden_size // c.num_attention_heads) ** -0.5,
              embedding_multiplier=1.0, residual_multiplier=1.0)
  for k, v in want.items():        # the transformers model runs the defaults...
    setattr(c, k, v)
  for mod in model.modules():
    for k, v in want.items():
      if hasattr(mod, k):
        setattr(mod, k, v)
    if hasattr(mod, "scaling") and hasattr(mod, "attention_dropout"):
      mod.scaling = want["attention_multiplier"]
    if hasattr(mod, "inv_freq"):
      mod.inv_freq.zero_()
  saved = {k: getattr(c, k) for k in want}
  for k in want:                   # ...while the file says 0
    setattr(c, k, 0.0)
  try:
    _, held = write_gguf(model, tmp_path / "g.gguf",
                         extra_meta=[("add_rope_scaling_finetuned", False)])
  finally:
    for k, v in saved.items():
      setattr(c, k, v)
  importer.import_model(str(tmp_path / "w"), file=str(tmp_path / "g.gguf"))
  loaded = mha_jax.load(str(tmp_path / "w"))
  assert all(lay["rope"] is None for lay in loaded.config.model.decoder["layers"])
  err = rel_err(np.asarray(loaded.task.logits(loaded.params, TOKENS)),
                hf_logits(load_held(model, held), TOKENS))
  print(f"\ngranite GGUF with zero scales, no RoPE: max relative logit error {err:.1e}")
  assert err < RTOL, err


def test_gpt_oss_gguf_yarn_runs_llama_cpp_s_truncated_correction_range(gguf_imported):
  """ggml rounds YaRN's correction range out to whole dimensions; gpt-oss's own config
  says truncate false. The import runs llama.cpp's ramp: it matches transformers with
  truncate true (the round trip) and differs from transformers with truncate false by far
  more than the tolerance (the setting is live in this file: range [0, 2] against
  [0, 1.2])."""
  model, loaded, _ = gguf_imported("gpt-oss:yarn")
  cfg = model.config.__class__.from_dict(model.config.to_dict())
  cfg.rope_parameters = dict(cfg.rope_parameters, truncate=False)
  cfg._attn_implementation = "eager"
  untruncated = type(model)(cfg).eval()
  untruncated.load_state_dict(model.state_dict())
  got = np.asarray(loaded.task.logits(loaded.params, TOKENS))
  assert rel_err(got, hf_logits(model, TOKENS)) < RTOL
  err = rel_err(got, hf_logits(untruncated, TOKENS))
  print(f"\ngpt-oss GGUF YaRN against transformers with truncate false: {err:.1e}")
  assert err > 100 * RTOL, err


_SIZES = [("add_embedding_length", 64), ("add_head_count", 4), ("add_block_count", 2),
          ("add_feed_forward_length", 96)]
_Gating = collections.namedtuple("_Gating", "value")   # a gating number gguf has no name for
_YARN = gguf.RopeScalingType.YARN
_OSS = [("add_layer_norm_rms_eps", 1e-5), ("add_expert_count", 4), ("add_expert_used_count", 2),
        ("add_sliding_window", 8), ("add_rope_scaling_type", _YARN),
        ("add_rope_scaling_factor", 4.0)]
_MLA = [("add_kv_lora_rank", 32), ("add_rope_dimension_count", 8), ("add_head_count_kv", 1),
        ("add_key_length", 40), ("add_value_length", 32), ("add_key_length_mla", 40),
        ("add_value_length_mla", 16), ("add_expert_count", 4), ("add_expert_used_count", 2),
        ("add_expert_feed_forward_length", 32)]


@pytest.mark.parametrize("arch,meta,match", [
    # keys llama.cpp reads for these architectures that the reader does not implement
    ("olmo2", [("add_sliding_window", 8)], r"'olmo2\.attention\.sliding_window' \(= 8\) is "
     r"not implemented for olmo2"),
    ("gpt2", [("add_rope_freq_base", 500.0)], r"'gpt2\.rope\.freq_base' \(= 500\.0\)"),
    ("gptneox", [("add_sliding_window", 8)], r"'gptneox\.attention\.sliding_window'"),
    ("gemma2", [("add_rope_scaling_attn_factors", 1.5)], r"'gemma2\.rope\.scaling\.attn_factor'"),
    # settings that cannot be run exactly
    ("gptneox", [("add_head_count_kv", 2), ("add_layer_norm_eps", 1e-5)],
     r"gptneox\.attention\.head_count_kv=2 \(grouped heads\)"),
    ("phi3", [("add_layer_norm_rms_eps", 1e-5),
              ("add_rope_scaling_type", gguf.RopeScalingType.YARN)],
     r"phi3\.rope\.scaling\.type='yarn' is not implemented"),
    ("olmo2", [("add_layer_norm_rms_eps", 1e-5), ("add_rope_dimension_count", 8)],
     r"olmo2\.rope\.dimension_count=8 \(partial rotary\)"),
    # llama.cpp has the name but no graph (nor converter) for GPT-J
    ("gptj", [], r"'gptj': llama.cpp defines no GPT-J graph.*import the HF folder"),
    # DeepSeek-V2/V3 files whose layout or settings are not run exactly
    ("deepseek2", [("add_layer_norm_rms_eps", 1e-6), ("add_kv_lora_rank", 32),
                   ("add_rope_dimension_count", 8)],
     r"deepseek2\.attention\.key_length_mla=None is missing: the older converters' layout"),
    ("deepseek2", _MLA + [("add_layer_norm_rms_eps", 1e-5)],
     r"layer_norm_rms_epsilon=\S+ is not 1e-6: llama.cpp normalises MLA's latents"),
    ("deepseek2", _MLA + [("add_layer_norm_rms_eps", 1e-6), ("add_expert_group_count", 2),
                          ("add_expert_group_used_count", 1)],
     r"deepseek2\.expert_group_count=2 with softmax gating"),
    ("deepseek2", _MLA + [("add_layer_norm_rms_eps", 1e-6), ("add_expert_gating_func", _Gating(3))],
     r"deepseek2\.expert_gating_func=3"),
    # keys the newer architectures' graphs read that are not implemented
    ("qwen3moe", [("add_expert_weights_scale", 2.0)], r"'qwen3moe\.expert_weights_scale'"),
    ("bloom", [("add_layer_norm_eps", 1e-5), ("add_max_alibi_bias", 4.0)],
     r"bloom\.attention\.max_alibi_bias=4\.0 is not BLOOM's 8"),
    ("falcon", [("add_layer_norm_eps", 1e-5), ("add_tensor_data_layout", "other")],
     r"falcon\.tensor_data_layout='other'"),
    ("olmoe", [("add_layer_norm_rms_eps", 1e-5), ("add_expert_count", 4),
               ("add_expert_used_count", 6)], r"olmoe\.expert_used_count=6 is more than"),
    # YaRN: what llama.cpp and transformers would run differently, or that is not read
    ("qwen3", [("add_layer_norm_rms_eps", 1e-5), ("add_rope_scaling_type", _YARN),
               ("add_rope_scaling_factor", 4.0)],
     r"qwen3\.rope\.scaling\.type='yarn' is not implemented for qwen3"),
    ("deepseek2", _MLA + [("add_layer_norm_rms_eps", 1e-6), ("add_rope_scaling_type", _YARN),
                          ("add_rope_scaling_factor", 4.0)],
     r"deepseek2\.rope\.scaling\.yarn_log_multiplier=None with YaRN: without DeepSeek's "
     r"mscale_all_dim"),
    ("deepseek2", _MLA + [("add_layer_norm_rms_eps", 1e-6),
                          ("add_rope_scaling_type", gguf.RopeScalingType.LINEAR),
                          ("add_rope_scaling_factor", 4.0)],
     r"deepseek2\.rope\.scaling\.type='linear' \(linear scaling\): llama.cpp's deepseek2"),
    ("gpt-oss", _OSS + [("add_rope_scaling_yarn_beta_fast", 16.0)],
     r"gpt-oss\.rope\.scaling\.yarn_beta_fast=16\.0 is not 32: llama.cpp's gpt-oss graph "
     r"does not read it"),
    ("gpt-oss", _OSS + [("add_rope_scaling_yarn_attn_factor", 1.2)],
     r"'gpt-oss\.rope\.scaling\.yarn_attn_factor' \(= 1\.2"),
    ("gpt-oss", _OSS[:-1], r"gpt-oss\.rope\.scaling\.factor=None is missing"),
    ("gpt-oss", _OSS[:-1] + [("add_rope_scaling_factor", 0.5)],
     r"gpt-oss\.rope\.scaling\.factor=0\.5 with rope\.scaling\.type yarn: a factor of 1"),
])
def test_gguf_refuses_unimplemented_keys_and_settings_by_name(tmp_path, arch, meta, match):
  from hf_models import write_gguf_header
  from mha_jax.errors import UserError
  path = write_gguf_header(tmp_path / f"{arch}.gguf", arch, _SIZES + meta)
  with pytest.raises(UserError, match=rf"{arch}\.gguf.*{match}"):
    importer.import_model(str(tmp_path / "w"), file=path)
  assert not (tmp_path / "w").exists()


def test_export_pruned_keeps_whole_projection_qk_norm_exact(imported):
  """OLMo 2 normalises all heads' queries (keys) together: the removed heads' Q (K)
  columns stay as wq_rest / wk_rest for the norm's statistics, and the export's logits
  equal the masked model's (a whole kv head removed in layer 0, GQA padding in layer 1;
  exported twice over)."""
  from mha_jax.models import common
  from mha_jax.toolkit import head_masks
  _, loaded, _ = imported("olmo2")                     # H = 4, G = 2
  mask = {"lm": [np.ones(4, np.float32) for _ in common.layers_of(loaded.params["lm"])]}
  mask["lm"][0][[0, 1]] = 0
  mask["lm"][1][2] = 0
  masked = head_masks.mask_params(loaded.params, mask)
  pruned = head_masks.export_pruned(masked, mask)
  a0, a1 = pruned["lm"]["layer_0"]["attn"], pruned["lm"]["layer_1"]["attn"]
  assert a0["wq"].shape[1] == 2 and a0["wk"].shape[1] == 1 and a0["q_norm"].shape == (2, 16)
  assert a0["wq_rest"].shape[1] == 2 and a0["wk_rest"].shape[1] == 1
  assert a1["wq"].shape[1] == 4 and "wq_rest" not in a1      # padding: nothing removed
  want = np.asarray(loaded.task.logits(masked, TOKENS))
  err = rel_err(np.asarray(loaded.task.logits(pruned, TOKENS)), want)
  print(f"\nOLMo 2 export-pruned vs the masked model: max rel logit error {err:.1e}")
  assert err < RTOL
  without = {**pruned, "lm": {**pruned["lm"], "layer_0": {**pruned["lm"]["layer_0"], "attn": {
      k: v for k, v in a0.items() if not k.endswith("_rest")}}}}
  assert rel_err(np.asarray(loaded.task.logits(without, TOKENS)), want) > 1e-3
  mask2 = {"lm": [np.array([1.0, 0.0], np.float32), np.ones(4, np.float32)]}
  twice = head_masks.export_pruned(head_masks.mask_params(pruned, mask2), mask2)
  assert twice["lm"]["layer_0"]["attn"]["wq_rest"].shape[1] == 3
  mask["lm"][0][3] = 0
  assert rel_err(np.asarray(loaded.task.logits(twice, TOKENS)),
                 np.asarray(loaded.task.logits(head_masks.mask_params(loaded.params, mask), TOKENS))) < RTOL


# --------------------------------------------------------------------------
# Mixture of experts: the router's choices as a site.
# --------------------------------------------------------------------------


def _hf_router_weights(model, tokens, gate_of):
  """transformers' router choices per layer as dense (B, T, E) weights (0 outside the
  top-k), captured with forward hooks on each layer's router module."""
  got = {}

  def keep(i):
    def hook(_mod, _inp, out):
      _, scores, idx = out
      dense = torch.zeros(idx.shape[0], gate_of(0).weight.shape[0], dtype=torch.float64)
      got[i] = dense.scatter(1, idx, scores.double()).numpy().reshape(*tokens.shape, -1)
    return hook
  handles = [gate_of(i).register_forward_hook(keep(i))
             for i in range(model.config.num_hidden_layers)]
  try:
    logits = hf_logits(model, tokens)
  finally:
    for h in handles:
      h.remove()
  return logits, got


@pytest.mark.parametrize("case,gate", [("mixtral", "mlp.gate"), pytest.param(
    "gpt_oss", "mlp.router", marks=pytest.mark.slow)])
def test_router_site_reads_transformers_choices_and_fixing_them_reproduces_its_logits(
    imported, case, gate):
  """lm.L.mlp.router read: the same experts (and weights) as transformers' router;
  replaced by transformers' own weights: its logits; replaced by other choices (each
  token's experts rolled by one): different logits."""
  from mha_jax import interventions
  from mha_jax.models import decoder
  model, loaded, _ = imported(case)
  mod_of = lambda i: model.model.layers[i].get_submodule(gate)  # noqa: E731
  ref, theirs = _hf_router_weights(model, TOKENS, mod_of)
  n = model.config.num_hidden_layers
  names = [f"lm.{i}.mlp.router" for i in range(n)]
  assert set(names) <= set(interventions.site_names(loaded.params))
  run = lambda hook: decoder.apply(loaded.params, loaded.task.spec, TOKENS, hook=hook)  # noqa: E731
  _, acts = interventions.run_with_hook(run, read=names)
  for i in range(n):
    ours = np.asarray(acts[names[i]])
    np.testing.assert_array_equal(ours > 0, theirs[i] > 0)
    assert np.max(np.abs(ours - theirs[i])) < 1e-5
  fixed, _ = interventions.run_with_hook(run, edits={
      names[i]: interventions.replace(jnp_f32(theirs[i])) for i in range(n)})
  assert rel_err(np.asarray(fixed), ref) < RTOL
  other, _ = interventions.run_with_hook(run, edits={
      names[i]: interventions.replace(jnp_f32(np.roll(theirs[i], 1, axis=-1)))
      for i in range(n)})
  assert rel_err(np.asarray(other), ref) > 1e-3


def test_deepseek_v3_mtp_layer_tensors_are_skipped_with_a_note(imported, tmp_path):
  """A DeepSeek-V3 folder with a multi-token-prediction layer (num_nextn_predict_layers 1,
  its tensors stored as layer n): the import skips them, says so in the workdir's
  config, and gives the same logits (transformers' model has no such layer); without
  the config key the same tensors are refused as unknown."""
  import shutil
  from safetensors.numpy import load_file, save_file
  from mha_jax.errors import UserError
  model, loaded, folder = imported("deepseek_v3")
  n = model.config.num_hidden_layers
  rng = np.random.default_rng(0)
  for mtp in (1, 0):
    src = tmp_path / f"hf{mtp}"
    shutil.copytree(folder, src)
    st = load_file(str(src / "model.safetensors"))
    extra = {f"model.layers.{n}.{k}": rng.standard_normal(shape).astype(np.float32)
             for k, shape in (("enorm.weight", (64,)), ("hnorm.weight", (64,)),
                              ("eh_proj.weight", (64, 128)), ("shared_head.norm.weight", (64,)),
                              ("self_attn.q_a_proj.weight", (20, 64)),
                              ("mlp.gate.weight", (8, 64)))}
    save_file({**st, **extra}, str(src / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((src / "config.json").read_text())
    cfg["num_nextn_predict_layers"] = mtp
    (src / "config.json").write_text(json.dumps(cfg))
    if not mtp:
      with pytest.raises(UserError, match=rf"does not know.*model\.layers\.{n}\."):
        importer.import_model(str(tmp_path / "w0"), file=str(src))
      continue
    importer.import_model(str(tmp_path / "w1"), file=str(src))
    got = mha_jax.load(str(tmp_path / "w1"))
    src_cfg = json.loads((tmp_path / "w1" / "config.json").read_text())["source"]
    assert src_cfg["skipped"].startswith("6 tensors of the 1 multi-token-prediction layer")
    np.testing.assert_array_equal(np.asarray(got.task.logits(got.params, TOKENS)),
                                  np.asarray(loaded.task.logits(loaded.params, TOKENS)))


def test_deepseek_v3_router_reads_transformers_choices_and_its_correction_bias_matters(
    imported):
  """DeepSeek-V3's sigmoid router (noaux_tc): the router site of the sparse layer holds
  transformers' choices and weights; without the e_score_correction_bias, or without
  the group restriction, the logits differ (so both are exercised)."""
  import jax
  from mha_jax import interventions
  from mha_jax.models import decoder
  model, loaded, _ = imported("deepseek_v3")          # layer 0 dense, layer 1 sparse
  got = {}
  gate = model.model.layers[1].mlp.gate

  def hook(_mod, _inp, out):
    _, w, idx = out
    dense = torch.zeros(idx.shape[0], gate.weight.shape[0], dtype=torch.float64)
    got["w"] = dense.scatter(1, idx, w.double()).numpy().reshape(*TOKENS.shape, -1)
  h = gate.register_forward_hook(hook)
  try:
    ref = hf_logits(model, TOKENS)
  finally:
    h.remove()
  run = lambda params, spec_: decoder.apply(params, spec_, TOKENS)  # noqa: E731
  spec = loaded.task.spec
  _, acts = interventions.run_with_hook(
      lambda hook: decoder.apply(loaded.params, spec, TOKENS, hook=hook), read=["lm.1.mlp.router"])
  ours = np.asarray(acts["lm.1.mlp.router"])
  np.testing.assert_array_equal(ours > 0, got["w"] > 0)
  assert np.max(np.abs(ours - got["w"])) < 1e-5
  no_bias = jax.tree_util.tree_map(lambda x: x, loaded.params)
  no_bias["lm"]["layer_1"]["mlp"] = {k: v for k, v in no_bias["lm"]["layer_1"]["mlp"].items()
                                     if k != "router_correction"}
  assert rel_err(np.asarray(run(no_bias, spec)), ref) > 1e-3
  no_groups = dataclasses.replace(spec, moe_groups=None)
  assert rel_err(np.asarray(run(loaded.params, no_groups)), ref) > 1e-3


def jnp_f32(x):
  import jax.numpy as jnp
  return jnp.asarray(x, jnp.float32)


# Options of the new families that are not implemented: refused by name at import.
NAMED_REFUSALS = [
    ("falcon", {"alibi": True}, "alibi"),
    ("falcon", {"new_decoder_architecture": True, "parallel_attn": False}, "parallel_attn"),
    ("falcon", {"new_decoder_architecture": False, "multi_query": False, "num_kv_heads": 2},
     "num_kv_heads"),
    ("falcon", {"new_decoder_architecture": False, "multi_query": True,
                "num_key_value_heads": 4}, "num_key_value_heads"),
    ("opt", {"word_embed_proj_dim": 32}, "word_embed_proj_dim"),
    ("gptj", {"rotary_dim": None}, "rotary_dim"),
    ("smollm3", {"no_rope_layers": [1, 2, 1]}, "no_rope_layers"),
    ("gpt_oss", {"hidden_act": "gelu"}, "hidden_act"),
    ("qwen3_moe", {"num_experts_per_tok": 9}, "num_experts_per_tok"),
    ("deepseek_v2", {"num_key_value_heads": 2}, "num_key_value_heads"),
    ("deepseek_v2", {"topk_method": "noaux_tc"}, "topk_method"),
    ("deepseek_v2", {"n_group": 3}, "n_group"),
    ("deepseek_v3", {"n_group": 8}, "n_group"),          # groups of one expert: no top-2
    ("deepseek_v3", {"topk_group": 1, "num_experts_per_tok": 3}, "num_experts_per_tok"),
    ("deepseek_v3", {"n_shared_experts": 0}, "n_shared_experts"),
    ("deepseek_v3", {"topk_method": "greedy"}, "topk_method"),
    ("deepseek_v3", {"quantization_config": {"quant_method": "fp8"}}, "quantization_config"),
]


@pytest.mark.parametrize("family,change,match", NAMED_REFUSALS)
def test_unimplemented_options_of_the_new_families_are_refused_by_name(family, change, match):
  cfg = _base_config(family)
  cfg.update(change)
  with pytest.raises(ValueError, match=match):
    adapters.read_config(cfg, adapters.FAMILIES[family], "config.json")


@pytest.mark.parametrize("case", ["deepseek_v2", "gpt_oss"])
def test_export_pruned_on_mla_and_sink_heads_equals_the_masked_model(imported, case):
  """Removing heads for real: MLA heads (each its own decompressed key and value; the
  latent's weights shared and kept) and sink heads (their sink logits sliced)."""
  from mha_jax.models import common
  from mha_jax.toolkit import head_masks
  _, loaded, _ = imported(case)
  n = len(common.layers_of(loaded.params["lm"]))
  h = loaded.params["lm"]["layer_0"]["attn"]["wq"].shape[1]
  mask = {"lm": [np.ones(h, np.float32) for _ in range(n)]}
  mask["lm"][0][[0, 2]] = 0
  mask["lm"][1][1] = 0
  masked = head_masks.mask_params(loaded.params, mask)
  pruned = head_masks.export_pruned(masked, mask)
  a0 = pruned["lm"]["layer_0"]["attn"]
  assert a0["wq"].shape[1] == 2 and (case != "gpt_oss" or a0["sink_logit"].shape == (2,))
  want = np.asarray(loaded.task.logits(masked, TOKENS))
  assert rel_err(np.asarray(loaded.task.logits(pruned, TOKENS)), want) < RTOL
  assert rel_err(want, np.asarray(loaded.task.logits(loaded.params, TOKENS))) > 1e-3
