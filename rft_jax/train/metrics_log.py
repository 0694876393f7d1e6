"""Every metric of every step, to ``RUN_DIR/metrics.jsonl`` and TensorBoard; the run's other
JSONL files (``rollouts.jsonl``, ``eval_completions.jsonl``) through :class:`JsonlFile`.

JSONL is the source of truth (one object per step with ``step`` and ``time``; read it
back with :func:`read_metrics`; steps are numbered as :mod:`rft_jax.train.step_numbers` says:
from 1, step 0 being the start); TensorBoard event files in ``RUN_DIR/tensorboard``
mirror the scalars for live viewing. On several processes only process 0 writes them; the
others get a :class:`NullLog`.

Both are written in the caller's thread: a write that fails (a full disk, a lost mount)
raises :class:`WriteError` naming the file and the cause at once. (tensorboardX's
``SummaryWriter`` writes from a thread that dies on such an error, after which its queue
fills and the training loop blocks forever; here its synchronous ``EventsWriter`` is used.)
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import time
import warnings
from typing import Any

from rft_jax.train.errors import WriteError
from rft_jax.train.metric_names import logged_names
from rft_jax.train.step_numbers import RUN_FILES, counts_from_zero, renumbered


class JsonlFile:
  """An append-only JSONL file of a run, one record per line, each flushed as it is written.

  On resume from the checkpoint of step ``resume_from_step``, records of the steps after it are
  dropped, so that a resumed run's file equals an uninterrupted one; on a fresh run (None) an
  earlier file is removed.
  """

  def __init__(self, path: str, *, resume_from_step: int | None = None):
    self.path = path
    with _naming(path):
      os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
      if resume_from_step is not None and os.path.exists(path):
        kept = [r for r in read_jsonl(path) if r["step"] <= resume_from_step]
        with open(path, "w") as f:
          f.writelines(json.dumps(r) + "\n" for r in kept)
      elif resume_from_step is None and os.path.exists(path):
        os.remove(path)
      self._file = open(path, "a")

  def write(self, records: list[dict]) -> None:
    with _naming(self.path):
      self._file.writelines(json.dumps(r) + "\n" for r in records)
      self._file.flush()

  def flush(self) -> None:
    """Puts everything written so far on disk, past the OS's cache."""
    with _naming(self.path):
      os.fsync(self._file.fileno())

  def close(self) -> None:
    try:
      self._file.close()
    except OSError:  # already reported by the write that failed; closing must not mask it
      pass


class MetricsLog:
  """Appends metrics of a run; safe to reopen on resume (steps after the resume point
  are dropped from the JSONL so that a resumed run's file equals an uninterrupted one)."""

  def __init__(self, run_dir: str, *, resume_from_step: int | None = None, tensorboard: bool = True,
               mirror: Any = None):
    """``mirror``: another sink of every record (``write(step, metrics)``, ``close()``), e.g. the
    optional :class:`~rft_jax.train.wandb_log.WandbLog`."""
    self.path = os.path.join(run_dir, "metrics.jsonl")
    self._mirror = mirror
    self._jsonl = JsonlFile(self.path, resume_from_step=resume_from_step)
    self._events = None
    if tensorboard:
      from tensorboardX.event_file_writer import EventsWriter

      self._events_dir = os.path.join(run_dir, "tensorboard")
      with _naming(self._events_dir):
        os.makedirs(self._events_dir, exist_ok=True)
        self._events = EventsWriter(os.path.join(self._events_dir, "events"))

  def write(self, step: int, metrics: dict[str, float]) -> None:
    """One record of ``step``, under the logged names (:mod:`rft_jax.train.metric_names`)."""
    metrics = {k: (float(v) if v is not None else None) for k, v in logged_names(metrics).items()}
    record = {"step": step, "time": time.time(), **metrics}
    self._jsonl.write([record])
    if self._events is not None:
      from tensorboardX.proto.event_pb2 import Event
      from tensorboardX.proto.summary_pb2 import Summary

      # Summary protos built here, not by tensorboardX's summary.scalar, which rewrites tags
      # ("eval/val/avg@4" -> "eval/val/avg_4"): TensorBoard shows the JSONL's names.
      values = [Summary.Value(tag=k, simple_value=v) for k, v in metrics.items()
                if v is not None and math.isfinite(v)]
      with _naming(self._events_dir):
        self._events.write_event(Event(wall_time=record["time"], step=step, summary=Summary(value=values)))
        self._events.flush()
    if self._mirror is not None:
      self._mirror.write(step, metrics)

  def flush(self) -> None:
    """Puts everything written so far on disk, past the OS's cache (the loop calls it at each
    checkpoint, so the metrics of every checkpointed step survive a machine crash)."""
    self._jsonl.flush()
    if self._events is not None:
      with _naming(self._events_dir):
        self._events.flush()
        for name in os.listdir(self._events_dir):
          fd = os.open(os.path.join(self._events_dir, name), os.O_RDONLY)
          try:
            os.fsync(fd)
          finally:
            os.close(fd)

  def close(self) -> None:
    self._jsonl.close()
    if self._mirror is not None:
      self._mirror.close()
    try:
      if self._events is not None:
        self._events.close()
    except OSError:  # already reported by the write that failed; closing must not mask it
      pass


class NullLog:
  """What processes other than 0 log to: nothing (same methods as :class:`MetricsLog`)."""

  def write(self, step: int, metrics: dict[str, float]) -> None:
    del step, metrics

  def flush(self) -> None:
    pass

  def close(self) -> None:
    pass


@contextlib.contextmanager
def _naming(path: str):
  """Re-raises an ``OSError`` as :class:`WriteError` naming ``path``."""
  try:
    yield
  except OSError as exc:
    raise WriteError(f"cannot write {path}: {exc.strerror or exc}") from exc


def read_metrics(path: str) -> list[dict]:
  """The records of a ``metrics.jsonl`` file (or of ``RUN_DIR/metrics.jsonl``) under the logged
  names and step numbers, also for files written before them
  (:func:`rft_jax.train.metric_names.logged_names`, :mod:`rft_jax.train.step_numbers`)."""
  if os.path.isdir(path):
    path = os.path.join(path, "metrics.jsonl")
  records = read_jsonl(path)
  if counts_from_zero(records):
    records = [renumbered(r) for r in records]
  return [logged_names(r) for r in records]


def read_jsonl(path: str) -> list[dict]:
  """The records of a JSONL file of a run (metrics, rollouts, evaluation completions).

  A last line that is not JSON (a crash in the middle of writing it) is dropped with a
  warning; an unreadable line before it is an error naming the file and the line.
  """
  with open(path, "rb") as f:
    lines = [(number, line) for number, line in enumerate(f, 1) if line.strip()]
  records = []
  for i, (number, line) in enumerate(lines):
    try:
      records.append(json.loads(line))
    except ValueError as exc:
      if i < len(lines) - 1:
        raise ValueError(f"{path}, line {number}: not a JSON record ({exc})") from None
      warnings.warn(f"{path}, line {number}: dropped a torn last record (a crash while writing it)",
                    stacklevel=2)
  return records


def read_run_records(run_dir: str, name: str) -> list[dict]:
  """The records of ``RUN_DIR/name`` (one of :data:`~rft_jax.train.step_numbers.RUN_FILES`)
  numbered as :mod:`rft_jax.train.step_numbers` says, whichever numbering the run was written in
  (judged by its ``metrics.jsonl``)."""
  records = read_jsonl(os.path.join(run_dir, name))
  metrics = os.path.join(run_dir, "metrics.jsonl")
  old = os.path.exists(metrics) and counts_from_zero(read_jsonl(metrics))
  return [renumbered(r) for r in records] if old else records


def renumber_run_files(run_dir: str) -> bool:
  """Rewrites the step numbers of a run written before :mod:`rft_jax.train.step_numbers` (each
  file replaced whole, ``metrics.jsonl``, by which the numbering is judged, last); returns whether
  it did."""
  metrics = os.path.join(run_dir, "metrics.jsonl")
  if not (os.path.exists(metrics) and counts_from_zero(read_jsonl(metrics))):
    return False
  for name in (*RUN_FILES[1:], RUN_FILES[0]):
    path = os.path.join(run_dir, name)
    if os.path.exists(path):
      with open(path + ".renumbered", "w") as f:
        f.writelines(json.dumps(renumbered(r)) + "\n" for r in read_jsonl(path))
      os.replace(path + ".renumbered", path)
  return True
