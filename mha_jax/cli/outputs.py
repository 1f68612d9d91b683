"""A command's output folder (made before any work, removed again if the command is
refused while still empty) and the run it reads."""

from __future__ import annotations

from mha_jax import storage
from mha_jax.errors import UserError

# The folders writable_out created for this command, outermost first: a command refused
# (UserError) removes those still empty, so a refusal leaves no empty --out behind.
MADE: list[str] = []


def writable_out(out: str, workdir: str | None = None) -> str:
  """Creates folder `out` (a command's output) and checks that it takes files, before any
  work is done; never the source workdir itself or inside its managed folders. The
  folders it creates are removed again, while empty, if the command is refused."""
  from mha_jax.errors import StorageFault
  from mha_jax.train import lock as lock_lib
  if workdir is not None:
    lock_lib.check_out(out, workdir)
  if storage.exists(out) and not storage.isdir(out):
    raise UserError(f"--out {out!r} is a file, not a folder")
  new, p = [], storage.normpath(out)
  while p and not storage.exists(p) and p not in new:
    new.insert(0, p)
    p = storage.dirname(p)
  try:
    storage.makedirs(out)
    MADE.extend(new)
  except StorageFault as e:
    raise UserError(f"--out {out!r} cannot be created ({storage.FAULTS[e.kind]}); a "
                    f"read-only workdir needs --out elsewhere") from None
  if not storage.writable(out):
    raise UserError(f"--out {out!r} is not writable; a read-only workdir needs --out "
                    f"elsewhere")
  return out


def unmake_out() -> None:
  """Removes the folders writable_out created for this command that are still empty
  (innermost first): a refused command leaves no empty --out."""
  while MADE:
    p = MADE.pop()
    try:
      if storage.isdir(p) and not storage.listdir(p):
        storage.rmdir(p)
    except (OSError, UserError):   # another process wrote there: kept
      pass


def is_multi_seed(workdir: str) -> bool:
  """Whether --workdir is a multi-seed run (train.seeds): one seed_<s>/ per seed."""
  from mha_jax.train import seeds as seeds_lib
  return seeds_lib.is_multi_seed(workdir)


def load(args, workdir: str | None = None):
  """The run at --workdir (or `workdir`); a multi-seed workdir is refused naming the verb
  (the verbs that take one, eval, analyze and prune-curve, load each seed)."""
  from mha_jax import loader
  wd = workdir or args.workdir
  if workdir is None and is_multi_seed(wd):
    loader.refuse(args.command, wd, f"one run (one of its seeds, "
                  f"{wd.rstrip('/')}/seed_<s>)")
  return loader.load_workdir(wd, step=getattr(args, "step", None))
