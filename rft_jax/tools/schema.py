"""A tool's JSON schema, from its type hints and docstring, and a check of the arguments a model gave it.

A tool is a plain Python function. The model sees it as the OpenAI-style schema that a chat template
renders into the system prompt (Qwen's ``<tools>`` block), built by ``transformers.utils.get_json_schema``
exactly as TRL's ``GRPOTrainer(tools=[fn])`` builds it: the name, the docstring's summary, and for each
argument its JSON type (from the hint) and description (from the Google-style ``Args:`` section). A
function whose docstring or hints do not say enough is refused when the schema is built, with one line
naming it, not when the model first calls it.

A model's call names its arguments in JSON. :func:`check_arguments` compares them with the schema
before the function runs, so a wrong call costs one line of feedback to the model, not a traceback:
unknown and missing arguments, and values of the wrong JSON type (an integer is a number; a boolean is
not an integer, although Python's ``bool`` is an ``int``).

Nothing here imports the rest of the project.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

# JSON type -> the Python values that JSON decoding gives for it.
_JSON_TYPES = {
    "string": (str,),
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
    "array": (list,),
    "object": (dict,),
    "null": (type(None),),
}


def tool_schema(fn: Callable) -> dict:
  """The tool's schema as a chat template takes it: ``{"type": "function", "function": {...}}``.

  Args:
    fn: a function with a type hint on every argument and a Google-style docstring whose ``Args:``
      section describes each one.

  Returns:
    ``transformers.utils.get_json_schema(fn)``: the name, description and ``parameters`` (a JSON
    schema object with ``properties`` and ``required``).

  Raises:
    ValueError: one line naming the function and what its docstring or hints lack.
  """
  from transformers.utils import get_json_schema

  name = getattr(fn, "__name__", repr(fn))
  try:
    schema = get_json_schema(fn)
  except Exception as e:  # transformers' DocstringParsingException / TypeHintParsingException
    reason = " ".join(str(e).split())
    raise ValueError(f"tool {name!r} has no usable schema (a type hint on every argument and a "
                     f"Google-style docstring with an Args: line for each are needed): {reason}") from None
  return schema


def _parameters(schema: dict) -> dict:
  """The ``parameters`` object of a tool schema (with or without the ``function`` wrapper)."""
  function = schema.get("function", schema)
  return function.get("parameters") or {"type": "object", "properties": {}}


def _type_error(value: Any, spec: dict) -> Optional[str]:
  """Why ``value`` is not of the JSON type ``spec`` declares (None if it is, or nothing is declared)."""
  declared = spec.get("type")
  if declared is None or (value is None and spec.get("nullable")):  # Optional[X] is X, nullable
    return None
  allowed = declared if isinstance(declared, list) else [declared]
  for json_type in allowed:
    python_types = _JSON_TYPES.get(json_type)
    if python_types is None:  # a type this check does not know: accept
      return None
    if isinstance(value, bool) and json_type in ("integer", "number"):
      continue  # true/false is not a number, although bool subclasses int
    if isinstance(value, python_types):
      if "enum" in spec and value not in spec["enum"]:
        return f"is {value!r}, not one of {spec['enum']}"
      if json_type == "array" and isinstance(spec.get("items"), dict):
        for i, item in enumerate(value):
          error = _type_error(item, spec["items"])
          if error:
            return f"[{i}] {error}"
      return None
  return f"should be {' or '.join(allowed)}, got {_json_type_name(value)}"


def _json_type_name(value: Any) -> str:
  """The JSON name of a decoded value's type."""
  if isinstance(value, bool):
    return "boolean"
  for json_type, python_types in _JSON_TYPES.items():
    if json_type != "number" and isinstance(value, python_types):
      return json_type
  return "number" if isinstance(value, float) else type(value).__name__


def check_arguments(schema: dict, arguments: dict) -> Optional[str]:
  """One line saying what is wrong with a call's arguments, or None if they fit the schema.

  Checked in order: arguments the tool does not take, required ones missing, then each value's JSON
  type (``string``, ``integer``, ``number`` -- an integer is accepted --, ``boolean``, ``array``,
  ``object``; a boolean is not an ``integer`` or ``number``; null only where ``Optional``), an
  array's items and ``enum`` where the schema has them.

  Args:
    schema: a tool schema from :func:`tool_schema`.
    arguments: the call's arguments, decoded from JSON.

  Returns:
    None when the call fits; otherwise one line naming the tool and the arguments at fault.
  """
  name = schema.get("function", schema).get("name", "tool")
  if not isinstance(arguments, dict):
    return f"{name}: arguments must be a JSON object, got {_json_type_name(arguments)}"
  parameters = _parameters(schema)
  properties = parameters.get("properties", {})
  unknown = [key for key in arguments if key not in properties]
  if unknown:
    takes = ", ".join(properties) or "no arguments"
    return f"{name}: unknown argument(s) {', '.join(unknown)} (it takes {takes})"
  missing = [key for key in parameters.get("required", []) if key not in arguments]
  if missing:
    return f"{name}: missing required argument(s) {', '.join(missing)}"
  for key, value in arguments.items():
    error = _type_error(value, properties[key])
    if error:
      return f"{name}: argument {key} {error}"
  return None
