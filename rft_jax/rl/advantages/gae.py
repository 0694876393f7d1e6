r"""PPO's critic side: generalised advantage estimation, whitening and the clipped value loss.

All functions take ``[B, T]`` arrays over response positions (``T``) with a 0/1 ``mask``
that is 1 on the valid response tokens; statistics are computed in float32.

**GAE** (Schulman, Moritz, Levine, Jordan, Abbeel 2016, "High-Dimensional Continuous Control
Using Generalized Advantage Estimation", eqs. 11-16): with token rewards :math:`r_t` and
value estimates :math:`V_t`,

.. math::

  \delta_t = r_t + \gamma V_{t+1} - V_t, \qquad
  \hat A_t = \delta_t + \gamma\lambda \hat A_{t+1}, \qquad
  \hat R_t = \hat A_t + V_t,

run backwards from :math:`V_{T} = \hat A_{T} = 0` (the episode ends with the response).
Masked positions are *skipped* rather than treated as terminal, exactly as verl does:
:math:`V_{t+1}` and :math:`\hat A_{t+1}` are those of the next *valid* position, so a
zero in the middle of a row (e.g. tool/observation tokens) is stepped over.

**Value loss** (PPO value clipping, as in verl / TRL):

.. math::

  \ell_t = \tfrac12 \max\Big((V^{new}_t - \hat R_t)^2,\
           \big(\mathrm{clip}(V^{new}_t, V^{old}_t - c, V^{old}_t + c) - \hat R_t\big)^2\Big).

Peer: verl 0.9.1 (Apache-2.0), ``verl/trainer/ppo/core_algos.py``
(``compute_gae_advantage_return`` l.216-263, ``compute_value_loss`` l.2125-2185) and
``verl/utils/torch_functional.py`` (``masked_sum`` l.273, ``masked_mean`` l.294,
``masked_var`` l.311, ``masked_whiten`` l.329, ``clip_by_value`` l.210). Every function
here was checked against verl 0.9.1 on identical tensors (``tests/test_gae.py``).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float

from rft_jax.entropy import masked_mean


def masked_whiten(
    x: Float[Array, "B T"], mask: Array, *, shift_mean: bool = True, eps: float = 1e-8
) -> Float[Array, "B T"]:
  r"""Whiten ``x`` with the mean and *unbiased* variance of its valid (``mask``) entries.

  .. math::

    \mu = \frac{\sum_{m} x}{N + 10^{-8}}, \quad
    \sigma^2 = \frac{N}{N-1} \cdot \frac{\sum_{m} (x - \mu)^2}{N + 10^{-8}}, \quad
    \tilde x = (x - \mu) / \sqrt{\sigma^2 + \epsilon} \; (+\mu \text{ if not shift\_mean}),

  with :math:`N = \sum m` over the whole batch (verl ``masked_whiten``/``masked_var`` with
  ``unbiased=True``; ``eps`` is verl's hard-coded ``1e-8`` inside the ``rsqrt``). Every
  position is transformed, padded ones included (as verl); only valid entries enter
  the statistics, and non-finite values at padded positions do not leak into them.

  verl raises ``ValueError`` when :math:`N \le 1`; under ``jit`` that cannot be done, so the
  Bessel factor is dropped instead (:math:`N = 1` then whitens the single valid entry to 0).
  """
  x = x.astype(jnp.float32)
  m = mask.astype(jnp.float32)
  mean = masked_mean(x, m)
  n = jnp.sum(m)
  var = masked_mean(jnp.square(x - mean), m)
  var = var * jnp.where(n > 1, n / jnp.where(n > 1, n - 1, 1.0), 1.0)
  whitened = (x - mean) * jax.lax.rsqrt(var + eps)
  if not shift_mean:
    whitened = whitened + mean
  return whitened


def gae_advantages(
    token_rewards: Float[Array, "B T"],
    values: Float[Array, "B T"],
    mask: Array,
    *,
    gamma: float = 1.0,
    lam: float = 1.0,
    whiten: bool = True,
) -> tuple[Float[Array, "B T"], Float[Array, "B T"]]:
  r"""GAE advantages and returns (see module docstring); returns ``(advantages, returns)``.

  The backward recursion is a reverse ``jax.lax.scan`` over ``T`` carrying
  ``(next_value, last_gae)`` per row, with verl's masking semantics
  (``core_algos.py`` l.250-258)::

    delta      = r_t + gamma * next_value - V_t
    gae_t      = delta + gamma * lam * last_gae
    next_value = V_t   if mask_t else next_value      # skip masked positions
    last_gae   = gae_t if mask_t else last_gae
    A_t        = last_gae

  so a masked position repeats the advantage of the next valid position (0 on right
  padding) and neither its reward nor its value reaches a valid position.
  ``returns = A + values`` is taken *before* whitening (padded positions included).
  verl whitens inside ``compute_gae_advantage_return`` (l.262,
  ``masked_whiten(advantages, response_mask)``, i.e. shift_mean=True, batch-wide, unbiased
  variance); ``whiten=True`` (default) does the same, ``False`` returns the raw advantages.
  verl's defaults are ``gamma = lam = 1.0`` (``trainer/config/ppo_trainer.yaml`` l.72, 75).

  ``mask`` must be 0/1 (verl multiplies by it; here ``where`` selects, which is identical
  for 0/1 masks and finite values, and NaN-safe on padding). Checked against verl 0.9.1
  on identical tensors.
  """
  r = token_rewards.astype(jnp.float32)
  v = values.astype(jnp.float32)
  valid = mask.astype(jnp.float32) > 0

  def step(carry, xs):
    next_value, last_gae = carry
    r_t, v_t, m_t = xs
    delta = r_t + gamma * next_value - v_t
    gae_t = delta + gamma * lam * last_gae
    next_value = jnp.where(m_t, v_t, next_value)
    last_gae = jnp.where(m_t, gae_t, last_gae)
    return (next_value, last_gae), last_gae

  zeros = jnp.zeros(r.shape[:1], jnp.float32)
  _, adv_t = jax.lax.scan(step, (zeros, zeros), (r.T, v.T, valid.T), reverse=True)
  advantages = adv_t.T
  returns = advantages + v
  if whiten:
    advantages = masked_whiten(advantages, mask)
  return advantages, returns


class ValueLossTerms(NamedTuple):
  """Per-token pieces of the clipped value loss, both ``[B, T]``."""

  loss: Float[Array, "B T"]  # 0.5 * max(unclipped, clipped) squared error
  clipped: Bool[Array, "B T"]  # the clipped error is strictly larger (verl's vf_clipfrac numerator)


def clipped_value_loss(
    values_new: Float[Array, "B T"],
    values_old: Float[Array, "B T"],
    returns: Float[Array, "B T"],
    mask: Array,
    *,
    clip_range: float,
) -> ValueLossTerms:
  r"""Per-token clipped value loss :math:`\ell_t` (module docstring), not aggregated.

  As verl ``compute_value_loss`` (``core_algos.py`` l.2171-2184): the clip is
  ``max(min(v, v_old + c), v_old - c)`` (``clip_by_value``), the loss is the elementwise
  **max** of the two squared errors times **0.5** (verl applies the 0.5 after
  ``agg_loss``; aggregation is linear, so it is the same). verl aggregates with
  ``critic.loss_agg_mode``, which defaults to the actor's ``loss_agg_mode`` =
  ``token-mean`` (``trainer/config/critic/critic.yaml`` l.64, ``actor/actor.yaml`` l.86):
  use :func:`rft_jax.rl.losses.aggregate_loss` with ``"token-mean"``. Default
  ``clip_range`` in verl: ``critic.cliprange_value = 0.5`` (``critic.yaml`` l.61).

  ``clipped`` marks valid tokens with ``(clip(v) - R)^2 > (v - R)^2``, so ``sum(clipped)``
  is the clip count and verl's ``vf_clipfrac`` is ``sum(clipped) / (sum(mask) + 1e-8)``.
  Both fields are zero / False on padded positions (``where``, so non-finite padding
  cannot leak into an aggregate).
  """
  valid = mask.astype(jnp.float32) > 0
  v = values_new.astype(jnp.float32)
  v_old = values_old.astype(jnp.float32)
  ret = returns.astype(jnp.float32)
  v_clipped = jnp.maximum(jnp.minimum(v, v_old + clip_range), v_old - clip_range)
  loss_unclipped = jnp.square(v - ret)
  loss_clipped = jnp.square(v_clipped - ret)
  return ValueLossTerms(
      loss=jnp.where(valid, 0.5 * jnp.maximum(loss_unclipped, loss_clipped), 0.0),
      clipped=valid & (loss_clipped > loss_unclipped),
  )


def outcome_token_rewards(rewards: Float[Array, "B"], mask: Array) -> Float[Array, "B T"]:
  """Each row's scalar reward at its last valid token, 0 elsewhere.

  verl's reward managers write ``reward_tensor[i, valid_response_length - 1] = reward``
  with ``valid_response_length = attention_mask[prompt_length:].sum()``
  (``workers/reward_manager/naive.py`` l.114, l.153). For right-padded rows (a contiguous
  block of ones from position 0) that index is the last valid token, which is what is
  placed here for any mask; a row with no valid token gets no reward (verl would write
  index ``-1``, i.e. the last padded position).
  """
  valid = mask.astype(jnp.float32) > 0
  T = valid.shape[-1]
  last = T - 1 - jnp.argmax(valid[:, ::-1], axis=-1)
  has_any = jnp.any(valid, axis=-1)
  onehot = (jnp.arange(T)[None, :] == last[:, None]) & has_any[:, None]
  return jnp.where(onehot, rewards.astype(jnp.float32)[:, None], 0.0)
