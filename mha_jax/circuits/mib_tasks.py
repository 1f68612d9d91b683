"""MIB's circuit-track tasks (Mueller et al. 2025), generated offline in their form.

Each pair is (clean prompt, the counterfactual prompt MIB patches in), and the metric is
MIB's (MIB_circuit_track/metrics.py logit_diff with dataset.py's labels): the clean
logits at the last position, logit(correct) - logit(the counterfactual's answer), with
each answer's *first* token, tokenized as MIB does. The pairs of one task are of equal
token length (MIB's loader refuses others) and the counterfactual flips the answer
(tested).

  mib-ioi      Wang et al.'s IOI: "When Mary and John went to the store, John gave a
               drink to" (IO Mary, subject John); counterfactual s2_io_flip, MIB's
               default: the second mention of the subject becomes the IO ("..., Mary
               gave a drink to": answer John). correct " IO", wrong " S".
  mib-mcqa     copy-colors MCQA, 4 choices: "Question: Boxes are brown. What color are
               boxes?\nA. green\nB. brown\nC. red\nD. blue\nAnswer:"; counterfactual
               symbol_counterfactual, MIB's default: the same question with other
               symbols as the choices' labels, so the correct label changes. MIB
               tokenizes the label alone ("B", no leading space): correct "B", wrong the
               counterfactual's label.
  mib-arithmetic-add, mib-arithmetic-sub
               two-digit operands, "23+45=" ("68-21="): MIB tokenizes the result
               alone, with no leading space, so the prompt ends where the number
               starts; the counterfactual random_counterfactual: other random operands
               of a result whose first token differs. MIB keeps results that are one
               token (Llama 3's numbers up to 999); on tokenizers that split digits
               (SmolLM2, Gemma) the metric reads each result's first token ("6" of 68),
               as MIB's first-token labels do.

MIB's own files (Hugging Face mib-bench/*) are not read: the prompts follow their
published templates; ARC comes from a file the user gives (`--pairs`).
"""

from __future__ import annotations

import numpy as np

from mha_jax.errors import UserError
from mha_jax.toolkit import pairs as pairs_lib

TASKS = ("mib-ioi", "mib-mcqa", "mib-arithmetic-add", "mib-arithmetic-sub")

IOI_TEMPLATES = (   # Wang et al. 2022's BABA and ABBA forms ({S2}: the subject again)
    "Then, {B} and {A} went to the {place}. {S2} gave a {obj} to",
    "When {B} and {A} got a {obj} at the {place}, {S2} decided to give it to",
    "After {B} and {A} went to the {place}, {S2} gave a {obj} to",
    "While {B} and {A} were working at the {place}, {S2} gave a {obj} to",
    "Then, {A} and {B} went to the {place}. {S2} gave a {obj} to",
    "When {A} and {B} got a {obj} at the {place}, {S2} decided to give it to",
    "After {A} and {B} went to the {place}, {S2} gave a {obj} to",
    "While {A} and {B} were working at the {place}, {S2} gave a {obj} to",
)
PLACES = ("store", "garden", "restaurant", "school", "hospital", "office", "house", "station")
OBJECTS = ("ring", "kiss", "bone", "basketball", "computer", "necklace", "drink", "snack")
NOUNS = (("Boxes", "boxes"), ("Bananas", "bananas"), ("Frogs", "frogs"), ("Roses", "roses"),
         ("Clouds", "clouds"), ("Lemons", "lemons"), ("Cherries", "cherries"),
         ("Coins", "coins"), ("Crows", "crows"), ("Carrots", "carrots"))
COLORS = ("green", "red", "blue", "gray", "pink", "purple", "yellow", "brown", "orange",
          "black", "white")
LABELS = ("A", "B", "C", "D")
OTHER_LABELS = ("E", "F", "G", "H", "W", "X", "Y", "Z")


def _first(task, text: str) -> int:
  ids = pairs_lib.task_tokenizer(task).encode(text)
  return int(ids[0])


def _check(n: int) -> None:
  if n < 1:
    raise UserError(f"n_pairs must be >= 1; got {n}", setting="n_pairs")


def ioi(task, n: int = 8, seed: int = 0) -> pairs_lib.Pairs:
  """MIB's IOI pairs (s2_io_flip counterfactual; the module docstring)."""
  _check(n)
  names = pairs_lib.ioi_names(task)
  rng = np.random.default_rng(seed)
  rows = []
  for i in range(8 * n):
    if len(rows) == n:
      break
    a, b = (str(x) for x in rng.choice(names, 2, replace=False))
    kw = dict(place=PLACES[rng.integers(len(PLACES))], obj=OBJECTS[rng.integers(len(OBJECTS))])
    tmpl = IOI_TEMPLATES[i % len(IOI_TEMPLATES)]
    clean, cf = tmpl.format(A=a, B=b, S2=b, **kw), tmpl.format(A=a, B=b, S2=a, **kw)
    ci, xi = pairs_lib.encode(task, clean), pairs_lib.encode(task, cf)
    if len(ci) == len(xi):
      rows.append((ci, xi, _first(task, " " + a), _first(task, " " + b),
                   {"clean": clean, "corrupt": cf, "answer": " " + a, "wrong": " " + b}))
  return _packed(rows, "mib-ioi")


def _mcqa_prompt(noun, color, choices, labels) -> str:
  lines = "".join(f"\n{lab}. {c}" for lab, c in zip(labels, choices))
  return f"Question: {noun[0]} are {color}. What color are {noun[1]}?{lines}\nAnswer:"


def mcqa(task, n: int = 8, seed: int = 0) -> pairs_lib.Pairs:
  """MIB's copy-colors MCQA pairs (symbol_counterfactual; the module docstring)."""
  _check(n)
  rng = np.random.default_rng(seed)
  rows = []
  for i in range(8 * n):
    if len(rows) == n:
      break
    noun = NOUNS[i % len(NOUNS)]
    choices = [str(c) for c in rng.choice(COLORS, len(LABELS), replace=False)]
    key = int(rng.integers(len(LABELS)))
    other = [str(x) for x in rng.choice(OTHER_LABELS, len(LABELS), replace=False)]
    clean = _mcqa_prompt(noun, choices[key], choices, LABELS)
    cf = _mcqa_prompt(noun, choices[key], choices, other)
    ci, xi = pairs_lib.encode(task, clean), pairs_lib.encode(task, cf)
    a, w = _first(task, LABELS[key]), _first(task, other[key])
    if len(ci) == len(xi) and a != w:
      rows.append((ci, xi, a, w, {"clean": clean, "corrupt": cf, "answer": LABELS[key],
                                  "wrong": other[key]}))
  return _packed(rows, "mib-mcqa")


def arithmetic(task, op: str, n: int = 8, seed: int = 0) -> pairs_lib.Pairs:
  """MIB's two-digit addition or subtraction pairs (random_counterfactual; the module
  docstring). op: "+" or "-"."""
  _check(n)
  fn = {"+": lambda a, b: a + b, "-": lambda a, b: a - b}[op]
  rng = np.random.default_rng(seed)

  def draw():
    a, b = (int(x) for x in rng.integers(10, 100, 2))
    if op == "-" and b > a:
      a, b = b, a
    return a, b, f"{a}{op}{b}="

  rows = []
  for _ in range(40 * n):
    if len(rows) == n:
      break
    (a, b, clean), (c, d, cf) = draw(), draw()
    ra, rc = fn(a, b), fn(c, d)
    ci, xi = pairs_lib.encode(task, clean), pairs_lib.encode(task, cf)
    ta, tw = _first(task, str(ra)), _first(task, str(rc))
    if len(ci) == len(xi) and ta != tw:
      rows.append((ci, xi, ta, tw, {"clean": clean, "corrupt": cf, "answer": str(ra),
                                    "wrong": str(rc)}))
  return _packed(rows, f"mib-arithmetic-{'add' if op == '+' else 'sub'}")


def _packed(rows, name: str) -> pairs_lib.Pairs:
  if not rows:
    raise UserError(f"task {name}: no pair tokenized to equal lengths with distinct answers "
                    f"for this tokenizer", setting="task")
  return pairs_lib.pack_pairs(rows)


def make(task, name: str, n: int, seed: int) -> pairs_lib.Pairs:
  """The pairs of MIB task `name` (TASKS); the metric is the logit difference."""
  if name == "mib-ioi":
    return ioi(task, n, seed)
  if name == "mib-mcqa":
    return mcqa(task, n, seed)
  if name in ("mib-arithmetic-add", "mib-arithmetic-sub"):
    return arithmetic(task, "+" if name.endswith("add") else "-", n, seed)
  raise UserError(f"task must be one of {TASKS}; got {name!r}", setting="task")
