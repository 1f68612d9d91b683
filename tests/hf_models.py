"""Tiny Hugging Face models and llama.cpp GGUF files built in the tests: a tiny LLaMA in
HF names and as a converter would write it, a tiny transformers model per family, any
of them written as GGUF in mixed tensor types, and the tokenizer samples
(`from hf_models import build_hf, write_gguf`)."""

import math
import os

import numpy as np

# ------------------------------------------------------------------ a tiny LLaMA in HF names and as a llama.cpp GGUF

def tiny_llama_hf(rng, d=64, h=4, h_kv=2, k=16, f=96, layers=2, v=256):
  """Random weights in Hugging Face's names and layout (half-split RoPE)."""
  w = {"model.embed_tokens.weight": rng.normal(0, 0.5, (v, d)),
       "model.norm.weight": 1 + 0.1 * rng.normal(size=d),
       "lm_head.weight": rng.normal(0, 0.2, (v, d))}
  for i in range(layers):
    p = f"model.layers.{i}."
    w.update({p + "input_layernorm.weight": 1 + 0.1 * rng.normal(size=d),
              p + "post_attention_layernorm.weight": 1 + 0.1 * rng.normal(size=d),
              p + "self_attn.q_proj.weight": rng.normal(0, 0.3, (h * k, d)),
              p + "self_attn.k_proj.weight": rng.normal(0, 0.3, (h_kv * k, d)),
              p + "self_attn.v_proj.weight": rng.normal(0, 0.3, (h_kv * k, d)),
              p + "self_attn.o_proj.weight": rng.normal(0, 0.3, (d, h * k)),
              p + "mlp.gate_proj.weight": rng.normal(0, 0.3, (f, d)),
              p + "mlp.up_proj.weight": rng.normal(0, 0.3, (f, d)),
              p + "mlp.down_proj.weight": rng.normal(0, 0.3, (d, f))})
  cfg = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": d,
         "num_attention_heads": h, "num_key_value_heads": h_kv, "intermediate_size": f,
         "num_hidden_layers": layers, "vocab_size": v, "rms_norm_eps": 1e-5,
         "rope_theta": 500.0, "max_position_embeddings": 128, "tie_word_embeddings": False,
         "hidden_act": "silu"}
  return {n: x.astype(np.float32) for n, x in w.items()}, cfg


def converter_permute(w_OI, n_head):
  """llama.cpp's converter: each head's rows (half, j) stored as (j, half)."""
  return w_OI.reshape(n_head, 2, w_OI.shape[0] // n_head // 2, -1).swapaxes(1, 2).reshape(
      w_OI.shape)


GGUF_TYPES = {"token_embd": "Q8_0", "output": "F16", "attn_q": "Q4_0", "attn_k": "Q4_1",
              "attn_v": "F16", "attn_output": "Q8_0", "ffn_gate": "Q4_1", "ffn_up": "Q4_0",
              "ffn_down": "F32"}


def write_tiny_gguf(path, w, cfg):
  """The HF weights as a llama.cpp converter would store them, in mixed quantizations."""
  import gguf
  h, h_kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
  g = gguf.GGUFWriter(str(path), "llama")
  g.add_context_length(cfg["max_position_embeddings"])
  g.add_embedding_length(cfg["hidden_size"])
  g.add_block_count(cfg["num_hidden_layers"])
  g.add_feed_forward_length(cfg["intermediate_size"])
  g.add_head_count(h)
  g.add_head_count_kv(h_kv)
  g.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
  g.add_rope_freq_base(cfg["rope_theta"])
  _add_byte_level_vocab(g, None, pre="smollm")

  def put(name, x, kind):
    _put_tensor(g, name, x, GGUF_TYPES.get(kind, "F32"))

  put("token_embd.weight", w["model.embed_tokens.weight"], "token_embd")
  put("output.weight", w["lm_head.weight"], "output")
  put("output_norm.weight", w["model.norm.weight"], "norm")
  hf = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
        "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
        "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm",
        "ffn_norm": "post_attention_layernorm"}
  for i in range(cfg["num_hidden_layers"]):
    for kind, name in hf.items():
      x = w[f"model.layers.{i}.{name}.weight"]
      if kind == "attn_q":
        x = converter_permute(x, h)
      elif kind == "attn_k":
        x = converter_permute(x, h_kv)
      put(f"blk.{i}.{kind}.weight", x, kind)
  g.write_header_to_file()
  g.write_kv_data_to_file()
  g.write_tensors_to_file()
  g.close()


# ------------------------------------------------ tiny transformers models per family

V, T, B, WINDOW = 96, 24, 2, 8


def tokenizer_json() -> str:
  from tokenizers import Tokenizer, models, pre_tokenizers
  tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(V)}, unk_token="t0"))
  tok.pre_tokenizer = pre_tokenizers.Whitespace()
  return tok.to_str()


# family -> (config class, model class, config kwargs). Every switch the family has is
# set away from its default where the forward depends on it.
TINY_LLAMA_KW = dict(vocab_size=V, hidden_size=64, intermediate_size=80, num_hidden_layers=2,
           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
           rms_norm_eps=1e-5, tie_word_embeddings=False)
# LayerNorm families: the same sizes without rms_norm_eps (their adapters refuse it)
TINY_LN_KW = {k: v for k, v in TINY_LLAMA_KW.items() if k != "rms_norm_eps"}
CASES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM",
              dict(TINY_LLAMA_KW, head_dim=24, attention_bias=True, mlp_bias=True,
                   rope_parameters={"rope_theta": 500000.0, "rope_type": "default"})),
    "llama3_rope": ("LlamaConfig", "LlamaForCausalLM",
                    dict(TINY_LLAMA_KW, rope_parameters={"rope_theta": 5000.0, "rope_type": "llama3",
                                               "factor": 8.0, "low_freq_factor": 1.0,
                                               "high_freq_factor": 4.0,
                                               "original_max_position_embeddings": 16})),
    "linear_rope": ("LlamaConfig", "LlamaForCausalLM",
                    dict(TINY_LLAMA_KW, rope_parameters={"rope_theta": 1000.0, "rope_type": "linear",
                                               "factor": 4.0})),
    "yarn_rope": ("LlamaConfig", "LlamaForCausalLM",
                  dict(TINY_LLAMA_KW, rope_parameters={"rope_theta": 1000.0, "rope_type": "yarn",
                                             "factor": 4.0, "beta_fast": 16.0, "beta_slow": 2.0,
                                             "original_max_position_embeddings": 16})),
    # switch length 16: TOKENS (T = 24) are past it; test_rope_by_length goes under too
    "dynamic_rope": ("LlamaConfig", "LlamaForCausalLM",
                     dict(TINY_LLAMA_KW, max_position_embeddings=16,
                          rope_parameters={"rope_theta": 1000.0, "rope_type": "dynamic",
                                           "factor": 3.0})),
    "phi3_longrope": ("Phi3Config", "Phi3ForCausalLM",
                      dict(TINY_LLAMA_KW, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                           max_position_embeddings=64, original_max_position_embeddings=16,
                           rope_parameters={"rope_theta": 700.0, "rope_type": "longrope",
                                            "partial_rotary_factor": 0.5,
                                            "short_factor": [1.0, 1.3, 1.7, 2.2],
                                            "long_factor": [1.5, 3.0, 6.0, 11.0]})),
    "mistral": ("MistralConfig", "MistralForCausalLM",
                dict(TINY_LLAMA_KW, head_dim=16, sliding_window=WINDOW,
                     rope_parameters={"rope_theta": 300.0, "rope_type": "default"})),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM",
              dict(TINY_LLAMA_KW, use_sliding_window=False, tie_word_embeddings=True)),
    "qwen2_sliding": ("Qwen2Config", "Qwen2ForCausalLM",
                      dict(TINY_LLAMA_KW, use_sliding_window=True, sliding_window=WINDOW,
                           max_window_layers=1)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM",
              dict(TINY_LLAMA_KW, head_dim=16, attention_bias=False)),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM",
               dict(TINY_LLAMA_KW, num_hidden_layers=3, head_dim=16, query_pre_attn_scalar=24,
                    sliding_window=WINDOW, attn_logit_softcapping=5.0,
                    final_logit_softcapping=3.0, hidden_activation="gelu_pytorch_tanh",
                    tie_word_embeddings=True)),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM",
               dict(TINY_LLAMA_KW, num_hidden_layers=3, num_key_value_heads=1, head_dim=16,
                    query_pre_attn_scalar=20, sliding_window=WINDOW,
                    layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                    rope_parameters={"sliding_attention": {"rope_type": "default",
                                                           "rope_theta": 100.0},
                                     "full_attention": {"rope_type": "linear", "factor": 2.0,
                                                        "rope_theta": 3000.0}},
                    tie_word_embeddings=True)),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", dict(TINY_LLAMA_KW)),
    "phi3": ("Phi3Config", "Phi3ForCausalLM",
             dict(TINY_LLAMA_KW, pad_token_id=0, bos_token_id=1, eos_token_id=2, sliding_window=WINDOW,
                  rope_parameters={"rope_theta": 700.0, "rope_type": "default",
                                   "partial_rotary_factor": 0.5})),
    "gpt2": ("GPT2Config", "GPT2LMHeadModel",
             dict(vocab_size=V, n_embd=64, n_layer=2, n_head=4, n_inner=96, n_positions=64,
                  layer_norm_epsilon=1e-4, scale_attn_by_inverse_layer_idx=True,
                  activation_function="gelu_new")),
    "gpt_neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM",
                 dict(vocab_size=V, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                      intermediate_size=96, max_position_embeddings=128, layer_norm_eps=1e-4,
                      hidden_act="gelu", use_parallel_residual=True,
                      rope_parameters={"rope_theta": 900.0, "rope_type": "default",
                                       "partial_rotary_factor": 0.5})),
    "gpt_neox_sequential": ("GPTNeoXConfig", "GPTNeoXForCausalLM",
                            dict(vocab_size=V, hidden_size=64, num_hidden_layers=2,
                                 num_attention_heads=4, intermediate_size=96,
                                 max_position_embeddings=128, use_parallel_residual=False,
                                 attention_bias=False)),
    "opt": ("OPTConfig", "OPTForCausalLM",
            dict(vocab_size=V, hidden_size=64, num_hidden_layers=2, ffn_dim=96,
                 num_attention_heads=4, max_position_embeddings=64, tie_word_embeddings=False)),
    "opt_nobias": ("OPTConfig", "OPTForCausalLM",
                   dict(vocab_size=V, hidden_size=64, num_hidden_layers=2, ffn_dim=96,
                        num_attention_heads=4, max_position_embeddings=64, enable_bias=False)),
    "phi": ("PhiConfig", "PhiForCausalLM",
            dict(TINY_LN_KW, layer_norm_eps=1e-4, hidden_act="gelu_new",
                 rope_parameters={"rope_theta": 700.0, "rope_type": "default",
                                  "partial_rotary_factor": 0.5})),
    "stablelm": ("StableLmConfig", "StableLmForCausalLM",
                 dict(TINY_LN_KW, layer_norm_eps=1e-4, use_qkv_bias=True,
                      rope_parameters={"rope_theta": 500.0, "rope_type": "default",
                                       "partial_rotary_factor": 0.25})),
    "stablelm_parallel": ("StableLmConfig", "StableLmForCausalLM",
                          dict(TINY_LN_KW, use_parallel_residual=True)),
    "gptj": ("GPTJConfig", "GPTJForCausalLM",
             dict(vocab_size=V, n_embd=64, n_layer=2, n_head=4, rotary_dim=8, n_inner=96,
                  n_positions=64, layer_norm_epsilon=1e-4)),
    "falcon": ("FalconConfig", "FalconForCausalLM",
               dict(vocab_size=V, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                    num_kv_heads=2, new_decoder_architecture=True, ffn_hidden_size=96,
                    layer_norm_epsilon=1e-4, tie_word_embeddings=False,
                    rope_parameters={"rope_theta": 800.0, "rope_type": "default"})),
    "falcon_mq": ("FalconConfig", "FalconForCausalLM",
                  dict(vocab_size=V, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                       multi_query=True, bias=True)),
    "falcon_seq": ("FalconConfig", "FalconForCausalLM",
                   dict(vocab_size=V, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                        multi_query=False, parallel_attn=False, bias=True,
                        activation="gelu_pytorch_tanh")),
    "smollm3": ("SmolLM3Config", "SmolLM3ForCausalLM",
                dict(TINY_LLAMA_KW, num_hidden_layers=3, no_rope_layers=[1, 0, 1], pad_token_id=0,
                     use_sliding_window=True, sliding_window=WINDOW, attention_bias=True,
                     rope_parameters={"rope_theta": 600.0, "rope_type": "default"})),
    "olmo3": ("Olmo3Config", "Olmo3ForCausalLM",
              dict(TINY_LLAMA_KW, sliding_window=WINDOW,
                   layer_types=["sliding_attention", "full_attention"],
                   rope_parameters={"sliding_attention": {"rope_type": "default",
                                                          "rope_theta": 300.0},
                                    "full_attention": {"rope_type": "linear", "factor": 2.0,
                                                       "rope_theta": 3000.0}})),
    "cohere": ("CohereConfig", "CohereForCausalLM",
               dict(TINY_LN_KW, layer_norm_eps=1e-4, logit_scale=0.3, attention_bias=True,
                    tie_word_embeddings=True,
                    rope_parameters={"rope_theta": 400.0, "rope_type": "default"})),
    "bloom": ("BloomConfig", "BloomForCausalLM",
              dict(vocab_size=V, hidden_size=48, n_layer=2, n_head=6, layer_norm_epsilon=1e-4,
                   tie_word_embeddings=False)),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM",
                dict(TINY_LLAMA_KW, num_hidden_layers=2, head_dim=16, sliding_window=WINDOW,
                     num_local_experts=4, num_experts_per_tok=2,
                     rope_parameters={"rope_theta": 300.0, "rope_type": "default"})),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(TINY_LLAMA_KW, num_hidden_layers=3, head_dim=16, num_experts=5,
                       num_experts_per_tok=2, moe_intermediate_size=40, norm_topk_prob=True,
                       mlp_only_layers=[0], decoder_sparse_step=1, use_sliding_window=True,
                       sliding_window=WINDOW)),
    "qwen3_moe_step": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                       dict(TINY_LLAMA_KW, num_hidden_layers=2, num_experts=4,
                            num_experts_per_tok=3, moe_intermediate_size=40,
                            norm_topk_prob=False, decoder_sparse_step=2)),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM",
              dict(TINY_LLAMA_KW, num_experts=6, num_experts_per_tok=2, pad_token_id=0,
                   eos_token_id=1)),
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM",
                dict(TINY_LLAMA_KW, head_dim=16, num_local_experts=4, num_experts_per_tok=2,
                     sliding_window=WINDOW, swiglu_limit=1.5, swiglu_alpha=1.3,
                     layer_types=["sliding_attention", "full_attention"],
                     rope_parameters={"rope_theta": 500.0, "rope_type": "default"})),
    "deepseek_v2": ("DeepseekV2Config", "DeepseekV2ForCausalLM",
                    dict(TINY_LLAMA_KW, num_key_value_heads=4, moe_intermediate_size=24,
                         n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=2,
                         first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=20,
                         qk_rope_head_dim=8, qk_nope_head_dim=12, v_head_dim=10,
                         routed_scaling_factor=1.7, topk_method="group_limited_greedy",
                         n_group=2, topk_group=1,
                         rope_parameters={"rope_theta": 300.0, "rope_type": "default"})),
    "deepseek_v2_lite": ("DeepseekV2Config", "DeepseekV2ForCausalLM",
                         dict(TINY_LLAMA_KW, num_key_value_heads=4, moe_intermediate_size=24,
                              n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
                              first_k_dense_replace=0, kv_lora_rank=16, q_lora_rank=None,
                              qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16)),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM",
                    dict(TINY_LLAMA_KW, num_key_value_heads=4, moe_intermediate_size=24,
                         n_routed_experts=8, num_experts_per_tok=3, n_shared_experts=2,
                         first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=20,
                         qk_rope_head_dim=8, qk_nope_head_dim=12, v_head_dim=10,
                         routed_scaling_factor=1.7, n_group=4, topk_group=2,
                         norm_topk_prob=True,
                         rope_parameters={"rope_theta": 300.0, "rope_type": "default"})),
    "deepseek_v3_half": ("DeepseekV3Config", "DeepseekV3ForCausalLM",
                         dict(TINY_LLAMA_KW, num_key_value_heads=4, moe_intermediate_size=24,
                              n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
                              first_k_dense_replace=0, kv_lora_rank=16, q_lora_rank=None,
                              qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
                              n_group=1, topk_group=1, norm_topk_prob=False,
                              rope_interleave=False)),
    # YaRN as DeepSeek's configs carry it: mscale = mscale_all_dim (cos / sin unscaled, the
    # scores x yarn_get_mscale(factor, mscale_all_dim)^2), original context 16 < T
    "deepseek_v3_yarn": ("DeepseekV3Config", "DeepseekV3ForCausalLM",
                         dict(TINY_LLAMA_KW, num_key_value_heads=4, moe_intermediate_size=24,
                              n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
                              first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=20,
                              qk_rope_head_dim=8, qk_nope_head_dim=12, v_head_dim=10,
                              n_group=2, topk_group=1, rope_parameters={
                                  "rope_theta": 300.0, "rope_type": "yarn", "factor": 8.0,
                                  "original_max_position_embeddings": 16, "beta_fast": 32.0,
                                  "beta_slow": 1.0, "mscale": 0.8, "mscale_all_dim": 0.8})),
    # gpt-oss's own YaRN: truncate false (the correction range not rounded)
    "gpt_oss_yarn": ("GptOssConfig", "GptOssForCausalLM",
                     dict(TINY_LLAMA_KW, head_dim=16, num_local_experts=4, num_experts_per_tok=2,
                          sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"],
                          rope_parameters={"rope_theta": 500.0, "rope_type": "yarn", "factor": 8.0,
                                           "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                                           "original_max_position_embeddings": 16})),
    "granite": ("GraniteConfig", "GraniteForCausalLM",
                dict(TINY_LLAMA_KW, embedding_multiplier=3.0, residual_multiplier=0.4,
                     attention_multiplier=0.2, logits_scaling=2.5, attention_bias=True,
                     mlp_bias=True)),
}


def build_hf(case: str, seed: int = 0):
  """A tiny random transformers model of `case` (every parameter perturbed)."""
  import torch
  import transformers
  cfg_cls, model_cls, kw = CASES[case]
  torch.manual_seed(seed)
  cfg = getattr(transformers, cfg_cls)(**kw)
  cfg._attn_implementation = "eager"
  model = getattr(transformers, model_cls)(cfg).eval()
  g = torch.Generator().manual_seed(seed + 1)
  with torch.no_grad():
    for p in model.parameters():
      if p.ndim == 1:
        p.add_(0.3 * torch.randn(p.shape, generator=g))
      else:
        p.add_(0.08 * torch.randn(p.shape, generator=g))
    for name, b in model.named_buffers():   # DeepSeek-V3's router correction (a buffer)
      if name.endswith("e_score_correction_bias"):
        b.add_(0.3 * torch.randn(b.shape, generator=g))
  return model


def save_folder(model, folder, **save_kw) -> str:
  os.makedirs(folder, exist_ok=True)
  model.save_pretrained(folder, **save_kw)
  with open(os.path.join(folder, "tokenizer.json"), "w") as f:
    f.write(tokenizer_json())
  return str(folder)


# ------------------------------------------------ HF models as llama.cpp's converter writes GGUF

# The tensor types a GGUF test file mixes (everything gguf.quants can quantize at 32-wide
# blocks); 2-D tensors cycle through them, 1-D ones stay F32 as the converter keeps them.
GGUF_CYCLE = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "F16", "BF16", "F32")

# llama.cpp architecture -> (CASES entry, overrides): the tiny model a GGUF test writes.
# The overrides keep only what the converter carries (GPT-2: n_inner = 4 D, no per-layer
# scale; NeoX: base 10000, which it does not write; Gemma 2: K = 24 = query_pre_attn_scalar,
# the scale llama.cpp assumes below 27B, while D / H = 16; Gemma 3: its fixed layer
# pattern and local base) and make the MLP width a multiple of the 32-wide quantization
# blocks.
GGUF_CASES = {
    "gpt2": ("gpt2", dict(n_inner=None, scale_attn_by_inverse_layer_idx=False)),
    "gptneox": ("gpt_neox", dict(rope_parameters={"rope_theta": 10000.0, "rope_type": "default",
                                                  "partial_rotary_factor": 0.5})),
    "phi3": ("phi3_longrope", dict(intermediate_size=96, sliding_window=WINDOW)),
    "gemma2": ("gemma2", dict(intermediate_size=96, head_dim=24)),
    # llama.cpp's Gemma 3 reads no layer pattern: every 6th layer is global, the local
    # ones at RoPE base 10000, queries scaled by 1 / sqrt(head_dim) below 27B
    "gemma3": ("gemma3", dict(intermediate_size=96, num_hidden_layers=6, query_pre_attn_scalar=16,
                              layer_types=["sliding_attention"] * 5 + ["full_attention"],
                              rope_parameters={"sliding_attention": {"rope_type": "default",
                                                                     "rope_theta": 10000.0},
                                               "full_attention": {"rope_type": "default",
                                                                  "rope_theta": 3000.0}})),
    "olmo2": ("olmo2", dict(intermediate_size=96)),
    "qwen3": ("qwen3", dict(intermediate_size=256)),
    # The newer families, as far as llama.cpp's format has them (an id "arch:variant"
    # where one architecture has two cases). The overrides keep what the converter
    # carries: no window (not written for these), RoPE base 10000 where the converter
    # writes none (StableLM, Phi-2, Falcon), Phi-2 / BLOOM / Falcon's 4 D MLP, every
    # layer sparse (llama.cpp has no dense MoE layers), OLMoE with as many kv heads as
    # heads (llama.cpp's k_norm is D wide), no biases where llama.cpp loads none;
    # SmolLM3's NoPE layer where llama.cpp's fixed step puts it (every 4th).
    "llama:mixtral": ("mixtral", dict(sliding_window=None, intermediate_size=96)),
    "qwen3moe": ("qwen3_moe", dict(mlp_only_layers=[], intermediate_size=96,
                                   moe_intermediate_size=64, use_sliding_window=False,
                                   sliding_window=None)),
    "olmoe": ("olmoe", dict(num_key_value_heads=4, intermediate_size=96)),
    "stablelm": ("stablelm", dict(intermediate_size=96, rope_parameters={
        "rope_theta": 10000.0, "rope_type": "default", "partial_rotary_factor": 0.25})),
    "stablelm:parallel": ("stablelm_parallel", dict(intermediate_size=96)),
    "phi2": ("phi", dict(intermediate_size=256, num_key_value_heads=4, rope_parameters={
        "rope_theta": 10000.0, "rope_type": "default", "partial_rotary_factor": 0.5})),
    "bloom": ("bloom", dict(hidden_size=96)),
    "falcon": ("falcon", dict(ffn_hidden_size=None, rope_parameters={
        "rope_theta": 10000.0, "rope_type": "default"})),
    "falcon:mq": ("falcon_mq", dict(bias=False)),
    "command-r": ("cohere", dict(intermediate_size=96)),     # with q / k / v / o biases
    "granite": ("granite", dict(attention_bias=False, mlp_bias=False, intermediate_size=96)),
    # Granite with q / k / v / o and MLP biases (llama.cpp's optional tensors; the q / k
    # biases permuted like their rows)
    "granite:bias": ("granite", dict(intermediate_size=96)),
    "smollm3": ("smollm3", dict(num_hidden_layers=4, no_rope_layers=[1, 1, 1, 0],
                                use_sliding_window=False, sliding_window=None,
                                attention_bias=False, intermediate_size=96)),
    # DeepSeek-V3 as the converter writes it for llama.cpp's absorbed MLA (kv_b split into
    # attn_k_b / attn_v_b), widths of 32 for the quantization blocks, rms_norm_eps 1e-6
    # (llama.cpp normalises the latents with it; transformers with 1e-6); the sigmoid
    # gating its config.json names (scoring_func), groups ranked by their two best scores
    "deepseek2": ("deepseek_v3", dict(rms_norm_eps=1e-6, intermediate_size=96, q_lora_rank=32,
                                      kv_lora_rank=32, qk_nope_head_dim=32, v_head_dim=16,
                                      moe_intermediate_size=32)),
    # DeepSeek-V2-Lite's shape: full-rank queries (attn_q), softmax routing, no groups
    "deepseek2:lite": ("deepseek_v2_lite", dict(rms_norm_eps=1e-6, intermediate_size=96,
                                                kv_lora_rank=32, qk_nope_head_dim=32,
                                                v_head_dim=32, moe_intermediate_size=32)),
    # DeepSeek-V3 with YaRN (factor 8, original context 16 < T, mscale = mscale_all_dim
    # 0.8: the converter's yarn_log_multiplier 0.08)
    "deepseek2:yarn": ("deepseek_v3_yarn", dict(rms_norm_eps=1e-6, intermediate_size=96,
                                                q_lora_rank=32, kv_lora_rank=32,
                                                qk_nope_head_dim=32, v_head_dim=16,
                                                moe_intermediate_size=32)),
    # gpt-oss with YaRN as llama.cpp runs it: the correction range rounded out (ggml
    # always truncates; gpt-oss's own config says truncate false: see the guide)
    "gpt-oss:yarn": ("gpt_oss_yarn", dict(intermediate_size=64, swiglu_limit=7.0,
                                          swiglu_alpha=1.702, rope_parameters={
                                              "rope_theta": 500.0, "rope_type": "yarn",
                                              "factor": 8.0, "beta_fast": 32.0,
                                              "beta_slow": 1.0, "truncate": True,
                                              "original_max_position_embeddings": 16})),
    # gpt-oss with MXFP4 experts (as the converter repacks the checkpoint's own MXFP4
    # blocks); llama.cpp's fixed SwiGLU limit 7 and alpha 1.702
    "gpt-oss": ("gpt_oss", dict(intermediate_size=64, swiglu_limit=7.0, swiglu_alpha=1.702)),
}
# Tensor types a GGUF test file of an architecture takes by name (others: GGUF_CYCLE)
GGUF_TYPES_BY_ARCH = {"gpt-oss": lambda gname: "MXFP4" if gname.endswith("_exps.weight") else None}


def build_hf_for_gguf(arch: str, seed: int = 0):
  """GGUF_CASES[arch]'s transformers model (arch: an id, "arch" or "arch:variant")."""
  case, kw = GGUF_CASES[arch]
  cfg_cls, model_cls, base = CASES[case]
  CASES[f"_gguf_{arch}"] = (cfg_cls, model_cls, dict(base, **kw))
  try:
    return build_hf(f"_gguf_{arch}", seed)
  finally:
    del CASES[f"_gguf_{arch}"]


def _neox_to_gguf(x, h):
  """GPT-NeoX's query_key_value rows [h][q, k, v][K] -> llama.cpp's [q; k; v]."""
  return x.reshape(h, 3, -1, *x.shape[1:]).swapaxes(0, 1).reshape(x.shape)


def _neox_from_gguf(x, h):
  return x.reshape(3, h, -1, *x.shape[1:]).swapaxes(0, 1).reshape(x.shape)


def _gguf_layout(model):
  """(arch, metadata [(GGUFWriter method, value)], tensors [(GGUF name, HF name, array as
  stored, stored -> HF)]) of a transformers model, following llama.cpp's
  convert_hf_to_gguf.py for its class."""
  c = model.config
  sd = {k: v.detach().numpy().astype(np.float32) for k, v in model.state_dict().items()}
  same = lambda x: x  # noqa: E731
  out = []

  def put(gname, hname, to=same, back=same):
    out.append((gname, hname, np.ascontiguousarray(to(sd[hname])), back))

  mt = c.model_type
  rp = getattr(c, "rope_parameters", None) or {}
  if mt in _NEW_ARCH:
    return _gguf_new_layout(model, sd)
  if mt == "gpt2":
    arch = "gpt2"
    meta = [("add_block_count", c.n_layer), ("add_context_length", c.n_positions),
            ("add_embedding_length", c.n_embd), ("add_feed_forward_length", 4 * c.n_embd),
            ("add_head_count", c.n_head), ("add_layer_norm_eps", c.layer_norm_epsilon)]
    p = "transformer."
    put("token_embd.weight", p + "wte.weight")
    put("position_embd.weight", p + "wpe.weight")
    put("output_norm.weight", p + "ln_f.weight")
    put("output_norm.bias", p + "ln_f.bias")
    names = {"ln_1": "attn_norm", "attn.c_attn": "attn_qkv", "attn.c_proj": "attn_output",
             "ln_2": "ffn_norm", "mlp.c_fc": "ffn_up", "mlp.c_proj": "ffn_down"}
    for i in range(c.n_layer):
      for hf, g in names.items():
        conv = not hf.startswith("ln")   # Conv1D (in, out) -> (out, in)
        put(f"blk.{i}.{g}.weight", f"{p}h.{i}.{hf}.weight", np.transpose if conv else same,
            np.transpose if conv else same)
        put(f"blk.{i}.{g}.bias", f"{p}h.{i}.{hf}.bias")
  elif mt == "gpt_neox":
    arch, h = "gptneox", c.num_attention_heads
    rot = int(rp.get("partial_rotary_factor", 1.0) * (c.hidden_size // h))
    meta = [("add_context_length", c.max_position_embeddings),
            ("add_embedding_length", c.hidden_size), ("add_block_count", c.num_hidden_layers),
            ("add_feed_forward_length", c.intermediate_size), ("add_rope_dimension_count", rot),
            ("add_head_count", h), ("add_parallel_residual", c.use_parallel_residual),
            ("add_layer_norm_eps", c.layer_norm_eps)]
    p = "gpt_neox."
    put("token_embd.weight", p + "embed_in.weight")
    put("output_norm.weight", p + "final_layer_norm.weight")
    put("output_norm.bias", p + "final_layer_norm.bias")
    put("output.weight", "lm_head.weight")
    names = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
             "attention.query_key_value": "attn_qkv", "attention.dense": "attn_output",
             "mlp.dense_h_to_4h": "ffn_up", "mlp.dense_4h_to_h": "ffn_down"}
    for i in range(c.num_hidden_layers):
      for hf, g in names.items():
        for part in ("weight", "bias"):
          qkv = g == "attn_qkv"
          put(f"blk.{i}.{g}.{part}", f"{p}layers.{i}.{hf}.{part}",
              (lambda x: _neox_to_gguf(x, h)) if qkv else same,
              (lambda x: _neox_from_gguf(x, h)) if qkv else same)
  else:
    arch = {"phi3": "phi3", "gemma2": "gemma2", "gemma3_text": "gemma3", "olmo2": "olmo2",
            "qwen3": "qwen3"}[mt]
    d, h, g = c.hidden_size, c.num_attention_heads, c.num_key_value_heads
    meta = [("add_context_length", c.max_position_embeddings), ("add_embedding_length", d),
            ("add_block_count", c.num_hidden_layers),
            ("add_feed_forward_length", c.intermediate_size), ("add_head_count", h),
            ("add_head_count_kv", g), ("add_layer_norm_rms_eps", c.rms_norm_eps)]
    plus = (lambda x: x + np.float32(1), lambda x: x - np.float32(1)) if arch in (
        "gemma2", "gemma3") else (same, same)     # Gemma's norms scale by 1 + w
    put("token_embd.weight", "model.embed_tokens.weight")
    put("output_norm.weight", "model.norm.weight", *plus)
    if not c.tie_word_embeddings:
      put("output.weight", "lm_head.weight")
    names = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
             "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
             "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
             "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
             "self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up",
             "input_layernorm": "attn_norm"}
    gemma_norms = {"post_attention_layernorm": "post_attention_norm",
                   "pre_feedforward_layernorm": "ffn_norm",
                   "post_feedforward_layernorm": "post_ffw_norm"}
    names.update({"gemma2": gemma_norms, "gemma3": gemma_norms,
                  "olmo2": {"post_attention_layernorm": "post_attention_norm",
                            "post_feedforward_layernorm": "post_ffw_norm"}}.get(
                                arch, {"post_attention_layernorm": "ffn_norm"}))
    for i in range(c.num_hidden_layers):
      for hf, gname in names.items():
        if f"model.layers.{i}.{hf}.weight" in sd:
          norm = hf.endswith("layernorm") or (arch == "gemma3" and hf.endswith("_norm"))
          put(f"blk.{i}.{gname}.weight", f"model.layers.{i}.{hf}.weight",
              *(plus if norm else (same, same)))
    if arch == "phi3":
      rot = int(rp.get("partial_rotary_factor", 1.0) * d) // h
      orig = c.original_max_position_embeddings
      meta += [("add_rope_scaling_orig_ctx_len", orig), ("add_rope_dimension_count", rot),
               ("add_rope_freq_base", rp["rope_theta"]),
               ("add_sliding_window", c.sliding_window or 0)]
      if rp.get("long_factor"):
        scale = c.max_position_embeddings / orig
        meta.append(("add_rope_scaling_attn_factors",
                     math.sqrt(1 + math.log(scale) / math.log(orig)) if scale > 1 else 1.0))
        for kind in ("long", "short"):
          out.append((f"rope_factors_{kind}.weight", None,
                      np.asarray(rp[f"{kind}_factor"], np.float32), None))
    elif arch == "gemma2":
      meta += [("add_key_length", c.head_dim), ("add_value_length", c.head_dim),
               ("add_attn_logit_softcapping", c.attn_logit_softcapping),
               ("add_final_logit_softcapping", c.final_logit_softcapping),
               ("add_sliding_window", c.sliding_window)]
    elif arch == "gemma3":
      meta += [("add_key_length", c.head_dim), ("add_value_length", c.head_dim),
               ("add_sliding_window", c.sliding_window),
               ("add_rope_freq_base", rp["full_attention"]["rope_theta"])]
    else:
      meta.append(("add_rope_freq_base", rp["rope_theta"]))
      if getattr(c, "head_dim", None):
        meta += [("add_key_length", c.head_dim), ("add_value_length", c.head_dim)]
  return arch, meta, out


# transformers model_type -> llama.cpp architecture, for the newer families
_NEW_ARCH = {"mixtral": "llama", "qwen3_moe": "qwen3moe", "olmoe": "olmoe",
             "stablelm": "stablelm", "phi": "phi2", "bloom": "bloom",
             "falcon": "falcon", "cohere": "command-r", "granite": "granite",
             "smollm3": "smollm3", "deepseek_v2": "deepseek2", "deepseek_v3": "deepseek2",
             "gpt_oss": "gpt-oss"}


def _new_meta(c, arch):
  """The metadata llama.cpp's converter writes for the newer families (its TextModel's
  generic keys, or the class's own set_gguf_parameters)."""
  g = lambda *keys: next(getattr(c, k) for k in keys if getattr(c, k, None) is not None)  # noqa: E731
  d, h = g("hidden_size", "n_embd"), g("num_attention_heads", "n_head")
  k = d // h
  rp = getattr(c, "rope_parameters", None) or {}
  meta = [("add_block_count", g("num_hidden_layers", "n_layer")), ("add_embedding_length", d),
          ("add_head_count", h)]
  if arch == "deepseek2":
    return meta + _deepseek2_meta(c) + _yarn_meta(rp)
  if arch in ("bloom", "falcon", "phi2"):       # their classes: 4 D, no RoPE base written
    ctx = 2048 if arch == "falcon" else getattr(c, "seq_length", d) if arch == "bloom" \
        else c.max_position_embeddings
    kv = _falcon_kv(c) if arch == "falcon" else h
    meta += [("add_context_length", ctx), ("add_feed_forward_length", 4 * d),
             ("add_head_count_kv", kv),
             ("add_layer_norm_eps", g("layer_norm_epsilon", "layer_norm_eps"))]
    if arch == "falcon":
      meta.append(("add_tensor_data_layout", "jploski"))
    if arch == "phi2":
      meta.append(("add_rope_dimension_count", int(rp["partial_rotary_factor"] * d) // h))
    return meta
  if arch == "stablelm":
    return meta + [("add_context_length", c.max_position_embeddings),
                   ("add_feed_forward_length", c.intermediate_size),
                   ("add_rope_dimension_count", int(rp["partial_rotary_factor"] * k)),
                   ("add_head_count_kv", c.num_key_value_heads),
                   ("add_parallel_residual", c.use_parallel_residual),
                   ("add_layer_norm_eps", c.layer_norm_eps)]
  meta += [("add_context_length", c.max_position_embeddings),
           ("add_feed_forward_length", c.intermediate_size),
           ("add_head_count_kv", c.num_key_value_heads), ("add_rope_freq_base", rp["rope_theta"])]
  meta.append(("add_layer_norm_eps", c.layer_norm_eps) if arch == "command-r"
              else ("add_layer_norm_rms_eps", c.rms_norm_eps))
  if getattr(c, "num_experts_per_tok", None):
    meta += [("add_expert_count", getattr(c, "num_local_experts", None) or c.num_experts),
             ("add_expert_used_count", c.num_experts_per_tok)]
  if getattr(c, "moe_intermediate_size", None):
    meta.append(("add_expert_feed_forward_length", c.moe_intermediate_size))
  if getattr(c, "head_dim", None) and arch != "granite":
    meta += [("add_key_length", c.head_dim), ("add_value_length", c.head_dim)]
  if arch in ("llama", "granite", "smollm3"):     # LlamaModel's
    meta += [("add_vocab_size", c.vocab_size),
             ("add_rope_dimension_count", getattr(c, "head_dim", None) or k)]
  if arch == "command-r":
    import gguf
    meta += [("add_logit_scale", c.logit_scale),
             ("add_rope_scaling_type", gguf.RopeScalingType.NONE)]
  if arch == "gpt-oss":
    meta += [("add_sliding_window", c.sliding_window),
             ("add_expert_feed_forward_length", c.intermediate_size)] + _yarn_meta(rp)
  if arch == "granite":
    meta += [("add_attention_scale", c.attention_multiplier),
             ("add_embedding_scale", c.embedding_multiplier),
             ("add_residual_scale", c.residual_multiplier),
             ("add_logit_scale", c.logits_scaling)]
  return meta


def _yarn_meta(rp):
  """The YaRN keys of the converter's TextModel (its generic RoPE settings): the type,
  factor and original context, the betas and attention factor where the config has them;
  DeepseekV2Model adds mscale_all_dim x 0.1 as yarn_log_multiplier."""
  import gguf
  if rp.get("rope_type") != "yarn" or rp.get("factor") is None:
    return []
  meta = [("add_rope_scaling_type", gguf.RopeScalingType.YARN),
          ("add_rope_scaling_factor", rp["factor"]),
          ("add_rope_scaling_orig_ctx_len", rp["original_max_position_embeddings"])]
  for key, method in (("attention_factor", "add_rope_scaling_yarn_attn_factor"),
                      ("beta_fast", "add_rope_scaling_yarn_beta_fast"),
                      ("beta_slow", "add_rope_scaling_yarn_beta_slow")):
    if rp.get(key) is not None:
      meta.append((method, rp[key]))
  if rp.get("mscale_all_dim") is not None:
    meta.append(("add_rope_scaling_yarn_log_mul", 0.1 * rp["mscale_all_dim"]))
  return meta


def _deepseek2_meta(c):
  """DeepseekV2Model.set_gguf_parameters's keys (and its TextModel's): one kv head of
  the latent's width, the per-head widths as *_mla, the experts, groups and gating."""
  import gguf
  rp = c.rope_parameters
  meta = [("add_context_length", c.max_position_embeddings),
          ("add_feed_forward_length", c.intermediate_size), ("add_head_count_kv", 1),
          ("add_rope_freq_base", rp["rope_theta"]), ("add_layer_norm_rms_eps", c.rms_norm_eps),
          ("add_expert_count", c.n_routed_experts), ("add_expert_used_count", c.num_experts_per_tok),
          ("add_leading_dense_block_count", c.first_k_dense_replace),
          ("add_vocab_size", c.vocab_size), ("add_kv_lora_rank", c.kv_lora_rank),
          ("add_key_length", c.kv_lora_rank + c.qk_rope_head_dim),
          ("add_value_length", c.kv_lora_rank),
          ("add_key_length_mla", c.qk_nope_head_dim + c.qk_rope_head_dim),
          ("add_value_length_mla", c.v_head_dim),
          ("add_expert_feed_forward_length", c.moe_intermediate_size),
          ("add_expert_shared_count", c.n_shared_experts),
          ("add_expert_weights_scale", c.routed_scaling_factor),
          ("add_rope_dimension_count", c.qk_rope_head_dim)]
  if c.q_lora_rank is not None:
    meta.append(("add_q_lora_rank", c.q_lora_rank))
  if c.n_group is not None:
    meta += [("add_expert_group_count", c.n_group), ("add_expert_group_used_count", c.topk_group)]
  # DeepSeek's config.json names its scoring_func: sigmoid (V3), softmax (V2)
  meta.append(("add_expert_gating_func", gguf.ExpertGatingFuncType.SIGMOID
               if c.model_type == "deepseek_v3" else gguf.ExpertGatingFuncType.SOFTMAX))
  if c.model_type == "deepseek_v3" and c.norm_topk_prob:
    meta.append(("add_expert_weights_norm", True))
  return meta


def _deepseek2_tensors(c, hname, x, blk):
  """The converter's split of kv_b_proj (H (Kn + V), C) into attn_k_b (H, C, Kn) and
  attn_v_b (H, V, C); DeepSeek-V3's correction bias as exp_probs_b.bias; None for others."""
  if hname.endswith("kv_b_proj.weight"):
    kv = x.reshape(c.num_attention_heads, c.qk_nope_head_dim + c.v_head_dim, -1)
    kb = np.ascontiguousarray(kv[:, :c.qk_nope_head_dim].transpose(0, 2, 1))
    vb = np.ascontiguousarray(kv[:, c.qk_nope_head_dim:])
    return [(blk + "attn_k_b.weight", hname + "#0", kb, lambda y: y.transpose(0, 2, 1)),
            (blk + "attn_v_b.weight", hname + "#1", vb, lambda y: y)]
  if hname.endswith("e_score_correction_bias"):
    return [(blk + "exp_probs_b.bias", hname, x, lambda y: y)]
  return None


def _gpt_oss_experts(hname, x, blk):
  """gpt-oss's experts as the converter writes them: gate_up_proj (E, D, 2F) with gate /
  up interleaved -> ffn_gate_exps / ffn_up_exps (E, F, D), down_proj (E, F, D) ->
  ffn_down_exps (E, D, F); their biases split the same way ("#i": interleaved back)."""
  if "gate_up_proj" in hname:
    bias = hname.endswith("_bias")
    part = (lambda y: y) if bias else (lambda y: y.transpose(0, 2, 1))
    suffix = "bias" if bias else "weight"
    return [(f"{blk}ffn_{n}_exps.{suffix}", f"{hname}#i{j}",
             np.ascontiguousarray(part(x[..., j::2])), part) for j, n in enumerate(("gate", "up"))]
  if hname.endswith("down_proj_bias"):
    return [(blk + "ffn_down_exps.bias", hname, x, lambda y: y)]
  return [(blk + "ffn_down_exps.weight", hname, np.ascontiguousarray(x.transpose(0, 2, 1)),
           lambda y: y.transpose(0, 2, 1))]


def _gguf_new_layout(model, sd):
  """(arch, metadata, tensors) of a newer family, following convert_hf_to_gguf.py: its
  tensor names from gguf's TensorNameMap (what the converter maps with), Q / K rows
  permuted for LlamaModel's subclasses, experts stacked, BLOOM's and Falcon's fused
  QKV reordered to [q; k; v]."""
  import gguf
  c = model.config
  arch = _NEW_ARCH[c.model_type]
  names = gguf.get_tensor_name_map({v: k for k, v in gguf.MODEL_ARCH_NAMES.items()}[arch],
                                   c.num_hidden_layers if hasattr(c, "num_hidden_layers")
                                   else c.n_layer)
  h = getattr(c, "num_attention_heads", None) or c.n_head
  g = getattr(c, "num_key_value_heads", None) or h
  if arch == "falcon":
    g = _falcon_kv(c)
  same = lambda x: x  # noqa: E731
  out = []
  for hname, x in sd.items():
    if hname == "lm_head.weight" and c.tie_word_embeddings:
      continue
    to = back = same
    if arch in ("llama", "granite", "smollm3") and hname.endswith((
        "q_proj.weight", "k_proj.weight", "q_proj.bias", "k_proj.bias")):   # LlamaModel's
      n = h if "q_proj" in hname else g
      to = lambda x, n=n: converter_permute(x, n)   # noqa: E731
      back = lambda x, n=n: _unpermute(x, n)   # noqa: E731
    if arch == "bloom" and "query_key_value" in hname:
      to, back = (lambda x: _neox_to_gguf(x, h)), (lambda x: _neox_from_gguf(x, h))
    if arch == "falcon" and "query_key_value" in hname:
      to, back = (lambda x: _group_qkv_to_gguf(x, h, g)), (lambda x: _group_qkv_from_gguf(x, h, g))
    key = hname.replace("transformer.", "") if arch == "bloom" else hname
    blk = f"blk.{hname.split('.layers.')[1].split('.')[0]}." if ".layers." in hname else ""
    special = _deepseek2_tensors(c, hname, x, blk) if arch == "deepseek2" else \
        _gpt_oss_experts(hname, x, blk) if arch == "gpt-oss" and ".experts." in hname else None
    if special is not None:
      out += special
      continue
    if arch == "gpt-oss" and hname.endswith("sinks"):
      key = hname + ".weight"      # the converter's name for it
    if ".experts." in hname:    # stacked (E, 2F, D) [gate; up] and (E, D, F)
      if hname.endswith("gate_up_proj"):
        f = x.shape[1] // 2
        out.append((blk + "ffn_gate_exps.weight", hname + "#0", np.ascontiguousarray(x[:, :f]),
                    same))
        out.append((blk + "ffn_up_exps.weight", hname + "#1", np.ascontiguousarray(x[:, f:]),
                    same))
      else:
        out.append((blk + "ffn_down_exps.weight", hname, x, same))
      continue
    gname = names.get_name(key, try_suffixes=(".weight", ".bias"))
    assert gname is not None, (arch, hname)
    out.append((gname, hname, np.ascontiguousarray(to(x)), back))
  return arch, _new_meta(c, arch), out


def _falcon_kv(c):
  return c.num_kv_heads if c.new_decoder_architecture else 1 if c.multi_query else \
      c.num_attention_heads


def _unpermute(w, n_head):
  return w.reshape(n_head, w.shape[0] // n_head // 2, 2, -1).swapaxes(1, 2).reshape(w.shape)


def _group_qkv_to_gguf(x, h, g):
  k = x.shape[0] // (h + 2 * g)
  y = x.reshape(g, h // g + 2, k, *x.shape[1:])
  return np.concatenate([y[:, :-2].reshape(h * k, *x.shape[1:]), y[:, -2].reshape(
      g * k, *x.shape[1:]), y[:, -1].reshape(g * k, *x.shape[1:])])


def _group_qkv_from_gguf(x, h, g):
  k = x.shape[0] // (h + 2 * g)
  q = x[:h * k].reshape(g, h // g, k, *x.shape[1:])
  kk = x[h * k:(h + g) * k].reshape(g, 1, k, *x.shape[1:])
  v = x[(h + g) * k:].reshape(g, 1, k, *x.shape[1:])
  return np.concatenate([q, kk, v], axis=1).reshape(x.shape)


def _put_tensor(writer, name, x, qtype):
  import gguf
  t = getattr(gguf.GGMLQuantizationType, qtype)
  if qtype == "F32":
    writer.add_tensor(name, x.astype(np.float32))
  elif qtype == "F16":
    writer.add_tensor(name, x.astype(np.float16))
  else:
    writer.add_tensor(name, gguf.quants.quantize(x.astype(np.float32), t), raw_dtype=t)


def _add_byte_level_vocab(writer, n, pre="gpt2"):
  """A byte-level BPE vocabulary of the first n (None: all 256) single-character tokens
  (tokenizer.ggml.*)."""
  from tokenizers import pre_tokenizers
  alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())[:n]
  writer.add_tokenizer_model("gpt2")
  writer.add_tokenizer_pre(pre)
  writer.add_token_list(alphabet)
  writer.add_token_types([1] * len(alphabet))
  writer.add_token_merges([])


def write_gguf(model, path, types: dict | None = None, extra_meta=()):
  """`model` (transformers) written as llama.cpp's converter would, in mixed tensor types
  (types: GGUF name -> type; default: 2-D tensors cycle through GGUF_CYCLE, 1-D stay F32).
  Returns (architecture, {HF name: the values the file holds, read back and mapped to the
  HF layout}): load those into the model for the reference."""
  import gguf
  arch, meta, tensors = _gguf_layout(model)
  w = gguf.GGUFWriter(str(path), arch)
  for method, value in list(meta) + list(extra_meta):
    getattr(w, method)(value)
  _add_byte_level_vocab(w, model.get_input_embeddings().weight.shape[0])
  n2 = 0
  by_name = GGUF_TYPES_BY_ARCH.get(arch, lambda gname: None)
  for gname, _, x, _ in tensors:
    qt = (types or {}).get(gname) or by_name(gname)
    if qt is None:
      qt = GGUF_CYCLE[n2 % len(GGUF_CYCLE)] if x.ndim >= 2 else "F32"
      n2 += x.ndim >= 2
    _put_tensor(w, gname, x, qt)
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()
  back = {t.name: np.asarray(gguf.quants.dequantize(np.asarray(t.data), t.tensor_type),
                             np.float32) for t in gguf.GGUFReader(str(path)).tensors}
  held = {hname: np.ascontiguousarray(to_hf(back[gname]))
          for gname, hname, _, to_hf in tensors if hname is not None}
  shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
  for part in sorted(n for n in held if n.endswith("#0")):   # stacked gate / up -> gate_up
    joined = np.concatenate([held.pop(part), held.pop(part[:-2] + "#1")], axis=1)
    held[part[:-2]] = joined.reshape(shapes[part[:-2]])
  for part in sorted(n for n in held if n.endswith("#i0")):  # interleaved back (gpt-oss)
    a, b = held.pop(part), held.pop(part[:-3] + "#i1")
    held[part[:-3]] = np.stack([a, b], axis=-1).reshape(*a.shape[:-1], 2 * a.shape[-1])
  return arch, held


def load_held(model, held):
  """The model with its weights replaced by `held` (write_gguf's); tied copies follow."""
  import torch
  sd = model.state_dict()
  missing = [k for k in sd if k not in held and not k.endswith((".attn.bias",
                                                               ".attn.masked_bias"))]
  tied = {"lm_head.weight"} if model.config.tie_word_embeddings else set()
  assert set(missing) <= tied | {k for k in missing if "rotary_emb" in k}, missing
  model.load_state_dict({k: torch.as_tensor(np.array(v)) for k, v in held.items()},
                        strict=False)
  return model


def write_gguf_header(path, arch, meta):
  """A GGUF file with metadata only (and a 4-token embedding): enough for the reader to
  check the keys and settings it refuses before it reads tensors."""
  import gguf
  w = gguf.GGUFWriter(str(path), arch)
  for method, value in meta:
    getattr(w, method)(value)
  w.add_tensor("token_embd.weight", np.zeros((4, 32), np.float32))
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()
  return str(path)


# Strings every tokenizer comparison runs (accents, digits, code, emoji, whitespace).
TOKENIZER_SAMPLES = [
    "The capital of France is Paris.",
    "Hello, world! It's a test: don't panic; we'll see.",
    "numbers 12345 and 3.14159, dates 2024-01-31",
    "Unicode: café, naïve, Zürich, 日本語のテキスト, Привет мир, emoji 🙂👍🏽",
    "def f(x):\n    return x ** 2  # square\n\nprint(f(3))",
    "   leading spaces, and\ttabs\t\tand trailing   ",
    "a\n\n\n\nb    c\r\n  d",
]
