"""One command: parse, check every input before any work, call the verb; bad input is
said in one line (exit 2), each setting it names shown as its flag."""

from __future__ import annotations

import sys

from mha_jax import machine, settings, storage
from mha_jax.cli import config_files, outputs
from mha_jax.cli.verb import flagged, options
from mha_jax.errors import UserError

def environment(args) -> None:
  """The environment variables every verb reads, parsed now (before any work), each bad
  one refused in a line naming it: MHA_JAX_STORAGE_RETRY_S, MHA_JAX_COMPILE_CACHE (train
  reads its MHA_JAX_* process variables as its flags' defaults and checks them as it
  checks the flags)."""
  from mha_jax import compile_cache
  storage.retry_budget()
  compile_cache.resolve(args.compile_cache)


def main(argv=None) -> int:
  """Runs one verb; returns the exit status (2: bad input, said in one line)."""
  machine.avoid_hugepage_stalls()
  argv = list(sys.argv[1:] if argv is None else argv)
  verb = config_files.verb_of(argv)[1]
  try:
    args, _ = config_files.parse_args(argv)
    verb = args.verb
    for spec in verb.inputs:       # the inputs: checked as the settings are
      settings.check_value(spec, getattr(args, spec.name))
    opts = options(verb, args)
    environment(args)
  except SystemExit as e:    # argparse: --help (0) or a usage error (2), printed already
    return e.code if isinstance(e.code, int) else 0
  except UserError as e:
    print(f"mha-jax: error: {flagged(e, verb)}", file=sys.stderr)
    return 2
  try:
    from mha_jax import compile_cache
    compile_cache.enable(args.compile_cache)
    return verb.call(args, opts)
  except UserError as e:     # bad input: one line. Anything else is a bug: its traceback.
    outputs.unmake_out()
    print(f"mha-jax: error: {flagged(e, verb)}", file=sys.stderr)
    return 2
  finally:
    outputs.MADE.clear()
