"""`mha-jax role-steps --workdir W`: the step at which each head role appears, over the
checkpoints of a decoder LM trained here (the natural-text model's phase change, role by
role).

At every saved checkpoint (`loader.each_checkpoint`, the one walker) each head is scored
for each role by the head taxonomy (`roles.head_taxonomy.scores`): previous-token,
induction and duplicate-token on repeated random tokens of the run's own vocabulary
(`roles.head_roles.real_lm_roles`), the attention sink, successor and copy suppression
(`roles.detectors`). A role **appears** at the first checkpoint from which its best
head's score is >= the taxonomy's threshold at every later checkpoint
(`toolkit.stability.appears_at`: a transient is no appearance). At the `check_steps`
(default: the last checkpoint and those before, at and after the induction role's
appearance) every role is checked causally as the taxonomy checks it
(`head_taxonomy.causal`: its top-k heads mean-ablated against random heads of the same
layers).

The IOI roles (name movers, negative name movers, S-inhibition) are asked only of a
model that has IOI prompts: names that are single tokens of a model of English. Asked
of one that has not (a model of Python code over a 2,048-token BPE), the taxonomy
refuses them by name; by default they are left out and the refusal is recorded under
"not_asked", as successor is on a model without a tokenizer (a toy induction run). Duplicate-token's causal check is IOI's logit difference too: on such a
model its score is kept and its check reported as not run. Retrieval is left out: its
haystack is longer than a 256-token window.

Writes OUT/role_steps.json ("by_step", "appears_at", "causal", "thresholds", "machine")
and OUT/role_steps.png (each role's best score against step, its threshold dashed).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable

from mha_jax import settings as settings_lib, storage
from mha_jax.roles import head_taxonomy
from mha_jax.errors import UserError
from mha_jax.machine import machine
from mha_jax import loader
from mha_jax.loader import each_checkpoint
from mha_jax.settings import setting
from mha_jax.toolkit import pairs as pairs_lib, stability
from mha_jax.roles import head_roles

# The roles a model of any text can have (the IOI roles need names; retrieval a long window).
STEP_ROLES = ("previous_token", "induction", "duplicate_token", "attention_sink",
              "successor", "copy_suppression")


@dataclasses.dataclass(frozen=True, kw_only=True)
class RoleStepsOptions:
  """The settings of `role-steps`."""
  roles: tuple[str, ...] = setting(STEP_ROLES, choices=head_taxonomy.ROLES,
                                   help="the roles scored at every checkpoint "
                                   "(roles.head_taxonomy.ROLES)")
  steps: tuple[int, ...] = setting((), lo=0, help="the checkpoints to score (default: "
                                   "every saved one)")
  check_steps: tuple[int, ...] = setting((), lo=0, help="the scored steps of the causal "
                                         "checks (default: the last, and those before, "
                                         "at and after the induction role's appearance)")
  causal: bool = setting(True, help="the causal checks (--no-causal skips them)")
  top_k: int = setting(3, lo=1, help="heads per role in a causal check")
  draws: int = setting(5, lo=1, help="random head sets per role in a causal check")


def _taxonomy_settings(opts: RoleStepsOptions, loaded) -> head_taxonomy.ClassifyOptions:
  """The taxonomy's settings; the default roles leave out successor on a model without a
  tokenizer (its numbered items are words), as they leave out the IOI roles."""
  roles = opts.roles
  if roles == STEP_ROLES and getattr(loaded.task, "tokenizer", None) is None:
    roles = tuple(r for r in roles if r != "successor")
  return head_taxonomy.ClassifyOptions(roles=roles, top_k=opts.top_k, draws=opts.draws)


def step_scores(at, tax: head_taxonomy.ClassifyOptions, log: Callable[[str], None] = print) -> dict:
  """head_taxonomy.scores of one checkpoint (`at`, a Loaded), with the pattern roles' rows
  from real_lm_roles (repeated random tokens of the run's own vocabulary, 2 x 32 + BOS
  or as many as the window holds)."""
  rows = head_roles.real_lm_roles(at, half_len=head_roles.repeat_half_len(at)) if set(tax.roles) & {
      "previous_token", "induction", "duplicate_token"} else None
  return head_taxonomy.scores(at, tax, rows, log)


def summary(step: int, sc: dict, top: int = 3) -> dict:
  """One step's row: each role's best head and score, its top heads, how many heads
  qualify, and every head's score."""
  out = {"step": step, "best": {}, "top": {}, "qualifying": {}, "scores": sc["lm_roles"]}
  for role, table in sc["lm_roles"].items():
    ranked = sorted(table.items(), key=lambda kv: -kv[1])
    out["best"][role] = {"head": ranked[0][0], "score": ranked[0][1]} if ranked else None
    out["top"][role] = [[h, v] for h, v in ranked[:top]]
    out["qualifying"][role] = len(sc["qualifies"].get(role, []))
  return out


def appearance(by_step: list[dict], thresholds: dict) -> dict:
  """{role: the step from which its best score stays >= its threshold, or None}."""
  return {role: stability.appears_at(
      [(r["step"], (r["best"].get(role) or {}).get("score")) for r in by_step], th)
      for role, th in thresholds.items()}


def default_check_steps(steps: list[int], appears: dict) -> list[int]:
  """The last step, and the steps before, at and after the induction role's appearance."""
  out = {steps[-1]}
  at = appears.get("induction")
  if at is not None:
    i = steps.index(at)
    out |= set(steps[max(0, i - 1):i + 2])
  return sorted(out)


def ioi_refusal(loaded, tax: head_taxonomy.ClassifyOptions) -> str | None:
  """Why the run cannot have the IOI roles (the pairs' refusal), or None."""
  if getattr(loaded.task, "tokenizer", None) is None:
    return "no tokenizer"
  try:
    pairs_lib.ioi_pairs(loaded.task, tax.n_pairs, tax.seed)
  except UserError as e:
    return str(e)
  return None


def _scored_already(path: str, workdir: str, tax: head_taxonomy.ClassifyOptions) -> dict:
  """{step: row} of an earlier role_steps.json in OUT for the same workdir and roles."""
  if not storage.exists(path):
    return {}
  old = storage.read_json(path)
  if old.get("workdir") != workdir or old.get("roles") != list(tax.roles):
    return {}
  return {r["step"]: r for r in old.get("by_step", [])}


def role_steps(loaded, out: str | None = None, opts: RoleStepsOptions = RoleStepsOptions(),
               *, log: Callable[[str], None] = print) -> dict:
  """Every role's scores at each checkpoint of `loaded`'s workdir, the step at which
  each appears, and the causal checks at the check steps; writes OUT/role_steps.json
  and role_steps.png (default WORKDIR/role_steps). A rerun into the same OUT reuses the
  rows of the steps it scored already (same workdir and roles): following a training
  as it runs costs one step's scores per new checkpoint."""
  settings_lib.check(opts)
  if not (loaded.task.decoder_only and loaded.task.trainable):
    loader.refuse("role-steps", loaded.workdir, "a decoder LM trained here (it follows the "
                  "checkpoints of its training)")
  tax = _taxonomy_settings(opts, loaded)
  out_dir = out or storage.join(loaded.workdir, "role_steps")
  storage.makedirs(out_dir)
  t0 = time.perf_counter()
  done = _scored_already(storage.join(out_dir, "role_steps.json"), loaded.workdir, tax)
  by_step, scored = [], {}       # scored: this run's head_taxonomy.scores, for the causal checks
  for at in each_checkpoint(loaded, opts.steps or None):
    if at.step in done:                # a saved checkpoint does not change: reuse its row
      by_step.append(done[at.step])
      continue
    t = time.perf_counter()
    scored[at.step] = step_scores(at, tax, log)
    by_step.append({**summary(at.step, scored[at.step]),
                    "seconds": round(time.perf_counter() - t, 2)})
    log(f"  step {at.step}: " + ", ".join(
        f"{r} {b['score']:.3f}" for r, b in by_step[-1]["best"].items() if b))
  if not by_step:
    raise UserError(f"workdir {loaded.workdir!r} has no good checkpoint", setting="workdir")
  steps = [r["step"] for r in by_step]
  thresholds = {r: tax.thresholds()[r] for r in by_step[-1]["best"]}
  appears = appearance(by_step, thresholds)
  doc = {"workdir": loaded.workdir, "roles": list(tax.roles), "steps": steps,
         "thresholds": thresholds, "appears_at": appears,
         "rule": "a role appears at the first checkpoint from which its best head's "
                 "score is >= its threshold at every later checkpoint",
         "by_step": by_step, "settings": dataclasses.asdict(opts),
         # the scores' seconds: each step's, summed (measured when it was scored)
         "seconds": {"scores": round(sum(r["seconds"] for r in by_step), 1)}}
  refused = ioi_refusal(loaded, tax)
  if refused and not set(head_taxonomy.IOI_ROLES) & set(tax.roles):
    doc["not_asked"] = {",".join(head_taxonomy.IOI_ROLES): refused}
  if set(opts.roles) - set(tax.roles):
    doc.setdefault("not_asked", {})["successor"] = "no tokenizer"
  if opts.causal:
    bad = [s for s in opts.check_steps if s not in steps]
    if bad:
      raise UserError(f"check_steps: {bad[0]} is not a scored step; scored: {steps}",
                      setting="check_steps")
    checks = sorted(set(opts.check_steps)) or default_check_steps(steps, appears)
    t1 = time.perf_counter()
    doc["causal"] = []
    for at in each_checkpoint(loaded, checks):
      log(f"causal checks at step {at.step} ...")
      sc = scored.get(at.step) or step_scores(at, tax, log)   # a reused row: scored again
      doc["causal"].append({"step": at.step, "checks": head_taxonomy.causal(
          at, tax, sc["lm_roles"], sc["inputs"], log)})
    doc["seconds"]["causal"] = round(time.perf_counter() - t1, 1)
  doc["seconds"]["this_run"] = round(time.perf_counter() - t0, 1)   # reused rows excluded
  doc["machine"] = machine()
  storage.write_json(storage.join(out_dir, "role_steps.json"), doc)
  plot(doc, storage.join(out_dir, "role_steps.png"), f"head roles over steps, {loaded.workdir}")
  return doc


def plot(doc: dict, path: str, title: str = "") -> None:
  """One panel per role: its best head's score against step, its threshold dashed, the
  step at which it appears marked."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  from mha_jax.roles import role_scores as roles_lib
  roles = list(doc["thresholds"])
  cols = min(3, len(roles))
  rows = -(-len(roles) // cols)
  fig, axes = plt.subplots(rows, cols, figsize=(3.4 * cols, 2.5 * rows), squeeze=False)
  steps = doc["steps"]
  for ax, role in zip(axes.flat, roles):
    ys = [(r["best"].get(role) or {}).get("score") for r in doc["by_step"]]
    color = roles_lib.ROLE_COLORS.get(role, "#444444")
    ax.plot(steps, [float("nan") if y is None else y for y in ys], "o-", ms=3, color=color)
    ax.axhline(doc["thresholds"][role], ls="--", lw=1, color="#777777")
    at = doc["appears_at"].get(role)
    if at is not None:
      ax.axvline(at, lw=1, color=color, alpha=0.5)
    ax.set_title(f"{role} (appears: {at if at is not None else 'never'})", fontsize=8)
    ax.set_xlabel("step", fontsize=7)
    ax.set_ylabel("best head's score", fontsize=7)
    ax.tick_params(labelsize=7)
  for ax in list(axes.flat)[len(roles):]:
    ax.axis("off")
  fig.suptitle(title, fontsize=9)
  fig.tight_layout()
  storage.savefig(fig, path, dpi=110)
  plt.close(fig)


def format_summary(doc: dict) -> str:
  """Each role's appearance step and its best head at the last step; the causal checks."""
  last = doc["by_step"][-1]
  lines = [f"{'role':18s} {'appears at':>10s}  best at step {last['step']} (threshold)"]
  for role, th in doc["thresholds"].items():
    b = last["best"].get(role)
    at = doc["appears_at"].get(role)
    lines.append(f"{role:18s} {str(at if at is not None else 'never'):>10s}  "
                 f"{b['head']} {b['score']:.3f} ({th})" if b else f"{role:18s} -")
  for c in doc.get("causal", []):
    for role, r in c["checks"].items():
      lines.append(f"step {c['step']:>5d} {role:18s} " + (
          f"effect {r['effect']:+.4f} vs random max {max(r['random']):+.4f}: "
          f"{r['verdict']}" if "effect" in r else f"{r['verdict']} ({r.get('reason', '')})"))
  for roles, why in doc.get("not_asked", {}).items():
    lines.append(f"not asked: {roles}: {why}")
  return "\n".join(lines)
