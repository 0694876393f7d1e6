r"""The covariance both Clip-Cov and KL-Cov rank tokens by, and verl's token counts
(Cui et al. 2025, arXiv:2505.22617; verl 0.9.1 ``verl/trainer/ppo/core_algos.py``): what
:mod:`rft_jax.rl.token_methods.cov_methods` shares between its two methods.

**Scope of the statistics.** verl calls these losses from ``ppo_loss``
(``verl/workers/utils/losses.py``) on one micro-batch of one data-parallel rank, so its
means, :math:`N`, the candidate set and the top-k are per micro-batch, while the token-mean
denominator (``batch_num_tokens``) is the global batch's. Here they are over the arrays
given: pass the whole training batch (under ``jit`` a sharded global array) for
batch-level statistics, or a micro-batch to reproduce verl's scope. Statistics are float32
and stop-gradient.

**Counts under jit.** :math:`\max(\lfloor r N\rfloor, 1)` uses Python's float64
``int(r * N)`` exactly as verl does, although :math:`N` is traced: the thresholds of
:math:`N` at which the count steps up are tabulated on the host for every possible
:math:`N \le B T` (the static shape).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float

from rft_jax.entropy import masked_mean


def _int_ratio_times(ratio: float, n: Array, n_max: int) -> Array:
  """``int(ratio * n)`` in Python float64, as verl computes it, for a traced ``0 <= n <= n_max``.

  ``floor(ratio * n)`` is non-decreasing in ``n``: tabulate on the host the smallest ``n``
  at which it reaches each value ``1..floor(ratio * n_max)`` and count the thresholds
  ``n`` has passed (float32 on the device could be off by one near integers).
  """
  values = np.floor(ratio * np.arange(n_max + 1, dtype=np.float64)).astype(np.int64)
  thresholds = np.searchsorted(values, np.arange(1, int(values[-1]) + 1), side="left")
  return jnp.sum(n >= jnp.asarray(thresholds, jnp.int32)).astype(jnp.int32)


def _verl_count(ratio: float, n_valid: Array, n_max: int) -> Array:
  """verl's ``max(int(ratio * n_valid), 1)``."""
  return jnp.maximum(_int_ratio_times(ratio, n_valid, n_max), 1)


def _ratio(logp, old_logp, log_ratio_clamp):
  log_ratio = logp.astype(jnp.float32) - old_logp.astype(jnp.float32)
  return log_ratio, jnp.exp(jnp.clip(log_ratio, -log_ratio_clamp, log_ratio_clamp))


def token_covariance(
    logp: Float[Array, "B T"], advantages: Float[Array, "B T"], mask: Array
) -> Float[Array, "B T"]:
  r"""Per-token centred covariance of advantage and log-prob (Cui et al. 2025).

  .. math::  \mathrm{Cov}_t = \big(A_t - \bar A\big)\big(\log\pi_\theta(y_t) - \overline{\log\pi_\theta}\big),
             \quad \bar x = \frac{1}{N}\sum_{t:\,m_t > 0} x_t,

  over the valid tokens (``mask > 0``) of the arrays given. float32, stop-gradient; 0 on
  padded tokens, whose values never enter the means. verl 0.9.1 computes the same
  (``cov_all`` in ``compute_policy_loss_clip_cov``, ``cov_lst_all`` in
  ``compute_policy_loss_kl_cov``); checked against verl 0.9.1 core_algos.py on identical
  tensors.

  Args:
    logp: ``[B, T]`` log-probs of the sampled tokens under the current policy.
    advantages: ``[B, T]`` per-token advantages.
    mask: ``[B, T]`` valid response tokens (``> 0``).

  Returns:
    ``[B, T]`` float32 covariance, 0 off the mask.
  """
  valid = mask > 0
  lp = jax.lax.stop_gradient(logp).astype(jnp.float32)
  adv = jax.lax.stop_gradient(advantages).astype(jnp.float32)
  cov = (adv - masked_mean(adv, valid)) * (lp - masked_mean(lp, valid))
  return jnp.where(valid, cov, 0.0)
