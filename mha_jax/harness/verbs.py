"""The harness's verbs, which `mha_jax.cli` adds through its one hook (cli.HARNESS):
`claims`, `primer`, `bench attention`, `bench train`. Their flags are generated from the
settings dataclasses below, as the library's verbs' are.

`python -m mha_jax.harness.bench scale-t-one NAME D H T B ROUNDS CAP_GB` is no verb: it is
the capped subprocess `bench attention --scale-t` starts for each (implementation, T)."""

from __future__ import annotations

import dataclasses

from mha_jax.cli import Verb, input_spec
from mha_jax.settings import setting
from mha_jax.harness import bench, bench_train, benchmarks
from mha_jax.harness.claims import run as claims_run

@dataclasses.dataclass(frozen=True, kw_only=True)
class ClaimsOptions:
  """The settings of `claims` (claims.run.run_claims's keywords)."""
  only: tuple[str, ...] | None = setting(None, choices=tuple(claims_run.CLAIMS),
                                         metavar="CLAIM[,CLAIM...]",
                                         help="comma-separated claim names (default: all)")
  settings: tuple[str, ...] | None = setting(
      None, choices=tuple(claims_run.SETTINGS), metavar="SETTING[,SETTING...]",
      help="comma-separated: toy, text, smollm2, gemma3, voita, minilm, variants "
           "(default: toy, and text / voita / variants when their workdir is given)")
  workdir: str | None = setting(None, path=True, help="a quickstart workdir to reuse")
  induction_workdir: str | None = setting(None, path=True, help="a trained "
                                          "configs/induction.py workdir to reuse")
  sweep_workdir: str | None = setting(None, path=True, help="a `mha-jax sweep` workdir: "
                                      "its loss at d_k = 1")
  text_workdir: str | None = setting(None, path=True, help="a trained "
                                     "configs/attn_only_text.py workdir (one run or "
                                     "seed_<s>/)")
  voita_workdir: str | None = setting(None, path=True, help="a translation workdir with "
                                      "sinusoidal positions (one run or seed_<s>/)")
  variants_workdir: str | None = setting(None, path=True, help="a workdir of one multi-seed "
                                         "run per attention variant (the variants "
                                         "setting; docs/guide/claims.md)")
  toy_seeds: tuple[int, ...] = setting((0, 1, 2), lo=0, help="the seeds the toy setting "
                                       "trains (default: 0,1,2)")
  primer: bool = setting(True, help="write primer.html beside the report (its figures run "
                         "the attention function at every zoo width: seconds)")


def _claims(args, opts: ClaimsOptions) -> int:
  rep = claims_run.run_claims(args.out, **dataclasses.asdict(opts))
  for r in rep["claims"]:
    print(f"{r['name']}: {r['verdict']}")
  wrote = "REPORT.md, claims.json" + (", primer.html" if opts.primer else "")
  print(f"wrote {args.out}/{wrote} in {rep['seconds']:.0f} s")
  return 0


@dataclasses.dataclass(frozen=True, kw_only=True)
class PrimerOptions:
  """The settings of `primer` (claims.primer.standalone's keywords)."""
  pruning_workdir: str | None = setting(None, path=True, help="a translation run (Voita's "
                                        "setting) with a prune result")
  pruned: str | None = setting(None, path=True, help="its prune or prune-curve folder")
  text_workdir: str | None = setting(None, path=True,
                                     help="the two-layer natural-text model")


def _primer(args, opts: PrimerOptions) -> int:
  from mha_jax.harness.claims import primer
  print(f"wrote {primer.standalone(args.out, **dataclasses.asdict(opts))}")
  return 0


def _bench_attention(args, opts: bench.BenchAttentionOptions) -> int:
  o = opts
  if o.scale_t:
    result = bench.run_scale_t(d_model=o.d_model or 512, num_heads=(o.heads or (8,))[0],
                               batch=o.batch or 1, seq_lens=o.seq_lens or bench.SCALE_T,
                               impls=o.impls, rounds=o.rounds, max_mem_gb=o.max_mem_gb)
    text, out = bench.format_scale_t(result), "results/bench_attention_scale_t.json"
  elif o.variants:
    result = bench.run_variants(d_model=o.d_model or 768, seq_len=o.seq_len,
                                batch=o.batch or 4, heads=o.heads or (8,), rounds=o.rounds,
                                warmup=o.warmup, dtype=o.dtype)
    text, out = bench.format_variants(result), "results/bench_attention_variants.json"
  else:
    result = bench.run_attention(d_model=o.d_model or 768, seq_len=o.seq_len, batch=o.batch or 4,
                       heads=o.heads or bench.DEFAULT_HEADS, rounds=o.rounds,
                       warmup=o.warmup, dtype=o.dtype, impls=o.impls)
    text, out = bench.format_table(result), "results/bench_attention.json"
  print(text)
  bench.write_json(result, args.out or out)
  print(f"\nwrote {args.out or out}")
  return 0


def _bench_train(args, opts: bench_train.BenchTrainOptions) -> int:
  result = bench_train.run_train_steps(args.config, args.extra, rounds=opts.rounds, warmup=opts.warmup,
                           workdir=args.workdir, matmul_size=opts.matmul_size)
  print(bench_train.format_table(result))
  bench.write_json(result, args.out)
  print(f"\nwrote {args.out}")
  return 0


VERBS = {
    "claims": Verb("measure the seed documents' claims; report + primer", _claims,
                   ClaimsOptions, (input_spec("out", "output folder (default: claims)",
                                          "claims"),)),
    "primer": Verb("the primer page alone (claims writes it with its claims)", _primer,
                   PrimerOptions, (input_spec("out", "output folder", required=True),)),
}
BENCH = {
    "attention": Verb("this layer vs flax.linen, flax.nnx, jax.nn", _bench_attention,
                      bench.BenchAttentionOptions,
                      (input_spec("out", "the JSON file (default: results/bench_attention"
                              "[_scale_t|_variants].json)"),), config=None),
    "train": Verb("the quickstart model's training step, ours vs flax.linen",
                  _bench_train, bench_train.BenchTrainOptions, (
                      input_spec("config", "a training config (default: the quickstart's)",
                             "configs/translation.py:quickstart"),
                      input_spec("workdir", "where the task writes its generated data",
                             "workdirs/bench_train"),
                      input_spec("out", "the JSON file", "results/bench_train.json")),
                  config="training"),
    **benchmarks.verbs(),
}
