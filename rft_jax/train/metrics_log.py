"""Every metric of every step, to ``RUN_DIR/metrics.jsonl`` and TensorBoard.

JSONL is the source of truth (one object per step with ``step`` and ``time``; read it
back with :func:`read_metrics`); TensorBoard event files in ``RUN_DIR/tensorboard``
mirror the scalars for live viewing. On several processes only process 0 writes them; the
others get a :class:`NullLog`.
"""

from __future__ import annotations

import json
import math
import os
import time


class MetricsLog:
  """Appends metrics of a run; safe to reopen on resume (steps after the resume point
  are dropped from the JSONL so that a resumed run's file equals an uninterrupted one)."""

  def __init__(self, run_dir: str, *, resume_from_step: int | None = None, tensorboard: bool = True):
    os.makedirs(run_dir, exist_ok=True)
    self.path = os.path.join(run_dir, "metrics.jsonl")
    if resume_from_step is not None and os.path.exists(self.path):
      kept = [r for r in read_metrics(self.path) if r["step"] < resume_from_step]
      with open(self.path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in kept)
    elif resume_from_step is None and os.path.exists(self.path):
      os.remove(self.path)
    self._file = open(self.path, "a")
    self._writer = None
    if tensorboard:
      from tensorboardX import SummaryWriter
      self._writer = SummaryWriter(os.path.join(run_dir, "tensorboard"))

  def write(self, step: int, metrics: dict[str, float]) -> None:
    record = {"step": step, "time": time.time()}
    record.update({k: (float(v) if v is not None else None) for k, v in metrics.items()})
    self._file.write(json.dumps(record) + "\n")
    self._file.flush()
    if self._writer is not None:
      for key, value in metrics.items():
        if value is not None and math.isfinite(float(value)):
          self._writer.add_scalar(key, float(value), step)

  def close(self) -> None:
    self._file.close()
    if self._writer is not None:
      self._writer.close()


class NullLog:
  """What processes other than 0 log to: nothing (same methods as :class:`MetricsLog`)."""

  def write(self, step: int, metrics: dict[str, float]) -> None:
    del step, metrics

  def close(self) -> None:
    pass


def read_metrics(path: str) -> list[dict]:
  """The records of a ``metrics.jsonl`` file (or of ``RUN_DIR/metrics.jsonl``)."""
  if os.path.isdir(path):
    path = os.path.join(path, "metrics.jsonl")
  with open(path) as f:
    return [json.loads(line) for line in f if line.strip()]
