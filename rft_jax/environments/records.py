"""What the trainer's side of ``workers.py`` keeps: trajectories, calls, and worker slots.

A :class:`TrajectoryRecord` holds what replaying a trajectory needs after its worker was
killed: its spec, row and prompt, and the action and digest of each step it finished (the digest,
:func:`~rft_jax.environments.host.step_digest`, is what the replay must reproduce). A
:class:`Call` is one message for a worker with its time limit and future; a :class:`WorkerSlot`
is one worker process with the calls waiting for it and the one it runs.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import pickle
import time
from typing import Any, Optional

from rft_jax.environments.base import Message
from rft_jax.environments.base import Outcome
from rft_jax.environments.host import step_digest
from rft_jax.environments.registry import EnvironmentSpec
from rft_jax.rewards.worker_process import WorkerProcess

_SERVE = "rft_jax.environments.host:serve"  # what a worker process runs


@dataclasses.dataclass(eq=False)
class Call:
  """One call for a worker: ``payload`` is the pickled ``(kind, trajectory, *args)``.

  Attributes:
    trajectory: the trajectory's id.
    record: the trajectory it was made for (None for a close: the record is gone by then).
    kind: ``start``, ``step``, ``close`` or ``restore``.
    payload: what is sent.
    timeout_s: its limit once the worker took it.
    future: resolved with its :class:`~rft_jax.environments.base.Outcome` (None: a restore).
    action: a step's action.
  """

  trajectory: int
  record: Optional["TrajectoryRecord"]
  kind: str
  payload: bytes
  timeout_s: float
  future: Optional[concurrent.futures.Future] = dataclasses.field(default_factory=concurrent.futures.Future)
  action: Optional[str] = None


@dataclasses.dataclass(eq=False)
class TrajectoryRecord:
  """What the trainer keeps of a trajectory to restore it by replay.

  Attributes:
    spec: its environment.
    factory: the environment's factory, resolved in the trainer (``environment_factory``).
    prompt: the messages its ``init`` got.
    extras: its row's extras.
    worker: the index of the worker it is pinned to.
    started: whether its ``init`` answered ``ok`` (its worker holds the environment).
    steps: ``(action, digest)`` of each step that finished (not timed out), in order.
    lost: why it cannot go on (its restore failed), or None.
  """

  spec: EnvironmentSpec
  factory: Any
  prompt: list[Message]
  extras: dict[str, Any]
  worker: int = 0
  started: bool = False
  steps: list[tuple[str, tuple]] = dataclasses.field(default_factory=list)
  lost: Optional[str] = None

  def step_finished(self, action: str, outcome: Outcome) -> None:
    self.steps.append((action, step_digest(outcome.status, outcome.output)))

  def restore_call(self, trajectory: int, step_timeout_s: float) -> Call:
    """The call that remakes its environment and replays its steps, ``step_timeout_s`` for
    each replayed call."""
    payload = pickle.dumps(("restore", trajectory, self.factory, self.spec, self.prompt, self.extras,
                            list(self.steps)))
    return Call(trajectory, self, "restore", payload, step_timeout_s * (1 + len(self.steps)), future=None)


class WorkerSlot:
  """A worker process, the calls waiting for it (``queue``) and the one it runs (``running``,
  due by ``deadline``)."""

  def __init__(self):
    self.process = WorkerProcess(_SERVE)
    self.spawned = time.monotonic()
    self.ready = False
    self.queue: collections.deque[Call] = collections.deque()
    self.running: Optional[Call] = None
    self.deadline = 0.0

  def replace_process(self) -> None:
    """Kill the worker (and its process group); start another, not ready yet."""
    self.process.kill()
    self.process, self.spawned, self.ready = WorkerProcess(_SERVE), time.monotonic(), False

  def drain(self) -> list[Call]:
    """The running call and those waiting, taken off the worker."""
    calls = ([self.running] if self.running else []) + list(self.queue)
    self.running, self.queue = None, collections.deque()
    return calls
