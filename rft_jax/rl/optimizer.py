"""The learner's (and the critic's) optimizer: AdamW with a learning-rate schedule and global-norm
clipping (optax), and the layout of its state on a mesh."""

from __future__ import annotations

from typing import Any

import jax
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from rft_jax.rl.config import LearnerConfig


def make_optimizer(config: LearnerConfig) -> tuple[optax.GradientTransformation, optax.Schedule]:
  """AdamW (betas b1, b2, epsilon, decoupled weight decay) with optional global-norm clipping."""
  if config.schedule == "constant":
    schedule = optax.constant_schedule(config.lr)
  else:
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, config.lr, max(config.warmup_steps, 1), max(config.total_steps, config.warmup_steps + 1))
  adamw = optax.adamw(schedule, b1=config.b1, b2=config.b2, eps=config.adam_eps,
                      weight_decay=config.weight_decay)
  if config.max_grad_norm is None:
    return adamw, schedule
  return optax.chain(optax.clip_by_global_norm(config.max_grad_norm), adamw), schedule


def optimizer_shardings(optimizer: optax.GradientTransformation, params: Any, mesh: Mesh):
  """``(parameter shardings, optimizer-state shardings, replicated)`` of a train state on ``mesh``,
  from its parameters (arrays or abstract ``jax.ShapeDtypeStruct`` with shardings).

  Every copy of the parameter tree inside the optimizer state (AdamW's two moments) is sharded
  exactly like the parameters (``optax.tree_map_params``); left to the compiler, they came back
  replicated: two float32 copies of the model on every device, 57 GB at 7B. Parameters not laid
  out on the mesh, and counters, are replicated.
  """
  replicated = NamedSharding(mesh, PartitionSpec())
  param_shardings = jax.tree.map(
      lambda x: x.sharding if isinstance(x.sharding, NamedSharding) else replicated, params)
  opt_shardings = optax.tree_map_params(
      optimizer, lambda _, sharding: sharding, jax.eval_shape(optimizer.init, params),
      param_shardings, transform_non_params=lambda _: replicated)
  return param_shardings, opt_shardings, replicated
