"""A calculator tool: arithmetic on numbers, evaluated by walking the expression's syntax tree.

The model writes an expression; ``eval`` of it would run any Python (``__import__('os')``), so the
expression is parsed with :mod:`ast` and only numbers, ``+ - * / // % **``, unary ``+``/``-`` and
parentheses are evaluated, node by node. Everything else is refused with a one-line error, returned as
the tool's text, which the model reads and may correct.

Arithmetic can still be a denial of service: ``9**9**9**9`` has more digits than atoms in the
universe, and Python computes integer powers exactly. So the work is bounded before it is done: the
expression's length (:data:`MAX_LENGTH`) and nesting depth (:data:`MAX_DEPTH`), and every integer, the
operands and the estimated result of a power alike, at :data:`MAX_BITS` bits (about 1,000 decimal
digits); a float that overflows or is not finite is an error. Each of these answers in microseconds.

Nothing here imports the rest of the project.
"""

from __future__ import annotations

import ast
import math
import operator
from typing import Union

MAX_LENGTH = 1000  # characters of the expression
MAX_DEPTH = 200  # nested operations (the walk recurses once per level)
MAX_BITS = 3322  # |integer| < 2**3322, about 10**1000

Number = Union[int, float]

_BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_NODE_NAMES = {ast.Call: "a function call", ast.Name: "a name", ast.Attribute: "an attribute",
               ast.Subscript: "indexing", ast.Compare: "a comparison", ast.BoolOp: "and/or",
               ast.Lambda: "a lambda", ast.IfExp: "if/else"}


class CalculatorError(ValueError):
  """An expression the calculator refuses or cannot evaluate (the message is the one line shown)."""


def _checked(value: Number) -> Number:
  """``value`` if it is within the bounds, else :class:`CalculatorError`."""
  if isinstance(value, complex):
    raise CalculatorError("the result is a complex number")
  if isinstance(value, int) and abs(value).bit_length() > MAX_BITS:
    raise CalculatorError(f"a number is too large (over 2**{MAX_BITS})")
  if isinstance(value, float) and not math.isfinite(value):
    raise CalculatorError("the result overflows (not a finite number)")
  return value


def _power(base: Number, exponent: Number) -> Number:
  """``base ** exponent``, refused before it is computed when the integer result would be too large."""
  if isinstance(base, int) and isinstance(exponent, int) and abs(base) > 1 and exponent > 0:
    # |base| >= 2**(b - 1) for b = base.bit_length(): the result has over (b - 1) * exponent bits; at
    # most b * exponent <= 2 * MAX_BITS when it passes, which is fast to compute.
    if (abs(base).bit_length() - 1) * exponent > MAX_BITS:
      raise CalculatorError(f"{base}**{exponent} is too large (over 2**{MAX_BITS})")
  return base ** exponent


def _evaluate(node: ast.AST, depth: int) -> Number:
  if depth > MAX_DEPTH:
    raise CalculatorError(f"the expression is nested more than {MAX_DEPTH} deep")
  if isinstance(node, ast.Expression):
    return _evaluate(node.body, depth + 1)
  if isinstance(node, ast.Constant):
    if isinstance(node.value, bool) or not isinstance(node.value, (int, float)):
      raise CalculatorError(f"only numbers are allowed, found {node.value!r}")
    return _checked(node.value)
  if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
    return _checked(_UNARY[type(node.op)](_evaluate(node.operand, depth + 1)))
  if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
    left = _evaluate(node.left, depth + 1)
    right = _evaluate(node.right, depth + 1)
    if isinstance(node.op, ast.Pow):
      return _checked(_power(left, right))
    return _checked(_BINARY[type(node.op)](left, right))
  found = _NODE_NAMES.get(type(node), type(node).__name__)
  raise CalculatorError(f"only numbers, + - * / // % ** and parentheses are allowed (found {found})")


def evaluate(expression: str) -> Number:
  """The value of an arithmetic expression.

  Args:
    expression: numbers (integers, decimals, ``1e-3``) with ``+ - * / // % **``, unary ``+``/``-``
      and parentheses.

  Returns:
    An ``int`` when every step is integral (``/`` gives a float), else a ``float``.

  Raises:
    CalculatorError: the expression is not arithmetic, is out of bounds, or its value is undefined
      (division by zero) or too large.
  """
  if len(expression) > MAX_LENGTH:
    raise CalculatorError(f"the expression is longer than {MAX_LENGTH} characters")
  try:
    tree = ast.parse(expression.strip(), mode="eval")
  except (SyntaxError, ValueError, RecursionError, MemoryError) as e:
    raise CalculatorError(f"not an expression ({getattr(e, 'msg', None) or e})") from None
  try:
    return _evaluate(tree, 0)
  except ZeroDivisionError:
    raise CalculatorError("division by zero") from None
  except OverflowError:
    raise CalculatorError("the result is too large for a float") from None
  except RecursionError:
    raise CalculatorError(f"the expression is nested more than {MAX_DEPTH} deep") from None


def calculator(expression: str) -> str:
  """Evaluates an arithmetic expression and returns its value.

  Args:
    expression: The expression, e.g. "(17 + 4) * 3 / 7" or "2**10 % 7": numbers with
      + - * / // % **, unary minus and parentheses.

  Returns:
    The value as text, or a line starting with "Error:" saying why there is none.
  """
  try:
    value = evaluate(expression)
  except CalculatorError as e:
    return f"Error: {e}"
  return repr(value)
