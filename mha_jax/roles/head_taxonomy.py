"""Every head of a decoder LM named by what it does, and each name checked causally.

`classify(loaded, rows, settings)` scores every head for each role (roles.detectors;
previous-token, induction and duplicate-token from the existing `rows` of
head_roles.real_lm_roles), assigns each head its first qualifying role in ROLES' order, and
checks every role causally: the role's top-k heads are mean-ablated together (their z
replaced by their mean over text windows, through the interventions) against `draws`
sets of k random heads drawn from the same layers (never a tested head, no head twice),
and the role's own behaviour must suffer more than under every random draw:

  previous_token, induction     the loss on the repeated half of repeated random tokens
  duplicate_token, name_mover,  IOI's logit difference logit(IO) - logit(S) (drops;
  s_inhibition                  negative_name_mover: rises)
  successor                     logit(successor) - logit(item) after three items of an
                                ordinal sequence
  copy_suppression              the logits of the tokens earlier in a text window
                                (centred on the mean logit): rise when ablated
  retrieval                     needle recall (teacher-forced)
  attention_sink                the text loss when the heads' weight on key 0 (the sink's
                                key) is set to 0 (not renormalised), against the same
                                edit of random heads

The IOI roles follow Wang et al. 2022 through patching.activation_patching.Study: name movers by their
DLA on logit(IO) - logit(S) (as a share of the clean logit difference) and attention
from the end to the IO larger than to S; negative name movers the same with negative
DLA; S-inhibition heads by path patching into the queries of the top-k heads that
qualify as name movers (`receivers`: never a negative head or one attending to S; none
qualifying: no S-inhibition score), the recovery summed over those receivers, from the
`senders` heads below them that attribution patching ranks highest (the others are not
path-patched: NaN, no score).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from mha_jax import interventions
from mha_jax import storage
from mha_jax.machine import machine
from mha_jax.roles import bootstrap, detectors
from mha_jax.toolkit import memory
from mha_jax.roles import role_scores as roles_lib
from mha_jax.errors import UserError
from mha_jax.models import common
from mha_jax.toolkit.importance import random_draws

# Assignment order: a head takes the first role it qualifies for.
ROLES = ("name_mover", "negative_name_mover", "s_inhibition", "successor",
         "copy_suppression", "retrieval", "induction", "duplicate_token", "previous_token",
         "attention_sink")
IOI_ROLES = ("name_mover", "negative_name_mover", "s_inhibition")
DEFAULT_ROLES = tuple(r for r in ROLES if r != "retrieval")    # retrieval only when asked
# The behaviour each role's causal check measures, and whether ablation should raise it.
BEHAVIOUR = {"previous_token": ("repeat_loss", +1), "induction": ("repeat_loss", +1),
             "duplicate_token": ("ioi_logit_diff", -1), "name_mover": ("ioi_logit_diff", -1),
             "negative_name_mover": ("ioi_logit_diff", +1),
             "s_inhibition": ("ioi_logit_diff", -1), "successor": ("successor_logit", -1),
             "copy_suppression": ("context_logit", +1), "retrieval": ("needle_recall", -1),
             "attention_sink": ("text_loss", +1)}


@dataclasses.dataclass(frozen=True)
class ClassifyOptions:
  """The taxonomy's settings (one name and one check each)."""
  roles: tuple = DEFAULT_ROLES   # roles to compute (retrieval only when named)
  top_k: int = 3                 # heads per role in the causal check
  draws: int = 5                 # random head sets per role
  seed: int = 0                  # the random draws' seed
  n_pairs: int = 8               # IOI pairs
  senders: int = 24              # S-inhibition: senders path-patched (screened by AtP)
  repeat_batch: int = 4          # sequences of repeated random tokens (2 x 32 + BOS, or
                                 # as many as the window holds)
  text_windows: int = 2          # windows of the built-in text (sink, copy suppression)
  text_len: int = 128            # tokens per text window
  mean_windows: int = 4          # text windows (the first ones) the ablation means average
  frequent: int = 200            # frequent tokens for the OV self-logit check
  retrieval_len: int = 384       # tokens of a needle-in-a-haystack input
  depths: tuple = (0.25, 0.5, 0.75)   # where the needle sits in the haystack
  pattern_threshold: float = 0.4      # previous-token, induction, duplicate-token
  sink_threshold: float = 0.8         # attention share on key 0
  successor_threshold: float = 0.5    # succession score
  copy_threshold: float = 1.0         # copy-suppression z-score (and ov_self < 0)
  name_mover_threshold: float = 0.1   # |DLA| / clean logit difference
  s_inhibition_threshold: float = 0.05  # path-patching recovery into the name movers
  retrieval_threshold: float = 0.1    # copy-paste score (Wu et al.)
  memory_budget: int | None = None    # bytes each program (detector, check) may hold:
                                      # `plan` (None: every row at once)
  bootstrap_windows: int = 0          # text roles also scored on this many windows spread
                                      # over the split, qualifying by the bootstrap
                                      # interval (roles.bootstrap; 0: off)
  bootstrap_draws: int = 2000         # bootstrap resamples
  bootstrap_level: float = 0.9        # two-sided interval level

  def __post_init__(self):
    roles = tuple(self.roles)
    bad = [r for r in roles if r not in ROLES]
    if bad or not roles:
      raise UserError(f"roles must be a non-empty subset of {', '.join(ROLES)}; got "
                      f"{','.join(map(str, roles)) or 'nothing'}")
    object.__setattr__(self, "roles", roles)
    for name in ("top_k", "draws", "n_pairs", "senders", "repeat_batch", "text_windows",
                 "mean_windows", "frequent"):
      if int(getattr(self, name)) < 1:
        raise UserError(f"{name} must be >= 1; got {getattr(self, name)}")
    if self.bootstrap_windows < 0 or self.bootstrap_draws < 1:
      raise UserError(f"bootstrap_windows must be >= 0 and bootstrap_draws >= 1; got "
                      f"{self.bootstrap_windows}, {self.bootstrap_draws}")
    if not 0.0 < self.bootstrap_level < 1.0:
      raise UserError(f"bootstrap_level must be in (0, 1); got {self.bootstrap_level}")
    if self.text_len < 3:
      raise UserError(f"text_len must be >= 3; got {self.text_len}")
    if not self.depths or any(not 0.0 <= float(d) <= 1.0 for d in self.depths):
      raise UserError(f"depths must be fractions in [0, 1]; got {self.depths}")

  def thresholds(self) -> dict:
    return {"previous_token": self.pattern_threshold, "induction": self.pattern_threshold,
            "duplicate_token": self.pattern_threshold, "attention_sink": self.sink_threshold,
            "successor": self.successor_threshold, "copy_suppression": self.copy_threshold,
            "name_mover": self.name_mover_threshold,
            "negative_name_mover": self.name_mover_threshold,
            "s_inhibition": self.s_inhibition_threshold,
            "retrieval": self.retrieval_threshold}


def parse_roles(text: str | None) -> tuple:
  """"a,b" -> ("a", "b"); None or "" -> DEFAULT_ROLES (checked by ClassifyOptions)."""
  if not text:
    return DEFAULT_ROLES
  return tuple(r.strip() for r in text.split(",") if r.strip())


# ------------------------------------------------------------------ heads and random draws

def head_list(params) -> list[str]:
  return common.head_names(params)


def _masks(params, heads: Sequence[str]) -> list[jax.Array]:
  """Per layer, a (H,) boolean mask of `heads` ("lm.l.h")."""
  counts = common.head_counts(params)["lm"]
  m = [np.zeros(h, bool) for h in counts]
  for n in heads:
    _, l, h = n.split(".")
    m[int(l)][int(h)] = True
  return [jnp.asarray(x) for x in m]


def mean_edits(params, heads: Sequence[str], means: Sequence) -> dict:
  """{lm.l.attn.z: replace by the mean (H, K) where the layer's mask holds}: one edit per
  layer whatever the heads, so every set of heads runs the same compiled program."""
  return {f"lm.{l}.attn.z": interventions.replace(jnp.asarray(means[l], jnp.float32), heads=m)
          for l, m in enumerate(_masks(params, heads))}


def text_means(task, params, tokens_BT) -> list[np.ndarray]:
  """Per layer, (H, K): each head's z averaged over the tokens' positions (B, T + 1)."""
  n = len(common.layers_of(params["lm"]))
  read = tuple(f"lm.{i}.attn.z" for i in range(n))
  vals = jax.jit(lambda p, t: interventions.run_with_hook(lambda hook: task.apply(p, {"tokens": t}, hook=hook),
                                    read=read)[1])(params, jnp.asarray(tokens_BT))
  return [np.asarray(vals[r], np.float64).mean((0, 1)) for r in read]


def sink_edits(params, heads: Sequence[str]) -> dict:
  """{lm.l.attn.pattern: the weight on key 0 set to 0 where the layer's mask holds}."""
  return {f"lm.{l}.attn.pattern": interventions.scale(0.0, heads=m, key_positions=0)
          for l, m in enumerate(_masks(params, heads))}


# ------------------------------------------------------------------ behaviours

def _text_tokens(task, n: int, length: int) -> np.ndarray:
  batch, _ = next(iter(task.eval_batches("test", n)))
  tok = np.asarray(batch["tokens"])[:n, :length + 1]
  if tok.shape[1] < 3:
    raise UserError(f"text_len: the model's evaluation windows have {tok.shape[1]} tokens")
  return tok


def role_ioi_pairs(task, n: int, seed: int, role: str):
  """n IOI pairs (toolkit.pairs.ioi_pairs) for `role`; a model that cannot make them is
  refused naming the role."""
  from mha_jax.toolkit import pairs as pairs_lib
  try:
    return pairs_lib.ioi_pairs(task, n, seed)
  except UserError as e:
    raise UserError(f"role {role}: {e}") from None


def _successor_prompts(ids_by_seq):
  """(tokens (N, 4) of [item i, i+1, i+2] + the answer, answer (N,), item (N,))."""
  rows, ans, cur = [], [], []
  for ids in ids_by_seq.values():
    for i in range(len(ids) - 3):
      rows.append(list(ids[i:i + 4]))
      ans.append(ids[i + 3])
      cur.append(ids[i + 2])
  return np.asarray(rows, np.int32), np.asarray(ans), np.asarray(cur)


def model_shapes(loaded, t: int) -> memory.PatchShapes:
  """The shapes a forward of t tokens holds (memory.PatchShapes, one row), traced from
  the model's own sites (nothing compiles)."""
  task, params = loaded.task, loaded.params
  sites = ("lm.0.attn.z", "lm.0.attn.k", "lm.0.resid_pre")
  tok = jax.ShapeDtypeStruct((1, t + 1), jnp.int32)
  vals = jax.eval_shape(lambda p, x: interventions.run_with_hook(
      lambda hook: task.apply(p, {"tokens": x}, hook=hook), None, sites)[1], params, tok)
  z, k = vals["lm.0.attn.z"], vals["lm.0.attn.k"]
  heads = common.head_counts(params)["lm"]
  d = int(vals["lm.0.resid_pre"].shape[-1])
  return memory.PatchShapes(layers=len(heads), heads=max(heads), kv_heads=int(k.shape[2]),
                            head_dim=int(z.shape[3]), d_model=d,
                            d_mlp=memory.mlp_width(params, d), vocab=int(task.vocab_size),
                            t=t, pairs=1, dtype_bytes=memory.dtype_bytes(params))


# behaviour -> (the inputs it reads, whether its logits are at every position)
CHECKS = {"repeat_loss": ("repeat", True), "ioi_logit_diff": ("ioi", False),
          "successor_logit": ("successor", False), "context_logit": ("text", True),
          "text_loss": ("text", True)}


def _check_rows(inputs: dict) -> dict[str, tuple[int, int]]:
  """{behaviour: (rows, positions each row runs)} of the causal checks' inputs (the
  forward reads tokens[:, :-1]; successor prompts may take a BOS: counted)."""
  out = {}
  for name, (key, _) in CHECKS.items():
    if key not in inputs:
      continue
    x, extra = inputs[key], -1
    if key == "repeat":
      x = x[0]
    elif key == "ioi":
      x, extra = x.clean, 0
    elif key == "successor":
      x, extra = _successor_prompts(x)[0], 0
    out[name] = (int(np.shape(x)[0]), int(np.shape(x)[1]) + extra)
  return out


def plan(loaded, inputs: dict, budget: int) -> dict[str, memory.RowsPlan]:
  """{program: memory.RowsPlan}: the rows per batch of every program the taxonomy runs
  on `inputs` in `budget` bytes, chosen from the shapes before anything compiles; a
  budget below one row of any is refused, naming the minimum. The causal checks (CHECKS:
  their inputs' rows, logits at every position or one) and the detectors: "text"
  (B, T + 1) windows: attention_sink (every layer's float32 pattern kept) and
  copy_suppression (every layer's pattern and head results, and one layer's effects on
  the key tokens and on COPY_SAMPLE tokens); "embeddings" N: effective_embeddings (N
  tokens on [BOS, token]); "needle": retrieval (one input at a time, its attention rows
  at the answer positions kept)."""
  out = {}
  for name, (rows, t) in _check_rows(inputs).items():
    every = CHECKS[name][1]
    out[name] = memory.rows_plan(model_shapes(loaded, t), rows, budget,
                                 logits_positions=t if every else 1,
                                 kept_per_row=4 * t * t if name == "context_logit" else 0,
                                 what=f"one row of the {name} check")
  out.update(_detector_plan(loaded, inputs, budget))
  return out


COPY_SAMPLE = 256    # vocab_sample's tokens: copy suppression's z-score reference
EMBEDDED = 256       # the effective embeddings planned per batch at most (frequent tokens,
                     # an ordinal sequence's items)


def _detector_plan(loaded, inputs: dict, budget: int) -> dict[str, memory.RowsPlan]:
  """The detectors' part of `plan`."""
  out = {}

  def rows_of(name, t, rows, kept, positions):
    return memory.rows_plan(model_shapes(loaded, t), rows, budget, kept_per_row=kept,
                            logits_positions=positions, what=f"one row of the {name} detector")
  if "text" in inputs:
    rows, t = int(np.shape(inputs["text"])[0]), int(np.shape(inputs["text"])[1]) - 1
    sh = model_shapes(loaded, t)
    pat = 4 * sh.layers * sh.heads * t * t
    res = 4 * sh.layers * t * sh.heads * sh.d_model
    out["attention_sink"] = rows_of("attention_sink", t, rows, pat, t)
    out["copy_suppression"] = rows_of("copy_suppression", t, rows,
                                      pat + res + 4 * sh.heads * t * (t + COPY_SAMPLE), t)
  if "embeddings" in inputs:
    t = len(detectors.bos_of(loaded.task)) + 1
    out["effective_embeddings"] = rows_of("effective_embeddings", t, int(inputs["embeddings"]),
                                          0, t)
  if "needle" in inputs:
    nd = inputs["needle"]
    t, n = int(np.shape(nd["tokens"])[1]) - 1, int(nd["len"])
    sh = model_shapes(loaded, t)
    out["retrieval"] = rows_of("retrieval", t, 1, 4 * sh.layers * sh.heads * n * t, n)
  return out


def detector_rows(loaded, settings: "ClassifyOptions", inputs: dict) -> dict[str, int | None]:
  """{program: rows per batch} of `plan` in settings.memory_budget ({} without one: every
  row at once)."""
  if settings.memory_budget is None:
    return {}
  return {k: v.rows_per_batch for k, v in plan(loaded, inputs, settings.memory_budget).items()}


def _by_rows(fn, arrays: tuple, rows: int):
  """fn(p, edits, *row_arrays, weight) -> (numerator, denominator) summed over a batch of
  rows; returns g(p, edits) -> their ratio over every row, `rows` at a time
  (memory.map_rows: padding rows weigh 0)."""
  def run(p, edits):
    num, den = memory.map_rows(lambda *c: fn(p, edits, *c), arrays, rows)
    return num.sum() / den.sum()
  return run


def behaviours(loaded, settings: ClassifyOptions, inputs: dict,
               budget: int | None = None) -> dict[str, Callable]:
  """{behaviour name: fn(edits) -> float}, each one compiled program over the inputs,
  their rows `plan(loaded, inputs, budget)`'s rows per batch at a time (None: all at once)."""
  out = {}
  for name, fn in check_programs(loaded, inputs, budget).items():
    if name == "needle_recall":
      out[name] = fn
    else:
      out[name] = lambda edits, j=jax.jit(fn): float(j(loaded.params, edits))
  return out


def check_programs(loaded, inputs: dict, budget: int | None = None) -> dict[str, Callable]:
  """{behaviour name: fn(params, edits) -> scalar} (not compiled; `needle_recall`: a
  run function) over the inputs, `plan`'s rows per batch at a time (None: all at once);
  what `behaviours` compiles and `mha-jax plan --job taxonomy` compiles for a target."""
  task, params = loaded.task, loaded.params
  rows = {k: v.rows_per_batch for k, v in plan(loaded, inputs, budget).items()} \
      if budget is not None else {k: r for k, (r, _) in _check_rows(inputs).items()}
  out = {}

  def compiled(name, fn, *arrays):
    return _by_rows(fn, arrays, rows[name])

  def fwd(p, tok, edits, **batch):
    return interventions.run_with_hook(lambda hook: task.apply(p, {"tokens": tok, **batch}, hook=hook), edits)[0]

  def ld_of(lg, a, w):
    r = jnp.arange(lg.shape[0])
    return lg[r, a] - lg[r, w]

  if "repeat" in inputs:
    def repeat_loss(p, edits, tok, mask, wt):
      logp = jax.nn.log_softmax(fwd(p, tok, edits).astype(jnp.float32), -1)
      nll = -jnp.take_along_axis(logp, tok[:, 1:, None], -1)[..., 0]
      return (nll * mask * wt[:, None]).sum(), (mask * wt[:, None]).sum()
    out["repeat_loss"] = compiled("repeat_loss", repeat_loss, *inputs["repeat"])
  if "ioi" in inputs:
    pairs = inputs["ioi"]
    tok = np.concatenate([pairs.clean, pairs.clean[:, -1:]], 1)

    def ioi(p, edits, tok, at, a, w, wt):
      lg = fwd(p, tok, edits, logits_at=at)[:, 0].astype(jnp.float32)
      return (ld_of(lg, a, w) * wt).sum(), wt.sum()
    out["ioi_logit_diff"] = compiled("ioi_logit_diff", ioi, tok, pairs.length - 1,
                                     pairs.answer, pairs.wrong)
  if "successor" in inputs:
    tok, ans, cur = (np.asarray(x) for x in _successor_prompts(inputs["successor"]))
    bos = detectors.bos_of(task)
    if bos:
      tok = np.concatenate([np.full((tok.shape[0], 1), bos[0], tok.dtype), tok], 1)

    def succ(p, edits, tok, ans, cur, wt):
      lg = fwd(p, tok, edits)[:, -1].astype(jnp.float32)
      return (ld_of(lg, ans, cur) * wt).sum(), wt.sum()
    out["successor_logit"] = compiled("successor_logit", succ, tok, ans, cur)
  if "text" in inputs:
    out.update(_text_checks(fwd, compiled, np.asarray(inputs["text"])))
  if "needle" in inputs:
    nd = inputs["needle"]
    prog = detectors.retrieval_program(task, params, nd["tokens"], nd["start"], nd["answer"],
                                       nd["len"])
    out["needle_recall"] = lambda edits, prog=prog: prog(edits)[1]
  return out


def plan_programs(loaded, rows: int, seq: int, budget: int,
                  settings: ClassifyOptions = ClassifyOptions()) -> list[tuple[str, Callable, tuple, int]]:
  """[(name, fn, args, rows per batch)] of the causal checks at `rows` rows of `seq` tokens each (the
  repeated tokens, the text windows and the IOI pairs all of that shape), each with
  settings.top_k heads mean-ablated, and of the detectors on those text windows (sink,
  copy suppression on COPY_SAMPLE tokens) and on every ordinal item (the effective
  embeddings), from the params' shapes alone (loaded.params may be ShapeDtypeStructs;
  `mha-jax plan --job taxonomy` compiles them for a target)."""
  from mha_jax.toolkit.pairs import Pairs
  tok = np.ones((rows, seq + 1), np.int32)
  z = np.zeros(rows, np.int32)
  items = sum(len(v) for v in detectors.ORDINAL_SEQUENCES.values())
  inputs = {"repeat": (tok, np.ones((rows, seq), np.float32)), "text": tok,
            "ioi": Pairs(tok[:, :seq], tok[:, :seq], z, z + 1, np.full(rows, seq, np.int32),
                         [{}] * rows), "embeddings": items}
  sh = model_shapes(loaded, seq)
  means = [np.zeros((h, sh.head_dim), np.float32) for h in common.head_counts(loaded.params)["lm"]]
  edits = mean_edits(loaded.params, head_list(loaded.params)[:settings.top_k], means)
  rows_of = {k: v.rows_per_batch for k, v in plan(loaded, inputs, budget).items()}
  checks = [(f"taxonomy_{name}", fn, (loaded.params, edits), rows_of[name])
            for name, fn in check_programs(loaded, inputs, budget).items()]
  task, layers = loaded.task, len(common.layers_of(loaded.params["lm"]))
  sample = np.arange(COPY_SAMPLE)
  found = [("attention_sink", detectors.sink_program(task, layers, rows_of["attention_sink"]),
            tok),
           ("copy_suppression", detectors.copy_suppression_program(
               task, layers, sample, rows_of["copy_suppression"]), tok),
           ("effective_embeddings", detectors.embeddings_program(
               task, rows_of["effective_embeddings"]),
            detectors.embedding_tokens(task, np.ones(items, np.int32)))]
  return checks + [(f"taxonomy_detector_{name}", fn, (loaded.params, t), rows_of[name])
                   for name, fn, t in found]


def _text_checks(fwd, compiled, text) -> dict[str, Callable]:
  """context_logit and text_loss over text windows (see `behaviours`)."""
  t = text.shape[1] - 1
  earlier = (jnp.arange(t)[None, :] >= 1) & (jnp.arange(t)[None, :] < jnp.arange(t)[:, None])
  m = earlier[None] & (jnp.arange(t) >= 2)[None, :, None]

  def context_logit(p, edits, tok, wt):
    inp = tok[:, :-1]
    lg = fwd(p, tok, edits).astype(jnp.float32)                    # (B, T, V)
    got = jnp.take_along_axis(lg, jnp.broadcast_to(inp[:, None, :], lg.shape[:2] + (t,)), -1)
    cen = got - lg.mean(-1, keepdims=True)                          # (B, T, T)
    # as before the chunking: every row's sum over one row's count of the mask
    return (cen * m * wt[:, None, None]).sum(), m.sum() * wt.sum() / text.shape[0]

  def text_loss(p, edits, tok, wt):
    logp = jax.nn.log_softmax(fwd(p, tok, edits).astype(jnp.float32), -1)
    nll = -jnp.take_along_axis(logp, tok[:, 1:, None], -1)[..., 0]
    return (nll * wt[:, None]).sum(), wt.sum() * t
  return {"context_logit": compiled("context_logit", context_logit, text),
          "text_loss": compiled("text_loss", text_loss, text)}


# ------------------------------------------------------------------ IOI roles

def name_movers(dla_share, attn_io, attn_s, threshold: float, sign: int = 1) -> np.ndarray:
  """(L, H_max) bool: Wang et al.'s name movers (sign +1: DLA share >= threshold) or
  negative name movers (sign -1: DLA share <= -threshold), each attending from the end
  more to the IO than to S (NaN, past a layer's heads: never)."""
  d = np.nan_to_num(sign * np.asarray(dla_share, np.float64), nan=-np.inf)
  with np.errstate(invalid="ignore"):
    return (d >= threshold) & (np.asarray(attn_io) > np.asarray(attn_s))


def receivers(dla_share, attn_io, attn_s, threshold: float, k: int) -> list[tuple[int, int]]:
  """S-inhibition's receivers: the top k name movers (`name_movers`, sign +1) by DLA
  share, as (layer, head); fewer where fewer qualify, [] where none does. Never a head
  with negative DLA or one that attends to S more than to the IO."""
  m = name_movers(dla_share, attn_io, attn_s, threshold)
  order = np.argsort(-np.where(m, np.asarray(dla_share, np.float64), -np.inf), axis=None,
                     kind="stable")[:k]
  return [tuple(int(x) for x in np.unravel_index(f, m.shape)) for f in order if m.flat[f]]


def ioi_scores(loaded, settings: ClassifyOptions, pairs, log=print) -> dict[str, np.ndarray]:
  """{"dla_share", "attn_io", "attn_s", "s_inhibition": (L, H_max), "receivers": [...]}:
  each head's DLA on logit(IO) - logit(S) over the clean logit difference, its attention
  from the end to the IO and to S (both mentions), and the path-patching recovery (clean
  into corrupt) through the queries of the top name movers (`receivers`), summed over
  them. Without a name mover (or with every one in layer 0), S-inhibition has no path
  to score: all NaN."""
  from mha_jax.toolkit import activation_patching
  budget = {} if settings.memory_budget is None else {"memory_budget": settings.memory_budget}
  s = activation_patching.Study(loaded.task, loaded.params, pairs, **budget)
  dla = s.dla("clean")["heads"] / max(abs(float(np.mean(s.ld_clean))), 1e-9)
  read = tuple(f"lm.{i}.attn.pattern" for i in range(s.layers))
  vals = s.values("clean", read)
  n = len(pairs)
  last = pairs.length - 1
  io = np.array([int(np.argmax(pairs.clean[i] == pairs.answer[i])) for i in range(n)])
  smask = pairs.clean == pairs.wrong[:, None]                          # (N, T)
  attn_io = np.full(dla.shape, np.nan)
  attn_s = np.full(dla.shape, np.nan)
  for i, r in enumerate(read):
    w = np.asarray(vals[r], np.float64)[np.arange(n), :, last]         # (N, H, S)
    attn_io[i, :w.shape[1]] = np.take_along_axis(
        w, io[:, None, None].repeat(w.shape[1], 1), -1)[..., 0].mean(0)
    attn_s[i, :w.shape[1]] = (w * smask[:, None, :w.shape[2]]).sum(-1).mean(0)
  recv = receivers(dla, attn_io, attn_s, settings.name_mover_threshold, settings.top_k)
  out = {"dla_share": dla, "attn_io": attn_io, "attn_s": attn_s,
         "receivers": [f"lm.{a}.{b}" for a, b in recv],
         "ld_clean": float(np.mean(s.ld_clean)), "ld_corrupt": float(np.mean(s.ld_corrupt))}
  if not recv:
    log("  s_inhibition: no name mover (DLA share >= "
        f"{settings.name_mover_threshold} attending to the IO more than to S): no receiver")
    return {**out, "s_inhibition": np.full(dla.shape, np.nan)}
  # Senders: the `senders` heads below the last receiver with the largest attribution
  # (AtP, one forward and one backward) of their z; the rest stay NaN (not screened in).
  atp = np.abs(s.attribution(("z",))["z"]["heads"])
  below = np.arange(dla.shape[0])[:, None] < max(a for a, _ in recv)
  ranked = np.argsort(-np.nan_to_num(np.where(below, atp, np.nan), nan=-1.0), axis=None)
  send = [tuple(int(x) for x in np.unravel_index(f, dla.shape)) for f in ranked
          if below[np.unravel_index(f, dla.shape)[0], 0] and np.isfinite(atp.flat[f])]
  if not send:        # every receiver in layer 0: nothing sits below them
    log("  s_inhibition: every name mover is in layer 0: no sender below them")
    return {**out, "s_inhibition": np.full(dla.shape, np.nan)}
  pp = s.path_patch(recv, "q", senders=send[:settings.senders])["recovery"]  # (L, H, R)
  return {**out, "s_inhibition": np.nansum(pp, -1) + np.where(np.isnan(pp[..., 0]), np.nan, 0.0)}


# ------------------------------------------------------------------ the taxonomy

def _table(arr, counts) -> dict[str, float]:
  return {f"lm.{l}.{h}": round(float(arr[l, h]), 6) for l, n in enumerate(counts)
          for h in range(n) if np.isfinite(arr[l, h])}


def _needs_tokenizer(loaded, role: str) -> None:
  if getattr(loaded.task, "tokenizer", None) is None:
    raise UserError(f"role {role} needs a model with a tokenizer (an imported LM, or one "
                    f"trained on text); this run has task {loaded.task.name!r}")


def _ioi_inputs(loaded, settings: ClassifyOptions, want: Sequence[str]) -> dict:
  """{"ioi": IOI pairs} for the IOI roles (refused by name where the model cannot have
  them) and duplicate-token's check. Duplicate-token's score is the attention's; only
  its check needs the pairs: a model without them (no single-token names: a model of
  Python code) keeps the score, and the check is reported as not run, with the reason
  ({"unchecked": {"duplicate_token": why}})."""
  if set(IOI_ROLES) & set(want):
    role = next(r for r in IOI_ROLES if r in want)
    _needs_tokenizer(loaded, role)
    return {"ioi": role_ioi_pairs(loaded.task, settings.n_pairs, settings.seed, role)}
  if "duplicate_token" not in want:
    return {}
  try:
    _needs_tokenizer(loaded, "duplicate_token")
    return {"ioi": role_ioi_pairs(loaded.task, settings.n_pairs, settings.seed, "duplicate_token")}
  except UserError as e:
    return {"unchecked": {"duplicate_token": str(e)}}


def scores(loaded, settings: ClassifyOptions, rows: Sequence[Mapping] | None, log=print) -> dict:
  """{"lm_roles": {role: {head: score}}, "qualifies": {role: [heads]}, "seconds",
  "extra", "inputs"} for settings.roles (see the module docstring)."""
  task, params = loaded.task, loaded.params
  counts = common.head_counts(params)["lm"]
  th = settings.thresholds()
  want = settings.roles
  out: dict = {}
  ok: dict = {}
  sec: dict = {}
  extra: dict = {}
  inputs: dict = {}
  by_head = {r["head"]: r for r in rows or ()}
  for role in ("previous_token", "induction", "duplicate_token"):
    if role in want:
      if not by_head or role not in next(iter(by_head.values())):
        raise UserError(f"role {role}: needs the existing role rows (rows=, from "
                        f"head_roles.real_lm_roles)")
      out[role] = {h: round(float(r[role]), 6) for h, r in by_head.items()}
  if {"previous_token", "induction"} & set(want):
    if not hasattr(task, "repeated_tokens"):
      raise UserError("roles previous_token, induction: their causal check needs repeated "
                      "random tokens of the model's own vocabulary (an imported LM)")
    from mha_jax.roles.head_roles import repeat_half_len
    tok, m = task.repeated_tokens(settings.seed + 7_000_003, settings.repeat_batch,
                                  repeat_half_len(loaded))
    from mha_jax.data import repeated_tokens as rt
    inputs["repeat"] = (tok, rt.position_masks(m, tok.shape[1] - 1)["repeat"])
  inputs["text"] = _text_tokens(task, settings.text_windows, settings.text_len)
  rows_of = detector_rows(loaded, settings, {"text": inputs["text"], "embeddings": EMBEDDED})
  if "attention_sink" in want:
    t0 = time.perf_counter()
    out["attention_sink"] = _table(detectors.sink_scores(
        task, params, inputs["text"], rows_of.get("attention_sink")), counts)
    sec["attention_sink"] = time.perf_counter() - t0
  if "successor" in want:
    _needs_tokenizer(loaded, "successor")
    t0 = time.perf_counter()
    arr, ids = detectors.successor_scores(task, params,
                                          rows=rows_of.get("effective_embeddings"))
    out["successor"] = _table(arr, counts)
    inputs["successor"] = ids
    extra["successor_sequences"] = {k: len(v) for k, v in ids.items()}
    sec["successor"] = time.perf_counter() - t0
  if "copy_suppression" in want:
    t0 = time.perf_counter()
    out["copy_suppression"], extra["ov_self"] = _copy_suppression(
        loaded, settings, inputs["text"], rows_of, counts)
    ok["copy_suppression"] = [h for h, v in out["copy_suppression"].items()
                              if v >= th["copy_suppression"] and extra["ov_self"][h] < 0]
    sec["copy_suppression"] = time.perf_counter() - t0
  inputs.update(_ioi_inputs(loaded, settings, want))
  if set(IOI_ROLES) & set(want):
    t0 = time.perf_counter()
    ioi = ioi_scores(loaded, settings, inputs["ioi"], log)
    for role, arr, sign in (("name_mover", ioi["dla_share"], 1),
                            ("negative_name_mover", -ioi["dla_share"], -1)):
      if role in want:
        out[role] = _table(arr, counts)
        ok[role] = list(_table(np.where(name_movers(
            ioi["dla_share"], ioi["attn_io"], ioi["attn_s"], th[role], sign), 1.0, np.nan),
            counts))
    if "s_inhibition" in want:
      out["s_inhibition"] = _table(ioi["s_inhibition"], counts)
    extra["ioi"] = {"attn_io": _table(ioi["attn_io"], counts),
                    "attn_s": _table(ioi["attn_s"], counts), "receivers": ioi["receivers"],
                    "ld_clean": ioi["ld_clean"], "ld_corrupt": ioi["ld_corrupt"],
                    "pairs": len(inputs["ioi"])}
    sec["ioi"] = time.perf_counter() - t0
  if "retrieval" in want:
    t0 = time.perf_counter()
    nd = needle(loaded, settings)
    detector_rows(loaded, settings, {"needle": nd})     # one input at a time: refused if not
    arr, recall = detectors.retrieval_scores(task, params, nd["tokens"], nd["start"], nd["answer"],
                                     nd["len"])
    out["retrieval"] = _table(arr, counts)
    inputs["needle"] = nd
    extra["needle_recall"] = recall
    sec["retrieval"] = time.perf_counter() - t0
  for role, table in out.items():
    ok.setdefault(role, [h for h, v in table.items() if v >= th[role]])
  return {"lm_roles": out, "qualifies": ok, "seconds": sec, "extra": extra, "inputs": inputs}


def _copy_suppression(loaded, settings: ClassifyOptions, text, rows_of: dict, counts
                      ) -> tuple[dict, dict]:
  """({head: copy-suppression score}, {head: OV self-logit z}) on the text windows, the
  rows per batch of rows_of (detector_rows)."""
  task, params = loaded.task, loaded.params
  cs = detectors.copy_suppression_text(task, params, text, vocab_sample(
      task, settings.seed, COPY_SAMPLE), rows_of.get("copy_suppression"))
  freq = detectors.frequent_tokens(text, settings.frequent, _specials(task))
  ov = detectors.ov_self_scores(params, detectors.effective_embeddings(
      task, params, freq, rows_of.get("effective_embeddings")), freq)
  return _table(cs, counts), _table(ov, counts)


def needle(loaded, settings: ClassifyOptions) -> dict:
  """The needle-in-a-haystack inputs (refused where the window is too short)."""
  task = loaded.task
  detectors.check_window(task, settings.retrieval_len)
  _needs_tokenizer(loaded, "retrieval")
  nd = [int(i) for i in task.tokenizer.encode(detectors.NEEDLE)]
  qd = [int(i) for i in task.tokenizer.encode(detectors.QUESTION)]
  tok, start, ans = detectors.needle_inputs(task, task.stream("test"), settings.retrieval_len,
                                    settings.depths, nd, qd)
  return {"tokens": tok, "start": start, "answer": ans, "len": len(nd)}


def _specials(task) -> list[int]:
  return [int(i) for i in task.special_ids()] if hasattr(task, "special_ids") else []


def vocab_sample(task, seed: int, n: int = COPY_SAMPLE) -> np.ndarray:
  rng = np.random.default_rng(seed + 11)
  pool = np.setdiff1d(np.arange(task.vocab_size), np.asarray(_specials(task), np.int64))
  return np.sort(rng.choice(pool, min(n, len(pool)), replace=False))


def assign(heads: Sequence[str], qualifies: Mapping[str, Sequence[str]]) -> dict[str, str]:
  """head -> the first role of ROLES it qualifies for, else "other"."""
  sets = {r: set(v) for r, v in qualifies.items()}
  return {h: next((r for r in ROLES if h in sets.get(r, ())), "other") for h in heads}


def causal(loaded, settings: ClassifyOptions, table: Mapping[str, Mapping[str, float]],
           inputs: dict, log=print) -> dict:
  """{role: {"top", "scores", "behaviour", "base", "ablated", "effect", "random",
  "random_heads", "verdict"}} (the module docstring's checks)."""
  params = loaded.params
  heads = head_list(params)
  fns = behaviours(loaded, settings, inputs, settings.memory_budget)
  means = text_means(loaded.task, params, _text_tokens(loaded.task, settings.mean_windows,
                                                    settings.text_len))
  base_cache: dict = {}
  out = {}
  for role, scores_ in table.items():
    name, sign = BEHAVIOUR[role]
    if role in inputs.get("unchecked", {}):
      out[role] = {"behaviour": name, "verdict": "not run",
                   "reason": inputs["unchecked"][role]}
      log(f"  {role}: not run ({inputs['unchecked'][role]})")
      continue
    if not scores_:     # S-inhibition without a name mover to receive it: no head to test
      out[role] = {"top": [], "scores": [], "behaviour": name, "verdict": "fails",
                   "reason": "no head has a score"}
      log(f"  {role}: no head has a score: fails")
      continue
    fn = fns[name]
    edits_of = (lambda hs: sink_edits(params, hs)) if role == "attention_sink" else \
        (lambda hs: mean_edits(params, hs, means))
    if name not in base_cache:
      base_cache[name] = fn(edits_of([]))
    base = base_cache[name]
    t0 = time.perf_counter()
    top = [h for h, _ in sorted(scores_.items(), key=lambda kv: -kv[1])[:settings.top_k]]
    eff = sign * (fn(edits_of(top)) - base)
    draws = random_draws(top, heads, settings.draws, settings.seed)
    rand = [sign * (fn(edits_of(d)) - base) for d in draws]
    verdict = "holds" if eff > 0 and eff > max(rand) else "fails"
    out[role] = {"top": top, "scores": [scores_[h] for h in top], "behaviour": name,
                 "ablation": "sink key removed" if role == "attention_sink" else "mean",
                 "direction": "rises" if sign > 0 else "drops", "base": base,
                 "effect": eff, "random": rand, "random_heads": draws,
                 "random_mean": float(np.mean(rand)), "random_std": float(np.std(rand)),
                 "verdict": verdict, "seconds": time.perf_counter() - t0}
    log(f"  {role}: top {top} effect {eff:+.4f} vs random {np.mean(rand):+.4f} "
        f"(max {max(rand):+.4f}): {verdict}")
  return out


def classify(loaded, rows: Sequence[Mapping] | None = None, settings: ClassifyOptions = ClassifyOptions(),
             log: Callable[[str], None] = print, check: bool = True,
             on_scores: Callable[[dict], None] | None = None) -> dict:
  """The roles.json document: "lm_roles", "thresholds", "assigned", "counts", "causal",
  "seconds" (per detector and per causal check), "extra" (second checks), "machine"
  (mha_jax.machine.machine(), when the document was written).
  on_scores(doc) is called before the causal checks (to save the scores early)."""
  if not loaded.task.decoder_only:
    raise UserError(f"the head taxonomy is for decoder LMs; this run has task "
                    f"{loaded.task.name!r}")
  log("taxonomy: scores ...")
  sc = scores(loaded, settings, rows, log)
  heads = head_list(loaded.params)
  boot = text_bootstrap(loaded, settings, sc, heads, log)
  assigned = assign(heads, sc["qualifies"])
  counts: dict[str, int] = {}
  for r in assigned.values():
    counts[r] = counts.get(r, 0) + 1
  doc = {"roles": list(settings.roles), "lm_roles": sc["lm_roles"],
         "thresholds": {r: settings.thresholds()[r] for r in sc["lm_roles"]},
         "assigned": assigned, "counts": counts, "qualifies": sc["qualifies"],
         "extra": sc["extra"], "seconds": {"detectors": sc["seconds"]},
         "settings": {k: list(v) if isinstance(v, tuple) else v
                      for k, v in dataclasses.asdict(settings).items()}}
  if boot is not None:
    doc["bootstrap"] = boot
  if settings.memory_budget is not None:
    planned = plan(loaded, {**{k: v for k, v in sc["inputs"].items() if k != "unchecked"},
                            "embeddings": EMBEDDED}, settings.memory_budget)
    doc["memory_budget"] = {"bytes": settings.memory_budget,
                            "plan": {k: dataclasses.asdict(v) for k, v in planned.items()}}
  if on_scores is not None:
    on_scores({**doc, "machine": machine()})
  if check:
    log("taxonomy: causal checks ...")
    t0 = time.perf_counter()
    doc["causal"] = causal(loaded, settings, sc["lm_roles"], sc["inputs"], log)
    doc["seconds"]["causal"] = time.perf_counter() - t0
  doc["machine"] = machine()
  return doc


def text_bootstrap(loaded, settings: ClassifyOptions, sc: dict, heads, log=print
                   ) -> dict | None:
  """With settings.bootstrap_windows, the text roles scored (roles.bootstrap.stability)
  and their qualifying heads in sc["qualifies"] replaced by those whose interval clears
  the threshold (the point score's kept as "qualifies_point"); else None."""
  roles = [r for r in bootstrap.TEXT_ROLES if r in sc["lm_roles"]]
  if not settings.bootstrap_windows or not roles:
    return None
  log(f"taxonomy: bootstrap of {', '.join(roles)} over {settings.bootstrap_windows} windows")
  t0 = time.perf_counter()
  out = bootstrap.stability(loaded.task, loaded.params, heads, settings.thresholds(),
                            sc["lm_roles"], sc["extra"].get("ov_self"),
                            vocab_sample(loaded.task, settings.seed),
                            settings.bootstrap_windows, settings.text_len,
                            settings.bootstrap_draws, settings.bootstrap_level,
                            settings.seed, roles, log)
  for r in roles:
    out["roles"][r]["qualifies_point"] = sc["qualifies"][r]
    sc["qualifies"][r] = out["roles"][r]["qualifies"]
  sc["seconds"]["bootstrap"] = time.perf_counter() - t0
  return out


def merge(doc: dict, new: dict) -> dict:
  """doc with new's roles added (or replaced): their scores, thresholds, qualifying
  heads, causal checks (the two runs' causal seconds added), second checks, detector
  seconds and bootstrap intervals; the assignment and counts recomputed over every
  role; new's settings and machine under "merged"."""
  out = {**doc, "lm_roles": {**doc["lm_roles"], **new["lm_roles"]},
         "thresholds": {**doc["thresholds"], **new["thresholds"]},
         "qualifies": {**doc["qualifies"], **new["qualifies"]},
         "extra": {**doc["extra"], **new["extra"]},
         "seconds": {**doc["seconds"], "detectors": {**doc["seconds"]["detectors"],
                                                     **new["seconds"]["detectors"]}}}
  out["roles"] = [r for r in ROLES if r in out["lm_roles"]]
  if "causal" in new:
    out["causal"] = {**doc.get("causal", {}), **new["causal"]}
    out["seconds"]["causal"] = doc["seconds"].get("causal", 0.0) + new["seconds"]["causal"]
  if "bootstrap" in new:     # new's text roles by their intervals, doc's others kept
    out["bootstrap"] = {**new["bootstrap"], "roles": {
        **doc.get("bootstrap", {}).get("roles", {}), **new["bootstrap"]["roles"]}}
  out["assigned"] = assign(list(doc["assigned"]), out["qualifies"])
  out["counts"] = {}
  for r in out["assigned"].values():
    out["counts"][r] = out["counts"].get(r, 0) + 1
  out["merged"] = [*doc.get("merged", []), {k: new[k] for k in (
      "roles", "settings", "machine", "seconds") if k in new}]
  return out


def colors() -> dict[str, str]:
  """Every role's colour: roles.ROLE_COLORS, the explorer's too."""
  return dict(roles_lib.ROLE_COLORS)


def plot(doc: dict, path: str, title: str = "") -> None:
  """The taxonomy figure: a layer x head grid coloured by each head's assigned role."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  cols = colors()
  cells = [(int(h.split(".")[1]), int(h.split(".")[2]), r) for h, r in doc["assigned"].items()]
  n_l = max(c[0] for c in cells) + 1
  n_h = max(c[1] for c in cells) + 1
  fig, ax = plt.subplots(figsize=(1.6 + 0.45 * n_h, 1.2 + 0.22 * n_l))
  for l, h, r in cells:
    ax.add_patch(plt.Rectangle((h, l), 0.95, 0.95, color=cols.get(r, "#c7c7c7")))
  ax.set_xlim(0, n_h)
  ax.set_ylim(n_l, 0)
  ax.set_xlabel("head")
  ax.set_ylabel("layer")
  used = [r for r in (*ROLES, "other") if any(c[2] == r for c in cells)]
  ax.legend([plt.Rectangle((0, 0), 1, 1, color=cols.get(r, "#c7c7c7")) for r in used],
            [f"{r} ({doc['counts'].get(r, 0)})" for r in used], loc="upper left",
            bbox_to_anchor=(1.02, 1), fontsize=7)
  ax.set_title(title, fontsize=9)
  fig.tight_layout()
  storage.savefig(fig, path, dpi=110)
  plt.close(fig)


def write(doc: dict, out_dir: str, title: str = "") -> None:
  """roles.json and taxonomy.png into out_dir."""
  storage.makedirs(out_dir)
  storage.write_json(storage.join(out_dir, "roles.json"), doc)
  plot(doc, storage.join(out_dir, "taxonomy.png"), title)


def format_summary(doc: dict) -> str:
  """Top-3 heads per role, the counts, and each causal check, as text."""
  lines = [f"counts: {doc['counts']}"]
  for role, table in doc["lm_roles"].items():
    top = sorted(table.items(), key=lambda kv: -kv[1])[:3]
    lines.append(f"{role:20s} top: " + ", ".join(f"{h} {v:.3f}" for h, v in top))
  for role, c in doc.get("causal", {}).items():
    if "effect" not in c:
      lines.append(f"{role:20s} causal: {c['verdict']} ({c.get('reason', '')})")
      continue
    lines.append(f"{role:20s} causal: effect {c['effect']:+.4f} vs random "
                 f"{c['random_mean']:+.4f} +- {c['random_std']:.4f} -> {c['verdict']}")
  return "\n".join(lines)
