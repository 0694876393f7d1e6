r"""Worker processes that run one call each under a hard wall-clock limit.

math-verify's own timeout is ``signal.alarm``: it only works in the main thread, and a
sympy computation stuck in C code does not see the signal until it returns. A
reward that hangs on ``9^{9^{9^{9}}}`` would stall training. Here every check runs in
a worker process; a call still running ``timeout_s`` after it was handed to its
worker is ended by ``SIGKILL`` and the worker is replaced.

Why not ``concurrent.futures.ProcessPoolExecutor``: it cannot kill one worker; killing
its process breaks the executor and fails every pending future with
``BrokenProcessPool``. Why not ``multiprocessing`` processes at all: with ``spawn`` or
``forkserver`` (``fork`` is unsafe in a process holding JAX/XLA threads) every worker
re-imports the parent's ``__main__`` -- a training script, with JAX -- and a script
without an ``if __name__ == "__main__":`` guard fails. So each worker is a fresh
interpreter (``worker_process.py``: ``python -c``) that imports only this module and
the called function's module, talking over a socket pair with ``multiprocessing``'s pickling
``Connection``. Workers see ``CUDA_VISIBLE_DEVICES=""`` and ``JAX_PLATFORMS=cpu``: they never
touch an accelerator. A killed worker's process group goes with it.

A task's clock starts when it is handed to a ready worker (a worker is ready once its
``initializer`` ran), so start-up time never counts against the limit. A replacement
worker starts in the background (~1 s to import sympy) while the others go on.
Outcomes come back in input order. ``map`` holds a lock: one batch at a time per pool,
callable from any thread.

A batch may also have a budget, ``map(..., budget_s=)``: a wall-clock limit on the whole
call, after which the calls still running are killed and those not started are not run, all
reported as ``timeout`` (value ``"budget"``) -- so a batch of hanging calls costs
``budget_s``, not one limit each. Waiting for workers to start counts against the budget,
but a pool whose workers never become ready still fails after ``startup_timeout_s``.

Nothing here imports the rest of the project.
"""

from __future__ import annotations

import collections
import multiprocessing.connection as mp_connection
import pickle
import threading
import time
from typing import Any, Callable, NamedTuple, Optional, Sequence

from rft_jax.rewards.worker_process import WorkerProcess, received

_READY = "__ready__"
_MAX_STARTUP_FAILURES = 3


class Outcome(NamedTuple):
  """Result of one call: ``status`` is ``ok`` (``value`` is the return value),
  ``timeout`` (``value`` is :data:`OVER_BUDGET` when the batch's budget, not the call's own
  limit, ended it) or ``error`` (``value`` names the exception or the worker's exit)."""

  status: str
  value: Any = None


OVER_BUDGET = "budget"  # the ``value`` of a ``timeout`` that the batch's budget ended


def _serve(conn) -> None:
  """Worker loop: set up, report ready, then receive ``(fn, args)`` and send back
  ``(ok, value)`` until None or the parent goes away."""
  initializer, memory_limit_mb = conn.recv()
  if memory_limit_mb is not None:
    import resource

    limit = int(memory_limit_mb) * 2**20
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
  if initializer is not None:
    initializer()
  conn.send(_READY)
  for msg in received(conn):
    try:
      task = pickle.loads(msg)  # here, so that a function it cannot import is an error
      if task is None:
        return
      fn, args = task
      conn.send((True, fn(*args)))
    except BaseException as e:  # noqa: BLE001 - reported to the parent, the worker lives on
      # Only the type: str() of a sympy object in the exception can itself hang.
      conn.send((False, type(e).__name__))


class _Worker(WorkerProcess):
  """A worker of the pool: its process, whether it is ready, its task and that task's deadline."""

  def __init__(self, initializer, memory_limit_mb):
    super().__init__("rft_jax.rewards.pool:_serve")
    self.conn.send((initializer, memory_limit_mb))
    self.ready = False
    self.task: Optional[int] = None
    self.deadline = 0.0


class TimeLimitedPool:
  """``num_workers`` processes running calls under a per-call wall-clock limit.

  Args:
    num_workers: worker processes (calls running at once).
    initializer: picklable, importable function each worker runs before it reports
      ready (imports, warm-up).
    memory_limit_mb: address-space limit (``RLIMIT_AS``) of each worker, or None; an
      allocation beyond it raises ``MemoryError`` in the worker (an ``error``).
    startup_timeout_s: how long ``map`` waits for a worker to become ready.
  """

  def __init__(
      self,
      num_workers: int = 4,
      *,
      initializer: Optional[Callable[[], None]] = None,
      memory_limit_mb: Optional[int] = None,
      startup_timeout_s: float = 120.0,
  ):
    if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 1:
      raise ValueError(f"num_workers must be an int >= 1, got {num_workers!r}")
    self.num_workers = num_workers
    self._initializer = initializer
    self._memory_limit_mb = memory_limit_mb
    self._startup_timeout_s = startup_timeout_s
    self._lock = threading.Lock()
    self._closed = False
    self.restarts = 0  # workers replaced after a timeout or a crash, over the pool's life
    self._startup_failures = 0  # consecutive deaths of starting workers
    self._workers = [self._spawn() for _ in range(num_workers)]

  def _spawn(self) -> _Worker:
    return _Worker(self._initializer, self._memory_limit_mb)

  def _replace(self, worker: _Worker) -> None:
    worker.kill()
    self._workers[self._workers.index(worker)] = self._spawn()
    self.restarts += 1

  def map(self, fn: Callable[..., Any], args: Sequence[tuple], timeout_s: float, *,
          budget_s: Optional[float] = None) -> list[Outcome]:
    """Run ``fn(*a)`` for each ``a`` in ``args``, each under ``timeout_s`` seconds.

    ``fn`` must be picklable by reference: a module-level function of an importable
    module (not ``__main__``). Returns one :class:`Outcome` per call, in input order.
    A call that times out or whose worker dies leaves the pool usable: its worker is
    replaced. ``budget_s`` (None: none) bounds the whole call: once it has passed, calls
    still running are killed and calls not started are skipped, each an
    ``Outcome("timeout", OVER_BUDGET)``.
    """
    for name, value in (("timeout_s", timeout_s), ("budget_s", budget_s)):
      if value is None and name == "budget_s":
        continue
      if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{name} must be > 0, got {value!r}")
    try:
      payloads = [pickle.dumps((fn, tuple(a))) for a in args]
    except Exception as e:
      raise TypeError(f"TimeLimitedPool.map: cannot pickle {fn!r} or its arguments ({e})") from e
    with self._lock:
      if self._closed:
        raise RuntimeError("TimeLimitedPool.map called after close()")
      try:
        end = float("inf") if budget_s is None else time.monotonic() + budget_s
        return self._map(payloads, float(timeout_s), end)
      except BaseException:
        for w in list(self._workers):  # a worker still busy would answer the next batch
          if w.task is not None:
            self._replace(w)
        raise

  def _map(self, payloads: list[bytes], timeout_s: float, end: float) -> list[Outcome]:
    """The batch; ``end``: the ``time.monotonic()`` at which its budget runs out (or inf)."""
    results: list[Optional[Outcome]] = [None] * len(payloads)
    pending = collections.deque(range(len(payloads)))
    idle_since = time.monotonic()
    dispatched = False  # until a worker has taken a task, the start-up limit applies, not the budget
    while pending or any(w.task is not None for w in self._workers):
      if pending and time.monotonic() >= end and (dispatched or any(w.ready for w in self._workers)):
        for task in pending:  # budget spent: what has not started never will
          results[task] = Outcome("timeout", OVER_BUDGET)
        pending.clear()
        continue
      for w in list(self._workers):  # hand out tasks to ready, idle workers
        if pending and w.ready and w.task is None:
          task = pending.popleft()
          try:
            w.conn.send_bytes(payloads[task])
          except (OSError, ValueError):  # died while idle: retry the task on another worker
            pending.appendleft(task)
            self._replace(w)
            continue
          w.task, w.deadline = task, min(time.monotonic() + timeout_s, end)
          dispatched = True
      busy = [w for w in self._workers if w.task is not None]
      now = time.monotonic()
      if busy:
        wait_s = max(0.0, min(w.deadline for w in busy) - now)
        idle_since = now
      else:  # nothing running: waiting for a (re)started worker to become ready
        wait_s = self._startup_timeout_s - (now - idle_since)
        if wait_s <= 0:
          raise RuntimeError(f"no worker became ready within startup_timeout_s={self._startup_timeout_s}")
        if dispatched:
          wait_s = min(wait_s, max(0.0, end - now))
      listening = [w.conn for w in self._workers if w.task is not None or not w.ready]
      for conn in mp_connection.wait(listening, timeout=wait_s):
        w = next(w for w in self._workers if w.conn is conn)
        try:
          msg = conn.recv()
        except (EOFError, OSError):  # the worker died
          code = w.exitcode()
          if w.task is None:  # during start-up: retry, unless start-up itself is broken
            self._startup_failures += 1
            if self._startup_failures > _MAX_STARTUP_FAILURES:
              raise RuntimeError(f"pool workers keep exiting during start-up (last exit code {code}); "
                                 "see their tracebacks above")
          else:
            results[w.task] = Outcome("error", f"worker exited (exit code {code})")
          self._replace(w)
          continue
        if msg == _READY:
          w.ready = True
          self._startup_failures = 0
        else:
          ok, value = msg
          results[w.task] = Outcome("ok", value) if ok else Outcome("error", value)
          w.task = None
      now = time.monotonic()
      for w in list(self._workers):
        if w.task is not None and now >= w.deadline:
          results[w.task] = Outcome("timeout", OVER_BUDGET if w.deadline >= end else None)
          self._replace(w)
    return results  # type: ignore[return-value]

  def close(self) -> None:
    """Stop the workers (idempotent)."""
    with self._lock:
      if self._closed:
        return
      self._closed = True
      for w in self._workers:
        w.ask_to_stop()
      for w in self._workers:
        w.kill(grace_s=1.0 if w.ready else 0.0)  # idle ready workers exit at once on None

  def __enter__(self) -> "TimeLimitedPool":
    return self

  def __exit__(self, *exc) -> None:
    self.close()

  def __del__(self):
    if not getattr(self, "_closed", True):
      self.close()
