"""A GGUF file -> mha-jax decoder params, config and tokenizer, for llama.cpp's
architectures llama (and llama with experts: Mixtral), qwen2, qwen3, qwen3moe, olmoe,
gemma2, gemma3, olmo2, phi3, phi2, stablelm, bloom, falcon, command-r, granite, smollm3,
deepseek2, gpt-oss, gpt2 and gptneox (mapped onto the Hugging Face families of
adapters.FAMILIES: the same adapter tables and the one decoder forward). gptj and
qwen2moe files are refused by name (REFUSED_ARCH says why).

Tensors are dequantized with `gguf` (F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, the
K-quants, MXFP4: whatever gguf.quants can dequantize, as ggml does). GGUF stores a
linear layer as (out, in), like torch. The conventions of llama.cpp's converter (convert_hf_to_gguf.py) undone here:

  llama     Q and K rows permuted within each head, turning Hugging Face's half-split
            RoPE layout (pairs (j, j + K/2)) into the interleaved one llama.cpp's llama
            runs (pairs (2j, 2j + 1)): rows (h, half, j) are stored as (h, j, half);
            `unpermute_rope_rows` undoes it. Every other architecture here runs
            llama.cpp's NeoX (half-split) RoPE and is stored unpermuted.
  gemma2/3  norm weights stored as 1 + w (Gemma's RMSNorm scales by 1 + w).
  gpt2      Conv1D weights transposed to (out, in); c_attn is attn_qkv `[q; k; v]` (weights
            and bias), wpe is position_embd.
  gptneox   query_key_value's rows, interleaved per head `[h][q, k, v][K]`, reordered
            to `[q; k; v]` (weights and bias); partial rotary as rope.dimension_count.
  phi3      qkv_proj kept fused as attn_qkv (or split as attn_q / attn_k / attn_v),
            gate_up_proj as ffn_up `[gate (F); up (F)]`; LongRoPE as the tensors
            rope_factors_long / rope_factors_short and rope.scaling.attn_factor.
  granite, smollm3, llama with experts: llama's Q / K permutation. Experts (Mixtral,
            qwen3moe, olmoe) stacked as ffn_{gate,up}_exps (E, F, D) and ffn_down_exps
            (E, D, F), the router as ffn_gate_inp; llama.cpp renormalises the top-k
            weights for llama and qwen3moe, not for olmoe, and has no dense layers.
  bloom     query_key_value reordered per head to `[q; k; v]` as gptneox; ALiBi (max
            bias 8: BLOOM's slopes); token_embd_norm is the embedding LayerNorm.
  falcon    query_key_value per kv group `[q..., k, v]` reordered to `[q; k; v]`
            (tensor_data_layout "jploski"); attn_norm feeds the MLP, attn_norm_2 (when
            there: Falcon-40B's ln_attn) the attention; the RoPE base is not written.
  phi2, command-r, stablelm: stored as the HF tensors (Command-R runs the interleaved
            RoPE, llama.cpp's NORM, as its HF model does); Phi-2's logit bias as
            output.bias; Command-R's LayerNorm has no bias, its q / k / v / output biases
            are optional and its logits x logit_scale (0: not applied).
  granite   attention.scale, embedding_scale, residual_scale (0: llama.cpp's defaults),
            and logit_scale (llama.cpp divides the logits by it); rope.scaling.finetuned
            false: no RoPE (llama.cpp's switch); q / k / v / output and MLP biases when
            present (llama.cpp's optional tensors; q / k biases permuted like the rows).
  deepseek2 attn_kv_b split by the converter into attn_k_b (H, C, Kn) and attn_v_b
            (H, V, C) for llama.cpp's absorbed MLA: joined back into each head's
            decompressed key and value; the latent's key/value lengths (C + R, C, one kv
            head) and the heads' (key_length_mla, value_length_mla); interleaved RoPE;
            YaRN with the scores x (1 + 0.1 m ln factor)^2, m = yarn_log_multiplier / 0.1
            (the converter's 0.1 x mscale_all_dim), cos / sin unscaled (_yarn).
  gpt-oss   experts in MXFP4, gate / up split from the interleaved gate_up_proj, with
            biases; sink logits (attn_sinks); even layers sliding; SwiGLU limit 7 and
            alpha 1.702 (llama.cpp's constants); YaRN on every layer, correction range
            truncated as ggml does, cos / sin x (1 + 0.1 ln factor) (_yarn).
  smollm3   no RoPE in every 4th layer (llama.cpp's fixed step; the file carries no key).

Metadata: every `{arch}.*` key is in the architecture's table (_GGUF_KEYS) or refused by
name; a value that cannot be run exactly is refused naming the file, key and value.
"""

from __future__ import annotations

import functools
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
      raise UserError(f"file {path!r}: GGUF metadata has no {key!r}", setting="file")
    return default
  try:
    return f.contents()
  except (ValueError, IndexError, TypeError) as e:   # a string that is not UTF-8, ...
    raise UserError(f"file {path!r}: GGUF metadata {key!r} cannot be read: "
                     f"{type(e).__name__}: {e}", setting="file") from None


@functools.cache
def _reader_class():
  import gguf

  class Reader(gguf.GGUFReader):
    """gguf's reader over a plain ndarray view of its memory map: a slice of an np.memmap
    costs a memmap object each, and the reader slices once per vocabulary entry (15 of
    the 31 s of importing Gemma 3's 262,144 tokens; 1 s this way). Same bytes, same
    fields."""

    def _get(self, offset, dtype, count=1, override_order=None):
      if type(self.data) is not np.ndarray:
        self.data = self.data.view(np.ndarray)
      return super()._get(offset, dtype, count, override_order)

  return Reader


def open_reader(path: str):
  if not os.path.isfile(path):
    raise UserError(f"file {path!r}: no such file", setting="file")
  try:
    return _reader_class()(path, "r")
  except Exception as e:  # noqa: BLE001 - gguf raises ValueError, IndexError, struct errors...
    raise UserError(f"file {path!r} is not a readable GGUF file (corrupt or truncated?): "
                     f"{type(e).__name__}: {e}", setting="file") from None


# llama.cpp's tensor names per architecture -> (name under blk.{i}., kind, param target,
# optional). kinds: as adapters.py; "q*" / "kv*" are Q / K rows the converter permuted
# (llama only). An optional row is taken when layer 0 has the tensor (biases, Phi-3's
# fused or split QKV); every tensor of the file must still be taken.
_NORMS = (("attn_norm.weight", "vec", "ln1.scale", False),
          ("ffn_norm.weight", "vec", "ln2.scale", False))
_QKVO = (("attn_q.weight", "q", "attn.wq", False), ("attn_k.weight", "kv", "attn.wk", False),
         ("attn_v.weight", "kv", "attn.wv", False), ("attn_output.weight", "o", "attn.wo", False))
_QK_NORM = (("attn_q_norm.weight", "head_norm", "attn.q_norm", False),
            ("attn_k_norm.weight", "head_norm", "attn.k_norm", False))
_MLP = (("ffn_gate.weight", "lin", "mlp.w_gate", False), ("ffn_up.weight", "lin", "mlp.w_up", False),
        ("ffn_down.weight", "lin", "mlp.w_down", False))
_GEMMA_NORMS = (("attn_norm.weight", "vec", "ln1.scale", False),
                ("post_attention_norm.weight", "vec", "ln1_post.scale", False),
                ("ffn_norm.weight", "vec", "ln2.scale", False),
                ("post_ffw_norm.weight", "vec", "ln2_post.scale", False))
# GPT-2 and GPT-NeoX: LayerNorm with bias, fused [q; k; v] with bias, biased MLP.
_LN_BIASED = (("attn_norm.weight", "vec", "ln1.scale", False),
              ("attn_norm.bias", "vec", "ln1.bias", False),
              ("attn_qkv.weight", "qkv", "attn", False), ("attn_qkv.bias", "qkv", "attn.b", True),
              ("attn_output.weight", "o", "attn.wo", False),
              ("attn_output.bias", "vec", "attn.bo", True),
              ("ffn_norm.weight", "vec", "ln2.scale", False),
              ("ffn_norm.bias", "vec", "ln2.bias", False),
              ("ffn_up.weight", "lin", "mlp.w_up", False), ("ffn_up.bias", "vec", "mlp.b_up", True),
              ("ffn_down.weight", "lin", "mlp.w_down", False),
              ("ffn_down.bias", "vec", "mlp.b_down", True))
# Mixture of experts: the router and the experts stacked (E, F, D) / (E, D, F) as
# llama.cpp's converter merges them (every layer sparse: llama.cpp has no dense layers
# in these architectures).
_EXPERTS = (("ffn_gate_inp.weight", "lin", "mlp.router", False),
            ("ffn_gate_exps.weight", "exps_in", "mlp.w_gate", False),
            ("ffn_up_exps.weight", "exps_in", "mlp.w_up", False),
            ("ffn_down_exps.weight", "exps_out", "mlp.w_down", False))
_LLAMA_ATTN = _NORMS[:1] + (("attn_q.weight", "q*", "attn.wq", False),
                            ("attn_k.weight", "kv*", "attn.wk", False)) + _QKVO[2:]


def _ln(name: str, target: str, optional=False):
  """A LayerNorm's weight and bias (the bias optional where the family may lack it)."""
  return ((f"{name}.weight", "vec", f"{target}.scale", optional),
          (f"{name}.bias", "vec", f"{target}.bias", True))


def _biased(name: str, kind: str, target: str, bias_kind: str = "vec", bias_target=None):
  return ((f"{name}.weight", kind, target, False),
          (f"{name}.bias", bias_kind, bias_target or target.replace(".w", ".b", 1), True))


_LN_MLP = _biased("ffn_up", "lin", "mlp.w_up") + _biased("ffn_down", "lin", "mlp.w_down")
_GGUF_LAYER = {
    "llama": _LLAMA_ATTN + _NORMS[1:] + _MLP,
    # Mixtral: llama with experts (LlamaModel's converter merges block_sparse_moe)
    "mixtral": _LLAMA_ATTN + _NORMS[1:] + _EXPERTS,
    # Granite: q / k / v / output and MLP biases when the file has them (llama.cpp's
    # optional tensors); q / k biases permuted like their rows
    "granite": _LLAMA_ATTN + (
        ("attn_q.bias", "bq*", "attn.bq", True), ("attn_k.bias", "bkv*", "attn.bk", True),
        ("attn_v.bias", "bkv", "attn.bv", True), ("attn_output.bias", "vec", "attn.bo", True))
    + _NORMS[1:] + _MLP + tuple((n.replace(".weight", ".bias"), "vec", t.replace(".w_", ".b_"),
                                 True) for n, _, t, _ in _MLP),
    "smollm3": _LLAMA_ATTN + _NORMS[1:] + _MLP,
    "qwen3moe": _NORMS + _QKVO + _QK_NORM + _EXPERTS,
    "olmoe": _NORMS + _QKVO + (("attn_q_norm.weight", "whole_q", "attn.q_norm", False),
                               ("attn_k_norm.weight", "whole_k", "attn.k_norm", False))
    + _EXPERTS,
    # StableLM: ffn_norm only in the sequential block (use_parallel_residual false)
    "stablelm": _ln("attn_norm", "ln1") + _ln("ffn_norm", "ln2", True) + (
        ("attn_q.bias", "bq", "attn.bq", True), ("attn_k.bias", "bkv", "attn.bk", True),
        ("attn_v.bias", "bkv", "attn.bv", True)) + _QKVO + _MLP,
    # Phi-2: one LayerNorm, q / k / v (or fused attn_qkv) with biases, biased MLP
    "phi2": _ln("attn_norm", "ln1") + (
        ("attn_qkv.weight", "qkv", "attn", True), ("attn_qkv.bias", "qkv", "attn.b", True),
        ("attn_q.weight", "q", "attn.wq", True), ("attn_k.weight", "kv", "attn.wk", True),
        ("attn_v.weight", "kv", "attn.wv", True), ("attn_q.bias", "bq", "attn.bq", True),
        ("attn_k.bias", "bkv", "attn.bk", True), ("attn_v.bias", "bkv", "attn.bv", True))
    + _biased("attn_output", "o", "attn.wo", bias_target="attn.bo") + _LN_MLP,
    # BLOOM: the converter reorders query_key_value per head to [q; k; v]
    "bloom": _ln("attn_norm", "ln1") + _ln("ffn_norm", "ln2") + (
        ("attn_qkv.weight", "qkv", "attn", False), ("attn_qkv.bias", "qkv", "attn.b", True))
    + _biased("attn_output", "o", "attn.wo", bias_target="attn.bo") + _LN_MLP,
    # Falcon: attn_qkv reordered to [q; k; v] ("jploski"); attn_norm feeds the MLP, and
    # the attention too unless attn_norm_2 (Falcon-40B's ln_attn) is there
    "falcon": _ln("attn_norm", "ln2") + _ln("attn_norm_2", "ln1", True) + (
        ("attn_qkv.weight", "qkv", "attn", False), ("attn_output.weight", "o", "attn.wo", False),
        ("ffn_up.weight", "lin", "mlp.w_up", False),
        ("ffn_down.weight", "lin", "mlp.w_down", False)),
    # Command-R: q / k / v / output biases when the file has them (llama.cpp's optional)
    "command-r": (("attn_norm.weight", "vec", "ln1.scale", False),) + _QKVO + (
        ("attn_q.bias", "bq", "attn.bq", True), ("attn_k.bias", "bkv", "attn.bk", True),
        ("attn_v.bias", "bkv", "attn.bv", True), ("attn_output.bias", "vec", "attn.bo", True))
    + _MLP,
    "qwen2": _NORMS + _QKVO + (("attn_q.bias", "bq", "attn.bq", False),
                               ("attn_k.bias", "bkv", "attn.bk", False),
                               ("attn_v.bias", "bkv", "attn.bv", False)) + _MLP,
    "qwen3": _NORMS + _QKVO + _QK_NORM + _MLP,
    "gemma2": _GEMMA_NORMS + _QKVO + _MLP,
    "gemma3": _GEMMA_NORMS + _QKVO + _QK_NORM + _MLP,
    # OLMo 2: no pre-norms; RMSNorm over the whole Q (H K) and K (G K) projections.
    "olmo2": (("post_attention_norm.weight", "vec", "ln1_post.scale", False),
              ("post_ffw_norm.weight", "vec", "ln2_post.scale", False),
              ("attn_q_norm.weight", "whole_q", "attn.q_norm", False),
              ("attn_k_norm.weight", "whole_k", "attn.k_norm", False)) + _QKVO + _MLP,
    "phi3": _NORMS + (("attn_qkv.weight", "qkv", "attn", True),
                      ("attn_q.weight", "q", "attn.wq", True),
                      ("attn_k.weight", "kv", "attn.wk", True),
                      ("attn_v.weight", "kv", "attn.wv", True),
                      ("attn_output.weight", "o", "attn.wo", False),
                      ("ffn_up.weight", "gate_up", "mlp", False),
                      ("ffn_down.weight", "lin", "mlp.w_down", False)),
    "gpt2": _LN_BIASED,
    "gptneox": _LN_BIASED,
    # DeepSeek-V2/V3 (MLA): the row's condition (a string) is a setting of the layer
    # (adapters.build_params: dense / moe / moe_shared; low_rank_q / full_q by the file);
    # attn_kv_b is rebuilt from the converter's attn_k_b / attn_v_b (_mla_kv_b)
    "deepseek2": _NORMS + (
        ("attn_q.weight", "mla_q", "attn.wq", "full_q"),
        ("attn_q_a.weight", "lin", "attn.wq_a", "low_rank_q"),
        ("attn_q_a_norm.weight", "vec", "attn.q_a_norm", "low_rank_q"),
        ("attn_q_b.weight", "mla_q", "attn.wq", "low_rank_q"),
        ("attn_kv_a_mqa.weight", "mla_kv_a", "attn", False),
        ("attn_kv_a_norm.weight", "vec", "attn.kv_a_norm", False),
        ("attn_kv_b.weight", "mla_kv_b", "attn", False),
        ("attn_output.weight", "mla_o", "attn.wo", False))
    + tuple((n, k, t, "dense") for n, k, t, _ in _MLP)
    + tuple((n, k, t, "moe") for n, k, t, _ in _EXPERTS) + (
        ("ffn_gate_shexp.weight", "lin", "mlp.shared.w_gate", "moe_shared"),
        ("ffn_up_shexp.weight", "lin", "mlp.shared.w_up", "moe_shared"),
        ("ffn_down_shexp.weight", "lin", "mlp.shared.w_down", "moe_shared")),
}
# gpt-oss: attention with biases and a sink logit per head, post_attention_norm before
# the experts (with biases, gate / up split by the converter from the interleaved
# gate_up_proj), the router with its bias
_GGUF_LAYER["gpt-oss"] = (
    ("attn_norm.weight", "vec", "ln1.scale", False),
    ("post_attention_norm.weight", "vec", "ln2.scale", False)) + _QKVO + (
    ("attn_q.bias", "bq", "attn.bq", False), ("attn_k.bias", "bkv", "attn.bk", False),
    ("attn_v.bias", "bkv", "attn.bv", False), ("attn_output.bias", "vec", "attn.bo", False),
    ("attn_sinks.weight", "vec", "attn.sink_logit", False),
    ("ffn_gate_inp.bias", "vec", "mlp.router_bias", False)) + _EXPERTS + (
    ("ffn_gate_exps.bias", "vec", "mlp.b_gate", False),
    ("ffn_up_exps.bias", "vec", "mlp.b_up", False),
    ("ffn_down_exps.bias", "vec", "mlp.b_down", False))
# DeepSeek-V3's expert-selection bias, on the sparse layers of the files that have it
_EXP_PROBS_B = ("exp_probs_b.bias", "vec", "mlp.router_correction", "moe")
# llama.cpp's architecture (or "mixtral": llama with experts) -> the Hugging Face family
# it maps onto (adapters.FAMILIES)
_FAMILY = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma2": "gemma2",
           "gemma3": "gemma3", "olmo2": "olmo2", "phi3": "phi3", "gpt2": "gpt2",
           "gptneox": "gpt_neox", "mixtral": "mixtral", "qwen3moe": "qwen3_moe",
           "olmoe": "olmoe", "stablelm": "stablelm", "phi2": "phi",
           "bloom": "bloom", "falcon": "falcon", "command-r": "cohere",
           "granite": "granite", "smollm3": "smollm3", "deepseek2": "deepseek_v2", "gpt-oss": "gpt_oss"}
SUPPORTED_ARCH = tuple(a for a in _GGUF_LAYER if a != "mixtral")
# Architectures llama.cpp has whose files are refused, and why (named in the refusal).
REFUSED_ARCH = {
    "qwen2moe": "Qwen2-MoE (a gated shared expert) is not a family here",
    "gptj": "llama.cpp defines no GPT-J graph (no model class runs it, its rope type for "
            "gptj is NONE, and convert_hf_to_gguf.py has no GPT-J class), so a gptj file "
            "has no computation to be exact to; import the HF folder",
}
_LAYER_NORM_ARCH = ("gpt2", "gptneox", "stablelm", "phi2", "bloom", "falcon",
                    "command-r")   # LayerNorm (with bias, but command-r's), not RMSNorm
_FUSED_QKV_ARCH = ("gpt2", "gptneox")   # Q, K, V as views of one (3 D) projection
# The converter's LlamaModel (and its subclasses) permute Q / K rows (see the docstring).
_PERMUTED_ARCH = ("llama", "granite", "smollm3")
_MOE_ARCH = {"mixtral": "softmax_renorm", "qwen3moe": "softmax_renorm", "olmoe": "softmax",
             "gpt-oss": "topk_softmax"}
_ACT = {"gemma2": "gelu_tanh", "gemma3": "gelu_tanh", "gpt2": "gelu_tanh", "gptneox": "gelu",
        "phi2": "gelu_tanh", "bloom": "gelu_tanh", "falcon": "gelu"}

# Metadata keys read per architecture (besides general.* and tokenizer.*); any other
# "{arch}.*" key is refused by name.
_SIZES = ("context_length", "embedding_length", "block_count", "feed_forward_length",
          "attention.head_count", "attention.head_count_kv", "attention.key_length",
          "attention.value_length", "vocab_size")
_ROPE = ("rope.freq_base", "rope.dimension_count", "rope.scaling.type",
         "rope.scaling.factor", "rope.scaling.original_context_length",
         "rope.scaling.finetuned")
_YARN_KEYS = ("rope.scaling.yarn_beta_fast", "rope.scaling.yarn_beta_slow")   # _yarn
_RMS = ("attention.layer_norm_rms_epsilon",)
_WINDOW = ("attention.sliding_window",)
_EXPERT_KEYS = ("expert_count", "expert_used_count")
_LN = ("attention.layer_norm_epsilon",)
_GGUF_KEYS = {
    "llama": _SIZES + _ROPE + _RMS + _WINDOW + _EXPERT_KEYS,
    "qwen2": _SIZES + _ROPE + _RMS + _WINDOW,
    "qwen3moe": _SIZES + _ROPE + _RMS + _EXPERT_KEYS + ("expert_feed_forward_length",),
    "olmoe": _SIZES + _ROPE + _RMS + _EXPERT_KEYS,
    "stablelm": _SIZES + _ROPE + _LN + ("use_parallel_residual",),
    "phi2": _SIZES + _ROPE + _LN,
    "bloom": _SIZES + _LN + ("attention.max_alibi_bias",),
    "falcon": _SIZES + _ROPE + _LN + ("tensor_data_layout",),
    "command-r": _SIZES + _ROPE + _LN + ("logit_scale",),
    "granite": _SIZES + _ROPE + _RMS + ("attention.scale", "embedding_scale",
                                        "residual_scale", "logit_scale"),
    "smollm3": _SIZES + _ROPE + _RMS,
    "qwen3": _SIZES + _ROPE + _RMS + _WINDOW, "gemma3": _SIZES + _ROPE + _RMS + _WINDOW,
    "gemma2": _SIZES + _ROPE + _RMS + _WINDOW + ("attn_logit_softcapping",
                                                 "final_logit_softcapping"),
    "olmo2": _SIZES + _ROPE + _RMS,
    "phi3": _SIZES + _ROPE + _RMS + _WINDOW + ("rope.scaling.attn_factor",),
    "gpt2": _SIZES + ("attention.layer_norm_epsilon",),
    "gptneox": _SIZES + _ROPE + ("attention.layer_norm_epsilon", "use_parallel_residual"),
    "gpt-oss": _SIZES + _ROPE + _YARN_KEYS + _RMS + _WINDOW + _EXPERT_KEYS + (
        "expert_feed_forward_length",),
    "deepseek2": _SIZES + _ROPE + _YARN_KEYS + _RMS + _EXPERT_KEYS + (
        "rope.scaling.yarn_log_multiplier",
        "leading_dense_block_count", "attention.q_lora_rank", "attention.kv_lora_rank",
        "attention.key_length_mla", "attention.value_length_mla",
        "expert_feed_forward_length", "expert_shared_count", "expert_weights_scale",
        "expert_weights_norm", "expert_gating_func", "expert_group_count",
        "expert_group_used_count"),
}
# llama.cpp's Gemma 2 / 3 27B (46 / 62 layers) scale queries by 1 / sqrt(D / H), the other
# sizes by 1 / sqrt(K) (llama-model.cpp, load_hparams): the files carry no scale key.
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}


def read(path: str, dtype: str = "float32", place=None):
  """(params as NumPy, model config dict, tokenizers.Tokenizer, tokenizer config, info).
  place: adapters.build_params's (each tensor placed as it is converted).

  Architectures: SUPPORTED_ARCH (llama: SmolLM2, Llama 3, Mistral's and Mixtral's GGUFs)."""
  from mha_jax.pretrained import adapters
  f = _File(path)
  s, fam = _metadata(f, _layout, f)
  params, qtypes = _params(f, s, fam, dtype, place)
  cfg = adapters.model_config(s, fam)
  tok, tok_cfg = _metadata(f, _tokenizer, f, s["v"])
  info = dict(format="gguf", name=str(f.field("general.name", "")), tensor_types=qtypes)
  return params, cfg, tok, tok_cfg, info


def read_header(path: str):
  """(model config dict, tokenizers.Tokenizer, tokenizer config, info) as `read` gives
  them, from the file's metadata and tensor headers alone: no tensor is dequantized, so
  it costs the metadata parse (seconds for a 262,144-token vocabulary), not the weights'
  memory. info's tensor_types counts the stored types of every tensor; the refusals of
  the metadata and tokenizer are read's (the tensors' own checks need `read`)."""
  from mha_jax.pretrained import adapters
  f = _File(path)
  s, fam = _metadata(f, _layout, f)
  tok, tok_cfg = _metadata(f, _tokenizer, f, s["v"])
  qtypes: dict[str, int] = {}
  for t in f.reader.tensors:
    qtypes[t.tensor_type.name] = qtypes.get(t.tensor_type.name, 0) + 1
  info = dict(format="gguf", name=str(f.field("general.name", "")), tensor_types=qtypes)
  return adapters.model_config(s, fam), tok, tok_cfg, info


def _metadata(f: _File, fn, *args):
  """fn(*args), reading the file's metadata: a value of the wrong type or out of range
  that no check named (a string where a number goes, ...) is one UserError naming the
  file."""
  try:
    return fn(*args)
  except UserError:
    raise
  except (TypeError, ValueError, ArithmeticError, AttributeError, KeyError, IndexError) as e:
    raise UserError(f"file {f.path!r}: GGUF metadata cannot be read as the settings it is "
                     f"for ({type(e).__name__}: {' '.join(str(e).split())[:200]})",
                     setting="file") from None


def _layout(f: _File):
  """(the settings dict with its vocabulary size, the adapters.Family of the file)."""
  s = _sizes(f)
  _attention_layout(f, s)
  embed_t = f.by_name.get("token_embd.weight")
  if embed_t is None:
    raise UserError(f"file {f.path!r}: tensor 'token_embd.weight' is missing", setting="file")
  if len(embed_t.shape) != 2:
    raise UserError(f"file {f.path!r}: tensor 'token_embd.weight' has shape "
                     f"{tuple(int(n) for n in embed_t.shape)}, not (D, V)", setting="file")
  s["v"] = f.check(int(embed_t.shape[1]), "token_embd.weight's rows")
  return s, _family(f)


class _File:
  """One open GGUF file: its reader, architecture and tensors by name, with metadata reads
  and refusals that name the file. Every `{arch}.*` key must be in _GGUF_KEYS[arch]."""

  def __init__(self, path: str):
    self.path, self.reader = path, open_reader(path)
    self.arch = arch = self.field("general.architecture", required=True)
    if not isinstance(arch, str):
      raise UserError(f"file {path!r}: general.architecture is {arch!r}, not a string",
                      setting="file")
    if arch in REFUSED_ARCH:
      raise UserError(f"file {path!r}: general.architecture is {arch!r}: "
                       f"{REFUSED_ARCH[arch]} (refused, not approximated)", setting="file")
    if arch not in SUPPORTED_ARCH:
      raise UserError(f"file {path!r}: general.architecture is {arch!r}; only "
                       f"{SUPPORTED_ARCH} GGUF files are supported", setting="file")
    for key in self.reader.fields:
      if key.startswith(arch + ".") and key[len(arch) + 1:] not in _GGUF_KEYS[arch]:
        raise UserError(f"file {path!r}: GGUF metadata key {key!r} "
                         f"(= {self.field(key)!r}) is not implemented for "
                         f"{arch}; refused rather than ignored", setting="file")
    self.by_name = {t.name: t for t in self.reader.tensors}
    # the row table: llama with experts is Mixtral
    self.kind = "mixtral" if arch == "llama" and (
        "blk.0.ffn_gate_inp.weight" in self.by_name) else arch

  def field(self, key, default=None, required=False):
    return _field(self.reader, key, default, path=self.path, required=required)

  def meta(self, key, default=None, required=True):
    """The architecture's key `{arch}.{key}`; required unless a default is given."""
    return self.field(f"{self.arch}.{key}", default, required=required and default is None)

  def size(self, key, default=None, lo=1) -> int:
    """The integer key `{arch}.{key}` (adapters.check_size: from lo to 2^31 - 1)."""
    return self.check(self.meta(key, default), f"{self.arch}.{key}", lo)

  def check(self, value, what: str, lo=1) -> int:
    from mha_jax.pretrained import adapters
    return adapters.check_size(value, what, f"file {self.path!r}", lo)

  def number(self, key, default=None) -> float:
    """The finite number `{arch}.{key}`."""
    v = self.meta(key, default)
    if isinstance(v, bool) or not isinstance(v, (int, float, np.number)) or not np.isfinite(v):
      raise UserError(f"file {self.path!r}: {self.arch}.{key}={v!r} must be a finite number",
                      setting="file")
    return float(v)

  def refuse(self, key, value, why):
    raise UserError(f"file {self.path!r}: {self.arch}.{key}={value!r} {why} (refused, "
                     f"not approximated)", setting="file")


def _sizes(f: _File) -> dict:
  """The settings dict's widths, depth, norm and activation (adapters.model_config's)."""
  meta, refuse, arch, size = f.meta, f.refuse, f.arch, f.size
  d = size("embedding_length")
  h = size("attention.head_count")
  h_kv = size("attention.head_count_kv", h)
  mla = _mla_sizes(f, h) if arch == "deepseek2" else None
  if mla is not None:     # one decompressed key and value per head
    k, h_kv = mla["r"] + mla["kn"], h
  else:
    k = size("attention.key_length", max(d // h, 1))
    if size("attention.value_length", k) != k:
      refuse("attention.value_length", meta("attention.value_length"),
             f"differs from the key length {k}")
  if h_kv < 1 or h % h_kv:
    refuse("attention.head_count_kv", h_kv, f"must divide attention.head_count={h}")
  if arch in _FUSED_QKV_ARCH:
    # llama.cpp's GPT-2 and GPT-NeoX graphs take Q, K, V as views of one (3 D) projection.
    if h_kv != h:
      refuse("attention.head_count_kv", h_kv, f"(grouped heads) with {arch}'s fused QKV")
    if k * h != d:
      refuse("attention.key_length", k, f"with {h} heads of embedding_length {d}")
  s = dict(d=d, h=h, g=h_kv, k=k, n=size("block_count"), f=size("feed_forward_length"),
           max_len=size("context_length", 2048), tied="output.weight" not in f.by_name)
  if mla is not None:
    s["mla"] = mla
  if arch in _LAYER_NORM_ARCH:
    s["eps"] = f.number("attention.layer_norm_epsilon")
  else:
    s["eps"] = f.number("attention.layer_norm_rms_epsilon")
  s["act"] = _ACT.get(arch, "silu")
  if arch in ("gptneox", "stablelm"):
    s["parallel"] = bool(meta("use_parallel_residual"))
  s["parallel"] = s.get("parallel", False) or arch in ("phi2", "falcon", "command-r")
  if arch == "command-r":
    s["rope_layout"] = "interleaved"   # llama.cpp's NORM RoPE, stored unpermuted
  if arch == "gpt2":
    s["scale"] = k ** -0.5
  _arch_settings(f, s)
  return s


def _mla_sizes(f: _File, h: int) -> dict:
  """DeepSeek-V2/V3's MLA widths (adapters' s["mla"]) from a deepseek2 file as the
  converter writes it for the absorbed form: key_length C + R and value_length C (the
  cached latent, one "kv head"), key_length_mla R + Kn and value_length_mla V (a head's
  decompressed key and value), kv_lora_rank C, rope.dimension_count R, q_lora_rank Cq
  when the queries are low-rank (attn_q_a)."""
  c, r = f.size("attention.kv_lora_rank"), f.size("rope.dimension_count")
  if f.meta("attention.key_length_mla", None, required=False) is None:
    f.refuse("attention.key_length_mla", None, "is missing: the older converters' layout "
             "(attn_kv_b whole, MHA key lengths) is not implemented; convert again with a "
             "current convert_hf_to_gguf.py")
  k, v = f.size("attention.key_length_mla"), f.size("attention.value_length_mla")
  for key, want in (("attention.key_length", c + r), ("attention.value_length", c),
                    ("attention.head_count_kv", 1)):
    if f.size(key, want) != want:
      f.refuse(key, f.meta(key), f"(MLA's cached latent: kv_lora_rank {c} + rope "
               f"{r}, value {c}, one kv head) must be {want}")
  if k <= r:
    f.refuse("attention.key_length_mla", k, f"must exceed rope.dimension_count={r}")
  low_rank = "blk.0.attn_q_a.weight" in f.by_name
  return dict(c=c, r=r, kn=k - r, v=v, cq=f.size("attention.q_lora_rank") if low_rank
              else None)


def _deepseek2_settings(f: _File, s: dict) -> None:
  """llama.cpp's deepseek2 graph as settings: MLA (interleaved RoPE on R features, scores
  scaled by 1 / sqrt(R + Kn)), leading dense layers, then MoE layers with shared
  experts; routing by expert_gating_func (softmax, the default, or sigmoid), the top-k
  within expert_group_used_count of expert_group_count groups ranked by their two best
  scores (+ exp_probs_b), weights renormalised with expert_weights_norm, times
  expert_weights_scale."""
  mla, e, top = s["mla"], f.size("expert_count"), f.size("expert_used_count")
  if top > e:
    f.refuse("expert_used_count", top, f"is more than expert_count={e}")
  if np.float32(s["eps"]) != np.float32(1e-6):   # llama.cpp: the file's eps for them too
    f.refuse("attention.layer_norm_rms_epsilon", s["eps"], "is not 1e-6: llama.cpp "
             "normalises MLA's latents with it, transformers' DeepSeek (and this import) "
             "with 1e-6")
  gating, norm = f.meta("expert_gating_func", 1, required=False), bool(
      f.meta("expert_weights_norm", False, required=False))
  if gating not in (1, 2):
    f.refuse("expert_gating_func", gating, "(implemented: 1 softmax, 2 sigmoid)")
  groups, used = f.size("expert_group_count", 1), f.size("expert_group_used_count", 1)
  if groups > 1 and gating == 1:
    f.refuse("expert_group_count", groups, "with softmax gating: llama.cpp ranks the "
             "groups by their two best scores, DeepSeek-V2 by the best one")
  if groups > 1 and (e % groups or e // groups < 2 or not 1 <= used <= groups
                     or top > used * (e // groups)):
    f.refuse("expert_group_count", groups, f"must split the {e} experts into groups of 2 "
             f"or more, with expert_group_used_count={used} groups holding the top {top}")
  scale = f.number("expert_weights_scale", 1.0)
  moe_f, shared = f.size("expert_feed_forward_length"), f.size("expert_shared_count", 0, lo=0)
  s.update(experts=e, top_k=top, moe_f=moe_f, moe_groups=[groups, used] if groups > 1 else None,
           routing=("sigmoid" if gating == 2 else "softmax") + ("_renorm" if norm else ""),
           moe_layers=list(range(f.size("leading_dense_block_count", 0, lo=0), s["n"])),
           moe_scale=None if scale in (0.0, 1.0) else scale, shared_f=moe_f * shared,
           shared=shared > 0, rope_layout="interleaved", scale=s["k"] ** -0.5,
           low_rank_q=mla["cq"] is not None, full_q=mla["cq"] is None)


def _arch_settings(f: _File, s: dict) -> None:
  """The settings of the newer architectures: experts, multipliers, ALiBi, NoPE layers."""
  arch, kind = f.arch, f.kind
  if arch == "deepseek2":
    _deepseek2_settings(f, s)
  elif kind in _MOE_ARCH:
    e, top = f.size("expert_count"), f.size("expert_used_count")
    if top > e:
      f.refuse("expert_used_count", top, f"is more than expert_count={e}")
    # llama.cpp's qwen3moe without the key: feed_forward_length / expert_used_count
    ff = max(s["f"] // top, 1) if arch == "qwen3moe" else s["f"]
    s.update(experts=e, top_k=top, routing=_MOE_ARCH[kind], moe_layers=list(range(s["n"])),
             moe_f=f.size("expert_feed_forward_length", ff))
  elif f.meta("expert_count", 0, required=False):
    f.refuse("expert_count", f.meta("expert_count"), "without the experts' tensors")
  if arch == "bloom":
    s["alibi"] = True
    if f.number("attention.max_alibi_bias", 8.0) != 8.0:   # BLOOM's slopes: 8
      f.refuse("attention.max_alibi_bias", f.meta("attention.max_alibi_bias"),
               "is not BLOOM's 8")
  if arch == "falcon" and f.meta("tensor_data_layout", "jploski") != "jploski":
    f.refuse("tensor_data_layout", f.meta("tensor_data_layout"), "(only the converter's "
             "'jploski' [q; k; v] layout is implemented)")
  if arch == "command-r":     # llama.cpp: a logit_scale of 0 is not applied
    s["logit_scale"] = f.number("logit_scale", 1.0) or None
  if arch == "granite":
    _granite_settings(f, s)
  if arch == "gpt-oss":   # llama.cpp's swiglu_oai: alpha and limit are constants
    s.update(swiglu_limit=7.0, swiglu_alpha=1.702, attn_bias=True, o_bias=True)
  if arch == "smollm3":   # llama.cpp: no RoPE in every 4th layer (n_no_rope_layer_step)
    s["no_rope"] = [i for i in range(s["n"]) if (i + 1) % 4 == 0]


def _granite_settings(f: _File, s: dict) -> None:
  """llama.cpp's granite graph: the score scale attention.scale (0: 1 / sqrt(K)), the
  embeddings times embedding_scale and each sublayer's output times residual_scale (0:
  not applied), the logits divided by logit_scale, and no RoPE at all when
  rope.scaling.finetuned is false (its switch for RoPE; true when absent)."""
  attn, embed, resid = (f.number(key, 0.0) for key in ("attention.scale", "embedding_scale",
                                                       "residual_scale"))
  logit = f.number("logit_scale", 1.0)
  if logit == 0:
    f.refuse("logit_scale", 0.0, "(llama.cpp divides the logits by it)")
  s.update(scale=attn or s["k"] ** -0.5, embed_scale=embed or 1.0,
           residual_scale=resid or 1.0, logit_scale=1.0 / logit)
  if not f.meta("rope.scaling.finetuned", True, required=False):
    s["no_rope"] = list(range(s["n"]))


def _attention_layout(f: _File, s: dict) -> None:
  """Sets s's layer types, window, RoPE per layer type and (Gemma) scales."""
  meta, arch, n_layers = f.meta, f.arch, s["n"]
  s["layer_types"], s["window"] = ["full_attention"] * n_layers, None
  rope = None
  if arch not in ("gpt2", "bloom"):   # learned positions / ALiBi, no RoPE
    rope = _rope(f, s["k"])
  s["rope"] = None if rope is None else {"full_attention": rope}
  if arch == "deepseek2" and rope["type"] == "yarn":   # llama.cpp's kq_scale x mscale^2
    s["scale"] *= _mla_yarn_mscale(f, rope["factor"]) ** 2
  window = f.size("attention.sliding_window", 0, lo=0)
  if arch in ("gemma2", "gemma3"):
    # llama.cpp's Gemma 2: even layers local (pattern 2), Gemma 3: every 6th layer global
    # (pattern 6), base 10000 without scaling on the local ones; a window of 4096 when
    # Gemma 2's file has none; queries scaled (see _GEMMA_27B_LAYERS); embeddings by
    # sqrt(D); GELU (tanh); Gemma 2 soft-caps scores and logits (50 / 30 by default).
    pattern = 2 if arch == "gemma2" else 6
    s["layer_types"] = ["sliding_attention" if i % pattern < pattern - 1 else "full_attention"
                        for i in range(n_layers)]
    if arch == "gemma2":
      window = f.size("attention.sliding_window", 4096)
      s["attn_softcap"] = float(meta("attn_logit_softcapping", 50.0))
      s["final_softcap"] = float(meta("final_logit_softcapping", 30.0))
      s["rope"]["sliding_attention"] = rope
    else:
      window = f.size("attention.sliding_window")
      s["rope"]["sliding_attention"] = {"type": "default", "base": 10000.0,
                                        "dim": rope["dim"]}
    s["window"] = int(window)
    d, h = s["d"], s["h"]
    big = n_layers == _GEMMA_27B_LAYERS[arch]
    s.update(scale=(d // h if big else s["k"]) ** -0.5,
             embed_scale=float(np.float32(d ** 0.5)))
  elif arch == "gpt-oss":   # llama.cpp's swa pattern 2: even layers slide
    s["layer_types"] = ["sliding_attention" if i % 2 == 0 else "full_attention"
                        for i in range(n_layers)]
    s["window"] = f.size("attention.sliding_window")
    s["rope"]["sliding_attention"] = rope
  elif arch == "phi3":
    # Phi-3: one window for every layer (0: none, Phi-4). llama.cpp currently runs Phi-3
    # without its window (llama_model_phi3::load_arch_hparams); transformers' Phi-3,
    # which the file was converted from, slides: that is what is run here.
    if int(window) > 0:
      s["layer_types"] = ["sliding_attention"] * n_layers
      s["window"] = int(window)
      s["rope"] = {"sliding_attention": rope}
  elif window:
    f.refuse("attention.sliding_window", window, f"is not implemented for {arch}")


def _params(f: _File, s: dict, fam, dtype: str, place):
  """(params as NumPy, {tensor type: count}) of the file's adapters.Family `fam`."""
  import gguf
  from mha_jax.pretrained import adapters, hf_folder
  path, arch, by_name, d = f.path, f.arch, f.by_name, s["d"]
  np_dtype = hf_folder.numpy_dtype(dtype)
  qtypes: dict[str, int] = {}
  lin_shapes = {"ffn_gate.weight": (s["f"], d), "ffn_down.weight": (d, s["f"])}
  if arch != "phi3":
    lin_shapes["ffn_up.weight"] = (s["f"], d)
  if arch in ("bloom", "falcon", "phi2"):    # feed_forward_length: 4 D, no gate
    lin_shapes.pop("ffn_gate.weight")

  def get(name):
    t = by_name[name]
    try:
      w = _dequantize_rows(gguf, t)
    except Exception as e:  # noqa: BLE001
      raise UserError(f"file {path!r}: tensor {name!r} of type {t.tensor_type.name} "
                       f"cannot be dequantized: {e}", setting="file") from None
    expect = tuple(int(n) for n in reversed(t.shape))
    if w.shape != expect:
      raise UserError(f"file {path!r}: tensor {name!r} has {w.shape} values, header "
                       f"says {expect} (truncated file?)", setting="file")
    want = lin_shapes.get(name.split(".", 2)[-1]) if name.startswith("blk.") else None
    if want is not None and w.shape != want:
      raise UserError(f"file {path!r}: tensor {name!r} has shape {w.shape}; "
                       f"{arch}.feed_forward_length={s['f']} and embedding_length={d} "
                       f"say {want}", setting="file")
    qtypes[t.tensor_type.name] = qtypes.get(t.tensor_type.name, 0) + 1
    heads = s["h"] if name.endswith(("attn_q.weight", "attn_q.bias")) else s["g"]
    if arch in _PERMUTED_ARCH and name.endswith(("attn_q.weight", "attn_k.weight",
                                                 "attn_q.bias", "attn_k.bias")) and (
        w.ndim in (1, 2) and w.shape[0] == heads * s["k"] and s["k"] % 2 == 0):
      # rows (and the biases of Granite's rows); another shape: refused by its row's check
      w = unpermute_rope_rows(w.reshape(w.shape[0], -1), heads).reshape(w.shape)
    return w

  names = [n for n in by_name if n not in _ROPE_FACTOR_TENSORS]
  if arch == "deepseek2":
    names, get = _mla_kv_b(f, s, names, get)
  t = adapters.Tensors(get, names, f"file {path!r}", ("",), np_dtype)
  params = adapters.build_params(fam, s, t, np_dtype, place=place)
  if arch == "gpt2" and params["pos_embed"].shape[0] != s["max_len"]:
    raise UserError(f"file {path!r}: position_embd has {params['pos_embed'].shape[0]} "
                     f"rows, {arch}.context_length={s['max_len']}", setting="file")
  return params, qtypes


def _mla_kv_b(f: _File, s: dict, names: list, get):
  """(names, get) with each layer's attn_k_b (H, C, Kn) and attn_v_b (H, V, C), as the
  converter splits transformers' kv_b_proj for llama.cpp's absorbed MLA, replaced by the
  whole blk.{i}.attn_kv_b.weight (H (Kn + V), C) that the MLA rows read."""
  h, m = s["h"], s["mla"]
  out = [n for n in names if not n.endswith(("attn_k_b.weight", "attn_v_b.weight"))]
  for i in range(s["n"]):
    if f"blk.{i}.attn_kv_b.weight" in f.by_name:
      raise UserError(f"file {f.path!r}: tensor 'blk.{i}.attn_kv_b.weight' (the older "
                       f"converters' whole kv_b) is not implemented; this reader takes "
                       f"attn_k_b / attn_v_b", setting="file")
    out.append(f"blk.{i}.attn_kv_b.weight")

  def get_kv_b(name):
    if not name.endswith("attn_kv_b.weight"):
      return get(name)
    blk = name[:-len("attn_kv_b.weight")]
    for part in ("attn_k_b.weight", "attn_v_b.weight"):
      if blk + part not in f.by_name:
        raise UserError(f"file {f.path!r}: tensor {blk + part!r} is missing", setting="file")
    kb, vb = get(blk + "attn_k_b.weight"), get(blk + "attn_v_b.weight")
    if kb.shape != (h, m["c"], m["kn"]) or vb.shape != (h, m["v"], m["c"]):
      raise UserError(f"file {f.path!r}: {blk}attn_k_b / attn_v_b have shapes {kb.shape} / "
                       f"{vb.shape}; the metadata says (H, C, Kn) = {(h, m['c'], m['kn'])} "
                       f"and (H, V, C) = {(h, m['v'], m['c'])}", setting="file")
    return np.concatenate([kb.transpose(0, 2, 1), vb], axis=1).reshape(-1, m["c"])

  return out, get_kv_b


def _family(f: _File):
  """The adapters.Family of the file's tensors: its top rows and layer rows."""
  from mha_jax.pretrained import adapters
  arch, by_name = f.arch, f.by_name
  rows = _GGUF_LAYER[f.kind]
  if arch == "falcon" and "blk.0.attn_norm_2.weight" not in by_name:
    rows = _ln("attn_norm", "ln1") + rows[4:]    # one LayerNorm for attention and MLP
  if arch == "deepseek2" and any(n.endswith(_EXP_PROBS_B[0]) for n in by_name):
    rows = rows + (_EXP_PROBS_B,)
  layer_rows = tuple((n, kind.rstrip("*"), target, optional if isinstance(optional, str)
                      else None) for n, kind, target, optional in rows
                     if optional is not True or f"blk.0.{n}" in by_name)
  if arch == "phi3" and ("blk.0.attn_qkv.weight" in by_name) == ("blk.0.attn_q.weight"
                                                                  in by_name):
    raise UserError(f"file {f.path!r}: a phi3 layer needs attn_qkv.weight or attn_q / "
                     f"attn_k / attn_v weights (exactly one of the two)", setting="file")
  top = [("token_embd.weight", "vec", "embed", None)]
  if arch == "gpt2":
    top.append(("position_embd.weight", "vec", "pos_embed", None))
  top.append(("output_norm.weight", "vec", "lm.ln_final.scale", None))
  present = [(n, t) for n, t in (("output_norm.bias", "lm.ln_final.bias"),
                                 ("token_embd_norm.weight", "ln_embed.scale"),
                                 ("token_embd_norm.bias", "ln_embed.bias"),
                                 ("output.bias", "unembed_bias")) if n in by_name]
  if arch not in _LAYER_NORM_ARCH + ("bloom",):
    present = []    # left over: refused by name with the file's other unknown tensors
  top += [(n, "vec", t, None) for n, t in present]
  top.append(("output.weight", "lin", "unembed", "untied"))
  name = _FAMILY[f.kind]
  if arch == "deepseek2" and f.meta("expert_gating_func", 1, required=False) == 2:
    name = "deepseek_v3"       # sigmoid routing: V3's
  return adapters.Family(name, (), {}, tuple(top), layer_rows, prefixes=("",),
                         layer_prefix="blk.{i}.", ignore_tensors=(),
                         norm="layer" if arch in _LAYER_NORM_ARCH else "rms")


def _tokenizer(f: _File, vocab: int):
  """(tokenizers.Tokenizer, tokenizer config) from the file's tokenizer.ggml.* keys."""
  from mha_jax.pretrained import tokenizer as tk
  path, arch = f.path, f.arch
  tokens = f.field("tokenizer.ggml.tokens", required=True)
  model = f.field("tokenizer.ggml.model", required=True)
  types = f.field("tokenizer.ggml.token_type")
  merges = f.field("tokenizer.ggml.merges", []) if model == "gpt2" else []
  pre = f.field("tokenizer.ggml.pre", "default")
  for key, value, kind in (("tokens", tokens, str), ("merges", merges, str),
                           ("token_type", types or [], int)):
    if not isinstance(value, list) or not all(isinstance(x, kind) for x in value):
      raise UserError(f"file {path!r}: tokenizer.ggml.{key} must be a list of "
                       f"{kind.__name__}s", setting="file")
  if len(tokens) != vocab or types is not None and len(types) != vocab:
    raise UserError(f"file {path!r}: {len(tokens)} tokens ({len(types or tokens)} token "
                     f"types) but the embedding has {vocab} rows", setting="file")
  if not isinstance(pre, str) or not isinstance(model, str):
    raise UserError(f"file {path!r}: tokenizer.ggml.model and .pre must be strings",
                     setting="file")
  if model == "gpt2":
    tok = tk.from_gguf_vocab(tokens, merges, types, pre, f"file {path!r}")
  elif model == "llama" and arch in ("gemma2", "gemma3"):
    tok = tk.from_gguf_gemma(tokens, types, f"file {path!r}")
  else:
    raise UserError(f"file {path!r}: tokenizer.ggml.model={model!r} is not supported for "
                     f"{arch} (byte-level BPE 'gpt2', or Gemma's SentencePiece 'llama'; "
                     f"Llama 2 style SentencePiece with a prefix space is not implemented)",
                     setting="file")

  def tid(key):
    from mha_jax.pretrained import adapters
    x = f.field(f"tokenizer.ggml.{key}")
    return -1 if x is None else adapters.check_size(x, f"tokenizer.ggml.{key}",
                                                    f"file {path!r}", lo=0)

  tok_cfg = dict(bos_id=tid("bos_token_id"), eos_id=tid("eos_token_id"),
                 pad_id=tid("padding_token_id"),
                 add_bos=bool(f.field("tokenizer.ggml.add_bos_token", False)),
                 chat_template=str(f.field("tokenizer.chat_template", "")))
  return tok, tok_cfg


_ROPE_FACTOR_TENSORS = ("rope_factors_long.weight", "rope_factors_short.weight")


def _rope(f: _File, k: int) -> dict:
  """The RoPE setting dict (models/rope_scaling) of the file's global layers."""
  import gguf
  meta, refuse, arch, by_name, path = f.meta, f.refuse, f.arch, f.by_name, f.path
  rot = int(meta("rope.dimension_count", k))
  if rot % 2 or rot < 2 or rot > k:
    refuse("rope.dimension_count", rot, f"with head width {k} (must be even, 2..{k})")
  if arch == "olmo2" and rot != k:
    refuse("rope.dimension_count", rot, f"(partial rotary) for olmo2: llama.cpp's OLMo 2 "
           f"rotates all {k} features")
  default_base = 1e6 if arch == "gemma3" else 10000.0
  rope = {"type": "default", "base": float(meta("rope.freq_base", default_base)), "dim": rot}
  scaling = meta("rope.scaling.type", "none")
  has_factors = [n in by_name for n in _ROPE_FACTOR_TENSORS]
  if arch == "phi3" and any(has_factors):
    # LongRoPE as transformers' Phi-3 runs it: theta_i / short_i up to the original
    # context length, theta_i / long_i past it, cos / sin scaled by the attention factor.
    if not all(has_factors):
      raise UserError(f"file {path!r}: LongRoPE needs both {_ROPE_FACTOR_TENSORS}", setting="file")
    if scaling not in ("none", "longrope"):
      refuse("rope.scaling.type", scaling, "with LongRoPE factor tensors")
    ctx = int(meta("context_length"))
    orig = int(meta("rope.scaling.original_context_length"))
    factors = {}
    for n in _ROPE_FACTOR_TENSORS:
      t = by_name[n]
      x = np.asarray(gguf.quants.dequantize(np.asarray(t.data), t.tensor_type), np.float64)
      if x.shape != (rot // 2,):
        raise UserError(f"file {path!r}: tensor {n!r} has shape {x.shape}; "
                         f"rope.dimension_count={rot} needs ({rot // 2},)", setting="file")
      factors[n.split("_")[2].split(".")[0]] = [float(v) for v in x]
    rope.update(type="longrope", short_factor=factors["short"], long_factor=factors["long"],
                original_max_position_embeddings=orig, factor=ctx / orig)
    att = meta("rope.scaling.attn_factor", None, required=False)
    if att is not None:
      rope["attention_factor"] = float(att)
    return rope
  if scaling == "yarn" and arch in _YARN_ARCH:
    rope = _yarn(f, rope)
  elif scaling == "linear" and meta("rope.scaling.factor", None, required=False) is not None:
    if arch == "deepseek2":    # its graph's kq_scale x (1 + 0.1 ln factor)^2 under linear too
      refuse("rope.scaling.type", scaling, "(linear scaling): llama.cpp's deepseek2 graph "
             "scales the scores by (1 + 0.1 ln factor)^2 with it, transformers does not")
    rope = dict(rope, type="linear", factor=float(meta("rope.scaling.factor")))
  elif scaling not in ("none", "linear"):
    refuse("rope.scaling.type", scaling, f"is not implemented for {arch} (linear is; yarn "
           f"for {' and '.join(_YARN_ARCH)})")
  att = meta("rope.scaling.attn_factor", None, required=False)
  if att is not None and float(att) != 1.0:
    refuse("rope.scaling.attn_factor", att, "without LongRoPE factor tensors")
  return rope


# The architectures whose YaRN files are read (llama.cpp's graphs checked against
# transformers' for them; the others' yarn is refused naming the architecture).
_YARN_ARCH = ("deepseek2", "gpt-oss")
_YARN_BETAS = (("rope.scaling.yarn_beta_fast", 32.0), ("rope.scaling.yarn_beta_slow", 1.0))


def _yarn(f: _File, rope: dict) -> dict:
  """YaRN as llama.cpp runs it for deepseek2 and gpt-oss, as a models/rope_scaling
  setting: theta_i blended between theta_i / factor and theta_i over the correction range
  of rope.scaling.original_context_length (context_length when absent), rounded out to
  whole dimensions (ggml always truncates: transformers' truncate true) with beta_fast 32
  and beta_slow 1 (their graphs read no beta key: a file whose yarn_beta_fast / _slow
  differ is refused); cos / sin x (1 + 0.1 ln factor) (gpt-oss) or x 1 (deepseek2, which
  scales the scores instead: _mla_yarn_mscale)."""
  if f.meta("rope.scaling.factor", None, required=False) is None:
    f.refuse("rope.scaling.factor", None, "is missing (rope.scaling.type yarn needs it)")
  factor = f.number("rope.scaling.factor")
  if factor < 1.0:
    f.refuse("rope.scaling.factor", factor, "with rope.scaling.type yarn: a factor of 1 "
             "or more is implemented")
  orig = f.size("rope.scaling.original_context_length", f.size("context_length", 2048))
  for key, want in _YARN_BETAS:
    got = f.meta(key, None, required=False)
    if got is not None and f.number(key) != want:
      f.refuse(key, got, f"is not {want:g}: llama.cpp's {f.arch} graph does not read it "
               f"and runs {want:g}, the model it came from ran {got!r}")
  out = dict(rope, type="yarn", factor=factor, original_max_position_embeddings=orig,
             beta_fast=32.0, beta_slow=1.0, truncate=True)
  if f.arch == "deepseek2":
    out["attention_factor"] = 1.0
  return out


def _mla_yarn_mscale(f: _File, factor: float) -> float:
  """deepseek2's YaRN score factor's square root: 1 + 0.1 m ln(factor), m the
  mscale_all_dim the converter stores as rope.scaling.yarn_log_multiplier = 0.1 m
  (llama.cpp divides it back). transformers' DeepSeek: the same factor, with cos / sin
  unscaled when its mscale equals mscale_all_dim (DeepSeek's configs; the file cannot
  carry mscale, and llama.cpp takes them equal). Without the key (or 0) llama.cpp
  scales the scores by (1 + 0.1 ln factor)^2 and cos / sin by 1 + 0.1 ln factor, which
  transformers does not: refused."""
  log_mul = f.number("rope.scaling.yarn_log_multiplier", 0.0)
  if log_mul == 0.0:
    f.refuse("rope.scaling.yarn_log_multiplier", f.meta(
        "rope.scaling.yarn_log_multiplier", None, required=False), "with YaRN: without "
        "DeepSeek's mscale_all_dim llama.cpp scales both the scores and cos / sin by 1 + "
        "0.1 ln factor, transformers only cos / sin")
  m = log_mul / 0.1
  return 1.0 if factor <= 1.0 else 0.1 * m * float(np.log(factor)) + 1.0


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

