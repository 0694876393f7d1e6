r"""The algorithms a run can train with, keyed by ``learner.advantage``: each entry makes a step's
advantages from its rewards (and, for PPO, trains the critic), so the loop calls one method.

* Group estimators (``grpo``, ``drgrpo``, ``rloo``; :data:`rft_jax.rl.advantages.ADVANTAGE_ESTIMATORS`):
  one advantage per completion from its group's rewards (Shao et al. 2024, "DeepSeekMath"; Liu et
  al. 2025, "Understanding R1-Zero-Like Training"; Ahmadian et al. 2024, "Back to Basics").
* ``gae``: PPO (Schulman et al. 2017) with a learned critic (:mod:`rft_jax.rl.advantages.critic`): token-level
  GAE advantages (Schulman et al. 2016) whitened over the batch (:mod:`rft_jax.rl.advantages.gae`), and one
  step of the critic's value loss per policy step.

Every entry first shapes the rewards with the unlikeliness reward when ``learner.beta_rank > 0``
(:mod:`rft_jax.rl.advantages.unlikeliness`; it changes the advantages' input only). The loop, the checkpoints,
the preflight checks and ``rft-jax plan`` ask the entry (:func:`algorithm`), e.g. whether it needs
a critic, rather than test the name; a new estimator is one registered entry
(:func:`register_algorithm`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int

from rft_jax.parallel import host_array
from rft_jax.rl.advantages.group import ADVANTAGE_ESTIMATORS, compute_advantages
from rft_jax.rl.advantages.gae import gae_advantages, outcome_token_rewards
from rft_jax.rl.named_registry import Registry
from rft_jax.rl.advantages.unlikeliness import mean_token_logp, unlikeliness_rewards


@dataclasses.dataclass(frozen=True)
class AdvantageInputs:
  """What a step's algorithm reads: its ``B`` completions, group by group (``n`` a group).

  Attributes:
    rewards: ``[B]`` each completion's reward.
    correct: ``[B]`` whether its answer was right (the unlikeliness reward's input).
    input_ids, attention_mask, response_mask, sampler_logp: ``[B, L]`` the learner batch's
      columns (prompt and completion; the sampler's log-probs of the completion tokens).
  """

  rewards: Float[np.ndarray, "B"]
  correct: Bool[np.ndarray, "B"]
  input_ids: Int[Array, "B L"]
  attention_mask: Int[Array, "B L"]
  response_mask: Float[Array, "B L"]
  sampler_logp: Float[Array, "B L"]


@dataclasses.dataclass(frozen=True)
class CriticRun:
  """PPO's critic in a run: the model (:class:`~rft_jax.rl.advantages.critic.Critic`), its train state and
  GAE's ``gamma`` and ``lam`` (``critic.*``)."""

  model: Any
  state: Any
  gamma: float = 1.0
  lam: float = 1.0


@dataclasses.dataclass(frozen=True)
class StepAdvantages:
  """An algorithm's output for one step.

  Attributes:
    advantages: ``[B]`` one per completion, or ``[B, L]`` per token (aligned with ``input_ids``).
    critic_targets: PPO's ``([B, L-1] returns, [B, L-1] values)`` at rollout time, next-token
      aligned as :meth:`~rft_jax.rl.advantages.critic.Critic.values`; None without a critic.
  """

  advantages: Float[Array, "B"] | Float[Array, "B L"]
  critic_targets: tuple[Float[Array, "B T"], Float[Array, "B T"]] | None = None


@dataclasses.dataclass(frozen=True)
class Algorithm:
  """An entry of :data:`ALGORITHMS`.

  Attributes:
    name: its ``learner.advantage`` value.
    needs_critic: the run trains a critic beside the policy (its parameters, AdamW state and
      step are part of the train state, its checkpoints and its memory).
    takes_rejection: ``learner.rollout_correction.rejection`` may drop tokens after this
      entry's advantages are made. False where the advantages would have to be made over the
      kept tokens only (GAE's recursion and whitening, as verl rejects before them), which needs
      the learner's pre-update log-probs before the advantages exist.
  """

  name: str
  needs_critic: bool = False
  takes_rejection: bool = True

  def advantages(self, inputs: AdvantageInputs, n: int, learner, critic: CriticRun | None = None
                 ) -> StepAdvantages:
    """The step's advantages from its rewards, shaped first (:meth:`shaped_rewards`).

    Args:
      inputs: the step's completions, ``n`` a group.
      n: completions per prompt.
      learner: the run's ``LearnerConfig`` (``beta_rank``, ``advantage_eps``, ...).
      critic: the run's critic (entries that need one).
    """
    return self.estimate(self.shaped_rewards(inputs, n, learner), inputs, n, learner, critic)

  def shaped_rewards(self, inputs: AdvantageInputs, n: int, learner) -> Float[np.ndarray, "B"]:
    """The rewards the estimator sees: with ``learner.beta_rank > 0`` the unlikeliness reward's
    (He et al. 2025: a correct completion's reward lowered by the rank of its likelihood in its
    group), else the rewards as they are."""
    if learner.beta_rank <= 0:
      return inputs.rewards
    likelihood = mean_token_logp(inputs.sampler_logp, inputs.response_mask)
    shaped = unlikeliness_rewards(inputs.rewards.reshape(-1, n), inputs.correct.reshape(-1, n),
                                  likelihood.reshape(-1, n), beta_rank=learner.beta_rank)
    return host_array(shaped).reshape(-1)

  def estimate(self, rewards: Float[np.ndarray, "B"], inputs: AdvantageInputs, n: int, learner,
               critic: CriticRun | None) -> StepAdvantages:
    """The advantages of (shaped) ``rewards``: each entry's own rule."""
    raise NotImplementedError(f"algorithm {self.name!r} makes no advantages")

  def critic_step(self, critic: CriticRun, batch, targets) -> tuple[Any, dict[str, float]]:
    """One step of the critic on the step's batch (a ``LearnerBatch``) and ``targets``
    (:attr:`StepAdvantages.critic_targets`): ``(new critic state, metrics)``."""
    raise NotImplementedError(f"algorithm {self.name!r} has no critic")


@dataclasses.dataclass(frozen=True)
class GroupEstimator(Algorithm):
  """A group-relative estimator of :data:`~rft_jax.rl.advantages.ADVANTAGE_ESTIMATORS`: one
  advantage per completion from its group's rewards. Every estimator is given the group
  z-score's ``learner.advantage_eps`` and ``advantage_ddof``; those that divide by no standard
  deviation (``drgrpo``, ``rloo``) ignore them, so no entry is told apart by its name."""

  def estimate(self, rewards, inputs, n, learner, critic) -> StepAdvantages:
    return StepAdvantages(compute_advantages(jnp.asarray(rewards), n, self.name, eps=learner.advantage_eps,
                                             ddof=learner.advantage_ddof))


@dataclasses.dataclass(frozen=True)
class Gae(Algorithm):
  """PPO's token advantages from the critic: each completion's reward at its last token, GAE
  over its tokens with the rollout-time values, whitened over the batch
  (:func:`~rft_jax.rl.advantages.gae.gae_advantages`); the critic then takes one step of its clipped value
  loss on the same rollouts."""

  needs_critic: bool = True
  takes_rejection: bool = False

  def estimate(self, rewards, inputs, n, learner, critic) -> StepAdvantages:
    values = critic.model.values(critic.state, inputs.input_ids, inputs.attention_mask)
    mask = jnp.asarray(inputs.response_mask[:, 1:] * inputs.attention_mask[:, 1:])
    advantages, returns = gae_advantages(outcome_token_rewards(jnp.asarray(rewards), mask), values,
                                         mask, gamma=critic.gamma, lam=critic.lam)
    return StepAdvantages(jnp.pad(advantages, ((0, 0), (1, 0))), (returns, values))

  def critic_step(self, critic, batch, targets):
    return critic.model.step(critic.state, batch.input_ids, batch.attention_mask,
                             batch.response_mask[:, 1:], *targets)


ALGORITHMS: Registry[Algorithm] = Registry("learner.advantage", "algorithm")


def register_algorithm(entry: Algorithm) -> Algorithm:
  """Adds ``entry`` to :data:`ALGORITHMS` under its name (``learner.advantage``)."""
  return ALGORITHMS.add(entry.name, entry)


for _name in ADVANTAGE_ESTIMATORS:
  register_algorithm(GroupEstimator(_name))
register_algorithm(Gae("gae"))


def algorithm(advantage: str) -> Algorithm:
  """The entry of ``learner.advantage``; ``ValueError`` naming the key if there is none."""
  return ALGORITHMS.entry(advantage)
