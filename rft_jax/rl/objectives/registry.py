r"""The policy objectives a learner can optimise, keyed by ``learner.objective``: the per-token
surrogate loss of the step's updates, before the entropy mask, the entropy methods and the
aggregation (``rft_jax.rl.losses``).

* ``ppo``: PPO's clipped surrogate on each token's ratio (Schulman et al. 2017), with DAPO's
  clip-higher (Yu et al. 2025, ``eps_low != eps_high``) and the dual clip (Ye et al. 2020);
  :func:`rft_jax.rl.losses.ppo_clipped_loss`. What GRPO (Shao et al. 2024) and the paper use.
* ``gspo``: the clipped surrogate on a sequence-level ratio (Zheng et al. 2025);
  :mod:`rft_jax.rl.objectives.gspo`.

Each entry says its clip defaults (``learner.eps_low`` / ``eps_high`` left unset take them) and
the peers' keys, and the learner asks the entry for the loss instead of testing the name. Add
one with :func:`register_objective`.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from jaxtyping import Array, Float, Int

from rft_jax.rl.objectives.gspo import GSPO_EPS_HIGH, GSPO_EPS_LOW, gspo_loss
from rft_jax.rl.losses import PolicyLossTerms, ppo_clipped_loss
from rft_jax.rl.named_registry import Registry


@dataclasses.dataclass(frozen=True)
class Objective:
  """An entry of :data:`OBJECTIVES`.

  Attributes:
    name: its ``learner.objective`` value.
    title: how reports name it.
    eps_low / eps_high: the clip range it takes when ``learner.eps_low`` / ``eps_high`` are unset.
    takes_dual_clip: whether ``learner.dual_clip`` applies to it.
    replaceable: whether the entropy methods that bring a loss of their own (Clip-Cov, KL-Cov:
      ``TokenMethod.replaces_loss``) may replace it: theirs are PPO's per-token surrogate.
    verl / trl: the peers' settings of the same objective.
    per_token_loss: ``(logp, old_logp, advantages, mask, *, eps_low, eps_high, dual_clip,
      sequence_ids) -> PolicyLossTerms``, all ``[B, T]`` (``mask``: the tokens in the loss;
      ``sequence_ids``: the sequences of packed rows, None for rows).
  """

  name: str
  title: str
  eps_low: float
  eps_high: float
  takes_dual_clip: bool
  replaceable: bool
  verl: str
  trl: str
  per_token_loss: Callable[..., PolicyLossTerms]


OBJECTIVES: Registry[Objective] = Registry("learner.objective", "objective")


def register_objective(entry: Objective) -> Objective:
  """Adds ``entry`` to :data:`OBJECTIVES` (a name taken by another entry is an error)."""
  return OBJECTIVES.add(entry.name, entry)


def objective(name: str) -> Objective:
  """The entry of ``learner.objective``; ``ValueError`` naming the key if there is none."""
  return OBJECTIVES.entry(name)


def _ppo(logp: Float[Array, "B T"], old_logp: Float[Array, "B T"], advantages: Float[Array, "B T"],
         mask: Array, *, eps_low: float, eps_high: float, dual_clip: float | None,
         sequence_ids: Int[Array, "B T"] | None = None) -> PolicyLossTerms:
  del mask, sequence_ids  # per token
  return ppo_clipped_loss(logp, old_logp, advantages, eps_low=eps_low, eps_high=eps_high,
                          dual_clip=dual_clip)


def _gspo(logp: Float[Array, "B T"], old_logp: Float[Array, "B T"], advantages: Float[Array, "B T"],
          mask: Array, *, eps_low: float, eps_high: float, dual_clip: float | None,
          sequence_ids: Int[Array, "B T"] | None = None) -> PolicyLossTerms:
  del dual_clip  # refused by the config
  return gspo_loss(logp, old_logp, advantages, mask, eps_low=eps_low, eps_high=eps_high,
                   sequence_ids=sequence_ids)


register_objective(Objective(
    "ppo", "PPO clipped surrogate (per-token ratio)", eps_low=0.2, eps_high=0.2,
    takes_dual_clip=True, replaceable=True, verl="actor.policy_loss.loss_mode=vanilla",
    trl='importance_sampling_level="token"', per_token_loss=_ppo))
register_objective(Objective(
    "gspo", "GSPO (sequence-level ratio)", eps_low=GSPO_EPS_LOW, eps_high=GSPO_EPS_HIGH,
    takes_dual_clip=False, replaceable=False, verl="actor.policy_loss.loss_mode=gspo",
    trl='importance_sampling_level="sequence"', per_token_loss=_gspo))
