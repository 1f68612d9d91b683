"""Circuits in attention-only transformers: composition, eigenvalue positivity, path
expansion, term importance, and behavioural scores tracked over checkpoints."""
