"""The documentation holds together: every relative link of ``README.md`` and the pages under
``docs/`` reaches a file (and its ``#anchor`` a heading of it), every ``docs/...`` path the
repository names exists, the README stays short with its two set-up commands first, and the config
reference is the one generated from the config dataclasses, whose allowed values are the ones the
validators accept."""
from __future__ import annotations

import glob
import os
import re

import pytest
from test_benchmarks_listed import text_files

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = os.path.join(ROOT, "docs")
SCANNED = ("README.md", "docs", "rft_jax", "configs", "launch", "tests", "benchmarks", "notebooks",
           "pyproject.toml")
TEXT_SUFFIXES = (".py", ".md", ".sh", ".yaml", ".yml", ".toml", ".cc", ".h", ".txt", ".json", ".ipynb")
SET_UP = ["bash launch/local.sh", "bash tests/run.sh"]
README_LINES = 300
REQUIRED = ["model.path=/m", "data.train_path=/d.jsonl"]
# Other projects' documentation the code cites (not ours): the path and whose it is.
FOREIGN = {"docs/algo/rollout_corr.md": "verl", "docs/algo/rollout_corr_math.md": "verl",
           "docs/source/en/continuous_batching.md": "transformers",
           "docs/source/en/llm_optims.md": "transformers"}


def _rel(path: str) -> str:
  return os.path.relpath(path, ROOT).replace(os.sep, "/")


def pages() -> list[str]:
  """``README.md`` and every Markdown page under ``docs/``."""
  return [os.path.join(ROOT, "README.md")] + sorted(
      glob.glob(os.path.join(DOCS, "**", "*.md"), recursive=True))


def _read(path: str) -> str:
  with open(path, encoding="utf-8", errors="replace") as f:
    return f.read()


def prose(text: str) -> str:
  """``text`` without fenced code blocks and inline code spans (their brackets are not links)."""
  text = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
  return re.sub(r"`[^`]*`", "", text)


def slug(heading: str) -> str:
  """GitHub's anchor of a heading: lower case, punctuation but ``-`` and ``_`` dropped, spaces to
  ``-``."""
  return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(path: str) -> set[str]:
  """The anchors of a page's headings (a repeated heading's ``-1``, ``-2``, ... too)."""
  seen: dict[str, int] = {}
  found = set()
  text = re.sub(r"^```.*?^```", "", _read(path), flags=re.S | re.M)
  for match in re.finditer(r"^#{1,6}\s+(.*?)\s*#*\s*$", text, re.M):
    base = slug(match.group(1))
    n = seen.get(base, 0)
    found.add(base if n == 0 else f"{base}-{n}")
    seen[base] = n + 1
  return found


def links(path: str) -> list[str]:
  """The relative link targets of a Markdown page (not ``http(s):`` or ``mailto:``)."""
  targets = re.findall(r"\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)", prose(_read(path)))
  return [t for t in targets if not re.match(r"[a-z]+:", t)]


def test_every_relative_link_reaches_a_file_and_its_anchor_a_heading():
  dead = []
  for page in pages():
    for target in links(page):
      file, _, anchor = target.partition("#")
      resolved = os.path.normpath(os.path.join(os.path.dirname(page), file)) if file else page
      if not os.path.exists(resolved):
        dead.append(f"{_rel(page)}: {target} (no {_rel(resolved)})")
      elif anchor and resolved.endswith(".md") and anchor not in anchors(resolved):
        dead.append(f"{_rel(page)}: {target} (no heading #{anchor} in {_rel(resolved)})")
  assert not dead, "dead links:\n  " + "\n  ".join(dead)


def test_every_named_docs_path_exists():
  dead: dict[str, set[str]] = {}
  for path in text_files(SCANNED, TEXT_SUFFIXES):
    for match in re.finditer(r"(?<![\w./-])docs/[\w./*-]*", _read(path)):
      mention = match.group(0).rstrip(".,")
      if mention in FOREIGN and not _rel(path).startswith(("README", "docs/")):
        continue
      if not glob.glob(os.path.join(ROOT, mention)):
        dead.setdefault(mention, set()).add(_rel(path))
  assert not dead, "dead references to docs/ paths:\n" + "\n".join(
      f"  {p}  (in {', '.join(sorted(w))})" for p, w in sorted(dead.items()))


def test_the_readme_is_short_and_starts_with_the_two_set_up_commands():
  text = _read(os.path.join(ROOT, "README.md"))
  assert len(text.splitlines()) <= README_LINES, f"README.md has {len(text.splitlines())} lines"
  first = re.search(r"^```[^\n]*\n(.*?)^```", text, re.S | re.M)
  assert first, "README.md has no code block"
  commands = [re.sub(r"\s+#.*", "", line).strip() for line in first.group(1).splitlines()]
  assert [c for c in commands if c] == SET_UP, f"README.md's first commands: {commands}"


def test_the_config_reference_is_up_to_date():
  from rft_jax.train.config_reference import COMMAND, markdown

  with open(os.path.join(DOCS, "configs.md"), encoding="utf-8") as f:
    assert f.read() == markdown(), f"docs/configs.md is out of date: run `{COMMAND}`"


def test_the_reference_covers_every_key_with_a_meaning():
  from rft_jax.train.config import config_keys
  from rft_jax.train.config_reference import reference

  rows = reference()
  assert {key for key, _ in config_keys()} <= {row.key for row in rows}
  assert not [row.key for row in rows if not row.meaning], "keys without a meaning: add an Attributes: entry"


# Overrides a value needs to be accepted on its own.
NEEDS = {"learner.rollout_correction.rejection": ["learner.rollout_correction.rejection_bounds=2.0"]}
# Keys checked when the data loads, not when the config does (rft_jax.data.datasets.load_math_dataset).
AT_LOAD = {"data.format", "data.on_bad_row", "eval.sets[i].format"}


def _value(row, value) -> str:
  if value is None:
    return "null"
  return f"[{value}]" if row.type.startswith("list") else str(value)


def _load(*overrides: str):
  from rft_jax.train.config import load_config
  return load_config(None, [*REQUIRED, *overrides])


def test_the_allowed_values_are_those_the_validators_accept():
  from rft_jax.train.config import ConfigError
  from rft_jax.train.config_reference import reference

  rows = [row for row in reference() if row.allowed is not None and row.key not in AT_LOAD]
  assert len(rows) > 20
  for row in rows:
    for value in row.allowed:
      _load(f"{row.key}={_value(row, value)}", *NEEDS.get(row.key, []))  # accepted
    with pytest.raises(ConfigError, match=re.escape(row.key.rpartition(".")[2])):
      _load(f"{row.key}={_value(row, 'no_such_value')}", *NEEDS.get(row.key, []))


def test_the_allowed_values_of_the_data_keys_are_the_loaders():
  from rft_jax.data.datasets import DatasetError, load_math_dataset
  from rft_jax.train.config_reference import reference

  allowed = {row.key: row.allowed for row in reference() if row.key in AT_LOAD}
  for key, kwargs in (("data.format", {"format": "no_such_value"}),
                      ("data.on_bad_row", {"format": "jsonl", "on_bad_row": "no_such_value"})):
    with pytest.raises(DatasetError) as refused:
      load_math_dataset("/no/such/file.jsonl", **kwargs)
    assert all(repr(v) in str(refused.value) or f"'{v}'" in str(refused.value) for v in allowed[key]), (
        key, str(refused.value))
  assert allowed["eval.sets[i].format"] == allowed["data.format"]


def test_every_key_whose_validator_refuses_an_unknown_word_lists_its_values():
  from rft_jax.train.config import ConfigError
  from rft_jax.train.config_reference import reference

  missing = []
  for row in reference():
    if row.allowed is not None or row.type not in ("str", "str or null") or "[i]" in row.key:
      continue
    try:
      _load(f"{row.key}=no_such_value")
    except ConfigError as refused:
      if re.search(r"not one of|choose from|must be \S+ or \S+", str(refused)):
        missing.append(f"{row.key}: {refused}")
  assert not missing, "keys with a fixed set of values missing from config_reference.ALLOWED:\n" + "\n".join(missing)


def test_train_help_shows_the_allowed_values():
  from rft_jax.train.config_reference import format_config_keys

  text = format_config_keys()
  assert "  learner.objective = 'ppo'  (one of: " in text and "gspo" in text
  assert "  learner.entropy_mask.kind = 'none'  (one of: " in text


def test_each_checkpoint_key_has_its_own_meaning():
  """``keep_checkpoints`` once shared ``checkpoint_every``'s entry ("0: only at the end")."""
  from rft_jax.train.config_reference import reference

  meaning = {row.key: row.meaning for row in reference()}
  assert "every this many steps" in meaning["checkpoint_every"]
  assert "latest checkpoints to keep" in meaning["keep_checkpoints"]
  assert "only at the end" not in meaning["keep_checkpoints"]


def test_the_readme_says_what_plan_and_export_need():
  """``rft-jax plan`` on a TPU topology needs libtpu and about 20 minutes on 2 cores; loading an
  export in transformers needs torch, which rft_jax does not install: said where each is shown."""
  lines = _read(os.path.join(ROOT, "README.md")).splitlines()
  plan = next(i for i, line in enumerate(lines) if line.startswith("rft-jax plan "))
  assert "[tpu]" in lines[plan - 1] and "20 minutes on 2 CPU cores" in lines[plan - 1]
  assert "torch" in next(line for line in lines if line.startswith("rft-jax export "))
  training = _read(os.path.join(DOCS, "training.md"))
  export = next(p for p in training.split("\n- ") if p.startswith("`rft-jax export`"))
  assert "needs torch" in export and "pip install torch" in export
