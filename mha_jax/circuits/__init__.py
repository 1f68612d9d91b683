"""Circuits, two verbs: `mha-jax circuits` (induction_circuits.py), a decoder's induction
circuits read off its heads and weights (composition, eigenvalue positivity, path
expansion, term importance, behavioural scores tracked over checkpoints); and `mha-jax
circuit` (circuit.py), the edge circuit of one behaviour (circuit_behaviours.py) on prompt
pairs, found by edge scores (edges, graph, search) and checked for faithfulness."""
