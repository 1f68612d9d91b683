"""Prompt pairs for causal studies: IOI, induction, and the user's JSONL file.

A pair is a clean and a corrupt prompt of the same token length, an answer token and a
wrong token; the metric is the logit difference logit(answer) - logit(wrong) at the
prompt's last position. Pairs of different lengths are right-padded (with the last
token): causal attention keeps the padding out of every earlier position.
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np

from mha_jax import storage, traces
from mha_jax.errors import UserError

# Common first names; the IOI task keeps those that are one token (with their leading
# space) in the model's vocabulary.
NAMES = ("John", "Mary", "Tom", "James", "Dan", "Sid", "Martin", "Amy", "Paul", "Kate",
         "Anne", "Mark", "Laura", "Jane", "Mike", "Sarah", "David", "Lisa", "Peter", "Emma",
         "Alex", "Chris", "Ben", "Sam", "Jack", "Lucy", "Adam", "Rose", "George", "Alice",
         "Henry", "Grace", "Ryan", "Kevin", "Steve", "Emily", "Daniel", "Anna", "Susan", "Joe")
# {A} is the indirect object (the answer), {B} the subject, {S} its second mention.
IOI_TEMPLATES = (
    "When {A} and {B} went to the store, {S} gave a drink to",
    "When {A} and {B} went to the park, {S} gave a ball to",
    "After {A} and {B} went to the office, {S} gave a book to",
    "Then, {A} and {B} had a long argument, and afterwards {S} said to",
    "While {A} and {B} were working at the house, {S} passed a key to",
    "Friends {A} and {B} found a bone at the garden. {S} gave it to",
)


@dataclasses.dataclass
class Pairs:
  """N prompt pairs, right-padded to T tokens.

  clean, corrupt: (N, T) int32; answer, wrong: (N,) token ids; length: (N,) prompt
  lengths (the metric reads the logits at length - 1); text: one dict per pair.
  """
  clean: np.ndarray
  corrupt: np.ndarray
  answer: np.ndarray
  wrong: np.ndarray
  length: np.ndarray
  text: list

  def __len__(self) -> int:
    return len(self.answer)

  def subset(self, rows) -> "Pairs":
    """The pairs at `rows` (a sequence of indices), in that order."""
    rows = np.asarray(rows, np.int64)
    return Pairs(self.clean[rows], self.corrupt[rows], self.answer[rows], self.wrong[rows],
                 self.length[rows], [self.text[i] for i in rows])

  def to_json(self) -> list[dict]:
    return [{**t, "answer_id": int(a), "wrong_id": int(w), "length": int(n)}
            for t, a, w, n in zip(self.text, self.answer, self.wrong, self.length)]


def task_tokenizer(task):
  """The task's tokenizer; a UserError (setting task) when the model has none."""
  tok = getattr(task, "tokenizer", None)
  if tok is None:
    raise UserError("this model has no tokenizer (a run on repeated random tokens): use "
                    "task induction", setting="task")
  return tok


def encode(task, text: str) -> list[int]:
  """The model's token ids of a prompt (its BOS first when its tokenizer adds one)."""
  task_tokenizer(task)
  return traces.prompt_ids(task, text)


def single_token(task, text: str) -> int | None:
  """The id of `text` when it is exactly one token of the model's vocabulary, else None."""
  ids = [int(i) for i in task_tokenizer(task).encode(text)]
  return ids[0] if len(ids) == 1 else None


def pack_pairs(rows: list[tuple[list[int], list[int], int, int, dict]]) -> Pairs:
  """Pairs from rows (clean ids, corrupt ids, answer, wrong, meta), each padded to the
  longest with its last token: clean and corrupt (N, T) int32."""
  n = len(rows)
  t = max(len(r[0]) for r in rows)
  clean = np.zeros((n, t), np.int32)
  corrupt = np.zeros((n, t), np.int32)
  for i, (c, x, _, _, _) in enumerate(rows):
    clean[i] = c + [c[-1]] * (t - len(c))
    corrupt[i] = x + [x[-1]] * (t - len(x))
  return Pairs(clean, corrupt, np.asarray([r[2] for r in rows], np.int32),
               np.asarray([r[3] for r in rows], np.int32),
               np.asarray([len(r[0]) for r in rows], np.int32), [r[4] for r in rows])


def ioi_names(task) -> list[str]:
  """The NAMES that are single tokens (" Name") of the model's vocabulary."""
  return [n for n in NAMES if single_token(task, " " + n) is not None]


def ioi_pairs(task, n: int = 8, seed: int = 0) -> Pairs:
  """Indirect-object identification pairs (Wang et al. 2022).

  clean:   "When Mary and John went to the store, John gave a drink to" -> " Mary"
  corrupt: the subject swapped, "..., Mary gave a drink to" (which now points at John)
  answer " Mary", wrong " John" in both; names are single tokens of the vocabulary,
  templates taken in turn.
  """
  if n < 1:
    raise UserError(f"n_pairs must be >= 1; got {n}", setting="n_pairs")
  names = ioi_names(task)
  if len(names) < 2:
    raise UserError(f"the IOI task needs two names that are single tokens of this "
                    f"model's vocabulary; only {names} of {len(NAMES)} are")
  rng = np.random.default_rng(seed)
  rows = []
  for i in range(n):
    a, b = rng.choice(names, 2, replace=False)
    tmpl = IOI_TEMPLATES[i % len(IOI_TEMPLATES)]
    clean, corrupt = tmpl.format(A=a, B=b, S=b), tmpl.format(A=a, B=b, S=a)
    # the corrupt prompt keeps both names in the first clause: "When A and B ..., A gave"
    ci, xi = encode(task, clean), encode(task, corrupt)
    if len(ci) != len(xi):
      continue
    rows.append((ci, xi, single_token(task, " " + a), single_token(task, " " + b),
                 {"clean": clean, "corrupt": corrupt, "answer": " " + a, "wrong": " " + b}))
  if not rows:
    raise UserError("no IOI pair tokenized to equal lengths for this tokenizer")
  return pack_pairs(rows)


def induction_pairs(task, n: int = 8, half_len: int = 10, seed: int = 0) -> Pairs:
  """Induction pairs on repeated random tokens.

  clean:   [BOS] r_1 .. r_m r_1 .. r_{m-1}  -> r_m  (the second copy predicts the first's)
  corrupt: [BOS] s_1 .. s_m r_1 .. r_{m-1}         (a fresh first half: nothing to copy)
  answer r_m, wrong s_m. Tokens are drawn from the model's ordinary vocabulary.
  """
  if n < 1 or half_len < 2:
    raise UserError(f"induction pairs need n >= 1 and half_len >= 2; got {n}, {half_len}")
  special = set()
  if hasattr(task, "special_ids"):
    special = {int(i) for i in task.special_ids()}
  first = 1      # id 0 is BOS in runs trained here; imported models name their specials
  pool = np.asarray([i for i in range(first, task.vocab_size) if i not in special])
  if len(pool) < 2 * half_len:
    raise UserError(f"the vocabulary ({task.vocab_size}) is too small for induction pairs "
                    f"of half_len {half_len}")
  bos = [int(task.bos_id)] if task.bos_id >= 0 else [int(pool[0])]   # the model's own BOS
  rng = np.random.default_rng(seed)
  rows = []
  for _ in range(n):
    toks = rng.choice(pool, 2 * half_len, replace=False)
    r, s = list(toks[:half_len]), list(toks[half_len:])
    clean = bos + r + r[:-1]
    corrupt = bos + s + r[:-1]
    rows.append(([int(i) for i in clean], [int(i) for i in corrupt], int(r[-1]), int(s[-1]),
                 {"clean": "repeated random tokens", "corrupt": "fresh first half"}))
  return pack_pairs(rows)


# The behaviours the toolkit draws pairs for: name -> fn(task, n, seed) -> Pairs. A
# behaviour is what a pair tests (its name is a study's --task); the `task` these
# functions take is the run's Task object (its tokenizer).
BUILDERS = {"ioi": lambda task, n, seed: ioi_pairs(task, n, seed),
            "induction": lambda task, n, seed: induction_pairs(task, n, seed=seed)}
BEHAVIOURS = tuple(BUILDERS)


def select_pairs(task, behaviour: str | None, pairs_file: str | None, n: int, seed: int,
                 builders: dict | None = None):
  """The pairs of exactly one of a built-in behaviour (n drawn with seed by
  `builders[behaviour]`, default BUILDERS) and a JSONL pairs file (read_pairs). Returns
  what the builder returns (Pairs for BUILDERS'), Pairs for a file; refuses both, neither
  and an unknown behaviour naming the setting (task, pairs)."""
  builders = BUILDERS if builders is None else builders
  if (behaviour is None) == (pairs_file is None):
    raise UserError(f"give exactly one of task ({', '.join(builders)}) and pairs "
                    "FILE.jsonl", setting=("task", "pairs"))
  if pairs_file is not None:
    return read_pairs(task, pairs_file)
  if behaviour not in builders:
    raise UserError(f"task must be one of {tuple(builders)}; got {behaviour!r}",
                    setting="task")
  return builders[behaviour](task, n, seed)


_FIELDS = ("clean", "corrupt", "answer", "wrong")


def read_pairs(task, path: str) -> Pairs:
  """Pairs from a JSONL file, one {"clean", "corrupt", "answer", "wrong"} object a line
  (blank lines skipped). Refused, naming the line, before any model is run: bad JSON, a
  missing or non-string field, clean and corrupt of different token lengths or of the
  same tokens, an answer or wrong that is not one token, or both the same token (a
  constant metric)."""
  if not storage.exists(path):
    raise UserError(f"pairs {path!r} does not exist", setting="pairs")
  return parse_pairs(task, storage.read_text(path).splitlines(), f"--pairs {path}")


def parse_pairs(task, lines, source: str) -> Pairs:
  """read_pairs' work on the lines themselves; errors name `source` and the line."""
  rows = []
  for no, line in enumerate(lines, 1):
    if not line.strip():
      continue
    where = f"{source}, line {no}"
    try:
      obj = json.loads(line)
    except json.JSONDecodeError as e:
      raise UserError(f"{where}: not valid JSON ({e.msg})") from None
    if not isinstance(obj, dict):
      raise UserError(f"{where}: expected an object with {list(_FIELDS)}")
    missing = [f for f in _FIELDS if f not in obj]
    if missing:
      raise UserError(f"{where}: missing field(s) {missing}; a pair has {list(_FIELDS)}")
    bad = [f for f in _FIELDS if not isinstance(obj[f], str) or not obj[f]]
    if bad:
      raise UserError(f"{where}: field {bad[0]!r} must be a non-empty string; got "
                      f"{obj[bad[0]]!r}")
    ci, xi = encode(task, obj["clean"]), encode(task, obj["corrupt"])
    if len(ci) != len(xi):
      raise UserError(f"{where}: clean and corrupt prompts must tokenize to the same "
                      f"length; got {len(ci)} and {len(xi)} tokens")
    ids = {}
    for f in ("answer", "wrong"):
      ids[f] = single_token(task, obj[f])
      if ids[f] is None:
        got = len(task_tokenizer(task).encode(obj[f]))
        raise UserError(f"{where}: {f} {obj[f]!r} must be one token of the model's "
                        f"vocabulary; it is {got} tokens")
    if ci == xi:
      raise UserError(f"{where}: the corrupt prompt is the clean one ({len(ci)} identical "
                      f"tokens): patching one into the other changes nothing")
    if ids["answer"] == ids["wrong"]:
      raise UserError(f"{where}: answer and wrong are the same token {obj['answer']!r}: "
                      f"the metric (their logit or probability difference) is 0 whatever "
                      f"the model does")
    rows.append((ci, xi, ids["answer"], ids["wrong"], {f: obj[f] for f in _FIELDS}))
  if not rows:
    raise UserError(f"{source} holds no pairs")
  return pack_pairs(rows)
