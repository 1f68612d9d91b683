"""`mha-jax prune` and `mha-jax export-pruned`: pruned workdirs that load like any other.

A pruned workdir holds the source run's config.json and data/, a checkpoint of the masked params
(pruned heads' W_O rows zeroed, i.e. gate 0) and pruning.json (method, lambda, mask,
kept heads, gate values, BLEU before and after). `export-pruned` removes the masked
heads from the weights for real.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import numpy as np

from mha_jax import loader, settings, storage
from mha_jax.errors import UserError
from mha_jax.models import common as common_lib
from mha_jax.pruning import hard_concrete
from mha_jax.toolkit import head_masks
from mha_jax.pruning import methods
from mha_jax.settings import setting
from mha_jax.train import checkpoint as ckpt_lib
from mha_jax.train import lock as lock_lib


METHODS = ("l0", "michel", "random")   # Voita et al.'s gates, Michel et al.'s scores
# The lambda of `prune` with method l0 and keep K but no l0_lambda (prune-curve's default).
DEFAULT_KEEP_LAMBDA = 0.05


def _fresh_dir(path: str, what: str) -> None:
  if storage.exists(path) and storage.listdir(path):
    raise UserError(f"{what} {path!r} exists and is not empty; refusing to overwrite it",
                    setting=what)
  storage.makedirs(path)


def _evaluate(loaded, params, bleu_limit):
  return loaded.task.evaluate(params, "test", bleu_limit=bleu_limit)


def write_workdir(loaded, out: str, params, info: dict) -> None:
  """A workdir whose checkpoint holds `params` and whose pruning.json holds `info`."""
  _fresh_dir(out, "out")
  try:
    storage.copy(storage.join(loaded.workdir, "config.json"), storage.join(out, "config.json"))
    data = storage.join(loaded.workdir, "data")   # the run's vocabulary/tokenizer and stats
    if storage.isdir(data):
      storage.copytree(data, storage.join(out, "data"))
    if storage.exists(storage.join(loaded.workdir, "tokenizer.json")):   # imported models
      storage.copy(storage.join(loaded.workdir, "tokenizer.json"), out)
    c = ckpt_lib.Checkpoints(out)
    c.save_params(loaded.step, params, {"step": loaded.step,
                                     "source": storage.abspath(loaded.workdir)})
    c.close()
    storage.write_json(storage.join(out, "pruning.json"), info)
  except BaseException:
    storage.rmtree(out, ignore_errors=True)   # we created it empty; leave nothing half-written
    raise


def check_stacks(params, stacks) -> None:
  """Every stack of `stacks` is one of the model's, else a UserError naming --stacks."""
  counts = common_lib.head_counts(params)
  for s in stacks:
    if s not in counts:
      raise UserError(f"stacks: {s!r} is not in this model; it has {sorted(counts)}",
                      setting="stacks")


def _check(loaded, stacks, keep, start_mask):
  counts = common_lib.head_counts(loaded.params)
  check_stacks(loaded.params, stacks)
  available = head_masks.count(start_mask) if start_mask else sum(sum(counts[s]) for s in stacks)
  if keep is not None and not 0 <= keep <= available:
    raise UserError(f"keep must be between 0 and the {available} heads left in "
                    f"{list(stacks)}; got {keep}", setting="keep")
  return available


@dataclasses.dataclass(frozen=True, kw_only=True)
class PruneOptions:
  """The settings of `prune`; `methods=` marks those only some methods read."""
  method: str = setting("l0", choices=METHODS,
                        help="l0: train Hard Concrete gates (Voita et al.); michel: drop "
                             "the heads of least gradient importance (Michel et al.); "
                             "random (default: l0)")
  keep: int | None = setting(None, help="end with exactly K heads (checked against the "
                             "heads left)")
  stacks: tuple[str, ...] = setting(("encoder",), choices=tuple(common_lib.STACKS),
                                    metavar="STACK[,STACK...]",
                                    help=f"attention stacks, of {', '.join(common_lib.STACKS)} "
                                         f"(default: encoder)")
  bleu_limit: int = setting(0, lo=0, note=" (0 = all)", help="test BLEU sentences (0 = all)")
  l0_lambda: float | None = setting(None, lo=0, methods=("l0",),
                                    help="L0 penalty (with keep K: default 0.05, it only "
                                         "ranks the heads)")
  lambdas: tuple[float, ...] = setting((), lo=0, methods=("l0",),
                                       help="sweep lambda: one sub-workdir per value")
  steps: int = setting(300, lo=1, methods=("l0",), help="gate training steps")
  lr: float = setting(0.05, lo=0, lo_open=True, methods=("l0",), help="gate learning rate")
  finetune: bool = setting(False, methods=("l0",), help="also train the model")
  beta: float = setting(1 / 3, lo=0, lo_open=True, methods=("l0",),
                        help="the Hard Concrete temperature")
  init_log_alpha: float = setting(2.0, methods=("l0",), help="the gates' initial log alpha")
  per_layer_mean: bool = setting(False, methods=("l0",),
                                 help="average the L0 penalty per layer")
  binarize: str = setting("nonzero", choices=hard_concrete.BINARIZE, methods=("l0",),
                          help="a head is kept when its gate is nonzero, or above 0.5")
  keep_one_per_layer: bool = setting(False, methods=("michel",), help="never empty a layer")
  seed: int = setting(0, lo=0, methods=("l0", "random"),
                      help="the random seed (default: 0)")

  @property
  def concrete_gates(self) -> hard_concrete.HardConcrete:
    """The Hard Concrete gates' settings (l0)."""
    return hard_concrete.HardConcrete(beta=self.beta, init_log_alpha=self.init_log_alpha,
                                      per_layer_mean=self.per_layer_mean,
                                      binarize=self.binarize)


def default_out(workdir: str, opts: PruneOptions) -> str:
  """Where `prune` writes by default: WORKDIR_pruned_METHOD, a new workdir."""
  return workdir.rstrip("/") + f"_pruned_{opts.method}"


def prune(loaded, out: str, opts: PruneOptions, *, log: Callable[[str], None] = print,
          base: dict | None = None) -> dict:
  """Prunes the loaded run into `out` (or one sub-workdir per lambda).

  `base` (its test metrics at opts.bleu_limit) saves an evaluation when the caller has
  them already."""
  settings.check(opts)
  workdir, method, keep = loaded.workdir, opts.method, opts.keep
  stacks, lam, lambdas, bleu_limit = list(opts.stacks), opts.l0_lambda, opts.lambdas, \
      opts.bleu_limit
  steps, lr, finetune, seed, hc = opts.steps, opts.lr, opts.finetune, opts.seed, \
      opts.concrete_gates
  keep_one_per_layer = opts.keep_one_per_layer
  lock_lib.check_out(out, workdir)
  if storage.exists(out) and storage.listdir(out):
    raise UserError(f"out {out!r} exists and is not empty; refusing to overwrite it",
                    setting="out")
  start_mask = head_masks.read_head_mask(workdir)
  if start_mask:
    start_mask = {s: m for s, m in start_mask.items() if s in stacks}
  available = _check(loaded, stacks, keep, start_mask)
  if method == "l0" and lam is None and not lambdas:
    if keep is None:
      raise UserError("method l0 needs l0_lambda X, lambdas a,b,c or keep K",
                      setting=("method", "l0_lambda", "lambdas", "keep"))
    lam = DEFAULT_KEEP_LAMBDA    # top K of the gates: lambda only shapes the ranking
  if method != "l0" and keep is None:
    raise UserError(f"method {method} needs keep K", setting=("method", "keep"))
  base = base if base is not None else _evaluate(loaded, loaded.params, bleu_limit)
  log(f"base: {available} heads in {list(stacks)}, test " +
      " ".join(f"{k} {v:.4g}" for k, v in base.items()))
  common = {"source": storage.abspath(workdir), "stacks": list(stacks), "method": method,
            "base": base, "binarize": hc.binarize}
  if method == "l0" and lambdas:
    rows = []
    for l in lambdas:
      row = _prune_l0(loaded, storage.join(out, f"lambda_{l:g}"), l, keep, stacks, steps, lr,
                      finetune, seed, hc, start_mask, bleu_limit, common, log)
      rows.append({"lambda": l, "kept": row["kept"], **row["after"]})
    storage.write_json(storage.join(out, "lambdas.json"), rows)
    return {"lambdas": rows, "base": base}
  if method == "l0":
    return _prune_l0(loaded, out, lam, keep, stacks, steps, lr, finetune, seed, hc, start_mask,
                     bleu_limit, common, log)
  if method == "michel":
    mask = methods.michel_masks(loaded, stacks=stacks, counts=[keep],
                                keep_one_per_layer=keep_one_per_layer,
                                start_mask=start_mask, log=log)[keep]
  else:
    mask = methods.random_masks(loaded, stacks=stacks, counts=[keep], seed=seed,
                                start_mask=start_mask)[keep]
  return save_pruned(loaded, out, loaded.params, mask, {**common, "keep": keep}, bleu_limit, log)


def _prune_l0(loaded, out, lam, keep, stacks, steps, lr, finetune, seed, hc, start_mask,
              bleu_limit, common, log):
  log_alpha, params, history = methods.train_gates(
      loaded, lam, stacks=stacks, steps=steps, lr=lr, finetune=finetune, seed=seed, hc=hc,
      start_mask=start_mask, log=log)
  mask = (methods.top_k_mask(log_alpha, keep, start_mask) if keep is not None
          else methods.l0_mask(log_alpha, hc, start_mask))
  info = {**common, "lambda": lam, "keep": keep, "steps": steps, "finetune": finetune,
          "beta": hc.beta, "stretch": [hc.low, hc.high], "history": history,
          "log_alpha": head_masks.jsonable(log_alpha), "gates": head_masks.jsonable(hard_concrete.deterministic(log_alpha, hc))}
  return save_pruned(loaded, out, params, mask, info, bleu_limit, log)


def save_pruned(loaded, out, params, mask, info, bleu_limit, log):
  """Writes `out`, the workdir of `params` with the heads where `mask` is 0 removed
  (masked), evaluated on test; returns `info` with the mask, kept, kept_heads and the
  test metrics ("after")."""
  masked = head_masks.mask_params(params, mask)
  after = _evaluate(loaded, masked, bleu_limit)
  info = {**info, "mask": head_masks.head_mask_to_json(mask), "kept": head_masks.count(mask),
          "kept_heads": head_masks.kept_names(mask), "after": after}
  write_workdir(loaded, out, masked, info)
  log(f"kept {info['kept']} heads -> {out}: test " +
      " ".join(f"{k} {v:.4g}" for k, v in after.items()))
  return info


@dataclasses.dataclass(frozen=True, kw_only=True)
class ExportOptions:
  """The settings of `export_pruned` (none yet: the pruned workdir says what to remove)."""


def check_export(workdir: str, out: str) -> None:
  """A pruned workdir, and an `out` that is a new folder outside it; before any work."""
  lock_lib.check_out(out, workdir)
  if head_masks.read_head_mask(workdir) is None:
    loader.refuse("export-pruned", workdir, "a run `mha-jax prune` wrote (its "
                  "pruning.json: prune it first)")
  if storage.exists(out) and storage.listdir(out):
    raise UserError(f"out {out!r} exists and is not empty; refusing to overwrite it",
                    setting="out")


def export_pruned(loaded, out: str, opts: ExportOptions = ExportOptions(), *,
                  log: Callable[[str], None] = print) -> dict:
  """Writes `out` with the masked heads of a loaded pruned run physically removed."""
  workdir = loaded.workdir
  check_export(workdir, out)
  mask = head_masks.read_head_mask(workdir)
  pruned = head_masks.export_pruned(loaded.params, mask)
  batch = next(loaded.task.eval_batches("test", 16))[0]
  speed, (masked_out, exported_out) = forward_speedup(loaded.task, loaded.params, pruned, batch)
  diff = float(np.max(np.abs(masked_out - exported_out)))
  scale = float(np.max(np.abs(masked_out)))
  info = storage.read_json(storage.join(workdir, "pruning.json"))
  info.update(exported_from=storage.abspath(workdir), max_abs_diff_vs_masked=diff,
              max_abs_output_masked=scale, relative_diff_vs_masked=diff / max(scale, 1e-30),
              head_counts=common_lib.head_counts(pruned), source_mask=info["mask"],
              kv_head_counts={s: [int(p["wk"].shape[1]) for st, _, p in
                                  common_lib.attention_blocks(pruned) if st == s] for s in mask},
              mask=head_masks.head_mask_to_json(head_masks.exported_head_mask(loaded.params, mask)), forward_speed=speed)
  write_workdir(loaded, out, pruned, info)
  log(f"exported {head_masks.count(mask)} heads -> {out}; head counts {common_lib.head_counts(pruned)}; "
      f"max |output difference| vs the masked model {diff:.2e} (max |output| {scale:.3g}); "
      f"forward {speed['masked_s']:.4f} s -> {speed['exported_s']:.4f} s "
      f"(x{speed['speedup']:.2f}, {speed['masked_tokens_per_s']:.0f} -> "
      f"{speed['exported_tokens_per_s']:.0f} tokens/s)")
  return info


def forward_speedup(model, dense, pruned, batch, rounds: int = 9) -> tuple[dict, tuple]:
  """One jitted forward of each (both compiled first) on the same batch, timed in
  `rounds` interleaved rounds (masked, exported, masked, ...; median seconds): the masked
  model (every head computed, pruned ones gated to 0 by W_O: the dense model's cost)
  against the exported one. Also tokens per second (batch tokens / median).
  Returns (timings, (masked outputs, exported outputs) as NumPy)."""
  import time
  import jax
  fwd = jax.jit(lambda p, b: model.apply(p, b))
  batch = jax.device_put(batch)     # on the device once, not inside the timed calls
  names = (("masked_s", dense), ("exported_s", pruned))
  outputs = tuple(np.asarray(fwd(p, batch)) for _, p in names)   # also the compiles
  times = {name: [] for name, _ in names}
  for _ in range(rounds):
    for name, p in names:
      t = time.perf_counter()
      jax.block_until_ready(fwd(p, batch))
      times[name].append(time.perf_counter() - t)
  tokens = int(np.prod(np.shape(batch["tokens"] if "tokens" in batch else
                                next(iter(batch.values())))))
  out = {name: float(np.median(v)) for name, v in times.items()}
  out["speedup"] = out["masked_s"] / out["exported_s"]
  out.update(rounds=rounds, interleaved=True, tokens_per_batch=tokens,
             masked_tokens_per_s=tokens / out["masked_s"],
             exported_tokens_per_s=tokens / out["exported_s"],
             batch_shapes={k: list(np.shape(v)) for k, v in batch.items()})
  return out, outputs
