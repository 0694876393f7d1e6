"""Rollouts of more than one turn: a trajectory of the model's turns and an environment's replies,
decoded with the history kept in its KV cache (:mod:`~rft_jax.rollout.multi_turn`), tokenized once
(:mod:`~rft_jax.rollout.conversation`), and given to the learner as one row whose environment
tokens are read but not trained on (:mod:`~rft_jax.rollout.trajectory`)."""

from rft_jax.rollout.config import RolloutConfig
from rft_jax.rollout.multi_turn import Problem, run_trajectories
from rft_jax.rollout.trajectory import Trajectory, trajectory_rollouts

__all__ = ["Problem", "RolloutConfig", "Trajectory", "run_trajectories", "trajectory_rollouts"]
