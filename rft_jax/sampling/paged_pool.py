r"""Continuous batching on a paged KV cache: the pool's memory follows its live tokens.

:mod:`rft_jax.sampling.continuous` gives each decode slot a cache row of ``P + M`` slots, so
the pool's memory is ``S x (P + M)`` whatever the samples' lengths. Here the keys and values
live in ``N`` pages of ``page_size`` tokens (:mod:`rft_jax.models.decode.paged_kv`) handed out as the
samples grow, so ``S`` slots need only as many pages as their live tokens fill, and a pool can
hold many more slots than full-width rows would fit:

* the ``B`` prompts are written once to their own pages (``ceil(P / page_size)`` each, shifted
  to the start: a slot's tokens are contiguous from position 0); a prompt's samples point at
  its full pages and copy only its last, partial page when they enter a slot;
* a slot takes a free page each time its length reaches a page boundary, and gives its own
  pages back when its sample ends;
* a free slot takes a waiting sample only while pages remain for the running slots' next step
  and for the entering samples' first page;
* when the running slots need more pages than are free, the youngest samples are evicted: their
  pages freed, and they go back to the front of the queue. A sample's tokens depend only on its
  prompt, its sample index and the seed (:mod:`rft_jax.sampling.keys`), so an evicted sample
  decodes the same tokens again when it re-enters (preemption by recomputation, as vLLM does,
  without a new prefill: its prompt's pages stay). The oldest running sample is never evicted
  for another, and the pool holds at least one full sample's pages, so every call ends.

This module is one pool: on a data mesh each data shard runs one on its own prompts, samples,
slots and pages (:mod:`rft_jax.sampling.paged_shards` vmaps these functions over the shards).
The samples are those of the dense pool and of the static program (log-probabilities to float32
rounding); ``tests/test_sampling_paged.py`` checks it, with page budgets small enough to evict.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from rft_jax.models.decode.paged_kv import PagedKVCache, init_paged_cache, pages_for, prompt_pages
from rft_jax.sampling.pool_state import PoolState


@flax.struct.dataclass
class PagedPoolState(PoolState):
  """:class:`PoolState` with the pages' bookkeeping (``S`` slots, ``N`` pages, ``R`` samples).

  Attributes:
    queue: ``[R]`` the samples in admission order; those from ``admitted`` on wait (an evicted
      sample is put back just before them).
    entered: ``[S]`` when each slot's sample entered (an admission count): the largest is
      evicted first.
    shared: ``[S]`` how many of the slot's first pages are its prompt's (never freed by it).
    free: ``[N]`` a stack of free page ids, ``free[:free_count]``.
    free_count: free pages.
    admissions: samples admitted so far, re-admissions included.
    evictions: samples evicted so far.
  """

  queue: Int[Array, "R"] = None
  entered: Int[Array, "S"] = None
  shared: Int[Array, "S"] = None
  free: Int[Array, "N"] = None
  free_count: Int[Array, ""] = None
  admissions: Int[Array, ""] = None
  evictions: Int[Array, ""] = None


def _pop(s: PagedPoolState, want: Bool[Array, "S"]) -> tuple[Int[Array, "S"], PagedPoolState]:
  """One free page for each slot in ``want`` (``N``, out of range, for the others)."""
  n = s.free.shape[0]
  order = jnp.cumsum(want) - 1
  ids = jnp.where(want, s.free[jnp.clip(s.free_count - 1 - order, 0, n - 1)], n)
  return ids, s.replace(free_count=s.free_count - jnp.sum(want))


def _release(s: PagedPoolState, slots: Bool[Array, "S"]) -> PagedPoolState:
  """``s`` with the own pages of ``slots`` (after their prompt's shared ones, up to their
  length) pushed on the free stack."""
  cache = s.cache
  width = cache.pages.shape[1]
  index = jnp.arange(width)[None, :]
  used = pages_for(cache.lengths, cache.page_size)[:, None]
  own = (slots[:, None] & (index >= s.shared[:, None]) & (index < used)).reshape(-1)
  place = jnp.where(own, s.free_count + jnp.cumsum(own) - 1, s.free.shape[0])
  free = s.free.at[place].set(cache.pages.reshape(-1), mode="drop")
  return s.replace(free=free, free_count=s.free_count + jnp.sum(own))


def admit(s: PagedPoolState, first: Int[Array, "R"], n: int, prompt_lengths: Int[Array, "B"],
          prompt_width: int, queued: Int[Array, ""]) -> PagedPoolState:
  """Free slots take waiting samples, as many as the free pages allow (one each, besides the
  pages the running slots take this step)."""
  cache = s.cache
  page_size = cache.page_size
  r = s.queue.shape[0]
  width = cache.pages.shape[1]
  free_slot = ~s.running
  rank = jnp.cumsum(free_slot) - 1
  place = s.admitted + rank
  running_need = jnp.sum(s.running & (cache.lengths % page_size == 0))
  take = free_slot & (place < queued) & (rank < s.free_count - running_need)
  sample = jnp.where(take, s.queue[jnp.minimum(place, r - 1)], s.sample)
  prompt = sample // n
  length = prompt_lengths[jnp.minimum(prompt, prompt_lengths.shape[0] - 1)]
  shared = length // page_size
  partial = take & (length % page_size != 0)
  copies, s = _pop(s, partial)
  prompt_table = jnp.minimum(prompt[:, None] * prompt_width + jnp.arange(width)[None, :],
                             cache.num_pages - 1)  # entries past the prompt's: overwritten
  pages = jnp.where(take[:, None], prompt_table, cache.pages)
  slot = jnp.arange(pages.shape[0])
  pages = pages.at[slot, shared].set(jnp.where(partial, copies, pages[slot, shared]),
                                     mode="clip")
  source = prompt * prompt_width + shared  # the prompt's partial page

  def copy(layer):
    return layer.at[:, copies].set(layer[:, jnp.minimum(source, layer.shape[1] - 1)],
                                   mode="drop")
  cache = cache.replace(k=tuple(map(copy, cache.k)), v=tuple(map(copy, cache.v)), pages=pages,
                        lengths=jnp.where(take, length, cache.lengths))
  admitted = jnp.sum(take)
  return s.replace(
      admitted=s.admitted + admitted, sample=sample, steps=jnp.where(take, 1, s.steps),
      last_tokens=jnp.where(take, first[jnp.minimum(sample, r - 1)], s.last_tokens),
      running=s.running | take, cache=cache,
      entered=jnp.where(take, s.admissions + rank, s.entered),
      shared=jnp.where(take, shared, s.shared), admissions=s.admissions + admitted)


def _evict_youngest(s: PagedPoolState) -> PagedPoolState:
  """``s`` with its most recently admitted running sample back at the front of the queue and
  its own pages freed."""
  victim = jnp.argmax(jnp.where(s.running, s.entered, -1))
  one = jnp.arange(s.running.shape[0]) == victim
  s = _release(s, one)
  return s.replace(running=s.running & ~one, admitted=s.admitted - 1,
                   queue=s.queue.at[s.admitted - 1].set(s.sample[victim]),
                   evictions=s.evictions + 1)


def _allocate(s: PagedPoolState) -> PagedPoolState:
  """A new page for every running slot whose next token starts one, evicting the youngest
  samples while the free pages do not suffice."""
  page_size = s.cache.page_size

  def need(c: PagedPoolState) -> Bool[Array, "S"]:
    return c.running & (c.cache.lengths % page_size == 0)

  s = jax.lax.while_loop(lambda c: jnp.sum(need(c)) > c.free_count, _evict_youngest, s)
  wanted = need(s)
  ids, s = _pop(s, wanted)
  cache = s.cache
  slot = jnp.arange(cache.pages.shape[0])
  column = cache.lengths // page_size
  pages = cache.pages.at[slot, column].set(
      jnp.where(wanted, ids, cache.pages[slot, jnp.minimum(column, cache.pages.shape[1] - 1)]),
      mode="drop")
  return s.replace(cache=cache.replace(pages=pages))


def initial_paged_state(pool: PoolState, prompt_k: tuple[Float[Array, "B K H P"], ...],
                        prompt_v: tuple[Float[Array, "B K P H"], ...],
                        prompt_lengths: Int[Array, "B"], queue: Int[Array, "R"], *, config,
                        num_pages: int, page_size: int, max_new_tokens: int, dtype
                        ) -> PagedPoolState:
  """The paged pool's first state: the prompts' pages written, every other page free.

  ``pool``: the dense pool's first state without a cache (slots, samples, first tokens);
  ``prompt_k`` / ``prompt_v``: the prompts' prefilled cache layers (the ``k`` and ``v`` of a
  :class:`~rft_jax.models.kv_cache.KVCache`). On a data mesh this is one data shard's pool
  (:mod:`.paged_shards`): its prompts, its samples and its ``num_pages`` pages."""
  b, _, _, p = prompt_k[0].shape
  prompt_width = pages_for(p, page_size)
  width = pages_for(p + max_new_tokens, page_size)
  slots = pool.sample.shape[0]
  if num_pages < b * prompt_width + width:
    raise ValueError(
        f"kv_pages={num_pages} pages of {page_size} tokens (per data shard) cannot hold the "
        f"shard's {b} prompts of {p} slots ({b * prompt_width} pages) and one whole sample "
        f"({width} pages); give at least {b * prompt_width + width}")
  cache = init_paged_cache(config, num_pages, page_size, slots, width, dtype)
  used = b * prompt_width

  def write(pages, prompt_layer):
    return pages.at[:, :used].set(prompt_pages(prompt_layer, prompt_lengths, page_size)
                                  .astype(pages.dtype))
  cache = cache.replace(
      k=tuple(write(pages, layer.transpose(0, 1, 3, 2))
              for pages, layer in zip(cache.k, prompt_k)),
      v=tuple(write(pages, layer) for pages, layer in zip(cache.v, prompt_v)))
  free = jnp.arange(num_pages, dtype=jnp.int32)[::-1]  # popped from the top: low ids first
  fields = {f: getattr(pool, f) for f in PoolState.__dataclass_fields__}
  fields["cache"] = cache
  zero = jnp.zeros((), jnp.int32)
  return PagedPoolState(**fields, queue=queue, entered=jnp.zeros((slots,), jnp.int32),
                        shared=jnp.zeros((slots,), jnp.int32), free=free,
                        free_count=jnp.asarray(num_pages - used, jnp.int32), admissions=zero,
                        evictions=zero)


def decode_step(s: PagedPoolState, decode) -> PagedPoolState:
  """One decode step of the paged pool, after :func:`admit`: allocate, decode
  (``decode(state)`` returns the state after a decode step), free the pages of the samples that
  ended."""
  s = _allocate(s)
  before = s.running
  s = decode(s)
  return _release(s, before & ~s.running)


def compact_paged(s: PagedPoolState, keep: Int[Array, "S2"]) -> PagedPoolState:
  """``s`` in a smaller pool of the slots ``keep`` (which hold every running sample): block
  tables move, pages stay."""
  take = lambda x: x[keep]  # noqa: E731
  return s.replace(sample=take(s.sample), steps=take(s.steps), last_tokens=take(s.last_tokens),
                   running=take(s.running), entered=take(s.entered), shared=take(s.shared),
                   cache=s.cache.replace(pages=take(s.cache.pages), lengths=take(s.cache.lengths)))
