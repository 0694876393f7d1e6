r"""rft_jax/environments/tool_use.py: the ``tools`` environment. Qwen-format calls answered with tool
messages (calculator, add, the sandboxed python tool), malformed and wrong calls fed back as errors and
counted, a python loop stopped by its time limit, the final ``\boxed{}`` or last number graded, the
config and row checked, the environment run end to end in the workers, and its tools' schemas rendered
by Qwen2.5's chat template."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from qwen_templates import QWEN2_5_CHAT_TEMPLATE

import rft_jax
import rft_jax.environments as E
from rft_jax.environments.tool_use import last_number
from rft_jax.tools import sandbox_missing

pytestmark = pytest.mark.timeout(60)

DEMO_TOKENIZER = Path(rft_jax.__file__).parent / "demo" / "checkpoint"
PROMPT = [{"role": "user", "content": "What is 17 * 23? Put the answer in \\boxed{}."}]


def call(name, **arguments):
  return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def explode(reason: str) -> str:
  """Always fails.

  Args:
    reason: Why it fails.
  """
  raise RuntimeError(f"failed: {reason}\nsecond line")


def counts(out, **expected):
  """The metadata's counts: every ``tool_status/<status>`` not named in ``expected`` is 0."""
  meta = out["metadata"]
  statuses = {key.split("/")[1]: n for key, n in meta.items() if key.startswith("tool_status/")}
  assert len(statuses) == 7 and {s: n for s, n in statuses.items() if n} == expected, meta
  return meta["tool_calls"], meta["tool_errors"], meta["tool_timeouts"]


def step(env, action):
  return E.check_step_output(env.step(action), "tools")


def test_a_calculator_call_then_the_boxed_answer():
  env = E.ToolUse({"tools": ["calculator"]}, {"answer": "391"})
  messages, info = env.init(PROMPT)
  assert messages == PROMPT and info == {"tools": ["calculator"]}
  out = step(env, "Let me compute.\n" + call("calculator", expression="17 * 23"))
  assert out["observations"] == [{"role": "tool", "content": "391"}]
  assert (out["reward"], out["done"]) == (0.0, False)
  assert counts(out, ok=1) == (1, 0, 0)
  final = step(env, "The tool says 391, so the answer is $\\boxed{391}$.")
  assert final["observations"] == [] and (final["reward"], final["done"]) == (1.0, True)
  assert final["metadata"]["correct"] is True and final["metadata"]["answer"] == "391"
  assert counts(final) == (0, 0, 0)


def test_an_add_call():
  env = E.ToolUse({"tools": ["add"]}, {"answer": 5})
  (schema,) = env.schemas
  assert schema["function"]["name"] == "add" and schema["function"]["description"] == "Adds two integers."
  assert schema["function"]["parameters"]["required"] == ["a", "b"]
  out = step(env, call("add", a=2, b=3) + "\n" + call("add", a=-7, b=10**12))
  assert [m["content"] for m in out["observations"]] == ["5", str(10**12 - 7)]
  assert counts(out, ok=2) == (2, 0, 0)
  assert step(env, "\\boxed{5}")["reward"] == 1.0  # an int ground truth is compared as text


def test_malformed_unknown_and_wrong_calls_are_errors_the_model_reads():
  env = E.ToolUse({"tools": ["calculator", "add", "test_tool_environment:explode"]}, {"answer": "4"})
  turn = ("<tool_call>\n{\"name\": \"add\", \"arguments\": {\"a\": 1,}}\n</tool_call>\n"  # not JSON
          + call("abacus", expression="1+1") + call("add", a=1, c=2) + call("add", a="1", b=2)
          + call("explode", reason="on purpose") + call("calculator", expression="1/0")
          + "<tool_call>{\"name\": \"add\"")  # never closed
  out = step(env, turn)
  contents = [m["content"] for m in out["observations"]]
  assert [m["role"] for m in out["observations"]] == ["tool"] * 7
  assert contents[0].startswith("Error: tool call 1: not JSON")
  assert contents[1] == "Error: unknown tool 'abacus': the tools are calculator, add, explode"
  assert contents[2] == "Error: add: unknown argument(s) c (it takes a, b)"
  assert contents[3] == "Error: add: argument a should be integer, got string"
  assert contents[4] == "RuntimeError: failed: on purpose second line"  # one line, the tool's own
  assert contents[5] == "Error: division by zero"  # the calculator's own text: it ran (ok)
  assert contents[6].startswith("Error: tool call 7: <tool_call> is never closed")
  assert (out["reward"], out["done"]) == (0.0, False)
  assert counts(out, invalid_call=2, unknown_tool=1, bad_arguments=2, error=1, ok=1) == (7, 6, 0)
  again = step(env, call("add", a=2, b=2))  # the run goes on
  assert again["observations"] == [{"role": "tool", "content": "4"}] and not again["done"]
  assert step(env, "\\boxed{4}")["reward"] == 1.0


def test_a_python_call_runs_in_the_sandbox():
  assert sandbox_missing() is None, f"no sandbox on this machine: install {sandbox_missing()}"
  env = E.ToolUse({"tools": ["python"]}, {"answer": "4"})
  code = "import os, socket\nprint(2 + 2)\nprint(os.path.exists('/work'), socket.gethostname())"
  out = step(env, call("python", code=code))
  lines = out["observations"][0]["content"].splitlines()
  assert lines[0] == "4" and lines[1].startswith("False ")  # the host's files are not there
  assert counts(out, ok=1) == (1, 0, 0)


@pytest.mark.timeout(30)
def test_a_python_loop_times_out_within_its_limit():
  env = E.ToolUse({"tools": ["python"], "python_limits": {"wall_s": 1.0, "cpu_s": 5}}, {"answer": "4"})
  start = time.monotonic()
  out = step(env, call("python", code="while True:\n  pass\n"))
  elapsed = time.monotonic() - start
  assert elapsed < 5.0, elapsed
  assert "[stopped: over the time limit (1 s wall, 5 s CPU)]" in out["observations"][0]["content"]
  assert (out["reward"], out["done"]) == (0.0, False)
  assert counts(out, timeout=1) == (1, 0, 1)  # a timeout, not an error


def test_a_wrong_or_missing_final_answer_earns_nothing():
  env = E.ToolUse({"tools": ["calculator"]}, {"answer": "\\frac{1}{2}"})
  wrong = step(env, "I think it is \\boxed{0.4}.")
  assert (wrong["reward"], wrong["done"], wrong["metadata"]["correct"]) == (0.0, True, False)
  assert step(env, "I think it is \\boxed{0.5}.")["reward"] == 1.0  # math equivalence, not strings
  unboxed = step(env, "It is 1/2.")
  assert unboxed["reward"] == 0.0 and unboxed["metadata"]["answer"] is None
  numbers = E.ToolUse({"answer": "last_number"}, {"answer": "1000"})
  assert step(numbers, "First 998, then 2 more: 1,000 in all.")["reward"] == 1.0
  assert step(numbers, "Between 999 and 1001.")["reward"] == 0.0
  assert last_number("-3.5 and 7/8.") == "7/8" and last_number("no digits") is None


def test_config_and_row_errors_are_one_line():
  for config, extras, message in [
      ({"tools": ["calculator"], "max_turns": 3, "sandbox": 1}, {"answer": "1"},
       r"unknown config keys \['max_turns', 'sandbox'\]"),
      ({"tools": ["calculator"]}, {"question": "?"}, r"extras\['answer'\] is missing"),
      ({"answer": "first_number"}, {"answer": "1"}, r"answer='first_number' must be one of \['boxed', 'last_number'\]"),
      ({"tools": "calculator"}, {"answer": "1"}, "tools must be a list of tool names"),
      ({"tools": ["abacus"]}, {"answer": "1"}, "unknown tool 'abacus'"),
      ({"python_limits": {"wall": 1}}, {"answer": "1"}, "python_limits must be a dict of SandboxLimits fields"),
      ({"max_output_chars": 0}, {"answer": "1"}, "max_output_chars must be a positive int")]:
    with pytest.raises(ValueError, match=message) as info:
      E.ToolUse(config, extras)
    assert "\n" not in str(info.value)


def test_the_registry_lists_tools():
  assert "tools" in E.registered_names()
  env = E.make_environment(E.EnvironmentSpec("tools", {"tools": ["add"]}), {"answer": "3"})
  assert isinstance(env, E.ToolUse) and env.schemas == E.tool_schemas({"tools": ["add"]})


@pytest.mark.timeout(180)
def test_tools_runs_end_to_end_in_the_workers():
  spec = E.EnvironmentSpec("tools", {"tools": ["calculator"]})
  with E.EnvironmentWorkers(1, step_timeout_s=30, startup_timeout_s=120) as workers:
    begun = workers.start(0, spec, PROMPT, {"answer": "391"}).result(timeout=120)
    assert begun.status == "ok", begun
    assert begun.output["observations"] == PROMPT and begun.output["metadata"] == {"tools": ["calculator"]}
    turns = [workers.step(0, action).result(timeout=60) for action in (
        call("calculator", expression="17 * 23") + call("calculator", expression="17 *"),
        "So \\boxed{391}.")]
    workers.close(0)
  assert [t.status for t in turns] == ["ok", "ok"], turns
  tool_turn, final = (t.output for t in turns)
  assert tool_turn["observations"][0] == {"role": "tool", "content": "391"}
  assert tool_turn["observations"][1]["content"].startswith("Error: not an expression")
  assert (tool_turn["reward"], tool_turn["done"], tool_turn["metadata"]["tool_calls"]) == (0.0, False, 2)
  assert (final["reward"], final["done"], final["metadata"]["correct"]) == (1.0, True, True)


def test_the_tools_schemas_render_in_qwen2_5s_chat_template():
  from transformers import AutoTokenizer

  tokenizer = AutoTokenizer.from_pretrained(DEMO_TOKENIZER)
  tokenizer.chat_template = QWEN2_5_CHAT_TEMPLATE
  env = E.ToolUse({"tools": ["calculator", "add"]}, {"answer": "7"})
  messages, _ = env.init(PROMPT)
  turn = call("add", a=3, b=4)
  messages += [{"role": "assistant", "content": turn}, *step(env, turn)["observations"]]
  text = tokenizer.apply_chat_template(messages, tools=env.schemas, tokenize=False, add_generation_prompt=True)
  schemas = "\n".join(json.dumps(schema, ensure_ascii=False) for schema in env.schemas)
  assert "\n<tools>\n" + schemas + "\n</tools>\n" in text
  assert '"name": "add", "description": "Adds two integers."' in text
  assert text.endswith("<|im_start|>assistant\n" + turn + "<|im_end|>\n"
                       "<|im_start|>user\n<tool_response>\n7\n</tool_response><|im_end|>\n"
                       "<|im_start|>assistant\n")
