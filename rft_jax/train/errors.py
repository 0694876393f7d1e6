"""Faults that end a run. Each is reported as one line naming its cause (the file, the step,
the process) and a non-zero exit status; none is silent, and none loses a checkpointed step."""

from __future__ import annotations


class RunError(RuntimeError):
  """A fault that ends a run; ``exit_code`` is the command's exit status."""

  exit_code = 1


class RunDirError(RunError):
  """The run directory cannot be used as asked: held by another trainer, holding another run's
  checkpoints, or resumed with a config that would not repeat the run."""


class WriteError(RunError):
  """A metrics, TensorBoard or checkpoint file could not be written (full disk, lost mount)."""


class NonFiniteError(RunError):
  """The loss or gradient norm stayed non-finite, or parameters to be saved are non-finite."""


class RewardError(RunError):
  """The rewards of more than ``rewards.max_error_fraction`` of a step's completions could not
  be computed (a reward function that fails, hangs or returns NaN): the run stops rather than
  train on zeros."""


class CorruptCheckpointError(RunError):
  """A checkpoint that cannot be restored (unreadable files, or arrays that fail their checksum)."""


class Preempted(RunError):
  """SIGTERM / SIGINT: the run finished its step, checkpointed it and stopped (exit 128 + signal)."""

  def __init__(self, message: str, signum: int):
    super().__init__(message)
    self.exit_code = 128 + signum
