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
"""

from __future__ import annotations

import importlib
import math
from typing import Any, Callable, Optional, Sequence

import numpy as np

from rft_jax.rewards.pool import OVER_BUDGET, TimeLimitedPool


def load_function(name: str, key: str = "rewards.functions") -> Callable:
  """The function ``"package.module:function"`` names; a ``ValueError`` naming ``key`` if not."""
  module_name, _, attribute = name.partition(":")
  if not module_name or not attribute:
    raise ValueError(f"{key}: {name!r} is not of the form 'package.module:function'")
  try:
    module = importlib.import_module(module_name)
  except Exception as exc:
    raise ValueError(f"{key}: cannot import {module_name!r} for {name!r} ({type(exc).__name__}: {exc})") from exc
  fn = getattr(module, attribute, None)
  if not callable(fn):
    raise ValueError(f"{key}: module {module_name!r} has no function {attribute!r}")
  return fn


def _batched(fn: Callable, completions: list, answers: list, rows: list) -> list[float]:
  values = [float(v) for v in fn(completions, answers, rows)]
  if len(values) != len(completions):
    raise ValueError(f"returned {len(values)} rewards for {len(completions)} completions")
  return _finite(values)


def _per_sample(fn: Callable, completion: str, answer: str, row: dict) -> float:
  return _finite([float(fn(completion, answer, row))])[0]


def _finite(values: list[float]) -> list[float]:
  bad = [v for v in values if not math.isfinite(v)]
  if bad:
    raise ValueError(f"returned a non-finite reward ({bad[0]})")
  return values


def function_rewards(functions: Sequence[str], weights: Sequence[float], per_sample: bool,
                     completions: Sequence[str], answers: Sequence[str], rows: Sequence[dict], *,
                     pool: TimeLimitedPool, timeout_s: float, budget_s: Optional[float]
                     ) -> tuple[np.ndarray, np.ndarray, int, int]:
  """``(reward [B], timed_out [B], errors, over_budget)`` of the weighted user functions."""
  n = len(completions)
  reward = np.zeros(n, np.float64)
  timed_out = np.zeros(n, bool)
  errors = over_budget = 0
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
    for outcome, indices in zip(outcomes, owners):
      if outcome.status == "ok":
        reward[indices] += weight * np.asarray(outcome.value, np.float64)
      elif outcome.status == "timeout":
        timed_out[indices] = True
        over_budget += len(indices) if outcome.value == OVER_BUDGET else 0
      else:
        errors += len(indices)
  return reward.astype(np.float32), timed_out, errors, over_budget


def example_rows(examples: Sequence[Any]) -> list[dict]:
  """Dataset examples (``question``, ``answer``, ``id`` attributes) as the ``rows`` of a call."""
  return [{"question": e.question, "answer": e.answer, "id": e.id} for e in examples]
