r"""Reward schemes, the DAPO over-long penalty, and the reward config.

A scheme maps per-completion judgements to a scalar reward. Judgements (boolean
arrays of shape ``[B]``):

* ``correct``: the completion has a final ``\boxed{}`` (``formatted``) and its content
  is equivalent to the ground truth (verdict ``CORRECT``; ``TIMEOUT``/``ERROR`` are
  not correct);
* ``formatted``: the completion has a well-formed final box (``extract.last_boxed``);
* ``unformatted_correct``: no final box, but the last math span or number of the text
  (``extract.last_unboxed_answer``) is equivalent to the ground truth;
* ``truncated``: generation stopped at the length limit (``finish_reason == 'length'``).

Registered schemes (:data:`SCHEMES`, selected by ``RewardConfig.scheme``):

* ``binary``: :math:`R = \mathbb{1}[\text{correct}]`.
* ``paper_appendix_b`` (arXiv 2602.03392, Appendix B), first matching rule:

  .. math::
     R = \begin{cases}
       1    & \text{correct (boxed and equivalent)} \\
       0    & \text{unformatted\_correct (right answer, no box)} \\
       -1   & \text{truncated (wrong and cut at the length limit)} \\
       -0.1 & \text{otherwise (wrong)}
     \end{cases}

  A box whose content is wrong is wrong even if another number in the text is right.
  A truncated completion whose last number happens to equal the answer gets 0.

DAPO's over-long shaping (:func:`dapo_overlong_penalty`) is an additive term on top
of any scheme when ``RewardConfig.overlong_shaping`` is set.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import numpy as np

from rft_jax.rewards.extract import EXTRACTORS


@dataclasses.dataclass(frozen=True)
class RewardScheme:
  """A registered scheme: ``fn(correct, formatted, unformatted_correct, truncated)``
  returns float32 rewards; ``uses_unformatted`` says whether ``unformatted_correct``
  must be computed (it costs a check per completion without a box)."""

  fn: Callable[..., np.ndarray]
  uses_unformatted: bool = False


def binary_reward(correct, formatted, unformatted_correct, truncated) -> np.ndarray:
  r""":math:`R = \mathbb{1}[\text{correct}]`, in {0, 1}."""
  del formatted, unformatted_correct, truncated
  return np.asarray(correct, bool).astype(np.float32)


def paper_appendix_b_reward(correct, formatted, unformatted_correct, truncated) -> np.ndarray:
  """1 correct; 0 right answer without a box; -1 wrong and truncated; -0.1 wrong."""
  del formatted
  correct, unformatted_correct, truncated = (np.asarray(x, bool) for x in (correct, unformatted_correct, truncated))
  wrong = np.where(truncated, -1.0, -0.1)
  return np.where(correct, 1.0, np.where(unformatted_correct, 0.0, wrong)).astype(np.float32)


SCHEMES: dict[str, RewardScheme] = {
    "binary": RewardScheme(binary_reward),
    "paper_appendix_b": RewardScheme(paper_appendix_b_reward, uses_unformatted=True),
}


def dapo_overlong_penalty(lengths, max_len: int, cache_len: int) -> np.ndarray:
  r"""DAPO's soft over-long punishment (Yu et al. 2025, arXiv 2503.14476, Eq. 13).

  .. math::
     R_\text{length}(L) = \begin{cases}
       0 & L \le L_\max - L_\text{cache} \\
       \frac{(L_\max - L_\text{cache}) - L}{L_\text{cache}}
         & L_\max - L_\text{cache} < L \le L_\max \\
       -1 & L > L_\max
     \end{cases}

  ``lengths`` are response lengths in tokens; the result (float32) is added to the
  scheme's reward. It is 0 at :math:`L_\max - L_\text{cache}` and -1 at :math:`L_\max`.
  """
  if not 0 < cache_len < max_len:
    raise ValueError(f"need 0 < cache_len < max_len, got cache_len={cache_len!r}, max_len={max_len!r}")
  lengths = np.asarray(lengths, np.float64)
  start = max_len - cache_len
  return np.clip((start - lengths) / cache_len, -1.0, 0.0).astype(np.float32)


def _is_int(value) -> bool:
  return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def _is_number(value) -> bool:
  return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool)


@dataclasses.dataclass
class RewardConfig:
  """How completions are scored.

  Attributes:
    scheme: a key of :data:`SCHEMES` (``binary``, ``paper_appendix_b``).
    timeout_s: wall-clock limit of one equivalence check, seconds (> 0).
    num_workers: verifier processes checking at once (>= 1).
    overlong_shaping: add :func:`dapo_overlong_penalty` to the reward.
    overlong_max_len: L_max of the penalty, in tokens (DAPO: 20480).
    overlong_cache_len: L_cache, the length of the linear ramp (DAPO: 4096);
      0 < L_cache < L_max.
    memory_limit_mb: address-space limit of each verifier process (None: none); an
      expression that blows up memory then fails inside its worker (wrong, or an
      ``error`` verdict) instead of exhausting the host.
    step_time_limit_s: wall-clock budget of one scored batch (a step's rollouts, or one
      refill round or evaluation chunk), seconds (> 0, or None: no budget). Past it, every
      answer not yet judged is scored as a timed-out answer (wrong; counted in
      ``timeouts`` and ``over_budget``) instead of each waiting its own ``timeout_s``.
      Default 60 s: a normal batch of ~1000 answers is judged in a few seconds, while 128
      hanging answers at 5 s each on 4 workers would take 160 s.
    extractor: where a completion's final answer is (``extract.EXTRACTORS``): ``boxed`` (the
      last ``\\boxed{}``), ``answer_line`` (the last line ``Answer: X``, DAPO-Math-17k's own
      format), ``answer_line_or_boxed`` (whichever comes last), or ``auto``: a training run
      picks ``answer_line_or_boxed`` when its questions ask for an ``Answer:`` line (the
      ``dapo_math_17k`` rows do), else ``boxed``; elsewhere ``auto`` is ``boxed``.
    functions: the user's own reward functions, ``"package.module:function"``
      (:mod:`rft_jax.rewards.user_functions`); when set, the reward is their
      ``function_weights``-weighted sum (plus the over-long penalty if on) instead of
      ``scheme``, and ``correct`` means a positive reward. ``function_per_sample``: call
      each per completion instead of once per batch.
    max_error_fraction: a training run stops (instead of training on zeros) after a step in
      which the rewards of more than this fraction of the completions could not be computed
      (a user function raised, returned a non-finite value or the wrong count, or timed out;
      a math check failed with an error), in [0, 1]; 1 never stops.
  """

  scheme: str = "binary"
  timeout_s: float = 5.0
  num_workers: int = 4
  overlong_shaping: bool = False
  overlong_max_len: int = 20480
  overlong_cache_len: int = 4096
  memory_limit_mb: Optional[int] = 4096
  step_time_limit_s: Optional[float] = 60.0
  extractor: str = "auto"
  functions: list[str] = dataclasses.field(default_factory=list)
  function_weights: list[float] = dataclasses.field(default_factory=list)
  function_per_sample: bool = False
  max_error_fraction: float = 0.5

  def __post_init__(self):
    if self.function_weights and len(self.function_weights) != len(self.functions):
      raise ValueError(f"rewards.function_weights has {len(self.function_weights)} weights for "
                       f"{len(self.functions)} rewards.functions")
    for name in self.functions:
      if ":" not in name:
        raise ValueError(f"rewards.functions: {name!r} is not of the form 'package.module:function'")
    if self.scheme not in SCHEMES:
      raise ValueError(f"rewards.scheme={self.scheme!r} is not one of {sorted(SCHEMES)}")
    if self.extractor not in ("auto", *EXTRACTORS):
      raise ValueError(f"rewards.extractor={self.extractor!r} is not one of {['auto', *EXTRACTORS]}")
    if not _is_number(self.timeout_s) or not self.timeout_s > 0:
      raise ValueError(f"rewards.timeout_s must be a number > 0, got {self.timeout_s!r}")
    if not _is_int(self.num_workers) or self.num_workers < 1:
      raise ValueError(f"rewards.num_workers must be an int >= 1, got {self.num_workers!r}")
    if not isinstance(self.overlong_shaping, bool):
      raise ValueError(f"rewards.overlong_shaping must be a bool, got {self.overlong_shaping!r}")
    if not _is_int(self.overlong_cache_len) or self.overlong_cache_len < 1:
      raise ValueError(f"rewards.overlong_cache_len must be an int >= 1, got {self.overlong_cache_len!r}")
    if not _is_int(self.overlong_max_len) or self.overlong_max_len <= self.overlong_cache_len:
      raise ValueError(
          f"rewards.overlong_max_len must be an int > overlong_cache_len={self.overlong_cache_len}, "
          f"got {self.overlong_max_len!r}")
    if self.step_time_limit_s is not None and (not _is_number(self.step_time_limit_s)
                                               or not self.step_time_limit_s > 0):
      raise ValueError(f"rewards.step_time_limit_s must be None or a number > 0, got {self.step_time_limit_s!r}")
    if not _is_number(self.max_error_fraction) or not 0 <= self.max_error_fraction <= 1:
      raise ValueError(f"rewards.max_error_fraction must be a number in [0, 1], got {self.max_error_fraction!r}")
    if self.memory_limit_mb is not None and (not _is_int(self.memory_limit_mb) or self.memory_limit_mb < 512):
      raise ValueError(f"rewards.memory_limit_mb must be None or an int >= 512, got {self.memory_limit_mb!r}")
