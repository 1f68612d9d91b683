"""The explorer's patching view: the JSON that `mha-jax patch` wrote, in one page.

The page is the one explorer (mha_jax/assets/explorer.{html,css,js}): it shows a
patching view when the data has "patching", the attention view when it has "weights"
(here: the patterns of the first pairs' clean and corrupt prompts, from the study's own
forward), and both with a switch between them. The patching data is read back from the
files in the output folder, so a committed result gets its page without the model.
"""

from __future__ import annotations

import dataclasses
import html
import json

import numpy as np

from mha_jax import assets, loader, settings, storage
from mha_jax.errors import UserError
from mha_jax.toolkit import activation_patching, pairs as pairs_lib
from mha_jax.toolkit.activation_patching import attention_data, json_finite
from mha_jax.settings import setting

FILES = ("patching", "dla", "attribution", "path")


def _read(out: str, name: str):
  """OUT/NAME.json read (None when absent); one that is not JSON is refused naming it."""
  path = storage.join(out, f"{name}.json")
  if not storage.exists(path):
    return None
  try:
    return json_finite(json.loads(storage.read_text(path)))
  except UnicodeDecodeError:
    raise UserError(f"out: {path} is not a JSON file `mha-jax patch` wrote (not UTF-8 "
                    f"text)", setting="out") from None
  except json.JSONDecodeError as e:
    raise UserError(f"out: {path} is not valid JSON ({e.msg}, line {e.lineno}): not as "
                    f"`mha-jax patch` wrote it; run the patch again", setting="out") from None


def patching_data(out: str) -> dict:
  """{"patching": ..., "dla": ..., "attribution": ..., "path": ...}: the files of a
  `mha-jax patch` folder as they are (those present); refused by name unless the folder
  holds patching.json or dla.json, each valid JSON."""
  if not storage.isdir(out):
    raise UserError(f"out {out!r} is not a folder; give the folder `mha-jax patch` wrote",
                    setting="out")
  found = {name: _read(out, name) for name in FILES}
  if found["patching"] is None and found["dla"] is None:
    raise UserError(f"out {out!r} has no patching.json or dla.json: give a folder "
                    f"`mha-jax patch` wrote", setting="out")
  return {k: v for k, v in found.items() if v is not None}


def rebuilt_study(out: str, loaded):
  """The Study of a written result's pairs on `run` (a `mha_jax.load`): IOI and
  induction pairs made again as `patch` made them (seed 0), a pairs file's pairs from
  their text; refused unless their token ids, lengths and clean logit differences are
  the ones patching.json recorded (another model or other pairs)."""
  doc = _read(out, "patching")
  if doc is None or not doc.get("pairs"):
    raise UserError(f"{out!r} has no patching.json with pairs")
  rec = doc["pairs"]
  if doc.get("task") == "ioi":
    pairs = pairs_lib.ioi_pairs(loaded.task, len(rec), 0)
  elif doc.get("task") == "induction":
    pairs = pairs_lib.induction_pairs(loaded.task, len(rec), seed=0)
  else:
    pairs = pairs_lib.parse_pairs(loaded.task, [json.dumps(
        {f: p[f] for f in ("clean", "corrupt", "answer", "wrong")}) for p in rec],
        f"{out}/patching.json pairs")
  got = [(p["answer_id"], p["wrong_id"], p["length"]) for p in pairs.to_json()]
  if got != [(p["answer_id"], p["wrong_id"], p["length"]) for p in rec]:
    raise UserError(f"the pairs made again on {loaded.workdir!r} are not those of {out!r}")
  study = activation_patching.Study(loaded.task, loaded.params, pairs)
  want = np.asarray([p["ld_clean"] for p in rec])
  if not np.allclose(study.ld_clean, want, atol=1e-2 * max(1.0, float(np.abs(want).max()))):
    raise UserError(f"{loaded.workdir!r} gives other logit differences than {out!r} recorded "
                    f"(another model?)")
  return study


def write(out: str, attention: dict | None = None, title: str | None = None) -> str:
  """Writes out/explorer.html from the patching files in `out` and the attention view's
  data: `attention` when given (then kept as out/attention_view.json, so the page can be
  written again without the model), else that file's when present. Returns its path."""
  view = storage.join(out, "attention_view.json")
  if attention is not None:
    storage.write_json(view, attention)
  else:
    attention = _read(out, "attention_view")
  data = {**(attention or {}), "patching": patching_data(out)}
  path = storage.join(out, "explorer.html")
  doc = data["patching"].get("patching") or data["patching"]["dla"]
  name = title or f"{doc.get('task', '')} on {doc.get('workdir', '')}"
  storage.write_text(path, assets.page("explorer", data, title=html.escape(name)))
  return path


@dataclasses.dataclass(frozen=True, kw_only=True)
class ExplorerOptions:
  """The settings of `rewrite` (`mha-jax patch-explorer`)."""
  attention_pairs: int = setting(2, lo=1, help="with the run: the pairs of the attention "
                                 "view")


def rewrite(loaded, out: str, opts: ExplorerOptions = ExplorerOptions(), *,
            log=print) -> str:
  """(Re)writes OUT/explorer.html from a patching result's JSON files in `out`; with the
  loaded run (or None), the attention view of its first pairs too (checked to be the
  same pairs and model; more pairs asked than the result has: all of them, said in a
  line). Returns the page's path."""
  settings.check(opts)
  out = storage.normpath(out)
  patching_data(out)
  attention = None
  if loaded is not None:
    if not loaded.task.decoder_only:
      loader.refuse("patch-explorer", loaded.workdir, "the decoder LM `mha-jax patch` "
                    "patched")
    study = rebuilt_study(out, loaded)
    if opts.attention_pairs > study.n:
      log(f"--attention-pairs {opts.attention_pairs}: the result has {study.n} pair(s); "
          f"the attention view shows all {study.n}")
    attention = attention_data(study, loaded.task, opts.attention_pairs)
  return write(out, attention)
