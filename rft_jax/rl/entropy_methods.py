r"""The entropy methods the paper compares Clip_B / Clip_V with (its Table 3), in the learner.

``learner.entropy_method.kind`` picks one; each is a pure function of ``rft_jax.rl``:

* ``clip_cov`` (Cui et al. 2025, :func:`rft_jax.rl.cov_methods.clip_cov_keep`): the gradient of a
  random ``clip_cov_ratio`` share of the tokens with covariance in ``(lb, ub)`` is removed;
* ``kl_cov`` (Cui et al. 2025, :func:`rft_jax.rl.cov_methods.kl_cov_penalty_mask`): the top
  ``kl_cov_ratio`` share by covariance gets ``kl_cov_coef * |log p - log p_old|``;
* ``forking`` (Wang et al. 2025, :func:`rft_jax.rl.forking_tokens.forking_token_mask`): only the
  top ``forking_rho`` share of tokens by entropy keeps its gradient.

As the peers do (verl 0.9.1 for the first two, TRL 1.16.0 for the third), a token a method drops
leaves the loss *numerator* only: its per-token loss is multiplied by 0 and the token-mean
denominator is unchanged. (The entropy masks Clip_B / Clip_V remove tokens from both.)

The token sets are chosen once per train step, over the whole batch's valid loss tokens, from
the pre-update pass (as Clip_B's statistics are): the covariance uses the pre-update log-probs,
and Clip-Cov's "not already clipped by PPO" holds for every token there (the ratio is 1). verl
chooses per micro-batch and, over several mini-batches, with the ratio of each update; with one
update per batch on one micro-batch the two agree. Clip-Cov's random choice is drawn from a key
folded with the train step, so a resumed run draws the same tokens.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from rft_jax.entropy import TokenStats
from rft_jax.rl.config import LearnerConfig
from rft_jax.rl.cov_methods import clip_cov_keep, clip_cov_loss, kl_cov_loss, kl_cov_penalty_mask
from rft_jax.rl.forking_tokens import forking_token_mask

CLIP_COV_KEY = 0x0C0F  # the base key of Clip-Cov's choice, folded with the step


class MethodTokens(NamedTuple):
  """The method's choice over a batch, ``[B, T]`` each.

  Attributes:
    weight: float32 multiplier of each token's policy loss (0 where the gradient is removed).
    penalised: tokens that get KL-Cov's penalty (all False for the other methods).
  """

  weight: jax.Array
  penalised: jax.Array


def method_tokens(config: LearnerConfig, stats: TokenStats, advantages, loss_mask, step) -> MethodTokens:
  """The configured method's tokens over the whole batch.

  Args:
    config: the learner's config.
    stats: ``[B, T]`` pre-update :class:`TokenStats` (stop-gradient).
    advantages: ``[B, T]`` per-token advantages.
    loss_mask: ``[B, T]`` the tokens in the loss (after any entropy mask).
    step: the train step (a scalar array): Clip-Cov's random choice is drawn from it.
  """
  m = config.entropy_method
  ones = jnp.ones(loss_mask.shape, jnp.float32)
  none = jnp.zeros(loss_mask.shape, bool)
  if m.kind == "clip_cov":
    key = jax.random.fold_in(jax.random.key(CLIP_COV_KEY), step)
    keep = clip_cov_keep(stats.logp, stats.logp, advantages, loss_mask, key, eps_low=config.eps_low,
                         eps_high=config.eps_high, ratio=m.clip_cov_ratio, lb=m.clip_cov_lb,
                         ub=m.clip_cov_ub)
    return MethodTokens(keep.astype(jnp.float32), none)
  if m.kind == "kl_cov":
    return MethodTokens(ones, kl_cov_penalty_mask(stats.logp, advantages, loss_mask, ratio=m.kl_cov_ratio))
  if m.kind == "forking":
    return MethodTokens(forking_token_mask(stats.entropy, loss_mask, rho=m.forking_rho).astype(jnp.float32),
                        none)
  return MethodTokens(ones, none)


def method_policy_loss(config: LearnerConfig, ppo_loss, logp, old_logp, advantages, loss_mask,
                       tokens: MethodTokens) -> jax.Array:
  """``[b, T]`` per-token policy loss under the configured method: verl's Clip-Cov and KL-Cov
  losses (:func:`rft_jax.rl.cov_methods.clip_cov_loss`, :func:`kl_cov_loss`), or ``ppo_loss``
  (the clipped surrogate) times the method's weight."""
  m, c = config.entropy_method, config
  if m.kind == "clip_cov":
    return clip_cov_loss(logp, old_logp, advantages, loss_mask, tokens.weight > 0, eps_low=c.eps_low,
                         eps_high=c.eps_high)
  if m.kind == "kl_cov":
    return kl_cov_loss(logp, old_logp, advantages, loss_mask, tokens.penalised, kl_coef=m.kl_cov_coef)
  return ppo_loss * tokens.weight
