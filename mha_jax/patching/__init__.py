"""Causal head studies: activation, path and attribution patching, DLA, the logit lens.

patch (`mha-jax patch`: JSON and heatmaps), explorer (the explorer's patching view of
those files). The Study itself (every method one compiled program over the model's own
forward and its intervention sites) and the prompt pairs (IOI, induction, JSONL) are
shared with the circuits: toolkit.activation_patching and toolkit.pairs.
"""
