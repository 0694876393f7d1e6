r"""The entropy target: a Clip_B / Clip_V cut :math:`\mu^-` chosen per batch to hold the policy's
entropy near a set value (``learner.entropy_mask.target_entropy``), a closed loop on Corollary 4."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from rft_jax.entropy import batch_entropy_change, masked_mean
from rft_jax.rl.token_methods.entropy_masks import OutlierMask
from rft_jax.rl.token_methods.registry import (
    TokenChoice,
    TokenInputs,
    TokenMethod,
    method_class,
    method_names,
    register_token_method,
)

# The cuts mu^- the entropy target chooses from, largest first; inf: no cut.
TARGET_MU_GRID = (float("inf"), 12.0, 8.5, 6.0, 4.0, 3.0, 2.5, 2.0, 1.5, 1.0, 0.5)


@register_token_method("entropy_target")
class EntropyTarget(TokenMethod):
  r"""The Clip_B / Clip_V keep-mask (``entropy_mask.kind``) whose cut holds the entropy near
  ``target_entropy`` :math:`H^*`.

  For every cut :math:`\mu` of :data:`TARGET_MU_GRID`, Corollary 4 forecasts the batch's entropy
  change :math:`f(\mu) = -\mathrm{Cov}_B(A, S_* - \mathbb{E}_p[S])` over the tokens the cut keeps
  (per unit learning rate: only the forecasts' order matters). With the batch's mean entropy
  :math:`H`, the share :math:`s = \mathrm{clip}((H^* - H) / (b H^*), 0, 1)` of the raising range
  is asked for (:math:`b` = ``target_band``): the forecast :math:`f(\infty) + s\,(\max_\mu f -
  f(\infty))`, and the largest cut (fewest tokens masked) that reaches it is taken. At or above
  the target nothing is masked (plain GRPO, which lowers entropy); a band or more below it the
  most entropy-raising cut of the grid is. The forecast's scale is not the measured change's (the
  optimizer moves shared weights, not logits), so the loop is steered by order, not magnitude.

  Its choice reports ``target_mu`` (the cut taken, 0 for none) and ``target_share`` (:math:`s`).
  """

  removes_tokens = True
  selected_by = "target_entropy"

  @classmethod
  def check(cls, section) -> None:
    cuts = sorted(k for k in method_names(True) if issubclass(method_class(k, True), OutlierMask))
    if section.kind not in cuts:
      raise ValueError(f"learner.entropy_mask.target_entropy chooses a Clip_B / Clip_V cut: set "
                       f"learner.entropy_mask.kind to one of {cuts}, not {section.kind!r}")

  def choose(self, inputs: TokenInputs) -> TokenChoice:
    m = self.config.entropy_mask
    base = method_class(m.kind, True)(self.config)
    valid = inputs.response > 0
    keeps = jnp.stack([jnp.ones(valid.shape, bool) if mu == float("inf") else base.keep_at(inputs, mu)
                       for mu in TARGET_MU_GRID])
    stats, advantages = inputs.stats, inputs.advantages
    forecasts = jax.vmap(lambda keep: batch_entropy_change(advantages, stats.centered, valid & keep, 1.0))(keeps)
    entropy = masked_mean(stats.entropy, valid)
    share = jnp.clip((m.target_entropy - entropy) / (m.target_band * m.target_entropy), 0.0, 1.0)
    wanted = forecasts[0] + share * (jnp.max(forecasts) - forecasts[0])
    reaches = forecasts >= wanted - 1e-6 * jnp.abs(wanted)
    index = jnp.argmax(reaches)  # the first, i.e. the largest cut, that reaches it
    mu = jnp.asarray([0.0 if x == float("inf") else x for x in TARGET_MU_GRID], jnp.float32)[index]
    choice = TokenChoice.everything(valid.shape)
    return choice._replace(keep=keeps[index], metrics={"target_mu": mu, "target_share": share})

