"""The step plan: how a batch splits into micro-batches (rows, or packed tokens), which forward
passes a step takes (:func:`is_single_pass`, :func:`shares_forward_pass`), and what it computes on
each micro-batch: the whole batch's token choices, then each micro-batch's loss and clip counts.

Functions of the learner's config and its configured token methods; :class:`~rft_jax.rl.learner.Learner`
composes them into the compiled step."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from rft_jax.rl.config import LearnerConfig
from rft_jax.rl.losses import aggregate_loss, aggregation_weights, kl_penalty, loss_normaliser
from rft_jax.rl.objectives import Objective
from rft_jax.rl.rollout_correction import RolloutCorrection, rollout_correction
from rft_jax.rl.token_batches import gather_slots, gather_tokens, packed_row_count, packed_rows
from rft_jax.rl.token_methods import TokenInputs, TokenMethod, configured_method

# The clip counts of an update before its first micro-batch (``merge_counts`` adds to them).
ZERO_COUNTS = {"clipped_low": 0, "clipped_high": 0, "clipped_dual": 0, "ratio_dev_max": 0.0}


def zero_counts() -> dict[str, jax.Array]:
  return {k: jnp.asarray(v, jnp.float32 if k == "ratio_dev_max" else jnp.int32) for k, v in ZERO_COUNTS.items()}


def micro_batch_count(config: LearnerConfig, batch_size: int) -> int:
  """How many row micro-batches of ``learner.micro_batch_size`` a batch of ``batch_size`` rows makes."""
  if batch_size % config.micro_batch_size:
    raise ValueError(f"batch of {batch_size} sequences does not split into micro-batches of "
                     f"learner.micro_batch_size={config.micro_batch_size}")
  return batch_size // config.micro_batch_size


def is_single_pass(config: LearnerConfig, batch_size: int) -> bool:
  """Whether a step on ``batch_size`` rows takes one forward pass (one update, one micro-batch of
  rows; with ``micro_batch_tokens`` never)."""
  if config.micro_batch_tokens is not None:
    return False
  return config.mini_batches == 1 and config.ppo_epochs == 1 and micro_batch_count(config, batch_size) == 1


def shares_forward_pass(config: LearnerConfig, entropy_mask: TokenMethod, entropy_method: TokenMethod,
                        batch_size: int) -> bool:
  """Whether the step's statistics come from the forward passes of its gradients (see
  ``Learner.shares_forward_pass``)."""
  local = not (entropy_mask.chooses_tokens or entropy_method.chooses_tokens)
  local = local and config.rollout_correction.token_local  # rejection changes the normaliser
  return config.mini_batches == 1 and config.ppo_epochs == 1 and (local or is_single_pass(config, batch_size))


def token_plan_shape(config: LearnerConfig, rows: int, width: int, data_devices: int) -> tuple[int, ...]:
  """The shape of the token plan of a ``[rows, width]`` batch as if every row were full (the most
  micro-batches a step of this shape takes)."""
  per_micro = packed_row_count(config.micro_batch_tokens, width, data_devices)
  micro_batches = -(-(rows // config.mini_batches) // per_micro)
  return (config.mini_batches, micro_batches, per_micro, width)


def step_loss_normaliser(config: LearnerConfig, loss_mask, input_ids):
  """``loss_normaliser`` of a (mini-)batch's ``[b, L-1-p]`` loss mask. Dr.GRPO's constant length
  defaults to the full next-token width ``L - 1`` of ``input_ids`` (``[b, L]``), whichever
  first position the statistics start from."""
  return loss_normaliser(loss_mask, config.max_len or input_ids.shape[1] - 1)


def step_rollout_correction(config: LearnerConfig, learner_logp, sampler_logp, response) -> RolloutCorrection | None:
  """``rft_jax.rl.rollout_correction`` of the whole batch's pre-update (stop-gradient) log-probs;
  None when ``learner.rollout_correction`` is off (the step is then the same program)."""
  if not config.rollout_correction.enabled:
    return None
  return rollout_correction(jax.lax.stop_gradient(learner_logp), sampler_logp, response, config.rollout_correction)


def batch_token_choices(entropy_mask: TokenMethod, entropy_method: TokenMethod, stats, per_token, response,
                        sampler_logp, step, correction: RolloutCorrection | None = None):
  """The whole batch's entropy-mask and entropy-method choices (``rft_jax.rl.token_methods``)
  from the pre-update statistics; adds the loss mask and the method's arrays to ``per_token``.
  Returns ``(per_token, masked, chosen)``: the two :class:`TokenChoice`.

  With a rollout ``correction``, its rejected tokens leave ``response`` first: the entropy mask's
  batch statistics, the method's choice and the loss normaliser see only the tokens verl would
  keep (verl rejects in the trainer, before the actor's loss); its importance weights go to
  ``per_token["rollout_is_weight"]``."""
  if correction is not None:
    response = response * correction.keep
    if correction.weight is not None:
      per_token = dict(per_token, rollout_is_weight=correction.weight)
  inputs = TokenInputs(stats, sampler_logp, per_token["advantages"], response, response, step)
  masked = entropy_mask.choose(inputs)
  per_token = dict(per_token, loss_mask=response * masked.keep)
  chosen = entropy_method.choose(inputs._replace(loss_mask=per_token["loss_mask"]))
  if entropy_method.chooses_tokens:
    per_token.update(method_weight=chosen.weight, method_penalised=chosen.penalised)
  return per_token, masked, chosen


def policy_loss(config: LearnerConfig, objective: Objective, entropy_method: TokenMethod, logp, old_logp, micro):
  """``(terms, [..] per-token policy loss)``: the objective's surrogate
  (``rft_jax.rl.objectives``), then the entropy method's loss where it chooses tokens, times
  the rollout correction's importance weights where it has them."""
  c = config
  terms = objective.per_token_loss(logp, old_logp, micro["advantages"], micro["loss_mask"],
                                  eps_low=c.resolved_eps_low, eps_high=c.resolved_eps_high,
                                  dual_clip=c.dual_clip, sequence_ids=micro.get("segment_ids"))
  loss = terms.loss
  if entropy_method.chooses_tokens:
    loss = entropy_method.policy_loss(terms.loss, logp, old_logp, micro["advantages"], micro["loss_mask"],
                                      micro["method_weight"], micro["method_penalised"])
  if "rollout_is_weight" in micro:  # rollout correction: verl's pg_losses * rollout_is_weights
    loss = loss * micro["rollout_is_weight"]
  return terms, loss


def loss_terms(config: LearnerConfig, objective: Objective, entropy_method: TokenMethod, stats, micro, normaliser,
               old_logp):
  """The micro-batch's loss (policy term, KL, entropy bonus) and its clip counts. ``normaliser``:
  the mini-batch's ``LossNormaliser``, or None for packed rows, whose ``micro["loss_weight"]``
  (``aggregation_weights``) holds it."""
  c = config
  mask = micro["loss_mask"]
  if normaliser is None:
    weight = micro["loss_weight"]
    aggregate = lambda x, mask, mode, normaliser: jnp.sum(jnp.where(weight != 0, x * weight, 0.0))
  else:
    aggregate = aggregate_loss
  terms, per_token_loss = policy_loss(c, objective, entropy_method, stats.logp, old_logp, micro)
  loss = aggregate(per_token_loss, mask, c.loss_agg, normaliser)
  if c.kl_coef > 0:
    loss += c.kl_coef * aggregate(kl_penalty(stats.logp, micro["ref_logp"], c.kl_estimator),
                                  mask, c.loss_agg, normaliser)
  if c.entropy_coef > 0:
    loss -= c.entropy_coef * aggregate(stats.entropy, mask, c.loss_agg, normaliser)
  valid = mask > 0
  counts = {
      "clipped_low": jnp.sum(terms.clipped_low & valid),
      "clipped_high": jnp.sum(terms.clipped_high & valid),
      "clipped_dual": jnp.sum(terms.clipped_dual & valid),
      "ratio_dev_max": jnp.max(jnp.where(valid, jnp.abs(terms.ratio - 1.0), 0.0)),
  }
  return loss, counts


def packed_micro_batches(config: LearnerConfig, mini: dict, token_index, first_position: int, row_stride: int,
                         constrain) -> dict:
  """A mini-batch's per-token arrays (``[b, T]``) as packed micro-batches ``[n, r, L]`` by its
  plan ``token_index`` (``[n, r, L]``; ``row_stride``: see ``packed_rows``), with the packed
  rows' fields and ``loss_weight``, the loss normaliser as per-token weights; ``constrain``: the
  learner's layout of micro-batches."""
  normaliser = step_loss_normaliser(config, mini["loss_mask"], mini["input_ids"])
  per_token = dict(mini, loss_weight=aggregation_weights(mini["loss_mask"], config.loss_agg, normaliser))
  packed = packed_rows(token_index, mini["input_ids"], mini["attention_mask"], first_position, row_stride)
  slots = ("expert_ids", "routed")  # aligned with input_ids: each slot's token's
  micros = {k: gather_tokens(v, packed.stat_index) for k, v in per_token.items()
            if k not in ("input_ids", "attention_mask") + slots}
  micros.update({k: gather_slots(token_index, mini[k], row_stride) for k in slots if k in mini})
  micros.update(packed._asdict())
  return {k: constrain(v) for k, v in micros.items()}


class StepPlan:
  """The step plan of one config: its token methods and objective, bound to the functions above."""

  def __init__(self, config: LearnerConfig):
    self.config = config
    self.entropy_mask = configured_method(config, removes_tokens=True)  # Clip_B, Clip_V, ...
    self.entropy_method = configured_method(config, removes_tokens=False)  # Clip-Cov, KL-Cov, ...
    self.objective = config.policy_objective  # PPO's or GSPO's surrogate

  def micro_batches(self, batch_size: int) -> int:
    return micro_batch_count(self.config, batch_size)

  def is_single_pass(self, batch_size: int) -> bool:
    return is_single_pass(self.config, batch_size)

  def shares_forward_pass(self, batch_size: int) -> bool:
    return shares_forward_pass(self.config, self.entropy_mask, self.entropy_method, batch_size)

  def loss_normaliser(self, loss_mask, input_ids):
    return step_loss_normaliser(self.config, loss_mask, input_ids)

  def rollout_correction(self, learner_logp, sampler_logp, response) -> RolloutCorrection | None:
    return step_rollout_correction(self.config, learner_logp, sampler_logp, response)

  def token_choices(self, stats, per_token, response, sampler_logp, step, correction=None):
    return batch_token_choices(self.entropy_mask, self.entropy_method, stats, per_token, response, sampler_logp,
                               step, correction)

  def policy_loss(self, logp, old_logp, micro):
    return policy_loss(self.config, self.objective, self.entropy_method, logp, old_logp, micro)

  def loss_terms(self, stats, micro, normaliser, old_logp):
    return loss_terms(self.config, self.objective, self.entropy_method, stats, micro, normaliser, old_logp)
