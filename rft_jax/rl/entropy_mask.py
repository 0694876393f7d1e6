r"""The learner's entropy-discriminator mask: which scores feed it, and which mask is configured.

The masks themselves are pure functions of ``rft_jax.entropy.clipping`` (Clip_B, Algorithm 1,
Eq. 15; Clip_V, Algorithm 2, Eq. 16; the Figure 1 sign masks). Here the learner's config picks
the mask and the log-probs of the sampled token that form :math:`S_* = p_k (H + \log p_k)`:
the learner's recomputed ones (default) or the sampler's (the authors' Clip_B).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from rft_jax.entropy import (
    TokenStats,
    clip_b_mask,
    clip_v_mask,
    discriminator_sign_mask,
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
  s_star, centered = mask_scores(config, stats, sampler_logp, mask)
  if m.kind == "clip_b":
    return clip_b_mask(s_star, advantages, mask, mu_low=m.resolved_mu_low, mu_high=m.mu_high,
                       samples=m.samples)
  if m.kind == "clip_v":
    return clip_v_mask(centered, advantages, mask, mu_low=m.resolved_mu_low, mu_high=m.mu_high,
                       samples=m.samples, max_frac=m.resolved_max_frac)
  return discriminator_sign_mask(s_star, advantages, sign=m.sign, action=m.action, samples=m.samples)
