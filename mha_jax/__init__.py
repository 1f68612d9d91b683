"""mha-jax: a JAX/Flax research codebase for studying multi-head attention."""

from mha_jax.attention import (AttentionOutput, RoPE, apply_rope, attention_scores,
                               attention_weights, init_attention_params, init_kv_cache,
                               merge_heads, mix_values, multi_head_attention, split_heads)

__version__ = "0.1.0"



def __getattr__(name):
  if name in ("load", "Loaded"):  # lazy: pulls in orbax and the data code
    from mha_jax import loader as _load_module
    return getattr(_load_module, name)
  if name == "show":
    from mha_jax import notebook as _notebook
    return _notebook.show
  raise AttributeError(f"module 'mha_jax' has no attribute {name!r}")


__all__ = ["load", "Loaded", "show", "AttentionOutput", "attention_scores", "attention_weights",
           "init_attention_params", "merge_heads", "mix_values", "multi_head_attention",
           "split_heads", "RoPE", "apply_rope", "init_kv_cache", "__version__"]
