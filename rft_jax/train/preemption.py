"""SIGTERM and SIGINT end a run at a step boundary with a checkpoint.

Cloud schedulers send SIGTERM some time before they reclaim a machine, and Ctrl-C sends
SIGINT. Inside :class:`StopSignals` the first such signal is only recorded: the loop
finishes the step it is in, saves a checkpoint and stops (:class:`rft_jax.train.errors.Preempted`,
exit status 128 + the signal). A second signal exits at once. On several processes the
loop stops when any process has been signalled (:meth:`StopSignals.requested` agrees over
processes), so that all of them save the same step.
"""

from __future__ import annotations

import logging
import os
import signal
import threading

import jax
import numpy as np

from rft_jax.train.status import logger

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopSignals:
  """Records SIGTERM / SIGINT while active (a context manager; the main thread only: elsewhere,
  e.g. a run started from a worker thread, it records nothing and leaves the handlers alone)."""

  def __init__(self):
    self.signum: int | None = None
    self._previous: dict = {}

  def __enter__(self) -> "StopSignals":
    if threading.current_thread() is threading.main_thread():
      self._previous = {s: signal.signal(s, self._handle) for s in SIGNALS}
    return self

  def __exit__(self, *exc) -> None:
    for s, handler in self._previous.items():
      signal.signal(s, handler)
    self._previous = {}

  def _handle(self, signum: int, frame) -> None:
    del frame
    name = signal.Signals(signum).name
    if self.signum is not None:
      logger.error("second signal (%s): exiting now, without a checkpoint of this step", name)
      logging.shutdown()
      os._exit(128 + signum)
    self.signum = signum
    logger.warning("received %s: finishing this step, then saving a checkpoint and stopping (send "
                   "it again to exit at once)", name)

  def requested(self) -> int | None:
    """The signal to stop for, if any process has received one (a collective call)."""
    signum = self.signum or 0
    if jax.process_count() > 1:
      from jax.experimental import multihost_utils

      signum = int(np.max(multihost_utils.process_allgather(np.int32(signum))))
    return signum or None
