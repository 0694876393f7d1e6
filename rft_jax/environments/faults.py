"""A step's environment calls counted by outcome, and the bound on the fraction that failed.

Rewards have ``rewards.max_error_fraction``: a step whose completions' rewards could not be
computed beyond that fraction stops the run (``rft_jax/train/step_rollouts.py``,
``check_reward_failures``) rather than train on zeros. Environments get the same: an environment
that raises, hangs or returns garbage in more than ``limit`` of a step's calls stops the run
with one line naming it and the counts, instead of training on trajectories cut short. A
fraction at the limit passes; only above it fails.
"""

from __future__ import annotations

import dataclasses
from typing import Iterable

from rft_jax.environments.base import STATUSES
from rft_jax.environments.base import Outcome


class EnvironmentFaultError(RuntimeError):
  """More than the allowed fraction of a step's environment calls failed (one line)."""


@dataclasses.dataclass
class EnvironmentCounts:
  """How a batch's environment calls ended (one count per :data:`~rft_jax.environments.base.STATUSES`).

  Attributes:
    ok: calls the environment answered.
    error: calls where it raised (or its worker died).
    timeout: calls with no answer in time.
    bad_output: calls whose output failed ``check_step_output``.
  """

  ok: int = 0
  error: int = 0
  timeout: int = 0
  bad_output: int = 0

  @classmethod
  def of(cls, outcomes: Iterable[Outcome]) -> "EnvironmentCounts":
    """The counts of ``outcomes``."""
    counts = cls()
    for outcome in outcomes:
      counts.add(outcome)
    return counts

  def add(self, outcome: Outcome) -> None:
    """Counts one outcome.

    Raises:
      ValueError: a status that is none of :data:`~rft_jax.environments.base.STATUSES`.
    """
    if outcome.status not in STATUSES:
      raise ValueError(f"unknown environment outcome status {outcome.status!r}; one of {STATUSES}")
    setattr(self, outcome.status, getattr(self, outcome.status) + 1)

  @property
  def failed(self) -> int:
    """Calls that did not end ``ok``."""
    return self.error + self.timeout + self.bad_output

  @property
  def total(self) -> int:
    return self.ok + self.failed

  def metrics(self, prefix: str = "env/") -> dict[str, int]:
    """The counts by name, for logging: ``env/ok``, ``env/error``, ``env/timeout``, ..."""
    return {f"{prefix}{status}": getattr(self, status) for status in STATUSES}


def check_fault_fraction(counts: EnvironmentCounts, limit: float, env_name: str) -> None:
  """Raises if more than ``limit`` of the step's environment calls failed.

  Args:
    counts: the step's calls by outcome.
    limit: the largest fraction of failed calls allowed, in [0, 1].
    env_name: the environment's name, for the message.

  Raises:
    ValueError: a limit outside [0, 1].
    EnvironmentFaultError: ``counts.failed / counts.total > limit``; one line naming the
      environment, the counts by kind, the fraction and the limit.
  """
  if isinstance(limit, bool) or not isinstance(limit, (int, float)) or not 0 <= limit <= 1:
    raise ValueError(f"the environment fault limit must be a number in [0, 1], got {limit!r}")
  failed, total = counts.failed, counts.total
  if total and failed / total > limit:
    raise EnvironmentFaultError(
        f"environment {env_name} failed or timed out in {failed} of {total} calls ({failed / total:.0%}) "
        f"this step ({counts.error} errors: raised or its worker died; {counts.timeout} timeouts; "
        f"{counts.bad_output} bad outputs), above the limit of {limit:.0%}; stopping rather than "
        "training on trajectories cut short")
