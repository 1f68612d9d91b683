"""`mha-jax taxonomy --workdir W`: every head of a decoder LM named by the role it plays,
and each role checked causally (roles.head_taxonomy: the detectors, the assignment and
the checks). Writes OUT/roles.json and taxonomy.png (default WORKDIR/taxonomy).

The pattern roles (previous-token, induction, duplicate-token) are scored on repeated
random tokens of the run's own vocabulary (head_roles.real_lm_roles, 2 x 32 + BOS or as
many as the window holds), as `role-steps` scores them at every checkpoint. With
--bootstrap-windows N the text roles also get each head's bootstrap interval over N
windows spread across the test split, and qualify by it (roles.bootstrap).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from mha_jax import loader, settings as settings_lib, storage
from mha_jax.roles import head_roles, head_taxonomy
from mha_jax.settings import setting
from mha_jax.toolkit import memory

PATTERN_ROLES = ("previous_token", "induction", "duplicate_token")


@dataclasses.dataclass(frozen=True, kw_only=True)
class TaxonomyOptions:
  """The settings of `taxonomy`."""
  roles: tuple[str, ...] = setting(head_taxonomy.DEFAULT_ROLES, choices=head_taxonomy.ROLES,
                                   help="the roles scored (roles.head_taxonomy.ROLES; "
                                   "retrieval only when named)")
  causal: bool = setting(True, help="the causal checks (--no-causal skips them)")
  top_k: int = setting(3, lo=1, help="heads per role in a causal check")
  draws: int = setting(5, lo=1, help="random head sets per role in a causal check")
  seed: int = setting(0, lo=0, help="the random draws' and the IOI pairs' seed")
  n_pairs: int = setting(8, lo=1, help="IOI pairs (the IOI roles)")
  retrieval_len: int = setting(384, lo=16, help="role retrieval: tokens of each "
                               "needle-in-a-haystack input")
  bootstrap_windows: int = setting(0, lo=0, help="the text roles (copy_suppression, "
                                   "attention_sink) also scored on this many windows "
                                   "spread over the test split; a head qualifies only when "
                                   "its bootstrap interval over windows clears the "
                                   "threshold (roles.json's \"bootstrap\"; 0: off)")
  bootstrap_level: float = setting(0.9, lo=0.0, hi=1.0, lo_open=True, hi_open=True,
                                   help="the bootstrap interval's two-sided level")
  bootstrap_draws: int = setting(2000, lo=1, help="bootstrap resamples of the windows")
  memory_budget: str | None = memory.budget_setting(
      "each detector's and causal check's program", "the rows per batch of each are")


def classifier_settings(opts: TaxonomyOptions, budget: int | None = None
                        ) -> head_taxonomy.ClassifyOptions:
  """The classifier's settings of a study's options; budget: the bytes of
  memory.budget (None: every row at once)."""
  return head_taxonomy.ClassifyOptions(
      memory_budget=budget, roles=opts.roles, top_k=opts.top_k, draws=opts.draws,
      seed=opts.seed, n_pairs=opts.n_pairs, retrieval_len=opts.retrieval_len,
      bootstrap_windows=opts.bootstrap_windows, bootstrap_level=opts.bootstrap_level,
      bootstrap_draws=opts.bootstrap_draws)


def taxonomy(loaded, out: str | None = None, opts: TaxonomyOptions = TaxonomyOptions(), *,
             log: Callable[[str], None] = print) -> dict:
  """The roles.json document of `loaded` (head_taxonomy.classify), with "workdir";
  written with taxonomy.png into `out` (default WORKDIR/taxonomy)."""
  settings_lib.check(opts)
  if not loaded.task.decoder_only:
    loader.refuse("taxonomy", loaded.workdir, "a decoder LM (its heads' roles are read on "
                  "next-token prediction)")
  budget, _ = memory.budget(opts.memory_budget, memory.params_bytes(loaded.params))
  tax = classifier_settings(opts, budget)
  rows = (head_roles.real_lm_roles(loaded, half_len=head_roles.repeat_half_len(loaded),
                                   memory_budget=budget)
          if set(tax.roles) & set(PATTERN_ROLES) else None)
  doc = head_taxonomy.classify(loaded, rows, tax, log, check=opts.causal)
  doc["workdir"] = loaded.workdir
  head_taxonomy.write(doc, out or storage.join(loaded.workdir, "taxonomy"),
                      f"head roles, {loaded.workdir}")
  return doc


def format_summary(doc: dict) -> str:
  """Top-3 heads per role, the counts and each causal check, as text."""
  return head_taxonomy.format_summary(doc)
