"""A paged multi-turn pool: rows' pages kept across turns, allocated by the host as they grow.

With ``sampling.kv_pages`` the rows of :mod:`rft_jax.sampling.turns` share a pool of pages
(:class:`~rft_jax.models.decode.paged_kv.PagedKVCache`) instead of a dense row of ``W`` slots
each, so memory follows the tokens the trajectories hold, not their budgets. The host owns the
block tables (:class:`PageTable`), since it sees every row between chunks anyway: before a feed
or a chunk it gives each row the pages its next tokens go to, and when the pool runs short it
takes a row's pages back (the youngest trajectory first), to feed the row's whole history again
later: the same samples, the time of a prefill.

An environment's reply is appended to a row's pages by :func:`extend_paged`: the row's tokens
gathered into a dense view, :meth:`~rft_jax.models.Qwen.extend` run over it (each new token
attends to the whole history), and the new tokens' keys and values written into their pages.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Int

from rft_jax.models.decode.paged_kv import PagedKVCache, pages_for
from rft_jax.models.kv_cache import KVCache


def extend_paged(model, cache: PagedKVCache, rows: Int[Array, "F"], restart: Bool[Array, "F"],
                 ids: Int[Array, "F T"], lengths: Int[Array, "F"]) -> PagedKVCache:
  """``cache`` with rows ``rows`` (emptied first where ``restart``) extended by ``ids[f,
  :lengths[f]]``, into the pages their block tables (``cache.pages``) give them."""
  heads, _, page, h = cache.k[0].shape
  table = cache.pages[rows]  # [F, Wp]
  f, t = ids.shape
  width = table.shape[1] * page
  start = jnp.where(restart, 0, cache.lengths[rows])

  def dense(layer, keys):  # [K, N, P, H] -> keys [F, K, H, width + T], values [F, K, width + T, H]
    x = layer[:, table].reshape(heads, f, width, h)
    x = jnp.pad(x, ((0, 0), (0, 0), (0, t), (0, 0)))
    return x.transpose(1, 0, 3, 2) if keys else x.transpose(1, 0, 2, 3)

  view = KVCache(k=tuple(dense(k, True) for k in cache.k), v=tuple(dense(v, False) for v in cache.v),
                 slot_mask=jnp.arange(width + t)[None] < start[:, None], positions=start, index=start)
  mask = (jnp.arange(t)[None] < lengths[:, None]).astype(jnp.int32)
  _, view = model.extend(ids, mask, view)

  new = start[:, None] + jnp.arange(t)  # [F, T] the new tokens' positions
  target = jnp.take_along_axis(table, jnp.minimum(new // page, table.shape[1] - 1), axis=1)
  target = jnp.where(jnp.arange(t)[None] < lengths[:, None], target, cache.num_pages)  # dropped
  offset = new % page
  take = jax.vmap(lambda x, s: jax.lax.dynamic_slice_in_dim(x, s, t, axis=-1))  # a row's T slots
  heads_index = jnp.arange(heads)[:, None, None]

  def put(pool, values):  # values [F, K, T, H] -> pool [K, N, P, H]
    return pool.at[heads_index, target[None], offset[None]].set(
        values.transpose(1, 0, 2, 3).astype(pool.dtype), mode="drop")

  k = tuple(put(pool, take(x, start).transpose(0, 1, 3, 2)) for pool, x in zip(cache.k, view.k))
  v = tuple(put(pool, take(jnp.swapaxes(x, 2, 3), start).transpose(0, 1, 3, 2))
            for pool, x in zip(cache.v, view.v))
  return cache.replace(k=k, v=v, lengths=cache.lengths.at[rows].set(start + lengths))


class PageTable:
  """The host's block tables of a paged pool: ``num_pages`` pages of ``page_size`` tokens, each
  row's pages in order (:attr:`table`, ``[S, W]`` int32, sent with every program call)."""

  def __init__(self, num_pages: int, page_size: int, slots: int, pages_per_row: int):
    self.page_size = page_size
    self.table = np.zeros((slots, pages_per_row), np.int32)
    self._free = list(range(num_pages - 1, -1, -1))  # a stack: page 0 first
    self._rows: dict[int, list[int]] = {}

  @property
  def free_pages(self) -> int:
    return len(self._free)

  def held(self, row: int) -> int:
    """Pages row ``row`` holds."""
    return len(self._rows.get(row, ()))

  def ensure(self, row: int, tokens: int) -> bool:
    """Gives row ``row`` the pages of ``tokens`` tokens; False (nothing taken) when too few are
    free."""
    pages = self._rows.setdefault(row, [])
    need = pages_for(tokens, self.page_size) - len(pages)
    if need > len(self._free):
      return False
    for _ in range(max(need, 0)):
      pages.append(self._free.pop())
      self.table[row, len(pages) - 1] = pages[-1]
    return True

  def release(self, row: int) -> None:
    """Row ``row``'s pages back to the pool."""
    self._free.extend(reversed(self._rows.pop(row, [])))
