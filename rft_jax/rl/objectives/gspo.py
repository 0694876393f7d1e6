r"""GSPO: the clipped surrogate with a sequence-level importance ratio (Zheng et al. 2025, "Group
Sequence Policy Optimization", arXiv 2507.18071).

Where PPO / GRPO clip each token's ratio :math:`r_t = \pi_\theta(y_t) / \pi_{old}(y_t)`, GSPO
clips one ratio per sequence :math:`y` of length :math:`|y|`, the geometric mean of its tokens'
ratios,

.. math::  s(\theta) = \Big(\frac{\pi_\theta(y \mid x)}{\pi_{old}(y \mid x)}\Big)^{1/|y|}
           = \exp\Big(\frac{1}{|y|} \sum_t \log r_t\Big),

.. math::  J_t = \min\big(s_t A_t,\ \mathrm{clip}(s_t, 1 - \epsilon_{low}, 1 + \epsilon_{high}) A_t\big),
           \qquad \log s_t = \mathrm{sg}[\log s] + \log \pi_\theta(y_t) - \mathrm{sg}[\log \pi_\theta(y_t)],

(GSPO-token: the value of every token is :math:`s`, the gradient of token :math:`t` is
:math:`s A_t \nabla \log \pi_\theta(y_t)`), and the loss :math:`-J_t` is aggregated as any other
(``rft_jax.rl.losses``; the paper uses ``seq-mean-token-mean``). Its clip range is about a
thousand times narrower than PPO's: :data:`GSPO_EPS_LOW`, :data:`GSPO_EPS_HIGH`, the paper's
and verl's recipe values.

This is verl 0.9.1's ``compute_policy_loss_gspo`` (``verl/trainer/ppo/core_algos.py``,
``policy_loss.loss_mode=gspo``: the mean over the tokens in the loss, the log-ratio clamped at
10) token for token. TRL 1.16's ``importance_sampling_level="sequence"`` differentiates
:math:`\exp(\mathrm{mean}_t \log r_t)` itself: the same values, and the same gradients whenever
the aggregation weighs the tokens of one sequence alike (every aggregation here does).
``tests/test_gspo.py`` checks both on identical tensors.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from rft_jax.rl.losses import PolicyLossTerms

GSPO_EPS_LOW = 3e-4
GSPO_EPS_HIGH = 4e-4
GSPO_LOG_RATIO_MAX = 10.0  # verl's clamp of log s


def sequence_mean(x: Float[Array, "B T"], mask: Array,
                  sequence_ids: Int[Array, "B T"] | None = None) -> Float[Array, "B T"]:
  """At each token, the mean of ``x`` over the tokens of its sequence where ``mask`` is set (0 for
  a sequence with none): the rows of ``[B, T]`` arrays, or with ``sequence_ids`` (packed rows,
  ``rft_jax.rl.token_batches``) the tokens sharing an id."""
  mask = mask.astype(x.dtype)
  if sequence_ids is None:
    total = jnp.sum(x * mask, axis=-1, keepdims=True)
    count = jnp.sum(mask, axis=-1, keepdims=True)
    return jnp.broadcast_to(total / jnp.maximum(count, 1.0), x.shape)
  ids = sequence_ids.reshape(-1)
  segments = ids.size + 1  # ids are below the number of slots (static)
  total = jax.ops.segment_sum((x * mask).reshape(-1), ids, num_segments=segments)
  count = jax.ops.segment_sum(mask.reshape(-1), ids, num_segments=segments)
  return (total / jnp.maximum(count, 1.0))[ids].reshape(x.shape)


def gspo_loss(logp: Float[Array, "B T"], old_logp: Float[Array, "B T"],
              advantages: Float[Array, "B T"], mask: Array, *, eps_low: float = GSPO_EPS_LOW,
              eps_high: float = GSPO_EPS_HIGH,
              sequence_ids: Int[Array, "B T"] | None = None) -> PolicyLossTerms:
  """Per-token GSPO loss (module docstring) with its sequence ratio in ``ratio`` and the tokens
  where the clip is active; ``mask``: the tokens in the loss, over which the ratio is taken."""
  log_seq = jax.lax.stop_gradient(sequence_mean(logp - old_logp, mask, sequence_ids))
  log_ratio = jnp.minimum(logp - jax.lax.stop_gradient(logp) + log_seq, GSPO_LOG_RATIO_MAX)
  ratio = jnp.exp(log_ratio)
  loss = jnp.maximum(-advantages * ratio, -advantages * jnp.clip(ratio, 1 - eps_low, 1 + eps_high))
  return PolicyLossTerms(
      loss=loss,
      ratio=ratio,
      clipped_low=(advantages < 0) & (ratio < 1 - eps_low),
      clipped_high=(advantages > 0) & (ratio > 1 + eps_high),
      clipped_dual=jnp.zeros(ratio.shape, bool),
  )
