r"""Policy-gradient loss terms and their aggregation over a training batch.

Per token :math:`t` with ratio :math:`r_t = \exp(\log \pi_\theta - \log \pi_{old})`
and advantage :math:`A_t`, the clipped surrogate (PPO with clip-higher, DAPO) is

.. math::  J_t = \min\big(r_t A_t,\ \mathrm{clip}(r_t, 1 - \epsilon_{low}, 1 + \epsilon_{high}) A_t\big),

and with dual clipping (constant :math:`c > 1`) :math:`J_t = \max(J_t, c A_t)` for
:math:`A_t < 0`. The loss is :math:`-J_t`, aggregated by one of :data:`AGGREGATIONS`:

==========================  ========================================================
``token-mean``              :math:`\sum_{b,t} \ell_{bt} / N_{tokens}`
``seq-mean-token-mean``     :math:`\frac{1}{N_{seq}} \sum_b \frac{1}{|o_b|}\sum_t \ell_{bt}`
``seq-mean-token-sum``      :math:`\frac{1}{N_{seq}} \sum_b \sum_t \ell_{bt}`
``seq-mean-token-sum-norm`` :math:`\frac{1}{N_{seq} L_{max}} \sum_b \sum_t \ell_{bt}` (Dr.GRPO, constant :math:`L_{max}`)
==========================  ========================================================

:math:`N_{tokens}` and :math:`N_{seq}` count the valid tokens / non-empty sequences
of the *whole training batch*: :func:`loss_normaliser` computes them once and every
micro-batch divides by them, so that the gradients of the micro-batches sum exactly
to the gradient of the full batch (normalising per micro-batch would not). Each aggregation is
one row of a table (:class:`Aggregation`) that :func:`aggregate_loss` and
:func:`aggregation_weights` both read.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import jax.numpy as jnp
from jaxtyping import Array, Bool, Float

class PolicyLossTerms(NamedTuple):
  """Per-token pieces of the clipped surrogate, all ``[B, T]``."""

  loss: Float[Array, "B T"]
  ratio: Float[Array, "B T"]
  clipped_low: Bool[Array, "B T"]  # A < 0 and r < 1 - eps_low: the clip is active
  clipped_high: Bool[Array, "B T"]  # A > 0 and r > 1 + eps_high
  clipped_dual: Bool[Array, "B T"]  # A < 0 and r > c


def ppo_clipped_loss(
    logp: Float[Array, "B T"],
    old_logp: Float[Array, "B T"],
    advantages: Float[Array, "B T"],
    *,
    eps_low: float = 0.2,
    eps_high: float = 0.2,
    dual_clip: float | None = None,
    log_ratio_clamp: float = 20.0,
) -> PolicyLossTerms:
  """Clipped surrogate loss per token (see module docstring).

  The log-ratio is clamped to ``[-log_ratio_clamp, log_ratio_clamp]`` before ``exp``
  so that a stale or corrupted log-prob cannot overflow.
  """
  if dual_clip is not None and dual_clip <= 1.0:
    raise ValueError(f"dual_clip must be > 1, got {dual_clip}")
  log_ratio = jnp.clip(logp - old_logp, -log_ratio_clamp, log_ratio_clamp)
  ratio = jnp.exp(log_ratio)
  objective = jnp.minimum(ratio * advantages, jnp.clip(ratio, 1 - eps_low, 1 + eps_high) * advantages)
  clipped_dual = jnp.zeros(ratio.shape, bool)
  if dual_clip is not None:
    clipped_dual = (advantages < 0) & (ratio > dual_clip)
    objective = jnp.where(advantages < 0, jnp.maximum(objective, dual_clip * advantages), objective)
  return PolicyLossTerms(
      loss=-objective,
      ratio=ratio,
      clipped_low=(advantages < 0) & (ratio < 1 - eps_low),
      clipped_high=(advantages > 0) & (ratio > 1 + eps_high),
      clipped_dual=clipped_dual,
  )


class LossNormaliser(NamedTuple):
  """Denominators of the whole training batch (scalars)."""

  tokens: Float[Array, ""]
  sequences: Float[Array, ""]
  max_len: Float[Array, ""]


def loss_normaliser(mask: Array, max_len: int | None = None) -> LossNormaliser:
  """Counts of valid tokens and non-empty sequences in the full batch ``[B, T]`` mask.

  ``max_len`` is Dr.GRPO's constant length (default: the padded width ``T``).
  """
  mask = mask.astype(jnp.float32)
  return LossNormaliser(
      tokens=jnp.maximum(jnp.sum(mask), 1.0),
      sequences=jnp.maximum(jnp.sum(jnp.any(mask > 0, axis=-1)), 1.0),
      max_len=jnp.asarray(float(max_len or mask.shape[-1])),
  )


class Aggregation(NamedTuple):
  r"""One aggregation of :data:`AGGREGATIONS` (a row of the module docstring's table):
  :math:`\sum_b s_b / D` with :math:`s_b = \sum_t \ell_{bt}`, or :math:`s_b / |o_b|` per sequence.

  Attributes:
    per_sequence: each row's token sum is first divided by its valid tokens :math:`|o_b|`
      (at least 1).
    denominator: :math:`D` from the full batch's :class:`LossNormaliser`.
  """

  per_sequence: bool
  denominator: Callable[[LossNormaliser], Float[Array, ""]]


AGGREGATION_RULES: dict[str, Aggregation] = {
    "token-mean": Aggregation(False, lambda n: n.tokens),
    "seq-mean-token-mean": Aggregation(True, lambda n: n.sequences),
    "seq-mean-token-sum": Aggregation(False, lambda n: n.sequences),
    "seq-mean-token-sum-norm": Aggregation(False, lambda n: n.sequences * n.max_len),
}
AGGREGATIONS = tuple(AGGREGATION_RULES)


def aggregation(mode: str) -> Aggregation:
  """The rule of ``mode``; ``ValueError`` naming the aggregations there are."""
  if mode not in AGGREGATION_RULES:
    raise ValueError(f"unknown loss aggregation {mode!r}; choose from {AGGREGATIONS}")
  return AGGREGATION_RULES[mode]


def aggregate_loss(
    per_token: Float[Array, "B T"], mask: Array, mode: str, normaliser: LossNormaliser
) -> Float[Array, ""]:
  """Aggregate a (micro-)batch's per-token loss with the full batch's ``normaliser``.

  Summing this over the micro-batches of a batch gives the full batch's value.
  """
  rule = aggregation(mode)
  mask = mask.astype(per_token.dtype)
  token_sum = jnp.sum(per_token * mask, axis=-1)
  if rule.per_sequence:
    token_sum = token_sum / jnp.maximum(jnp.sum(mask, axis=-1), 1.0)
  return jnp.sum(token_sum) / rule.denominator(normaliser)


def aggregation_weights(mask: Array, mode: str, normaliser: LossNormaliser) -> Float[Array, "B T"]:
  """``[B, T]`` per-token weights ``w`` with ``aggregate_loss(x, mask, mode, normaliser) ==
  sum(x * w)`` (to float32 rounding): an aggregation that no longer needs the rows, for a loss
  whose tokens were moved to another layout (packed rows, ``rft_jax.rl.token_batches``)."""
  rule = aggregation(mode)
  mask = mask.astype(jnp.float32)
  if rule.per_sequence:
    mask = mask / jnp.maximum(jnp.sum(mask, axis=-1, keepdims=True), 1.0)
  return mask / rule.denominator(normaliser)


def _k1(log_ratio):
  return -log_ratio


def _k2(log_ratio):
  return 0.5 * jnp.square(log_ratio)


def _k3(log_ratio):
  return jnp.expm1(log_ratio) - log_ratio


KL_ESTIMATORS: dict[str, Callable[[Array], Array]] = {"k1": _k1, "k2": _k2, "k3": _k3}


def kl_penalty(logp: Float[Array, "B T"], ref_logp: Float[Array, "B T"], estimator: str = "k3") -> Float[Array, "B T"]:
  r"""Per-token estimate of :math:`\mathrm{KL}(\pi_\theta \| \pi_{ref})` from samples of :math:`\pi_\theta`.

  With :math:`\log \rho = \log \pi_{ref} - \log \pi_\theta`: ``k1`` :math:`= -\log\rho`
  (unbiased, high variance), ``k2`` :math:`= \frac12 (\log\rho)^2`, ``k3``
  :math:`= \rho - 1 - \log\rho` (unbiased, non-negative; Schulman 2020).
  """
  if estimator not in KL_ESTIMATORS:
    raise ValueError(f"unknown KL estimator {estimator!r}; choose from {sorted(KL_ESTIMATORS)}")
  return KL_ESTIMATORS[estimator](ref_logp - logp)
