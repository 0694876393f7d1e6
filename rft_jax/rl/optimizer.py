"""The learner's optimizer: AdamW with a learning-rate schedule and global-norm clipping (optax)."""

from __future__ import annotations

import optax

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
