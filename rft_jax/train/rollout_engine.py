"""What the training loop asks of whatever makes its rollouts: one interface, as tunix's
``BaseRollout``, so that single-turn and multi-turn rollouts (and later engines in other
processes) are written once and the loop does not care which it has.

:class:`RolloutEngine`: ``update_weights`` (the policy to sample from next), ``sample`` (a round:
rollouts, texts, rewards), ``logprobs`` (the engine's log-probabilities of given tokens under its
current weights), ``close``. :class:`SingleTurnEngine` samples one completion per sample and scores
it with ``rewards``; :class:`MultiTurnEngine` samples trajectories with the run's environment. Both
sample with the learner's own parameters on its mesh (colocated): ``update_weights`` hands them
the learner's model, nothing is copied.
"""

from __future__ import annotations

import abc
import time
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from rft_jax.rewards import score_batch
from rft_jax.rewards.user_functions import example_rows
from rft_jax.rl.learner import learner_batch
from rft_jax.sampling import SamplingParams, generate
from rft_jax.sampling.rollouts import Rollouts
from rft_jax.train.agent_round import AgentParts, sample_trajectories
from rft_jax.train.step_rollouts import SampledRound


class RolloutEngine(abc.ABC):
  """Makes a run's rollouts from the policy it was last given."""

  model: Any = None

  def update_weights(self, model) -> None:
    """The policy the next rounds sample from (an in-process engine keeps the model itself)."""
    self.model = model

  @abc.abstractmethod
  def sample(self, prompts: Sequence, params: SamplingParams, seed: int) -> SampledRound:
    """A round: ``params.n`` rollouts of each of ``prompts`` (``data.Prompt``), decoded and
    rewarded."""

  def logprobs(self, rollouts: Rollouts) -> np.ndarray:
    """``[N, M]`` the current policy's log-probabilities of the rollouts' completion tokens (0 on
    padding and on an environment's tokens), one forward pass of prompt and completion."""
    batch = learner_batch(rollouts)
    logp = _token_logprobs(self.model, jnp.asarray(batch.input_ids), jnp.asarray(batch.attention_mask))
    m = rollouts.completion_ids.shape[1]
    out = np.asarray(logp)[:, -m:]
    return out * np.asarray(batch.response_mask)[:, -m:]

  def close(self) -> None:
    """Stops what the engine started."""


@nnx.jit
def _token_logprobs(model, input_ids, attention_mask):
  """``[B, L]`` log p of each token given the ones before it (column 0: 0)."""
  logits = model(input_ids, attention_mask)[:, :-1]
  logp = jnp.take_along_axis(jax.nn.log_softmax(logits, -1), input_ids[:, 1:, None], -1)[..., 0]
  return jnp.pad(logp, ((0, 0), (1, 0)))


class SingleTurnEngine(RolloutEngine):
  """One completion per sample (:func:`~rft_jax.sampling.generate`), left on the devices for the
  learner's batch, scored by the run's ``rewards``."""

  def __init__(self, cfg, tokenizer, mesh=None):
    self.cfg, self.tokenizer, self.mesh = cfg, tokenizer, mesh

  def sample(self, prompts: Sequence, params: SamplingParams, seed: int) -> SampledRound:
    t0 = time.perf_counter()
    rollouts = generate(self.model, [list(p.token_ids) for p in prompts], params, seed=seed,
                        mesh=self.mesh, keep_on_device=True)
    t1 = time.perf_counter()
    texts = self.tokenizer.batch_decode(rollouts.completions(), skip_special_tokens=True)
    examples = [prompts[i].example for i in rollouts.prompt_index]
    scored = score_batch(texts, [e.answer for e in examples], list(rollouts.finish_reason),
                         [int(x) for x in rollouts.completion_lengths], self.cfg.rewards,
                         rows=example_rows(examples))
    return SampledRound(list(prompts), rollouts, texts, scored, t1 - t0, time.perf_counter() - t1)


class MultiTurnEngine(RolloutEngine):
  """Trajectories with the run's environment (:func:`~rft_jax.train.agent_round.sample_trajectories`),
  rewarded by it; the environments' worker processes stop with :meth:`close`."""

  def __init__(self, cfg, tokenizer, agent: AgentParts, mesh=None):
    self.cfg, self.tokenizer, self.agent, self.mesh = cfg, tokenizer, agent, mesh

  def sample(self, prompts: Sequence, params: SamplingParams, seed: int) -> SampledRound:
    t0 = time.perf_counter()
    rollouts, texts, scored, trajectories = sample_trajectories(
        self.cfg, self.agent, self.model, self.tokenizer, [p.example for p in prompts], params,
        seed, self.mesh)
    return SampledRound(list(prompts), rollouts, texts, scored, time.perf_counter() - t0, 0.0,
                        trajectories=trajectories)

  def close(self) -> None:
    self.agent.close()


def rollout_engine(cfg, tokenizer, agent: AgentParts | None, mesh=None) -> RolloutEngine:
  """The run's engine: multi-turn with ``agent`` (``rollout.environment``), else single-turn."""
  if agent is not None:
    return MultiTurnEngine(cfg, tokenizer, agent, mesh)
  return SingleTurnEngine(cfg, tokenizer, mesh)
