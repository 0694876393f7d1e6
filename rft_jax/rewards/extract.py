r"""Pull the final answer out of a completion.

The graded answer is the content of the **last** ``\boxed{...}`` (or ``\fbox{...}``),
matched with balanced braces so that ``\boxed{\frac{1}{2}}`` gives ``\frac{1}{2}``.
There is deliberately no fallback to the whole text: a grader that compares the
full completion when no box is found rewards a model for listing many candidates.
A completion without a well-formed final box has no answer (``None``).

:func:`last_answer_line` reads DAPO-Math-17k's own format instead: its prompts ask for a
final line ``Answer: X``. :data:`EXTRACTORS` names the choices of ``rewards.extractor``;
``answer_line_or_boxed`` takes whichever of the two comes last in the text.

:func:`last_unboxed_answer` is a separate, weaker extractor used only to detect
"correct but not in the required format" (see ``schemes.paper_appendix_b``); it is
never used to award a positive reward.
"""

from __future__ import annotations

import re
from typing import Optional

# ``\boxed`` / ``\fbox`` not followed by a letter (``\boxedsymbol`` is another command).
_BOX = re.compile(r"\\(?:boxed|fbox)(?![A-Za-z])")
# ``\boxed 42``: after whitespace, one token: a run without whitespace, ``$``, braces.
_BOX_TOKEN = re.compile(r"\s+([^\s${}]+)")

# ``Answer: X`` at the start of a line (markdown emphasis allowed: ``**Answer:** X``).
_ANSWER_LINE = re.compile(r"^[ \t*_#>]*answer[ \t*_]*:[ \t*_]*(.*)$", re.IGNORECASE | re.MULTILINE)
_MATH_SPAN = re.compile(r"\$\$(.+?)\$\$|(?<!\\)\$(.+?)(?<!\\)\$|\\\((.+?)\\\)|\\\[(.+?)\\\]", re.DOTALL)
_NUMBER = re.compile(r"(?<![\w.])-?\d+(?:,\d{3})*(?:\.\d+)?(?:/\d+)?")


def _braced(text: str, start: int) -> Optional[str]:
  r"""Content of the brace group opening at ``text[start] == '{'``; None if unbalanced.

  A backslash escapes the next character, so ``\{`` and ``\}`` do not count.
  """
  depth, i = 0, start
  while i < len(text):
    ch = text[i]
    if ch == "\\":
      i += 2
      continue
    if ch == "{":
      depth += 1
    elif ch == "}":
      depth -= 1
      if depth == 0:
        return text[start + 1:i]
    i += 1
  return None


def last_boxed(text: str) -> Optional[str]:
  r"""Content of the last ``\boxed{...}`` / ``\fbox{...}`` in ``text``, or None.

  Accepted forms, with ``X`` returned:

  * ``\boxed{X}`` (also ``\boxed {X}``, ``\fbox{X}``), ``X`` may contain nested and
    escaped braces: ``\boxed{\frac{1}{2}}`` -> ``\frac{1}{2}``;
  * ``\boxed X`` -- whitespace then a single token (no whitespace, ``$`` or braces):
    ``\boxed 42$`` -> ``42``.

  Returns None when there is no box, or when the **last** box is malformed (an
  unclosed brace, as in a truncated ``\boxed{\frac{1}{2``, or ``\boxed`` with no
  argument); an earlier well-formed box does not stand in for a broken final one.
  Never returns the whole text. ``\boxed{}`` gives ``''`` (a box, but an empty answer).
  """
  matches = list(_BOX.finditer(text))
  if not matches:
    return None
  end = matches[-1].end()
  rest = text[end:]
  stripped = rest.lstrip()
  if stripped.startswith("{"):
    return _braced(text, end + len(rest) - len(stripped))
  token = _BOX_TOKEN.match(rest)
  return token.group(1) if token else None


def last_answer_line(text: str) -> Optional[str]:
  r"""``X`` of the last line ``Answer: X`` (DAPO-Math-17k's requested format), or None.

  The line must start with ``Answer:`` (any case; markdown marks such as ``**Answer:**``
  allowed); ``X`` is the rest of that line with surrounding ``$`` and a final period
  removed: ``Answer: $\frac{1}{2}$.`` -> ``\frac{1}{2}``. A line ``Answer:`` with nothing
  after it gives None, as does text without such a line (never the whole text).
  """
  matches = list(_ANSWER_LINE.finditer(text))
  if not matches:
    return None
  answer = matches[-1].group(1).strip().rstrip(".").strip().strip("$").strip()
  return answer or None


def _last_of(text: str, extractors) -> Optional[str]:
  """The answer of whichever extractor's marker starts last in ``text``."""
  marks = [(m.start(), extract) for extract, pattern in extractors
           for m in list(pattern.finditer(text))[-1:]]
  return max(marks, key=lambda m: m[0])[1](text) if marks else None


def answer_line_or_boxed(text: str) -> Optional[str]:
  """:func:`last_boxed` or :func:`last_answer_line`, whichever marker comes last in ``text``."""
  return _last_of(text, ((last_boxed, _BOX), (last_answer_line, _ANSWER_LINE)))


# The final-answer extractors ``rewards.extractor`` names.
EXTRACTORS = {"boxed": last_boxed, "answer_line": last_answer_line,
              "answer_line_or_boxed": answer_line_or_boxed}


def last_unboxed_answer(text: str) -> Optional[str]:
  r"""The last math span or bare number of ``text``, whichever ends later; or None.

  Math spans are ``$...$``, ``$$...$$``, ``\(...\)`` and ``\[...\]`` (their content is
  returned); numbers are ``-12``, ``3.5``, ``1,000``, ``7/8``. A number inside a span
  ends no later than the span, so the span wins. This is the "answer that appears
  without the required format" of ``schemes.paper_appendix_b``.
  """
  best_end, best = -1, None
  for m in _MATH_SPAN.finditer(text):
    content = next(g for g in m.groups() if g is not None)
    if m.end() >= best_end and content.strip():
      best_end, best = m.end(), content.strip()
  for m in _NUMBER.finditer(text):
    if m.end() > best_end:
      best_end, best = m.end(), m.group(0)
  return best
