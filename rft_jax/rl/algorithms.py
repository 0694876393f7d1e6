r"""The algorithms a run can train with, keyed by ``learner.advantage``: how a step's advantages are
made and what the run needs for them.

* Group estimators (``grpo``, ``drgrpo``, ``rloo``; :data:`rft_jax.rl.advantages.ADVANTAGE_ESTIMATORS`):
  one advantage per completion from its group's rewards (Shao et al. 2024, "DeepSeekMath"; Liu et
  al. 2025, "Understanding R1-Zero-Like Training"; Ahmadian et al. 2024, "Back to Basics").
* ``gae``: PPO (Schulman et al. 2017) with a learned critic (:mod:`rft_jax.rl.critic`): token-level
  GAE advantages (Schulman et al. 2016) whitened over the batch (:mod:`rft_jax.rl.gae`).

The loop, the checkpoints, the preflight checks and ``rft-jax plan`` ask the entry
(:func:`algorithm`), e.g. whether it needs a critic, rather than test the name.
"""

from __future__ import annotations

import dataclasses

from rft_jax.rl.advantages import ADVANTAGE_ESTIMATORS


@dataclasses.dataclass(frozen=True)
class Algorithm:
  """An entry of :data:`ALGORITHMS`.

  Attributes:
    name: its ``learner.advantage`` value.
    needs_critic: the run trains a critic beside the policy (its parameters, AdamW state and
      step are part of the train state, its checkpoints and its memory).
  """

  name: str
  needs_critic: bool = False


ALGORITHMS: dict[str, Algorithm] = {name: Algorithm(name) for name in ADVANTAGE_ESTIMATORS}
ALGORITHMS["gae"] = Algorithm("gae", needs_critic=True)


def algorithm(advantage: str) -> Algorithm:
  """The entry of ``learner.advantage``; ``ValueError`` naming the key if there is none."""
  if advantage not in ALGORITHMS:
    raise ValueError(f"learner.advantage={advantage!r} is not one of {sorted(ALGORITHMS)}")
  return ALGORITHMS[advantage]
