"""Reward functions of the user's own, named ``"package.module:function"`` in ``rewards.functions``.

A batched function is called as ``fn(completions, answers, rows) -> list[float]`` (one call per
scored batch); with ``rewards.function_per_sample`` as ``fn(completion, answer, row) -> float``
(one call per completion, spread over the workers). ``rows`` are the completions' dataset
examples as dicts (``question``, ``answer``, ``id``). Every call runs in the verifier's worker
processes (:class:`~rft_jax.rewards.pool.TimeLimitedPool`), so a function that hangs or blows
up memory is killed like a math check: a per-sample call after ``timeout_s``, a batched call
after ``step_time_limit_s`` (or ``timeout_s`` x the batch when there is no step budget). A call
that fails, hangs or returns something that is not one finite number per completion gives
those completions reward 0 and counts as an error or a timeout. The reward is the
``function_weights``-weighted sum of the functions (weights default to 1).

A failed call comes back from its worker as a :class:`FunctionFailure` (the exception's type,
message and traceback); the first failure of each kind (function, exception type and the line
that raised it; or the non-finite value, the wrong count, the timeout) is logged once per
process with all of that, the later ones only counted (``train/reward_errors``,
``train/reward_timeouts``; ``rewards.max_error_fraction`` stops a run that they dominate).
"""

from __future__ import annotations

import importlib
import logging
import math
import os
import traceback
from typing import Any, Callable, NamedTuple, Optional, Sequence

import numpy as np

from rft_jax.rewards.pool import OVER_BUDGET, TimeLimitedPool

logger = logging.getLogger(__name__)
_reported: set[tuple] = set()  # the kinds of failure logged so far (function, type, where)


def load_function(name: str, key: str = "rewards.functions", near: Sequence[str] = ()) -> Callable:
  """The function ``"package.module:function"`` names; a ``ValueError`` naming ``key`` if not.

  A module that is not found gets :func:`path_hint`'s hint (``near``: directories where its file
  may be, besides the current one)."""
  module_name, _, attribute = name.partition(":")
  if not module_name or not attribute:
    raise ValueError(f"{key}: {name!r} is not of the form 'package.module:function'")
  try:
    module = importlib.import_module(module_name)
  except Exception as exc:
    raise ValueError(f"{key}: cannot import {module_name!r} for {name!r} ({type(exc).__name__}: {exc})"
                     f"{path_hint(module_name, exc, near)}") from exc
  fn = getattr(module, attribute, None)
  if not callable(fn):
    raise ValueError(f"{key}: module {module_name!r} has no function {attribute!r}")
  return fn


def path_hint(module_name: str, exc: BaseException, near: Sequence[str] = ()) -> str:
  """Where ``module_name`` was not found (``exc``, a ``ModuleNotFoundError`` for it or its
  package, not for something it imports): the ``PYTHONPATH`` to set, naming the directory that
  holds its file where one of the current directory and ``near`` does; else ''."""
  top = module_name.split(".")[0]
  if not isinstance(exc, ModuleNotFoundError) or exc.name not in (top, module_name):
    return ""  # the module was found; something inside it failed
  relative = os.path.join(*module_name.split("."))
  for directory in [os.getcwd(), *near]:
    if os.path.isfile(os.path.join(directory, relative + ".py")) or os.path.isfile(
        os.path.join(directory, relative, "__init__.py")):
      where = "." if os.path.abspath(directory) == os.getcwd() else directory
      return (f"; {relative}.py is in {os.path.abspath(directory)}: put that directory on the module "
              f"search path, e.g. PYTHONPATH={where} rft-jax ...")
  return (f"; put the directory that holds {relative}.py on the module search path, e.g. "
          f"PYTHONPATH=/path/to/that/directory rft-jax ... (PYTHONPATH=. from that directory)")


class FunctionFailure(NamedTuple):
  """A call of a user function that failed, as its worker reports it: the exception's type
  name, its message (one line, at most 300 characters) and the traceback from the function's
  frame down ('' when the function returned a wrong value: the message says which)."""

  kind: str
  message: str
  traceback: str = ""

  def where(self) -> str:
    """The line that raised (the traceback's last frame), or the message: what makes two
    failures the same kind."""
    frames = [line.strip() for line in self.traceback.splitlines() if line.strip().startswith("File ")]
    return frames[-1] if frames else self.message


def _failure(exc: BaseException) -> FunctionFailure:
  text = str(exc).strip().splitlines()
  message = text[0][:300] if text else ""
  tb = exc.__traceback__.tb_next if exc.__traceback__ is not None else None  # from the function down
  return FunctionFailure(type(exc).__name__, message, "".join(traceback.format_exception(type(exc), exc, tb)))


def _batched(fn: Callable, completions: list, answers: list, rows: list) -> list[float] | FunctionFailure:
  try:
    values = fn(completions, answers, rows)
  except Exception as exc:  # noqa: BLE001 - the user's code: reported, not raised
    return _failure(exc)
  return _checked(values, len(completions))


def _per_sample(fn: Callable, completion: str, answer: str, row: dict) -> float | FunctionFailure:
  try:
    value = fn(completion, answer, row)
  except Exception as exc:  # noqa: BLE001
    return _failure(exc)
  checked = _checked([value], 1)
  return checked if isinstance(checked, FunctionFailure) else checked[0]


def _checked(values: Any, count: int) -> list[float] | FunctionFailure:
  """``values`` as ``count`` finite floats, or the :class:`FunctionFailure` saying what is wrong."""
  try:
    values = [float(v) for v in values]
  except (TypeError, ValueError) as exc:
    return FunctionFailure(type(exc).__name__, f"returned {_shown(values)}, not numbers ({exc})")
  if len(values) != count:
    return FunctionFailure("ValueError", f"returned {len(values)} rewards for {count} completions")
  bad = [v for v in values if not math.isfinite(v)]
  if bad:
    return FunctionFailure("ValueError", f"returned a non-finite reward ({bad[0]})")
  return values


def _shown(value: Any) -> str:
  text = repr(value)
  return text if len(text) <= 60 else text[:57] + "..."


def _report_first(name: str, failure: FunctionFailure, completions: int) -> None:
  """Logs ``failure`` of function ``name`` if it is the first of its kind in this process."""
  key = (name, failure.kind, failure.where())
  if key in _reported:
    return
  _reported.add(key)
  what = f"{failure.kind}: {failure.message}" if failure.traceback else failure.message
  logger.warning("reward function %s failed on %d completion(s): %s (its first failure of this kind; "
                 "they score 0; later ones are only counted, in train/reward_errors or "
                 "train/reward_timeouts)%s", name, completions,
                 what, "\n" + failure.traceback.rstrip() if failure.traceback else "")


def function_rewards(functions: Sequence[str], weights: Sequence[float], per_sample: bool,
                     completions: Sequence[str], answers: Sequence[str], rows: Sequence[dict], *,
                     pool: TimeLimitedPool, timeout_s: float, budget_s: Optional[float]
                     ) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
  """``(reward [B], timed_out [B], errored [B], over_budget)`` of the weighted user functions:
  ``errored`` marks the completions a function failed on (raised, or returned a non-finite
  value or the wrong count), ``timed_out`` those it did not finish in time."""
  n = len(completions)
  reward = np.zeros(n, np.float64)
  timed_out = np.zeros(n, bool)
  errored = np.zeros(n, bool)
  over_budget = 0
  weights = list(weights) or [1.0] * len(functions)
  for name, weight in zip(functions, weights):
    fn = load_function(name)
    if per_sample:
      outcomes = pool.map(_per_sample, [(fn, c, a, r) for c, a, r in zip(completions, answers, rows)],
                          timeout_s, budget_s=budget_s)
      owners = [[i] for i in range(n)]
    else:
      outcomes = pool.map(_batched, [(fn, list(completions), list(answers), list(rows))],
                          budget_s or timeout_s * max(n, 1))
      owners = [list(range(n))]
    failures: dict[tuple, tuple[FunctionFailure, int]] = {}  # this batch's, by kind: (first, count)
    for outcome, indices in zip(outcomes, owners):
      if outcome.status == "ok" and not isinstance(outcome.value, FunctionFailure):
        reward[indices] += weight * np.asarray(outcome.value, np.float64)
        continue
      if outcome.status == "timeout":
        timed_out[indices] = True
        over_budget += len(indices) if outcome.value == OVER_BUDGET else 0
        limit = (f"rewards.timeout_s={timeout_s} s" if per_sample else
                 f"the batch's {budget_s or timeout_s * max(n, 1)} s")
        failure = FunctionFailure("timeout", f"did not return within {limit}; its worker was killed")
      else:
        errored[indices] = True
        failure = (outcome.value if isinstance(outcome.value, FunctionFailure) else
                   FunctionFailure("WorkerError", str(outcome.value)))  # e.g. the worker died
      first, count = failures.get((failure.kind, failure.where()), (failure, 0))
      failures[failure.kind, failure.where()] = (first, count + len(indices))
    for first, count in failures.values():
      _report_first(name, first, count)
  return reward.astype(np.float32), timed_out, errored, over_budget


def example_rows(examples: Sequence[Any]) -> list[dict]:
  """Dataset examples (``question``, ``answer``, ``id`` attributes) as the ``rows`` of a call."""
  return [{"question": e.question, "answer": e.answer, "id": e.id} for e in examples]
