r"""High-entropy "forking" tokens: train only on the top-:math:`\rho` entropy tokens.

Source: S. Wang et al., *Beyond the 80/20 Rule: High-Entropy Minority Tokens Drive
Effective Reinforcement Learning for LLM Reasoning*, arXiv:2506.01939 (2025): keep the
policy gradient of the tokens whose entropy is in the top :math:`\rho` share of the batch
(:math:`\rho = 0.2` recommended) and drop the rest.

Peer implementation: TRL 1.16.0 (Apache-2.0), ``trl/trainer/grpo_trainer.py``,
``GRPOTrainer.get_high_entropy_mask`` with ``GRPOConfig.top_entropy_quantile`` (= :math:`\rho`,
default 1.0 there, i.e. off). TRL gathers the valid tokens' entropies of every process
(padding dropped), takes ``torch.quantile(gathered, 1 - rho)`` (linear interpolation) and
keeps the valid tokens with ``entropy >= threshold``; the mask multiplies the per-token
loss, the loss denominators are unchanged.

As a token method (:class:`ForkingTokens`, ``learner.entropy_method.kind=forking``): only the top
``forking_rho`` share of the batch's loss tokens by entropy keeps its gradient.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float

from rft_jax.rl.token_methods.registry import TokenChoice, TokenInputs, TokenMethod, register_token_method

FORKING_RHO = 0.2


@dataclasses.dataclass
class ForkingSettings:
  """The forking-token method's setting (part of ``learner.entropy_method``).

  Attributes:
    forking_rho: the share of highest-entropy tokens that keep their gradient (the paper's 0.2).
  """

  forking_rho: float = FORKING_RHO

  def check_forking(self, section: str) -> None:
    """``ValueError`` naming ``section.forking_rho`` unless it is in (0, 1]."""
    if not 0 < self.forking_rho <= 1:
      raise ValueError(f"{section}.forking_rho must be in (0, 1], got {self.forking_rho!r}")


def _torch_lerp(start: Array, end: Array, weight: Array) -> Array:
  """``torch.lerp``'s formula (ATen ``Lerp.h``): exact at both ends."""
  return jnp.where(jnp.abs(weight) < 0.5, start + weight * (end - start), end - (end - start) * (1 - weight))


def forking_token_mask(
    entropy: Float[Array, "B T"], mask: Array, *, rho: float = FORKING_RHO
) -> Bool[Array, "B T"]:
  r"""True on the valid tokens whose entropy is in the top ``rho`` share of the batch.

  With :math:`H_{(0)} \le \dots \le H_{(N-1)}` the sorted entropies of the :math:`N` valid
  tokens (``mask > 0``) of the arrays given, :math:`q = 1 - \rho` (rounded to float32, as
  ``torch.quantile`` does with a Python float) and :math:`i = q (N - 1)` (float32),

  .. math::  \tau = \mathrm{lerp}\big(H_{(\lfloor i\rfloor)}, H_{(\lceil i\rceil)}, i - \lfloor i\rfloor\big),
             \qquad \text{keep}_t = m_t \wedge (H_t \ge \tau),

  i.e. ``torch.quantile(valid, 1 - rho)`` with its default ``linear`` interpolation and a
  non-strict ``>=``, exactly TRL 1.16.0's ``get_high_entropy_mask`` (padding is excluded
  from the quantile and always False). Hence:

  * ``rho = 1``: every valid token (TRL skips the mask; :math:`\tau` would be the minimum).
  * ``rho = 0``: :math:`\tau` is the maximum: the token(s) of the highest entropy (all of
    them if tied).
  * Ties at :math:`\tau` are all kept, so slightly more than :math:`\rho N` tokens may be.
  * No valid token: all False.

  Statistics are float32 and stop-gradient; :math:`N` is traced under ``jit`` (invalid
  tokens sort last, the quantile indexes the first :math:`N`). Pass the whole training
  batch: TRL gathers across processes, so its quantile is over the global batch of that
  step. Checked against TRL 1.16.0 ``get_high_entropy_mask`` on identical tensors
  (``tests/test_forking_tokens.py``).

  Args:
    entropy: ``[B, T]`` per-token entropy of the policy's next-token distribution.
    mask: ``[B, T]`` valid response tokens (``> 0``).
    rho: top share kept, in ``[0, 1]`` (TRL ``top_entropy_quantile``; paper: 0.2).

  Returns:
    ``[B, T]`` bool keep-mask: multiply it into the per-token loss.
  """
  if not 0.0 <= rho <= 1.0:
    raise ValueError(f"rho must be in [0, 1], got {rho}")
  valid = mask > 0
  if rho >= 1.0:
    return valid
  h = jax.lax.stop_gradient(entropy).astype(jnp.float32)
  n_valid = jnp.sum(valid).astype(jnp.int32)
  ordered = jnp.sort(jnp.where(valid, h, jnp.inf).reshape(-1))
  q = np.float32(1.0 - rho)  # TRL passes threshold = 1 - top_entropy_quantile (float64)
  position = q * jnp.maximum(n_valid - 1, 0).astype(jnp.float32)
  below = jnp.floor(position).astype(jnp.int32)
  above = jnp.ceil(position).astype(jnp.int32)
  threshold = _torch_lerp(ordered[below], ordered[above], position - below.astype(jnp.float32))
  return valid & (h >= threshold) & (n_valid > 0)


@register_token_method("forking")
class ForkingTokens(TokenMethod):
  """The gradient of every loss token outside the top ``forking_rho`` share by entropy is removed."""

  def choose(self, inputs: TokenInputs) -> TokenChoice:
    keep = forking_token_mask(inputs.stats.entropy, inputs.loss_mask, rho=self.config.entropy_method.forking_rho)
    return TokenChoice.everything(keep.shape)._replace(weight=keep.astype(jnp.float32))
