"""Math question/answer datasets from local files, in their published formats.

Everything is read through ``datasets`` from local paths only (a ``.jsonl``/``.json``
or ``.parquet`` file, or a directory written by ``Dataset.save_to_disk``); nothing is
downloaded. Each row becomes a :class:`MathExample`. A row with a missing or empty
question/answer is reported by its index and field and either skipped (counted, and
listed in the returned :class:`LoadReport`) or fatal, per ``on_bad_row``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
from typing import Any

import datasets as hf_datasets


class DatasetError(ValueError):
  """A data file or row that cannot be used; the message names file, row and field."""


@dataclasses.dataclass(frozen=True)
class MathExample:
  """One problem: the question text, its ground-truth answer and a stable id; ``extras``: its
  environment's arguments (``data.extras_field``; multi-turn rollouts), or None."""

  question: str
  answer: str
  id: str
  extras: dict | None = None


@dataclasses.dataclass(frozen=True)
class DatasetFormat:
  """Where a format keeps the question and the answer (dotted paths into a row; ``answer``
  may list alternatives, the first column present is used)."""

  question: str
  answer: str | tuple[str, ...]
  id: str | None = None


# Published formats. DAPO-Math-17k as released (chat-list ``prompt``, ``reward_model.ground_truth``)
# or in its processed form (one question / one solution column), AIME 2024 (problem / answer,
# integer answers), AIME 2025 (same layout).
FORMATS: dict[str, DatasetFormat] = {
    "dapo_math_17k": DatasetFormat(question="prompt", answer=("solution", "reward_model.ground_truth")),
    "aime_2024": DatasetFormat(question="problem", answer="answer", id="id"),
    "aime_2025": DatasetFormat(question="problem", answer="answer"),
    "jsonl": DatasetFormat(question="question", answer="answer"),
}


def _read(path: str) -> hf_datasets.Dataset:
  if not os.path.exists(path):
    raise DatasetError(f"{path}: no such file or directory")
  if os.path.isdir(path):
    try:
      data = hf_datasets.load_from_disk(path)
    except FileNotFoundError as exc:
      raise DatasetError(f"{path}: not a dataset saved with save_to_disk ({exc})") from exc
    if isinstance(data, hf_datasets.DatasetDict):
      if "train" not in data:
        raise DatasetError(f"{path}: DatasetDict without a 'train' split (has {sorted(data)})")
      data = data["train"]
    return _non_empty(path, data)
  suffix = path.rsplit(".", 1)[-1].lower()
  builder = {"jsonl": "json", "json": "json", "parquet": "parquet"}.get(suffix)
  if builder is None:
    raise DatasetError(f"{path}: unsupported file type '.{suffix}' (use .jsonl, .json, .parquet or a directory)")
  if builder == "json":
    _check_text(path, rows=suffix == "jsonl")
  else:
    _check_parquet(path)
  try:
    with _quiet_progress():  # "Generating train split: ..." in every log of a run
      return _non_empty(path, hf_datasets.load_dataset(builder, data_files=path, split="train"))
  except DatasetError:
    raise
  except Exception as exc:  # datasets raises several types for malformed files
    where = _bad_json_line(path) if suffix == "jsonl" else None
    raise DatasetError(where or f"{path}: could not be read as {builder}: {_root_cause(exc)}") from exc


@contextlib.contextmanager
def _quiet_progress():
  """``datasets``' progress bars and log off while loading a small local file, as they were
  after: its "Generating train split" bars, and its own lines about a file it cannot parse
  (which the one line of :class:`DatasetError` replaces)."""
  was_enabled = hf_datasets.is_progress_bar_enabled()
  verbosity = hf_datasets.logging.get_verbosity()
  hf_datasets.disable_progress_bars()
  hf_datasets.logging.set_verbosity(hf_datasets.logging.CRITICAL)
  try:
    yield
  finally:
    hf_datasets.logging.set_verbosity(verbosity)
    if was_enabled:
      hf_datasets.enable_progress_bars()


def _non_empty(path: str, data: hf_datasets.Dataset) -> hf_datasets.Dataset:
  if len(data) == 0:
    raise DatasetError(f"{path}: no rows (the data set is empty)")
  return data


def _line_name(number: int, row: int | None) -> str:
  return f"line {number}" + ("" if row is None else f" (row {row})")


def _check_text(path: str, rows: bool) -> None:
  """A JSON file must be UTF-8 text with something in it; the first bad byte is reported with
  its line (and, for JSON lines, its row: the 0-based index among the non-blank lines)."""
  row = 0
  with open(path, "rb") as f:
    for number, line in enumerate(f, 1):
      try:
        line.decode("utf-8")
      except UnicodeDecodeError as exc:
        raise DatasetError(f"{path}: {_line_name(number, row if rows else None)}: not UTF-8 text "
                           f"(byte 0x{line[exc.start]:02x} at column {exc.start + 1})") from exc
      row += bool(line.strip())
  if not row:
    raise DatasetError(f"{path}: the file is empty (no rows)")


def _check_parquet(path: str) -> None:
  import pyarrow.parquet as pq

  try:
    rows = pq.read_metadata(path).num_rows
  except Exception as exc:  # pyarrow's ArrowInvalid / OSError for a file that is not parquet
    raise DatasetError(f"{path}: not a parquet file ({_root_cause(exc)})") from exc
  if rows == 0:
    raise DatasetError(f"{path}: no rows (the data set is empty)")


def _bad_json_line(path: str) -> str | None:
  """The first line of a JSON-lines file that is not a JSON object, described; None if none.
  The column is the character's on the line, counted from 1 (the line's end when the object
  is cut short); a key that appears twice in one object is named (``datasets`` refuses it)."""
  row = 0
  with open(path, encoding="utf-8") as f:
    for number, line in enumerate(f, 1):
      text = line.rstrip("\r\n")
      if not text.strip():
        continue
      try:
        value = json.loads(text, object_pairs_hook=_no_repeated_keys)
      except _RepeatedKey as exc:
        return f"{path}: {_line_name(number, row)}: the key {exc.args[0]!r} appears twice in one object"
      except json.JSONDecodeError as exc:
        where = f"column {exc.pos + 1}" + (", the end of the line" if exc.pos >= len(text) else "")
        return f"{path}: {_line_name(number, row)}: not valid JSON ({exc.msg} at {where})"
      if not isinstance(value, dict):
        return f"{path}: {_line_name(number, row)}: not a JSON object (a {type(value).__name__})"
      row += 1
  return None


class _RepeatedKey(ValueError):
  """A key that appears twice in one JSON object."""


def _no_repeated_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
  keys = [k for k, _ in pairs]
  repeated = next((k for k in keys if keys.count(k) > 1), None)
  if repeated is not None:
    raise _RepeatedKey(repeated)
  return dict(pairs)


def _root_cause(exc: BaseException) -> str:
  while (exc.__cause__ or exc.__context__) is not None:
    exc = exc.__cause__ or exc.__context__
  text = str(exc).strip().splitlines()
  return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


def _field(row: dict[str, Any], dotted: str):
  value: Any = row
  for key in dotted.split("."):
    if not isinstance(value, dict) or key not in value:
      return None
    value = value[key]
  return value


def _extras(path: str, index: int, field: str, value: Any) -> dict:
  """A row's environment arguments: a dict, or a JSON object as text."""
  if isinstance(value, str):
    try:
      value = json.loads(value)
    except json.JSONDecodeError as exc:
      raise DatasetError(f"{path}: row {index}: field '{field}' is not JSON ({exc.msg} at "
                         f"character {exc.pos}): {value[:80]!r}") from None
  if not isinstance(value, dict):
    raise DatasetError(f"{path}: row {index}: field '{field}' must be an object (the environment's "
                       f"arguments), got {type(value).__name__} {str(value)[:80]!r}")
  return value


def _text(value) -> str | None:
  """A question/answer value as text; chat-style lists keep their user turn."""
  if isinstance(value, list) and value and isinstance(value[-1], dict) and "content" in value[-1]:
    value = value[-1]["content"]
  if value is None:
    return None
  text = str(value).strip()
  return text or None


@dataclasses.dataclass
class LoadReport:
  """What loading kept and what it skipped (row index, field, reason)."""

  path: str
  rows: int = 0
  kept: int = 0
  skipped: list[tuple[int, str, str]] = dataclasses.field(default_factory=list)


def load_math_dataset(
    path: str,
    format: str = "jsonl",
    *,
    question_field: str | None = None,
    answer_field: str | None = None,
    on_bad_row: str = "error",
    field_settings: tuple[str, str] = ("data.question_field", "data.answer_field"),
    extras_field: str | None = None,
) -> tuple[list[MathExample], LoadReport]:
  """Loads ``path`` as :class:`MathExample` rows.

  Args:
    path: a ``.jsonl``/``.json``/``.parquet`` file or a ``save_to_disk`` directory.
    format: a key of :data:`FORMATS`; ``question_field`` / ``answer_field`` (dotted
      paths, e.g. ``reward_model.ground_truth``) override its columns.
    on_bad_row: ``error`` (raise on the first missing/empty field) or ``skip``.
    field_settings: what the caller's user sets to choose the question / answer column,
      named in the error for a missing column (``rft-jax sft`` passes its flags).
    extras_field: a column (dotted path) of each row's environment arguments, a dict or a JSON
      object as text (``data.extras_field``); a row whose value is neither is bad input.
  """
  if format not in FORMATS:
    raise DatasetError(f"unknown dataset format {format!r}; choose from {sorted(FORMATS)}")
  if on_bad_row not in ("error", "skip"):
    raise DatasetError(f"on_bad_row must be 'error' or 'skip', got {on_bad_row!r}")
  spec = FORMATS[format]
  data = _read(path)
  answers = (spec.answer,) if isinstance(spec.answer, str) else spec.answer
  default_answer = next((a for a in answers if a.split(".")[0] in data.column_names), answers[0])
  fields = {"question": question_field or spec.question, "answer": answer_field or default_answer}
  for (name, column), setting in zip(fields.items(), field_settings):
    if column.split(".")[0] not in data.column_names:
      raise DatasetError(f"{path}: no column '{column.split('.')[0]}' for the {name} "
                         f"(columns: {data.column_names}); set {setting}")
  if extras_field and extras_field.split(".")[0] not in data.column_names:
    raise DatasetError(f"{path}: no column '{extras_field.split('.')[0]}' for the environment's "
                       f"arguments (columns: {data.column_names}); set data.extras_field")
  report = LoadReport(path=path, rows=len(data))
  examples = []
  try:
    for index, row in enumerate(data):
      values = {name: _text(_field(row, column)) for name, column in fields.items()}
      missing = [name for name, value in values.items() if value is None]
      if missing:
        problem = (index, fields[missing[0]], "missing or empty")
        if on_bad_row == "error":
          raise DatasetError(f"{path}: row {index}: field '{fields[missing[0]]}' ({missing[0]}) is missing or empty")
        report.skipped.append(problem)
        continue
      ident = _field(row, spec.id) if spec.id else None
      extras = _extras(path, index, extras_field, _field(row, extras_field)) if extras_field else None
      examples.append(MathExample(values["question"], values["answer"],
                                  str(ident if ident is not None else index), extras))
  except UnicodeDecodeError as exc:  # a string column holding bytes that are not UTF-8
    row_index = len(examples) + len(report.skipped)  # rows are read in order: the next one failed
    raise DatasetError(f"{path}: row {row_index}: not UTF-8 text ({exc.reason})") from exc
  report.kept = len(examples)
  if not examples:
    raise DatasetError(f"{path}: none of its {report.rows} rows has a question and an answer "
                       f"(first skipped: row {report.skipped[0][0]}, field '{report.skipped[0][1]}')")
  return examples, report


def split_validation(examples: list[MathExample], size: int, seed: int, *,
                     setting: str = "data.val_size") -> tuple[list[MathExample], list[MathExample]]:
  """The paper's split: a deterministic ``size``-question validation set held out.

  Returns ``(train, validation)``; the same ``seed`` and data give the same split.
  ``setting`` is what the user sets to choose ``size``, named in the error.
  """
  import numpy as np

  if size < 0 or size >= len(examples):
    raise DatasetError(f"{setting}={size} (validation size) must be in [0, {len(examples)}) for "
                       f"{len(examples)} usable examples")
  order = np.random.default_rng(seed).permutation(len(examples))
  held = set(order[:size].tolist())
  train = [e for i, e in enumerate(examples) if i not in held]
  validation = [examples[i] for i in sorted(held)]
  return train, validation
