"""One worker process: a fresh interpreter that can be killed alone, with everything it started.

Shared by the reward checks' pool (``pool.py``) and the environments' workers
(``rft_jax/environments/workers.py``); the reasons for the design are the same for both, and
are given in ``pool.py``'s docstring: ``concurrent.futures.ProcessPoolExecutor`` cannot kill one
worker, and ``multiprocessing``'s ``spawn`` / ``forkserver`` re-import the parent's
``__main__`` (``fork`` is unsafe in a process holding JAX/XLA threads). So a worker is
``python -c`` importing only this module and the module of its ``serve`` function, talking to
the parent over a socket pair with ``multiprocessing``'s pickling ``Connection``.

A worker:

* sees ``CUDA_VISIBLE_DEVICES=""`` and ``JAX_PLATFORMS=cpu``: it never touches an accelerator;
* leads its own process group, so :meth:`WorkerProcess.kill` (``SIGKILL`` to the group) also
  ends any process the called code started;
* ignores ``SIGINT`` and ``SIGTERM`` (the trainer's to handle: it finishes its step, which
  needs the workers) and ends with its parent, even a parent that was killed.

Nothing here imports the rest of the project.
"""

from __future__ import annotations

import concurrent.futures
import functools
import importlib
import multiprocessing.connection as mp_connection
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Callable, Iterator, Optional

# The worker's whole command line: take the parent's sys.path, then serve.
_BOOTSTRAP = (
    "import sys\n"
    "from multiprocessing.connection import Connection\n"
    "conn = Connection(int(sys.argv[1]))\n"
    "sys.path[:] = conn.recv()\n"
    "from rft_jax.rewards.worker_process import become_worker\n"
    "become_worker(int(sys.argv[2]), sys.argv[3])(conn)\n"
)


def _exit_with_parent(parent_pid: int) -> None:
  """End this worker when the parent dies, even if it is killed (no atexit runs).

  On Linux, ``PR_SET_PDEATHSIG`` has the kernel send ``SIGKILL`` -- which also ends a
  worker stuck in one long C call -- when the parent *thread* that started the worker
  exits; workers are therefore started from one long-lived thread (:func:`_launch`).
  A watchdog thread polling the parent pid is the fallback elsewhere.
  """
  if sys.platform.startswith("linux"):
    try:
      import ctypes

      ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG = 1
    except (OSError, AttributeError):
      pass
  if os.getppid() != parent_pid:
    os._exit(0)

  def watch():
    while os.getppid() == parent_pid:
      time.sleep(1.0)
    os._exit(0)

  threading.Thread(target=watch, daemon=True).start()


def become_worker(parent_pid: int, serve: str) -> Callable:
  """In the worker: ignore Ctrl-C and SIGTERM, die with the parent, and return the function
  named by ``serve`` (``"module:function"``), which the bootstrap calls with the connection."""
  # Ctrl-C and a scheduler's SIGTERM (often sent to the whole process group) are the trainer's to
  # handle: it finishes its step, which needs these workers. They end with it.
  signal.signal(signal.SIGINT, signal.SIG_IGN)
  signal.signal(signal.SIGTERM, signal.SIG_IGN)
  _exit_with_parent(parent_pid)
  module, _, function = serve.partition(":")
  return getattr(importlib.import_module(module), function)


_launcher: Optional[tuple[int, queue.SimpleQueue]] = None  # (pid, request queue)
_launcher_lock = threading.Lock()


def received(conn) -> Iterator[bytes]:
  """A worker's loop over the messages its parent sends, until the parent goes away."""
  while True:
    try:
      yield conn.recv_bytes()
    except (EOFError, OSError):
      return


def _launcher_loop(requests: queue.SimpleQueue) -> None:
  while True:
    start, future = requests.get()
    try:
      future.set_result(start())
    except BaseException as e:  # noqa: BLE001 - handed to the caller
      future.set_exception(e)


def _launch(cmd: list[str], **kwargs) -> subprocess.Popen:
  """``subprocess.Popen`` run on one daemon thread that lives as long as the process,
  so a worker's parent-death signal fires at process exit, not when the calling
  thread ends (a daemon thread, unlike an executor's, is not joined at shutdown while
  other threads may still use the pool)."""
  global _launcher
  with _launcher_lock:
    if _launcher is None or _launcher[0] != os.getpid():  # none yet, or we are a fork
      requests: queue.SimpleQueue = queue.SimpleQueue()
      threading.Thread(target=_launcher_loop, args=(requests,), name="rft-pool-launcher", daemon=True).start()
      _launcher = (os.getpid(), requests)
  future: concurrent.futures.Future = concurrent.futures.Future()
  _launcher[1].put((functools.partial(subprocess.Popen, cmd, **kwargs), future))
  return future.result()


def _worker_env() -> dict[str, str]:
  env = dict(os.environ)
  env.update(CUDA_VISIBLE_DEVICES="", JAX_PLATFORMS="cpu")
  return env


class WorkerProcess:
  """One worker process and the parent's end of its socket (``conn``).

  Args:
    serve: ``"module:function"``, importable from the parent's ``sys.path``: the worker calls
      ``function(conn)`` with its end of the socket and exits when it returns.
  """

  def __init__(self, serve: str):
    parent, child = socket.socketpair()
    with child:
      self.process = _launch(
          [sys.executable, "-c", _BOOTSTRAP, str(child.fileno()), str(os.getpid()), serve],
          pass_fds=(child.fileno(),), stdin=subprocess.DEVNULL, env=_worker_env(), close_fds=True,
          process_group=0)
    self.conn = mp_connection.Connection(parent.detach())
    self.conn.send(list(sys.path))

  def exitcode(self) -> Optional[int]:
    """The exit status, waiting up to a second for it; None if the worker still runs."""
    try:
      return self.process.wait(timeout=1)
    except subprocess.TimeoutExpired:
      return None

  def kill(self, grace_s: float = 0.0) -> None:
    """``SIGKILL`` the worker's process group (after waiting ``grace_s`` for it to exit) and
    close the parent's end of the socket."""
    if grace_s > 0:
      try:
        self.process.wait(timeout=grace_s)
      except subprocess.TimeoutExpired:
        pass
    if self.process.poll() is None:  # not reaped: the group id is still the worker's own
      try:
        os.killpg(self.process.pid, signal.SIGKILL)
      except (ProcessLookupError, PermissionError):
        self.process.kill()
    self.exitcode()
    self.conn.close()

  def ask_to_stop(self) -> None:
    """Send None, which a worker's serve loop takes as the end."""
    try:
      self.conn.send(None)
    except (OSError, ValueError):
      pass
