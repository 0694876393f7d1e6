"""The optimizer of the learner and of the critic: one config (:class:`OptimizerConfig`, nested as
``learner.optim`` and ``critic.optim``), AdamW with a learning-rate schedule and global-norm
clipping (optax), and the layout of its state on a mesh."""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import jax
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from rft_jax.rl.checks import choice, finite_numbers, positive

SCHEDULES = ("constant", "warmup_cosine")


@dataclasses.dataclass
class OptimizerConfig:
  """AdamW with a learning-rate schedule (``learner.optim``, ``critic.optim``).

  Attributes:
    lr: learning rate eta, in (0, 1].
    schedule: ``constant`` or ``warmup_cosine`` (linear warm-up from 0 over ``warmup_steps``, then
      cosine decay to 0 at ``total_steps``).
    warmup_steps: optimizer updates of the warm-up.
    total_steps: optimizer updates of the cosine decay; None: in a run with a decaying schedule,
      the run's updates (``steps`` x the updates of a step: ``learner.mini_batches`` x
      ``learner.ppo_epochs`` for the policy, 1 for the critic). A constant schedule ignores it.
    weight_decay: AdamW's decoupled weight decay.
    b1, b2: Adam's betas, in [0, 1).
    adam_eps: Adam's epsilon (a larger one stops Adam from moving parameters whose gradients are
      only noise by a full step of size lr).
    max_grad_norm: global-norm gradient clipping (None: off).
  """

  lr: float = 1e-6
  schedule: str = "constant"
  warmup_steps: int = 0
  total_steps: Optional[int] = None
  weight_decay: float = 0.0
  b1: float = 0.9
  b2: float = 0.999
  adam_eps: float = 1e-8
  max_grad_norm: Optional[float] = 1.0

  def check(self, prefix: str) -> None:
    """Raises ``ValueError`` naming ``prefix.<field>`` for a value out of its range."""
    if not 0 < self.lr <= 1:  # also NaN; 1e39 (accepted before) turned every parameter to inf
      raise ValueError(f"{prefix}.lr must be a finite number in (0, 1], got {self.lr!r}")
    finite_numbers(prefix, self)
    choice(f"{prefix}.schedule", self.schedule, SCHEDULES)
    positive(f"{prefix}.adam_eps", self.adam_eps)
    for name in ("warmup_steps", "weight_decay"):
      positive(f"{prefix}.{name}", getattr(self, name), allow_zero=True)
    for name in ("total_steps", "max_grad_norm"):
      if getattr(self, name) is not None:
        positive(f"{prefix}.{name}", getattr(self, name))
    for name in ("b1", "b2"):
      if not 0 <= getattr(self, name) < 1:
        raise ValueError(f"{prefix}.{name} must be in [0, 1), got {getattr(self, name)!r}")


def optimizer_config(value, prefix: str) -> OptimizerConfig:
  """``value`` (an :class:`OptimizerConfig` or a dict of its fields) checked as ``prefix``."""
  optim = OptimizerConfig(**value) if isinstance(value, dict) else value
  optim.check(prefix)
  return optim


def make_optimizer(config: OptimizerConfig) -> tuple[optax.GradientTransformation, optax.Schedule]:
  """AdamW (betas b1, b2, epsilon, decoupled weight decay) with optional global-norm clipping."""
  if config.schedule == "constant":
    schedule = optax.constant_schedule(config.lr)
  elif config.total_steps is None:
    raise ValueError("optim.total_steps is needed for schedule warmup_cosine outside a run (a run sets "
                     "it from its steps)")
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
