"""Reinforcement learning on rollouts: advantages, policy losses and aggregation (pure functions),
the registry of token methods (``token_methods/``), and the compiled train steps of the learner
(``learner/``) and of PPO's critic (``advantages/critic.py``). ``rl/`` shares only the model with
``sampling/``.
"""

from rft_jax.rl.advantages import ADVANTAGE_ESTIMATORS
from rft_jax.rl.advantages import compute_advantages
from rft_jax.rl.losses import AGGREGATIONS
from rft_jax.rl.losses import KL_ESTIMATORS
from rft_jax.rl.losses import LossNormaliser
from rft_jax.rl.losses import PolicyLossTerms
from rft_jax.rl.losses import aggregate_loss
from rft_jax.rl.losses import kl_penalty
from rft_jax.rl.losses import loss_normaliser
from rft_jax.rl.losses import ppo_clipped_loss

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "AGGREGATIONS",
    "KL_ESTIMATORS",
    "LossNormaliser",
    "PolicyLossTerms",
    "aggregate_loss",
    "compute_advantages",
    "kl_penalty",
    "loss_normaliser",
    "ppo_clipped_loss",
]
