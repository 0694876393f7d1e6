"""What a finished run leaves for the figures: its per-step metrics and its final evaluation."""

from __future__ import annotations

import dataclasses
import os

import numpy as np

from rft_jax.analysis.plots import metric_series
from rft_jax.train.metrics_log import read_metrics, read_run_records


@dataclasses.dataclass
class RunResult:
  """One run, read back from its directory.

  Attributes:
    name: the run's name (its directory's).
    steps: the training steps' metric records (``step >= 1``; step 0 is the start), in order.
    start / final: held-out ``avg``, ``pass`` and ``entropy`` before training (None where this run
      did not evaluate the start) and after its last step.
    correct: ``[P, K]`` bool, the final evaluation's answers (problem by sample).
  """

  name: str
  steps: list[dict]
  start: dict | None
  final: dict
  correct: np.ndarray

  def series(self, key: str) -> tuple[np.ndarray, np.ndarray]:
    """``(steps, values)`` of a per-step metric where it was logged."""
    steps, values = metric_series(self.steps, key)
    return np.array(steps, np.int64), np.array(values, np.float64)

  def mean(self, key: str) -> float:
    return float(np.mean(self.series(key)[1]))


def _held_out(record: dict) -> dict:
  """``avg`` / ``pass`` / ``entropy`` of the (one) evaluation set of a record."""
  out = {}
  for key, value in record.items():
    if key.startswith("eval/"):
      stat = key.rsplit("/", 1)[1]
      out["avg" if stat.startswith("avg@") else "pass" if stat.startswith("pass@") else stat] = value
  return out


def load_run(run_dir: str) -> RunResult:
  """Reads a finished run (``metrics.jsonl`` and ``eval_completions.jsonl``) of ``run_dir``.

  Raises:
    ValueError: naming the file, when the run has no final evaluation or its answers are missing.
  """
  records = read_metrics(run_dir)
  evals = [r for r in records if any(k.startswith("eval/") for k in r)]
  if not evals or evals[-1]["step"] == 0:
    raise ValueError(f"{os.path.join(run_dir, 'metrics.jsonl')}: no evaluation after training")
  last = evals[-1]["step"]
  path = os.path.join(run_dir, "eval_completions.jsonl")
  answers: dict[int, dict[int, bool]] = {}
  if os.path.exists(path):
    for row in read_run_records(run_dir, "eval_completions.jsonl"):
      if row["step"] == last:
        answers.setdefault(row["problem"], {})[row["sample"]] = bool(row["correct"])
  if not answers:
    raise ValueError(f"{path}: no answers of the evaluation at step {last}")
  k = max(len(a) for a in answers.values())
  correct = np.array([[answers[p].get(j, False) for j in range(k)] for p in sorted(answers)], bool)
  start = next((_held_out(r) for r in evals if r["step"] == 0), None)
  return RunResult(os.path.basename(os.path.normpath(run_dir)), [r for r in records if r["step"] >= 1],
                   start, _held_out(evals[-1]), correct)
