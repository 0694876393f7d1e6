r"""Forking tokens (Wang et al. 2025, "Beyond the 80/20 Rule: High-Entropy Minority Tokens Drive
Effective Reinforcement Learning for LLM Reasoning") as a token method: only the top
``forking_rho`` share of the batch's loss tokens by entropy keeps its gradient (TRL 1.16.0's
``top_entropy_quantile``; :func:`rft_jax.rl.forking_tokens.forking_token_mask`)."""

from __future__ import annotations

import jax.numpy as jnp

from rft_jax.rl.forking_tokens import forking_token_mask
from rft_jax.rl.token_methods.registry import TokenChoice, TokenInputs, TokenMethod, register_token_method


@register_token_method("forking")
class ForkingTokens(TokenMethod):
  """The gradient of every loss token outside the top ``forking_rho`` share by entropy is removed."""

  def choose(self, inputs: TokenInputs) -> TokenChoice:
    keep = forking_token_mask(inputs.stats.entropy, inputs.loss_mask, rho=self.config.entropy_method.forking_rho)
    return TokenChoice.everything(keep.shape)._replace(weight=keep.astype(jnp.float32))
