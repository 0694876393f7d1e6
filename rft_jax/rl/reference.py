r"""The reference policy of the KL penalty: frozen parameters beside the trained ones.

With :math:`\beta` = ``learner.kl_coef`` > 0 the loss adds
:math:`\beta\, \widehat{\mathrm{KL}}(\pi_\theta \| \pi_{ref})`, estimated per completion
token from :math:`\log \pi_{ref}` of the sampled token (``rft_jax.rl.losses.kl_penalty``;
TRL's ``beta`` with ``k3``). The reference is the starting policy, or another checkpoint of
the same architecture. Its parameters are copied once, laid out on the mesh exactly like the
policy's (each device holds its shard of one more copy of the model), optionally stored in
bfloat16 (half the bytes of a float32 copy), and never updated. They are not part of the
train state, so not checkpointed: a run re-derives them from the same source at start.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from rft_jax.models.config import DTYPES
from rft_jax.parallel import global_array, with_shardings



def reference_source_params(source: Any) -> Any:
  """The parameter tree of ``source``: an ``nnx.Module`` (its ``nnx.Param`` state) or a tree."""
  return nnx.state(source, nnx.Param) if isinstance(source, nnx.Module) else source


def check_matches_policy(reference: Any, policy: Any) -> None:
  """Raises ``ValueError`` unless ``reference`` has the policy's tree structure and shapes."""
  if jax.tree.structure(reference) != jax.tree.structure(policy):
    raise ValueError("the reference policy's parameters do not have the policy's structure "
                     "(a different architecture?)")
  for path, r, p in zip(jax.tree_util.tree_flatten_with_path(policy)[0],
                        jax.tree.leaves(reference), jax.tree.leaves(policy)):
    if r.shape != p.shape:
      raise ValueError(f"reference parameter {jax.tree_util.keystr(path[0])} has shape {r.shape}, "
                       f"the policy's {p.shape}")


def frozen_copy(params: Any, shardings: Any = None, dtype: str | None = None) -> Any:
  """A copy of ``params`` in ``dtype`` (None: unchanged), laid out with ``shardings``.

  Always new buffers, never aliases of ``params``: the train state donates the policy's arrays
  at every step, and the reference must outlive them.

  Args:
    params: parameter tree (arrays, on the mesh or on the host).
    shardings: matching tree of shardings (the policy parameters' layout on the mesh), or None
      (no mesh: placed like ``params``, so that a step sees the reference and the state
      committed alike and compiles once).
    dtype: ``None``, ``"float32"`` or ``"bfloat16"``.
  """
  cast = DTYPES.get(dtype)

  def copy(tree):
    return jax.tree.map(lambda x: jnp.array(x, dtype=cast or x.dtype, copy=True), tree)

  if shardings is None:
    return copy(params)
  placed = jax.tree.map(global_array, params, shardings)
  return jax.jit(copy, out_shardings=shardings)(placed)


def abstract_reference(params: Any, shardings: Any = None, dtype: str | None = None) -> Any:
  """The reference as ``jax.ShapeDtypeStruct`` leaves, with ``shardings`` when given (its
  memory, for ``rft-jax plan``)."""
  cast = DTYPES.get(dtype)
  shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, cast or x.dtype), params)
  return shapes if shardings is None else with_shardings(shapes, shardings)
