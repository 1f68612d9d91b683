"""What the studies share, one floor under them (no study imports another study).

  capture               per-head attention weights streamed over a split
  roles                 the role detectors (positional, syntactic, rare, induction, ...)
  head_roles            every head's role statistics and role for a loaded run
  syntax                dependency accuracy of encoder heads on CoNLL-U sentences
  importance            Michel et al.'s head importance, single-head ablations
  ablations             zero, mean, resample and corrupt ablations as interventions
  masks                 head masks: counting, applying, saving, export of pruned heads
  pairs                 clean/corrupt prompt pairs (IOI, induction, JSONL)
  activation_patching   the Study: activation, path and attribution patching
  stability             role and pruning-curve statistics across seeds
  plots                 every figure the studies write, one implementation each
"""
