"""What a text environment is, and the check of what it returns.

The interface is skyrl-gym's (``skyrl_gym/envs/base_text_env.py``), so that its environments run
here unchanged: ``init(prompt)`` takes the dataset row's chat messages and returns the messages
the model starts from and an info dict; ``step(action)`` takes the model's whole turn as text and
returns a :class:`StepOutput` -- the messages to append (a user's or a tool's reply), the turn's
reward and whether the episode is over; ``close()`` frees what the environment holds.

An environment is user code, run in a worker process (``workers.py``): what it returns is
checked there by :func:`check_step_output` before it reaches the sampler, and a wrong type, a
NaN reward or a message without ``content`` is one line naming the environment and the field.
"""

from __future__ import annotations

import math
import numbers
from typing import Any, NamedTuple, Optional, Protocol, TypedDict, runtime_checkable

Message = dict[str, str]  # an OpenAI-style chat message: {"role": "user", "content": "Higher."}
STATUSES = ("ok", "error", "timeout", "bad_output")  # how a call to an environment can end

_REPR_CHARS = 80  # a bad value is shown by its repr, cut to this many characters


class StepOutput(TypedDict, total=False):
  """What ``Environment.step`` returns (skyrl-gym's ``BaseTextEnvStepOutput``).

  Attributes:
    observations: the chat messages to append after the model's turn (``[]``: none).
    reward: the turn's reward, a finite real number.
    done: whether the episode is over.
    metadata: anything else, for logging.
    postprocessed_action: the model's turn as the environment rewrote it (optional, skyrl-gym's:
      e.g. cut after a tool call's closing tag), or None.
  """

  observations: list[Message]
  reward: float
  done: bool
  metadata: dict[str, Any]
  postprocessed_action: Optional[str]


@runtime_checkable
class Environment(Protocol):
  """A text environment with skyrl-gym's API; one object per trajectory."""

  def init(self, prompt: list[Message]) -> tuple[list[Message], dict[str, Any]]:
    """The messages the model starts from (usually ``prompt`` itself) and an info dict."""

  def step(self, action: str) -> StepOutput:
    """Take the model's turn ``action``; the reply, the turn's reward, whether it is over."""

  def close(self) -> None:
    """Free what the environment holds; calling it twice is harmless."""


class Outcome(NamedTuple):
  """How one call to an environment ended (``workers.py``).

  Attributes:
    status: ``ok``; ``error`` (it raised, or its worker died); ``timeout``; ``bad_output`` (what
      it returned failed :func:`check_step_output`).
    output: the checked :class:`StepOutput` when ``ok``, else None.
    error: one line saying what went wrong (``ExceptionType: message``), None when ``ok``.
  """

  status: str
  output: Optional[StepOutput] = None
  error: Optional[str] = None


class EnvironmentOutputError(ValueError):
  """An environment returned something that is not a valid :class:`StepOutput` (one line)."""


def _shown(value: Any) -> str:
  text = repr(value)
  return text if len(text) <= _REPR_CHARS else text[:_REPR_CHARS - 3] + "..."


def _is_bool(value: Any) -> bool:
  """A Python bool or numpy's (``done = turns >= max_turns`` on numpy integers)."""
  kind = type(value)
  return isinstance(value, bool) or (kind.__module__ == "numpy" and kind.__name__ in ("bool", "bool_"))


def check_messages(messages: Any, env_name: str, field: str = "observations") -> list[Message]:
  """``messages`` as a list of ``{"role": str, "content": str, ...}`` dicts, else one line.

  Args:
    messages: what the environment returned.
    env_name: the environment's name, for the error.
    field: what the messages are (``observations``, or ``init's messages``), for the error.

  Returns:
    ``messages`` as a list of dicts.

  Raises:
    EnvironmentOutputError: naming the environment, the field and the bad value.
  """
  if not isinstance(messages, (list, tuple)):
    raise EnvironmentOutputError(
        f"environment {env_name!r} returned {field}={_shown(messages)}: not a list of chat messages")
  for i, message in enumerate(messages):
    if not isinstance(message, dict):
      raise EnvironmentOutputError(
          f"environment {env_name!r} returned {field}[{i}]={_shown(message)}: not a dict")
    for key in ("role", "content"):
      if not isinstance(message.get(key), str):
        raise EnvironmentOutputError(
            f"environment {env_name!r} returned {field}[{i}][{key!r}]={_shown(message.get(key))}: "
            "not a string")
  return list(messages)


def check_step_output(out: Any, env_name: str) -> StepOutput:
  """Validates what ``Environment.step`` returned.

  Args:
    out: the return value of ``step``.
    env_name: the environment's name (its spec's), for the error.

  Returns:
    A new :class:`StepOutput`: ``reward`` a Python float, ``done`` a Python bool, ``metadata``
    a dict (``{}`` where it was missing or None); ``postprocessed_action`` kept where present.

  Raises:
    EnvironmentOutputError: one line naming the environment and the bad field and value:
      ``out`` not a dict; observations not a list of ``{"role": str, "content": str}``; reward
      not a finite real number (bools are not rewards); done not a bool; metadata not a dict;
      postprocessed_action neither a string nor None.
  """
  if not isinstance(out, dict):
    raise EnvironmentOutputError(
        f"environment {env_name!r} step returned {_shown(out)}: not a dict with observations, "
        "reward, done")
  missing = [key for key in ("observations", "reward", "done") if key not in out]
  if missing:
    raise EnvironmentOutputError(f"environment {env_name!r} step returned no {', '.join(missing)}")
  observations = check_messages(out["observations"], env_name)
  reward = out["reward"]
  if (isinstance(reward, bool) or not isinstance(reward, numbers.Real)
      or not math.isfinite(float(reward))):
    raise EnvironmentOutputError(
        f"environment {env_name!r} returned reward={_shown(reward)}: not a finite real number")
  done = out["done"]
  if not _is_bool(done):
    raise EnvironmentOutputError(f"environment {env_name!r} returned done={_shown(done)}: not a bool")
  metadata = out.get("metadata")
  if metadata is not None and not isinstance(metadata, dict):
    raise EnvironmentOutputError(
        f"environment {env_name!r} returned metadata={_shown(metadata)}: not a dict")
  checked = StepOutput(observations=observations, reward=float(reward), done=bool(done),
                       metadata=dict(metadata or {}))
  if "postprocessed_action" in out:
    action = out["postprocessed_action"]
    if action is not None and not isinstance(action, str):
      raise EnvironmentOutputError(
          f"environment {env_name!r} returned postprocessed_action={_shown(action)}: not a string")
    checked["postprocessed_action"] = action
  return checked
