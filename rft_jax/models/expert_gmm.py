r"""The routed experts' products on TPUs where they are differentiated: megablox's grouped matmul.

The TPU compiler has a grouped product for :func:`jax.lax.ragged_dot`'s forward, but its
derivative with respect to the experts' weights (a product whose contracted rows are grouped)
runs over every expert, many times the rows' work at Qwen3-30B-A3B's 128 experts, top-8
(compiled deviceless for v5p, figures:
``docs/results/moe.md#the-learners-expert-products-on-a-gpu-and-a-tpu-deviceless-2026-11-29``).
jax ships the Pallas TPU kernels of megablox (``jax.experimental.pallas.ops.tpu.megablox``):
``gmm`` (grouped rows times their group's matrix) with a ``custom_vjp`` whose weight gradient is
``tgmm`` (each group's rows transposed times their cotangents), both over the rows each group
has. :func:`gmm_experts` is :func:`rft_jax.models.moe.grouped_experts`'s sorted-rows form with
``gmm`` for the three products; ``interpret=True`` runs the kernels on any backend (the CPU
tests).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from rft_jax.models.expert_tiles import in_assignment_order, sort_assignments

ROW_TILE = 128  # rows per kernel tile; the sorted rows are padded to a multiple of it


def _tile(width: int, most: int = 128) -> int:
  """The kernel's tile of a ``width``-wide axis: the largest power of two up to ``most`` that
  divides it (128 for Qwen3-MoE's 2,048 / 768)."""
  return math.gcd(width, most)


def gmm_experts(x: Float[Array, "N D"], expert_ids: Int[Array, "N k"], weights: Float[Array, "N k"],
                gate: Float[Array, "E D I"], up: Float[Array, "E D I"], down: Float[Array, "E I D"], *,
                interpret: bool = False, row_tile: int = ROW_TILE) -> Float[Array, "N D"]:
  r""":math:`\sum_j w_j E_{e_j}(x)` for every token, dropless, each projection one ``gmm`` over the
  assignments sorted by expert (padded with zero rows to a multiple of ``row_tile``, which no
  group covers and which are dropped after the last product). An id of ``E`` or more is no
  expert's: it adds nothing (:mod:`rft_jax.models.expert_parallel`'s other devices' experts).
  Products in ``x.dtype``; differentiable (megablox's ``custom_vjp``)."""
  from jax.experimental.pallas.ops.tpu.megablox import gmm  # Pallas TPU: imported when used

  n, k = expert_ids.shape
  num_experts, d, _ = gate.shape
  a = n * k
  dtype = x.dtype
  order, rows, sizes = sort_assignments(x, expert_ids, num_experts, pad=-a % row_tile)  # rows [A + pad, D]
  grouped = jnp.sum(sizes)  # A, or fewer: ids past the experts (expert parallelism) are no group's

  def product(lhs, rhs):
    tiling = (row_tile, _tile(lhs.shape[1]), _tile(rhs.shape[2]))
    # Rows of no group (padding; ids past the experts, sorted last) are left unwritten by the
    # kernel, forward and backward: select zeros there on both sides (a select, not a product,
    # so the unwritten values reach nothing, not even as 0 x NaN).
    valid = jnp.arange(lhs.shape[0])[:, None] < grouped
    out = gmm(jnp.where(valid, lhs, 0), rhs.astype(dtype), sizes, dtype, tiling, interpret=interpret)
    return jnp.where(valid, out, 0)

  h = jax.nn.silu(product(rows, gate)) * product(rows, up)
  y = in_assignment_order(product(h, down)[:a], order)  # [A, D]
  return jnp.einsum("nkd,nk->nd", y.reshape(n, k, d), weights.astype(dtype))
