"""Causal head studies: activation, path and attribution patching, DLA, the logit lens.

core (the Study: every method one compiled program over the model's own forward and its
intervention sites), pairs (IOI, induction and JSONL prompt pairs), run (`mha-jax patch`:
JSON and heatmaps), explorer (the explorer's patching view of those files).
"""
