"""How the learner cuts a batch: rows into micro-batches (strided, so each stays spread over the
data-parallel devices), and columns from the first completion token on (the statistics of
prompt positions are never used)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from rft_jax.parallel import host_array


def split_rows(x: jax.Array, n: int) -> jax.Array:
  """``[B, ...] -> [n, B // n, ...]``, part ``i`` holding rows ``i, i + n, ...``."""
  return jnp.swapaxes(x.reshape(x.shape[0] // n, n, *x.shape[1:]), 0, 1)


def merge_rows(x: jax.Array) -> jax.Array:
  """Inverse of :func:`split_rows`."""
  return jnp.swapaxes(x, 0, 1).reshape(-1, *x.shape[2:])


def first_response_column(response_mask, multiple: int = 16) -> int:
  """The first column holding a completion token in any row of ``response_mask`` (``[B, L]``, a
  host or device array; of a device array only the ``[L]`` column flags are read back), rounded
  down to a multiple of ``multiple`` (few compiled programs per run); 0 when there is none.
  Columns before it hold prompts or padding in every row."""
  if isinstance(response_mask, jax.Array):
    used = np.flatnonzero(host_array(jnp.any(response_mask, axis=0)))
  else:
    used = np.flatnonzero(np.asarray(response_mask).any(axis=0))
  return int(used[0]) // multiple * multiple if used.size else 0


def first_stats_position(stats_from_column: int) -> int:
  """The first next-token position whose statistics a step computes: the one predicting the
  token of column ``stats_from_column`` (position ``t`` predicts token ``t + 1``; column 0 is
  never predicted)."""
  return max(stats_from_column - 1, 0)


def merge_counts(a: dict, b: dict) -> dict:
  """Combines per-update clip counts: sums, except ``ratio_dev_max`` (a maximum)."""
  return {k: jnp.maximum(a[k], v) if k == "ratio_dev_max" else a[k] + v for k, v in b.items()}
