r"""The ``tools`` environment: the model calls tools over several turns, then answers; 1 if right.

Each turn the model either calls tools or gives its final answer. Calls are written in the format
Qwen2.5's and Qwen3's chat templates teach (the tools' schemas in the system prompt's ``<tools>``
block, rendered from :attr:`ToolUse.schemas` through ``apply_chat_template(..., tools=)``): one JSON
object per call between tags, several calls allowed in one turn::

    <tool_call>
    {"name": "calculator", "arguments": {"expression": "17 * 23"}}
    </tool_call>

A turn that opens a ``<tool_call>`` (well-formed or not) is run by a
:class:`~rft_jax.tools.ToolBox`: every block gets one ``{"role": "tool", "content": ...}`` message,
in order, which the template renders as ``<tool_response>`` blocks in the next user turn. A call that
does not parse, names no tool offered, has arguments that do not fit the schema, raises or runs out
of time is answered by a one-line error the model reads and may correct -- never an exception, so
the episode goes on (reward 0, not done). A turn without a ``<tool_call>`` is the final answer: read
as the last ``\boxed{}`` (``answer: boxed``, the default) or the last number (``last_number``) and
compared with the row's ``answer`` by math equivalence (:func:`rft_jax.rewards.check_equivalence`):
reward 1.0 and ``correct`` when equivalent, else 0.0; done either way. The rollout's
``rollout.max_turns`` cuts a model that never stops calling tools.

Where it runs. The environment, and so the ToolBox with every tool it calls, lives in an
environment worker process (:class:`~rft_jax.environments.EnvironmentWorkers`), one call at a time
under the worker's wall clock ``rollout.env_step_timeout_s``: a tool that hangs, or an answer whose
equivalence check never ends, costs that step's trajectory (counted as an environment timeout) and
the worker is replaced; the sampler and the other trajectories go on. The check is called directly,
not through the reward pool, for the same reason. The ``python`` tool runs each call's code in a
fresh interpreter inside a bubblewrap sandbox (:mod:`rft_jax.tools.sandbox`: no network, no
host files, an unprivileged user, limits on CPU, memory, processes, output and its own wall clock
``python_limits.wall_s``, which must stay below the step timeout); where bubblewrap is missing it is
refused unless ``allow_unsandboxed`` is set.

Elsewhere: TRL passes the functions to ``GRPOTrainer(..., tools=[fn, ...])`` and runs the calls
between generations itself (masking the tool output out of the loss); verl runs its tool agent loop
(``actor_rollout_ref.rollout.multi_turn.tool_config_path`` naming a YAML of tool classes and their
OpenAI schemas, ``agent.default_agent_loop: tool_agent``). Here the tools are named in the config,
``rollout.tools`` (which the trainer hands over as this environment's ``tools``).
"""

from __future__ import annotations

import collections
import collections.abc
import dataclasses
import logging
import re
from typing import Any, Callable, Optional

from rft_jax.environments.base import Message
from rft_jax.environments.base import StepOutput
from rft_jax.rewards.extract import last_boxed
from rft_jax.rewards.verify import Verdict
from rft_jax.rewards.verify import check_equivalence
from rft_jax.tools import SandboxLimits
from rft_jax.tools import ToolBox
from rft_jax.tools import has_tool_call
from rft_jax.tools import tool_message
from rft_jax.tools.toolbox import STATUSES as TOOL_STATUSES

CONFIG_KEYS = ("tools", "allow_unsandboxed", "max_output_chars", "answer", "python_limits")
DEFAULT_MAX_OUTPUT_CHARS = 4096
# Statuses of calls that never ran: their text is prefixed so the model reads it as an error.
_REFUSED = ("invalid_call", "unknown_tool", "bad_arguments")
# 12, -3.5, 1,000 (commas between groups of three dropped), 7/8; not part of a word or a decimal.
_NUMBER = re.compile(r"(?<![\w.])-?\d+(?:,\d{3})*(?:\.\d+)?(?:/\d+)?")


def last_number(text: str) -> Optional[str]:
  """The last number in ``text`` (``-12``, ``3.5``, ``7/8``; ``1,000`` as ``1000``), or None."""
  numbers = _NUMBER.findall(text)
  return numbers[-1].replace(",", "") if numbers else None


# How a final answer is read from the model's last turn (``env_config["answer"]``).
ANSWER_READERS: dict[str, Callable[[str], Optional[str]]] = {"boxed": last_boxed, "last_number": last_number}


@dataclasses.dataclass(frozen=True)
class ToolUseConfig:
  """The environment's ``env_config``, checked.

  Attributes:
    tools: tool names for :meth:`~rft_jax.tools.ToolBox.from_names`: ``calculator``, ``python``,
      ``add``, or ``package.module:function``.
    allow_unsandboxed: let the ``python`` tool run without bubblewrap where it is missing.
    max_output_chars: characters of a tool's output the model sees; longer output is cut.
    answer: how the final answer is read: ``boxed`` (the last ``\\boxed{}``) or ``last_number``.
    python_limits: the ``python`` tool's :class:`~rft_jax.tools.SandboxLimits` fields (a dict;
      missing ones keep their defaults).
  """

  tools: tuple[str, ...] = ()
  allow_unsandboxed: bool = False
  max_output_chars: int = DEFAULT_MAX_OUTPUT_CHARS
  answer: str = "boxed"
  python_limits: Optional[SandboxLimits] = None

  @classmethod
  def of(cls, env_config: Optional[dict[str, Any]]) -> "ToolUseConfig":
    """The config from an ``env_config`` dict (an omegaconf ``DictConfig`` works as well).

    Raises:
      ValueError: one line, for an unknown key or a value of the wrong kind.
    """
    config = dict(env_config or {})
    unknown = sorted(set(config) - set(CONFIG_KEYS))
    if unknown:
      raise ValueError(f"tools environment: unknown config keys {unknown}; it takes {list(CONFIG_KEYS)}")
    tools = config.get("tools", ())
    if isinstance(tools, str) or not all(isinstance(name, str) for name in tools):
      raise ValueError(f"tools environment: tools must be a list of tool names, got {tools!r}")
    allow = config.get("allow_unsandboxed", False)
    if not isinstance(allow, bool):
      raise ValueError(f"tools environment: allow_unsandboxed must be a bool, got {allow!r}")
    chars = config.get("max_output_chars", DEFAULT_MAX_OUTPUT_CHARS)
    if isinstance(chars, bool) or not isinstance(chars, int) or chars < 1:
      raise ValueError(f"tools environment: max_output_chars must be a positive int, got {chars!r}")
    answer = config.get("answer", "boxed")
    if answer not in ANSWER_READERS:
      raise ValueError(f"tools environment: answer={answer!r} must be one of {list(ANSWER_READERS)}")
    limits = config.get("python_limits")
    if limits is not None:
      fields = {field.name for field in dataclasses.fields(SandboxLimits)}
      if not isinstance(limits, collections.abc.Mapping) or set(limits) - fields:
        raise ValueError(f"tools environment: python_limits must be a dict of SandboxLimits fields "
                         f"{sorted(fields)}, got {limits!r}")
      limits = SandboxLimits(**dict(limits))
    return cls(tuple(tools), allow, chars, answer, limits)

  def toolbox(self) -> ToolBox:
    """The tools, built (a name that cannot be built raises ValueError, one line)."""
    return ToolBox.from_names(self.tools, self.max_output_chars, python_limits=self.python_limits,
                              allow_unsandboxed=self.allow_unsandboxed)


def tool_schemas(env_config: Optional[dict[str, Any]]) -> list[dict]:
  """The schemas of the tools ``env_config`` names, for the prompt (``apply_chat_template(tools=)``),
  without a row: what every :class:`ToolUse` of that config offers."""
  return ToolUseConfig.of(env_config).toolbox().schemas


def _counts(statuses: list[str]) -> dict[str, int]:
  """A turn's call counts for the metadata: attempted, errors (not ok, timeouts apart), timeouts,
  and one ``tool_status/<status>`` count for every status."""
  per_status = collections.Counter(statuses)
  counts = {"tool_calls": len(statuses),
            "tool_errors": sum(n for status, n in per_status.items() if status not in ("ok", "timeout")),
            "tool_timeouts": per_status["timeout"]}
  counts.update({f"tool_status/{status}": per_status[status] for status in TOOL_STATUSES})
  return counts


class ToolUse:
  """Tool calls answered until a final answer, which earns 1.0 when it equals the row's answer.

  Args:
    env_config: :class:`ToolUseConfig`'s keys: ``tools``, ``allow_unsandboxed``,
      ``max_output_chars``, ``answer`` (``boxed`` or ``last_number``), ``python_limits``.
    extras: the dataset row; ``answer`` (the ground truth, text or a number) is required.

  Raises:
    ValueError: one line, for an unknown config key or bad value, a tool that cannot be built, or a
      row without ``answer``.
  """

  def __init__(self, env_config: Optional[dict[str, Any]] = None,
               extras: Optional[dict[str, Any]] = None):
    self.config = ToolUseConfig.of(env_config)
    extras = dict(extras or {})
    if extras.get("answer") is None:
      raise ValueError("tools environment needs the row's ground truth: extras['answer'] is missing")
    self.ground_truth = str(extras["answer"])
    self.toolbox = self.config.toolbox()
    self.read_answer = ANSWER_READERS[self.config.answer]
    self.turns = 0

  @property
  def schemas(self) -> list[dict]:
    """The tools' schemas, for ``apply_chat_template(messages, tools=...)``."""
    return self.toolbox.schemas

  def init(self, prompt: list[Message]) -> tuple[list[Message], dict[str, Any]]:
    """The row's prompt unchanged; the info names the tools offered."""
    return list(prompt), {"tools": self.toolbox.names}

  def step(self, action: str) -> StepOutput:
    """Runs the turn's tool calls, or grades its final answer.

    Returns:
      With a ``<tool_call>``: one ``tool`` message per block (errors as text), reward 0, not done,
      metadata of :func:`_counts`. Without: no messages, reward 1.0 or 0.0, done, metadata
      ``correct`` and the ``answer`` read (None where there was none).
    """
    self.turns += 1
    if has_tool_call(action):
      results = self.toolbox.run(action)
      observations = [tool_message(f"Error: {r.content}" if r.status in _REFUSED else r.content)
                      for r in results]
      metadata = {"turn": self.turns, **_counts([r.status for r in results])}
      return StepOutput(observations=observations, reward=0.0, done=False, metadata=metadata)
    answer = self.read_answer(action)
    logging.getLogger("math_verify").setLevel(logging.ERROR)  # its "timeout is disabled": ours is the step's
    correct = check_equivalence(answer, self.ground_truth) == Verdict.CORRECT
    metadata = {"turn": self.turns, "correct": correct, "answer": answer, **_counts([])}
    return StepOutput(observations=[], reward=1.0 if correct else 0.0, done=True, metadata=metadata)

  def close(self) -> None:
    """Nothing to free: each python call's sandbox is gone when the call returns."""
