"""A run's status lines through :mod:`logging`: what a log file of a multi-day job should say.

The loop logs each event once on the ``rft_jax`` logger (config loaded, model loaded with its
size, dtype and mesh, the first step's compile time, each evaluation, each checkpoint, a resume,
every fault), where a progress bar only redraws one line. ``rft-jax`` commands call
:func:`configure_logging` (``--quiet``: warnings only; ``--verbose``: debug).
"""

from __future__ import annotations

import logging
import sys

logger = logging.getLogger("rft_jax")
FORMAT = "%(asctime)s rft-jax: %(message)s"


class _CurrentStderr(logging.StreamHandler):
  """Writes to ``sys.stderr`` as it is at each line (a redirected or captured stream too)."""

  def __init__(self):
    super().__init__()

  @property
  def stream(self):
    return sys.stderr

  @stream.setter
  def stream(self, value):
    del value


def configure_logging(verbosity: int = 0) -> None:
  """Status lines to standard error: ``verbosity`` -1 warnings only, 0 info, 1 debug."""
  level = {-1: logging.WARNING, 0: logging.INFO}.get(verbosity, logging.DEBUG)
  if not any(isinstance(h, _CurrentStderr) for h in logger.handlers):
    handler = _CurrentStderr()
    handler.setFormatter(logging.Formatter(FORMAT, datefmt="%H:%M:%S"))
    logger.addHandler(handler)
    logger.propagate = False
  logger.setLevel(level)
