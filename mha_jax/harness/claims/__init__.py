"""The seed documents' claims, each measured by a small experiment and judged by a
stated rule: `mha-jax claims` (run.py), the rules (rules.py), the experiments
(measure.py, studies.py, toy.py, variants.py) and the primer page (primer.py)."""
