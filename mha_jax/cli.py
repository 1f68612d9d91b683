"""The `mha-jax` command."""

from __future__ import annotations

import argparse
import sys


def _int_list(text: str) -> tuple[int, ...]:
  try:
    return tuple(int(v) for v in text.split(",") if v.strip())
  except ValueError:
    raise argparse.ArgumentTypeError(f"expected comma-separated integers; got {text!r}") from None


def _cmd_zoo(args) -> int:
  from mha_jax import accounting
  if args.d_model is not None:
    print(accounting.format_head_sweep(args.d_model, seq_len=args.seq_len, batch=args.batch))
    print("\nAt d_k = 1 a query and a key are single numbers: a head can then only favour "
          "the key with the largest or the smallest k.")
    return 0
  print(accounting.format_zoo(seq_len=args.seq_len, batch=args.batch))
  print("\nParams and FLOPs are the same for every h at a given d_model; the score "
        "tensor grows with h.")
  return 0


def _cmd_bench_attention(args) -> int:
  from mha_jax import bench
  result = bench.run(d_model=args.d_model, seq_len=args.seq_len, batch=args.batch,
                     heads=args.heads, rounds=args.rounds, warmup=args.warmup,
                     dtype=args.dtype)
  print(bench.format_table(result))
  bench.write_json(result, args.out)
  print(f"\nwrote {args.out}")
  return 0


def build_parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(prog="mha-jax", description=__doc__)
  sub = p.add_subparsers(dest="command", required=True)

  z = sub.add_parser("zoo", help="params, FLOPs and score memory of the model zoo")
  z.add_argument("--seq-len", type=int, default=2048)
  z.add_argument("--batch", type=int, default=1)
  z.add_argument("--d-model", type=int, default=None,
                 help="instead of the zoo, every h dividing this width")
  z.set_defaults(func=_cmd_zoo)

  b = sub.add_parser("bench", help="benchmarks")
  bsub = b.add_subparsers(dest="bench", required=True)
  ba = bsub.add_parser("attention", help="this layer vs flax.linen, flax.nnx, jax.nn")
  add_bench_attention_args(ba)
  ba.set_defaults(func=_cmd_bench_attention)
  return p


def add_bench_attention_args(p: argparse.ArgumentParser) -> None:
  from mha_jax.bench import DEFAULT_HEADS
  p.add_argument("--d-model", type=int, default=768)
  p.add_argument("--seq-len", type=int, default=512)
  p.add_argument("--batch", type=int, default=4)
  p.add_argument("--heads", type=_int_list, default=DEFAULT_HEADS,
                 help="comma-separated head counts (default: %(default)s)")
  p.add_argument("--rounds", type=int, default=5)
  p.add_argument("--warmup", type=int, default=1)
  p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
  p.add_argument("--out", default="results/bench_attention.json")


def main(argv=None) -> int:
  args = build_parser().parse_args(argv)
  try:
    return args.func(args)
  except ValueError as e:
    print(f"mha-jax: error: {e}", file=sys.stderr)
    return 2


if __name__ == "__main__":
  sys.exit(main())
