"""Skipping a train step whose numbers are not finite.

A NaN in a loaded weight, or an absurd learning rate, turns the parameters to NaN / inf in one
update, and every later step inherits them. The learner's compiled step checks its losses,
gradient norms and updated parameters and, if any is not finite, returns the state it was given.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp


def all_finite(tree: Any, scalars: tuple[jax.Array, ...] | list[jax.Array] = ()) -> jax.Array:
  """Whether every scalar and every entry of every floating-point leaf of ``tree`` is finite
  (a bool scalar; integer leaves are finite by construction)."""
  finite = jnp.all(jnp.isfinite(jnp.stack(scalars))) if len(scalars) else jnp.bool_(True)
  for leaf in jax.tree.leaves(tree):
    if jnp.issubdtype(leaf.dtype, jnp.inexact):
      finite = finite & jnp.all(jnp.isfinite(leaf))
  return finite


def keep_if_finite(new: Any, start: Any, scalars: list[jax.Array]) -> tuple[Any, jax.Array]:
  """``new`` with its step counted, if every scalar (losses, gradient norms) and every updated
  parameter is finite; else ``start``, unchanged: parameters, optimizer state and step counter
  (a skipped step is not a step done).

  Args:
    new: the train state after the step's updates (``params``, ``opt_state``, ``step`` fields;
      ``step`` not yet advanced).
    start: the train state the step was given.
    scalars: the step's losses and gradient norms (0-d arrays).

  Returns:
    The state, selected inside the compiled step (no host round trip), and
    ``nonfinite_skipped``: float32 1.0 for a skipped step, 0.0 otherwise.
  """
  finite = all_finite(new.params, scalars)
  params, opt_state = jax.tree.map(lambda n, s: jnp.where(finite, n, s),
                                   (new.params, new.opt_state), (start.params, start.opt_state))
  state = new.replace(params=params, opt_state=opt_state,
                      step=start.step + finite.astype(start.step.dtype))
  return state, 1.0 - finite.astype(jnp.float32)
