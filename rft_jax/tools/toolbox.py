"""A set of tools a rollout offers the model: their schemas for the prompt, and the calls of a turn run.

A multi-turn rollout alternates the model's turns and the tools' answers. After each turn the rollout
asks :meth:`ToolBox.run` for the answers to the turn's ``<tool_call>`` blocks. Every block gets exactly
one :class:`~rft_jax.tools.calls.ToolResult`, in the order of the blocks, so a malformed or wrong call
is fed back to the model as a one-line error rather than ending the episode, and each outcome has a
status for the rollout's statistics:

=================  ==================================================================================
``ok``             the tool ran; its return value (``str()`` of it) is the content
``invalid_call``   the block did not parse (not JSON, no name, never closed: :mod:`.calls`)
``unknown_tool``   no tool of that name
``bad_arguments``  the arguments do not fit the schema (:func:`~rft_jax.tools.schema.check_arguments`)
``error``          the tool raised (``"TypeName: message"``, one line) or reported a failure
``timeout``        the tool reported running out of time (the ``python`` tool does)
``output_limit``   the content was longer than ``max_output_chars`` and was cut, with a marker
=================  ==================================================================================

A tool is a plain function (its schema from its hints and docstring) returning anything, or a
:class:`~rft_jax.tools.calls.ToolResult` to set its own status. Tools run in this process, one after
another: the caller runs the ToolBox inside a worker process with its own wall clock (as the reward
checks run in :mod:`rft_jax.rewards.pool`), which bounds a tool that hangs; the ``python`` tool runs
its code in a sandbox (:mod:`.sandbox`) with its own limits.

Nothing here imports the rest of the project.
"""

from __future__ import annotations

import importlib
from typing import Any, Callable, Optional, Sequence, Union

from rft_jax.tools.arithmetic import add
from rft_jax.tools.calculator import calculator
from rft_jax.tools.calls import ParsedCalls, ToolCall, ToolResult, parse_tool_calls
from rft_jax.tools.sandbox import SandboxLimits, python_tool
from rft_jax.tools.schema import check_arguments, tool_schema

STATUSES = ("ok", "invalid_call", "unknown_tool", "bad_arguments", "error", "timeout", "output_limit")


def _one_line(text: str) -> str:
  return " ".join(str(text).split())


class ToolBox:
  """Tools by name, their schemas, and :meth:`run` for a turn's calls.

  Args:
    tools: the tool functions; each needs a schema (:func:`~rft_jax.tools.schema.tool_schema`) and a
      name no other tool has.
    max_output_chars: characters of a tool's output the model sees; longer output is cut.
  """

  def __init__(self, tools: Sequence[Callable], max_output_chars: int = 4096):
    if max_output_chars <= 0:
      raise ValueError(f"max_output_chars must be positive, got {max_output_chars}")
    self.max_output_chars = max_output_chars
    self._tools: dict[str, tuple[Callable, dict]] = {}
    for fn in tools:
      schema = tool_schema(fn)
      name = schema["function"]["name"]
      if name in self._tools:
        raise ValueError(f"two tools are named {name!r}: tool names must be unique")
      self._tools[name] = (fn, schema)

  @classmethod
  def from_names(cls, names: Sequence[str], max_output_chars: int = 4096, *,
                 python_limits: Optional[SandboxLimits] = None, allow_unsandboxed: bool = False) -> "ToolBox":
    """The tools named: a builtin (``calculator``, ``python``, ``add``) or ``module.path:function``.

    Args:
      names: tool names as a config lists them.
      max_output_chars: as in :class:`ToolBox`.
      python_limits: the ``python`` tool's limits (:class:`~rft_jax.tools.sandbox.SandboxLimits`).
      allow_unsandboxed: let the ``python`` tool run without a sandbox where there is none
        (``rollout.tools_allow_unsandboxed``).

    Raises:
      ValueError: one line, for a name that is neither a builtin nor an importable function, or
        ``python`` without a sandbox (:func:`~rft_jax.tools.sandbox.python_tool`).
    """
    builtins = {
        "calculator": lambda: calculator,
        "python": lambda: python_tool(python_limits, allow_unsandboxed=allow_unsandboxed),
        "add": lambda: add,
    }
    tools = []
    for name in names:
      if name in builtins:
        tools.append(builtins[name]())
      elif ":" in name:
        tools.append(_import_function(name))
      else:
        raise ValueError(f"unknown tool {name!r}: the builtins are {', '.join(builtins)}, or name a "
                         f"function as module.path:function")
    return cls(tools, max_output_chars=max_output_chars)

  @property
  def names(self) -> list[str]:
    """The tools' names, in the order given."""
    return list(self._tools)

  @property
  def schemas(self) -> list[dict]:
    """The tools' schemas, for ``tokenizer.apply_chat_template(messages, tools=...)``."""
    return [schema for _, schema in self._tools.values()]

  def run(self, text_or_call: Union[str, ToolCall, ParsedCalls]) -> list[ToolResult]:
    """Runs every call of a model's turn, in order.

    Args:
      text_or_call: the turn's text (parsed with :func:`~rft_jax.tools.calls.parse_tool_calls`), its
        parsed calls, or one :class:`~rft_jax.tools.calls.ToolCall`.

    Returns:
      One result per ``<tool_call>`` block, in order: a malformed block's error as ``invalid_call``.
      Empty when the turn calls no tool.
    """
    if isinstance(text_or_call, ToolCall):
      blocks = (text_or_call,)
    elif isinstance(text_or_call, ParsedCalls):
      blocks = text_or_call.blocks
    else:
      blocks = parse_tool_calls(text_or_call).blocks
    return [self._call(block) if isinstance(block, ToolCall) else ToolResult(block, "invalid_call")
            for block in blocks]

  def _call(self, call: ToolCall) -> ToolResult:
    if call.name not in self._tools:
      return ToolResult(f"unknown tool {call.name!r}: the tools are {', '.join(self._tools) or 'none'}",
                        "unknown_tool")
    fn, schema = self._tools[call.name]
    problem = check_arguments(schema, call.arguments)
    if problem is not None:
      return ToolResult(problem, "bad_arguments")
    try:
      value = fn(**call.arguments)
    except Exception as e:  # the tool's failure is the model's feedback, not the rollout's end
      return ToolResult(_one_line(f"{type(e).__name__}: {e}"), "error")
    return self._cut(value if isinstance(value, ToolResult) else ToolResult(_as_text(value), "ok"))

  def _cut(self, result: ToolResult) -> ToolResult:
    if len(result.content) <= self.max_output_chars:
      return result
    content = result.content[:self.max_output_chars] + f"\n[output cut at {self.max_output_chars} characters]"
    return ToolResult(content, "output_limit" if result.status == "ok" else result.status)


def _as_text(value: Any) -> str:
  return value if isinstance(value, str) else str(value)


def _import_function(spec: str) -> Callable:
  """The function ``module.path:function`` names (one-line ValueError when it cannot be had)."""
  module_name, _, attribute = spec.partition(":")
  try:
    module = importlib.import_module(module_name)
  except Exception as e:
    reason = _one_line(f"{type(e).__name__}: {e}")
    raise ValueError(f"tool {spec!r}: cannot import {module_name!r} ({reason})") from None
  fn = getattr(module, attribute, None)
  if not callable(fn):
    raise ValueError(f"tool {spec!r}: {module_name} has no function {attribute!r}")
  return fn
