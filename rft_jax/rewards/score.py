r"""Score a batch of completions: extract, verify in the worker pool, apply the scheme.

All checks of a batch are handed to the :class:`~rft_jax.rewards.pool.TimeLimitedPool`
at once and run concurrently in ``config.num_workers`` processes, so one slow or
hanging answer costs at most ``config.timeout_s`` of one worker, not the batch. The
whole batch has ``config.step_time_limit_s``: past it, the answers not yet judged are
scored as timed out (wrong) and counted in ``timeouts`` and ``over_budget``, so a batch
of hanging answers costs that budget, not ``timeout_s`` each.

The reward of completion :math:`i` is

.. math::
   R_i = \text{scheme}(\text{correct}_i, \text{formatted}_i,
         \text{unformatted\_correct}_i, \text{truncated}_i)
         + [\text{overlong\_shaping}]\; R_\text{length}(L_i)

(see :mod:`rft_jax.rewards.schemes`).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Optional, Sequence

import numpy as np

from rft_jax.rewards.extract import EXTRACTORS, last_unboxed_answer
from rft_jax.rewards.pool import TimeLimitedPool
from rft_jax.rewards.schemes import SCHEMES, RewardConfig, dapo_overlong_penalty
from rft_jax.rewards.user_functions import function_rewards
from rft_jax.rewards.verify import Verdict, check_within_budget, default_pool

logger = logging.getLogger(__name__)

TRUNCATED_FINISH_REASON = "length"


@dataclasses.dataclass(frozen=True)
class RewardResult:
  """Rewards and judgements of a batch of ``B`` completions, in input order.

  Attributes:
    reward: float32 ``[B]``, scheme plus optional over-long penalty.
    correct: bool ``[B]``, the final answer (``rewards.extractor``: by default the last
      ``\\boxed{}``) is equivalent to the ground truth.
    formatted: bool ``[B]``, a well-formed final answer exists.
    unformatted_correct: bool ``[B]``, no box but the last math span / number is
      right (computed only for schemes that use it; False otherwise).
    truncated: bool ``[B]``, ``finish_reason == 'length'``.
    timed_out: bool ``[B]``, a check of this completion hit the time limit (its own, or
      the batch's budget).
    timeouts / errors: number of checks that timed out / failed in the batch (with
      ``RewardConfig.functions``: completions a function timed out / failed on: raised, or
      returned a non-finite value or the wrong count).
    over_budget: how many of the ``timeouts`` the batch's budget
      (``RewardConfig.step_time_limit_s``) cut, not started or stopped when it ran out.
    failed: bool ``[B]``, no reward could be computed and the completion scores 0: its check
      failed with an error, or a user function failed or timed out on it (a math check that
      times out is a wrong answer, by design, not a failure).
  """

  reward: np.ndarray
  correct: np.ndarray
  formatted: np.ndarray
  unformatted_correct: np.ndarray
  truncated: np.ndarray
  timed_out: np.ndarray
  timeouts: int
  errors: int
  over_budget: int = 0
  failed: Optional[np.ndarray] = None  # None: nothing failed

  def failures(self) -> int:
    """How many completions' rewards could not be computed (:attr:`failed`)."""
    return 0 if self.failed is None else int(self.failed.sum())

  def metrics(self, prefix: str = "reward/") -> dict[str, float]:
    """Batch means and counts for logging."""
    if self.reward.size == 0:
      return {f"{prefix}timeouts": 0.0, f"{prefix}errors": 0.0, f"{prefix}over_budget": 0.0}
    return {
        f"{prefix}mean": float(self.reward.mean()),
        f"{prefix}accuracy": float(self.correct.mean()),
        f"{prefix}format_rate": float(self.formatted.mean()),
        f"{prefix}truncated_rate": float(self.truncated.mean()),
        f"{prefix}timeouts": float(self.timeouts),
        f"{prefix}errors": float(self.errors),
        f"{prefix}over_budget": float(self.over_budget),
    }


def score_batch(
    completions: Sequence[str],
    answers: Sequence[str],
    finish_reasons: Sequence[str],
    lengths: Sequence[int],
    config: RewardConfig,
    *,
    pool: Optional[TimeLimitedPool] = None,
    rows: Optional[Sequence[dict]] = None,
) -> RewardResult:
  """Rewards of ``completions`` against ground-truth ``answers``.

  Args:
    completions: generated texts (the response only, without the prompt).
    answers: ground truths, one per completion (LaTeX; a full solution is reduced to
      its last ``\\boxed{}``).
    finish_reasons: ``'length'`` marks a completion cut at the length limit.
    lengths: response lengths in tokens (for the over-long penalty).
    config: the :class:`RewardConfig`.
    pool: the verifier pool; default: the process-wide one of ``config``'s settings.
    rows: the completions' dataset rows (dicts), passed to ``config.functions``; default:
      ``{"answer": answer}`` each.
  """
  n = len(completions)
  for name, seq in (("answers", answers), ("finish_reasons", finish_reasons), ("lengths", lengths)):
    if len(seq) != n:
      raise ValueError(f"score_batch: len({name})={len(seq)} != len(completions)={n}")
  truncated = np.array([r == TRUNCATED_FINISH_REASON for r in finish_reasons], bool)
  if config.functions:
    return _score_with_functions(completions, answers, rows, lengths, truncated, config, pool)
  scheme = SCHEMES[config.scheme]
  extract = EXTRACTORS["boxed" if config.extractor == "auto" else config.extractor]
  final = [extract(text) for text in completions]  # the answer in the required format
  formatted = np.array([f is not None for f in final], bool)

  # One check per completion: its box, else (if the scheme needs it) its last answer.
  pairs, owners, is_boxed = [], [], []
  for i, (text, answer) in enumerate(zip(completions, answers)):
    candidate = final[i] if final[i] is not None else (
        last_unboxed_answer(text) if scheme.uses_unformatted else None)
    if candidate is not None:
      pairs.append((candidate, answer))
      owners.append(i)
      is_boxed.append(final[i] is not None)
  if pairs and pool is None:
    pool = default_pool(config.num_workers, memory_limit_mb=config.memory_limit_mb)
  verdicts, over_budget = check_within_budget(
      pairs, timeout_s=config.timeout_s, budget_s=config.step_time_limit_s, pool=pool) if pairs else ([], 0)
  if over_budget:
    logger.warning("rewards: the batch's time budget rewards.step_time_limit_s=%s ran out; %d of %d "
                   "answers were not judged and count as timed out (wrong)",
                   config.step_time_limit_s, over_budget, len(pairs))

  correct = np.zeros(n, bool)
  unformatted_correct = np.zeros(n, bool)
  timed_out = np.zeros(n, bool)
  failed = np.zeros(n, bool)
  for i, in_box, verdict in zip(owners, is_boxed, verdicts):
    (correct if in_box else unformatted_correct)[i] = verdict is Verdict.CORRECT
    timed_out[i] = verdict is Verdict.TIMEOUT
    failed[i] = verdict is Verdict.ERROR

  reward = _with_overlong_penalty(scheme.fn(correct, formatted, unformatted_correct, truncated),
                                  lengths, config)
  return RewardResult(
      reward=reward.astype(np.float32),
      correct=correct,
      formatted=formatted,
      unformatted_correct=unformatted_correct,
      truncated=truncated,
      timed_out=timed_out,
      timeouts=int(timed_out.sum()),
      errors=int(failed.sum()),
      over_budget=int(over_budget),
      failed=failed,
  )


def _with_overlong_penalty(reward: np.ndarray, lengths: Sequence[int], config: RewardConfig) -> np.ndarray:
  if config.overlong_shaping:
    reward = reward + dapo_overlong_penalty(lengths, config.overlong_max_len, config.overlong_cache_len)
  return reward.astype(np.float32)


def _score_with_functions(completions, answers, rows, lengths, truncated, config: RewardConfig,
                          pool: Optional[TimeLimitedPool]) -> RewardResult:
  """The user's reward functions (``config.functions``) in the verifier's worker processes."""
  if pool is None:
    pool = default_pool(config.num_workers, memory_limit_mb=config.memory_limit_mb)
  rows = [{"answer": a} for a in answers] if rows is None else list(rows)
  reward, timed_out, errored, over_budget = function_rewards(
      config.functions, config.function_weights, config.function_per_sample, completions, answers,
      rows, pool=pool, timeout_s=config.timeout_s, budget_s=config.step_time_limit_s)
  reward = _with_overlong_penalty(reward, lengths, config)
  none = np.zeros(len(completions), bool)
  return RewardResult(reward=reward, correct=reward > 0, formatted=none, unformatted_correct=none,
                      truncated=truncated, timed_out=timed_out, timeouts=int(timed_out.sum()),
                      errors=int(errored.sum()), over_budget=int(over_budget), failed=errored | timed_out)
