r"""Clip-Cov and KL-Cov (Cui et al. 2025, "The Entropy Mechanism of Reinforcement Learning for
Reasoning Language Models") as token methods: the paper's Table 3 comparisons.

The maths is ``rft_jax.rl.cov_methods`` (checked against verl 0.9.1 on identical tensors). The
token sets are chosen once per train step, over the whole batch's valid loss tokens, from the
pre-update pass (as Clip_B's statistics are): the covariance uses the pre-update log-probs, and
Clip-Cov's "not already clipped by PPO" holds for every token there (the ratio is 1). verl
chooses per micro-batch and, over several mini-batches, with the ratio of each update; with one
update per batch on one micro-batch the two agree. Clip-Cov's random choice is drawn from a key
folded with the train step, so a resumed run draws the same tokens. Both replace the clipped
surrogate by verl's loss, which has no dual clip.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from rft_jax.rl.cov_methods import clip_cov_keep, clip_cov_loss, kl_cov_loss, kl_cov_penalty_mask
from rft_jax.rl.token_methods.registry import TokenChoice, TokenInputs, TokenMethod, register_token_method

CLIP_COV_KEY = 0x0C0F  # the base key of Clip-Cov's choice, folded with the step


@register_token_method("clip_cov")
class ClipCov(TokenMethod):
  """Clip-Cov: the gradient of a random ``clip_cov_ratio`` share of the tokens with covariance in
  ``(clip_cov_lb, clip_cov_ub)`` is removed (:func:`rft_jax.rl.cov_methods.clip_cov_keep`)."""

  replaces_loss = True

  def choose(self, inputs: TokenInputs) -> TokenChoice:
    c, m = self.config, self.config.entropy_method
    key = jax.random.fold_in(jax.random.key(CLIP_COV_KEY), inputs.step)
    logp = inputs.stats.logp
    keep = clip_cov_keep(logp, logp, inputs.advantages, inputs.loss_mask, key, eps_low=c.resolved_eps_low,
                         eps_high=c.resolved_eps_high, ratio=m.clip_cov_ratio, lb=m.clip_cov_lb, ub=m.clip_cov_ub)
    return TokenChoice.everything(keep.shape)._replace(weight=keep.astype(jnp.float32))

  def policy_loss(self, ppo_loss, logp, old_logp, advantages, loss_mask, weight, penalised) -> jax.Array:
    c = self.config
    return clip_cov_loss(logp, old_logp, advantages, loss_mask, weight > 0, eps_low=c.resolved_eps_low,
                         eps_high=c.resolved_eps_high)


@register_token_method("kl_cov")
class KLCov(TokenMethod):
  """KL-Cov: the top ``kl_cov_ratio`` share of tokens by covariance gets ``kl_cov_coef * |log p -
  log p_old|`` (:func:`rft_jax.rl.cov_methods.kl_cov_penalty_mask`)."""

  replaces_loss = True

  def choose(self, inputs: TokenInputs) -> TokenChoice:
    m = self.config.entropy_method
    penalised = kl_cov_penalty_mask(inputs.stats.logp, inputs.advantages, inputs.loss_mask, ratio=m.kl_cov_ratio)
    return TokenChoice.everything(penalised.shape)._replace(penalised=penalised)

  def policy_loss(self, ppo_loss, logp, old_logp, advantages, loss_mask, weight, penalised) -> jax.Array:
    return kl_cov_loss(logp, old_logp, advantages, loss_mask, penalised, kl_coef=self.config.entropy_method.kl_cov_coef)

  def touched(self, choice: TokenChoice) -> jax.Array:
    return choice.penalised
