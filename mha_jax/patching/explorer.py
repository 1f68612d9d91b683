"""The explorer's patching view: the JSON that `mha-jax patch` wrote, in one page.

The page is the one explorer (mha_jax/assets/explorer.{html,css,js}): it shows a
patching view when the data has "patching", the attention view when it has "weights"
(here: the patterns of the first pairs' clean and corrupt prompts, from the study's own
forward), and both with a switch between them. The patching data is read back from the
files in the output folder, so a committed result gets its page without the model.
"""

from __future__ import annotations

import html
import json
import os

import numpy as np

from mha_jax import assets, storage
from mha_jax.analysis import roles as roles_lib

FILES = ("patching", "dla", "attribution", "path")


def _finite(x):
  """NaN and infinities as None (JSON.parse refuses them)."""
  if isinstance(x, float):
    return x if np.isfinite(x) else None
  if isinstance(x, dict):
    return {k: _finite(v) for k, v in x.items()}
  if isinstance(x, list):
    return [_finite(v) for v in x]
  return x


def _read(out: str, name: str):
  path = storage.join(out, f"{name}.json")
  if not storage.exists(path):
    return None
  return _finite(json.loads(storage.read_text(path)))


def patching_data(out: str) -> dict:
  """{"patching": ..., "dla": ..., "attribution": ..., "path": ...}: the files of a
  `mha-jax patch` folder as they are (those present)."""
  found = {name: _read(out, name) for name in FILES}
  if found["patching"] is None and found["dla"] is None:
    raise ValueError(f"out must be a folder `mha-jax patch` wrote (patching.json or "
                     f"dla.json); got {out!r}")
  return {k: v for k, v in found.items() if v is not None}


def _token_strings(task, ids) -> list[str]:
  tok = getattr(task, "tokenizer", None)
  if tok is None:
    return [str(int(i)) for i in ids]
  return [tok.decode([int(i)]) or f"<{int(i)}>" for i in ids]


def attention_data(study, task, pairs: int = 2, digits: int = 2) -> dict:
  """The attention view's JSON for the first `pairs` pairs, clean and corrupt prompts:
  `weights[sentence]["lm"][layer][head][query][key]` from the study's own forward
  (the `lm.{i}.attn.pattern` sites)."""
  n = min(pairs, study.n)
  read = [f"lm.{i}.attn.pattern" for i in range(study.layers)]
  sents, weights = [], []
  for run in ("clean", "corrupt"):
    vals = study.values(run, read)
    ids = np.asarray(study.pairs.clean if run == "clean" else study.pairs.corrupt)
    for b in range(n):
      t = int(study.pairs.length[b])
      sents.append({"tokens": _token_strings(task, ids[b, :t]), "label": f"pair {b} {run}"})
      weights.append({"lm": [np.round(np.asarray(vals[s][b], np.float64)[:, :t, :t],
                                      digits).tolist() for s in read]})
  order = [i for b in range(n) for i in (b, n + b)]     # pair 0 clean, pair 0 corrupt, ...
  return {"sentences": [sents[i] for i in order], "weights": [weights[i] for i in order],
          "stacks": ["lm"], "roles": {}, "colors": roles_lib.ROLE_COLORS}


def write(out: str, attention: dict | None = None, title: str | None = None) -> str:
  """Writes out/explorer.html from the patching files in `out` (and the attention
  view's data when given); returns its path."""
  data = {**(attention or {}), "patching": patching_data(out)}
  path = storage.join(out, "explorer.html")
  doc = data["patching"].get("patching") or data["patching"]["dla"]
  name = title or f"{doc.get('task', '')} on {doc.get('workdir', '')}"
  storage.write_text(path, assets.page("explorer", data, title=html.escape(name)))
  return path


def main(argv=None) -> int:
  """python -m mha_jax.patching.explorer DIR...: (re)writes DIR/explorer.html from the
  JSON files alone (no model: the page has no attention view)."""
  import sys
  for out in (argv if argv is not None else sys.argv[1:]):
    print(write(os.path.normpath(out)))
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
