"""Workdir I/O. Every file a run, a study or an export reads or writes in a workdir (or
in an --out folder) goes through this module, so a workdir may be a local folder or a
cloud URI such as gs://bucket/run (etils.epath; gs:// needs gcsfs: docs/guide/training.md).

Paths stay strings in the rest of the code (error messages quote them as given).
Writes happen on process 0 only: in a multi-process run every process may read, and
the other processes' writes are skipped here (orbax coordinates its own checkpoints).
This is the one module that may touch files through os/open (tests/train/test_storage.py).
"""

from __future__ import annotations

import contextlib
import errno
import io
import json
import os
from typing import Any

from etils import epath

from mha_jax.errors import StorageFault, UserError


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


def normpath(p) -> str:
  """p absolute and normalised (local: symlinks resolved; URIs: no trailing /), to
  compare two paths."""
  if is_uri(p):
    return os.fspath(p).rstrip("/")
  return os.path.realpath(os.path.abspath(p))


def is_within(p, folder) -> bool:
  """Whether p is folder or lies inside it."""
  a, b = normpath(p), normpath(folder)
  return a == b or a.startswith(b.rstrip("/") + "/")


def dirname(p) -> str:
  return str(epath.Path(p).parent) if is_uri(p) else os.path.dirname(p)


def basename(p) -> str:
  return epath.Path(p).name if is_uri(p) else os.path.basename(p)


def is_writer() -> bool:
  """Whether this process writes files (process 0 of a multi-process run)."""
  import jax
  return jax.process_index() == 0


# Faults of the place written to.

_FULL = (errno.ENOSPC, errno.EDQUOT)
_READ_ONLY = (errno.EROFS, errno.EACCES, errno.EPERM)
_NOT_A_FOLDER = (errno.ENOTDIR, errno.EEXIST, errno.EISDIR)


def fault_kind(e: BaseException) -> str | None:
  """"full", "read-only", "not a folder", "forbidden" (HTTP 401/403) or "unavailable"
  (transient errors past the retry budget) when e (or what caused it: orbax and
  TensorStore wrap the OS error) says the place cannot be written; else None."""
  seen = 0
  while e is not None and seen < 8:
    code = getattr(e, "errno", None)
    text = str(e)
    if code in _FULL or "No space left on device" in text or "RESOURCE_EXHAUSTED" in text \
        or "Disk quota exceeded" in text:
      return "full"
    if code in _READ_ONLY or "Read-only file system" in text or "Permission denied" in text:
      return "read-only"
    if code in _NOT_A_FOLDER or isinstance(e, (NotADirectoryError, FileExistsError)):
      return "not a folder"
    if getattr(e, "code", None) in (401, 403) or getattr(e, "status", None) in (401, 403):
      return "forbidden"
    if getattr(e, "kind", None) == "unavailable":
      return "unavailable"
    e, seen = e.__cause__ or e.__context__, seen + 1
  return None


FAULTS = {"full": "the disk is full (no space left on device)",
          "read-only": "the place is read-only (not writable)",
          "not a folder": "a part of the path is a file, not a folder",
          "forbidden": "access is denied (HTTP 401/403: check the credentials and the "
                       "bucket's permissions)",
          "unavailable": "the object store kept failing (transient errors past the "
                         "retry budget)",
          "cut off": "a write to the object store was cut off (a reset connection or an "
                     "HTTP 5xx in the middle of a checkpoint, which orbax does not retry)"}


def fault_message(kind: str, where, what: str = "") -> str:
  """One line: what went wrong at `where`."""
  return f"{what + ': ' if what else ''}cannot write {os.fspath(where)!r}: {FAULTS[kind]}"


@contextlib.contextmanager
def faults(where, what: str = "", *, remove=()):
  """Turns a full disk or a read-only place, met inside, into a StorageFault naming
  `where`, after removing the partial files and folders `remove` (and p.tmp files)."""
  try:
    yield
  except StorageFault:
    raise
  except Exception as e:   # orbax/TensorStore wrap OSError in their own types
    kind = fault_kind(e)
    if kind is None:
      raise
    for p in remove:
      _remove_quietly(p)
    fault = StorageFault(fault_message(kind, where, what))
    fault.kind, fault.where = kind, os.fspath(where)
    raise fault from e


def _remove_quietly(p) -> None:
  try:
    q = path(p)
    if q.is_dir():
      q.rmtree()
    elif q.exists():
      q.unlink()
  except OSError:
    pass


# Transient errors of an object store (503, 429, a reset connection): retried.

TRANSIENT_CODES = (408, 429, 500, 502, 503, 504)
RETRY_ENV = "MHA_JAX_STORAGE_RETRY_S"
RETRY_S = 60.0        # the default bound on the waits of one operation
RETRIES: dict[str, int] = {}    # operation -> retries so far (this process)
_BUDGETS: dict[str, float] = {}  # MHA_JAX_STORAGE_RETRY_S as given -> its seconds


def retry_budget() -> float:
  """The seconds of waiting one operation retries for: MHA_JAX_STORAGE_RETRY_S, else
  RETRY_S. Parsed once per value; one that is not a number of seconds >= 0 is a
  UserError naming the variable (the CLI asks before any work)."""
  raw = os.environ.get(RETRY_ENV, "")
  if raw not in _BUDGETS:
    try:
      v = float(raw) if raw.strip() else RETRY_S
    except ValueError:
      v = float("nan")
    if not 0 <= v < float("inf"):
      raise UserError(f"{RETRY_ENV} must be a number of seconds >= 0; got {raw!r}")
    _BUDGETS[raw] = v
  return _BUDGETS[raw]


def transient(e: BaseException) -> bool:
  """Whether e is worth retrying: an HTTP 408/429/5xx (gcsfs's HttpError, fsspec's
  errors carry .code or .status), a reset or refused connection, a timeout."""
  code = getattr(e, "code", None) or getattr(e, "status", None)
  return isinstance(e, (ConnectionError, TimeoutError)) or code in TRANSIENT_CODES


def transient_cause(e: BaseException) -> BaseException | None:
  """The transient error (see transient) that e is or was caused by, if any: orbax
  wraps the object store's errors in its own."""
  seen = 0
  while e is not None and seen < 8:
    if transient(e):
      return e
    e, seen = e.__cause__ or e.__context__, seen + 1
  return None


def _retrying(what: str):
  """Runs the decorated operation on path p, retrying transient errors with exponential
  backoff (0.5 s, 1 s, 2 s, ... at most 8 s apart) for at most MHA_JAX_STORAGE_RETRY_S
  seconds of waiting (default RETRY_S), each retry logged as a warning. Past that, a
  StorageFault names the object."""
  import functools
  import sys
  import time

  def wrap(fn):
    @functools.wraps(fn)
    def run(p, *args, **kwargs):
      budget = retry_budget()
      waited, delay, tries = 0.0, 0.5, 0
      while True:
        try:
          return fn(p, *args, **kwargs)
        except Exception as e:  # noqa: BLE001 - only transient ones are retried
          if not transient(e):
            raise
          tries += 1
          if waited + delay > budget:
            fault = StorageFault(f"cannot {what} {os.fspath(p)!r}: {type(e).__name__}: "
                                 f"{' '.join(str(e).split())[:200]} (still failing after "
                                 f"{tries} tries over {waited:.0f} s; {RETRY_ENV} sets "
                                 f"how long to retry)")
            fault.kind, fault.where = "unavailable", os.fspath(p)
            raise fault from e
          RETRIES[what] = RETRIES.get(what, 0) + 1
          print(f"mha-jax: warning: {what} {os.fspath(p)!r}: {type(e).__name__}: "
                f"{' '.join(str(e).split())[:120]}; retry {tries} in {delay:g} s",
                file=sys.stderr, flush=True)
          time.sleep(delay)
          waited += delay
          delay = min(2 * delay, 8.0)
    return run
  return wrap


# Reads (every process).

@_retrying("check")
def exists(p) -> bool:
  return path(p).exists()


@_retrying("check")
def isdir(p) -> bool:
  return path(p).is_dir()


@_retrying("check")
def isfile(p) -> bool:
  return path(p).is_file()


@_retrying("list")
def listdir(p) -> list[str]:
  """Names in folder p (sorted)."""
  return sorted(c.name for c in path(p).iterdir())


def writable(p) -> bool:
  """Whether folder p accepts new files (assumed for URIs, where errors surface at the
  first write, and on processes that write nothing)."""
  return is_uri(p) or not is_writer() or os.access(p, os.W_OK)


@_retrying("read")
def read_text(p) -> str:
  with path(p).open("rb") as f:   # bytes, then decode: UnicodeDecodeError as with open()
    return f.read().decode("utf-8")


@_retrying("read")
def read_bytes(p) -> bytes:
  with path(p).open("rb") as f:
    return f.read()


def read_json(p) -> Any:
  return json.loads(read_text(p))


# Writes (process 0 only).

@_retrying("create")
def makedirs(p) -> None:
  if is_writer():
    with faults(p):
      path(p).mkdir(parents=True, exist_ok=True)


@_retrying("write")
def write_bytes(p, data: bytes, *, atomic: bool = False) -> None:
  """Writes the whole file. atomic: through p.tmp and a rename (local paths; an object
  store's single write is atomic already). A full disk or a read-only place raises
  StorageFault naming p, and the partial file is removed (an atomic write leaves p as
  it was)."""
  if not is_writer():
    return
  if atomic and not is_uri(p):
    tmp = os.fspath(p) + ".tmp"
    with faults(p, remove=[tmp]):
      with open(tmp, "wb") as f:
        f.write(data)
      os.replace(tmp, p)
    return
  existed = exists(p)
  with faults(p, remove=[] if existed else [p]):
    with path(p).open("wb") as f:
      f.write(data)


@_retrying("create")
def create_exclusive(p, data: bytes) -> bool:
  """Creates file p holding data, atomically: False (nothing written) when p exists.
  Local: O_CREAT | O_EXCL; object stores: fsspec's exclusive mode "xb" (a conditional
  create on GCS and S3)."""
  with faults(p):
    if is_uri(p):
      from etils.epath import backend   # the file system epath itself uses for p
      try:
        with backend.fsspec_backend.fs(p).open(os.fspath(p), mode="xb") as f:
          f.write(data)
      except FileExistsError:
        return False
      return True
    try:
      fd = os.open(p, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
      return False
    try:
      os.write(fd, data)
    finally:
      os.close(fd)
    return True


@_retrying("remove")
def remove(p) -> None:
  """Removes file p (nothing when it does not exist)."""
  if is_writer():
    path(p).unlink(missing_ok=True)


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
    with faults(p):
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
