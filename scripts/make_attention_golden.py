"""Writes tests/core/data/attention_softmax_golden.npz: outputs and gradients of
multi_head_attention (softmax) on small fixed inputs, so that a test can check the
default variant stays the same to the bit. Run with the tests' XLA flags (conftest):

  XLA_FLAGS="--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true \
    --xla_cpu_use_fusion_emitters=false" PYTHONPATH=. python scripts/make_attention_golden.py

The committed file was written at commit 1b0752d (the code before the variants), with
these flags.

The cases live in tests/core/golden_cases.py; the test recomputes them and compares.
"""

import os

import numpy as np

from mha_jax.harness import module_at

golden_cases = module_at("golden_cases", os.path.join(os.path.dirname(__file__), "..",
                                                      "tests", "core"))

if __name__ == "__main__":
  out = os.path.join(os.path.dirname(__file__), "..", "tests", "core", "data",
                     "attention_softmax_golden.npz")
  arrays = golden_cases.compute_all()
  np.savez_compressed(out, **arrays)
  print(f"wrote {len(arrays)} arrays to {out}")
