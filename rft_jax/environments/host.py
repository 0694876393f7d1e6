"""The worker process's side of ``workers.py``: it hosts environments and runs their calls.

A worker holds one environment object per trajectory pinned to it and runs one call at a time:
``start`` (make the environment, ``init``), ``step``, ``close``, and ``restore`` (make it again,
``init``, then replay the steps it had taken, after the worker that held it was killed). Each
call's answer is ``(status, output, error)``: ``ok``; ``error`` when the environment raised (one
line, ``ExceptionType: message``; the worker lives on); ``bad_output`` when what it returned
failed :func:`~rft_jax.environments.base.check_step_output`. Timeouts are the parent's: it kills
the worker.

Nothing here imports jax; the worker's environment is set by ``rft_jax/rewards/worker_process.py``.
"""

from __future__ import annotations

import pickle
from typing import Any, Optional

from rft_jax.environments.base import Environment
from rft_jax.environments.base import EnvironmentOutputError
from rft_jax.environments.base import StepOutput
from rft_jax.environments.base import check_messages
from rft_jax.environments.base import check_step_output
from rft_jax.environments.registry import construct
from rft_jax.rewards.worker_process import received

READY = "__ready__"
_ERROR_CHARS = 500  # an environment's exception is reported as one line of at most this

Answer = tuple[str, Any, Optional[str]]  # (status, output, error)


def one_line(error: BaseException) -> str:
  """``ExceptionType: message``, the message's first line, cut to a few hundred characters."""
  message = str(error).strip().splitlines()
  text = f"{type(error).__name__}: {message[0]}" if message else type(error).__name__
  return text if len(text) <= _ERROR_CHARS else text[:_ERROR_CHARS - 3] + "..."


def step_digest(status: str, output: Any) -> tuple:
  """What a replayed step must reproduce: its status, and an ``ok`` step's reward and done."""
  return (status, output["reward"], output["done"]) if status == "ok" else (status,)


class Host:
  """The environments of one worker, by trajectory."""

  def __init__(self):
    self.envs: dict[int, tuple[str, Environment]] = {}

  def start(self, trajectory: int, factory, spec, prompt: list, extras: dict) -> Answer:
    """Makes the environment and calls ``init``; output: init's messages as ``observations``,
    its info as ``metadata``, reward 0, not done."""
    try:
      env = construct(factory, spec, extras)
      initial = env.init(prompt)
    except Exception as e:  # noqa: BLE001 - the environment's fault, reported
      return "error", None, one_line(e)
    try:
      if not isinstance(initial, tuple) or len(initial) != 2 or not isinstance(initial[1], dict):
        raise EnvironmentOutputError(f"environment {spec.name!r} init returned {type(initial).__name__}, "
                                     "not (messages, info dict)")
      messages = check_messages(initial[0], spec.name, "init's messages")
    except EnvironmentOutputError as e:
      _close_quietly(env)
      return "bad_output", None, str(e)
    self.envs[trajectory] = (spec.name, env)
    return "ok", StepOutput(observations=messages, reward=0.0, done=False, metadata=dict(initial[1])), None

  def step(self, trajectory: int, action: str) -> Answer:
    if trajectory not in self.envs:
      return "error", None, f"KeyError: trajectory {trajectory} has no environment on this worker"
    name, env = self.envs[trajectory]
    try:
      out = env.step(action)
    except Exception as e:  # noqa: BLE001
      return "error", None, one_line(e)
    try:
      return "ok", check_step_output(out, name), None
    except EnvironmentOutputError as e:
      return "bad_output", None, str(e)

  def close(self, trajectory: int) -> Answer:
    name_env = self.envs.pop(trajectory, None)
    if name_env is None:
      return "ok", None, None
    try:
      name_env[1].close()
    except Exception as e:  # noqa: BLE001
      return "error", None, one_line(e)
    return "ok", None, None

  def restore(self, trajectory: int, factory, spec, prompt: list, extras: dict,
              steps: list[tuple[str, tuple]]) -> Answer:
    """``start``, then each recorded ``(action, digest)`` step again; an ``error`` unless every
    replayed step reproduces its digest (the environment is not deterministic)."""
    status, _, error = self.start(trajectory, factory, spec, prompt, extras)
    if status != "ok":
      return "error", None, f"replaying init: {status}: {error}"
    for i, (action, digest) in enumerate(steps):
      status, output, error = self.step(trajectory, action)
      if step_digest(status, output) != digest:
        self.close(trajectory)
        return "error", None, (f"replay diverged at step {i}: {step_digest(status, output)} where the "
                               f"first run gave {digest} (a non-deterministic environment)")
    return "ok", None, None

  def close_all(self) -> None:
    for trajectory in list(self.envs):
      self.close(trajectory)


def _close_quietly(env: Any) -> None:
  try:
    env.close()
  except Exception:  # noqa: BLE001 - its output was already bad; that is the report
    pass


def _answer_bytes(answer: Answer) -> bytes:
  """The answer pickled; an output that cannot be pickled is a ``bad_output``."""
  try:
    return pickle.dumps(answer)
  except Exception as e:  # noqa: BLE001
    return pickle.dumps(("bad_output", None, f"the output cannot be sent: {one_line(e)}"))


def serve(conn) -> None:
  """Worker loop: report ready, then answer ``(kind, trajectory, *args)`` calls until None or the
  parent goes away; closes every environment on the way out."""
  host = Host()
  conn.send(READY)
  try:
    for msg in received(conn):
      try:
        call = pickle.loads(msg)  # here, so that a factory it cannot import is an error
      except Exception as e:  # noqa: BLE001
        conn.send_bytes(_answer_bytes(("error", None, one_line(e))))
        continue
      if call is None:
        return
      kind, *args = call
      run = {"start": host.start, "step": host.step, "close": host.close, "restore": host.restore}[kind]
      conn.send_bytes(_answer_bytes(run(*args)))
  finally:
    host.close_all()
