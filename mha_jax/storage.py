"""Workdir I/O. Every file a run, a study or an export reads or writes in a workdir (or
in an --out folder) goes through this module, so a workdir may be a local folder or a
cloud URI such as gs://bucket/run (etils.epath; gs:// needs gcsfs: docs/guide/training.md).

Paths stay strings in the rest of the code (error messages quote them as given).
Writes happen on process 0 only: in a multi-process run every process may read, and
the other processes' writes are skipped here (orbax coordinates its own checkpoints).
This is the one module that may touch files through os/open (tests/test_storage.py).
"""

from __future__ import annotations

import io
import json
import os
from typing import Any

from etils import epath


def path(p) -> epath.Path:
  return epath.Path(p)


def is_uri(p) -> bool:
  """gs://, s3://, ... (anything not a local path)."""
  return "://" in os.fspath(p)


def join(p, *parts: str) -> str:
  if is_uri(p):
    return str(epath.Path(p).joinpath(*parts))
  return os.path.join(p, *parts)


def abspath(p) -> str:
  return os.fspath(p) if is_uri(p) else os.path.abspath(p)


def dirname(p) -> str:
  return str(epath.Path(p).parent) if is_uri(p) else os.path.dirname(p)


def basename(p) -> str:
  return epath.Path(p).name if is_uri(p) else os.path.basename(p)


def is_writer() -> bool:
  """Whether this process writes files (process 0 of a multi-process run)."""
  import jax
  return jax.process_index() == 0


# Reads (every process).

def exists(p) -> bool:
  return path(p).exists()


def isdir(p) -> bool:
  return path(p).is_dir()


def isfile(p) -> bool:
  return path(p).is_file()


def listdir(p) -> list[str]:
  """Names in folder p (sorted)."""
  return sorted(c.name for c in path(p).iterdir())


def writable(p) -> bool:
  """Whether folder p accepts new files (assumed for URIs, where errors surface at the
  first write, and on processes that write nothing)."""
  return is_uri(p) or not is_writer() or os.access(p, os.W_OK)


def read_text(p) -> str:
  with path(p).open("rb") as f:   # bytes, then decode: UnicodeDecodeError as with open()
    return f.read().decode("utf-8")


def read_bytes(p) -> bytes:
  with path(p).open("rb") as f:
    return f.read()


def read_json(p) -> Any:
  return json.loads(read_text(p))


# Writes (process 0 only).

def makedirs(p) -> None:
  if is_writer():
    path(p).mkdir(parents=True, exist_ok=True)


def write_bytes(p, data: bytes, *, atomic: bool = False) -> None:
  """Writes the whole file. atomic: through p.tmp and a rename (local paths; an object
  store's single write is atomic already)."""
  if not is_writer():
    return
  if atomic and not is_uri(p):
    tmp = os.fspath(p) + ".tmp"
    with open(tmp, "wb") as f:
      f.write(data)
    os.replace(tmp, p)
    return
  with path(p).open("wb") as f:
    f.write(data)


def write_text(p, text: str, *, atomic: bool = False) -> None:
  write_bytes(p, text.encode("utf-8"), atomic=atomic)


def write_json(p, obj: Any, *, indent: int | None = 1, atomic: bool = False) -> None:
  write_text(p, json.dumps(obj, indent=indent), atomic=atomic)


def append_text(p, text: str) -> None:
  """Appends to a local file. Object stores cannot append: callers keep the contents and
  rewrite the file (see train/metrics.py)."""
  if is_uri(p):
    raise ValueError(f"append_text: {p!r} is on an object store, which cannot append")
  if is_writer():
    with open(p, "a", encoding="utf-8") as f:
      f.write(text)


def savefig(fig, p, **kwargs) -> None:
  """matplotlib's fig.savefig to any path (the format from p's suffix)."""
  buf = io.BytesIO()
  fmt = kwargs.pop("format", None) or path(p).suffix.lstrip(".") or None
  fig.savefig(buf, format=fmt, **kwargs)
  write_bytes(p, buf.getvalue())


def copy(src, dst) -> None:
  """Copies file src to dst (a file path, or an existing folder to copy into)."""
  if not is_writer():
    return
  if isdir(dst):
    dst = join(dst, basename(src))
  path(src).copy(path(dst), overwrite=True)


def copytree(src, dst) -> None:
  """Copies folder src to dst (which must not exist)."""
  if not is_writer():
    return
  if exists(dst):
    raise FileExistsError(f"{dst} exists")
  makedirs(dst)
  for name in listdir(src):
    s, d = join(src, name), join(dst, name)
    if isdir(s):
      copytree(s, d)
    else:
      copy(s, d)


def rename(src, dst) -> None:
  """Renames src to dst, which must not exist (local: one atomic rename)."""
  if is_writer():
    path(src).rename(path(dst))


def rmdir(p) -> None:
  """Removes an empty folder."""
  if is_writer():
    path(p).rmdir()


def rmtree(p, *, ignore_errors: bool = False) -> None:
  if not is_writer():
    return
  try:
    path(p).rmtree()
  except OSError:
    if not ignore_errors:
      raise
