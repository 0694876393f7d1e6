"""A step's advantages, by algorithm (``learner.advantage``, the registry of ``algorithms.py``):
the group estimators of GRPO, Dr. GRPO and RLOO (``group.py``), the unlikeliness reward's shaping
(``unlikeliness.py``), and PPO's GAE (``gae.py``) with its critic (``critic.py``)."""

from rft_jax.rl.advantages.group import ADVANTAGE_ESTIMATORS
from rft_jax.rl.advantages.group import compute_advantages

__all__ = ["ADVANTAGE_ESTIMATORS", "compute_advantages"]
