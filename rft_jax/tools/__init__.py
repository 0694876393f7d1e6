"""Tools for multi-turn rollouts in Qwen's tool-call format: plain functions, no model, no JAX.

``schema`` (a tool's JSON schema from its hints and docstring; a call's arguments checked against
it), ``calls`` (``<tool_call>`` blocks parsed; the ``tool`` message that answers them), ``calculator``
(arithmetic by walking the syntax tree, bounded), ``sandbox`` (Python run in bubblewrap under hard
limits; the ``python`` tool) and ``toolbox`` (``ToolBox``: the tools' schemas, a turn's calls run).
Nothing here imports the rest of the project.
"""

from rft_jax.tools.calculator import calculator
from rft_jax.tools.calls import ParsedCalls
from rft_jax.tools.calls import ToolCall
from rft_jax.tools.calls import ToolResult
from rft_jax.tools.calls import has_tool_call
from rft_jax.tools.calls import parse_tool_calls
from rft_jax.tools.calls import tool_message
from rft_jax.tools.sandbox import SandboxLimits
from rft_jax.tools.sandbox import SandboxResult
from rft_jax.tools.sandbox import python_tool
from rft_jax.tools.sandbox import result_text
from rft_jax.tools.sandbox import run_python
from rft_jax.tools.sandbox import sandbox_missing
from rft_jax.tools.schema import check_arguments
from rft_jax.tools.schema import tool_schema
from rft_jax.tools.toolbox import ToolBox

__all__ = [
    "ParsedCalls", "SandboxLimits", "SandboxResult", "ToolBox", "ToolCall", "ToolResult",
    "calculator", "check_arguments", "has_tool_call", "parse_tool_calls", "python_tool",
    "result_text", "run_python", "sandbox_missing", "tool_message", "tool_schema",
]
