r"""The learner's metrics and its entropy-change forecasts.

A step reports its loss, gradient norm, the pre-update entropy and :math:`S_*`, the clip and mask
shares, the sampler's mismatch and Corollary 4's forecast of the entropy change
(:func:`step_metrics`); a step of several updates adds Corollary 3's, each update at its own
parameters (:func:`update_entropy_forecast`). Every ``forecast_every`` steps the learner measures
the change on the same batch beside the exact first-order change of the update applied
(:func:`entropy_change`)."""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

from rft_jax.entropy import batch_entropy_change, masked_mean
from rft_jax.rl.learner.routing import router_metrics
from rft_jax.rl.losses import kl_penalty
from rft_jax.rl.token_methods import TokenMethod


def update_entropy_forecast(policy_loss: Callable, mini: dict, stats, lr, batch_tokens):
  r"""Corollary 3's first-order change of the batch's mean entropy by one update on a
  mini-batch, from its statistics at the parameters :math:`\theta_u` the update starts from:
  each of its tokens takes the step :math:`\alpha_t = \eta\, g_t` with :math:`g_t = -\partial
  \ell_t / \partial \log p_t` (:math:`r_t A_t` where the clip lets the gradient through, 0 where
  it does not; GSPO's sequence ratio; an entropy method's weights), so the batch's entropy moves
  by :math:`-\eta\, (n_u / N)\, \mathrm{Cov}_u(g, S_* - \mathbb{E}_p[S])` (``n_u`` of the
  batch's ``N`` loss tokens). On-policy and unclipped, :math:`g = A`: Corollary 4.
  ``policy_loss(logp, old_logp, micro)``: ``(terms, per-token policy loss)`` of the step."""
  valid = mini["loss_mask"] > 0  # [b, T] rows: one sequence each

  def summed_loss(logp):
    return jnp.sum(jnp.where(valid, policy_loss(logp, mini["old_logp"], mini)[1], 0.0))

  step_size = -jax.grad(summed_loss)(stats.logp)
  share = jnp.sum(valid) / jnp.maximum(batch_tokens, 1.0)
  return batch_entropy_change(step_size, stats.centered, valid, lr * share)


def step_metrics(*, config, entropy_method: TokenMethod, stats, advantages, response, sampler_logp, loss_mask,
                 masked, chosen, correction, counts, losses, grad_norms, updates_done, lr, forecasts,
                 ref_logp) -> tuple[dict[str, jax.Array], jax.Array]:
  """The step's metrics (``[B, T]`` arrays of the pre-update pass; ``masked``, ``chosen``: the
  entropy mask's and method's :class:`TokenChoice`), and ``[B, T]`` the tokens the entropy mask
  removed (of those the rollout correction kept)."""
  valid = response > 0
  n_loss_tokens = jnp.maximum(jnp.sum(loss_mask) * updates_done, 1.0)
  positive, negative = valid & (advantages > 0), valid & (advantages < 0)
  removed = valid & ~masked.keep
  logp_gap = jnp.abs(sampler_logp - stats.logp)  # the sampler's against the learner's pre-update
  if correction is not None:  # what the entropy mask removed of the tokens the rejection kept
    removed = removed & (correction.keep > 0)
  metrics = {
      "loss": jnp.mean(jnp.stack(losses)),
      "grad_norm": jnp.mean(jnp.stack(grad_norms)),
      "lr": lr,
      "entropy": masked_mean(stats.entropy, valid),
      "s_star_mean": masked_mean(stats.s_star, valid),
      "s_centered_mean": masked_mean(stats.centered, valid),
      "clip_frac_low": counts["clipped_low"] / n_loss_tokens,
      "clip_frac_high": counts["clipped_high"] / n_loss_tokens,
      "clip_frac_dual": counts["clipped_dual"] / n_loss_tokens,
      "ratio_dev_max": counts["ratio_dev_max"],
      "mask_frac": jnp.sum(removed) / jnp.maximum(jnp.sum(valid), 1),
      "mask_frac_positive": jnp.sum(removed & positive) / jnp.maximum(jnp.sum(positive), 1),
      "mask_frac_negative": jnp.sum(removed & negative) / jnp.maximum(jnp.sum(negative), 1),
      "entropy_change_forecast": batch_entropy_change(advantages, stats.centered, loss_mask, lr),
      "logp_mismatch": masked_mean(logp_gap, valid),
      "logp_mismatch_max": jnp.max(jnp.where(valid, logp_gap, 0.0)),
      "response_tokens": jnp.sum(valid),
  }
  if forecasts:  # Corollary 3: every update at its own parameters, ratios and clips
    metrics["entropy_change_forecast_off_policy"] = jnp.sum(jnp.stack(forecasts))
  if entropy_method.chooses_tokens:  # the share of loss tokens the method drops or penalises
    touched = entropy_method.touched(chosen)
    metrics["method_frac"] = jnp.sum(touched & (loss_mask > 0)) / jnp.maximum(jnp.sum(loss_mask > 0), 1)
  metrics.update(masked.metrics)  # e.g. the cut the entropy target chose, and why
  metrics.update(chosen.metrics)
  if correction is not None:
    metrics.update(correction.metrics)
  metrics.update(router_metrics(counts))  # an MoE policy's router terms and routing
  if ref_logp is not None:  # measured with the pre-update parameters
    metrics["kl"] = masked_mean(kl_penalty(stats.logp, ref_logp, config.kl_estimator), valid)
  return metrics, removed


def row_stats(stats, valid, masked) -> dict[str, jax.Array]:
  """``[B]`` per-completion statistics of the pre-update pass (what ``rollouts.jsonl`` logs), and
  ``token_entropy``, ``[B, T]`` each valid token's entropy (0 elsewhere)."""
  tokens = jnp.maximum(jnp.sum(valid, axis=1), 1)
  return {"entropy_mean": jnp.sum(jnp.where(valid, stats.entropy, 0.0), axis=1) / tokens,
          "s_star_mean": jnp.sum(jnp.where(valid, stats.s_star, 0.0), axis=1) / tokens,
          "masked_tokens": jnp.sum(masked, axis=1),
          "token_entropy": jnp.where(valid, stats.entropy, 0.0)}


def entropy_change(mean_entropy: Callable, trainable: Callable, with_trainable: Callable, before, after):
  r"""``(H(after), dH)``: the token-mean entropy ``mean_entropy(params, entropy_grad)`` of a batch's
  responses under parameters ``after``, and the exact first-order change of the entropy under the
  update applied, :math:`\nabla_\theta H(\theta_0) \cdot (\theta_1 - \theta_0)` (a ``jax.jvp`` at
  ``before`` along ``after - before``; same tokens, same temperature).

  Corollary 4 forecasts the change in logit space, as if each token's logits moved by its own
  step; this is what the shared parameters actually do to first order, so the two forecasts'
  ratio measures how much the coupling through the weights changes the paper's picture.
  ``before``: the trainable parameters only (with LoRA the adapters; the frozen base is
  ``after``'s); ``trainable``, ``with_trainable``: the learner's split and merge of them."""
  tangent = jax.tree.map(lambda a, b: (a - b).astype(b.dtype), trainable(after), before)
  _, first_order = jax.jvp(lambda t: mean_entropy(with_trainable(after, t), True), (before,), (tangent,))
  return mean_entropy(after, False), first_order
