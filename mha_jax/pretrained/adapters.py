"""One declarative adapter per decoder family: which config keys it reads, ignores or
refuses, which tensors it takes (Hugging Face names, shapes, how a fused tensor splits),
and the switches of the one decoder forward (mha_jax/models/decoder.py) they set.

Config keys. Every key of a family's config.json is in its table (`keys`) or in COMMON:
  USE         read, and implemented exactly;
  IGNORE      no effect on the logits (dropout rates, initialisation, token ids, caching);
  (v1, v2..)  only these values are implemented; any other is refused naming the key.
A key in neither table is refused by name (never a silent approximation). RoPE settings
are read from `rope_parameters` (transformers 5), `rope_scaling` (4.x) or the top-level
`rope_theta` / `partial_rotary_factor` / `rotary_pct` / `rotary_emb_base` /
`rope_local_base_freq`, flat or nested per layer type, and each key inside is checked
the same way (ROPE_KEYS); `longrope` is Phi-3's only (LONGROPE_FAMILIES).

Tensors. `layer` lists (HF name under the layer prefix, kind, target) rows, `top` the
model-level ones; a row with a condition is taken only when the config enables it. Kinds:
  vec           a (D,) or (F,) vector as stored (norms: + 1 where the family scales by
                (1 + w), Gemma)
  lin           nn.Linear (out, in) -> (in, out)          conv  GPT-2 Conv1D (in, out) as is
  q / kv / o    nn.Linear rows -> (D, H, K) / (D, G, K) / (H, K, D)
  bq / bkv      biases -> (H, K) / (G, K)
  qkv           fused rows [q (H K); k (G K); v (G K)] (Phi-3; GGUF's attn_qkv, weights
                and bias)
  neox_qkv      GPT-NeoX's rows interleaved per head `[h][q, k, v][K]` (weights and bias)
  gpt2_qkv      GPT-2's Conv1D c_attn (D, 3 D) columns [q; k; v] (weights and bias)
  gpt2_o        GPT-2's Conv1D c_proj (H K, D) -> (H, K, D)
  gate_up       Phi-3's fused rows [gate (F); up (F)]
  experts_in / experts_out   per-expert nn.Linear (name with {e}), stacked to (E, D, F) / (E, F, D)
  exps_in / exps_out         GGUF's stacked experts (E, F, D) / (E, D, F), the same
  head_norm     QK-norm (K,) shared by the heads     whole_q / whole_k  OLMo 2's (H K,) / (G K,)
Every tensor of the file must be taken (or be a known buffer); leftovers are refused.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import numpy as np

from mha_jax import attention
from mha_jax.errors import UserError

USE, IGNORE = "use", "ignore"

# Keys every transformers config may carry, with no effect on a decoder's logits (or
# refused unless harmless).
COMMON = {
    "_name_or_path": IGNORE, "architectures": USE, "model_type": USE,
    "transformers_version": IGNORE, "dtype": IGNORE, "torch_dtype": IGNORE,
    "id2label": IGNORE, "label2id": IGNORE, "problem_type": IGNORE, "return_dict": IGNORE,
    "output_attentions": IGNORE, "output_hidden_states": IGNORE,
    "chunk_size_feed_forward": (0,), "is_encoder_decoder": (False,),
    "add_cross_attention": (False,), "is_decoder": IGNORE, "use_cache": IGNORE,
    "initializer_range": IGNORE, "bos_token_id": IGNORE, "eos_token_id": IGNORE,
    "pad_token_id": IGNORE, "tie_word_embeddings": USE, "attention_dropout": IGNORE,
    "pruned_heads": ({},), "tokenizer_class": IGNORE, "task_specific_params": IGNORE,
    "cache_implementation": IGNORE, "max_position_embeddings": USE,
    "tf_legacy_loss": IGNORE, "use_bfloat16": IGNORE, "torchscript": IGNORE,
    "sep_token_id": IGNORE, "decoder_start_token_id": IGNORE,
    "_attn_implementation_autoset": IGNORE, "num_labels": IGNORE,
    # RoPE, wherever it is stored (checked key by key in ROPE_KEYS)
    "rope_parameters": USE, "rope_scaling": USE, "rope_theta": USE,
}

# Keys inside a RoPE settings dict, per rope_type; anything else is refused by name.
ROPE_KEYS = {
    "default": ("rope_theta", "partial_rotary_factor"),
    "linear": ("rope_theta", "partial_rotary_factor", "factor"),
    "llama3": ("rope_theta", "partial_rotary_factor", "factor", "low_freq_factor",
               "high_freq_factor", "original_max_position_embeddings"),
    "yarn": ("rope_theta", "partial_rotary_factor", "factor",
             "original_max_position_embeddings", "beta_fast", "beta_slow",
             "attention_factor", "mscale", "mscale_all_dim", "truncate"),
    "dynamic": ("rope_theta", "partial_rotary_factor", "factor"),
    "longrope": ("rope_theta", "partial_rotary_factor", "short_factor", "long_factor",
                 "factor", "attention_factor", "original_max_position_embeddings"),
}
# LongRoPE is implemented as Phi-3 runs it: generate recomputes the prompt's keys with
# the long factors when the length first passes original_max_position_embeddings
# (decoder.generate does too). transformers' other families keep the short-factor keys
# in their cache, which a model here would not reproduce: refused there.
LONGROPE_FAMILIES = ("phi3",)

ACTS = {"silu": "silu", "swish": "silu", "gelu": "gelu", "gelu_new": "gelu_tanh",
        "gelu_pytorch_tanh": "gelu_tanh", "gelu_fast": None, "relu": "relu"}


@dataclasses.dataclass(frozen=True)
class Family:
  """A decoder family's adapter (see the module docstring)."""
  name: str
  model_types: tuple[str, ...]
  keys: dict                       # config key -> USE | IGNORE | allowed values
  top: tuple                       # (hf name, kind, target, condition)
  layer: tuple                     # the same, under layer_prefix
  prefixes: tuple = ("model.", "")
  layer_prefix: str = "layers.{i}."
  norm: str = "rms"
  plus_one: bool = False           # norms scale by (1 + w) (Gemma)
  ignore_tensors: tuple = ("rotary_emb.inv_freq",)
  parse: Callable | None = None    # config -> the family's settings (see _settings)


# ---------------------------------------------------------------------------------------
# Config reading.
# ---------------------------------------------------------------------------------------


class Config:
  """A config.json being read: every key is checked against the family's table."""

  def __init__(self, cfg: dict, family: Family, where: str):
    self.cfg, self.family, self.where = dict(cfg), family, where

  def refuse(self, key, value, why=""):
    raise UserError(f"{self.where}: config key {key}={value!r} is not implemented for "
                     f"{self.family.name}{': ' + why if why else ''} (refused, not "
                     f"approximated)")

  def check_keys(self):
    table = {**COMMON, **self.family.keys}
    for key, value in self.cfg.items():
      rule = table.get(key)
      if rule is None:
        raise UserError(f"{self.where}: config key {key!r} (= {value!r}) is not known to "
                         f"the {self.family.name} adapter; refused rather than ignored")
      if isinstance(rule, tuple) and value not in rule:
        self.refuse(key, value, f"only {list(rule)} is supported")

  def get(self, key, default=None):
    v = self.cfg.get(key)
    return default if v is None else v

  def need(self, key):
    if self.cfg.get(key) is None:
      raise UserError(f"{self.where}: config.json has no {key!r}")
    return self.cfg[key]


def _rope_settings(c: Config, head_dim: int, layer_types: list[str], *,
                   default_theta: float = 10000.0, default_partial: float = 1.0,
                   legacy_theta_key: str | None = None,
                   legacy_partial_key: str | None = None,
                   local_theta_key: str | None = None) -> dict:
  """{layer type: RoPE setting dict (models/rope_scaling)} from wherever the config
  keeps them; refuses unknown keys and unimplemented rope types by name."""
  theta = c.cfg.get("rope_theta")
  if legacy_theta_key and c.cfg.get(legacy_theta_key) is not None:
    theta = c.cfg[legacy_theta_key] if theta is None else theta
  partial = c.cfg.get("partial_rotary_factor")
  if legacy_partial_key and c.cfg.get(legacy_partial_key) is not None and partial is None:
    partial = c.cfg[legacy_partial_key]
  types = sorted(set(layer_types))
  per_type, nested = _rope_dicts(c, types, local_theta_key)
  out = {}
  for t in types:
    d = per_type.get(t, {})
    if t == "sliding_attention" and local_theta_key and not nested:
      base = c.get(local_theta_key, 10000.0)
    else:
      base = d.get("rope_theta", theta if theta is not None else default_theta)
    frac = d.get("partial_rotary_factor", partial if partial is not None else default_partial)
    out[t] = _rope_setting(c, d, "rope_parameters" + (f".{t}" if nested else ""), base,
                           frac, head_dim)
  return out


def _rope_dicts(c: Config, types: list[str], local_theta_key: str | None):
  """({layer type: its raw rope dict}, whether the config nests them by layer type):
  transformers 4.x's rope_scaling or 5's rope_parameters, flat or per layer type."""
  rp = c.cfg.get("rope_parameters")
  rs = c.cfg.get("rope_scaling")
  nested = isinstance(rp, dict) and any(k in ("full_attention", "sliding_attention")
                                        for k in rp)
  if rp is not None and not isinstance(rp, dict):
    c.refuse("rope_parameters", rp, "expected a dict")
  if rs is not None and not isinstance(rs, dict):
    c.refuse("rope_scaling", rs, "expected a dict")
  per_type: dict[str, dict] = {}
  if nested:
    for k in rp:
      if k not in ("full_attention", "sliding_attention"):
        c.refuse(f"rope_parameters.{k}", rp[k], "unknown layer type")
    for t in types:
      per_type[t] = dict(rp.get(t) or {})
    if rs:          # 4.x scaling of a nested family applies to the global layers
      per_type.setdefault("full_attention", {}).update(rs)
  else:
    flat = dict(rs or rp or {})     # transformers 5: rope_scaling wins over rope_parameters
    for t in types:
      per_type[t] = dict(flat)
    if local_theta_key:   # Gemma 3 (4.x): local layers' base at the top level
      per_type.setdefault("full_attention", dict(flat))
      per_type["sliding_attention"] = {"rope_type": "default"}
  return per_type, nested


def _rope_setting(c: Config, d: dict, where: str, base, frac, head_dim: int) -> dict:
  """One layer type's RoPE setting dict from its raw dict d (consumed), named `where` in
  refusals; base and frac are its resolved theta and partial rotary factor."""
  kind = d.pop("rope_type", None) or d.pop("type", None) or "default"
  d.pop("type", None)
  if kind == "longrope" and c.family.name not in LONGROPE_FAMILIES:
    c.refuse(f"{where}.rope_type", kind, "LongRoPE is implemented as Phi-3's generate "
             "runs it (the prompt recomputed at the switch length); transformers' "
             f"{c.family.name} keeps short-factor keys in its cache")
  if kind not in ROPE_KEYS:
    c.refuse(f"{where}.rope_type", kind, f"implemented: {sorted(ROPE_KEYS)}")
  for k in d:
    if k not in ROPE_KEYS[kind]:
      c.refuse(f"{where}.{k}", d[k], f"not a setting of rope_type {kind!r}")
  dim = int(head_dim * float(frac))
  if dim < 2 or dim % 2:
    c.refuse(f"{where}.partial_rotary_factor", frac,
             f"rotates {dim} of {head_dim} features (must be even, >= 2)")
  s = {"type": kind, "base": float(base), "dim": dim}
  if kind in ("llama3", "yarn", "longrope"):
    d.setdefault("original_max_position_embeddings",
                 c.get("original_max_position_embeddings",
                       c.get("max_position_embeddings")))
  if kind == "longrope":   # Phi-3's top-level key wins, as in transformers
    if c.cfg.get("original_max_position_embeddings") is not None:
      d["original_max_position_embeddings"] = c.cfg["original_max_position_embeddings"]
    for k in ("short_factor", "long_factor"):
      got = d.pop(k, None)
      if not isinstance(got, (list, tuple)) or len(got) != dim // 2:
        c.refuse(f"{where}.{k}", got, f"expected {dim // 2} numbers (one per rotated "
                 f"feature pair)")
      s[k] = [float(x) for x in got]
    if d.get("factor") is None:   # transformers: max_position_embeddings / original
      d["factor"] = float(c.need("max_position_embeddings")) / float(
          d["original_max_position_embeddings"])
  if kind == "dynamic":       # transformers reads the top-level length for dynamic
    s["max_position_embeddings"] = int(c.need("max_position_embeddings"))
  for k in ROPE_KEYS[kind][2:]:
    if d.get(k) is not None:
      s[k] = d[k] if isinstance(d[k], bool) else float(d[k])
  if kind != "default" and "factor" not in s:
    c.refuse(f"{where}.factor", None, f"rope_type {kind!r} needs a factor")
  if kind == "llama3":
    for k in ("low_freq_factor", "high_freq_factor"):
      if k not in s:
        c.refuse(f"{where}.{k}", None, "rope_type 'llama3' needs it")
  return s


def _act(c: Config, key: str, default: str) -> str:
  name = c.get(key, default)
  if ACTS.get(name) is None:
    c.refuse(key, name, f"implemented: {sorted(k for k, v in ACTS.items() if v)}")
  return ACTS[name]


def _layer_types(c: Config, n: int, window) -> list[str]:
  lt = c.cfg.get("layer_types")
  if lt is not None:
    if len(lt) != n or any(t not in ("full_attention", "sliding_attention") for t in lt):
      c.refuse("layer_types", lt, f"expected {n} entries of 'full_attention' / "
               f"'sliding_attention'")
    return list(lt)
  return ["sliding_attention" if window else "full_attention"] * n


def _settings(c: Config) -> dict:
  """The settings shared by the llama-like families (each family's parse adds its own)."""
  d, h = int(c.need("hidden_size")), int(c.need("num_attention_heads"))
  k = int(c.get("head_dim", d // h))
  return dict(d=d, h=h, g=int(c.get("num_key_value_heads", h)), k=k,
              f=int(c.need("intermediate_size")), n=int(c.need("num_hidden_layers")),
              v=int(c.need("vocab_size")), max_len=int(c.get("max_position_embeddings", 2048)),
              eps=float(c.get("rms_norm_eps", 1e-6)), tied=bool(c.get("tie_word_embeddings",
                                                                       False)))


def _finish(c, s, layer_types, window, **rope_kw):
  s["layer_types"] = layer_types
  s["window"] = None if window is None else int(window)
  s["rope"] = _rope_settings(c, s["k"], layer_types, **rope_kw)
  return s


def _parse_llama(c: Config) -> dict:
  s = _settings(c)
  s["act"] = _act(c, "hidden_act", "silu")
  s["attn_bias"] = s["o_bias"] = bool(c.get("attention_bias", False))
  s["mlp_bias"] = bool(c.get("mlp_bias", False))
  window = c.get("sliding_window") if c.family.name == "mistral" else None
  return _finish(c, s, _layer_types(c, s["n"], window), window)


def _parse_qwen(c: Config) -> dict:
  s = _settings(c)
  s["act"] = _act(c, "hidden_act", "silu")
  s["attn_bias"] = c.family.name == "qwen2" or bool(c.get("attention_bias", False))
  s["o_bias"] = c.family.name == "qwen3" and bool(c.get("attention_bias", False))
  s["mlp_bias"] = False
  window = c.get("sliding_window") if c.get("use_sliding_window", False) else None
  lt = c.cfg.get("layer_types")
  if lt is None:
    mwl = int(c.get("max_window_layers", s["n"]))
    lt = ["sliding_attention" if window is not None and i >= mwl else "full_attention"
          for i in range(s["n"])]
  lt = list(lt)
  if window is None and "sliding_attention" in lt:   # transformers: no window set
    lt = ["full_attention"] * s["n"]
  if len(lt) != s["n"]:
    c.refuse("layer_types", lt, f"expected {s['n']} entries")
  return _finish(c, s, lt, window)


def _parse_gemma(c: Config) -> dict:
  s = _settings(c)
  s["act"] = _act(c, "hidden_activation", "gelu_pytorch_tanh")
  if c.cfg.get("hidden_act") is not None and c.cfg.get("hidden_activation") is None:
    s["act"] = _act(c, "hidden_act", "gelu_pytorch_tanh")
  s["attn_bias"] = s["o_bias"] = bool(c.get("attention_bias", False))
  s["mlp_bias"] = False
  s["scale"] = float(c.get("query_pre_attn_scalar", s["k"])) ** -0.5
  s["attn_softcap"] = c.get("attn_logit_softcapping")
  s["final_softcap"] = c.get("final_logit_softcapping")
  s["embed_scale"] = float(np.float32(s["d"] ** 0.5))
  window = c.get("sliding_window")
  lt = c.cfg.get("layer_types")
  if lt is None:
    if c.family.name == "gemma2":
      lt = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(s["n"])]
    else:
      pat = int(c.get("sliding_window_pattern", c.get("_sliding_window_pattern", 6)))
      lt = ["sliding_attention" if (i + 1) % pat else "full_attention" for i in range(s["n"])]
  if c.cfg.get("layer_types") is not None:
    lt = _layer_types(c, s["n"], window)
  kw = {}
  if c.family.name == "gemma3":
    kw = dict(local_theta_key="rope_local_base_freq", default_theta=1e6)
  return _finish(c, s, lt, window, **kw)


def _parse_olmo2(c: Config) -> dict:
  s = _settings(c)
  s["act"] = _act(c, "hidden_act", "silu")
  s["attn_bias"] = s["o_bias"] = bool(c.get("attention_bias", False))
  s["mlp_bias"] = False
  return _finish(c, s, ["full_attention"] * s["n"], None)


def _parse_phi3(c: Config) -> dict:
  s = _settings(c)
  s["act"] = _act(c, "hidden_act", "silu")
  s["attn_bias"] = s["o_bias"] = s["mlp_bias"] = False
  window = c.get("sliding_window")
  return _finish(c, s, ["sliding_attention" if window else "full_attention"] * s["n"], window)


def _parse_gpt2(c: Config) -> dict:
  d, h = int(c.get("n_embd", 768)), int(c.get("n_head", 12))
  n = int(c.get("n_layer", 12))
  s = dict(d=d, h=h, g=h, k=d // h, f=int(c.get("n_inner") or 4 * d), n=n,
           v=int(c.get("vocab_size", 50257)), max_len=int(c.get("n_positions", 1024)),
           eps=float(c.get("layer_norm_epsilon", 1e-5)),
           tied=bool(c.get("tie_word_embeddings", True)))
  s["act"] = _act(c, "activation_function", "gelu_new")
  base = (s["k"] ** -0.5) if c.get("scale_attn_weights", True) else 1.0
  inv = bool(c.get("scale_attn_by_inverse_layer_idx", False))
  s["scale"] = [base / (i + 1) if inv else base for i in range(n)]
  s["layer_types"], s["window"], s["rope"] = ["full_attention"] * n, None, None
  return s


def _parse_neox(c: Config) -> dict:
  s = _settings(c)
  s["g"] = s["h"]
  s["k"] = s["d"] // s["h"]
  s["eps"] = float(c.get("layer_norm_eps", 1e-5))
  s["act"] = _act(c, "hidden_act", "gelu")
  s["attn_bias"] = s["o_bias"] = bool(c.get("attention_bias", True))
  s["parallel"] = bool(c.get("use_parallel_residual", True))
  return _finish(c, s, ["full_attention"] * s["n"], None, legacy_theta_key="rotary_emb_base",
                 legacy_partial_key="rotary_pct", default_partial=0.25)


def _parse_opt(c: Config) -> dict:
  d, h = int(c.need("hidden_size")), int(c.need("num_attention_heads"))
  if int(c.get("word_embed_proj_dim", d)) != d:
    c.refuse("word_embed_proj_dim", c.cfg["word_embed_proj_dim"], f"the project_in / "
             f"project_out projections (width != hidden_size={d}) are not implemented")
  s = dict(d=d, h=h, g=h, k=d // h, f=int(c.need("ffn_dim")), n=int(c.need("num_hidden_layers")),
           v=int(c.need("vocab_size")), max_len=int(c.get("max_position_embeddings", 2048)),
           eps=1e-5, tied=bool(c.get("tie_word_embeddings", True)))
  s["act"] = _act(c, "activation_function", "relu")
  s["attn_bias"] = s["o_bias"] = s["mlp_bias"] = bool(c.get("enable_bias", True))
  s["layer_types"], s["window"], s["rope"] = ["full_attention"] * s["n"], None, None
  return s


def _parse_phi(c: Config) -> dict:
  """Phi (1, 1.5, 2): one LayerNorm feeding attention and MLP in parallel, partial rotary."""
  s = _settings(c)
  s["eps"] = float(c.get("layer_norm_eps", 1e-5))
  s["act"] = _act(c, "hidden_act", "gelu_new")
  s["attn_bias"] = s["o_bias"] = s["mlp_bias"] = True
  s["parallel"] = True
  return _finish(c, s, ["full_attention"] * s["n"], None, default_partial=0.5)


def _parse_stablelm(c: Config) -> dict:
  s = _settings(c)
  s["eps"] = float(c.get("layer_norm_eps", 1e-5))
  s["act"] = _act(c, "hidden_act", "silu")
  s["attn_bias"] = bool(c.get("use_qkv_bias", False))
  s["parallel"] = bool(c.get("use_parallel_residual", False))
  s["sequential"] = not s["parallel"]
  return _finish(c, s, ["full_attention"] * s["n"], None, default_partial=0.25)


def _parse_gptj(c: Config) -> dict:
  d, h = int(c.get("n_embd", 4096)), int(c.get("n_head", 16))
  s = dict(d=d, h=h, g=h, k=d // h, f=int(c.get("n_inner") or 4 * d),
           n=int(c.get("n_layer", 28)), v=int(c.get("vocab_size", 50400)),
           max_len=int(c.get("n_positions", 2048)), eps=float(c.get("layer_norm_epsilon", 1e-5)),
           tied=bool(c.get("tie_word_embeddings", False)))
  s["act"] = _act(c, "activation_function", "gelu_new")
  s["parallel"], s["rope_layout"] = True, "interleaved"
  rot = c.cfg.get("rotary_dim")
  if rot is None or int(rot) > s["k"] or int(rot) < 2 or int(rot) % 2:
    c.refuse("rotary_dim", rot, f"expected an even number of rotated features <= the head "
             f"width {s['k']}")
  s = _finish(c, s, ["full_attention"] * s["n"], None)
  s["rope"]["full_attention"]["dim"] = int(rot)
  return s


def _parse_falcon(c: Config) -> dict:
  """Falcon's three attention layouts (new_decoder_architecture: grouped kv heads;
  multi_query; per-head q, k, v) and its block (parallel with one or two LayerNorms, or
  sequential)."""
  d, h = int(c.need("hidden_size")), int(c.need("num_attention_heads"))
  new, mq = bool(c.get("new_decoder_architecture", False)), bool(c.get("multi_query", True))
  par = bool(c.get("parallel_attn", True))
  n_ln = c.get("num_ln_in_parallel_attn")
  n_ln = 2 if n_ln is None and new else n_ln
  if c.get("alibi", False):
    c.refuse("alibi", True, "Falcon's ALiBi (added before the 1 / sqrt(K) scale) is not "
             "implemented; the RoPE Falcons are")
  if new and not par:
    c.refuse("parallel_attn", False, "transformers' new_decoder_architecture needs it")
  if n_ln not in (None, 1, 2) or (n_ln == 2 and not new):
    c.refuse("num_ln_in_parallel_attn", n_ln, "2 only with new_decoder_architecture, else 1")
  g = int(c.get("num_kv_heads", h)) if new else (1 if mq else h)
  if not new and not mq and int(c.get("num_kv_heads", h)) != h:
    c.refuse("num_kv_heads", c.cfg["num_kv_heads"], "the per-head q, k, v layout has one "
             "kv head per head")
  if c.get("num_key_value_heads") is not None and int(c.get("num_key_value_heads")) != g:
    c.refuse("num_key_value_heads", c.get("num_key_value_heads"), f"the layout above "
             f"(new_decoder_architecture, multi_query, num_kv_heads) gives {g}")
  s = dict(d=d, h=h, g=g, k=d // h, f=int(c.get("ffn_hidden_size") or 4 * d),
           n=int(c.need("num_hidden_layers")), v=int(c.need("vocab_size")),
           max_len=int(c.get("max_position_embeddings", 2048)),
           eps=float(c.get("layer_norm_epsilon", 1e-5)),
           tied=bool(c.get("tie_word_embeddings", True)))
  s["act"] = _act(c, "activation", "gelu")
  s["attn_bias"] = s["o_bias"] = s["mlp_bias"] = bool(c.get("bias", False))
  s["falcon_layout"] = "grouped" if new else ("multi_query" if mq else "per_head")
  s["parallel"] = par
  s["two_ln"] = bool(new and n_ln == 2)
  s["one_ln"] = not s["two_ln"]
  s["sequential"] = not par
  s = _finish(c, s, ["full_attention"] * s["n"], None)
  if s["rope"]["full_attention"]["dim"] != s["k"]:
    c.refuse("rope_parameters.partial_rotary_factor", s["rope"]["full_attention"]["dim"] /
             s["k"], "Falcon rotates the whole head")
  return s


def _parse_smollm3(c: Config) -> dict:
  """SmolLM3: LLaMA with no RoPE in the layers where no_rope_layers[i] is 0 (NoPE)."""
  s = _settings(c)
  s["act"] = _act(c, "hidden_act", "silu")
  s["attn_bias"] = s["o_bias"] = bool(c.get("attention_bias", False))
  s["mlp_bias"] = bool(c.get("mlp_bias", False))
  n = s["n"]
  flags = c.cfg.get("no_rope_layers")
  if flags is None:
    every = int(c.get("no_rope_layer_interval", 4))
    flags = [int((i + 1) % every != 0) for i in range(n)]
  if len(flags) != n or any(f not in (0, 1) for f in flags):
    c.refuse("no_rope_layers", flags, f"expected {n} entries of 0 / 1")
  s["no_rope"] = [i for i, f in enumerate(flags) if not f]
  window = c.get("sliding_window") if c.get("use_sliding_window", False) else None
  lt = c.cfg.get("layer_types")
  if lt is None:
    lt = ["sliding_attention" if window and not flags[i] else "full_attention"
          for i in range(n)]
  lt = _layer_types(c, n, window) if c.cfg.get("layer_types") is not None else lt
  if window is None:    # transformers: no window on any layer without use_sliding_window
    lt = ["full_attention"] * n
  return _finish(c, s, lt, window)


def _parse_olmo3(c: Config) -> dict:
  """OLMo 3: OLMo 2's block with sliding and full layers (layer_types), each type its
  own RoPE."""
  s = _settings(c)
  s["act"] = _act(c, "hidden_act", "silu")
  s["attn_bias"] = s["o_bias"] = bool(c.get("attention_bias", False))
  window = c.get("sliding_window")
  return _finish(c, s, _layer_types(c, s["n"], window), window)


def _parse_cohere(c: Config) -> dict:
  """Cohere (Command-R): one bias-free LayerNorm feeding attention and MLP in parallel,
  interleaved RoPE, logits times logit_scale."""
  s = _settings(c)
  s["eps"] = float(c.get("layer_norm_eps", 1e-5))
  s["act"] = _act(c, "hidden_act", "silu")
  s["attn_bias"] = s["o_bias"] = bool(c.get("attention_bias", False))
  s["parallel"], s["rope_layout"] = True, "interleaved"
  s["tied"] = bool(c.get("tie_word_embeddings", True))
  s["logit_scale"] = float(c.get("logit_scale", 0.0625))
  return _finish(c, s, ["full_attention"] * s["n"], None)


def _parse_granite(c: Config) -> dict:
  """Granite: LLaMA with embedding, residual, attention-score and logit multipliers."""
  s = _parse_llama(c)
  s["embed_scale"] = float(c.get("embedding_multiplier", 1.0))
  s["residual_scale"] = float(c.get("residual_multiplier", 1.0))
  s["scale"] = float(c.get("attention_multiplier", 1.0))
  s["logit_scale"] = 1.0 / float(c.get("logits_scaling", 1.0))
  return s



def _parse_bloom(c: Config) -> dict:
  """BLOOM: ALiBi (no RoPE), a LayerNorm on the embeddings, per-head [q, k, v] rows."""
  d, h = int(c.get("hidden_size", 64)), int(c.get("n_head", 8))
  n = int(c.get("n_layer", 2))
  s = dict(d=d, h=h, g=h, k=d // h, f=4 * d, n=n, v=int(c.get("vocab_size", 250880)),
           max_len=int(c.get("seq_length", c.get("max_position_embeddings", 2048))),
           eps=float(c.get("layer_norm_epsilon", 1e-5)),
           tied=bool(c.get("tie_word_embeddings", True)))
  s["act"], s["alibi"] = "gelu_tanh", True
  s["layer_types"], s["window"], s["rope"] = ["full_attention"] * n, None, None
  return s

def _moe(c: Config, s: dict, experts_key: str, routing: str, f_key: str | None = None):
  """The MoE settings: experts, top-k, routing, expert width, which layers are sparse."""
  e = c.cfg.get(experts_key)
  if e is None and experts_key == "num_experts":   # transformers' alias
    e = c.cfg.get("num_local_experts")
  s["experts"] = int(e if e is not None else c.need(experts_key))
  s["top_k"] = int(c.need("num_experts_per_tok"))
  if not 1 <= s["top_k"] <= s["experts"]:
    c.refuse("num_experts_per_tok", s["top_k"], f"must be 1..{s['experts']} experts")
  s["routing"] = routing
  s["moe_f"] = int(c.need(f_key)) if f_key else s["f"]
  s["moe_layers"] = list(range(s["n"]))
  return s


def _parse_mixtral(c: Config) -> dict:
  s = _parse_llama(c)
  window = c.get("sliding_window")
  s = _finish(c, s, _layer_types(c, s["n"], window), window)
  return _moe(c, s, "num_local_experts", "softmax_renorm")


def _parse_qwen3_moe(c: Config) -> dict:
  """Qwen3-MoE: Qwen3's attention; layer i is sparse unless in mlp_only_layers, and
  only when (i + 1) % decoder_sparse_step == 0."""
  s = _settings(c)
  s["act"] = _act(c, "hidden_act", "silu")
  s["attn_bias"] = s["o_bias"] = bool(c.get("attention_bias", False))
  window = c.get("sliding_window") if c.get("use_sliding_window", False) else None
  s = _finish(c, s, _layer_types(c, s["n"], window), window)
  s = _moe(c, s, "num_experts", "softmax_renorm" if c.get("norm_topk_prob", False)
           else "softmax", "moe_intermediate_size")
  step, only = int(c.get("decoder_sparse_step", 1)), c.get("mlp_only_layers", [])
  if step < 1 or not isinstance(only, list):
    c.refuse("decoder_sparse_step" if step < 1 else "mlp_only_layers", step if step < 1
             else only, "expected a step >= 1 and a list of layer indices")
  s["moe_layers"] = [i for i in range(s["n"]) if i not in only and (i + 1) % step == 0]
  return s


def _parse_olmoe(c: Config) -> dict:
  """OLMoE: OLMo 2's whole-projection QK-norm with pre-norms; softmax routing,
  renormalised with norm_topk_prob."""
  s = _settings(c)
  s["act"] = _act(c, "hidden_act", "silu")
  s["attn_bias"] = s["o_bias"] = bool(c.get("attention_bias", False))
  s = _finish(c, s, ["full_attention"] * s["n"], None)
  return _moe(c, s, "num_experts", "softmax_renorm" if c.get("norm_topk_prob", False)
              else "softmax")


def _parse_gpt_oss(c: Config) -> dict:
  """gpt-oss: a sink logit per head, sliding and full layers, top-k of the router's
  logits then a softmax over them, clamped SwiGLU experts with biases."""
  s = _settings(c)
  s["act"] = "silu"
  if c.get("hidden_act", "silu") != "silu":
    c.refuse("hidden_act", c.cfg["hidden_act"], "gpt-oss's experts run their own clamped "
             "SwiGLU (swiglu_limit, swiglu_alpha)")
  s["attn_bias"] = s["o_bias"] = bool(c.get("attention_bias", True))
  window = c.get("sliding_window")
  s = _finish(c, s, _layer_types(c, s["n"], window), window)
  s = _moe(c, s, "num_local_experts", "topk_softmax")
  s["swiglu_limit"] = float(c.get("swiglu_limit", 7.0))
  s["swiglu_alpha"] = float(c.get("swiglu_alpha", 1.702))
  return s


def _parse_deepseek_v2(c: Config) -> dict:
  """DeepSeek-V2: multi-head latent attention (attention.py), interleaved RoPE on the
  qk_rope_head_dim features, MoE with shared experts after first_k_dense_replace dense
  layers, softmax routing (greedy or group-limited) times routed_scaling_factor."""
  s = _deepseek(c)
  method = c.get("topk_method", "greedy")
  if method not in ("greedy", "group_limited_greedy"):
    c.refuse("topk_method", method, "implemented: greedy, group_limited_greedy")
  if method == "group_limited_greedy":
    n_group, keep = int(c.need("n_group")), int(c.need("topk_group"))
    if s["experts"] % n_group or not 1 <= keep <= n_group:
      c.refuse("n_group", n_group, f"must divide the {s['experts']} experts, with "
               f"topk_group={keep} in 1..n_group")
    s["moe_groups"] = [n_group, keep]
  return s


def _parse_deepseek_v3(c: Config) -> dict:
  """DeepSeek-V3: V2's attention and experts; the router (noaux_tc) scores experts with a
  sigmoid, keeps the topk_group of n_group groups whose two best scores + the
  e_score_correction_bias sum highest, takes the top-k of score + bias there, and weighs
  them by their scores (renormalised with norm_topk_prob) times routed_scaling_factor.
  rope_interleave false: half-split RoPE."""
  s = _deepseek(c)
  s["routing"] = "sigmoid_renorm" if c.get("norm_topk_prob", True) else "sigmoid"
  e, n_group, keep = s["experts"], int(c.get("n_group") or 1), int(c.get("topk_group") or 1)
  if e % n_group or e // n_group < 2 or not 1 <= keep <= n_group:
    c.refuse("n_group", n_group, f"must divide the {e} experts into groups of 2 or more, "
             f"with topk_group={keep} in 1..n_group")
  if s["top_k"] > keep * (e // n_group):
    c.refuse("num_experts_per_tok", s["top_k"], f"more than the {keep * (e // n_group)} "
             f"experts of the topk_group={keep} groups")
  s["moe_groups"] = [n_group, keep]
  s["mtp_layers"] = int(c.get("num_nextn_predict_layers", 0))
  if not c.get("rope_interleave", True):
    s["rope_layout"] = "half"
  if not s["shared"]:
    c.refuse("n_shared_experts", c.cfg.get("n_shared_experts"), "DeepSeek-V3's MoE "
             "always runs its shared experts")
  return s


def _deepseek(c: Config) -> dict:
  """The settings DeepSeek-V2 and V3 share: MLA, experts, dense first layers."""
  s = _settings(c)
  s["act"] = _act(c, "hidden_act", "silu")
  h = s["h"]
  if int(c.get("num_key_value_heads", h)) != h:
    c.refuse("num_key_value_heads", c.cfg["num_key_value_heads"], "MLA decompresses a key "
             "and a value per head: it must equal num_attention_heads")
  r, kn = int(c.need("qk_rope_head_dim")), int(c.need("qk_nope_head_dim"))
  q = c.cfg.get("q_lora_rank")
  s["mla"] = dict(c=int(c.need("kv_lora_rank")), r=r, kn=kn, v=int(c.need("v_head_dim")),
                  cq=None if q is None else int(q))
  s["low_rank_q"] = q is not None
  s["full_q"] = q is None
  s["g"], s["k"], s["rope_layout"] = h, r + kn, "interleaved"
  s = _finish(c, s, ["full_attention"] * s["n"], None)
  rope = s["rope"]["full_attention"]
  rope["dim"] = r
  scale = (r + kn) ** -0.5
  if rope["type"] != "default" and rope.get("mscale_all_dim"):
    m = rope.get("factor", 1.0)
    m = 1.0 if m <= 1 else 0.1 * rope["mscale_all_dim"] * float(np.log(m)) + 1.0
    scale = scale * m * m
  s["scale"] = scale
  s = _moe(c, s, "n_routed_experts", "softmax", "moe_intermediate_size")
  s["moe_layers"] = list(range(int(c.get("first_k_dense_replace", 0)), s["n"]))
  s["moe_scale"] = float(c.get("routed_scaling_factor", 1.0))
  s["shared_f"] = s["moe_f"] * int(c.get("n_shared_experts") or 0)
  s["shared"] = s["shared_f"] > 0
  return s

# ---------------------------------------------------------------------------------------
# The families.
# ---------------------------------------------------------------------------------------

_ATTN = (("self_attn.q_proj.weight", "q", "attn.wq", None),
         ("self_attn.k_proj.weight", "kv", "attn.wk", None),
         ("self_attn.v_proj.weight", "kv", "attn.wv", None),
         ("self_attn.o_proj.weight", "o", "attn.wo", None),
         ("self_attn.q_proj.bias", "bq", "attn.bq", "attn_bias"),
         ("self_attn.k_proj.bias", "bkv", "attn.bk", "attn_bias"),
         ("self_attn.v_proj.bias", "bkv", "attn.bv", "attn_bias"),
         ("self_attn.o_proj.bias", "vec", "attn.bo", "o_bias"))
_MLP = (("mlp.gate_proj.weight", "lin", "mlp.w_gate", None),
        ("mlp.up_proj.weight", "lin", "mlp.w_up", None),
        ("mlp.down_proj.weight", "lin", "mlp.w_down", None),
        ("mlp.gate_proj.bias", "vec", "mlp.b_gate", "mlp_bias"),
        ("mlp.up_proj.bias", "vec", "mlp.b_up", "mlp_bias"),
        ("mlp.down_proj.bias", "vec", "mlp.b_down", "mlp_bias"))
_LLAMA_NORMS = (("input_layernorm.weight", "vec", "ln1.scale", None),
                ("post_attention_layernorm.weight", "vec", "ln2.scale", None))
_TOP = (("embed_tokens.weight", "vec", "embed", None),
        ("norm.weight", "vec", "lm.ln_final.scale", None),
        ("lm_head.weight", "lin", "unembed", "untied"))

# Mixture-of-experts config keys used only in training (the auxiliary loss).
_MOE_TRAINING_KEYS = {"output_router_logits": IGNORE, "router_aux_loss_coef": IGNORE}
# Qwen-MoE / OLMoE experts: a router and per-expert SwiGLUs, taken on the sparse layers.
_MOE_ROWS = (("mlp.gate.weight", "lin", "mlp.router", "moe"),
             ("mlp.experts.{e}.gate_proj.weight", "experts_in", "mlp.w_gate", "moe"),
             ("mlp.experts.{e}.up_proj.weight", "experts_in", "mlp.w_up", "moe"),
             ("mlp.experts.{e}.down_proj.weight", "experts_out", "mlp.w_down", "moe"))

_LLAMA_KEYS = {"vocab_size": USE, "hidden_size": USE, "intermediate_size": USE,
               "num_hidden_layers": USE, "num_attention_heads": USE,
               "num_key_value_heads": USE, "head_dim": USE, "hidden_act": USE,
               "rms_norm_eps": USE, "pretraining_tp": (1,), "attention_bias": USE,
               "mlp_bias": USE}

# Gemma 2 and 3: the config keys they share and the norms before and after attention and MLP.
_GEMMA_KEYS = {
    "vocab_size": USE, "hidden_size": USE, "intermediate_size": USE,
    "num_hidden_layers": USE, "num_attention_heads": USE, "num_key_value_heads": USE,
    "head_dim": USE, "hidden_activation": USE, "hidden_act": USE,
    "rms_norm_eps": USE, "attention_bias": USE, "query_pre_attn_scalar": USE,
    "sliding_window": USE, "layer_types": USE, "final_logit_softcapping": USE,
    "attn_logit_softcapping": USE, "use_bidirectional_attention": (None, False)}
_GEMMA_NORMS = (("input_layernorm.weight", "vec", "ln1.scale", None),
                ("post_attention_layernorm.weight", "vec", "ln1_post.scale", None),
                ("pre_feedforward_layernorm.weight", "vec", "ln2.scale", None),
                ("post_feedforward_layernorm.weight", "vec", "ln2_post.scale", None))
# DeepSeek-V2 and V3: their shared config keys and tensors (MLA, experts, shared experts,
# dense first layers).
_DEEPSEEK_KEYS = {
    "vocab_size": USE, "hidden_size": USE, "intermediate_size": USE,
    "num_hidden_layers": USE, "num_attention_heads": USE, "num_key_value_heads": USE,
    "hidden_act": USE, "rms_norm_eps": USE, "pretraining_tp": (1,),
    "attention_bias": (False,), "mlp_bias": (False,), "kv_lora_rank": USE,
    "q_lora_rank": USE, "qk_rope_head_dim": USE, "qk_nope_head_dim": USE,
    "v_head_dim": USE, "qk_head_dim": IGNORE, "head_dim": IGNORE,   # derived
    "n_routed_experts": USE, "num_experts_per_tok": USE, "n_shared_experts": USE,
    "moe_intermediate_size": USE, "first_k_dense_replace": USE,
    "routed_scaling_factor": USE, "n_group": USE, "topk_group": USE, **_MOE_TRAINING_KEYS}
_DEEPSEEK_LAYER = _LLAMA_NORMS + (
    ("self_attn.q_proj.weight", "mla_q", "attn.wq", "full_q"),
    ("self_attn.q_a_proj.weight", "lin", "attn.wq_a", "low_rank_q"),
    ("self_attn.q_a_layernorm.weight", "vec", "attn.q_a_norm", "low_rank_q"),
    ("self_attn.q_b_proj.weight", "mla_q", "attn.wq", "low_rank_q"),
    ("self_attn.kv_a_proj_with_mqa.weight", "mla_kv_a", "attn", None),
    ("self_attn.kv_a_layernorm.weight", "vec", "attn.kv_a_norm", None),
    ("self_attn.kv_b_proj.weight", "mla_kv_b", "attn", None),
    ("self_attn.o_proj.weight", "mla_o", "attn.wo", None)) + _MOE_ROWS + (
    ("mlp.shared_experts.gate_proj.weight", "lin", "mlp.shared.w_gate", "moe_shared"),
    ("mlp.shared_experts.up_proj.weight", "lin", "mlp.shared.w_up", "moe_shared"),
    ("mlp.shared_experts.down_proj.weight", "lin", "mlp.shared.w_down", "moe_shared")) + tuple(
    (n, k, t, "dense") for n, k, t, _ in _MLP[:3])
FAMILIES = {f.name: f for f in (
    Family("llama", ("llama",), _LLAMA_KEYS, _TOP, _LLAMA_NORMS + _ATTN + _MLP,
           parse=_parse_llama),
    Family("mistral", ("mistral",),
           {**{k: v for k, v in _LLAMA_KEYS.items() if k not in ("pretraining_tp",
                                                                   "attention_bias",
                                                                   "mlp_bias")},
            "sliding_window": USE},
           _TOP, _LLAMA_NORMS + _ATTN[:4] + _MLP[:3], parse=_parse_llama),
    Family("qwen2", ("qwen2",),
           {**{k: v for k, v in _LLAMA_KEYS.items() if k not in ("pretraining_tp",
                                                                   "attention_bias",
                                                                   "mlp_bias", "head_dim")},
            "use_sliding_window": USE, "sliding_window": USE, "max_window_layers": USE,
            "layer_types": USE, "use_mrope": (False,)},
           _TOP, _LLAMA_NORMS + _ATTN[:7] + _MLP[:3], parse=_parse_qwen),
    Family("qwen3", ("qwen3",),
           {**{k: v for k, v in _LLAMA_KEYS.items() if k not in ("pretraining_tp",
                                                                   "mlp_bias")},
            "use_sliding_window": USE, "sliding_window": USE, "max_window_layers": USE,
            "layer_types": USE},
           _TOP, _LLAMA_NORMS + _ATTN + _MLP[:3] + (
               ("self_attn.q_norm.weight", "head_norm", "attn.q_norm", None),
               ("self_attn.k_norm.weight", "head_norm", "attn.k_norm", None)),
           parse=_parse_qwen),
    Family("gemma2", ("gemma2",),
           {**_GEMMA_KEYS, "sliding_window_size": IGNORE},
           _TOP, _GEMMA_NORMS + _ATTN + _MLP[:3], plus_one=True, parse=_parse_gemma),
    Family("gemma3", ("gemma3_text",),
           {**_GEMMA_KEYS,
            "_sliding_window_pattern": USE, "sliding_window_pattern": USE,
            "rope_local_base_freq": USE},
           _TOP, _GEMMA_NORMS + (("self_attn.q_norm.weight", "head_norm", "attn.q_norm", None),
                  ("self_attn.k_norm.weight", "head_norm", "attn.k_norm", None))
           + _ATTN + _MLP[:3], plus_one=True, parse=_parse_gemma),
    Family("olmo2", ("olmo2",),
           {k: v for k, v in _LLAMA_KEYS.items() if k not in ("pretraining_tp", "mlp_bias",
                                                               "head_dim")},
           _TOP, (("post_attention_layernorm.weight", "vec", "ln1_post.scale", None),
                  ("post_feedforward_layernorm.weight", "vec", "ln2_post.scale", None),
                  ("self_attn.q_norm.weight", "whole_q", "attn.q_norm", None),
                  ("self_attn.k_norm.weight", "whole_k", "attn.k_norm", None))
           + _ATTN + _MLP[:3], parse=_parse_olmo2),
    Family("phi3", ("phi3",),
           {"vocab_size": USE, "hidden_size": USE, "intermediate_size": USE,
            "num_hidden_layers": USE, "num_attention_heads": USE, "num_key_value_heads": USE,
            "resid_pdrop": IGNORE, "embd_pdrop": IGNORE, "hidden_act": USE,
            "original_max_position_embeddings": USE, "rms_norm_eps": USE,
            "sliding_window": USE, "partial_rotary_factor": USE, "head_dim": USE},
           _TOP, _LLAMA_NORMS + (
               ("self_attn.qkv_proj.weight", "qkv", "attn", None),
               ("self_attn.o_proj.weight", "o", "attn.wo", None),
               ("mlp.gate_up_proj.weight", "gate_up", "mlp", None),
               ("mlp.down_proj.weight", "lin", "mlp.w_down", None)),
           parse=_parse_phi3),
    Family("gpt2", ("gpt2",),
           {"vocab_size": USE, "n_positions": USE, "n_embd": USE, "n_layer": USE,
            "n_head": USE, "n_inner": USE, "activation_function": USE,
            "resid_pdrop": IGNORE, "embd_pdrop": IGNORE, "attn_pdrop": IGNORE,
            "layer_norm_epsilon": USE, "summary_type": IGNORE, "summary_use_proj": IGNORE,
            "summary_activation": IGNORE, "summary_proj_to_labels": IGNORE,
            "summary_first_dropout": IGNORE, "scale_attn_weights": USE,
            "scale_attn_by_inverse_layer_idx": USE, "reorder_and_upcast_attn": IGNORE,
            "n_ctx": IGNORE},
           (("wte.weight", "vec", "embed", None), ("wpe.weight", "vec", "pos_embed", None),
            ("ln_f.weight", "vec", "lm.ln_final.scale", None),
            ("ln_f.bias", "vec", "lm.ln_final.bias", None),
            ("lm_head.weight", "lin", "unembed", "untied")),
           (("ln_1.weight", "vec", "ln1.scale", None), ("ln_1.bias", "vec", "ln1.bias", None),
            ("attn.c_attn.weight", "gpt2_qkv", "attn", None),
            ("attn.c_attn.bias", "gpt2_qkv", "attn.b", None),
            ("attn.c_proj.weight", "gpt2_o", "attn.wo", None),
            ("attn.c_proj.bias", "vec", "attn.bo", None),
            ("ln_2.weight", "vec", "ln2.scale", None), ("ln_2.bias", "vec", "ln2.bias", None),
            ("mlp.c_fc.weight", "conv", "mlp.w_up", None),
            ("mlp.c_fc.bias", "vec", "mlp.b_up", None),
            ("mlp.c_proj.weight", "conv", "mlp.w_down", None),
            ("mlp.c_proj.bias", "vec", "mlp.b_down", None)),
           prefixes=("transformer.", ""), layer_prefix="h.{i}.", norm="layer",
           ignore_tensors=("attn.bias", "attn.masked_bias"), parse=_parse_gpt2),
    Family("gpt_neox", ("gpt_neox",),
           {"vocab_size": USE, "hidden_size": USE, "num_hidden_layers": USE,
            "num_attention_heads": USE, "intermediate_size": USE, "hidden_act": USE,
            "hidden_dropout": IGNORE, "classifier_dropout": IGNORE, "layer_norm_eps": USE,
            "use_parallel_residual": USE, "attention_bias": USE, "rotary_pct": USE,
            "rotary_emb_base": USE, "partial_rotary_factor": USE},
           (("embed_in.weight", "vec", "embed", None),
            ("final_layer_norm.weight", "vec", "lm.ln_final.scale", None),
            ("final_layer_norm.bias", "vec", "lm.ln_final.bias", None),
            ("embed_out.weight", "lin", "unembed", "untied")),
           (("input_layernorm.weight", "vec", "ln1.scale", None),
            ("input_layernorm.bias", "vec", "ln1.bias", None),
            ("post_attention_layernorm.weight", "vec", "ln2.scale", None),
            ("post_attention_layernorm.bias", "vec", "ln2.bias", None),
            ("attention.query_key_value.weight", "neox_qkv", "attn", None),
            ("attention.query_key_value.bias", "neox_qkv", "attn.b", "attn_bias"),
            ("attention.dense.weight", "o", "attn.wo", None),
            ("attention.dense.bias", "vec", "attn.bo", "o_bias"),
            ("mlp.dense_h_to_4h.weight", "lin", "mlp.w_up", None),
            ("mlp.dense_h_to_4h.bias", "vec", "mlp.b_up", None),
            ("mlp.dense_4h_to_h.weight", "lin", "mlp.w_down", None),
            ("mlp.dense_4h_to_h.bias", "vec", "mlp.b_down", None)),
           prefixes=("gpt_neox.", ""), norm="layer",
           ignore_tensors=("rotary_emb.inv_freq", "attention.bias", "attention.masked_bias"),
           parse=_parse_neox),
    Family("opt", ("opt",),
           {"vocab_size": USE, "hidden_size": USE, "num_hidden_layers": USE, "ffn_dim": USE,
            "num_attention_heads": USE, "activation_function": USE, "dropout": IGNORE,
            "layerdrop": IGNORE, "init_std": IGNORE, "enable_bias": USE,
            "word_embed_proj_dim": USE, "do_layer_norm_before": (True,),
            "_remove_final_layer_norm": (False,), "layer_norm_elementwise_affine": (True,)},
           (("embed_tokens.weight", "vec", "embed", None),
            ("embed_positions.weight", "pos_offset", "pos_embed", None),
            ("final_layer_norm.weight", "vec", "lm.ln_final.scale", None),
            ("final_layer_norm.bias", "vec", "lm.ln_final.bias", None),
            ("lm_head.weight", "lin", "unembed", "untied")),
           (("self_attn_layer_norm.weight", "vec", "ln1.scale", None),
            ("self_attn_layer_norm.bias", "vec", "ln1.bias", None),
            ("self_attn.q_proj.weight", "q", "attn.wq", None),
            ("self_attn.k_proj.weight", "kv", "attn.wk", None),
            ("self_attn.v_proj.weight", "kv", "attn.wv", None),
            ("self_attn.out_proj.weight", "o", "attn.wo", None),
            ("self_attn.q_proj.bias", "bq", "attn.bq", "attn_bias"),
            ("self_attn.k_proj.bias", "bkv", "attn.bk", "attn_bias"),
            ("self_attn.v_proj.bias", "bkv", "attn.bv", "attn_bias"),
            ("self_attn.out_proj.bias", "vec", "attn.bo", "o_bias"),
            ("final_layer_norm.weight", "vec", "ln2.scale", None),
            ("final_layer_norm.bias", "vec", "ln2.bias", None),
            ("fc1.weight", "lin", "mlp.w_up", None), ("fc1.bias", "vec", "mlp.b_up", "mlp_bias"),
            ("fc2.weight", "lin", "mlp.w_down", None),
            ("fc2.bias", "vec", "mlp.b_down", "mlp_bias")),
           prefixes=("model.decoder.", "decoder.", ""), norm="layer", parse=_parse_opt),
    Family("phi", ("phi",),
           {"vocab_size": USE, "hidden_size": USE, "intermediate_size": USE,
            "num_hidden_layers": USE, "num_attention_heads": USE, "num_key_value_heads": USE,
            "head_dim": USE, "hidden_act": USE, "layer_norm_eps": USE, "resid_pdrop": IGNORE,
            "embd_pdrop": IGNORE, "qk_layernorm": (False,), "partial_rotary_factor": USE},
           (("embed_tokens.weight", "vec", "embed", None),
            ("final_layernorm.weight", "vec", "lm.ln_final.scale", None),
            ("final_layernorm.bias", "vec", "lm.ln_final.bias", None),
            ("lm_head.weight", "lin", "unembed", "untied"),
            ("lm_head.bias", "vec", "unembed_bias", None)),
           (("input_layernorm.weight", "vec", "ln1.scale", None),
            ("input_layernorm.bias", "vec", "ln1.bias", None)) + _ATTN[:3] + (
               ("self_attn.dense.weight", "o", "attn.wo", None),) + _ATTN[4:7] + (
               ("self_attn.dense.bias", "vec", "attn.bo", None),
               ("mlp.fc1.weight", "lin", "mlp.w_up", None), ("mlp.fc1.bias", "vec", "mlp.b_up", None),
               ("mlp.fc2.weight", "lin", "mlp.w_down", None),
               ("mlp.fc2.bias", "vec", "mlp.b_down", None)),
           norm="layer", parse=_parse_phi),
    Family("stablelm", ("stablelm",),
           {"vocab_size": USE, "hidden_size": USE, "intermediate_size": USE,
            "num_hidden_layers": USE, "num_attention_heads": USE, "num_key_value_heads": USE,
            "hidden_act": USE, "layer_norm_eps": USE, "hidden_dropout": IGNORE,
            "use_qkv_bias": USE, "use_parallel_residual": USE, "qk_layernorm": (False,),
            "partial_rotary_factor": USE},
           (("embed_tokens.weight", "vec", "embed", None),
            ("norm.weight", "vec", "lm.ln_final.scale", None),
            ("norm.bias", "vec", "lm.ln_final.bias", None),
            ("lm_head.weight", "lin", "unembed", "untied")),
           (("input_layernorm.weight", "vec", "ln1.scale", None),
            ("input_layernorm.bias", "vec", "ln1.bias", None),
            ("post_attention_layernorm.weight", "vec", "ln2.scale", "sequential"),
            ("post_attention_layernorm.bias", "vec", "ln2.bias", "sequential"))
           + _ATTN[:7] + _MLP[:3], norm="layer", parse=_parse_stablelm),
    Family("gptj", ("gptj",),
           {"vocab_size": USE, "n_positions": USE, "n_embd": USE, "n_layer": USE,
            "n_head": USE, "rotary_dim": USE, "n_inner": USE, "activation_function": USE,
            "resid_pdrop": IGNORE, "embd_pdrop": IGNORE, "attn_pdrop": IGNORE,
            "layer_norm_epsilon": USE},
           (("wte.weight", "vec", "embed", None),
            ("ln_f.weight", "vec", "lm.ln_final.scale", None),
            ("ln_f.bias", "vec", "lm.ln_final.bias", None),
            ("lm_head.weight", "lin", "unembed", "untied"),
            ("lm_head.bias", "vec", "unembed_bias", None)),
           (("ln_1.weight", "vec", "ln1.scale", None), ("ln_1.bias", "vec", "ln1.bias", None),
            ("attn.q_proj.weight", "q", "attn.wq", None),
            ("attn.k_proj.weight", "kv", "attn.wk", None),
            ("attn.v_proj.weight", "kv", "attn.wv", None),
            ("attn.out_proj.weight", "o", "attn.wo", None),
            ("mlp.fc_in.weight", "lin", "mlp.w_up", None),
            ("mlp.fc_in.bias", "vec", "mlp.b_up", None),
            ("mlp.fc_out.weight", "lin", "mlp.w_down", None),
            ("mlp.fc_out.bias", "vec", "mlp.b_down", None)),
           prefixes=("transformer.", ""), layer_prefix="h.{i}.", norm="layer",
           ignore_tensors=("attn.bias", "attn.masked_bias", "embed_positions"),
           parse=_parse_gptj),
    Family("falcon", ("falcon",),
           {"vocab_size": USE, "hidden_size": USE, "num_hidden_layers": USE,
            "num_attention_heads": USE, "num_kv_heads": USE, "layer_norm_epsilon": USE,
            "num_key_value_heads": USE,   # derived (newer transformers write it); must agree
            "hidden_dropout": IGNORE, "activation": USE, "alibi": USE, "bias": USE,
            "ffn_hidden_size": USE, "multi_query": USE, "new_decoder_architecture": USE,
            "num_ln_in_parallel_attn": USE, "parallel_attn": USE},
           (("word_embeddings.weight", "vec", "embed", None),
            ("ln_f.weight", "vec", "lm.ln_final.scale", None),
            ("ln_f.bias", "vec", "lm.ln_final.bias", None),
            ("lm_head.weight", "lin", "unembed", "untied")),
           (("input_layernorm.weight", "vec", "ln1.scale", "one_ln"),
            ("input_layernorm.bias", "vec", "ln1.bias", "one_ln"),
            ("ln_attn.weight", "vec", "ln1.scale", "two_ln"),
            ("ln_attn.bias", "vec", "ln1.bias", "two_ln"),
            ("ln_mlp.weight", "vec", "ln2.scale", "two_ln"),
            ("ln_mlp.bias", "vec", "ln2.bias", "two_ln"),
            ("post_attention_layernorm.weight", "vec", "ln2.scale", "sequential"),
            ("post_attention_layernorm.bias", "vec", "ln2.bias", "sequential"),
            ("self_attention.query_key_value.weight", "falcon_qkv", "attn", None),
            ("self_attention.query_key_value.bias", "falcon_qkv", "attn.b", "attn_bias"),
            ("self_attention.dense.weight", "o", "attn.wo", None),
            ("self_attention.dense.bias", "vec", "attn.bo", "o_bias"),
            ("mlp.dense_h_to_4h.weight", "lin", "mlp.w_up", None),
            ("mlp.dense_h_to_4h.bias", "vec", "mlp.b_up", "mlp_bias"),
            ("mlp.dense_4h_to_h.weight", "lin", "mlp.w_down", None),
            ("mlp.dense_4h_to_h.bias", "vec", "mlp.b_down", "mlp_bias")),
           prefixes=("transformer.", ""), layer_prefix="h.{i}.", norm="layer",
           parse=_parse_falcon),
    Family("smollm3", ("smollm3",),
           {**{k: v for k, v in _LLAMA_KEYS.items() if k not in ("pretraining_tp", "head_dim")},
            "use_sliding_window": USE, "sliding_window": USE, "layer_types": USE,
            "no_rope_layers": USE, "no_rope_layer_interval": USE},
           _TOP, _LLAMA_NORMS + _ATTN + _MLP, parse=_parse_smollm3),
    Family("olmo3", ("olmo3",),
           {k: v for k, v in _LLAMA_KEYS.items() if k not in ("pretraining_tp", "mlp_bias",
                                                               "head_dim")}
           | {"sliding_window": USE, "layer_types": USE},
           _TOP, (("post_attention_layernorm.weight", "vec", "ln1_post.scale", None),
                  ("post_feedforward_layernorm.weight", "vec", "ln2_post.scale", None),
                  ("self_attn.q_norm.weight", "whole_q", "attn.q_norm", None),
                  ("self_attn.k_norm.weight", "whole_k", "attn.k_norm", None))
           + _ATTN + _MLP[:3], parse=_parse_olmo3),
    Family("cohere", ("cohere",),
           {"vocab_size": USE, "hidden_size": USE, "intermediate_size": USE,
            "num_hidden_layers": USE, "num_attention_heads": USE, "num_key_value_heads": USE,
            "hidden_act": USE, "layer_norm_eps": USE, "attention_bias": USE,
            "logit_scale": USE, "use_qk_norm": (False,)},
           _TOP, (("input_layernorm.weight", "vec", "ln1.scale", None),) + _ATTN + _MLP[:3],
           norm="layer", parse=_parse_cohere),
    Family("bloom", ("bloom",),
           {"vocab_size": USE, "hidden_size": USE, "n_layer": USE, "n_head": USE,
            "layer_norm_epsilon": USE, "hidden_dropout": IGNORE, "seq_length": IGNORE,
            "apply_residual_connection_post_layernorm": (False,),
            # tensor-parallel slicing of the same sums (rounding order only)
            "pretraining_tp": IGNORE, "slow_but_exact": IGNORE},
           (("word_embeddings.weight", "vec", "embed", None),
            ("word_embeddings_layernorm.weight", "vec", "ln_embed.scale", None),
            ("word_embeddings_layernorm.bias", "vec", "ln_embed.bias", None),
            ("ln_f.weight", "vec", "lm.ln_final.scale", None),
            ("ln_f.bias", "vec", "lm.ln_final.bias", None),
            ("lm_head.weight", "lin", "unembed", "untied")),
           (("input_layernorm.weight", "vec", "ln1.scale", None),
            ("input_layernorm.bias", "vec", "ln1.bias", None),
            ("post_attention_layernorm.weight", "vec", "ln2.scale", None),
            ("post_attention_layernorm.bias", "vec", "ln2.bias", None),
            ("self_attention.query_key_value.weight", "neox_qkv", "attn", None),
            ("self_attention.query_key_value.bias", "neox_qkv", "attn.b", None),
            ("self_attention.dense.weight", "o", "attn.wo", None),
            ("self_attention.dense.bias", "vec", "attn.bo", None),
            ("mlp.dense_h_to_4h.weight", "lin", "mlp.w_up", None),
            ("mlp.dense_h_to_4h.bias", "vec", "mlp.b_up", None),
            ("mlp.dense_4h_to_h.weight", "lin", "mlp.w_down", None),
            ("mlp.dense_4h_to_h.bias", "vec", "mlp.b_down", None)),
           prefixes=("transformer.", ""), layer_prefix="h.{i}.", norm="layer",
           parse=_parse_bloom),
    Family("mixtral", ("mixtral",),
           {**{k: v for k, v in _LLAMA_KEYS.items() if k not in ("pretraining_tp",
                                                                   "attention_bias",
                                                                   "mlp_bias")},
            "sliding_window": USE, "num_local_experts": USE, "num_experts_per_tok": USE,
            "router_jitter_noise": IGNORE, **_MOE_TRAINING_KEYS},
           _TOP, _LLAMA_NORMS + _ATTN[:4] + (
               ("block_sparse_moe.gate.weight", "lin", "mlp.router", None),
               ("block_sparse_moe.experts.{e}.w1.weight", "experts_in", "mlp.w_gate", None),
               ("block_sparse_moe.experts.{e}.w3.weight", "experts_in", "mlp.w_up", None),
               ("block_sparse_moe.experts.{e}.w2.weight", "experts_out", "mlp.w_down", None)),
           parse=_parse_mixtral),
    Family("qwen3_moe", ("qwen3_moe",),
           {**{k: v for k, v in _LLAMA_KEYS.items() if k not in ("pretraining_tp",
                                                                   "mlp_bias")},
            "use_sliding_window": USE, "sliding_window": USE, "layer_types": USE,
            "max_window_layers": (None,), "num_experts": USE, "num_local_experts": USE,
            "num_experts_per_tok": USE, "moe_intermediate_size": USE, "norm_topk_prob": USE,
            "decoder_sparse_step": USE, "mlp_only_layers": USE, **_MOE_TRAINING_KEYS},
           _TOP, _LLAMA_NORMS + _ATTN + (
               ("self_attn.q_norm.weight", "head_norm", "attn.q_norm", None),
               ("self_attn.k_norm.weight", "head_norm", "attn.k_norm", None))
           + _MOE_ROWS + tuple((n, k, t, "dense") for n, k, t, _ in _MLP[:3]),
           parse=_parse_qwen3_moe),
    Family("olmoe", ("olmoe",),
           {**{k: v for k, v in _LLAMA_KEYS.items() if k not in ("pretraining_tp",
                                                                   "mlp_bias", "head_dim")},
            "num_experts": USE, "num_experts_per_tok": USE, "norm_topk_prob": USE,
            "clip_qkv": (None,), **_MOE_TRAINING_KEYS},
           _TOP, _LLAMA_NORMS + _ATTN + (
               ("self_attn.q_norm.weight", "whole_q", "attn.q_norm", None),
               ("self_attn.k_norm.weight", "whole_k", "attn.k_norm", None)) + _MOE_ROWS,
           parse=_parse_olmoe),
    Family("gpt_oss", ("gpt_oss",),
           {**{k: v for k, v in _LLAMA_KEYS.items() if k not in ("pretraining_tp",
                                                                   "mlp_bias")},
            "sliding_window": USE, "layer_types": USE, "num_local_experts": USE,
            "num_experts_per_tok": USE, "swiglu_limit": USE, "swiglu_alpha": USE,
            **_MOE_TRAINING_KEYS},
           _TOP, _LLAMA_NORMS + _ATTN + (
               ("self_attn.sinks", "vec", "attn.sink_logit", None),
               ("mlp.router.weight", "lin", "mlp.router", None),
               ("mlp.router.bias", "vec", "mlp.router_bias", None),
               ("mlp.experts.gate_up_proj", "oss_gate_up", "mlp", None),
               ("mlp.experts.gate_up_proj_bias", "oss_gate_up", "mlp", None),
               ("mlp.experts.down_proj", "conv", "mlp.w_down", None),
               ("mlp.experts.down_proj_bias", "vec", "mlp.b_down", None)),
           parse=_parse_gpt_oss),
    Family("deepseek_v2", ("deepseek_v2",), _DEEPSEEK_KEYS | {
        "topk_method": USE,
        # transformers' DeepSeek-V2 router does not read it (no renormalisation)
        "norm_topk_prob": IGNORE}, _TOP, _DEEPSEEK_LAYER, parse=_parse_deepseek_v2),
    Family("deepseek_v3", ("deepseek_v3",), _DEEPSEEK_KEYS | {
        "norm_topk_prob": USE, "rope_interleave": USE,
        # the multi-token-prediction layers: their tensors are skipped (build_params)
        "num_nextn_predict_layers": USE, "num_mtp_layers": IGNORE,
        # DeepSeek's own config.json spellings of what V3 always does
        "topk_method": ("noaux_tc",), "scoring_func": ("sigmoid",), "moe_layer_freq": (1,)},
        _TOP, _DEEPSEEK_LAYER + (
            ("mlp.gate.e_score_correction_bias", "vec", "mlp.router_correction", "moe"),),
        parse=_parse_deepseek_v3),
    Family("granite", ("granite",),
           {**{k: v for k, v in _LLAMA_KEYS.items() if k not in ("pretraining_tp", "head_dim")},
            "embedding_multiplier": USE, "residual_multiplier": USE,
            "attention_multiplier": USE, "logits_scaling": USE},
           _TOP, _LLAMA_NORMS + _ATTN + _MLP, parse=_parse_granite),
)}


def family_of(cfg: dict) -> Family | None:
  mt = cfg.get("model_type", "")
  for f in FAMILIES.values():
    if mt in f.model_types:
      return f
  return None


# ---------------------------------------------------------------------------------------
# Config -> the model section of an imported workdir's config.json.
# ---------------------------------------------------------------------------------------


# Integer config keys (sizes, counts, windows) and their smallest value. Every one is
# checked before any is used: an integer, at most MAX_SIZE (MAX_LAYERS for a layer
# count: a list per layer is made before the tensors are read).
SIZE_KEYS = {"hidden_size": 1, "num_attention_heads": 1, "num_key_value_heads": 1,
             "head_dim": 1, "intermediate_size": 1, "num_hidden_layers": 1, "vocab_size": 1,
             "max_position_embeddings": 1, "original_max_position_embeddings": 1,
             "n_embd": 1, "n_head": 1, "n_layer": 1, "n_inner": 1, "n_positions": 1,
             "max_window_layers": 0, "sliding_window": 0, "sliding_window_pattern": 1,
             "_sliding_window_pattern": 1}
LAYER_KEYS = ("num_hidden_layers", "n_layer", "block_count")
MAX_SIZE, MAX_LAYERS = 2 ** 31 - 1, 2 ** 16


def check_size(value, key: str, where: str, lo: int = 1):
  """`value` as an int, refused naming `where` and `key` unless it is an integer (not a
  bool, nor a float) in [lo, MAX_SIZE] (MAX_LAYERS for a layer count)."""
  hi = MAX_LAYERS if key.split(".")[-1] in LAYER_KEYS else MAX_SIZE
  ok = isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))
  if not ok or not lo <= int(value) <= hi:
    raise UserError(f"{where}: {key}={value!r} must be an integer from {lo} to {hi}")
  return int(value)


def read_config(cfg: dict, family: Family, where: str) -> dict:
  """The family's settings (checked key by key) from a Hugging Face config dict."""
  c = Config(cfg, family, where)
  c.check_keys()
  for key, lo in SIZE_KEYS.items():
    if cfg.get(key) is not None:
      check_size(cfg[key], key, where, lo)
  try:
    s = family.parse(c)
  except UserError:
    raise
  except (TypeError, ValueError, ArithmeticError, AttributeError, KeyError) as e:
    raise UserError(f"{where}: a value cannot be read as the setting it is for "
                     f"({type(e).__name__}: {' '.join(str(e).split())[:200]})") from None
  if s["k"] < 1:
    c.refuse("head_dim", s["k"], f"hidden_size {s['d']} / {s['h']} heads leaves no width")
  if s["h"] % s["g"]:
    c.refuse("num_key_value_heads", s["g"], f"must divide num_attention_heads={s['h']}")
  for w in (s["window"] for t in s["layer_types"] if t == "sliding_attention"):
    if not w:
      c.refuse("sliding_window", w, "sliding layers need a window")
  return s


def model_config(s: dict, family: Family) -> dict:
  """config.json's "model" section: sizes, and model.decoder (decoder.spec_from_config)."""
  layers = []
  scale = s.get("scale")
  no_rope = set(s.get("no_rope", ()))
  for i, t in enumerate(s["layer_types"]):
    rope = None if s["rope"] is None or i in no_rope else s["rope"][t]
    sc = scale[i] if isinstance(scale, list) else scale
    layers.append({"type": t, "rope": rope,
                   "window": s["window"] if t == "sliding_attention" else None,
                   "scale": sc})
  dec = {"norm": family.norm, "norm_eps": s["eps"], "act": s["act"],
         "parallel": bool(s.get("parallel", False)), "layers": layers,
         "attn_softcap": s.get("attn_softcap"), "final_softcap": s.get("final_softcap"),
         "embed_scale": s.get("embed_scale"), "rope_layout": s.get("rope_layout", "half"),
         "residual_scale": s.get("residual_scale"), "logit_scale": s.get("logit_scale"),
         "moe_top_k": s.get("top_k", 0), "moe_routing": s.get("routing", "softmax_renorm"),
         "moe_scale": s.get("moe_scale"), "moe_groups": s.get("moe_groups"),
         "swiglu_limit": s.get("swiglu_limit"), "swiglu_alpha": s.get("swiglu_alpha")}
  rope0 = next((l["rope"] for l in layers if l["rope"] is not None), None)
  return dict(family=family.name, d_model=s["d"], num_heads=s["h"], num_kv_heads=s["g"],
              head_dim=s["k"], num_layers=s["n"], d_ff=s["f"], vocab_size=s["v"],
              norm_eps=s["eps"], rope_base=float(rope0["base"]) if rope0 else 0.0,
              max_len=s["max_len"], tie_embeddings=s["tied"], decoder=dec)


# ---------------------------------------------------------------------------------------
# Tensors.
# ---------------------------------------------------------------------------------------


class Tensors:
  """The file's tensors by HF name: each is taken once, as float32 (or the --dtype)."""

  def __init__(self, get: Callable[[str], np.ndarray], names, where, prefixes, dtype):
    self.get, self.left, self.where = get, set(names), where
    self.prefixes, self.dtype = prefixes, dtype

  def has(self, name):
    return any(p + name in self.left for p in self.prefixes)

  def take(self, name, shape=None):
    for p in self.prefixes:
      if p + name in self.left:
        x = np.asarray(self.get(p + name))
        self.left.discard(p + name)
        if shape is not None and x.shape != tuple(shape):
          raise UserError(f"{self.where}: tensor {p + name!r} has shape {x.shape}, "
                           f"expected {tuple(shape)}")
        if x.dtype.kind == "f" and not np.isfinite(x).all():   # a corrupt scale or value
          raise UserError(f"{self.where}: tensor {p + name!r} holds "
                           f"{int(np.size(x) - np.isfinite(x).sum())} NaN or infinite "
                           f"values (a corrupt file?)")
        return x
    raise UserError(f"{self.where}: tensor {name!r} is missing")


def _set(tree, path, value):
  parts = path.split(".")
  for p in parts[:-1]:
    tree = tree.setdefault(p, {})
  tree[parts[-1]] = value


def _vec_shape(name: str, s: dict) -> tuple | None:
  """The shape a "vec" tensor must have, where its name says: the embeddings (V, D) /
  (max_len, D), an MLP's hidden biases (F,), a norm's (D,); None (not checked here; the
  model's own shapes check it) for a name of another family's layout."""
  if name.endswith(("embed_tokens.weight", "wte.weight", "embed_in.weight",
                    "token_embd.weight")):
    return (s["v"], s["d"])
  if name.endswith(("wpe.weight", "position_embd.weight")):
    return (s["max_len"], s["d"])
  if "expert" in name:
    return None
  if name.endswith(("gate_proj.bias", "up_proj.bias", "c_fc.bias", "dense_h_to_4h.bias",
                    "ffn_up.bias")):
    return (s["f"],)
  module = (name.rsplit(".", 2) + ["", ""])[-3] if name.count(".") < 1 else name.rsplit(".", 2)[-2]
  if ("norm" in module or module.startswith("ln_")) and "attn" not in name:
    return (s["d"],)
  return None


def _lin_shape(name: str, s: dict) -> tuple | None:
  """The (out, in) shape of a "lin" tensor where its name says: the unembedding (V, D),
  an MLP's up / gate (F, D) or down (D, F) projection; None for other names (experts
  have widths of their own)."""
  if "expert" in name:
    return None
  if name.endswith(("down_proj.weight", "c_proj.weight", "dense_4h_to_h.weight",
                    "ffn_down.weight")) and "attn" not in name:
    return (s["d"], s["f"])
  if name.endswith(("lm_head.weight", "embed_out.weight", "output.weight")):
    return (s["v"], s["d"])
  if name.endswith(("gate_proj.weight", "up_proj.weight", "c_fc.weight",
                    "dense_h_to_4h.weight", "ffn_up.weight", "ffn_gate.weight")):
    return (s["f"], s["d"])
  return None


def _convert(t: Tensors, name, kind, s, family, dt):
  """{relative target: array} for one row of the table."""
  d, h, g, k, f = s["d"], s["h"], s["g"], s["k"], s["f"]
  # one copy at most (dtype and layout together: a transposed bf16 weight is not first
  # converted to float32, then made contiguous)
  cast = lambda x: np.asarray(x, dtype=dt, order="C")  # noqa: E731
  if kind == "vec":
    x = t.take(name, _vec_shape(name, s)).astype(np.float32)
    if family.plus_one and name.endswith("norm.weight"):
      x = x + np.float32(1.0)
    return {"": cast(x)}
  if kind == "head_norm":
    x = t.take(name, (k,)).astype(np.float32)
    return {"": cast(x + np.float32(1.0) if family.plus_one else x)}
  if kind == "whole_q":
    return {"": cast(t.take(name, (h * k,)).reshape(h, k))}
  if kind == "whole_k":
    return {"": cast(t.take(name, (g * k,)).reshape(g, k))}
  if kind == "lin":
    return {"": cast(t.take(name, _lin_shape(name, s)).T)}
  if kind == "conv":
    shape = _lin_shape(name, s)
    return {"": cast(t.take(name, None if shape is None else shape[::-1]))}
  if kind == "q":
    return {"": cast(t.take(name, (h * k, d)).T.reshape(d, h, k))}
  if kind == "kv":
    return {"": cast(t.take(name, (g * k, d)).T.reshape(d, g, k))}
  if kind == "o":
    return {"": cast(t.take(name, (d, h * k)).T.reshape(h, k, d))}
  if kind == "bq":
    return {"": cast(t.take(name, (h * k,)).reshape(h, k))}
  if kind == "bkv":
    return {"": cast(t.take(name, (g * k,)).reshape(g, k))}
  if kind == "gpt2_o":
    return {"": cast(t.take(name, (h * k, d)).reshape(h, k, d))}
  if kind == "qkv":
    if name.endswith(".bias"):
      b = t.take(name, (h * k + 2 * g * k,))
      return {"q": cast(b[:h * k].reshape(h, k)), "k": cast(b[h * k:h * k + g * k].reshape(g, k)),
              "v": cast(b[h * k + g * k:].reshape(g, k))}
    w = t.take(name, (h * k + 2 * g * k, d))
    q, kk, v = w[:h * k], w[h * k:h * k + g * k], w[h * k + g * k:]
    return {"wq": cast(q.T.reshape(d, h, k)), "wk": cast(kk.T.reshape(d, g, k)),
            "wv": cast(v.T.reshape(d, g, k))}
  if kind == "gate_up":
    w = t.take(name, (2 * f, d))
    return {"w_gate": cast(w[:f].T), "w_up": cast(w[f:].T)}
  if kind == "neox_qkv":
    if name.endswith(".bias"):
      b = t.take(name, (3 * h * k,)).reshape(h, 3, k)
      return {"q": cast(b[:, 0]), "k": cast(b[:, 1]), "v": cast(b[:, 2])}
    w = t.take(name, (3 * h * k, d)).reshape(h, 3, k, d)
    return {"wq": cast(w[:, 0].transpose(2, 0, 1)), "wk": cast(w[:, 1].transpose(2, 0, 1)),
            "wv": cast(w[:, 2].transpose(2, 0, 1))}
  if kind in ("experts_in", "experts_out"):   # per-expert nn.Linear, name with {e}
    shape = (s["moe_f"], d) if kind == "experts_in" else (d, s["moe_f"])
    return {"": cast(np.stack([t.take(name.format(e=e), shape).T
                               for e in range(s["experts"])]))}
  if kind in ("exps_in", "exps_out"):   # stacked (E, F, D) / (E, D, F), GGUF's _exps
    fi = s["moe_f"]
    shape = (s["experts"], fi, d) if kind == "exps_in" else (s["experts"], d, fi)
    return {"": cast(t.take(name, shape).transpose(0, 2, 1))}
  if kind == "oss_gate_up":     # gpt-oss (E, D, 2F) / (E, 2F): gate, up interleaved
    x = t.take(name)
    sub = ("b_gate", "b_up") if name.endswith("_bias") else ("w_gate", "w_up")
    return {sub[0]: cast(x[..., 0::2]), sub[1]: cast(x[..., 1::2])}
  if kind.startswith("mla_"):
    return _mla(t, name, kind, s, cast)
  if kind == "pos_offset":    # OPT: positions p read row p + 2; rows 0, 1 never read
    x = t.take(name)
    return {"": cast(x[2:])}
  if kind == "falcon_qkv":
    return _falcon_qkv(t, name, s, cast)
  if kind == "gpt2_qkv":
    if name.endswith(".bias"):
      b = t.take(name, (3 * d,)).reshape(3, h, k)
      return {"q": cast(b[0]), "k": cast(b[1]), "v": cast(b[2])}
    w = t.take(name, (d, 3 * d)).reshape(d, 3, h, k)
    return {"wq": cast(w[:, 0]), "wk": cast(w[:, 1]), "wv": cast(w[:, 2])}
  raise ValueError(f"unknown tensor kind {kind!r}")


def _falcon_qkv(t: Tensors, name, s, cast):
  """Falcon's query_key_value (weights or bias) -> q, k, v: new_decoder_architecture
  rows per kv group [g][q_0 .. q_{H/G-1}, k, v][K]; multi_query [q (H K); k; v]; else
  [h][q, k, v][K] (GPT-NeoX's)."""
  d, h, g, k = s["d"], s["h"], s["g"], s["k"]
  bias = name.endswith(".bias")
  x = t.take(name, ((h + 2 * g) * k,) if bias else ((h + 2 * g) * k, d))
  tail = x.shape[1:]
  if s["falcon_layout"] == "grouped":
    y = x.reshape(g, h // g + 2, k, *tail)
    q, kk, v = y[:, :-2].reshape(h, k, *tail), y[:, -2], y[:, -1]
  elif s["falcon_layout"] == "multi_query":
    q, kk, v = x[:h * k].reshape(h, k, *tail), x[h * k:(h + 1) * k].reshape(1, k, *tail), \
        x[(h + 1) * k:].reshape(1, k, *tail)
  else:
    y = x.reshape(h, 3, k, *tail)
    q, kk, v = y[:, 0], y[:, 1], y[:, 2]
  if bias:
    return {"q": cast(q), "k": cast(kk), "v": cast(v)}
  return {"wq": cast(q.transpose(2, 0, 1)), "wk": cast(kk.transpose(2, 0, 1)),
          "wv": cast(v.transpose(2, 0, 1))}


def _mla(t: Tensors, name, kind, s, cast):
  """DeepSeek's MLA tensors in the house layout (attention.py's MLA): queries per head
  reordered [rotary R; non-rotary Kn]; kv_a_proj_with_mqa split into wkv_a (D, C) and
  wk_rope (D, R); kv_b_proj into per-head blocks over the latent [C; R]: wk (C + R, H,
  R + Kn) (rotary rows an identity), wv (C + R, H, V); o_proj (D, H V) -> (H, V, D)."""
  d, h = s["d"], s["h"]
  c, r, kn, v, cq = (s["mla"][x] for x in ("c", "r", "kn", "v", "cq"))
  if kind == "mla_q":
    w = t.take(name, (h * (kn + r), cq or d)).reshape(h, kn + r, -1)
    w = np.concatenate([w[:, kn:], w[:, :kn]], axis=1)        # [rotary; non-rotary]
    return {"": cast(w.transpose(2, 0, 1))}
  if kind == "mla_kv_a":
    w = t.take(name, (c + r, d))
    return {"wkv_a": cast(w[:c].T), "wk_rope": cast(w[c:].T)}
  if kind == "mla_kv_b":
    w = t.take(name, (h * (kn + v), c)).reshape(h, kn + v, c)
    wk = np.zeros((c + r, h, r + kn), w.dtype)
    wk[c:, :, :r] = np.eye(r, dtype=w.dtype)[:, None, :]
    wk[:c, :, r:] = w[:, :kn].transpose(2, 0, 1)
    wv = np.zeros((c + r, h, v), w.dtype)
    wv[:c] = w[:, kn:].transpose(2, 0, 1)
    return {"wk": cast(wk), "wv": cast(wv)}
  if kind == "mla_o":
    return {"": cast(t.take(name, (d, h * v)).T.reshape(h, v, d))}
  raise ValueError(f"unknown tensor kind {kind!r}")


def _rows(family, s, rows, t, dt, out, prefix="", place=None, where=""):
  def on(cond):   # a row's condition: a true setting of the family's parse ("untied")
    return not s["tied"] if cond == "untied" else bool(s.get(cond, False))
  for name, kind, target, cond in rows:
    if cond is not None and not on(cond):
      continue
    if cond == "untied" and not t.has(prefix + name):
      raise UserError(f"{t.where}: tie_word_embeddings is false but {name!r} is missing")
    for sub, arr in _convert(t, prefix + name, kind, s, family, dt).items():
      path = target + (sub if target.endswith(".b") else ("." + sub if sub else ""))
      _set(out, path, arr if place is None else place(where + path, arr))


def _skip_mtp(family: Family, s: dict, t: Tensors) -> None:
  """DeepSeek-V3's multi-token-prediction layers (num_nextn_predict_layers, stored as the
  layers after the last one): not read, their count noted in s["skipped"]. Exact for
  the model's logits: the MTP module reads the last layer's output to predict a further
  token and feeds nothing back (transformers' model has no such layer)."""
  n, mtp = s["n"], s.get("mtp_layers", 0)
  heads = [p + family.layer_prefix.format(i=j) for j in range(n, n + mtp)
           for p in family.prefixes]
  skipped = sorted(name for name in t.left if name.startswith(tuple(heads)))
  t.left.difference_update(skipped)
  if skipped:
    s["skipped"] = (f"{len(skipped)} tensors of the {mtp} multi-token-prediction layer(s) "
                    f"(layers {n}..{n + mtp - 1}): not part of the model's forward")


def build_params(family: Family, s: dict, t: Tensors, dtype=np.float32,
                 place: Callable | None = None) -> dict:
  """mha-jax params from the tensors (each taken once); refuses leftovers by name.

  place: None, or f(dotted param path such as "lm.layer_0.attn.wq", NumPy array) -> the
  array to keep, called as each tensor is converted (the importer puts it on its
  devices, sharded: the host then holds one converted tensor at a time)."""
  params: dict = {}
  _rows(family, s, family.top, t, dtype, params, place=place)
  if s["tied"] and t.has("lm_head.weight"):   # a saved copy of the tied embedding
    t.take("lm_head.weight")
  lm = params.setdefault("lm", {})
  for i in range(s["n"]):
    layer: dict = {}
    sparse = i in s.get("moe_layers", ())
    _rows(family, dict(s, moe=sparse, dense=not sparse,
                       moe_shared=sparse and bool(s.get("shared"))), family.layer, t, dtype, layer,
          family.layer_prefix.format(i=i), place=place, where=f"lm.layer_{i}.")
    if s.get("alibi"):     # derived from H, not stored: BLOOM's slopes
      slopes = attention.alibi_slopes(s["h"]).astype(dtype)
      layer["attn"]["alibi"] = slopes if place is None else place(
          f"lm.layer_{i}.attn.alibi", slopes)
    lm[f"layer_{i}"] = layer
  lm["ln_final"] = lm.pop("ln_final")
  _skip_mtp(family, s, t)
  left = sorted(n for n in t.left if not any(n.endswith(x) for x in family.ignore_tensors))
  if left:
    raise UserError(f"{t.where}: tensors the {family.name} adapter does not know: "
                     f"{left[:5]}")
  return params
