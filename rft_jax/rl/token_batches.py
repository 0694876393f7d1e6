r"""Learner micro-batches by tokens (``learner.micro_batch_tokens``): a batch's rows packed into
full-width rows, several sequences per row.

RL completions are long-tailed: most stop early, a few run to the maximum, and a batch trimmed to
its longest row is mostly padding. Packing puts the real tokens of several rows into one packed
row of the batch's width ``L``: attention stays inside each sequence (segment ids) and RoPE
positions are each sequence's own (they restart per segment), so every token's statistics are
those of its unpacked row.

Why packing rather than rows grouped by length, each micro-batch padded to its own longest row:
the step is one ``jax.jit`` with static shapes, and its micro-batches run under ``lax.scan``, so
they must share one shape. Length groups give micro-batches of different widths: an unrolled
program, and the step's list of widths a static argument, a new compile whenever the lengths of
a step fall differently. Packed micro-batches all have the shape ``[r, L]`` (``L``: the batch's
width, which the loop already rounds to a multiple of 16; ``r = micro_batch_tokens // L``
rounded up to a multiple of the data-parallel devices, so each micro-batch stays spread over
them); a step varies only the number ``n`` of micro-batches it scans over. A run compiles one
program per (width, first completion column, ``n``), ``n`` a small integer.

The plan (host, :func:`token_plan`): the real tokens of row ``b`` are the columns ``[s_b, e_b)``
(a left-padded prompt followed by a right-padded completion). Mini-batch ``m`` holds rows
``m, m + M, ...`` (``rft_jax.rl.batching.split_rows``); their spans are packed first-fit
decreasing into packed rows of ``L`` slots, dealt in order into micro-batches of ``r`` rows.
``token_index[m, i, j, w] = b * L + c``: packed slot ``w`` of row ``j`` of micro-batch ``i`` holds
token ``(b, c)`` of the batch; ``B * L`` marks an empty slot.

In the step (:func:`packed_rows`) the plan becomes the micro-batch's token ids, segment ids,
positions and next-token targets, and ``stat_index``: where the statistic of each slot (the
position predicting token ``c + 1`` of the same row) lies in the step's ``[B, T]`` per-token
arrays (``T = L - 1 - p``, from position ``p`` on); :func:`gather_tokens` and
:func:`scatter_tokens` move per-token arrays between the two layouts.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Int

from rft_jax.models.model import positions_from_mask


def packed_row_count(micro_batch_tokens: int, width: int, row_multiple: int = 1) -> int:
  """Packed rows ``r`` per micro-batch: ``micro_batch_tokens // width`` (at least 1), rounded up to
  a multiple of ``row_multiple`` (the data-parallel devices)."""
  rows = max(micro_batch_tokens // width, 1)
  return -(-rows // row_multiple) * row_multiple


def row_spans(attention_mask) -> tuple[np.ndarray, np.ndarray]:
  """``([B] first, [B] end)``: each row's real tokens lie in columns ``[first, end)`` of the
  ``[B, L]`` host mask (``first = end = 0`` for a row with none)."""
  mask = np.asarray(attention_mask) > 0
  width = mask.shape[1]
  any_token = mask.any(axis=1)
  first = np.where(any_token, mask.argmax(axis=1), 0)
  end = np.where(any_token, width - mask[:, ::-1].argmax(axis=1), 0)
  return first, end


def _first_fit_decreasing(lengths: np.ndarray, rows: np.ndarray, capacity: int) -> list[list[int]]:
  """Rows (ids ``rows``, token counts ``lengths``) packed into bins of ``capacity`` slots."""
  free = np.zeros(0, np.int64)
  bins: list[list[int]] = []
  for k in np.argsort(-lengths, kind="stable"):
    if lengths[k] == 0:
      continue
    fits = np.flatnonzero(free >= lengths[k])
    if fits.size:
      slot = int(fits[0])
    else:
      slot = len(bins)
      free = np.append(free, capacity)
      bins.append([])
    free[slot] -= lengths[k]
    bins[slot].append(int(rows[k]))
  return bins


def token_plan(attention_mask, *, micro_batch_tokens: int, mini_batches: int = 1,
               row_multiple: int = 1) -> np.ndarray:
  """``[M, n, r, L]`` int32 ``token_index`` of the batch whose ``[B, L]`` host mask is
  ``attention_mask`` (see the module docstring): ``M = mini_batches``, ``r`` of
  :func:`packed_row_count`, ``n`` the most micro-batches any mini-batch needs (at least 1); the
  mini-batches with fewer have empty ones."""
  first, end = row_spans(attention_mask)
  batch, width = np.shape(attention_mask)
  if batch % mini_batches:
    raise ValueError(f"batch of {batch} sequences does not split into learner.mini_batches={mini_batches}")
  rows_per_micro = packed_row_count(micro_batch_tokens, width, row_multiple)
  bins = []
  for m in range(mini_batches):
    rows = np.arange(m, batch, mini_batches)
    bins.append(_first_fit_decreasing(end[rows] - first[rows], rows, width))
  micro_batches = max(1, max(-(-len(b) // rows_per_micro) for b in bins))
  index = np.full((mini_batches, micro_batches * rows_per_micro, width), batch * width, np.int32)
  for m, mini_bins in enumerate(bins):
    for k, members in enumerate(mini_bins):
      offset = 0
      for b in members:
        n = end[b] - first[b]
        index[m, k, offset:offset + n] = b * width + np.arange(first[b], end[b])
        offset += n
  return index.reshape(mini_batches, micro_batches, rows_per_micro, width)


class PackedRows(NamedTuple):
  """Packed rows ``[..., W]`` ready for the decoder and ``token_stats``.

  Attributes:
    input_ids: the token at each slot (0 on empty slots).
    segment_ids: ``b + 1`` on the real tokens of row ``b`` (of the arrays packed), 0 elsewhere:
      a query attends only to earlier keys of its own segment.
    positions: each token's RoPE position in its own row (``positions_from_mask``).
    targets: the token each slot predicts, ``(b, c + 1)``, 0 where there is none.
    stat_index: ``b * T + c - p``, the slot's statistic in the ``[B, T]`` per-token arrays, or
      ``B * T`` where the slot has none (empty, a sequence's last token, before position ``p``).
  """

  input_ids: Int[Array, "... W"]
  segment_ids: Int[Array, "... W"]
  positions: Int[Array, "... W"]
  targets: Int[Array, "... W"]
  stat_index: Int[Array, "... W"]


def packed_rows(token_index: Int[Array, "... W"], input_ids: Int[Array, "B L"],
                attention_mask: Int[Array, "B L"], first_position: int, row_stride: int = 1) -> PackedRows:
  """The :class:`PackedRows` of ``token_index`` (a part of :func:`token_plan`'s) over ``input_ids``
  and ``attention_mask``; statistics from position ``first_position`` on (``T = L - 1 -
  first_position``). ``row_stride``: the arrays hold every ``row_stride``-th row of the planned
  batch (a mini-batch of ``split_rows``): planned row ``b`` is their row ``b // row_stride``."""
  rows, width = input_ids.shape
  stats_width = width - 1 - first_position
  empty = token_index >= rows * row_stride * width
  row = jnp.where(empty, 0, token_index // width // row_stride)
  column = jnp.where(empty, 0, token_index % width)
  flat_ids, flat_mask = input_ids.reshape(-1), attention_mask.reshape(-1).astype(bool)
  here = row * width + column
  following = row * width + jnp.minimum(column + 1, width - 1)
  real = ~empty & flat_mask[here]
  next_real = real & (column + 1 < width) & flat_mask[following]
  has_stat = next_real & (column >= first_position)
  return PackedRows(
      input_ids=jnp.where(real, flat_ids[here], 0),
      segment_ids=jnp.where(real, row + 1, 0).astype(jnp.int32),
      positions=jnp.where(real, positions_from_mask(attention_mask).reshape(-1)[here], 0),
      targets=jnp.where(next_real, flat_ids[following], 0),
      stat_index=jnp.where(has_stat, row * stats_width + column - first_position,
                           rows * stats_width).astype(jnp.int32))


def gather_tokens(x: jax.Array, stat_index: Int[Array, "... W"]) -> jax.Array:
  """``[B, T]`` per-token array -> packed ``[..., W]`` at ``stat_index`` (0 / False where none)."""
  return jnp.take(x.reshape(-1), stat_index, mode="fill", fill_value=0)


def gather_slots(token_index: Int[Array, "... W"], x: jax.Array, row_stride: int = 1) -> jax.Array:
  """``[B, L, ...]`` array aligned with ``input_ids`` -> packed ``[..., W, ...]``: each slot's
  token's entry (0 on empty slots); ``token_index`` and ``row_stride`` as for :func:`packed_rows`."""
  rows, width = x.shape[:2]
  empty = token_index >= rows * row_stride * width
  here = jnp.where(empty, 0, token_index // width // row_stride * width + token_index % width)
  values = jnp.take(x.reshape(rows * width, *x.shape[2:]), here, axis=0)
  return jnp.where(empty.reshape(empty.shape + (1,) * (x.ndim - 2)), jnp.zeros((), x.dtype), values)


def scatter_tokens(x: jax.Array, stat_index: Int[Array, "... W"], shape: tuple[int, int]) -> jax.Array:
  """Packed ``[..., W]`` -> ``[B, T]`` (``shape``) per-token array; 0 where no slot maps."""
  flat = jnp.zeros(shape[0] * shape[1], x.dtype).at[stat_index.reshape(-1)].set(x.reshape(-1), mode="drop")
  return flat.reshape(shape)
