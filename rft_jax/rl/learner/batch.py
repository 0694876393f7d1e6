"""The learner's batch and its layout: :class:`LearnerBatch` (aligned with ``input_ids``, ``[B, L]``),
built from a sampler's typed rollouts by :func:`learner_batch` (the one place that knows the
layout), and the ``[B, L-1-p]`` per-token arrays a step computes on, from the position
predicting the batch's first completion column on (``rft_jax.rl.batching.first_stats_position``)."""

from __future__ import annotations

from typing import Any, NamedTuple, Optional, Protocol

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np


@flax.struct.dataclass
class LearnerBatch:
  """Rollouts as the learner sees them; token arrays are aligned with ``input_ids``.

  Attributes:
    input_ids: ``[B, L]`` prompt (left-padded) followed by completion (right-padded).
    attention_mask: ``[B, L]`` 1 on real tokens.
    response_mask: ``[B, L]`` 1 on completion tokens that count in the loss.
    advantages: ``[B]`` one advantage per completion (GRPO), or ``[B, L]`` one per token, aligned
      with ``input_ids`` (PPO's GAE advantages; read on the completion tokens only). None in a
      batch :func:`learner_batch` built without them, until the algorithm's advantages are set
      (``batch.replace(advantages=...)``); a step needs them.
    sampler_logp: ``[B, L]`` the sampler's log-prob of each completion token (the
      ``logp_mismatch`` metric; the rollout correction's pi_rollout; the entropy mask's S_* with
      ``entropy_mask.logp_source=sampler``).
    expert_ids: ``[B, L, n_layers, k]`` (uint8, or int16 beyond 256 experts) the experts the
      sampler routed each token to in each layer of an MoE policy (prompt tokens: its prefill's;
      completion tokens: the decode step that fed them; 0 where it fed none, e.g. a completion's
      last token), or None (a dense policy, or a sampler that did not record them). The
      learner's routing mismatch metric compares with them, and ``learner.routing_replay``
      routes its forward passes by them (``rft_jax.rl.learner.routing``).
  """

  input_ids: jax.Array
  attention_mask: jax.Array
  response_mask: jax.Array
  advantages: Optional[jax.Array]
  sampler_logp: jax.Array
  expert_ids: Optional[jax.Array] = None


class SampledRollouts(Protocol):
  """The typed rollouts a learner's batch is built from: ``B`` prompts, ``N`` completions
  (``rft_jax.sampling.Rollouts`` is one; ``rl/`` names what it reads without importing the sampler).

  Attributes:
    prompt_ids: ``[B, P]`` int32 prompts, left-padded.
    prompt_lengths: ``[B]`` real prompt tokens.
    completion_ids: ``[N, M]`` int32 completions, right-padded (the stop token included).
    completion_lengths: ``[N]`` tokens per completion.
    logprobs: ``[N, M]`` the sampler's log-probability of each completion token, or None when
      they stay on the sampler's devices (``on_device``).
    prompt_index: ``[N]`` the prompt (row of ``prompt_ids``) of each completion.
    on_device: None, or the completions left on the devices: ``completion_ids`` and
      ``logprobs``, ``[N, M]`` ``jax.Array`` s.
    prompt_expert_ids: ``[B, P, n_layers, k]`` the experts an MoE sampler routed each prompt
      token to in its prefill, or None (not recorded; optional attribute).
    completion_expert_ids: ``[N, M, n_layers, k]`` those of each completion token, from the
      decode step that fed it (0 where none did), or None.
    completion_mask: ``[N, M]`` 1 on the model's tokens, 0 on tokens an environment fed between
      its turns (a multi-turn trajectory), or None (all the model's; optional attribute).
  """

  prompt_ids: np.ndarray
  prompt_lengths: np.ndarray
  completion_ids: np.ndarray
  completion_lengths: np.ndarray
  logprobs: Optional[np.ndarray]
  prompt_index: np.ndarray
  on_device: Any
  prompt_expert_ids: Optional[Any]
  completion_expert_ids: Optional[Any]


def learner_batch(rollouts: SampledRollouts, rows=None, prompt_width: int | None = None,
                  advantages: jax.Array | None = None) -> LearnerBatch:
  """The learner's batch of ``rollouts``' completions ``rows``, ``[K, W + M]``.

  Column ``t`` of every array describes token ``input_ids[:, t]``: the completion's prompt
  (left-padded to ``W`` columns) followed by the completion (right-padded to ``M``);
  ``attention_mask`` is 1 on real prompt and completion tokens, ``response_mask`` on completion
  tokens the model drew (the stop token included; an environment's tokens in a multi-turn
  trajectory are read, ``attention_mask`` 1, but not trained on, ``response_mask`` 0),
  ``sampler_logp`` the sampler's log-probability of the completion tokens (0 elsewhere), ``expert_ids`` the sampler's recorded routing when it has
  one (``[K, W + M, n_layers, k]``, prompts' and completions' side by side).

  Args:
    rollouts: the sampled rollouts (:class:`SampledRollouts`).
    rows: ``[K]`` the completions to take, in this order (default: all, ``K = N``).
    prompt_width: ``W``, the prompt block's width (default ``P``): fewer columns drop leading
      padding (it must hold every taken prompt), more add some.
    advantages: ``[K]`` or ``[K, W + M]``; None: set later (``batch.replace(advantages=...)``).

  Returns:
    numpy arrays; ``jax.Array`` s computed on the sampler's devices when the rollouts are
    ``on_device`` (only the prompts and lengths are sent there, nothing comes back).
  """
  r = rollouts
  rows = np.arange(len(r.completion_ids)) if rows is None else np.asarray(rows, np.int32)
  p = r.prompt_ids.shape[1]
  width = p if prompt_width is None else int(prompt_width)
  prompt_lengths = r.prompt_lengths[r.prompt_index[rows]]
  if rows.size and prompt_lengths.max() > width:
    raise ValueError(f"learner_batch: prompt_width={width} is narrower than a taken prompt "
                     f"({prompt_lengths.max()} tokens)")
  prompt_ids = np.pad(r.prompt_ids, ((0, 0), (max(width - p, 0), 0)))[:, max(p - width, 0):]
  prompt_ids = prompt_ids[r.prompt_index[rows]]  # the last `width` columns, each row's prompt
  prompt_mask = (np.arange(width)[None] >= (width - prompt_lengths)[:, None]).astype(np.int32)
  lengths = r.completion_lengths[rows]
  if r.on_device is None:
    batch = _assemble(np, prompt_ids, prompt_mask, r.completion_ids[rows], r.logprobs[rows], lengths)
  else:
    batch = _assemble_on_device(prompt_ids, prompt_mask, r.on_device.completion_ids, r.on_device.logprobs,
                                rows, lengths)
  batch = batch.replace(expert_ids=_expert_ids(r, rows, width))
  model_tokens = getattr(r, "completion_mask", None)
  if model_tokens is not None:  # an environment's tokens: read, not trained on
    xp = jnp if isinstance(batch.response_mask, jax.Array) else np
    batch = batch.replace(response_mask=batch.response_mask * xp.concatenate(
        [xp.zeros_like(prompt_mask), xp.asarray(model_tokens[rows], batch.response_mask.dtype)], axis=1))
  return batch if advantages is None else batch.replace(advantages=advantages)


def _expert_ids(r: SampledRollouts, rows, width: int):
  """``[K, W + M, n_layers, k]`` the recorded routing of the taken rows (see :func:`learner_batch`),
  or None; on the devices when the recording is there."""
  prompt, completion = getattr(r, "prompt_expert_ids", None), getattr(r, "completion_expert_ids", None)
  if prompt is None or completion is None:
    return None
  xp = jnp if isinstance(completion, jax.Array) else np
  p = prompt.shape[1]
  prompt = xp.pad(prompt, ((0, 0), (max(width - p, 0), 0), (0, 0), (0, 0)))[:, max(p - width, 0):]
  return xp.concatenate([prompt[r.prompt_index[rows]], completion[rows]], axis=1)


def _assemble(xp, prompt_ids, prompt_mask, completion_ids, logprobs, lengths) -> LearnerBatch:
  """:func:`learner_batch`'s layout in numpy (``xp = np``) or traced JAX (``xp = jnp``)."""
  m = completion_ids.shape[1]
  completion_mask = (xp.arange(m)[None] < lengths[:, None]).astype(xp.int32)
  return LearnerBatch(
      input_ids=xp.concatenate([prompt_ids, completion_ids], axis=1).astype(xp.int32),
      attention_mask=xp.concatenate([prompt_mask, completion_mask], axis=1),
      response_mask=xp.concatenate([xp.zeros_like(prompt_mask), completion_mask], axis=1),
      advantages=None,
      sampler_logp=xp.concatenate([xp.zeros(prompt_mask.shape, xp.float32),
                                   logprobs * completion_mask], axis=1).astype(xp.float32))


@jax.jit
def _assemble_on_device(prompt_ids, prompt_mask, completion_ids, logprobs, rows, lengths) -> LearnerBatch:
  return _assemble(jnp, prompt_ids, prompt_mask, completion_ids[rows], logprobs[rows], lengths)


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
