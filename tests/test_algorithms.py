"""The algorithm entries (``rft_jax.rl.advantages.algorithms``): each makes a step's advantages from its
rewards (the loop calls one method), shapes them with the unlikeliness reward when asked, and a
new estimator is one registered entry."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from rft_jax.rl.advantages import algorithms as A
from rft_jax.rl.advantages import compute_advantages
from rft_jax.rl.config import LearnerConfig
from rft_jax.rl.advantages.unlikeliness import mean_token_logp, unlikeliness_rewards


def inputs(seed: int = 0, groups: int = 3, n: int = 4, length: int = 6) -> A.AdvantageInputs:
  rng = np.random.default_rng(seed)
  b = groups * n
  mask = (np.arange(length)[None] >= rng.integers(1, length, b)[:, None]).astype(np.float32)
  return A.AdvantageInputs(
      rewards=rng.integers(0, 2, b).astype(np.float32), correct=rng.random(b) < 0.5,
      input_ids=jnp.asarray(rng.integers(1, 50, (b, length))), attention_mask=jnp.ones((b, length), jnp.int32),
      response_mask=jnp.asarray(mask), sampler_logp=jnp.asarray(-rng.exponential(1.0, (b, length)) * mask))


@pytest.mark.parametrize("name", ["grpo", "drgrpo", "rloo"])
def test_group_estimators_are_compute_advantages(name):
  x = inputs()
  learner = LearnerConfig(advantage=name)
  result = learner.algorithm.advantages(x, 4, learner)
  options = {"eps": learner.advantage_eps, "ddof": learner.advantage_ddof} if name == "grpo" else {}
  np.testing.assert_array_equal(result.advantages, compute_advantages(jnp.asarray(x.rewards), 4, name, **options))
  assert result.critic_targets is None and not learner.algorithm.needs_critic


def test_the_unlikeliness_reward_shapes_the_estimators_input():
  x = inputs(1)
  learner = LearnerConfig(beta_rank=0.5)
  likelihood = mean_token_logp(x.sampler_logp, x.response_mask)
  shaped = np.asarray(unlikeliness_rewards(x.rewards.reshape(-1, 4), x.correct.reshape(-1, 4),
                                           likelihood.reshape(-1, 4), beta_rank=0.5)).reshape(-1)
  assert not np.array_equal(shaped, x.rewards)  # the case shapes something
  np.testing.assert_array_equal(learner.algorithm.shaped_rewards(x, 4, learner), shaped)
  np.testing.assert_allclose(learner.algorithm.advantages(x, 4, learner).advantages,
                             compute_advantages(jnp.asarray(shaped), 4, "grpo", eps=learner.advantage_eps,
                                                ddof=learner.advantage_ddof))


def test_a_new_estimator_is_one_registered_entry():
  @dataclasses.dataclass(frozen=True)
  class Centered(A.Algorithm):
    def estimate(self, rewards, inputs, n, learner, critic):
      grouped = jnp.asarray(rewards).reshape(-1, n)
      return A.StepAdvantages((grouped - grouped.mean(axis=1, keepdims=True)).reshape(-1))

  entry = A.register_algorithm(Centered("centered_for_test"))
  try:
    learner = LearnerConfig(advantage="centered_for_test")
    assert learner.algorithm is entry
    x = inputs(2)
    np.testing.assert_allclose(learner.algorithm.advantages(x, 4, learner).advantages,
                               compute_advantages(jnp.asarray(x.rewards), 4, "drgrpo"))
    with pytest.raises(ValueError, match="registered already"):
      A.register_algorithm(Centered("centered_for_test"))
  finally:
    del A.ALGORITHMS["centered_for_test"]
  with pytest.raises(ValueError, match=r"learner\.advantage='centered_for_test' is not one of"):
    LearnerConfig(advantage="centered_for_test")


def test_rejection_is_refused_by_what_the_entry_says_not_by_its_name():
  """``learner.rollout_correction.rejection`` is refused for an entry whose advantages would have to
  be made over the kept tokens only (``takes_rejection=False``: PPO's GAE), whatever its name."""
  assert [name for name, entry in A.ALGORITHMS.items() if not entry.takes_rejection] == ["gae"]
  rejection = {"rejection": "token_k3", "rejection_bounds": "1"}

  @dataclasses.dataclass(frozen=True)
  class KeptTokensOnly(A.Algorithm):
    takes_rejection: bool = False

  A.register_algorithm(KeptTokensOnly("kept_tokens_only_for_test"))
  try:
    with pytest.raises(ValueError, match=r"rejection='token_k3' with learner\.advantage=kept_tokens_only_for_test"):
      LearnerConfig(advantage="kept_tokens_only_for_test", rollout_correction=rejection)
  finally:
    del A.ALGORITHMS["kept_tokens_only_for_test"]
  assert LearnerConfig(advantage="rloo", rollout_correction=rejection).rollout_correction.rejection == "token_k3"
