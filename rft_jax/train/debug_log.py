"""``RUN_DIR/debug.log``: what a run's one-line status and fault lines leave out.

A fault ends a run with one line on the console (:mod:`rft_jax.train.errors`); the details a
developer wants afterwards go here: the tracebacks of a checkpoint save that failed, and the
records of the libraries that write checkpoints (:data:`LIBRARY_LOGGERS`: orbax logs through
absl, and its failed writes leave asyncio's "exception was never retrieved" and, collected at
exit, "coroutine ... was never awaited" warnings; TensorStore prints
its callbacks' errors through ``sys.unraisablehook``: those whose traceback starts in
:data:`LIBRARY_PACKAGES`). All of these otherwise reach the console: a save that fails on a full
disk printed hundreds of lines of tracebacks. The run's status lines are copied in for context.
Other processes than 0 write ``debug.<process>.log``.

A save that failed leaves orbax's work behind, which reports only when it is collected (at
exit): :func:`linger` keeps the libraries' records going to the run's debug log after the run
ends, until the process exits or the next run starts. A record that cannot be written (on the
full disk the console line names) is dropped quietly.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import warnings
from collections.abc import Iterator

from rft_jax.train.status import logger

DEBUG_LOG = "debug.log"
LIBRARY_LOGGERS = ("absl", "asyncio")
LIBRARY_PACKAGES = ("asyncio", "orbax", "tensorstore", "absl")  # whose code an uncaught error starts in
# Details for the debug log only, never the console (its own handlers; not propagated to "rft_jax").
debug_logger = logging.getLogger("rft_jax.debug")
debug_logger.setLevel(logging.DEBUG)
debug_logger.propagate = False


class _QuietFileHandler(logging.FileHandler):
  """A log file whose write errors are dropped, not printed ("--- Logging error ---")."""

  def handleError(self, record: logging.LogRecord) -> None:
    del record


class _Redirect:
  """The debug log's hold on the loggers and on ``sys.excepthook`` / ``sys.unraisablehook``,
  undone by :meth:`release`."""

  def __init__(self, path: str):
    self.handler = _QuietFileHandler(path)
    self.handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s: %(message)s"))
    self.libraries = [logging.getLogger(name) for name in LIBRARY_LOGGERS]
    self.propagate = [library.propagate for library in self.libraries]
    self.excepthook, self.unraisablehook = sys.excepthook, sys.unraisablehook
    self.linger = False
    for target in (debug_logger, logger, *self.libraries):
      target.addHandler(self.handler)
    for library in self.libraries:
      library.propagate = False
    sys.excepthook, sys.unraisablehook = self._excepthook, self._unraisablehook
    self.showwarning = warnings.showwarning
    warnings.showwarning = self._showwarning

  def _showwarning(self, message, category, filename, lineno, file=None, line=None) -> None:
    """After a failed save (:func:`linger`), the "coroutine ... was never awaited" warnings of
    orbax's abandoned writes, collected at exit, to the debug log; every other warning as before."""
    if self.linger and issubclass(category, RuntimeWarning) and "was never awaited" in str(message):
      debug_logger.warning("%s: %s", category.__name__, message)
    else:
      self.showwarning(message, category, filename, lineno, file, line)

  def _excepthook(self, kind, value, tb) -> None:
    """An error a library's C code printed (TensorStore's callbacks on a closed event loop, after
    a failed save) to the debug log; every other uncaught exception as before."""
    if _in_library(tb):
      debug_logger.error("uncaught in %s:", threading.current_thread().name, exc_info=(kind, value, tb))
    else:
      self.excepthook(kind, value, tb)

  def _unraisablehook(self, unraisable) -> None:
    if _in_library(unraisable.exc_traceback):
      debug_logger.error("ignored in %s: %s", threading.current_thread().name, unraisable.err_msg or "",
                         exc_info=(unraisable.exc_type, unraisable.exc_value, unraisable.exc_traceback))
    else:
      self.unraisablehook(unraisable)

  def release(self) -> None:
    if sys.excepthook == self._excepthook:
      sys.excepthook = self.excepthook
    if sys.unraisablehook == self._unraisablehook:
      sys.unraisablehook = self.unraisablehook
    if warnings.showwarning == self._showwarning:
      warnings.showwarning = self.showwarning
    for library, was in zip(self.libraries, self.propagate):
      library.propagate = was
    for target in (debug_logger, logger, *self.libraries):
      target.removeHandler(self.handler)
    self.handler.close()


_current: _Redirect | None = None


def _in_library(tb) -> bool:
  """Whether a traceback starts in the code of one of :data:`LIBRARY_PACKAGES`."""
  outermost = tb.tb_frame.f_code.co_filename if tb is not None else ""
  return any(f"{os.sep}{name}{os.sep}" in outermost for name in LIBRARY_PACKAGES)


def debug_log_path(run_dir: str, process_index: int = 0) -> str:
  return os.path.join(run_dir, DEBUG_LOG if process_index == 0 else f"debug.{process_index}.log")


@contextlib.contextmanager
def debug_log(run_dir: str, process_index: int = 0) -> Iterator[str]:
  """While inside, :data:`debug_logger`, the :data:`LIBRARY_LOGGERS`' records, the status lines
  and the libraries' uncaught exceptions are appended to the run's debug log, and the
  libraries' records no longer reach the console (after it too, with :func:`linger`). Yields
  the file's path."""
  global _current
  if _current is not None:  # an earlier run's, lingering
    _current.release()
  path = debug_log_path(run_dir, process_index)
  os.makedirs(run_dir, exist_ok=True)
  _current = redirect = _Redirect(path)
  try:
    yield path
  finally:
    if not redirect.linger:
      redirect.release()
      _current = None


def linger() -> None:
  """Keeps the current run's debug log holding the libraries' records after the run ends (see
  the module docstring); called when a checkpoint save fails."""
  if _current is not None:
    _current.linger = True
