"""Sweeps: a config file lists runs; each runs in its own sub-workdir.

    mha-jax sweep --config configs/sweep_heads.py:heads=1,4,8,64 --workdir runs/sweep
    mha-jax sweep ... --print-commands      # one `mha-jax train` line per run (TPU VMs)

Extra `--config.a.b=v` arguments apply to every run's base config.
"""

from __future__ import annotations

import dataclasses
import shlex
from typing import Callable, Sequence

from mha_jax import storage
from mha_jax.errors import UserError
from mha_jax import config as mc
from mha_jax.train import metrics as metrics_lib
from mha_jax.settings import setting
from mha_jax.toolkit import plots


@dataclasses.dataclass(frozen=True, kw_only=True)
class SweepOptions:
  """The settings of `sweep`."""
  print_commands: bool = setting(False, help="print one `mha-jax train` command per run "
                                 "instead")


def plan(sweep_spec: str, workdir: str, extra: Sequence[str]) -> list[dict]:
  """One entry per run: name, workdir, the base config spec, its overrides, the config."""
  sweep_cfg = mc.load_config(sweep_spec)
  sweep_path = sweep_spec.partition(":")[0]
  base = mc.resolve(sweep_cfg.base, sweep_path).partition(":")[0]
  if not storage.isfile(base):
    raise UserError(f"sweep base config {sweep_cfg.base!r} not found")
  spec = base + (f":{sweep_cfg.base_arg}" if sweep_cfg.base_arg else "")
  runs = []
  for run in sweep_cfg.runs:
    overrides = [f"--config.{k}={v}" for k, v in dict(run["overrides"]).items()]
    overrides += list(extra)
    cfg = mc.load_config(spec)
    rest = mc.apply_overrides(cfg, overrides)
    if rest:
      raise UserError(f"sweep: unexpected arguments {rest}")
    mc.validate(cfg)
    runs.append({"name": run["name"], "workdir": storage.join(workdir, run["name"]),
                 "spec": spec, "overrides": overrides, "config": cfg})
  return runs


def commands(runs: list[dict]) -> list[str]:
  return [" ".join(["mha-jax", "train", "--config", shlex.quote(r["spec"]), "--workdir",
                    shlex.quote(r["workdir"])] + [shlex.quote(o) for o in r["overrides"]])
          for r in runs]


def _finished(run: dict) -> bool:
  from mha_jax.train import checkpoint as ckpt_lib
  if not storage.isdir(storage.join(run["workdir"], "checkpoints")):
    return False
  c = ckpt_lib.Checkpoints(run["workdir"], read_only=True)
  try:
    return (c.latest_step() or 0) >= run["config"].train.steps
  finally:
    c.close()


def _self_attention_params(cfg) -> int:
  """Numbers in the model's first attention block (relative-position tables included),
  from the model's own init under jax.eval_shape (no arrays are made)."""
  import jax
  from mha_jax import tasks
  from mha_jax.models import common
  shapes = jax.eval_shape(lambda k: tasks.init_model(cfg, k, vocab_size=8),
                          jax.random.PRNGKey(0))
  _, _, block = next(common.attention_blocks(shapes))
  return sum(int(x.size) for x in jax.tree.leaves(block))


def summarize(runs: list[dict]) -> list[dict]:
  rows = []
  for r in runs:
    m = r["config"].model
    d_k = m.head_dim or m.d_model // m.num_heads
    valid = [x for x in metrics_lib.read_metrics(r["workdir"]) if x["split"] == "valid"]
    last = valid[-1] if valid else {}
    rows.append({"run": r["name"], "heads": m.num_heads, "d_k": d_k,
                 "attn_params_per_layer": _self_attention_params(r["config"]),
                 "step": last.get("step"), "valid_loss": last.get("loss"),
                 "valid_accuracy": last.get("accuracy"), "valid_bleu": last.get("bleu")})
  return rows


def format_rows(rows: list[dict]) -> str:
  out = ["| run | h | d_k | attn params/layer | step | valid loss | valid acc | valid BLEU |",
         "|---|---:|---:|---:|---:|---:|---:|---:|"]
  f = lambda v, p: "-" if v is None else f"{v:.{p}f}"
  for r in rows:
    out.append(f"| {r['run']} | {r['heads']} | {r['d_k']} | {r['attn_params_per_layer']:,} | "
               f"{r['step'] or '-'} | {f(r['valid_loss'], 3)} | {f(r['valid_accuracy'], 3)} | "
               f"{f(r['valid_bleu'], 1)} |")
  return "\n".join(out)


def run_sweep(sweep_spec: str, workdir: str, extra: Sequence[str], *,
              train_fn: Callable, log: Callable[[str], None] = print) -> list[dict]:
  runs = plan(sweep_spec, workdir, extra)
  storage.makedirs(workdir)
  for r in runs:
    if _finished(r):
      log(f"[{r['name']}] finished already, skipping")
      continue
    log(f"[{r['name']}] training in {r['workdir']}")
    train_fn(r["config"], r["workdir"])
  rows = summarize(runs)
  storage.write_json(storage.join(workdir, "sweep.json"), rows)
  table = format_rows(rows)
  storage.write_text(storage.join(workdir, "sweep.md"), table + "\n")
  plots.sweep_grid(rows, storage.join(workdir, "sweep.png"))
  log(table)
  return rows
