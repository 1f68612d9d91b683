"""Models built on the one attention function: seq2seq (encoder-decoder) and lm."""

from mha_jax.models import common, lm, seq2seq
from mha_jax.models.common import (STACKS, ModelSpec, attention_blocks, head_counts,
                                   head_names, ones_gates)
