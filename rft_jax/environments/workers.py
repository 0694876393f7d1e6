r"""Worker processes that host one environment per trajectory, each call bounded in time.

An environment is user code that may hang (a tool that never returns, a sandbox that waits on
input) or raise, and it runs while the sampler keeps decoding the other trajectories. So
environments live in worker processes -- fresh interpreters, for the reasons
``rft_jax/rewards/pool.py`` gives, started by ``rft_jax/rewards/worker_process.py``: no
accelerator (``CUDA_VISIBLE_DEVICES=""``, ``JAX_PLATFORMS=cpu``), no jax, killable alone with
what they started -- and the calls are non-blocking: :meth:`EnvironmentWorkers.start`,
:meth:`~EnvironmentWorkers.step` and :meth:`~EnvironmentWorkers.close` return futures of an
:class:`Outcome`, resolved as the calls finish; calls to different workers run in parallel.

Each trajectory (an int id) is pinned to one worker, the one holding the fewest trajectories
when it starts, which keeps its environment object between calls; a worker runs its calls one at
a time, in the order they were made. A call's clock starts when its worker takes it (so a queue
on a busy worker and a worker's start-up never count against the limit). A call ends ``ok``,
``error`` (the environment raised: the worker and the trajectory live on), ``bad_output`` (it
returned something ``check_step_output`` rejects) or ``timeout`` (no answer within
``step_timeout_s``); ``start``'s output holds init's messages as ``observations``.

A timeout is recovered thus: the worker's process group gets ``SIGKILL``, a new worker starts in
its place, and the trajectory whose call timed out is over (its later calls are errors; ``close``
is a no-op). Every other trajectory pinned to that worker is restored on the new one by replay:
its environment is made again from the same spec and row, ``init`` gets the same prompt and
``step`` the same actions, in order, before any call made since -- so environments must be
deterministic given their row (seed any randomness from it, as ``GuessNumber`` does). A replayed
step must reproduce its status, reward and done, else the trajectory cannot be restored and its
later calls are errors that say so; a replay is bounded by ``step_timeout_s`` per replayed call.
A worker that dies (a crash, ``os._exit``) is treated the same way, its call an ``error``.
"""

from __future__ import annotations

import collections
import concurrent.futures
import multiprocessing.connection as mp_connection
import pickle
import socket
import threading
import time
from typing import Any, Optional

from rft_jax.environments.base import Outcome
from rft_jax.environments.host import READY
from rft_jax.environments.records import Call
from rft_jax.environments.records import TrajectoryRecord
from rft_jax.environments.records import WorkerSlot
from rft_jax.environments.registry import EnvironmentSpec
from rft_jax.environments.registry import environment_factory

_MAX_STARTUP_FAILURES = 3


class EnvironmentWorkers:
  """``num_workers`` processes hosting trajectories' environments (module docstring).

  Args:
    num_workers: worker processes (calls running at once).
    step_timeout_s: the longest a call (``start``, ``step``, ``close``) may run once its worker
      took it.
    startup_timeout_s: the longest a worker may take to start; more than three starts in a row
      that fail break the pool (its pending futures then raise ``RuntimeError``, as do its calls).

  Futures resolve on the pool's own thread: their callbacks run there and must be quick.
  """

  def __init__(self, num_workers: int, step_timeout_s: float, startup_timeout_s: float = 60.0):
    if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 1:
      raise ValueError(f"num_workers must be an int >= 1, got {num_workers!r}")
    for name, value in (("step_timeout_s", step_timeout_s), ("startup_timeout_s", startup_timeout_s)):
      if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{name} must be > 0, got {value!r}")
    self.step_timeout_s = float(step_timeout_s)
    self.startup_timeout_s = float(startup_timeout_s)
    self.restarts = 0  # workers replaced after a timeout, a death or a failed start
    self._trajectories: dict[int, TrajectoryRecord] = {}
    self._lock = threading.Lock()
    self._to_resolve: list[tuple[Optional[concurrent.futures.Future], Any]] = []
    self._broken: Optional[str] = None
    self._closed = False
    self._startup_failures = 0  # in a row
    self._wake_read, self._wake_write = socket.socketpair()
    self._slots = [WorkerSlot() for _ in range(num_workers)]
    self._thread = threading.Thread(target=self._run, name="rft-environment-workers", daemon=True)
    self._thread.start()

  # ---------------------------------------------------------------- the caller's side

  def start(self, trajectory: int, spec: EnvironmentSpec, prompt_messages: list,
            extras: dict) -> concurrent.futures.Future:
    """Makes trajectory ``trajectory``'s environment on a worker and calls its ``init``.

    Args:
      trajectory: an id not running.
      spec: the environment and its config; its name is resolved here (an unknown one raises).
      prompt_messages: the row's chat messages, handed to ``init``.
      extras: the row's extras, handed to the environment's constructor.

    Returns:
      A future of the :class:`Outcome`; on ``ok`` its output's ``observations`` are the messages
      to start from. A failed start ends the trajectory.

    Raises:
      ValueError: a trajectory already running, or an unknown environment name.
      TypeError: a spec that is not an ``EnvironmentSpec``, or a factory, prompt or extras that
        cannot be sent to a worker.
    """
    if not isinstance(spec, EnvironmentSpec):
      raise TypeError(f"spec must be an EnvironmentSpec, got {type(spec).__name__}")
    factory = environment_factory(spec.name)
    record = TrajectoryRecord(spec, factory, list(prompt_messages), dict(extras), worker=0)
    call = ("start", trajectory, factory, spec, record.prompt, record.extras)
    try:
      payload = pickle.dumps(call)
    except Exception as e:
      raise TypeError(f"environment {spec.name!r}: cannot send its factory, spec, prompt or extras "
                      f"to a worker ({e})") from e
    with self._lock:
      self._check_open()
      if trajectory in self._trajectories:
        raise ValueError(f"trajectory {trajectory} is already running")
      load = [0] * len(self._slots)
      for other in self._trajectories.values():
        load[other.worker] += 1
      record.worker = load.index(min(load))
      self._trajectories[trajectory] = record
      return self._enqueue(record.worker, Call(trajectory, record, "start", payload, self.step_timeout_s))

  def step(self, trajectory: int, action: str) -> concurrent.futures.Future:
    """Hands the model's turn ``action`` to the trajectory's environment.

    Returns:
      A future of the :class:`Outcome`; an ``error`` at once for a trajectory that was lost.

    Raises:
      ValueError: a trajectory not running (never started, closed, or ended by a timeout or a
        failed start).
    """
    if not isinstance(action, str):
      raise TypeError(f"action must be a str, got {type(action).__name__}")
    with self._lock:
      self._check_open()
      record = self._trajectories.get(trajectory)
      if record is None:
        raise ValueError(f"trajectory {trajectory} is not running (never started, closed, or ended "
                         "by a timeout or a failed start)")
      if record.lost is not None:
        return _resolved(Outcome("error", None, record.lost))
      payload = pickle.dumps(("step", trajectory, action))
      return self._enqueue(record.worker, Call(trajectory, record, "step", payload, self.step_timeout_s,
                                                action=action))

  def close(self, trajectory: int) -> concurrent.futures.Future:
    """Closes the trajectory's environment; a no-op (a resolved ``ok``) for one not running.
    The future need not be waited on."""
    with self._lock:
      record = self._trajectories.pop(trajectory, None)
      if record is None or self._closed or self._broken:
        return _resolved(Outcome("ok"))
      return self._enqueue(record.worker, Call(trajectory, None, "close", pickle.dumps(("close", trajectory)),
                                                self.step_timeout_s))

  def worker_of(self, trajectory: int) -> int:
    """The index of the worker the trajectory is pinned to."""
    with self._lock:
      return self._trajectories[trajectory].worker

  def shutdown(self) -> None:
    """Stops the workers, which close their environments; calls not finished are cancelled
    (idempotent)."""
    with self._lock:
      if self._closed:
        return
      self._closed = True
    self._wake()
    self._thread.join()

  def __enter__(self) -> "EnvironmentWorkers":
    return self

  def __exit__(self, *exc) -> None:
    self.shutdown()

  def _check_open(self) -> None:
    if self._closed:
      raise RuntimeError("EnvironmentWorkers used after shutdown()")
    if self._broken:
      raise RuntimeError(self._broken)

  def _enqueue(self, worker: int, call: Call) -> concurrent.futures.Future:
    self._slots[worker].queue.append(call)
    self._wake()
    return call.future

  def _wake(self) -> None:
    try:
      self._wake_write.send(b"x")
    except OSError:
      pass

  # ---------------------------------------------------------------- the pool's thread

  def _run(self) -> None:
    """Hands calls to idle workers, collects answers, kills workers past their deadline."""
    try:
      while True:
        with self._lock:
          if self._closed or self._broken:
            break
          self._dispatch()
          wait_s = self._wait_s()
        conns = [slot.process.conn for slot in self._slots]
        answered = mp_connection.wait(conns + [self._wake_read], timeout=wait_s)
        with self._lock:
          if self._wake_read in answered:
            self._wake_read.recv(4096)
          for slot in [s for s in self._slots if s.process.conn in answered]:
            self._receive(slot)
          self._expire()
        self._flush()
    except BaseException as e:  # noqa: BLE001 - a bug here must not leave futures waiting forever
      with self._lock:
        self._break(f"EnvironmentWorkers' thread failed: {type(e).__name__}: {e}")
    finally:
      with self._lock:
        self._stop_workers()
      self._flush()

  def _dispatch(self) -> None:
    for slot in self._slots:
      if slot.ready and slot.running is None and slot.queue:
        call = slot.queue.popleft()
        try:
          slot.process.conn.send_bytes(call.payload)
        except (OSError, ValueError):  # died while idle: its answer (EOF) comes next
          slot.queue.appendleft(call)
          continue
        slot.running, slot.deadline = call, time.monotonic() + call.timeout_s

  def _wait_s(self) -> Optional[float]:
    deadlines = [s.deadline for s in self._slots if s.running is not None]
    deadlines += [s.spawned + self.startup_timeout_s for s in self._slots if not s.ready]
    return max(0.0, min(deadlines) - time.monotonic()) if deadlines else None

  def _receive(self, slot: WorkerSlot) -> None:
    try:
      answer = slot.process.conn.recv()
    except (EOFError, OSError):  # the worker died
      code = slot.process.exitcode()
      if slot.ready:
        self._fail(slot, "error", f"worker exited (exit code {code})")
      else:
        self._start_failed(slot, f"a worker exited during start-up (exit code {code})")
      return
    except Exception as e:  # noqa: BLE001 - an answer this process cannot unpickle
      answer = ("bad_output", None, f"the output cannot be received: {type(e).__name__}: {e}")
    if answer == READY:
      slot.ready, self._startup_failures = True, 0
      return
    call, slot.running = slot.running, None
    if call is not None:
      self._finished(slot, call, Outcome(*answer))

  def _finished(self, slot: WorkerSlot, call: Call, outcome: Outcome) -> None:
    record = call.record if call.record is self._trajectories.get(call.trajectory) else None
    if record is not None:
      if call.kind == "start" and outcome.status == "ok":
        record.started = True
      elif call.kind == "start":  # nothing was kept on the worker: the trajectory never began
        self._end(slot, call.trajectory, f"its start ended {outcome.status}")
      elif call.kind == "step":
        record.step_finished(call.action, outcome)
      elif call.kind == "restore" and outcome.status != "ok":
        self._lose(slot, call.trajectory, outcome)
    self._to_resolve.append((call.future, outcome))

  def _expire(self) -> None:
    now = time.monotonic()
    for slot in self._slots:
      if slot.running is not None and now >= slot.deadline:
        self._fail(slot, "timeout", f"no answer within {slot.running.timeout_s:g} s")
      elif not slot.ready and now >= slot.spawned + self.startup_timeout_s:
        self._start_failed(slot, f"a worker was not ready within startup_timeout_s={self.startup_timeout_s:g}")

  def _fail(self, slot: WorkerSlot, status: str, error: str) -> None:
    """The worker's call timed out or the worker died: kill it, start another, end the call's
    trajectory and restore the others pinned there by replay."""
    call, slot.running = slot.running, None
    self._replace(slot)
    if call is not None:
      if call.record is not None and call.record is self._trajectories.get(call.trajectory):
        if call.kind == "restore":
          self._lose(slot, call.trajectory, Outcome(status, None, error))
        else:
          self._end(slot, call.trajectory, f"its {call.kind} ended {status}")
      self._to_resolve.append((call.future, Outcome(status, None, error)))
    index = self._slots.index(slot)
    restores = [r.restore_call(t, self.step_timeout_s) for t, r in sorted(self._trajectories.items())
                if r.worker == index and r.started and r.lost is None]
    slot.queue = collections.deque(restores + [c for c in slot.queue if c.kind != "restore"])

  def _end(self, slot: WorkerSlot, trajectory: int, why: str) -> None:
    """The trajectory is over: forget it; the calls it has waiting are errors saying why."""
    self._trajectories.pop(trajectory, None)
    self._answer_waiting(slot, trajectory, f"trajectory {trajectory} is over: {why}")

  def _lose(self, slot: WorkerSlot, trajectory: int, outcome: Outcome) -> None:
    """The trajectory could not be restored: its calls, waiting and later, are errors saying why."""
    record = self._trajectories[trajectory]
    record.lost = (f"trajectory {trajectory} was lost with its worker and could not be restored "
                   f"({outcome.status}: {outcome.error})")
    self._answer_waiting(slot, trajectory, record.lost)

  def _answer_waiting(self, slot: WorkerSlot, trajectory: int, error: str) -> None:
    waiting = [c for c in slot.queue if c.trajectory == trajectory and c.kind in ("start", "step")]
    slot.queue = collections.deque(c for c in slot.queue if c not in waiting)
    self._to_resolve += [(call.future, Outcome("error", None, error)) for call in waiting]

  def _replace(self, slot: WorkerSlot) -> None:
    slot.replace_process()
    self.restarts += 1

  def _start_failed(self, slot: WorkerSlot, why: str) -> None:
    self._startup_failures += 1
    if self._startup_failures > _MAX_STARTUP_FAILURES:
      self._break(f"environment workers keep failing to start ({why}); see their tracebacks above")
    else:
      self._replace(slot)

  def _break(self, message: str) -> None:
    self._broken = message
    self._to_resolve += [(call.future, RuntimeError(message)) for s in self._slots for call in s.drain()]

  def _stop_workers(self) -> None:
    self._to_resolve += [(call.future, None) for s in self._slots for call in s.drain()]  # cancelled
    for slot in self._slots:
      slot.process.ask_to_stop()
    for slot in self._slots:
      slot.process.kill(grace_s=1.0 if slot.ready else 0.0)
    self._wake_read.close()
    self._wake_write.close()

  def _flush(self) -> None:
    """Resolves the futures decided under the lock, outside it (their callbacks may call in)."""
    with self._lock:
      done, self._to_resolve = self._to_resolve, []
    for future, result in done:
      if future is None or future.done():
        continue
      try:
        if result is None:
          future.cancel()
        elif isinstance(result, BaseException):
          future.set_exception(result)
        else:
          future.set_result(result)
      except concurrent.futures.InvalidStateError:  # cancelled by its caller meanwhile
        pass


def _resolved(outcome: Outcome) -> concurrent.futures.Future:
  future: concurrent.futures.Future = concurrent.futures.Future()
  future.set_result(outcome)
  return future
