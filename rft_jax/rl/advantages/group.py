r"""Group-relative advantages: one scalar per completion, broadcast over its tokens.

Rewards come as ``[G, n]``: ``G`` prompts (groups) with ``n`` completions each.

* ``grpo``: :math:`A_i = (R_i - \bar R_g) / (\mathrm{std}_g + \epsilon)`, with the
  unbiased (``ddof=1``) standard deviation as the reference implementations use;
  ``ddof=0`` is available.
* ``drgrpo`` (Dr.GRPO): :math:`A_i = R_i - \bar R_g` (no division by the std).
* ``rloo``: :math:`A_i = R_i - \frac{1}{n-1}\sum_{j \ne i} R_j
  = \frac{n}{n-1}(R_i - \bar R_g)`.

Estimators are registered in :data:`ADVANTAGE_ESTIMATORS`; configs are validated
against that registry.
"""

from __future__ import annotations

from typing import Callable

import jax.numpy as jnp
from jaxtyping import Array, Float


def grpo_advantages(rewards: Float[Array, "G n"], *, eps: float = 1e-6, ddof: int = 1) -> Float[Array, "G n"]:
  """Group z-score :math:`(R - \\bar R_g) / (\\mathrm{std}_g + \\epsilon)`."""
  if rewards.shape[-1] <= ddof:
    raise ValueError(f"grpo advantages need more than {ddof} completions per group, got {rewards.shape[-1]}")
  centred = rewards - jnp.mean(rewards, axis=-1, keepdims=True)
  return centred / (jnp.std(rewards, axis=-1, keepdims=True, ddof=ddof) + eps)


def drgrpo_advantages(rewards: Float[Array, "G n"], **_) -> Float[Array, "G n"]:
  """Dr.GRPO: :math:`R - \\bar R_g`."""
  return rewards - jnp.mean(rewards, axis=-1, keepdims=True)


def rloo_advantages(rewards: Float[Array, "G n"], **_) -> Float[Array, "G n"]:
  """Leave-one-out baseline: :math:`R_i - \\mathrm{mean}_{j \\ne i} R_j`."""
  n = rewards.shape[-1]
  if n < 2:
    raise ValueError(f"rloo advantages need at least 2 completions per group, got {n}")
  return n / (n - 1) * drgrpo_advantages(rewards)


ADVANTAGE_ESTIMATORS: dict[str, Callable[..., Array]] = {
    "grpo": grpo_advantages,
    "drgrpo": drgrpo_advantages,
    "rloo": rloo_advantages,
}


def compute_advantages(rewards: Float[Array, "N"], group_size: int, estimator: str = "grpo", **kwargs) -> Float[Array, "N"]:
  """Advantages of ``N = G * group_size`` completions ordered group by group."""
  if estimator not in ADVANTAGE_ESTIMATORS:
    raise ValueError(f"unknown advantage estimator {estimator!r}; choose from {sorted(ADVANTAGE_ESTIMATORS)}")
  if rewards.shape[0] % group_size:
    raise ValueError(f"{rewards.shape[0]} rewards do not split into groups of {group_size}")
  grouped = rewards.reshape(-1, group_size).astype(jnp.float32)
  return ADVANTAGE_ESTIMATORS[estimator](grouped, **kwargs).reshape(-1)

