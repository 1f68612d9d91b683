"""Multi-head attention as pure functions: the one attention of this project.

Shape letters used in names (nanodo style):
  B batch, T query positions, S key/value positions, D d_model,
  H heads, K head width d_k (= D / H for a standard layer).

The whole computation, for one layer, is the textbook's seven lines:

  q_BTD = x_BTD @ W_Q              (W_Q holds D x D numbers for every H)
  q_BTHK = split_heads(q_BTD, H)   (heads are a reshape; each reads the whole token)
  s_BHTS = q . k / sqrt(K)         (each head divides by its own width)
  w_BHTS = softmax(s_BHTS)         (float32; masked entries get weight 0)
  o_BTHK = w_BHTS . v_BSHK         (one weighted average per head)
  o_BTD = merge_heads(o_BTHK)      (concatenate)
  y_BTD = o_BTD @ W_O              (W_O mixes the heads)

Parameters are a plain dict: ``wq`` of shape (D, H, K), ``wk``, ``wv`` of shape
(D, G, K), ``wo`` of shape (H, K, D), optional ``bq`` (H, K), ``bk``, ``bv`` (G, K)
and ``bo`` (D,), and optional
``rel_bias`` (H, 2R + 1): one learned score bias per head and relative offset
(Shaw et al. 2018), so every per-head parameter lives in the block and removing a
head is slicing its row. H, G and K are read from the shapes, so a layer whose
heads were removed still runs. G is the number of key/value heads: G = H is
multi-head attention, G dividing H is grouped-query attention (Ainslie et al. 2023;
G = 1 is multi-query, Shazeer 2019). Query head i reads key/value head i // (H // G),
the order of Hugging Face's ``repeat_kv``: kv head j serves query heads
j*H/G ... (j+1)*H/G - 1. Everything per head (gates, weights, masks, biases, the
returned heads) is per query head.

Rotary position embeddings (RoPE) rotate q and k inside the function; a KV cache
(init_kv_cache) lets a decoder attend one step at a time over earlier keys and values.
The attention variants (VARIANTS: gated, gated_head, differential, sigmoid, sink,
qk_norm) are options of the same function (variant=...), their params made by
init_attention_params(..., variant=...); each is one entry of the registry in
mha_jax/attention_variants.py.

The package reads in the order of the seven lines: params.py (the params and the
projections, line 1), heads.py (line 2: heads, QK-norm, RoPE, the KV cache), scores.py
(lines 3-5: the kernel's call), mixing.py (lines 6-7: gates, W_O) and mha.py (the
public function, its arguments checked).
"""

from mha_jax.attention_variants import DIFF_NORM_EPS, diff_lambda, diff_lambda_init
from mha_jax.attention.heads import (ROPE_LAYOUTS, RoPE, apply_rope, init_kv_cache,
                                     qk_rms_norm, rope_frequencies)
from mha_jax.attention.mha import multi_head_attention
from mha_jax.attention.mixing import AttentionOutput
from mha_jax.attention.params import (ALIBI, BIAS_KEYS, MLA_KEYS, MLA_NORM_EPS, NORM_REST_KEYS,
                                      PARAM_INITS, QK_NORM_KEYS, REL_BIAS, VARIANTS,
                                      WEIGHT_KEYS, Params, check_attention_params,
                                      check_variant, init_attention_params, num_heads_of,
                                      num_kv_heads_of, param_shapes, variant_param_shapes)
from mha_jax.attention.scores import IMPLS, alibi_slopes, position_table, resolve_impl
from mha_jax.blocks import (attention_scores, attention_weights, masked_softmax, merge_heads,
                            mix_values, relative_bias, relative_index, split_heads)

__all__ = [
    "ALIBI", "BIAS_KEYS", "DIFF_NORM_EPS", "IMPLS", "MLA_KEYS", "MLA_NORM_EPS",
    "NORM_REST_KEYS", "PARAM_INITS", "QK_NORM_KEYS", "REL_BIAS", "ROPE_LAYOUTS", "VARIANTS",
    "WEIGHT_KEYS", "AttentionOutput", "Params", "RoPE", "alibi_slopes", "apply_rope",
    "attention_scores", "attention_weights", "check_attention_params", "check_variant",
    "diff_lambda", "diff_lambda_init", "init_attention_params", "init_kv_cache",
    "masked_softmax", "merge_heads", "mix_values", "multi_head_attention", "num_heads_of",
    "num_kv_heads_of", "param_shapes", "position_table", "qk_rms_norm", "relative_bias",
    "relative_index", "resolve_impl", "rope_frequencies", "split_heads",
    "variant_param_shapes"]
