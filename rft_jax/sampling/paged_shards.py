r"""Continuous batching on paged KV caches: one independent pool per ``data`` shard.

:func:`~rft_jax.sampling.generate.generate` lays the rows of a call out prompt-major over the
mesh's ``data`` axis (``D`` shards, 1 without a mesh): shard ``d`` holds the prompts
``[d B/D, (d+1) B/D)`` and their samples, rows ``[d R/D, (d+1) R/D)``. Each shard runs its own
paged pool (:mod:`.paged_pool`) on them: its ``S/D`` decode slots, its queue of its ``R/D``
samples and its own ``kv_pages`` pages, with block tables that point into its pages only. So a
data-parallel group of devices holds ``kv_pages`` pages (their heads split over ``model``),
not a copy of one global pool, and no step gathers pages across shards.

Every array of the pools' state has a leading shard axis ``[D, ...]`` laid out over ``data``;
admission and each decode step (allocate or evict, decode, release) are :func:`jax.vmap` of the
one-pool functions over it, and the loops run while any shard is busy (a shard with nothing
left to admit steps on its running samples, or on nothing). Admission copies pages (two
scatters a layer), so it runs only when a slot could take a waiting sample: an inner loop
decodes until some shard has a free slot and a sample waiting, then the outer loop admits
(the copies add kernels to a step on a GPU: ``docs/results/gpu.md#paged-attention-on-one-h100``;
a ``lax.cond`` around the copies made XLA copy whole page pools instead). A step with nothing to
admit would admit nothing, so the schedule is that of admitting at every step. A stage's
compaction keeps ``size / D`` slots per shard.
Samples depend only on their prompt, their sample index and the seed, so which shard, slot or
step decodes them changes nothing: the samples are those of one pool, and of the static
program.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jaxtyping import Array, Bool, Float, Int

from rft_jax.models.kv_cache import KVCache
from rft_jax.models.decode.paged_kv import pages_for
from rft_jax.parallel import DATA_AXIS, Rules
from rft_jax.sampling import paged_pool
from rft_jax.sampling.loop import constrain
from rft_jax.sampling.paged_pool import PagedPoolState
from rft_jax.sampling.pool_state import PoolState


def data_shards(mesh: Mesh | None) -> int:
  """``D``: the size of ``mesh``'s ``data`` axis, 1 without a mesh (or without that axis)."""
  return 1 if mesh is None else dict(mesh.shape).get(DATA_AXIS, 1)


def split_shards(x: Array, shards: int) -> Array:
  """``x`` (``[R, ...]``, rows laid out shard-major) as ``[D, R / D, ...]``."""
  return x.reshape(shards, x.shape[0] // shards, *x.shape[1:])


def join_shards(x: Array) -> Array:
  """``[D, R / D, ...]`` back to ``[R, ...]``."""
  return x.reshape(x.shape[0] * x.shape[1], *x.shape[2:])


def shard_axes(state: PagedPoolState) -> PagedPoolState:
  """The logical axes of the pools' state (:func:`~rft_jax.sampling.loop.constrain`): the
  leading shard axis is ``batch`` (on ``data``), the pages' heads ``kv_heads`` (on ``model``)."""
  axes = jax.tree.map(lambda x: ("batch",) + (None,) * (x.ndim - 1), state)
  pages = ("batch", "kv_heads", None, None, None)
  cache = axes.cache.replace(k=(pages,) * len(state.cache.k), v=(pages,) * len(state.cache.v))
  return axes.replace(cache=cache)


def run_paged(pool: PoolState, decode, uniforms: Float[Array, "R M"], prompt_cache: KVCache,
              prompt_lengths: Int[Array, "B"], waiting: Bool[Array, "R"], first: Int[Array, "R"],
              config, spec, mesh: Mesh | None, rules: Rules) -> PagedPoolState:
  """The decode loop of :func:`~rft_jax.sampling.continuous._sample_pool` on paged caches, one
  pool per data shard, the same stages as the dense pool's.

  Args:
    pool: the dense pool's first state without a cache: its ``[R, M]`` / ``[R]`` sample rows.
    decode: ``decode(state, uniforms)``, the state after a decode step of one pool whose
      samples draw ``uniforms`` (``[R / D, M]``, by sample and column).
    uniforms: every sample's uniform numbers.
    prompt_cache: the ``B`` prompts' prefilled cache.
    prompt_lengths: each prompt's token count.
    waiting: the samples that did not end at their first token (they queue).
    first: every sample's first token.
    config: the model's :class:`~rft_jax.models.QwenConfig`.
    spec: the call's :class:`~rft_jax.sampling.continuous.PoolSpec`.

  Returns:
    The pools' final state joined over the shards: ``tokens``, ``logprobs``, ``lengths``,
    ``done`` and an MoE model's recorded ``expert_ids`` by sample (``[R, M]`` / ``[R]``, rows as in ``pool``), ``admissions`` and
    ``evictions`` summed; the slot, page and queue fields are None.
  """
  shards = data_shards(mesh)
  b, r = prompt_lengths.shape[0], first.shape[0]
  if b % shards or any(size % shards for size in spec.slots):
    raise ValueError(f"paged pools: {b} prompts and pool sizes {spec.slots} must be multiples "
                     f"of the {shards} data shards")
  split = functools.partial(split_shards, shards=shards)
  keep = functools.partial(_on_shards, mesh=mesh, rules=rules)
  waiting, first, uniforms, prompt_lengths = map(split, (waiting, first, uniforms, prompt_lengths))
  queue = jnp.argsort(~waiting, axis=1, stable=True)  # each shard's waiting samples first
  queued = jnp.sum(waiting, axis=1)
  slots = spec.slots[0] // shards
  zeros = jnp.zeros((shards, slots), jnp.int32)
  shard_pools = PoolState(
      admitted=jnp.zeros((shards,), jnp.int32), sample=jnp.full((shards, slots), r // shards),
      steps=zeros, last_tokens=zeros, running=jnp.zeros((shards, slots), bool), cache=None,
      tokens=split(pool.tokens), logprobs=split(pool.logprobs), lengths=split(pool.lengths),
      done=split(pool.done), expert_ids=None if pool.expert_ids is None else split(pool.expert_ids))
  initial = functools.partial(
      paged_pool.initial_paged_state, config=config, num_pages=spec.kv_pages,
      page_size=spec.page_size, max_new_tokens=spec.max_new_tokens, dtype=spec.cache_dtype)
  state = keep(jax.vmap(initial)(shard_pools, tuple(map(split, prompt_cache.k)),
                                 tuple(map(split, prompt_cache.v)), prompt_lengths, queue))
  prompt_width = pages_for(prompt_cache.max_len, spec.page_size)

  # spmd_axis_name: a sharding constraint inside a step gets the shard axis on data.
  on_shards = functools.partial(jax.vmap, spmd_axis_name=DATA_AXIS if shards > 1 else None)
  admit = on_shards(lambda s, first, lengths, queued: paged_pool.admit(
      s, first, spec.n, lengths, prompt_width, queued))
  decode_step = on_shards(lambda s, uniforms: paged_pool.decode_step(
      s, lambda x: decode(x, uniforms)))

  def can_admit(s):  # some shard has a free slot and a waiting sample
    return jnp.any((s.admitted < queued) & jnp.any(~s.running, axis=1))

  def admit_then_decode(s, busy):
    """Admission, then decode steps until a slot can take a waiting sample (at least one)."""
    s = keep(admit(s, first, prompt_lengths, queued))
    s, _ = jax.lax.while_loop(
        lambda c: c[1] | (busy(c[0]) & ~can_admit(c[0])),
        lambda c: (keep(decode_step(c[0], uniforms)), jnp.bool_(False)), (s, jnp.bool_(True)))
    return s

  for stage, size in enumerate(spec.slots):
    size //= shards
    if stage:
      state = keep(jax.vmap(lambda s, size=size: paged_pool.compact_paged(
          s, jnp.argsort(~s.running, stable=True)[:size]))(state))
    smaller = spec.slots[stage + 1] // shards if stage + 1 < len(spec.slots) else 0

    def busy(s, smaller=smaller):  # some shard's samples wait, or run past the next size
      return jnp.any((s.admitted < queued) | (jnp.sum(s.running, axis=1) > smaller))
    state = jax.lax.while_loop(busy, lambda s, busy=busy: admit_then_decode(s, busy), state)
  rows = ("batch", None)
  return PagedPoolState(
      admitted=jnp.sum(state.admitted), sample=None, steps=None, last_tokens=None, running=None,
      cache=None, tokens=constrain(join_shards(state.tokens), rows, mesh, rules),
      logprobs=constrain(join_shards(state.logprobs), rows, mesh, rules),
      lengths=join_shards(state.lengths), done=join_shards(state.done),
      expert_ids=None if state.expert_ids is None else constrain(
          join_shards(state.expert_ids), ("batch", None, None, None), mesh, rules),
      admissions=jnp.sum(state.admissions), evictions=jnp.sum(state.evictions))


def _on_shards(state: PagedPoolState, mesh: Mesh | None, rules: Rules) -> PagedPoolState:
  """``state`` laid out with its shard axis over ``data`` (a no-op without a mesh)."""
  return constrain(state, shard_axes(state), mesh, rules)
