"""mha-jax: a JAX/Flax research codebase for studying multi-head attention."""

from mha_jax.attention import (AttentionOutput, attention_scores, attention_weights,
                               init_attention_params, merge_heads, mix_values,
                               multi_head_attention, split_heads)

__version__ = "0.1.0"

__all__ = ["AttentionOutput", "attention_scores", "attention_weights",
           "init_attention_params", "merge_heads", "mix_values", "multi_head_attention",
           "split_heads", "__version__"]
