"""The policy's surrogate losses, a registry selected by ``learner.objective``: PPO's clipped
surrogate (``rft_jax.rl.losses``) and GSPO's sequence-level one (``gspo.py``); the registry and its
entries in ``registry.py``."""

from rft_jax.rl.objectives.registry import OBJECTIVES
from rft_jax.rl.objectives.registry import Objective
from rft_jax.rl.objectives.registry import objective
from rft_jax.rl.objectives.registry import register_objective

__all__ = ["OBJECTIVES", "Objective", "objective", "register_objective"]
