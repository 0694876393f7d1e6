r"""Expert parallelism: each device of the mesh's ``model`` axis computes its own experts' rows.

The stacked experts ``[E, ...]`` are laid out over ``model`` (:data:`rft_jax.parallel.TP_RULES`:
``experts`` -> ``model``), ``E / model`` whole experts a device, while the tokens of a layer are
the same on every device of a ``model`` group (after attention's reduction over the heads), laid
out over ``data`` by rows. Left to the compiler, a product that picks an expert by a
data-dependent index (the tiles' loop, megablox's kernels) gathers every expert onto every
device, layer by layer. :func:`expert_parallel` instead runs the product under
:func:`jax.shard_map`: device ``j`` of the ``model`` axis keeps the assignments routed to its
experts ``[j E / model, (j + 1) E / model)``, renumbered from 0; the others get the group
number ``E / model``, past its experts, which no tile or kernel group covers (they are sorted
last and contribute zero rows), so the device computes only its own experts' rows; a ``psum``
over ``model`` adds the devices' partial sums (each token's ``k`` experts live on at most
``k`` devices). The communication is that ``[N, D]`` sum per layer, what a tensor-parallel MLP
also reduces; the work per device is its share of the assignments. Derivatives pass through
(the transpose of the ``psum`` broadcasts the cotangent, the tokens' cotangent is summed over
``model``).
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec as P
from jaxtyping import Array, Float, Int

ExpertProduct = Callable[..., Float[Array, "N D"]]


def is_expert_parallel(mesh: Mesh | None, num_experts: int) -> bool:
  """Whether ``mesh`` splits ``num_experts`` experts over its ``model`` axis (more than one
  device there, dividing the experts evenly)."""
  if mesh is None or "model" not in mesh.shape:
    return False
  size = mesh.shape["model"]
  return size > 1 and num_experts % size == 0


def local_assignments(expert_ids: Int[Array, "N k"], weights: Float[Array, "N k"], first: Int[Array, ""],
                      local: int) -> tuple[Int[Array, "N k"], Float[Array, "N k"]]:
  """The assignments to experts ``[first, first + local)`` renumbered from 0; every other one
  gets group ``local`` (past the device's experts) and weight 0."""
  ids = expert_ids - first
  mine = (ids >= 0) & (ids < local)
  return jnp.where(mine, ids, local), jnp.where(mine, weights, 0)


def expert_parallel(product: ExpertProduct, x: Float[Array, "N D"], expert_ids: Int[Array, "N k"],
                    weights: Float[Array, "N k"], gate: Float[Array, "E D I"], up: Float[Array, "E D I"],
                    down: Float[Array, "E I D"], *, mesh: Mesh) -> Float[Array, "N D"]:
  """``product`` (the tiles' or megablox's form: assignments to a group past the experts add
  nothing) on each ``model`` device's experts, summed over ``model``; tokens over ``data`` by
  rows where ``data`` divides them."""
  size = mesh.shape["model"]
  local = gate.shape[0] // size
  rows = "data" if x.shape[0] % mesh.shape.get("data", 1) == 0 else None
  tokens, experts = P(rows, None), P("model", None, None)

  def on_device(x, expert_ids, weights, gate, up, down):
    ids, w = local_assignments(expert_ids, weights, jax.lax.axis_index("model") * local, local)
    return jax.lax.psum(product(x, ids, w, gate, up, down), "model")

  # check_vma=False: with the replication checks on (jax 0.10.2) the tokens' gradient through the
  # tiles came out wrong (tests/test_expert_tiles.py compares it with one device's).
  return jax.shard_map(on_device, mesh=mesh, in_specs=(tokens, tokens, tokens, experts, experts, experts),
                       out_specs=tokens, check_vma=False)(x, expert_ids, weights, gate, up, down)
