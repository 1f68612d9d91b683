"""LLaMA-family decoder (SmolLM2, LLaMA 2/3 layout): RMSNorm, SwiGLU, RoPE, GQA.

The llama adapter of the one decoder forward (mha_jax/models/decoder.py): the forward,
the KV cache and greedy decoding are decoder's; this module gives LLaMA's settings
(llama_spec) and fresh params in LLaMA's layout.

params = {
  "embed": (V, D),
  "lm": {"layer_{i}": {"ln1": {"scale"}, "attn": {"wq": (D, H, K), "wk", "wv": (D, H_kv, K),
                                                  "wo": (H, K, D)},
                       "ln2": {"scale"}, "mlp": {"w_gate", "w_up": (D, F), "w_down": (F, D)}},
         "ln_final": {"scale"}},
  "unembed": (D, V)        absent when the embeddings are tied (logits = x @ embed.T)
}
Pre-norm blocks: x + attn(RMSNorm(x)), then x + W_down(silu(x W_gate) * x W_up). RoPE acts
on q and k inside the one attention function, in Hugging Face's half-split layout.
Head i reads key/value head i // (H / H_kv).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from mha_jax import attention
from mha_jax.models.decoder import (DecoderSpec, prefill_jit, step_jit, apply,  # noqa: F401
                                    generate, init_cache, positions_from_mask, rms_norm,
                                    unembed)


def llama_spec(norm_eps: float = 1e-5, rope_base: float = 10000.0, rope_layout: str = "half",
               impl: str = "auto") -> DecoderSpec:
  """LLaMA's decoder settings: RMSNorm, SiLU-gated MLP, RoPE of one base on every layer."""
  return DecoderSpec(norm="rms", norm_eps=norm_eps, act="silu",
                     rope=attention.RoPE(base=rope_base, layout=rope_layout), impl=impl)


def init(key, *, vocab_size: int, d_model: int, num_heads: int, num_kv_heads: int,
         head_dim: int, num_layers: int, d_ff: int, tie_embeddings: bool = True) -> dict:
  """Fresh params (random; the real ones come from mha_jax.pretrained)."""
  keys = iter(jax.random.split(key, 2 + 4 * num_layers))
  init_w = jax.nn.initializers.lecun_normal()
  layers = {}
  for i in range(num_layers):
    layers[f"layer_{i}"] = {
        "ln1": {"scale": jnp.ones((d_model,))},
        "attn": attention.init_attention_params(next(keys), d_model, num_heads,
                                                head_dim=head_dim, num_kv_heads=num_kv_heads),
        "ln2": {"scale": jnp.ones((d_model,))},
        "mlp": {"w_gate": init_w(next(keys), (d_model, d_ff)),
                "w_up": init_w(next(keys), (d_model, d_ff)),
                "w_down": init_w(next(keys), (d_ff, d_model))},
    }
  layers["ln_final"] = {"scale": jnp.ones((d_model,))}
  params = {"embed": jax.random.normal(next(keys), (vocab_size, d_model)) * 0.02,
            "lm": layers}
  if not tie_embeddings:
    params["unembed"] = jax.random.normal(next(keys), (d_model, vocab_size)) * d_model ** -0.5
  return params
