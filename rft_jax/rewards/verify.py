r"""Is an extracted answer equivalent to the ground truth? Time-limited, in a process.

:func:`check_equivalence` decides in-process, with no time limit:

1. **Normalised string equality** (:func:`normalize_answer`) -- cheap, and it also
   settles answers math-verify cannot parse.
2. **math-verify**: both sides are wrapped as inline math, ``$...$``, and parsed with
   ``math_verify.parse(s, extraction_config=[LatexExtractionConfig(),
   ExprExtractionConfig()], parsing_timeout=None)``, then compared with
   ``math_verify.verify(gold, pred, timeout_seconds=None)`` (gold first: the
   comparison is not symmetric). Wrapping in ``$`` makes the LaTeX extractor take the
   whole answer (``\frac{1}{2}``, ``2\sqrt{3}``, ``x=3``, ``\{1,2\}``, ``(1,2]``) and
   the expression extractor catches plain ``1/2`` or ``0.5``. Both of math-verify's
   signal-based timeouts are off (``None``); the limit is the worker process's.

math-verify compares numbers after rounding to 6 decimals (``float_rounding=6``), so
``0.5000001`` equals ``1/2``; ``x=3`` equals ``3`` (an assignment is reduced to its
right side); ``10\%`` equals ``0.1`` and ``10``; units in ``\text{}`` are dropped.

:func:`is_equivalent` / :func:`check_many` run :func:`check_equivalence` in a
:class:`~rft_jax.rewards.pool.TimeLimitedPool` and map the outcome to a
:class:`Verdict`: ``timeout`` and ``error`` count as wrong in every reward scheme.
"""

from __future__ import annotations

import atexit
import enum
import logging
import re
import threading
from typing import Optional, Sequence

from rft_jax.rewards.extract import last_boxed
from rft_jax.rewards.pool import OVER_BUDGET, TimeLimitedPool

DEFAULT_TIMEOUT_S = 5.0


class Verdict(str, enum.Enum):
  """Outcome of one equivalence check. Only ``CORRECT`` earns a reward."""

  CORRECT = "correct"
  WRONG = "wrong"
  TIMEOUT = "timeout"
  ERROR = "error"


_TEXT_WRAPPER = re.compile(r"\\(?:text|textbf|textrm|mathrm|mbox)\s*\{([^{}]*)\}")
_SPACING = re.compile(r"\\(?:left|right)(?![A-Za-z])|\\[!,;: ]")
_UNESCAPED_DOLLAR = re.compile(r"(?<!\\)\$")


def normalize_answer(text: str) -> str:
  r"""Canonical string of an answer for exact comparison.

  In order: drop ``\$`` and ``$``; unwrap ``\text{X}``, ``\textbf{X}``, ``\mathrm{X}``,
  ``\mbox{X}`` to ``X``; drop ``\left``, ``\right`` and the spacing commands ``\!``,
  ``\,``, ``\;``, ``\:``, ``\ ``; ``\dfrac``/``\tfrac`` -> ``\frac``; remove all
  whitespace; strip trailing ``.``. Nothing else (no unit or word removal): the
  mathematical equivalences are math-verify's job.
  """
  s = text.replace("\\$", "").replace("$", "")
  while True:
    unwrapped = _TEXT_WRAPPER.sub(r"\1", s)
    if unwrapped == s:
      break
    s = unwrapped
  s = _SPACING.sub("", s)
  s = re.sub(r"\\[dt]frac(?![A-Za-z])", r"\\frac", s)
  s = re.sub(r"\s+", "", s)
  return s.rstrip(".")


def _as_inline_math(text: str) -> str:
  """``$text$`` with unescaped ``$`` and a trailing ``.`` removed."""
  return "$" + _UNESCAPED_DOLLAR.sub("", text).strip().rstrip(".").strip() + "$"


def _parse(text: str) -> list:
  import math_verify

  if not normalize_answer(text):
    return []
  return math_verify.parse(
      _as_inline_math(text),
      extraction_config=[math_verify.LatexExtractionConfig(), math_verify.ExprExtractionConfig()],
      parsing_timeout=None,
  )


def _gold_text(ground_truth: str) -> str:
  """A ground truth given as a full solution is reduced to its last box."""
  boxed = last_boxed(ground_truth) if "\\boxed" in ground_truth or "\\fbox" in ground_truth else None
  return ground_truth if boxed is None else boxed


def check_equivalence(answer: Optional[str], ground_truth: str) -> Verdict:
  """``CORRECT`` or ``WRONG``, in this process and with **no time limit**.

  ``answer`` None (no box) or blank is ``WRONG``. Use :func:`is_equivalent` for
  untrusted model output.
  """
  if answer is None:
    return Verdict.WRONG
  gold = _gold_text(ground_truth)
  norm = normalize_answer(answer)
  if not norm:
    return Verdict.WRONG
  if norm == normalize_answer(gold):
    return Verdict.CORRECT
  import math_verify

  gold_parsed, pred_parsed = _parse(gold), _parse(answer)
  if gold_parsed and pred_parsed and math_verify.verify(gold_parsed, pred_parsed, timeout_seconds=None):
    return Verdict.CORRECT
  return Verdict.WRONG


def worker_init() -> None:
  """Worker start-up: import and warm math-verify; silence its per-process
  "timeout is disabled" warning (the limit is enforced by the pool)."""
  logging.getLogger("math_verify").setLevel(logging.ERROR)
  check_equivalence("\\frac{1}{2}", "0.5")


def make_pool(num_workers: int = 4, *, memory_limit_mb: Optional[int] = None) -> TimeLimitedPool:
  """A :class:`TimeLimitedPool` whose workers have math-verify imported and warm."""
  return TimeLimitedPool(num_workers, initializer=worker_init, memory_limit_mb=memory_limit_mb)


_default_pool: Optional[TimeLimitedPool] = None
_default_key: Optional[tuple] = None
_default_lock = threading.Lock()


def default_pool(num_workers: int = 2, *, memory_limit_mb: Optional[int] = None) -> TimeLimitedPool:
  """The process-wide pool used when none is passed: created on first use, closed at
  exit, and recreated when asked for different settings."""
  global _default_pool, _default_key
  key = (num_workers, memory_limit_mb)
  with _default_lock:
    if _default_pool is None or _default_key != key:
      if _default_pool is not None:
        _default_pool.close()
      _default_pool = make_pool(num_workers, memory_limit_mb=memory_limit_mb)
      _default_key = key
    return _default_pool


@atexit.register
def _close_default_pool() -> None:
  if _default_pool is not None:
    _default_pool.close()


_STATUS_VERDICT = {"timeout": Verdict.TIMEOUT, "error": Verdict.ERROR}


def check_many(
    pairs: Sequence[tuple[Optional[str], str]],
    *,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    pool: Optional[TimeLimitedPool] = None,
    budget_s: Optional[float] = None,
) -> list[Verdict]:
  """Verdicts of ``(answer, ground_truth)`` pairs, checked concurrently in ``pool``,
  each under ``timeout_s`` seconds; in input order. ``answer`` None is ``WRONG``
  without a worker round trip. ``budget_s`` bounds the whole batch (see
  :func:`check_within_budget`)."""
  return check_within_budget(pairs, timeout_s=timeout_s, budget_s=budget_s, pool=pool)[0]


def check_within_budget(
    pairs: Sequence[tuple[Optional[str], str]],
    *,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    budget_s: Optional[float] = None,
    pool: Optional[TimeLimitedPool] = None,
) -> tuple[list[Verdict], int]:
  """:func:`check_many` whose whole batch has ``budget_s`` seconds (None: no budget).

  Once the budget is spent, checks still running are stopped and checks not started are
  skipped; each is a ``TIMEOUT`` verdict. Returns the verdicts and how many of them the
  budget cut (as opposed to a check's own ``timeout_s``).
  """
  verdicts: list[Optional[Verdict]] = [Verdict.WRONG if a is None else None for a, _ in pairs]
  todo = [i for i, v in enumerate(verdicts) if v is None]
  over_budget = 0
  if todo:
    pool = default_pool() if pool is None else pool
    outcomes = pool.map(check_equivalence, [pairs[i] for i in todo], timeout_s, budget_s=budget_s)
    for i, out in zip(todo, outcomes):
      verdicts[i] = Verdict(out.value) if out.status == "ok" else _STATUS_VERDICT[out.status]
      over_budget += out.status == "timeout" and out.value == OVER_BUDGET
  return verdicts, over_budget  # type: ignore[return-value]


def is_equivalent(
    answer: Optional[str],
    ground_truth: str,
    *,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    pool: Optional[TimeLimitedPool] = None,
) -> Verdict:
  r"""Verdict of ``answer`` against ``ground_truth`` within ``timeout_s`` seconds.

  The check runs in a worker process; past the limit the worker is killed and the
  verdict is ``TIMEOUT`` (which scores as wrong). ``pool`` defaults to
  :func:`default_pool`.
  """
  return check_many([(answer, ground_truth)], timeout_s=timeout_s, pool=pool)[0]
