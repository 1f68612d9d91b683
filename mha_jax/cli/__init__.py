"""mha-jax: train, study and benchmark multi-head attention (one verb per job).

Every verb's flags are generated from dataclasses of settings (`mha_jax.settings`): a
study's options (`analysis.report.AnalyzeOptions`, `pruning.prune.PruneOptions`, ...),
each living beside the code it configures, and the verb's inputs (`--workdir`, `--step`,
`--out`). A setting's flag is its name with `-` for `_` (`bleu_limit` is
`--bleu-limit`); its type, default, choices (per item for a comma-separated list), range
and help come from its field, and `settings.check` checks the options before any work. A
study verb also reads its settings from a config file, loaded as `train` loads its own:

    mha-jax prune --workdir W --config configs/studies/prune_michel.py --config.keep=6

A verb with methods (`prune --method`, `patch --method`, `circuit --method`) takes, and
lists in --help, only the flags of the methods asked for.

The package, read in this order:
  verb.py          a Verb (help, call, settings, inputs) and the shared inputs
  table.py         the verbs: VERBS, BENCH (`mha-jax bench NAME`), the harness's hook
  runner.py        the one runner of the study verbs (a `Study` entry of table.STUDIES)
  parser.py        argparse flags generated from the settings; the flags each verb took
  config_files.py  argv -> args: a study's config file, then the command line over it
  command.py       main: parse, check, call; bad input in one line (exit 2)
  outputs.py       --out made before the work and removed if refused; the run loaded
"""

from mha_jax.cli.verb import STEP, WORKDIR, Verb, flagged, input_spec, options, out_spec
from mha_jax.cli.outputs import unmake_out, writable_out
from mha_jax.cli.parser import add_verb, build_parser, flag_of
from mha_jax.cli.table import BENCH, HARNESS, STUDIES, VERBS
from mha_jax.cli.runner import Study, run_study, study_verb
from mha_jax.cli.config_files import parse_args
from mha_jax.cli.command import environment, main
from mha_jax.settings import DTYPES

__all__ = ["BENCH", "DTYPES", "HARNESS", "STEP", "STUDIES", "VERBS", "WORKDIR", "Study",
           "Verb", "add_verb", "build_parser", "environment", "flag_of", "flagged",
           "input_spec", "main", "options", "out_spec", "parse_args", "run_study",
           "study_verb", "unmake_out", "writable_out"]
