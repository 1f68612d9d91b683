"""Parallel text the user brings: one sentence per line, optional CoNLL-U for the source."""

from __future__ import annotations


from mha_jax.errors import UserError
from mha_jax import storage


def read_lines(path: str, what: str) -> list[list[str]]:
  """Whitespace-tokenized lines of a UTF-8 file; errors name the config field."""
  if not path or not storage.isfile(path):
    raise UserError(f"{what}: no such file {path!r}")
  try:
    lines = [l.split() for l in storage.read_text(path).splitlines()]
  except UnicodeDecodeError as e:
    raise UserError(f"{what}: {path!r} is not UTF-8 text (byte {e.start}: {e.reason})"
                    ) from None
  if not any(lines):
    raise UserError(f"{what}: file {path!r} is empty")
  for i, l in enumerate(lines):
    if not l:
      raise UserError(f"{what}: line {i + 1} of {path!r} is empty")
  return lines


def _check_tree(heads: list[int], where: str) -> None:
  """1-based heads (0 = root) form a tree: a root, and no token its own ancestor."""
  if 0 not in heads:
    raise UserError(f"{where} has no root (no token with head 0)")
  for start in range(1, len(heads) + 1):
    path, node = [start], heads[start - 1]
    while node != 0:
      if node in path:
        loop = path[path.index(node):] + [node]
        raise UserError(f"{where}: the heads form a cycle (tokens "
                        f"{' -> '.join(map(str, loop))}), not a tree")
      path.append(node)
      node = heads[node - 1]


def read_conllu_arcs(path: str, sentences: list[list[str]] | None, what: str
                     ) -> list[dict[str, list]]:
  """Gold arcs from a CoNLL-U file whose tokens match `sentences` one to one (None: the
  file's own sentences, whatever they are).

  Returns per sentence {"heads": 0-based head index or -1, "rels": relation}; the
  relation's subtype is dropped (nsubj:pass -> nsubj).
  """
  return read_conllu(path, sentences, what)[1]


def read_conllu(path: str, sentences: list[list[str]] | None, what: str
                ) -> tuple[list[list[str]], list[dict[str, list]]]:
  """(words, arcs) per sentence of a CoNLL-U file, parsed once; see read_conllu_arcs."""
  import conllu
  if not storage.isfile(path):
    raise UserError(f"{what}: no such file {path!r}")
  try:
    parsed = conllu.parse(storage.read_text(path))
  except UnicodeDecodeError as e:
    raise UserError(f"{what}: {path!r} is not UTF-8 text (byte {e.start}: {e.reason})"
                    ) from None
  except conllu.exceptions.ParseException as e:
    raise UserError(f"{what}: {path!r} is not valid CoNLL-U ({e})") from None
  if not parsed:
    raise UserError(f"{what}: {path!r} holds no sentence")
  if sentences is None:
    sentences = [[t["form"] for t in tl if isinstance(t["id"], int)] for tl in parsed]
  if len(parsed) != len(sentences):
    raise UserError(f"{what}: {path!r} has {len(parsed)} sentences, the source file "
                     f"{len(sentences)}")
  out = []
  for n, (tl, words) in enumerate(zip(parsed, sentences)):
    toks = [t for t in tl if isinstance(t["id"], int)]
    forms = [t["form"] for t in toks]
    if forms != words:
      raise UserError(f"{what}: sentence {n + 1} of {path!r} has tokens {forms[:8]}..., "
                       f"the source line {words[:8]}...")
    for t in toks:
      if not isinstance(t["head"], int) or not 0 <= t["head"] <= len(toks):
        raise UserError(f"{what}: sentence {n + 1} of {path!r}, token {t['id']} "
                        f"({t['form']!r}): head {t['head']!r} is not a token of the "
                        f"sentence (0..{len(toks)})")
    _check_tree([int(t["head"]) for t in toks], f"{what}: sentence {n + 1} of {path!r}")
    out.append({"heads": [int(t["head"]) - 1 for t in toks],
                "rels": [str(t["deprel"]).split(":")[0] for t in toks]})
  return sentences, out
