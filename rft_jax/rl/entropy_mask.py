r"""The learner's entropy-discriminator mask: which scores feed it, and which mask is configured.

The masks themselves are pure functions of ``rft_jax.entropy.clipping`` (Clip_B, Algorithm 1,
Eq. 15; Clip_V, Algorithm 2, Eq. 16; the Figure 1 sign masks). Here the learner's config picks
the mask and the log-probs of the sampled token that form :math:`S_* = p_k (H + \log p_k)`:
the learner's recomputed ones (default) or the sampler's (the authors' Clip_B).

With ``entropy_mask.target_entropy`` the cut :math:`\mu^-` is chosen per batch
(:func:`entropy_target_cut`): a closed loop that holds the policy's entropy near a set value.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from rft_jax.entropy import (
    TokenStats,
    batch_entropy_change,
    clip_b_mask,
    clip_v_mask,
    discriminator_sign_mask,
    masked_mean,
    token_discriminator_from_logp,
)
from rft_jax.rl.config import LearnerConfig


def mask_scores(config: LearnerConfig, stats: TokenStats, sampler_logp, mask) -> tuple[jax.Array, jax.Array]:
  r""":math:`S_*` and :math:`S^c = S_* - \mathbb{E}_p[S]` that feed the entropy mask.

  ``entropy_mask.logp_source=learner``: the learner's statistics. ``sampler``:
  :math:`S_* = e^{\ell}(H + \ell)` with :math:`\ell` the sampler's log-prob of the token and
  :math:`H` the learner's entropy (the authors' Clip_B; ``rft_jax.entropy.clipping``), with
  padding zeroed so that garbage there cannot reach a statistic.

  Args:
    config: the learner's config.
    stats: ``[B, T]`` the learner's :class:`TokenStats` of the batch.
    sampler_logp: ``[B, T]`` the sampler's log-probs, aligned with ``stats``.
    mask: ``[B, T]`` valid response tokens.

  Returns:
    ``(s_star, centered)``, ``[B, T]`` each.
  """
  if config.entropy_mask.logp_source == "learner":
    return stats.s_star, stats.centered
  s_star = token_discriminator_from_logp(jnp.where(mask > 0, sampler_logp, 0.0), stats.entropy)
  return s_star, s_star - stats.expected_s


def entropy_keep_mask(config: LearnerConfig, stats: TokenStats, sampler_logp, advantages, mask) -> jax.Array:
  """The configured entropy-discriminator keep-mask over the whole batch, ``[B, T]``."""
  m = config.entropy_mask
  if m.kind == "none":
    return jnp.ones(mask.shape, bool)
  if m.target_entropy is not None:
    return entropy_target_cut(config, stats, sampler_logp, advantages, mask)[0]
  s_star, centered = mask_scores(config, stats, sampler_logp, mask)
  if m.kind == "clip_b":
    return clip_b_mask(s_star, advantages, mask, mu_low=m.resolved_mu_low, mu_high=m.mu_high,
                       samples=m.samples)
  if m.kind == "clip_v":
    return clip_v_mask(centered, advantages, mask, mu_low=m.resolved_mu_low, mu_high=m.mu_high,
                       samples=m.samples, max_frac=m.resolved_max_frac)
  return discriminator_sign_mask(s_star, advantages, sign=m.sign, action=m.action, samples=m.samples)


# The cuts mu^- the entropy target chooses from, largest first; inf: no cut.
TARGET_MU_GRID = (float("inf"), 12.0, 8.5, 6.0, 4.0, 3.0, 2.5, 2.0, 1.5, 1.0, 0.5)


def entropy_target_cut(config: LearnerConfig, stats: TokenStats, sampler_logp, advantages, mask):
  r"""The Clip_B / Clip_V keep-mask whose cut holds the entropy near ``target_entropy`` :math:`H^*`.

  For every cut :math:`\mu` of :data:`TARGET_MU_GRID`, Corollary 4 forecasts the batch's entropy
  change :math:`f(\mu) = -\mathrm{Cov}_B(A, S_* - \mathbb{E}_p[S])` over the tokens the cut keeps
  (per unit learning rate: only the forecasts' order matters). With the batch's mean entropy
  :math:`H`, the share :math:`s = \mathrm{clip}((H^* - H) / (b H^*), 0, 1)` of the raising range
  is asked for (:math:`b` = ``target_band``): the forecast :math:`f(\infty) + s\,(\max_\mu f -
  f(\infty))`, and the largest cut (fewest tokens masked) that reaches it is taken. At or above
  the target nothing is masked (plain GRPO, which lowers entropy); a band or more below it the
  most entropy-raising cut of the grid is. The forecast's scale is not the measured change's (the
  optimizer moves shared weights, not logits), so the loop is steered by order, not magnitude.

  Args:
    config: the learner's config (``entropy_mask.kind`` is ``clip_b`` or ``clip_v``).
    stats: ``[B, T]`` pre-update :class:`TokenStats`.
    sampler_logp, advantages, mask: ``[B, T]`` as :func:`entropy_keep_mask`.

  Returns:
    ``(keep, mu, share)``: ``[B, T]`` bool keep-mask, the cut taken (0 for none) and :math:`s`.
  """
  m = config.entropy_mask
  s_star, centered = mask_scores(config, stats, sampler_logp, mask)
  valid = mask > 0
  keeps = []
  for mu in TARGET_MU_GRID:
    if mu == float("inf"):
      keeps.append(jnp.ones(mask.shape, bool))
    elif m.kind == "clip_b":
      keeps.append(clip_b_mask(s_star, advantages, mask, mu_low=mu, mu_high=m.mu_high, samples=m.samples))
    else:
      keeps.append(clip_v_mask(centered, advantages, mask, mu_low=mu, mu_high=m.mu_high, samples=m.samples,
                               max_frac=m.resolved_max_frac))
  keeps = jnp.stack(keeps)
  forecasts = jax.vmap(lambda keep: batch_entropy_change(advantages, stats.centered, valid & keep, 1.0))(keeps)
  entropy = masked_mean(stats.entropy, valid)
  share = jnp.clip((m.target_entropy - entropy) / (m.target_band * m.target_entropy), 0.0, 1.0)
  wanted = forecasts[0] + share * (jnp.max(forecasts) - forecasts[0])
  reaches = forecasts >= wanted - 1e-6 * jnp.abs(wanted)
  index = jnp.argmax(reaches)  # the first, i.e. the largest cut, that reaches it
  mu = jnp.asarray([0.0 if x == float("inf") else x for x in TARGET_MU_GRID], jnp.float32)[index]
  return keeps[index], mu, share
