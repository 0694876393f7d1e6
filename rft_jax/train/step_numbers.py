"""Step numbers: one convention in every file and line a run writes.

A run's steps are numbered from 1, and a step counts once it is done: step ``N`` is the ``N``-th
update, "after step ``N``" means ``N`` steps done, and ``steps=N`` runs steps 1 to ``N``. Step 0
is the start, before any update (the evaluation of ``eval.at_start``). The same number is the
``step`` of ``metrics.jsonl``, ``rollouts.jsonl`` and ``eval_completions.jsonl``, the x-axis of
TensorBoard, W&B and the plots, the step of every status line and warning, and the name of the
checkpoint ``RUN_DIR/checkpoints/N`` (the state after step ``N``).

Files written before this convention numbered the updates from 0 (and the start -1):
:func:`counts_from_zero` recognises their ``metrics.jsonl``, :func:`renumbered` reads a record of
such a run under this convention (:func:`rft_jax.train.metrics_log.read_metrics` and
:func:`~rft_jax.train.metrics_log.read_run_records` do so for every reader), and
:func:`~rft_jax.train.metrics_log.renumber_run_files` rewrites a run's files when it is resumed.
"""

from __future__ import annotations

# The JSONL files of a run whose records carry a step.
RUN_FILES = ("metrics.jsonl", "rollouts.jsonl", "eval_completions.jsonl")


def _evaluation_key(key: str) -> bool:
  return key in ("step", "time", "timing/eval_s", "time_eval") or key.startswith(("eval/", "eval_"))


def counts_from_zero(records: list[dict]) -> bool:
  """Whether ``metrics.jsonl``'s ``records`` number the updates from 0 (written before the
  convention): a start at step -1, or a step 0 that holds an update's metrics (under the
  convention step 0 holds only the evaluation of the start)."""
  return any(r.get("step", 0) < 0 or (r.get("step") == 0 and not all(map(_evaluation_key, r)))
             for r in records)


def renumbered(record: dict) -> dict:
  """A record of a run numbered from 0, under the convention (its ``step`` plus one)."""
  return {**record, "step": record["step"] + 1} if "step" in record else record
