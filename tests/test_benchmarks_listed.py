"""Every benchmark script is listed in a table of ``docs/benchmarks.md``, and every path under
``benchmarks/`` that the README, the docs, the package, the configs, the launch scripts, the tests
or the benchmarks themselves mention exists (so that moving a script cannot leave a dead
reference)."""
from __future__ import annotations

import glob
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCANNED = ("README.md", "docs", "rft_jax", "configs", "launch", "tests", "benchmarks")
LISTING = os.path.join("docs", "benchmarks.md")  # the benchmarks' tables
TEXT_SUFFIXES = (".py", ".md", ".sh", ".yaml", ".yml", ".toml", ".cc", ".h", ".txt", ".json")
# A path: "benchmarks/" then path characters; a path cut after a "/" at the end of a line carries
# on at the next line's first word (after any comment marker, "#" or "//") when that word names
# a script (".py", ".sh") or a folder.
PATH = re.compile(r"benchmarks/(?:[\w.*-]+/)*"
                  r"(?:[ \t]*\n[ \t]*(?:#|//)?[ \t]*(?=[\w*-]+(?:/|\.py\b|\.sh\b)))?[\w.*-]*")


def _rel(path: str) -> str:
  return os.path.relpath(path, ROOT).replace(os.sep, "/")


def scripts() -> list[str]:
  """``benchmarks/**/*.py`` with a ``__main__`` block and ``benchmarks/**/*.sh``, repo-relative."""
  found = []
  for path in glob.glob(os.path.join(ROOT, "benchmarks", "**", "*"), recursive=True):
    if path.endswith(".sh"):
      found.append(_rel(path))
    elif path.endswith(".py"):
      with open(path, encoding="utf-8") as f:
        if re.search(r"^if __name__ == .__main__.:", f.read(), re.M):
          found.append(_rel(path))
  return sorted(found)


def benchmarks_table() -> str:
  """The table rows (lines that start with ``|``) of ``docs/benchmarks.md``."""
  with open(os.path.join(ROOT, LISTING), encoding="utf-8") as f:
    rows = [line for line in f if line.lstrip().startswith("|")]
  assert rows, f"{LISTING} has no table"
  return "".join(rows)


def text_files(scanned=SCANNED, suffixes=TEXT_SUFFIXES) -> list[str]:
  """The files of ``scanned`` (files, or folders walked, hidden ones skipped) ending in
  ``suffixes``."""
  files = []
  for entry in scanned:
    top = os.path.join(ROOT, entry)
    if os.path.isfile(top):
      files.append(top)
    for folder, dirs, names in os.walk(top):
      dirs[:] = [d for d in dirs if not d.startswith((".", "__pycache__"))]
      files += [os.path.join(folder, n) for n in names if n.endswith(suffixes)]
  return files


def mentioned_paths() -> dict[str, set[str]]:
  """``{benchmarks/... path: files mentioning it}`` over the scanned files."""
  paths: dict[str, set[str]] = {}
  for path in text_files():
    with open(path, encoding="utf-8", errors="replace") as f:
      text = f.read()
    for match in PATH.finditer(text):
      if match.start() > 0 and (text[match.start() - 1].isalnum() or text[match.start() - 1] in "_-"):
        continue  # "my_benchmarks/..." is not ours
      mention = re.sub(r"[ \t]*\n[ \t]*(?:#|//)?[ \t]*", "", match.group(0)).rstrip(".")
      paths.setdefault(mention, set()).add(_rel(path))
  return paths


def test_every_script_is_listed_in_the_benchmarks_table():
  table = benchmarks_table()
  unlisted = [s for s in scripts() if f"`{s}`" not in table]
  assert scripts(), "no benchmark scripts found"
  assert not unlisted, f"not in a table row of {LISTING}: {unlisted}"


def test_every_mentioned_benchmarks_path_exists():
  dead = {path: sorted(where) for path, where in mentioned_paths().items()
          if not glob.glob(os.path.join(ROOT, path))}
  assert not dead, "dead references to benchmarks/ paths:\n" + "\n".join(
      f"  {path}  (in {', '.join(where)})" for path, where in sorted(dead.items()))
