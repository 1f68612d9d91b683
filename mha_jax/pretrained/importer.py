"""`mha-jax import`: a known model (found in its pip package) or a file -> an ordinary
workdir: config.json, an orbax checkpoint (step 0, float32 params), tokenizer.json."""

from __future__ import annotations

import dataclasses
import hashlib
import uuid

from mha_jax import storage
from mha_jax.errors import StorageFault, UserError
from mha_jax.pretrained import adapters, gguf_file, hf_folder, registry
from mha_jax.settings import DTYPES, setting


@dataclasses.dataclass(frozen=True, kw_only=True)
class ImportOptions:
  """The settings of `import` (`import_model`'s): which model, its dtype and how its
  params are placed."""
  name: str | None = setting(None, choices=tuple(registry.KNOWN), positional=True,
                             help="a packaged model (or give --file)")
  file: str | None = setting(None, path=True, help="a GGUF file (llama, qwen2, qwen3, "
                             "gemma3), or a Hugging Face folder (config.json + "
                             "model.safetensors or shards) of a family in "
                             "docs/guide/model-families.md")
  dtype: str = setting("float32", choices=DTYPES, help="the params' dtype (bfloat16 keeps "
                       "bf16 weights as they are)")
  mesh: str | None = setting(None, help="place the params sharded as they load: model=4 "
                             "or data=2,model=4 (heads over model; "
                             "docs/guide/model-families.md)")

TASK_OF_FAMILY = {"bert": "embedding", **{f: "pretrained_lm" for f in adapters.FAMILIES}}
# Evaluation defaults written into config.json (eval = perplexity on the built-in text).
EVAL_DEFAULTS = {"pretrained_lm": dict(batch_size=4, seq_len=256, windows=16),
                 "embedding": dict(batch_size=16, seq_len=128, windows=64)}


def _sha256(*paths: str) -> str:
  """sha256 of the files' bytes, one after the other."""
  h = hashlib.sha256()
  for path in paths:
    with storage.path(path).open("rb") as f:
      for chunk in iter(lambda: f.read(1 << 22), b""):
        h.update(chunk)
  return h.hexdigest()


def placer(mesh):
  """f(dotted param path, NumPy array) -> the array on `mesh`'s devices, heads (and MLP
  hidden units) split over its "model" axis where it divides them, else replicated
  (train/sharding.py's rules, the ones training uses).

  Each copy is finished before f returns and JAX's reference to the host array dropped
  (JAX releases the arrays it copied from only when a garbage collection runs its
  callback: without one, every converted tensor stays in host memory to the end of the
  import, the model twice)."""
  import gc

  import jax
  from jax.sharding import NamedSharding
  from mha_jax.train import sharding
  m = mesh.shape["model"]

  def place(path: str, arr):
    spec = sharding.spec_of_names(path.split("."), arr.shape, m)
    out = jax.device_put(arr, NamedSharding(mesh, spec))
    out.block_until_ready()
    gc.collect(0)      # runs JAX's callback: the host array is then the caller's alone
    return out
  return place


def read_model(name: str | None = None, file: str | None = None, dtype: str = "float32",
               scratch: str | None = None, mesh=None):
  """(params, config dict, tokenizers.Tokenizer) of a known model or a file/folder.
  dtype: the params' dtype (float32, or bfloat16 / float16 to keep half-precision weights
  as they are). scratch: a folder where a model stored in chunks is assembled (inside
  the import's own temporary folder). mesh: a jax.sharding.Mesh with a "model" axis:
  each tensor is placed on it, sharded (placer), as it is converted, so the whole model
  is never on one device (nor, converted, on the host); without one, the params are
  NumPy arrays, each converted as it is read (the host holds the model once)."""
  place = None if mesh is None else placer(mesh)
  if (name is None) == (file is None):
    raise UserError(f"give a known model name ({sorted(registry.KNOWN)}) or file PATH, "
                     f"not both or neither; got name={name!r}, file={file!r}", setting="file")
  if name in registry.KNOWN and registry.KNOWN[name].chunks and scratch is None:
    raise UserError(f"model {name!r} is stored in chunks: read_model needs a scratch folder "
                     f"to assemble them in (import_model gives its own)")
  path = registry.find_model(name, scratch=scratch) if name else file
  if name and registry.KNOWN[name].chunks:   # the file was assembled from its chunks
    src_path = ", ".join(registry.chunk_paths(name))
  else:
    src_path = None
  if not storage.exists(path):
    raise UserError(f"file {path!r}: no such file or folder", setting="file")
  if storage.isdir(path):
    params, mcfg, tok, tok_cfg, info = hf_folder.read(path, dtype, place=place)
    digest = _sha256(*[storage.join(path, f) for f in info["files"]])
  else:
    with storage.path(path).open("rb") as f:
      magic = f.read(4)
    if magic != b"GGUF":
      raise UserError(f"file {path!r} is neither a GGUF file (its first bytes are "
                       f"{magic!r}, not b'GGUF') nor a Hugging Face folder", setting="file")
    params, mcfg, tok, tok_cfg, info = gguf_file.read(path, dtype, place=place)
    digest = _sha256(path)
  task = TASK_OF_FAMILY[mcfg["family"]]
  cfg = {"task": task, "model": {**mcfg, "impl": "auto", "dtype": dtype},
         "tokenizer": tok_cfg,
         "source": {"name": name or "", "path": src_path or storage.abspath(path),
                    "sha256": digest,
                    **info},
         "data": {"kind": "text", "text_files": []},
         "eval": dict(EVAL_DEFAULTS[task])}
  from mha_jax import config as mc
  try:
    mc.validate(mc.from_dict(cfg))
  except UserError as e:      # a setting the file gave: named as the file's
    raise UserError(f"file {path!r}: {e}", setting="file") from None
  return params, cfg, tok


def import_model(workdir: str, name: str | None = None, file: str | None = None,
                 dtype: str = "float32", mesh: str | None = None) -> dict:
  """Writes the workdir; refuses one that exists and is not empty. Returns config dict.
  mesh: None, or "model=4" / "data=2,model=4": the params are placed sharded over that
  device mesh as they load (read_model) and the checkpoint is written from the shards."""
  import jax
  from mha_jax.train import checkpoint as ckpt_lib
  from mha_jax.train import sharding
  device_mesh = None
  if mesh is not None:
    device_mesh = sharding.make_mesh(*sharding.parse_mesh(mesh))
  if storage.exists(workdir) and (not storage.isdir(workdir) or storage.listdir(workdir)):
    raise UserError(f"workdir {workdir!r} exists and is not empty; import writes a new "
                     f"run and overwrites nothing", setting="workdir")
  if name is not None:
    registry.find_model(name)          # a missing package is named before anything is made
  parent = storage.dirname(storage.abspath(workdir))
  storage.makedirs(parent)
  # Written next to the target and renamed at the end: a failed import leaves nothing.
  tmp = storage.join(parent, f".import-{uuid.uuid4().hex[:8]}")
  storage.makedirs(tmp)
  try:
    scratch = storage.join(tmp, ".source")      # a chunked model is assembled here
    # NumPy arrays (or, on a mesh, placed as they stream), written as they are: the
    # host never holds the model twice
    params, cfg, tok = read_model(name, file, dtype, scratch=scratch, mesh=device_mesh)
    if storage.exists(scratch):
      storage.rmtree(scratch)
    storage.write_json(storage.join(tmp, "config.json"), cfg)
    storage.write_text(storage.join(tmp, "tokenizer.json"), tok.to_str(pretty=True))
    # the save copies one largest array to the host at a time, not the whole model
    ckpts = ckpt_lib.Checkpoints(tmp, max_to_keep=1, host_bytes=max(
        int(x.nbytes) for x in jax.tree.leaves(params)))
    try:
      ckpts.save_params(0, params, {"imported_from": cfg["source"]["path"]})
    finally:
      ckpts.close()
    if storage.isdir(workdir):
      storage.rmdir(workdir)         # empty (checked above)
    storage.rename(tmp, workdir)
  except StorageFault as e:    # named as the target, not the hidden folder it was
    _remove_staging(tmp)
    fault = StorageFault(f"import: {str(e).replace(tmp, storage.abspath(workdir))}; "
                         f"nothing was left behind")
    fault.kind, fault.where = getattr(e, "kind", None), workdir
    raise fault from None
  except BaseException:
    _remove_staging(tmp)
    raise
  return cfg


def _remove_staging(tmp: str, tries: int = 40, wait_s: float = 0.25) -> None:
  """Removes a failed import's folder, again while something still writes into it (a
  failed save's storage threads can finish a file after the first removal), for up to
  tries x wait_s seconds."""
  import time
  for _ in range(tries):
    storage.rmtree(tmp, ignore_errors=True)
    if not storage.exists(tmp):
      return
    time.sleep(wait_s)


# ------------------------------------------------------------------ the user's model cache

MODELS_ENV = "MHA_JAX_MODELS"
IMPORT_WAIT_S = 3600.0     # how long a second process waits for the first one's import


def cache_root(environ=None) -> str:
  """Where `mha_jax.load` keeps the models it imports: $MHA_JAX_MODELS, else
  $XDG_CACHE_HOME/mha-jax/models (~/.cache/mha-jax/models)."""
  import os
  environ = os.environ if environ is None else environ
  if environ.get(MODELS_ENV):
    return os.path.abspath(os.path.expanduser(environ[MODELS_ENV]))
  base = environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
  return os.path.join(base, "mha-jax", "models")


def cache_key(name: str | None = None, file: str | None = None) -> str:
  """The cache folder's name of a known model (name and its package's version) or of a
  file or HF folder (its name and a hash of its path, sizes and modification times: a
  changed file is imported again)."""
  import importlib.metadata
  import os
  if name is not None:
    k = registry.KNOWN[name]
    try:
      version = importlib.metadata.version(k.pip_name)
    except importlib.metadata.PackageNotFoundError:
      version = "unknown"
    return f"{name}-{version}"
  path = os.path.abspath(file)
  files = ([os.path.join(path, f) for f in sorted(os.listdir(path))] if os.path.isdir(path)
           else [path])
  h = hashlib.sha256(path.encode())
  for f in files:
    st = os.stat(f)
    h.update(f"{os.path.basename(f)}:{st.st_size}:{st.st_mtime_ns}".encode())
  return f"{os.path.basename(path.rstrip('/')) or 'model'}-{h.hexdigest()[:12]}"


def cached_import(name: str | None = None, file: str | None = None, root: str | None = None,
                  log=print) -> str:
  """The workdir of a known model (`name`) or a file / HF folder (`file`) in the model
  cache (`root`, default cache_root()): imported by the first call (import_model, under
  the cache's lock: a second process waits for it and then reuses it), reused after."""
  from mha_jax.train import lock as lock_lib
  root = root or cache_root()
  if name is not None:
    registry.find_model(name)          # a missing package is named before anything is made
  workdir = storage.join(root, cache_key(name, file))
  done = lambda: storage.exists(storage.join(workdir, "config.json"))  # noqa: E731
  if done():
    return workdir
  storage.makedirs(root)
  lock = lock_lib.Lock(root, log=log).acquire(wait_s=IMPORT_WAIT_S)
  try:
    if not done():                     # import_model renames its folder in place at the end
      log(f"importing {name or file} into {workdir} (once)")
      import_model(workdir, name=name, file=file)
  finally:
    lock.release()
  return workdir
