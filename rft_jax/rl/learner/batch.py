"""The learner's batch and its layout: :class:`LearnerBatch` (aligned with ``input_ids``, ``[B, L]``)
and the ``[B, L-1-p]`` per-token arrays a step computes on, from the position predicting the
batch's first completion column on (``rft_jax.rl.batching.first_stats_position``)."""

from __future__ import annotations

from typing import NamedTuple

import flax.struct
import jax
import jax.numpy as jnp


@flax.struct.dataclass
class LearnerBatch:
  """Rollouts as the learner sees them; token arrays are aligned with ``input_ids``.

  Attributes:
    input_ids: ``[B, L]`` prompt (left-padded) followed by completion (right-padded).
    attention_mask: ``[B, L]`` 1 on real tokens.
    response_mask: ``[B, L]`` 1 on completion tokens that count in the loss.
    advantages: ``[B]`` one advantage per completion (GRPO), or ``[B, L]`` one per token, aligned
      with ``input_ids`` (PPO's GAE advantages; read on the completion tokens only).
    sampler_logp: ``[B, L]`` the sampler's log-prob of each completion token (the
      ``logp_mismatch`` metric; the rollout correction's pi_rollout; the entropy mask's S_* with
      ``entropy_mask.logp_source=sampler``).
  """

  input_ids: jax.Array
  attention_mask: jax.Array
  response_mask: jax.Array
  advantages: jax.Array
  sampler_logp: jax.Array


class StepTokens(NamedTuple):
  """A batch's ``[B, L-1-p]`` per-token arrays, position ``t`` predicting token ``t + 1 + p``.

  Attributes:
    response: float 1 on the valid completion tokens.
    advantages: float32 per-token advantages (a completion's own, broadcast, or PPO's per token).
    sampler_logp: the sampler's log-probs.
  """

  response: jax.Array
  advantages: jax.Array
  sampler_logp: jax.Array


def step_tokens(batch: LearnerBatch, first_position: int) -> StepTokens:
  """``batch``'s per-token arrays from position ``first_position`` on (the token columns it and the
  positions after it predict)."""
  targets = slice(first_position + 1, None)
  response = batch.response_mask[:, targets].astype(jnp.float32) * batch.attention_mask[:, targets]
  if batch.advantages.ndim == 2:  # per token, aligned with input_ids
    advantages = batch.advantages[:, targets].astype(jnp.float32)
  else:
    advantages = batch.advantages[:, None].astype(jnp.float32) * jnp.ones_like(response)
  return StepTokens(response, advantages, batch.sampler_logp[:, targets])


def response_tokens(batch: LearnerBatch, first_position: int) -> jax.Array:
  """``[B, L-1-p]`` 1 on the valid completion tokens (``response_mask * attention_mask``)."""
  targets = slice(first_position + 1, None)
  return batch.response_mask[:, targets] * batch.attention_mask[:, targets]
