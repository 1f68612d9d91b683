"""Measured numbers live on the generated results pages (and the dated notes), never in
the README or the guides, which explain and link: a guide that quotes a timing goes stale
the day the code changes."""

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[2]

# What a measurement looks like in prose: a time in ms, a wall time, a speed ratio, a
# measured rate, a peak, a date. Settings ("default 60 s") and analytic sizes are allowed.
MEASURED = [
  (r"\b\d[\d,]*(\.\d+)? ?ms\b", "a time in ms"),
  (r"\b\d+ min \d+ s\b|\b\d+(\.\d+)? s (of )?wall\b|\bwall time of \d", "a wall time"),
  (r"\b\d+(\.\d+)?x (faster|slower)\b|\b\d+\.\d+(-\d+\.\d+)?x\b", "a speed ratio"),
  (r"\b\d[\d,]*(\.\d+)? (GFLOP|tokens)/s\b", "a measured rate"),
  (r"\bpeak( resident memory| RSS)? (of )?\d", "a measured peak"),
  (r"\b20\d\d-\d\d-\d\d\b", "a date"),
]


def prose(text):
  """The text outside fenced code blocks and tables' example rows (code is not prose)."""
  return re.sub(r"```.*?```", "", text, flags=re.S)


def offenders(path):
  out = []
  for line in prose(path.read_text()).splitlines():
    for pat, what in MEASURED:
      m = re.search(pat, line)
      if m:
        out.append(f"{path.relative_to(ROOT)}: {what}: {m.group(0)!r} in {line.strip()[:90]!r}")
  return out


def test_the_readme_and_the_guides_carry_no_measured_numbers():
  pages = [ROOT / "README.md", *sorted((ROOT / "docs" / "guide").glob("*.md"))]
  found = [o for p in pages for o in offenders(p)]
  assert not found, "\n".join(found)


def test_the_check_finds_a_measurement(tmp_path):
  page = ROOT / "docs" / "guide" / "x_probe.md"
  try:
    page.write_text("The sweep took 12.5 ms.\n\n```\nlog: 3 ms\n```\nIt is 1.6x faster.\n")
    found = offenders(page)
  finally:
    page.unlink()
  assert [f.split(": ")[1] for f in found] == ["a time in ms", "a speed ratio"]
