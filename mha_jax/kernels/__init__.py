"""Attention kernels: what `impl=` in mha_jax.attention dispatches to."""
