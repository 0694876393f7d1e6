r"""The routed experts' products as a loop over tiles of each used expert's rows.

Neither XLA's CPU nor its GPU backend (jax 0.10) has a grouped matrix product: both expand
:func:`jax.lax.ragged_dot` over every expert, the GPU one by building a ``[N k, E D]`` masked
copy of the rows (32 GiB for 65,536 assignments of Qwen3-30B-A3B's 128 experts of 2,048 x 768,
``E`` times the products' work), the CPU one as ``N k E`` rows' products. Here the assignments are
sorted by expert, as for the ragged product, and cut into tiles of ``tile`` rows that each
belong to one expert (an expert with ``s_e`` rows has :math:`\lceil s_e / \mathrm{tile}\rceil`
tiles, the last one partly masked); a loop runs the tiles,

.. math:: T = \sum_{e:\, s_e > 0} \lceil s_e / \mathrm{tile} \rceil
   \le \lceil N k / \mathrm{tile} \rceil + \min(E, N k),

each the expert's SwiGLU on ``[tile, D]`` rows read in place, scaled by the rows' routing
weights. A step thus reads only the experts it uses, once per tile, and computes at most
``N k + min(E, N k) tile`` rows: on CPU one layer's experts run many times faster than with
the ragged product, and so does the MoE decode step (figures:
``docs/results/moe.md#one-layers-expert-products-on-cpu`` and
``docs/results/moe.md#the-cpu-decode-step-beside-a-dense-model-of-the-same-active-parameters``).

Two forms: the loop over the tiles that exist (a trip count of the data's, no reverse-mode
derivative: the sampler's prefill and decode steps), and, ``differentiable``, a map over the
bound :math:`T` above (tiles past the data's are empty and add nothing), each tile
rematerialised in the backward pass, whose gradients are the ragged product's and whose
memory is the rows' (``O(N k (D + I))``), never ``O(N k E)``. :func:`rft_jax.models.moe.
expert_product` says which product runs where.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

MIN_TILE, MAX_TILE = 8, 256


class SortedAssignments(NamedTuple):
  """The ``A = N k`` assignments of tokens to experts sorted by expert, what every expert product
  (the tiles, megablox's kernels, ``ragged_dot``) runs on.

  Attributes:
    order: ``[A]`` sorted position -> assignment (``token * k + j``); stable.
    rows: ``[A + pad, D]`` the assignments' token rows in that order, then ``pad`` zero rows.
    sizes: ``[E]`` each expert's assignments; an id of ``E`` or more is counted nowhere and
      sorted last (:mod:`rft_jax.models.expert_parallel` gives other devices' experts such ids).
  """

  order: Int[Array, "A"]
  rows: Float[Array, "P D"]
  sizes: Int[Array, "E"]


def sort_assignments(x: Float[Array, "N D"], expert_ids: Int[Array, "N k"], num_experts: int,
                     pad: int = 0) -> SortedAssignments:
  """:class:`SortedAssignments` of ``expert_ids`` over ``num_experts`` experts."""
  k = expert_ids.shape[1]
  flat = expert_ids.reshape(-1)
  order = jnp.argsort(flat, stable=True)
  rows = jnp.take(x, order // k, axis=0)
  if pad:
    rows = jnp.pad(rows, ((0, pad), (0, 0)))
  return SortedAssignments(order, rows, jnp.bincount(flat, length=num_experts).astype(jnp.int32))


def in_assignment_order(y: Float[Array, "A D"], order: Int[Array, "A"]) -> Float[Array, "A D"]:
  """Sorted rows ``y`` put back in assignment order (``order``: :class:`SortedAssignments`'s)."""
  return jnp.zeros_like(y).at[order].set(y, unique_indices=True)


def tile_rows(assignments: int, num_experts: int) -> int:
  """Rows per tile: the mean rows per expert, ``N k / E``, rounded up to a power of two and
  clipped to ``[8, 256]`` (measured best within a factor of two at 8 to 4096 tokens, 64 experts
  of ``512 x 256``: small tiles waste no rows on the few tokens of a decode step, large ones make
  fewer, fuller products for a prompt)."""
  mean = max(1, -(-assignments // num_experts))
  return int(min(MAX_TILE, max(MIN_TILE, 1 << (mean - 1).bit_length())))


def tiled_experts(x: Float[Array, "N D"], expert_ids: Int[Array, "N k"],
                  weights: Float[Array, "N k"], gate: Float[Array, "E D I"],
                  up: Float[Array, "E D I"], down: Float[Array, "E I D"],
                  tile: int | None = None, differentiable: bool = False) -> Float[Array, "N D"]:
  r""":math:`\sum_j w_j E_{e_j}(x)` for every token, by a loop over tiles of one expert's rows.

  Args:
    x: ``[N, D]`` tokens; expert_ids, weights: ``[N, k]`` their experts and routing weights.
    gate, up: ``[E, D, I]``; down: ``[E, I, D]`` the stacked experts.
    tile: rows per tile (default :func:`tile_rows`).
    differentiable: the map over every possible tile (reverse-mode differentiable), not the
      loop over the tiles that exist.

  An id of ``E`` or more is no expert's: sorted last and in no tile, it adds nothing
  (:mod:`rft_jax.models.expert_parallel` gives other devices' experts such ids).

  Returns:
    ``[N, D]`` in ``x.dtype``, equal to the ragged form's to rounding (products in ``x.dtype``,
    each assignment scaled by its weight before the sum over ``k``).
  """
  n, k = expert_ids.shape
  num_experts, d, _ = gate.shape
  a = n * k
  tile = tile or tile_rows(a, num_experts)
  dtype = x.dtype
  gate, up, down = (w.astype(dtype) for w in (gate, up, down))
  order, rows, sizes = sort_assignments(x, expert_ids, num_experts, pad=tile)  # rows [A + tile, D]
  scale = jnp.pad(weights.reshape(-1)[order].astype(dtype), (0, tile))  # [A + tile]
  starts = jnp.cumsum(sizes) - sizes
  tiles = (sizes + tile - 1) // tile
  tiles_end = jnp.cumsum(tiles)  # [E], tile t belongs to the first expert whose end exceeds t
  t = jnp.arange(-(-a // tile) + min(num_experts, a), dtype=jnp.int32)
  expert = jnp.minimum(jnp.searchsorted(tiles_end, t, side="right"), num_experts - 1)
  start = starts[expert] + (t - (tiles_end - tiles)[expert]) * tile  # first sorted row
  count = jnp.clip(starts[expert] + sizes[expert] - start, 0, tile)  # its rows in the tile
  lane = jnp.arange(tile)

  def tile_output(e, s, n):
    r = jax.lax.dynamic_slice_in_dim(rows, s, tile)  # [tile, D]
    h = jax.nn.silu(r @ gate[e]) * (r @ up[e])
    w = jnp.where(lane < n, jax.lax.dynamic_slice_in_dim(scale, s, tile), 0)
    return (h @ down[e]) * w[:, None]  # masked rows (the next expert's, or padding) add 0

  if differentiable:
    # Every possible tile; those past the data's have no rows (count 0) and add zeros. The
    # rows a tile covers are its own, so the scatter's sums meet only those zeros.
    ys = jax.lax.map(jax.checkpoint(lambda xs: tile_output(*xs), prevent_cse=False),
                     (expert, start, jnp.where(t < tiles_end[-1], count, 0)))  # [T, tile, D]
    index = jnp.minimum(start[:, None] + lane, a + tile - 1)
    out = jnp.zeros((a + tile, d), dtype).at[index].add(ys)[:a]
  else:
    def one_tile(i, out):
      s = start[i]
      return jax.lax.dynamic_update_slice_in_dim(
          out, jax.lax.dynamic_slice_in_dim(out, s, tile) + tile_output(expert[i], s, count[i]), s, 0)

    out = jax.lax.fori_loop(0, tiles_end[-1], one_tile, jnp.zeros((a + tile, d), dtype))[:a]
  return in_assignment_order(out, order).reshape(n, k, d).sum(axis=1)
