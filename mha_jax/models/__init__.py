"""Models built on the one attention function: seq2seq (encoder-decoder), lm
(decoder-only, trained here); decoder.py, one forward for every decoder family of the
real models (llama is its LLaMA entry; rope_scaling its scaled-RoPE frequencies), and
bert; common holds the stacks, gates and head names. (decoder, llama and bert are
imported by their users, not here: they are only needed for imported runs.)"""

from mha_jax.models import common, lm, seq2seq
from mha_jax.models.common import (STACKS, ModelSpec, attention_blocks, head_counts,
                                   head_names, ones_head_gates)

__all__ = ["common", "lm", "seq2seq", "STACKS", "ModelSpec", "attention_blocks",
           "head_counts", "head_names", "ones_head_gates"]
