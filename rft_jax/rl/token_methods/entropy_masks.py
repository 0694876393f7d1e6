r"""The paper's entropy masks as token methods: Clip_B, Clip_V and the Figure 1 sign masks.

The masks themselves are pure functions of ``rft_jax.entropy.clipping`` (Clip_B, Algorithm 1,
Eq. 15; Clip_V, Algorithm 2, Eq. 16; the Figure 1 sign masks). Here the learner's config picks
the log-probs of the sampled token that form :math:`S_* = p_k (H + \log p_k)`: the learner's
recomputed ones (default) or the sampler's (the authors' Clip_B), and the cuts. A token a mask
drops leaves the loss's numerator and its token-mean denominator.
"""

from __future__ import annotations

from typing import ClassVar

import jax
import jax.numpy as jnp

from rft_jax.entropy import clip_b_mask, clip_v_mask, discriminator_sign_mask, token_discriminator_from_logp
from rft_jax.entropy.clipping import CLIP_B_MU_LOW, CLIP_V_MU_LOW
from rft_jax.rl.token_methods.registry import TokenChoice, TokenInputs, TokenMethod, register_token_method


def mask_scores(logp_source: str, inputs: TokenInputs) -> tuple[jax.Array, jax.Array]:
  r""":math:`S_*` and :math:`S^c = S_* - \mathbb{E}_p[S]` that feed an entropy mask, ``[B, T]`` each.

  ``logp_source="learner"``: the learner's statistics. ``"sampler"``: :math:`S_* = e^{\ell}(H +
  \ell)` with :math:`\ell` the sampler's log-prob of the token and :math:`H` the learner's entropy
  (the authors' Clip_B; ``rft_jax.entropy.clipping``), with padding zeroed so that garbage there
  cannot reach a statistic.
  """
  stats = inputs.stats
  if logp_source == "learner":
    return stats.s_star, stats.centered
  logp = jnp.where(inputs.response > 0, inputs.sampler_logp, 0.0)
  s_star = token_discriminator_from_logp(logp, stats.entropy)
  return s_star, s_star - stats.expected_s


class OutlierMask(TokenMethod):
  """A mask of :math:`S` outliers beyond a cut ``mu_low`` (in batch standard deviations); the
  entropy target (``rft_jax.rl.token_methods.entropy_target``) chooses that cut per batch."""

  removes_tokens = True
  default_mu_low: ClassVar[float]

  def keep_at(self, inputs: TokenInputs, mu_low: float) -> jax.Array:
    """``[B, T]`` bool keep-mask with the lower cut ``mu_low``."""
    raise NotImplementedError

  def choose(self, inputs: TokenInputs) -> TokenChoice:
    keep = self.keep_at(inputs, self.config.entropy_mask.resolved_mu_low)
    return TokenChoice.everything(keep.shape)._replace(keep=keep)


@register_token_method("clip_b")
class ClipB(OutlierMask):
  """Clip_B (Algorithm 1): tokens whose :math:`S_* - \\bar S_*` lies outside
  :math:`[-\\mu^-\\sigma, \\mu^+\\sigma]` leave the loss."""

  title = "Clip_B"
  default_mu_low = CLIP_B_MU_LOW

  def keep_at(self, inputs: TokenInputs, mu_low: float) -> jax.Array:
    m = self.config.entropy_mask
    s_star, _ = mask_scores(m.logp_source, inputs)
    return clip_b_mask(s_star, inputs.advantages, inputs.response, mu_low=mu_low, mu_high=m.mu_high,
                       samples=m.samples)


@register_token_method("clip_v")
class ClipV(OutlierMask):
  """Clip_V (Algorithm 2): the same with :math:`S^c = S_* - \\mathbb{E}_p[S]`, at most
  ``max_frac`` of the valid tokens."""

  title = "Clip_V"
  default_mu_low = CLIP_V_MU_LOW

  def keep_at(self, inputs: TokenInputs, mu_low: float) -> jax.Array:
    m = self.config.entropy_mask
    _, centered = mask_scores(m.logp_source, inputs)
    return clip_v_mask(centered, inputs.advantages, inputs.response, mu_low=mu_low, mu_high=m.mu_high,
                       samples=m.samples, max_frac=m.resolved_max_frac)


@register_token_method("sign")
class SignMask(TokenMethod):
  """The Figure 1 masks on the sign of :math:`S_*` (``entropy_mask.sign`` / ``action``)."""

  removes_tokens = True

  def choose(self, inputs: TokenInputs) -> TokenChoice:
    m = self.config.entropy_mask
    s_star, _ = mask_scores(m.logp_source, inputs)
    keep = discriminator_sign_mask(s_star, inputs.advantages, sign=m.sign, action=m.action, samples=m.samples)
    return TokenChoice.everything(keep.shape)._replace(keep=keep)
