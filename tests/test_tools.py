"""rft_jax/tools: schemas from hints and docstrings, argument checks, Qwen tool-call parsing, the
calculator (no eval, bounded), ToolBox statuses, and Qwen2.5's chat template rendering the tools and
their answers. The sandboxed ``python`` tool is tested in tests/test_sandbox.py."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Optional

import pytest

from qwen_templates import QWEN2_5_CHAT_TEMPLATE

import rft_jax
from rft_jax.tools import (ParsedCalls, ToolBox, ToolCall, ToolResult, calculator, check_arguments,
                           has_tool_call, parse_tool_calls, tool_message, tool_schema)

pytestmark = pytest.mark.timeout(60)

DEMO_TOKENIZER = Path(rft_jax.__file__).parent / "demo" / "checkpoint"


def lookup(city: str, days: int, units: Optional[str] = None, hourly: bool = False) -> str:
  """Looks up the weather.

  Args:
    city: The city's name.
    days: How many days ahead.
    units: "metric" or "imperial".
    hourly: One forecast per hour.
  """
  return f"{city}: sunny for {days} days"


def fails(reason: str) -> str:
  """Always raises.

  Args:
    reason: The error's message.
  """
  raise RuntimeError(reason)


def talks(words: int) -> str:
  """Returns many words.

  Args:
    words: How many.
  """
  return "word " * words


def counts(n: int) -> list:
  """Returns a list, not a string.

  Args:
    n: Its length.
  """
  return list(range(n))


def slow_status(x: int):
  """Reports its own status, as the python tool does.

  Args:
    x: Ignored.
  """
  return ToolResult("stopped", "timeout")


# ---- schema ---------------------------------------------------------------------------------------


def test_schema_from_hints_and_docstring():
  schema = tool_schema(lookup)
  function = schema["function"]
  assert schema["type"] == "function" and function["name"] == "lookup"
  assert function["description"] == "Looks up the weather."
  properties = function["parameters"]["properties"]
  assert properties["city"] == {"type": "string", "description": "The city's name."}
  assert properties["days"]["type"] == "integer" and properties["hourly"]["type"] == "boolean"
  assert properties["units"].get("nullable") is True
  assert function["parameters"]["required"] == ["city", "days"]  # the defaults are optional


@pytest.mark.parametrize("source, lacking", [
    ("def nodoc(a: int):\n  pass\n", "no docstring"),
    ("def nohint(a):\n  '''Doc.\n\n  Args:\n    a: the a.\n  '''\n", "type hint"),
    ("def noargs(a: int):\n  '''Doc without an Args section.'''\n", "description for the argument 'a'"),
])
def test_schema_refuses_a_function_that_says_too_little(source, lacking):
  scope = {}
  exec(source, scope)  # noqa: S102 -- the test's own function definitions
  fn = next(v for k, v in scope.items() if k != "__builtins__")
  with pytest.raises(ValueError) as info:
    tool_schema(fn)
  message = str(info.value)
  assert "\n" not in message and repr(fn.__name__) in message and lacking in message


def test_check_arguments():
  schema = tool_schema(lookup)
  assert check_arguments(schema, {"city": "Oslo", "days": 3, "units": None}) is None
  assert check_arguments(schema, {"city": "Oslo", "days": 3, "units": "metric", "hourly": True}) is None
  assert "unknown argument(s) town" in check_arguments(schema, {"town": "Oslo", "days": 1, "units": None})
  assert "missing required argument(s) days" in check_arguments(schema, {"city": "Oslo", "units": None})
  assert "days should be integer, got string" in check_arguments(schema, {"city": "Oslo", "days": "3"})
  assert "days should be integer, got boolean" in check_arguments(schema, {"city": "Oslo", "days": True})
  assert "hourly should be boolean, got integer" in check_arguments(
      schema, {"city": "Oslo", "days": 1, "units": None, "hourly": 1})
  assert "must be a JSON object" in check_arguments(schema, ["Oslo", 3])


def test_check_arguments_numbers_arrays_objects():
  schema = {"function": {"name": "f", "parameters": {"type": "object", "required": ["x"], "properties": {
      "x": {"type": "number"}, "xs": {"type": "array", "items": {"type": "integer"}}, "o": {"type": "object"},
      "mode": {"type": "string", "enum": ["a", "b"]}}}}}
  assert check_arguments(schema, {"x": 2}) is None  # an integer is a number
  assert check_arguments(schema, {"x": 2.5, "xs": [1, 2], "o": {"k": 1}, "mode": "a"}) is None
  assert "x should be number, got boolean" in check_arguments(schema, {"x": False})
  assert "xs [1] should be integer, got number" in check_arguments(schema, {"x": 1, "xs": [1, 2.5]})
  assert "o should be object, got array" in check_arguments(schema, {"x": 1, "o": []})
  assert "not one of ['a', 'b']" in check_arguments(schema, {"x": 1, "mode": "c"})
  for problem in (check_arguments(schema, {}), check_arguments(schema, {"x": "1"})):
    assert problem.startswith("f: ") and "\n" not in problem


# ---- calls ----------------------------------------------------------------------------------------


def test_parse_one_call_with_whitespace():
  text = ('Let me compute.\n<tool_call>\n  {"name": "calculator", "arguments": {"expression": "2+2"}}  \n'
          '</tool_call>')
  parsed = parse_tool_calls(text)
  assert parsed.calls == [ToolCall("calculator", {"expression": "2+2"})] and parsed.errors == []
  assert has_tool_call(text) and not has_tool_call("The answer is 4.")
  assert parse_tool_calls("The answer is 4.") == ParsedCalls(())


def test_parse_several_calls_and_string_arguments():
  text = ('<tool_call>{"name": "a", "arguments": {"x": 1}}</tool_call> then '
          '<tool_call>\n{"name": "b", "arguments": "{\\"y\\": [1, 2]}"}\n</tool_call>'
          '<tool_call>{"name": "c"}</tool_call>')
  assert parse_tool_calls(text).calls == [ToolCall("a", {"x": 1}), ToolCall("b", {"y": [1, 2]}),
                                          ToolCall("c", {})]


@pytest.mark.parametrize("body, error", [
    ('{"name": "a", "arguments": {"x": 1}', "tool call 1: not JSON"),
    ('[{"name": "a"}]', "the JSON is an array, not an object"),
    ('{"arguments": {"x": 1}}', 'no "name"'),
    ('{"name": "a", "arguments": [1, 2]}', '"arguments" is an array, not an object'),
    ('{"name": "a", "arguments": "x=1"}', '"arguments" is a string that is not JSON'),
    ('{"name": "a", "arguments": "[1]"}', '"arguments" is an array, not an object'),
])
def test_parse_malformed_call(body, error):
  parsed = parse_tool_calls(f"<tool_call>{body}</tool_call>")
  assert parsed.calls == [] and len(parsed.errors) == 1
  assert error in parsed.errors[0] and "\n" not in parsed.errors[0]


def test_parse_keeps_order_and_reports_an_unclosed_call():
  text = ('<tool_call>{"name": "a", "arguments": {}}</tool_call><tool_call>nonsense</tool_call>'
          '<tool_call>{"name": "b", "arguments": {}}</tool_call>\n<tool_call>\n{"name": "c", "argu')
  parsed = parse_tool_calls(text)
  kinds = [type(block).__name__ for block in parsed.blocks]
  assert kinds == ["ToolCall", "str", "ToolCall", "str"]
  assert [call.name for call in parsed.calls] == ["a", "b"]
  assert parsed.errors[0].startswith("tool call 2: not JSON")
  assert parsed.errors[1].startswith("tool call 4: <tool_call> is never closed")


def test_tool_message():
  assert tool_message("42") == {"role": "tool", "content": "42"}


# ---- calculator -----------------------------------------------------------------------------------


@pytest.mark.parametrize("expression, value", [
    ("1 + 2 * 3", "7"), ("(1 + 2) * 3", "9"), ("7 / 2", "3.5"), ("7 // 2", "3"), ("-7 % 3", "2"),
    ("2 ** 10", "1024"), ("-3 ** 2", "-9"), ("2 ** -1", "0.5"), ("+1.5e2 - .5", "149.5"), ("((4))", "4"),
])
def test_calculator_arithmetic(expression, value):
  assert calculator(expression) == value


@pytest.mark.parametrize("expression, error", [
    ("1 / 0", "division by zero"), ("5 % 0", "division by zero"), ("0 ** -1", "division by zero"),
    ("__import__('os').system('touch /tmp/calculator_ran')", "found a function call"),
    ("os", "found a name"), ("(1).__class__", "found an attribute"), ("'a' * 3", "only numbers"),
    ("True + 1", "only numbers"), ("[1, 2][0]", "found"), ("lambda: 1", "found a lambda"),
    ("1 +", "not an expression"), ("(-8) ** 0.5", "complex"), ("1e308 * 10", "not a finite number"),
    ("1" * 1001, "longer than 1000"),
])
def test_calculator_refuses(expression, error):
  out = calculator(expression)
  assert out.startswith("Error: ") and error in out and "\n" not in out
  assert not os.path.exists("/tmp/calculator_ran")


@pytest.mark.parametrize("expression", ["9**9**9**9", "10**10**10", "2**(2**100)", "(10**999)**(10**999)",
                                        "2.0**(10**30)", "1.5**1e10", "10**1000 * 10**1000", "(2**3000)**2"])
def test_calculator_bounds_huge_powers_quickly(expression):
  start = time.perf_counter()
  out = calculator(expression)
  assert time.perf_counter() - start < 0.5  # computing any of them would take hours, or fail for memory
  assert out.startswith("Error: ") and ("too large" in out or "finite" in out)


def test_calculator_schema():
  function = tool_schema(calculator)["function"]
  assert function["name"] == "calculator" and function["parameters"]["required"] == ["expression"]
  assert function["parameters"]["properties"]["expression"]["type"] == "string"


# ---- ToolBox --------------------------------------------------------------------------------------


def call(name, **arguments):
  return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def test_toolbox_statuses_in_order():
  box = ToolBox([calculator, lookup, fails, talks, counts, slow_status], max_output_chars=50)
  assert box.names == ["calculator", "lookup", "fails", "talks", "counts", "slow_status"]
  assert [s["function"]["name"] for s in box.schemas] == box.names
  text = "".join([call("calculator", expression="6*7"), "<tool_call>{oops}</tool_call>", call("weather"),
                  call("lookup", city="Oslo"), call("fails", reason="no\nluck"), call("talks", words=100),
                  call("counts", n=3), call("slow_status", x=1), call("calculator", expression="1/0")])
  results = box.run(text)
  assert [r.status for r in results] == ["ok", "invalid_call", "unknown_tool", "bad_arguments", "error",
                                         "output_limit", "ok", "timeout", "ok"]
  assert results[0] == ToolResult("42", "ok")
  assert results[2].content == "unknown tool 'weather': the tools are " + ", ".join(box.names)
  assert results[3].content == "lookup: missing required argument(s) days"
  assert results[4].content == "RuntimeError: no luck"  # one line
  assert results[5].content == ("word " * 10) + "\n[output cut at 50 characters]"
  assert results[6].content == "[0, 1, 2]"
  assert results[8].content == "Error: division by zero"  # the calculator's own error is its output


def test_toolbox_runs_one_call_and_nothing():
  box = ToolBox([calculator])
  assert box.run(ToolCall("calculator", {"expression": "2**5"})) == [ToolResult("32", "ok")]
  assert box.run("No tools needed: 4.") == []
  assert str(ToolResult("text", "ok")) == "text"


def test_toolbox_from_names():
  box = ToolBox.from_names(["calculator", "tests.test_tools:lookup"])
  assert box.names == ["calculator", "lookup"]
  for names, error in [(["abacus"], "unknown tool 'abacus'"), (["no_such_module_x:f"], "cannot import"),
                       (["rft_jax.tools.calculator:nothing"], "has no function 'nothing'"),
                       (["calculator", "rft_jax.tools.calculator:calculator"], "two tools are named")]:
    with pytest.raises(ValueError, match=error) as info:
      ToolBox.from_names(names)
    assert "\n" not in str(info.value)


# ---- Qwen2.5's chat template ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def qwen_tokenizer():
  from transformers import AutoTokenizer

  tokenizer = AutoTokenizer.from_pretrained(DEMO_TOKENIZER)
  tokenizer.chat_template = QWEN2_5_CHAT_TEMPLATE
  return tokenizer


def test_chat_template_renders_tools_and_tool_messages(qwen_tokenizer):
  box = ToolBox([calculator, lookup])
  turn = ("I need two things.\n" + call("calculator", expression="6*7") + "\n"
          + call("lookup", city="Oslo", days=2, units=None))
  results = box.run(turn)
  messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather and 6*7?"},
              {"role": "assistant", "content": turn}, *[tool_message(r.content) for r in results]]
  text = qwen_tokenizer.apply_chat_template(messages, tools=box.schemas, tokenize=False,
                                            add_generation_prompt=True)
  assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n")
  schemas = "\n".join(json.dumps(schema, ensure_ascii=False) for schema in box.schemas)
  assert "\n<tools>\n" + schemas + "\n</tools>\n" in text  # each schema on its own line
  assert text.endswith("<|im_start|>assistant\n" + turn + "<|im_end|>\n"
                       "<|im_start|>user\n<tool_response>\n42\n</tool_response>\n"
                       "<tool_response>\nOslo: sunny for 2 days\n</tool_response><|im_end|>\n"
                       "<|im_start|>assistant\n")


def test_parser_reads_the_templates_own_tool_calls(qwen_tokenizer):
  """An assistant message with ``tool_calls`` rendered by the template parses back to the same calls."""
  calls = [{"type": "function", "function": {"name": "lookup", "arguments": {"city": "Zürich", "days": 1}}},
           {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "1/3"}}}]
  messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "", "tool_calls": calls}]
  text = qwen_tokenizer.apply_chat_template(messages, tokenize=False)
  turn = text.split("<|im_start|>assistant")[1]
  assert parse_tool_calls(turn).calls == [ToolCall("lookup", {"city": "Zürich", "days": 1}),
                                          ToolCall("calculator", {"expression": "1/3"})]
