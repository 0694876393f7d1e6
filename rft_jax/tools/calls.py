"""Tool calls in Qwen2.5's and Qwen3's format: parse them from a model's turn, answer with a tool message.

Qwen's chat template tells the model (in the system prompt, after the ``<tools>`` schemas) to call a
function by writing one JSON object per call between tags::

    <tool_call>
    {"name": "calculator", "arguments": {"expression": "2**10"}}
    </tool_call>

A turn may hold several calls. Each block is parsed on its own, so one malformed call does not hide the
others: :func:`parse_tool_calls` returns the good calls and one line per bad block (not JSON, not an
object, no ``"name"``, ``"arguments"`` not an object, or a ``<tool_call>`` never closed), in the order
they appear. ``"arguments"`` may also come as a JSON string holding the object, as Qwen sometimes
writes it (the OpenAI wire format); a call without ``"arguments"`` has none.

A tool's answer is a :class:`ToolResult`: its text and a status for the rollout's statistics. The
text goes back as a message of role ``tool`` (:func:`tool_message`), which Qwen's template
renders inside a user turn as ``<tool_response>\\n...\\n</tool_response>`` (consecutive tool messages
share one turn).

Nothing here imports the rest of the project.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Union

OPEN_TAG = "<tool_call>"
CLOSE_TAG = "</tool_call>"


@dataclasses.dataclass(frozen=True)
class ToolCall:
  """One call the model made: the tool's ``name`` and its ``arguments`` (a decoded JSON object)."""

  name: str
  arguments: dict


@dataclasses.dataclass(frozen=True)
class ParsedCalls:
  """Every ``<tool_call>`` block of a turn, in order.

  Attributes:
    blocks: a :class:`ToolCall` for each well-formed block and a one-line error (``str``) for each
      malformed one, in the order they appear in the text.
  """

  blocks: tuple[Union[ToolCall, str], ...] = ()

  @property
  def calls(self) -> list[ToolCall]:
    """The well-formed calls, in order."""
    return [block for block in self.blocks if isinstance(block, ToolCall)]

  @property
  def errors(self) -> list[str]:
    """One line for each malformed block, in order."""
    return [block for block in self.blocks if isinstance(block, str)]


@dataclasses.dataclass(frozen=True)
class ToolResult:
  """The outcome of one call: the text the model reads and how the call went.

  Attributes:
    content: the tool's output (or the one-line error), as it goes into :func:`tool_message`.
    status: ``ok``, ``invalid_call`` (the block did not parse), ``unknown_tool``, ``bad_arguments``,
      ``error`` (the tool raised or failed), ``timeout`` or ``output_limit`` (cut).
  """

  content: str
  status: str = "ok"

  def __str__(self) -> str:
    return self.content


def _json_type_name(value: Any) -> str:
  names = {bool: "a boolean", int: "a number", float: "a number", str: "a string", list: "an array",
           type(None): "null"}
  return names.get(type(value), type(value).__name__)


def _one_line(text: str, limit: int = 80) -> str:
  """``text`` on one line, shortened to ``limit`` characters."""
  text = " ".join(text.split())
  return text if len(text) <= limit else text[:limit - 3] + "..."


def _parse_block(body: str, index: int) -> Union[ToolCall, str]:
  """The call in one block's text, or one line saying why there is none (``index`` counts from 1)."""
  where = f"tool call {index}"
  try:
    call = json.loads(body)
  except json.JSONDecodeError as e:
    return f"{where}: not JSON ({e.msg} at char {e.pos}): {_one_line(body)!r}"
  if not isinstance(call, dict):
    return f"{where}: the JSON is {_json_type_name(call)}, not an object with \"name\" and \"arguments\""
  name = call.get("name")
  if not isinstance(name, str) or not name:
    return f"{where}: no \"name\" (a non-empty string) in {_one_line(body)!r}"
  arguments = call.get("arguments", {})
  if isinstance(arguments, str):  # the arguments object written as a JSON string
    try:
      arguments = json.loads(arguments) if arguments.strip() else {}
    except json.JSONDecodeError:
      return f"{where} ({name}): \"arguments\" is a string that is not JSON: {_one_line(call['arguments'])!r}"
  if arguments is None:
    arguments = {}
  if not isinstance(arguments, dict):
    return f"{where} ({name}): \"arguments\" is {_json_type_name(arguments)}, not an object"
  return ToolCall(name=name, arguments=arguments)


def parse_tool_calls(text: str) -> ParsedCalls:
  """Every ``<tool_call>...</tool_call>`` block of a model's turn, parsed.

  Whitespace and newlines around the JSON are allowed. Text outside the blocks is ignored, and so is
  a ``</tool_call>`` without its opening tag. An opening tag never closed is an error (the turn was cut
  off, or the model forgot the tag): the call is not run.

  Args:
    text: the model's turn, decoded.

  Returns:
    The calls and the errors, in order (:class:`ParsedCalls`).
  """
  blocks = []
  position = 0
  while True:
    start = text.find(OPEN_TAG, position)
    if start < 0:
      break
    body_start = start + len(OPEN_TAG)
    end = text.find(CLOSE_TAG, body_start)
    index = len(blocks) + 1
    if end < 0:
      blocks.append(f"tool call {index}: {OPEN_TAG} is never closed by {CLOSE_TAG}: "
                    f"{_one_line(text[body_start:])!r}")
      break
    blocks.append(_parse_block(text[body_start:end].strip(), index))
    position = end + len(CLOSE_TAG)
  return ParsedCalls(tuple(blocks))


def has_tool_call(text: str) -> bool:
  """Whether the turn opens a tool call (well-formed or not): the rollout continues with tool output."""
  return OPEN_TAG in text


def tool_message(content: str) -> dict:
  """The chat message that carries a tool's output back to the model (role ``tool``)."""
  return {"role": "tool", "content": content}
