"""The project's own error types.

`UserError` is bad input from the user (a flag, a config field, a data file, a workdir):
the CLI prints its message on one line and exits with status 2. Any other exception is a
bug and shows its traceback. It is a ValueError, so `except ValueError` still catches it.
"""


class UserError(ValueError):
  """Bad input; the message names the argument, field or file and the value it got.

  `setting`: the study settings (or the inputs `workdir`, `out`, `file`) the message
  names, as the library calls them; the CLI shows each as its flag (`bleu_limit` ->
  `--bleu-limit`). A name or a tuple of names."""

  def __init__(self, *args, setting: str | tuple[str, ...] | None = None):
    super().__init__(*args)
    self.settings = (setting,) if isinstance(setting, str) else tuple(setting or ())


class BadCheckpoint(UserError):
  """A checkpoint that cannot be read back as it was written (missing or garbled item,
  checksum mismatch)."""


class StorageFault(UserError):
  """A place that cannot take what is written there: a full disk, a read-only mount or
  folder, a path under a file. One line naming the place (and, for a run, its last good
  checkpoint); partial files are removed first. Not a bug, so no traceback."""
