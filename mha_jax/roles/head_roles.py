"""Every head's role statistics and role for a loaded run, by its task: the capture of
toolkit.capture scored by roles.role_scores' detectors (what `mha-jax analyze` reports and
the pruning curve and the claims read)."""

from __future__ import annotations

from typing import Callable

import numpy as np

from mha_jax import storage
from mha_jax.data import vocab
from mha_jax.toolkit import capture as capture_lib
from mha_jax.roles import role_scores, syntax


def _rarest(words: list[str], freqs: dict[str, int]) -> int:
  return int(np.argmin([freqs.get(w, 0) for w in words]))


def translation_roles(loaded, split: str, limit: int = 0,
                      th: role_scores.Thresholds = role_scores.Thresholds()) -> list[dict]:
  """Role statistics of the encoder's and the decoder's self-attention heads."""
  task = loaded.task
  freqs_path = storage.join(loaded.workdir, "data", "train_freqs.json")
  freqs = storage.read_json(freqs_path)
  max_len = loaded.config.data.max_len + 1
  stats = {}
  arcs_all = task.arcs.get(split)
  src_words = task.words[split][0]
  offset = 0
  for batch, cap, weight in capture_lib.iter_captures(
      loaded, split, stacks=("encoder", "decoder_self"), limit=limit):
    n = int(weight.sum())
    idx = range(offset, offset + n)
    src = np.asarray(batch["src"])[:n]
    lengths = ((src != vocab.PAD_ID) & (src != vocab.EOS_ID)).sum(1)
    arcs = [arcs_all[i] for i in idx] if arcs_all else None
    rarest = np.array([_rarest(src_words[i], freqs) for i in idx])
    for stack in ("encoder", "decoder_self"):
      if stack not in stats:   # head counts as captured (pruned layers may differ)
        heads = [np.asarray(cap[stack][l].weights).shape[1] for l in sorted(cap[stack])]
        stats[stack] = role_scores.RoleStats(len(heads), heads, max_len)
    enc = cap["encoder"]
    stats["encoder"].update([np.asarray(enc[l].weights)[:n] for l in sorted(enc)], lengths,
                            arcs, rarest)
    tgt = np.asarray(batch["tgt"])[:n, :-1]
    t_len = ((tgt != vocab.PAD_ID) & (tgt != vocab.EOS_ID)).sum(1)
    dec = cap["decoder_self"]
    stats["decoder_self"].update([np.asarray(dec[l].weights)[:n] for l in sorted(dec)],
                                 t_len, None, None)
    offset += n
  rows = stats["encoder"].results("encoder", th)
  for r in stats["decoder_self"].results("decoder_self", th):
    r["role"] = "positional" if r["positional_share"] >= th.positional else "other"
    rows.append(r)
  return rows


def lm_roles(loaded, split: str, limit: int = 256, threshold: float = 0.4) -> list[dict]:
  sums, n = {}, 0
  for batch, cap, _weight in capture_lib.iter_captures(loaded, split, stacks=("lm",), limit=limit):
    tokens = np.asarray(batch["tokens"])[:, :-1]
    for layer, r in cap["lm"].items():
      s = role_scores.lm_scores(np.asarray(r.weights), tokens)
      acc = sums.setdefault(layer, {k: 0 for k in s})
      for k, v in s.items():
        acc[k] = acc[k] + v
    n += 1
  rows = []
  for layer in sorted(sums):
    for h in range(len(sums[layer]["induction"])):
      row = {"head": f"lm.{layer}.{h}", "stack": "lm", "layer": layer, "index": h,
             **{k: float(v[h] / n) for k, v in sums[layer].items()}}
      best = max(role_scores.LM_ROLES, key=lambda k: row[k])
      row["role"] = best if row[best] >= threshold else "other"
      rows.append(row)
  return rows


def repeat_half_len(loaded, most: int = 32) -> int:
  """The half length n of [BOS] r_1..r_n r_1..r_n that fits the model's window (at most
  `most`): a toy model of 13 positions gets 6."""
  return max(1, min(most, (int(loaded.config.model.max_len) - 1) // 2))


def real_lm_roles(loaded, split: str = "test", *, batches: int = 2, batch_size: int = 8,
                  half_len: int = 32, text_windows: int = 8, threshold: float = 0.4,
                  sink: float = 0.8, seed: int = 7_000_003,
                  memory_budget: int | None = None) -> list[dict]:
  """Roles of every head of an LM over a real tokenizer (mha_jax.load of an imported
  model). On `batches` x `batch_size` sequences of repeated random tokens over the model's
  own vocabulary with its BOS ([BOS] r_1..r_n r_1..r_n, n = half_len): previous-token,
  duplicate-token and induction scores (lm_scores). On `text_windows` windows of the
  built-in text (split): the attention-sink share (weight on the first token) and the
  mean entropy. Role: the largest of the three scores if >= threshold, else
  "attention_sink" if the sink share >= sink, else "other". memory_budget (bytes): each
  batch captured capture.plan's sequences at a time (the same captures)."""
  sums, n = {}, 0
  for i in range(batches):
    tokens, _ = loaded.task.repeated_tokens(seed + i, batch_size, half_len)
    batch = {"tokens": tokens}
    rows = None if memory_budget is None else capture_lib.plan(
        loaded.task, loaded.params, batch, memory_budget).rows_per_batch
    cap = capture_lib.captured_rows(loaded.task, loaded.params, batch, rows=rows)
    for layer, r in enumerate(cap["lm"]):
      acc = sums.setdefault(layer, {})
      for k, v in role_scores.lm_scores(np.asarray(r.weights), tokens[:, :-1]).items():
        acc[k] = acc.get(k, 0) + v
    n += 1
  text = sink_and_entropy(loaded, split, windows=text_windows, memory_budget=memory_budget)
  rows = []
  for layer in sorted(sums):
    t = text[layer]
    for h in range(len(sums[layer]["induction"])):
      row = {"head": f"lm.{layer}.{h}", "stack": "lm", "layer": layer, "index": h,
             **{k: float(v[h] / n) for k, v in sums[layer].items()},
             "sink_share": float(t["sink_share"][h]), "entropy": float(t["entropy"][h])}
      best = max(role_scores.LM_ROLES, key=lambda k: row[k])
      row["role"] = (best if row[best] >= threshold else
                     "attention_sink" if row["sink_share"] >= sink else "other")
      rows.append(row)
  return rows


def sink_and_entropy(loaded, split: str = "test", *, windows: int = 8,
                     batch_size: int | None = None, memory_budget: int | None = None
                     ) -> dict[int, dict[str, np.ndarray]]:
  """{layer: {"sink_share": (H,), "entropy": (H,), "off_keys": (H,)}} of a decoder's
  heads on the first `windows` windows of its text (split): the mean weight on the first
  token over real queries 1.. (role_scores.first_token_share), the mean entropy in nats over
  real queries (role_scores.entropy) and the mean weight on no key, 1 - the row's sum over real
  queries 1.. (variant="sink": the sink logit's weight; 0 for softmax).
  batch_size: the run's eval batch size by default; memory_budget: iter_captures'."""
  text = {}
  for batch, cap, weight in capture_lib.iter_captures(
      loaded, split, stacks=("lm",), batch_size=batch_size or loaded.config.eval.batch_size,
      limit=windows, memory_budget=memory_budget):
    valid = np.broadcast_to(weight[:, None] > 0, np.asarray(batch["tokens"])[:, :-1].shape)
    for layer, r in cap["lm"].items():
      acc = text.setdefault(layer, {"sink": 0, "entropy": 0, "off": 0, "n": 0, "n_sink": 0})
      w = np.asarray(r.weights)
      acc["sink"] = acc["sink"] + role_scores.first_token_share(w, valid) * valid[:, 1:].sum()
      acc["entropy"] = acc["entropy"] + role_scores.entropy(w, valid) * valid.sum()
      q = valid[:, None, 1:]                                     # queries 1..
      acc["off"] = acc["off"] + ((1.0 - w.sum(-1, dtype=np.float64))[:, :, 1:] * q).sum((0, 2))
      acc["n"] += valid.sum()
      acc["n_sink"] += valid[:, 1:].sum()
  return {layer: {"sink_share": t["sink"] / max(t["n_sink"], 1),
                  "entropy": t["entropy"] / max(t["n"], 1),
                  "off_keys": t["off"] / max(t["n_sink"], 1)} for layer, t in text.items()}


def embedding_roles(loaded, split: str = "test", limit: int = 0,
                    th: role_scores.Thresholds = role_scores.Thresholds(), special: float = 0.5,
                    conllu: str | None = None) -> list[dict]:
  """Roles of every encoder head of a BERT encoder on paragraphs of the built-in text:
  Voita et al.'s positional (90 % rule) and rare-token statistics over the real tokens
  ([CLS] and [SEP] included as positions; the rarest token is the least frequent
  wordpiece of the train split, [CLS]/[SEP] excluded), and the attention on [CLS] and on
  [SEP]. Role: positional > syntactic > cls > sep > rare > other ("cls"/"sep" when that
  share >= `special`). Syntactic needs arcs: with `conllu` (a CoNLL-U file of input
  sentences) each head's dependency accuracy is measured on those sentences, words
  aligned to wordpieces (roles.syntax), and a head is syntactic by the translation
  models' rule; without it no head is syntactic."""
  syn = syntax.conllu_syntax(loaded, conllu, th) if conllu else {}
  task = loaded.task
  freqs = np.zeros(task.vocab_size, np.int64)
  for ids in task.tokenizer.encode_batch(task.paragraphs()["train"]):
    np.add.at(freqs, ids, 1)
  stats, special_sums, n_q = None, {}, 0
  for batch, cap, weight in capture_lib.iter_captures(loaded, split, stacks=("encoder",),
                                                      limit=limit):
    n = int(weight.sum())
    lengths = np.asarray(batch["mask"]).sum(1)[:n]
    tok = np.asarray(batch["tokens"])[:n]
    rarest = np.array([1 + int(np.argmin(freqs[tok[b, 1:max(lengths[b] - 1, 2)]]))
                       for b in range(n)])
    enc = cap["encoder"]
    if stats is None:
      heads = [np.asarray(enc[l].weights).shape[1] for l in sorted(enc)]
      stats = role_scores.RoleStats(len(heads), heads, int(loaded.config.eval.seq_len))
    ws = [np.asarray(enc[l].weights)[:n] for l in sorted(enc)]
    stats.update(ws, lengths, None, rarest)
    q = int(lengths.sum())
    for l, w in enumerate(ws):
      for k, v in role_scores.special_token_shares(w, lengths).items():
        special_sums.setdefault(l, {}).setdefault(k, 0)
        special_sums[l][k] = special_sums[l][k] + v * q
    n_q += q
  rows = stats.results("encoder", th)
  for r in rows:
    if syn:
      r.update(syn[r["head"]])
      r["role"] = role_scores.assign_role(r, th)
    for k in ("cls_share", "sep_share"):
      r[k] = float(special_sums[r["layer"]][k][r["index"]] / max(n_q, 1))
    if r["role"] in ("rare", "other"):
      if r["cls_share"] >= special:
        r["role"] = "cls"
      elif r["sep_share"] >= special:
        r["role"] = "sep"
  return rows


def head_roles(loaded, split: str = "test", limit: int = 0, *, conllu: str | None = None
               ) -> list[dict]:
  """Every head's role statistics and role, by the run's task (the one dispatch)."""
  family = loaded.task.role_family
  if family == "translation":
    return translation_roles(loaded, split, limit)
  if family == "embedding":
    return embedding_roles(loaded, split, limit, conllu=conllu)
  if family == "real_lm":
    return real_lm_roles(loaded, split)
  return lm_roles(loaded, split)


def saved_or_head_roles(loaded, split: str = "test", log: Callable[[str], None] = print
                        ) -> list[dict]:
  """The rows of the run's analysis/heads.json when `analyze` wrote one, else
  head_roles(loaded, split) computed now."""
  path = storage.join(loaded.workdir, "analysis", "heads.json")
  if storage.exists(path):
    return storage.read_json(path)
  log("roles: analysing the dense model first ...")
  return head_roles(loaded, split)


def role_of(rows: list[dict]) -> dict[str, str]:
  """head name -> role ("other" where a row has none)."""
  return {r["head"]: r.get("role", "other") for r in rows}
