"""A self-contained attention explorer page (no network, no CDN).

Pick a sentence, an attention type, a layer and a head; the page shows each query
token's attention row over the keys, shaded by weight, like the figures in the seed
documents. Head buttons are coloured by role. The data sits in the page as JSON; the
page itself is mha_jax/assets/explorer.{html,css,js}.
"""

from __future__ import annotations

import html

import numpy as np

from mha_jax import assets, storage
from mha_jax.toolkit import capture as capture_lib
from mha_jax.roles import role_scores as roles_lib
from mha_jax.data import vocab as vocab_lib
from mha_jax.models import common
from mha_jax.models.common import STACKS




def page_data(loaded, rows, split: str = "test", sentences: int = 20) -> dict:
  """The explorer's JSON: sentences, `weights[sentence][stack][layer][head][query][key]`."""
  roles = {r["head"]: r.get("role", "other") for r in rows}
  is_tr = loaded.task.reports_bleu     # source and target words (TranslationData)
  sents, weights = [], []
  for batch, cap, weight in capture_lib.iter_captures(loaded, split, limit=sentences):
    n = int(weight.sum())
    for b in range(n):
      if is_tr:
        src = np.asarray(batch["src"][b])
        tgt = np.asarray(batch["tgt"][b])[:-1]
        s_len, t_len = int((src != vocab_lib.PAD_ID).sum()), int((tgt != vocab_lib.PAD_ID).sum())
        vocab = loaded.task.vocab
        sents.append({"src": [vocab.tokens[i] for i in src[:s_len]],
                      "tgt": [vocab.tokens[i] for i in tgt[:t_len]]})
        lens = {"encoder": (s_len, s_len), "decoder_self": (t_len, t_len),
                "decoder_cross": (t_len, s_len)}
      else:
        toks = np.asarray(batch["tokens"][b])[:-1]
        sents.append({"tokens": [str(int(i)) for i in toks]})
        lens = {"lm": (len(toks), len(toks))}
      weights.append({stack: [np.round(np.asarray(r.weights[b])[:, :lens[stack][0],
                                                                 :lens[stack][1]], 3).tolist()
                              for _, r in sorted(layers.items())]
                      for stack, layers in cap.items()})
  return {"sentences": sents, "weights": weights, "roles": roles,
          "colors": roles_lib.ROLE_COLORS,
          "stacks": [s for s in STACKS if weights and s in weights[0]]}


def real_page_data(loaded, rows, split: str = "test", sentences: int = 2, max_tokens: int = 20,
                   half_len: int = 10) -> dict:
  """The explorer's JSON for an imported model (LLaMA LM or BERT encoder): `sentences`
  pieces of the built-in text cut to max_tokens tokens (and, for an LM, one sequence of
  repeated random tokens), tokens shown as the tokenizer's strings, weights to 2 places
  (SmolLM2's 270 heads stay well under 5 MB)."""
  from mha_jax.toolkit import head_masks
  model = loaded.task
  roles = {r["head"]: r.get("role", "other") for r in rows}
  batches = []
  for batch, _weight in model.eval_batches(split, max(sentences, 1)):
    cut = {k: np.asarray(v)[:sentences, :max_tokens + 1] for k, v in batch.items()}
    batches.append(cut)
    break
  if model.decoder_only:
    tokens, _ = model.repeated_tokens(7_000_003, 1, half_len)
    batches.append({"tokens": tokens})
  sents, weights = [], []
  for batch in batches:
    cap = capture_lib.captured(model, loaded.params, batch)
    stack = "lm" if "lm" in cap else "encoder"
    toks = np.asarray(batch["tokens"])
    for b in range(len(toks)):
      ids = toks[b, :-1] if stack == "lm" else toks[b][np.asarray(batch["mask"])[b]]
      n = len(ids)
      sents.append({"tokens": [model.tokenizer.decode([int(i)]) or f"<{int(i)}>"
                               for i in ids]})
      weights.append({stack: [np.round(np.asarray(r.weights[b])[:, :n, :n], 2).tolist()
                              for r in cap[stack]]})
  mask = head_masks.read_head_mask(loaded.workdir)
  pruned = ([n for n in common.head_names(loaded.params) if n not in set(head_masks.kept_names(mask))]
            if mask else [])
  return {"sentences": sents, "weights": weights, "roles": roles,
          "colors": roles_lib.ROLE_COLORS,
          "stacks": [s for s in STACKS if weights and s in weights[0]], "pruned": pruned}


def write(loaded, rows, path: str, split: str = "test", sentences: int = 20) -> dict:
  if not loaded.task.trainable:       # an imported model: its tokenizer's strings
    data = real_page_data(loaded, rows, split, min(sentences, 2))
  else:
    data = page_data(loaded, rows, split, sentences)
  storage.write_text(path, assets.page("explorer", data, title=html.escape(loaded.workdir)))
  return data
