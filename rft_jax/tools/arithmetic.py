"""``add``: the smallest builtin tool, for demos and tests of the tool-calling loop.

A model that is asked to sum two integers can call it instead of adding in its head; its schema is
built from the hints and the docstring below (:func:`~rft_jax.tools.schema.tool_schema`), so the
docstring is what the model reads. The ``tools`` environment offers it as ``"add"``
(:meth:`~rft_jax.tools.toolbox.ToolBox.from_names`).

Nothing here imports the rest of the project.
"""

from __future__ import annotations


def add(a: int, b: int) -> int:
  """Adds two integers.

  Args:
    a: The first integer.
    b: The second integer.

  Returns:
    The sum a + b.
  """
  return a + b
