"""The optimizer of the learner and of the critic: one config (:class:`OptimizerConfig`, nested as
``learner.optim`` and ``critic.optim``), AdamW with a learning-rate schedule and global-norm
clipping (optax), its moments in the parameters' dtype or in float32, and the layout of its state
on a mesh."""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from rft_jax.rl.checks import choice, finite_numbers, positive

SCHEDULES = ("constant", "warmup_cosine")
MOMENT_DTYPES = ("auto", "float32")


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
    moment_dtype: the dtype of Adam's two moments: ``auto``, the parameters' (float32
      parameters: float32 moments; ``model.param_dtype: bfloat16``: bfloat16 moments, half the
      optimizer's bytes, but a second moment of 8 significant bits), or ``float32`` (with
      bfloat16 parameters: float32 moments, the update computed in float32 and rounded to
      bfloat16 only when added to the parameters, the micro-batches' gradients summed in
      float32; twice ``auto``'s optimizer bytes and a float32 gradient sum).
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
  moment_dtype: str = "auto"

  def check(self, prefix: str) -> None:
    """Raises ``ValueError`` naming ``prefix.<field>`` for a value out of its range."""
    if not 0 < self.lr <= 1:  # also NaN; 1e39 (accepted before) turned every parameter to inf
      raise ValueError(f"{prefix}.lr must be a finite number in (0, 1], got {self.lr!r}")
    finite_numbers(prefix, self)
    choice(f"{prefix}.schedule", self.schedule, SCHEDULES)
    choice(f"{prefix}.moment_dtype", self.moment_dtype, MOMENT_DTYPES)
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


def moment_dtype(config: OptimizerConfig):
  """The dtype ``config.moment_dtype`` names, or None for ``auto`` (the parameters')."""
  return None if config.moment_dtype == "auto" else jnp.dtype(config.moment_dtype)


def make_optimizer(config: OptimizerConfig) -> tuple[optax.GradientTransformation, optax.Schedule]:
  """AdamW (betas b1, b2, epsilon, decoupled weight decay) with optional global-norm clipping;
  its moments in ``config.moment_dtype`` (:func:`moments_in`)."""
  if config.schedule == "constant":
    schedule = optax.constant_schedule(config.lr)
  elif config.total_steps is None:
    raise ValueError("optim.total_steps is needed for schedule warmup_cosine outside a run (a run sets "
                     "it from its steps)")
  else:
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, config.lr, max(config.warmup_steps, 1), max(config.total_steps, config.warmup_steps + 1))
  mu_dtype = moment_dtype(config)
  adamw = optax.adamw(schedule, b1=config.b1, b2=config.b2, eps=config.adam_eps,
                      weight_decay=config.weight_decay, mu_dtype=mu_dtype)
  if mu_dtype is not None:
    adamw = moments_in(adamw, mu_dtype)
  if config.max_grad_norm is None:
    return adamw, schedule
  return optax.chain(optax.clip_by_global_norm(config.max_grad_norm), adamw), schedule


def moments_in(transform: optax.GradientTransformation, dtype) -> optax.GradientTransformation:
  """``transform`` (optax's AdamW) computed in ``dtype``: its ``init`` sees the parameters cast to
  ``dtype`` (only their shapes and dtypes are read; the cast is dead code), so the parameter-shaped
  leaves of its state are created in ``dtype`` (Adam's first moment then keeps ``mu_dtype``, its
  second the dtype it was created in: optax casts the updated one like the old); its ``update``
  takes the gradients cast to ``dtype`` (else the new gradient's share of each moment,
  ``(1 - b) g`` and ``(1 - b) g^2``, would be rounded to bfloat16 before the float32 sum). The
  updates are then in ``dtype``, and ``optax.apply_updates`` adds them to the parameters in it and
  rounds the sum to the parameters' dtype."""
  return optax.GradientTransformation(
      lambda params: transform.init(optax.tree.cast(params, dtype)),
      lambda updates, state, params=None: transform.update(optax.tree.cast(updates, dtype), state,
                                                           params))


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
