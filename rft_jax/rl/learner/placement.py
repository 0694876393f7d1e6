"""Where the learner's step runs: the layouts of its arguments on the mesh, the compiled step
(:func:`compile_step`), and the token plan placed over the data axis."""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from rft_jax.parallel import global_array, host_array
from rft_jax.rl import token_batches


def data_devices(mesh: Mesh | None, data_axis: str) -> int:
  """How many devices the data axis has (1 without a mesh)."""
  return 1 if mesh is None else mesh.shape[data_axis]


def plan_sharding(mesh: Mesh | None, data_axis: str) -> NamedSharding | None:
  """The layout of a ``[M, n, r, L]`` token plan: packed rows ``r`` over the data axis."""
  if mesh is None:
    return None
  return NamedSharding(mesh, PartitionSpec(None, None, data_axis))


def compile_step(step_fn: Callable, mesh: Mesh | None, state, batch, reference, rows: NamedSharding | None,
                 token_plan: NamedSharding | None):
  """``jax.jit`` of the step ``step_fn(state, batch, reference, stats_from_column, token_index)``
  with explicit shardings when a mesh is given: the state keeps the layout it has (parameters as
  placed by ``rft_jax.parallel``), the reference keeps its own (the parameters'; never donated),
  batch rows are split over the data axis (``rows``) and metrics are replicated. Its fourth
  argument, ``stats_from_column``, is static; its fifth, the token plan, has the layout
  ``token_plan`` (None without ``micro_batch_tokens``)."""
  if mesh is None:
    return jax.jit(step_fn, donate_argnums=0, static_argnums=3)
  state_shardings = jax.tree.map(lambda x: x.sharding, state)
  reference_shardings = jax.tree.map(lambda x: x.sharding, reference)
  batch_shardings = jax.tree.map(lambda _: rows, batch)
  replicated = NamedSharding(mesh, PartitionSpec())
  return jax.jit(step_fn, donate_argnums=0, static_argnums=3,
                 in_shardings=(state_shardings, batch_shardings, reference_shardings, token_plan),
                 out_shardings=(state_shardings, replicated, replicated))


def token_plan(config, attention_mask, mesh: Mesh | None, data_axis: str) -> jax.Array | None:
  """The ``[M, n, r, L]`` int32 token plan of a batch (``rft_jax.rl.token_batches.token_plan``, made
  on the host from its attention mask; ``r`` a multiple of the data-parallel devices), placed on
  the mesh; None without ``learner.micro_batch_tokens``."""
  if config.micro_batch_tokens is None:
    return None
  mask = host_array(attention_mask) if isinstance(attention_mask, jax.Array) else np.asarray(attention_mask)
  index = token_batches.token_plan(mask, micro_batch_tokens=config.micro_batch_tokens,
                                   mini_batches=config.mini_batches, row_multiple=data_devices(mesh, data_axis))
  return jnp.asarray(index) if mesh is None else global_array(index, plan_sharding(mesh, data_axis))


def step_reference(kl_coef: float, reference, held, abstract: Callable[[], Any] | None):
  """The reference parameters a step takes: None unless ``kl_coef > 0``; else ``reference``,
  ``held`` (the learner's), or ``abstract()`` (its abstract one for a lowered step)."""
  if kl_coef <= 0:
    return None
  if reference is None:
    reference = held
  if reference is None and abstract is not None:
    reference = abstract()
  if reference is None:
    raise ValueError("learner.kl_coef > 0 needs reference log-probs: call Learner.init (it copies "
                     "the starting parameters, or the constructor's reference)")
  return reference
