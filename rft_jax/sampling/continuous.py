r"""Continuous batching: a pool of decode slots kept full from a queue of samples, one program.

One call of :func:`sample_pool`, for ``B`` (bucketed) prompts of (bucketed) length ``P``, ``n``
samples each (``R = B * n`` samples, sample ``b * n + j`` is sample ``j`` of prompt ``b``) and
``M = max_new_tokens``:

1. prefill the ``B`` prompts once into a ``P``-slot prompt cache, and draw every sample's first
   token from its prompt's last logits (a prompt's ``n`` samples share its prefill);
2. the samples that did not stop at their first token wait in a queue, in sample order; a pool
   of ``S`` decode slots (``S <= R``, each with a ``P + M``-slot cache row and its own write
   index) takes them: every step, each free slot takes the next waiting sample (its prompt's
   cache row copied in, the admitted rows only), then all slots decode one token;
   a slot is freed when its sample emits a stop token or reaches ``M`` tokens;
3. once nothing waits, the pool shrinks by halves (``spec.slots``: ``S, S/2, ...``, down to one
   slot on CPU and eight elsewhere: :func:`min_pool_slots`): when the running samples fit the
   next size, they are gathered into a pool of that size and decoding goes on there, so the
   last long completions run in a small batch instead of keeping every slot of the call busy;
   the call ends when nothing waits or runs. Until then a stopped slot still takes part in the
   weight products (their shapes are the stage's), but on one CPU device not in attention: it
   attends to the slot it writes only (``feature_major.decode_step``'s ``live``), so the kernel
   skips its cache.

Each sample's tokens and log-probabilities depend only on its prompt, its sample index and the
seed: its uniform numbers are those of :mod:`rft_jax.sampling.keys` (by sample and step, not by
slot), its cache row holds the prompt at slots ``[0, P)`` and its tokens from slot ``P`` on, as
in the static program (:mod:`rft_jax.sampling.loop`), whatever slot it runs in and whenever it
enters. So the samples equal the static program's (log-probabilities to float32 rounding: XLA
may round a row's sums differently at another batch size; ``tests/test_sampling_continuous.py``).

Why one ``while_loop`` with the queue on the device, not a host scheduler driving jitted
``prefill`` / ``insert`` / ``decode k steps`` programs (JetStream's orchestrator): the queue of
one RL step is known when the call starts (every prompt and its ``n``), so nothing needs the
host between steps; a host loop would wait for a device-to-host transfer every ``k`` steps and
leave a freed slot idle until then (a small model's CPU decode step costs about as much as a
round trip through Python and dispatch:
``docs/results/longtail.md#the-cpu-pool-a-steps-cost-by-its-rows``), and admitting inside the
loop copies only the admitted rows' prompt slots.

The cache is sized by the pool, not by the rows: ``S x (P + M)`` slots instead of the static
program's ``R x (P + M)``; ``SamplingParams.decode_slots`` bounds it. With
``SamplingParams.kv_pages`` the cache is paged instead (a block table per slot, so that memory
follows the live tokens; :mod:`rft_jax.sampling.paged_pool`), one pool per data shard
(:mod:`rft_jax.sampling.paged_shards`); on one CPU device the dense pool's attention kernel
already reads only each row's live slots, and the pool holds its keys tiled for it
(:func:`rft_jax.models.decode.cpu_attention.tile_keys`: a block of slots is one stretch of memory).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh
from jaxtyping import Array, Bool, Float, Int, UInt32

from rft_jax.models.decode import cpu_attention
from rft_jax.models.kv_cache import KVCache
from rft_jax.parallel import Rules
from rft_jax.sampling import paged_shards, routing_record
from rft_jax.sampling.decoder import CPU_COMPILER_OPTIONS, Decoder, on_cpu
from rft_jax.sampling.keys import completion_keys, step_uniforms
from rft_jax.sampling.loop import DecodeSpec, cache_slots, constrain
from rft_jax.sampling.params import SamplingParams
from rft_jax.sampling.pool_state import PoolState


def pool_sizes(rows: int, decode_slots: int | None, stages: int, data: int = 1,
               min_slots: int = 8) -> tuple[int, ...]:
  """The pool's sizes, largest first: ``S = min(rows, decode_slots)`` rounded up to a multiple
  of ``data`` (each data shard decodes as many slots), then halved while a half is a multiple of
  ``data`` and at least ``min_slots`` (at most ``stages`` sizes); e.g. ``(64, 32, 16)`` for 128
  rows, 64 slots and 3 stages, ``(32,)`` for 32 rows and 1 stage.

  ``min_slots`` (:func:`min_pool_slots`): 1 on CPU, 8 elsewhere."""
  size = rows if decode_slots is None else min(rows, decode_slots)
  sizes = [-(-size // data) * data]
  while (len(sizes) < stages and sizes[-1] % 2 == 0 and (sizes[-1] // 2) % data == 0
         and sizes[-1] // 2 >= min_slots):
    sizes.append(sizes[-1] // 2)
  return tuple(sizes)


@dataclasses.dataclass(frozen=True)
class PoolSpec(DecodeSpec):
  """Continuous batching's :class:`~rft_jax.sampling.loop.DecodeSpec`, and

  Attributes:
    slots: :func:`pool_sizes`, the pool's size at each stage.
    kv_pages, page_size, paged_attention: the call's :class:`SamplingParams` settings.
  """

  slots: tuple[int, ...] = ()
  kv_pages: int | None = None
  page_size: int = 16
  paged_attention: str = "auto"

  @classmethod
  def of(cls, params: SamplingParams, rows: int, data: int = 1, cache_dtype=None,
         platform: str | None = None) -> PoolSpec:
    """The spec of a call of ``rows`` samples over ``data`` shards on ``platform`` (``cpu``,
    ``gpu`` or ``tpu``; None: an accelerator's, as ``rft-jax plan`` sizes it)."""
    return cls(slots=pool_sizes(rows, params.decode_slots, pool_stages(params), data,
                                min_pool_slots(platform)),
               kv_pages=params.kv_pages, page_size=params.page_size,
               paged_attention=params.paged_attention,
               **DecodeSpec.fields_of(params, cache_dtype))


def min_pool_slots(platform: str | None) -> int:
  """The smallest pool a call shrinks to on ``platform``: 1 on CPU, where a decode step's cost
  follows its rows down to one (it streams the weights once and multiplies them by every row),
  8 elsewhere, where a step of 1 to 64 rows costs about the same and a smaller stage would only
  add a compiled body. On CPU the long-tailed work's replay finishes sooner halving down to 1
  slot than stopping at 8 (``docs/results/longtail.md#the-cpu-pool-a-steps-cost-by-its-rows``)."""
  return 1 if platform == "cpu" else 8


def pool_stages(params: SamplingParams) -> int:
  """``params.pool_stages``, or 1 (no shrinking) for calls of fewer than twice
  ``params.min_segment_tokens`` new tokens: a stage is one more compiled decode body, and on
  short calls the steps it saves are worth less than its compile time (the static program's
  segments follow the same rule; the test suite, mostly short calls, took far longer with five
  stages everywhere: ``docs/results/longtail.md#the-cpu-pool-a-steps-cost-by-its-rows``)."""
  return params.pool_stages if params.max_new_tokens >= 2 * params.min_segment_tokens else 1


def _empty_pool_cache(model, slots: int, width: int, dtype, tiled: bool) -> KVCache:
  """A pool cache of ``slots`` rows x ``width`` slots with one write index per row; ``tiled``:
  its keys tiled (:func:`rft_jax.models.decode.cpu_attention.tile_keys`), ``width`` rounded up to whole
  tiles."""
  if tiled:
    width = cpu_attention.tiled_slots(width)
  cache = model.init_cache(slots, width, dtype=dtype)
  if tiled:
    cache = cache.replace(k=tuple(map(cpu_attention.tile_keys, cache.k)))
  return cache.replace(index=jnp.zeros((slots,), jnp.int32))


def _tiled_prompts(prompt_cache: KVCache) -> KVCache:
  """``prompt_cache`` with its keys tiled (:func:`rft_jax.models.decode.cpu_attention.tile_keys`), their
  slots padded to whole tiles (the slot mask keeps its ``P`` slots: :func:`_insert` copies the
  padding's keys too, into slots a row writes before it reads them)."""
  p = prompt_cache.max_len
  pad = ((0, 0), (0, 0), (0, 0), (0, cpu_attention.tiled_slots(p) - p))
  return prompt_cache.replace(k=tuple(cpu_attention.tile_keys(jnp.pad(k, pad))
                                      for k in prompt_cache.k))


def _insert(cache: KVCache, prompt_cache: KVCache, order: Int[Array, "S"], count: Int[Array, ""],
            prompts: Int[Array, "S"], prompt_lengths: Int[Array, "B"]) -> KVCache:
  """``cache`` with its rows ``order[:count]`` restarted, row ``s`` on prompt ``prompts[s]``:
  the prompt's keys and values at slots ``[0, P)``, its slot mask, its position and the write
  index ``P``. The row's later slots keep their old contents, masked off. One row at a time
  (``count`` is traced): each copies only its own ``P`` slots of every layer, in place, where a
  scatter of a fixed ``S`` rows would move every slot's window at each admission."""
  p = prompt_cache.max_len

  def restart(i, c: KVCache) -> KVCache:
    slot = order[i]
    prompt = prompts[slot]

    def row(layer, prompt_layer):  # one layer's row `slot` <- the prompt's row, slots [0, P)
      update = jax.lax.dynamic_index_in_dim(prompt_layer, prompt, keepdims=True)
      start = (slot,) + (0,) * (layer.ndim - 1)
      return jax.lax.dynamic_update_slice(layer, update.astype(layer.dtype), start)

    return KVCache(
        k=tuple(map(row, c.k, prompt_cache.k)), v=tuple(map(row, c.v, prompt_cache.v)),
        slot_mask=row(c.slot_mask.at[slot].set(False), prompt_cache.slot_mask),
        positions=c.positions.at[slot].set(prompt_lengths[prompt]),
        index=c.index.at[slot].set(p))

  return jax.lax.fori_loop(0, count, restart, cache)


def _compact(state: PoolState, size: int) -> PoolState:
  """``state`` in a pool of ``size`` slots holding all its running samples (``size`` at least
  their number): the running slots first, in slot order, then free ones."""
  keep = jnp.argsort(~state.running, stable=True)[:size]
  take = lambda x: x[keep]  # noqa: E731
  return state.replace(sample=take(state.sample), steps=take(state.steps),
                       last_tokens=take(state.last_tokens), running=take(state.running),
                       cache=jax.tree.map(take, state.cache))


def _sample_pool(graphdef: nnx.GraphDef, state: nnx.State,
                 prompt_ids: Int[Array, "B P"], prompt_mask: Int[Array, "B P"],
                 fingerprints: UInt32[Array, "B 3"], live: Bool[Array, "B"],
                 seed: UInt32[Array, ""], temperature: Float[Array, ""],
                 top_k: Int[Array, ""], top_p: Float[Array, ""],
                 layer_ids: tuple[Int[Array, ""], ...] | None = None, *, spec: PoolSpec,
                 mesh: Mesh | None, rules: Rules) -> PoolState:
  """Samples ``spec.n`` completions of every prompt (see the module docstring); the arguments
  are those of :func:`rft_jax.sampling.loop.sample_loop`.

  Returns:
    The final :class:`PoolState` without its cache: ``tokens``, ``logprobs``, ``lengths`` and
    ``done`` by sample (row ``b * n + j`` is sample ``j`` of prompt ``b``).
  """
  b, p = prompt_ids.shape
  n, m = spec.n, spec.max_new_tokens
  r = b * n
  rows = ("batch", None)
  decoder = Decoder.of(graphdef, state, spec, mesh=mesh, rows=spec.slots[0], layer_ids=layer_ids)
  model, routed = decoder.model, decoder.routed

  prompt_cache = model.init_cache(b, p, dtype=spec.cache_dtype)
  axes = prompt_cache.logical_axes()
  prompt_cache = constrain(prompt_cache, axes, mesh, rules)
  logits, prompt_cache, prompt_routing = decoder.prefill(prompt_ids, prompt_mask, prompt_cache)
  tiled = decoder.backend.tiled_keys
  prompt_lengths = jnp.sum(prompt_mask.astype(jnp.int32), axis=1)

  uniforms = constrain(step_uniforms(completion_keys(seed, fingerprints, n), m), rows, mesh, rules)
  logits = jnp.repeat(logits, n, axis=0, total_repeat_length=r)
  first, first_logp = spec.strategy(logits, uniforms[:, 0], temperature, top_k, top_p)
  real = jnp.repeat(live, n, total_repeat_length=r)
  stopped = spec.is_stop(first)
  waiting = real & ~stopped & (m > 1)
  queue = jnp.argsort(~waiting, stable=True)  # the waiting samples first, in sample order
  queued = jnp.sum(waiting)

  size = spec.slots[0]
  pool_cache, pool_axes = None, None
  if spec.kv_pages is None:
    pool_cache = _empty_pool_cache(model, size, cache_slots(p, m), spec.cache_dtype, tiled)
    pool_axes = pool_cache.logical_axes()
    pool_cache = constrain(pool_cache, pool_axes, mesh, rules)
  pool = PoolState(
      admitted=jnp.zeros((), jnp.int32),
      sample=jnp.full((size,), r, jnp.int32),
      steps=jnp.zeros((size,), jnp.int32),
      last_tokens=jnp.zeros((size,), jnp.int32),
      running=jnp.zeros((size,), bool),
      cache=pool_cache,
      tokens=constrain(jnp.zeros((r, m), jnp.int32).at[:, 0].set(jnp.where(real, first, 0)),
                        rows, mesh, rules),
      logprobs=constrain(jnp.zeros((r, m), jnp.float32).at[:, 0].set(
          jnp.where(real, first_logp, 0.0)), rows, mesh, rules),
      lengths=real.astype(jnp.int32),
      done=~real | stopped,
      expert_ids=routing_record.constrain_rows(
          routing_record.empty_record(model.config, r, m) if routed else None,
          lambda x, axes: constrain(x, axes, mesh, rules)),
  )

  insert_from = _tiled_prompts(prompt_cache) if tiled else prompt_cache

  def admit(s: PoolState) -> PoolState:
    free = ~s.running
    place = s.admitted + jnp.cumsum(free) - 1  # each free slot's place in the queue
    take = free & (place < queued)
    sample = jnp.where(take, queue[jnp.minimum(place, r - 1)], s.sample)
    order = jnp.argsort(~take, stable=True)  # the admitting slots first
    cache = _insert(s.cache, insert_from, order, jnp.sum(take), sample // n, prompt_lengths)
    return s.replace(admitted=s.admitted + jnp.sum(take), sample=sample,
                     steps=jnp.where(take, 1, s.steps),
                     last_tokens=jnp.where(take, first[jnp.minimum(sample, r - 1)], s.last_tokens),
                     running=s.running | take, cache=cache)

  def decode(s: PoolState, sample_uniforms: Float[Array, "R M"] = uniforms) -> PoolState:
    u = s.slot_uniforms(sample_uniforms)
    if spec.kv_pages is not None:
      (logits, cache, fed_ids), vocab_axis = decoder.paged_step(s.last_tokens, s.cache, s.running)
    else:  # stopped slots skip attention
      (logits, cache, fed_ids), vocab_axis = decoder.step(s.last_tokens, s.cache, s.running)
    tokens, logp = spec.strategy(logits, u, temperature, top_k, top_p, vocab_axis=vocab_axis)
    if spec.kv_pages is None:
      cache = constrain(cache, pool_axes, mesh, rules)
    return s.replace(cache=cache).record(tokens, logp, spec.is_stop(tokens), fed_ids)

  if spec.kv_pages is not None:
    return paged_shards.run_paged(pool, decode, uniforms, prompt_cache, prompt_lengths, waiting,
                                  first, model.config, spec, mesh, rules
                                  ).replace(prompt_expert_ids=prompt_routing)
  for stage, size in enumerate(spec.slots):
    if stage:
      pool = _compact(pool, size)
      pool = pool.replace(cache=constrain(pool.cache, pool_axes, mesh, rules))
    smaller = spec.slots[stage + 1] if stage + 1 < len(spec.slots) else 0

    def busy(s: PoolState, smaller=smaller):  # samples wait, or more run than the next pool holds
      return (s.admitted < queued) | (jnp.sum(s.running) > smaller)
    step = (lambda s: decode(admit(s))) if stage == 0 else decode  # later, nothing waits
    pool = jax.lax.while_loop(busy, step, pool)
  return pool.replace(cache=None, prompt_expert_ids=prompt_routing)


_STATIC = ("graphdef", "spec", "mesh", "rules")
sample_pool = jax.jit(_sample_pool, static_argnames=_STATIC)
sample_pool_cpu = jax.jit(_sample_pool, static_argnames=_STATIC,
                          compiler_options=CPU_COMPILER_OPTIONS)


def pool_for(mesh: Mesh | None):
  """The compiled :func:`sample_pool` for the devices of ``mesh`` (the default devices without
  one): :data:`sample_pool_cpu` on CPU, else :data:`sample_pool`."""
  return sample_pool_cpu if on_cpu(mesh) else sample_pool
