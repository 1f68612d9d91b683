"""Causal head studies: activation, path and attribution patching, DLA, the logit lens."""
