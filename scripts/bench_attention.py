#!/usr/bin/env python
"""Benchmark this project's attention against flax.linen, flax.nnx and jax.nn.

Same as `mha-jax bench attention`; prints a markdown table and writes JSON.
"""
import sys

from mha_jax import cli

if __name__ == "__main__":
  sys.exit(cli.main(["bench", "attention", *sys.argv[1:]]))
