r"""Multi-turn decoding: rows that leave the decode loop when their turn ends and come back with
an environment's tokens appended to their own KV cache.

An agent's trajectory alternates the model's turns and an environment's replies (a tool's
output, a user's feedback). Its environment runs on the host, in Python, for as long as it takes;
so here the host (:class:`~rft_jax.sampling.turn_pool.TurnPool`) drives the decoding, chunk by
chunk, with two compiled programs on a pool of ``S`` rows (each a dense cache row of ``W`` slots
with its own write index, or with ``sampling.kv_pages`` pages of a shared pool,
:mod:`~rft_jax.sampling.turn_pages`), the state kept on the devices between them
(:class:`TurnState`):

* :func:`feed`: appends tokens to rows' caches (a prompt for a new trajectory, emptying its row
  first; an environment's reply for a waiting one), the fed rows at once with
  :meth:`~rft_jax.models.Qwen.extend`, and sets the token each row's next decode step feeds; the
  rows' earlier slots are kept as they are (no re-prefill of the history);
* :func:`decode`: up to ``steps`` decode steps of the running rows; a row *pauses* (its turn
  ended) at a stop token or when its token budget runs out, and waits, its cache untouched,
  while the others go on; the host reads the chunk's tokens, hands the ended turns to their
  environments, and feeds the replies when they come.

A row's random numbers follow its trajectory, not its row or the chunks: token ``t`` of the
model's tokens of a trajectory (its ``t``-th draw, over all its turns) takes
``uniform(fold_in(k, t))`` with ``k`` the trajectory's key (:func:`rft_jax.sampling.keys.completion_keys`
of the seed, the prompt and the sample index), as :func:`rft_jax.sampling.keys.step_uniforms`
gives a single-turn completion's; so a trajectory's first turn is the completion
:func:`~rft_jax.sampling.generate` samples for the same seed, and a host that re-feeds the whole
history every turn (``rollout.keep_cache=false``, or a paged row evicted for lack of pages)
samples the same trajectories (log-probabilities to float32 rounding).

The decode step is the single-turn programs' (:meth:`rft_jax.sampling.decoder.Decoder.step`):
feature-major on CPU, the fused kernels on one GPU. A paused row still takes part in the weight
products (the step's shapes are the pool's) but not in attention, and its write index, position
and slot mask are kept (:func:`_keep_paused`), so the slot its step wrote is overwritten before
anything reads it.
"""

from __future__ import annotations

import dataclasses

import flax.struct
import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh
from jaxtyping import Array, Bool, Float, Int, UInt32

from rft_jax.models.decode import feature_major
from rft_jax.models.decode.paged_kv import init_paged_cache
from rft_jax.models.kv_cache import KVCache
from rft_jax.parallel import Rules
from rft_jax.sampling.decoder import (CPU_COMPILER_OPTIONS, Decoder, backend_for, decode_state,
                                      on_cpu)
from rft_jax.sampling.loop import SLOT_MULTIPLE, constrain
from rft_jax.sampling.turn_pages import extend_paged
from rft_jax.sampling.params import SamplingParams
from rft_jax.sampling.strategies import Strategy

FEED_MULTIPLE = 16  # feed widths are powers of two from this up: few compiled feed programs


@flax.struct.dataclass
class TurnState:
  """The pool of ``S`` rows between programs.

  Attributes:
    cache: ``S`` rows of ``W`` slots, one write index per row.
    last_tokens: ``[S]`` the token each row's next decode step feeds.
    keys: ``[S, 2]`` uint32 each row's trajectory key (``jax.random.key_data``).
    counts: ``[S]`` tokens the row's trajectory has drawn so far (its next draw's step).
    budget: ``[S]`` tokens the row may still draw before its trajectory is cut.
    running: ``[S]`` the row is in a turn (not paused, not free).
  """

  cache: KVCache
  last_tokens: Int[Array, "S"]
  keys: UInt32[Array, "S 2"]
  counts: Int[Array, "S"]
  budget: Int[Array, "S"]
  running: Bool[Array, "S"]


@dataclasses.dataclass(frozen=True)
class TurnSpec:
  """What shapes the multi-turn programs besides array shapes (a static argument).

  Attributes:
    slots: ``S``, rows in the pool.
    width: ``W``, cache slots per row (a trajectory's prompt and all its later tokens).
    kv_pages, page_size, paged_attention: a paged cache of ``kv_pages`` pages shared by the rows
      (``SamplingParams``; None: one dense row of ``W`` slots each).
    stop_token_ids: tokens that end a turn.
    strategy: greedy or not, truncation or not.
    cache_dtype: the KV cache's dtype (None: the model's compute dtype).
  """

  slots: int
  width: int
  stop_token_ids: tuple[int, ...]
  strategy: Strategy
  cache_dtype: jnp.dtype | None = None
  kv_pages: int | None = None
  page_size: int = 16
  paged_attention: str = "auto"

  @classmethod
  def of(cls, params: SamplingParams, slots: int, width: int, cache_dtype=None) -> TurnSpec:
    page = params.page_size if params.kv_pages is not None else SLOT_MULTIPLE
    return cls(slots=slots, width=-(-width // page) * page,
               stop_token_ids=params.stop_token_ids, strategy=Strategy.of(params),
               cache_dtype=None if cache_dtype is None else jnp.dtype(cache_dtype),
               kv_pages=params.kv_pages, page_size=params.page_size,
               paged_attention=params.paged_attention)

  @property
  def pages_per_row(self) -> int:
    """A paged pool's block-table width: the pages of ``width`` tokens."""
    return self.width // self.page_size

  def is_stop(self, tokens: Int[Array, "..."]) -> Bool[Array, "..."]:
    if not self.stop_token_ids:
      return jnp.zeros(tokens.shape, bool)
    return jnp.isin(tokens, jnp.asarray(self.stop_token_ids, jnp.int32))


def feed_width(tokens: int) -> int:
  """The compiled width of a :func:`feed` of at most ``tokens`` tokens a row: a power of two, at
  least :data:`FEED_MULTIPLE`."""
  width = FEED_MULTIPLE
  while width < tokens:
    width *= 2
  return width


class DecodeModel(flax.struct.PyTreeNode):
  """The model state the programs decode with, made once per rollout (:func:`decode_model`):
  on an accelerator the weights in the compute dtype laid out for decoding
  (:func:`~rft_jax.sampling.decoder.decode_state`), on CPU also the transposed weights of the
  feature-major step."""

  state: nnx.State
  weights: feature_major.DecodeWeights | None


def _decode_model(graphdef: nnx.GraphDef, state: nnx.State, *, mesh: Mesh | None) -> DecodeModel:
  model = nnx.merge(graphdef, state)
  if not on_cpu(mesh):
    return DecodeModel(decode_state(model, mesh), None)
  return DecodeModel(state, feature_major.decode_weights(model, model.unstacked_layers()))


decode_model = jax.jit(_decode_model, static_argnames=("graphdef", "mesh"))


def empty_state(config, spec: TurnSpec) -> TurnState:
  """A pool of free rows for a model of ``config`` (zeros, on the default device)."""
  s, dtype = spec.slots, spec.cache_dtype or config.dtype
  zeros = lambda: jnp.zeros((s,), jnp.int32)  # noqa: E731  distinct buffers: the state is donated
  if spec.kv_pages is not None:
    cache = init_paged_cache(config, spec.kv_pages, spec.page_size, s, spec.pages_per_row, dtype)
    return TurnState(cache=cache, last_tokens=zeros(), keys=jnp.zeros((s, 2), jnp.uint32),
                     counts=zeros(), budget=zeros(), running=jnp.zeros((s,), bool))
  k, h, layers = config.num_key_value_heads, config.head_dim, config.num_hidden_layers
  cache = KVCache(
      k=tuple(jnp.zeros((s, k, h, spec.width), dtype) for _ in range(layers)),
      v=tuple(jnp.zeros((s, k, spec.width, h), dtype) for _ in range(layers)),
      slot_mask=jnp.zeros((s, spec.width), bool), positions=jnp.zeros((s,), jnp.int32),
      index=jnp.zeros((s,), jnp.int32))
  return TurnState(cache=cache, last_tokens=zeros(), keys=jnp.zeros((s, 2), jnp.uint32),
                   counts=zeros(), budget=zeros(), running=jnp.zeros((s,), bool))


def _feed(graphdef: nnx.GraphDef, model_state: DecodeModel, state: TurnState,
          rows: Int[Array, "F"], restart: Bool[Array, "F"], keys: UInt32[Array, "F 2"],
          counts: Int[Array, "F"], ids: Int[Array, "F T"], lengths: Int[Array, "F"],
          last: Int[Array, "F"], budget: Int[Array, "F"], pages: Int[Array, "S W"] | None = None,
          *, spec: TurnSpec) -> TurnState:
  """Feeds ``F`` rows: row ``rows[f]`` (emptied first where ``restart[f]``: a new trajectory,
  its ``keys[f]`` and ``counts[f]`` set) gets ``ids[f, :lengths[f]]`` appended to its cache, then
  runs with ``last[f]`` as its next decode input and ``budget[f]`` draws left. Only these rows are
  computed (gathered, extended, written back); ``rows`` may repeat a row with the same inputs
  (padding ``F`` to a bucket), which writes the same values twice. ``pages``: a paged pool's block
  tables, as the host allocated them (each row's pages for its tokens after the feed)."""
  model = nnx.merge(graphdef, model_state.state)
  if spec.kv_pages is None:
    cache = _extend_dense(model, state.cache, rows, restart, ids, lengths, spec.width)
  else:
    cache = extend_paged(model, state.cache.replace(pages=pages), rows, restart, ids, lengths)
  put = lambda whole, part: whole.at[rows].set(part)  # noqa: E731
  return TurnState(
      cache=cache,
      last_tokens=put(state.last_tokens, last),
      keys=put(state.keys, jnp.where(restart[:, None], keys, state.keys[rows])),
      counts=put(state.counts, jnp.where(restart, counts, state.counts[rows])),
      budget=put(state.budget, budget),
      running=put(state.running, jnp.ones_like(restart)))


def _extend_dense(model, cache: KVCache, rows, restart, ids, lengths, width: int) -> KVCache:
  """``cache`` with rows ``rows`` (emptied first where ``restart``) extended by ``ids[f,
  :lengths[f]]``: the rows gathered, extended and written back."""
  t = ids.shape[1]
  sub = jax.tree.map(lambda x: x[rows], cache)
  index = jnp.where(restart, 0, sub.index)
  # T spare slots while extending: the write of T slots from a row's index never clamps (its
  # real tokens end within W; the padding's slots are cut off again below).
  pad = lambda x, axis: jnp.pad(x, [(0, t) if a == axis else (0, 0) for a in range(x.ndim)])  # noqa: E731
  sub = KVCache(k=tuple(pad(k, 3) for k in sub.k), v=tuple(pad(v, 2) for v in sub.v),
                slot_mask=pad(sub.slot_mask & ~restart[:, None], 1),
                positions=jnp.where(restart, 0, sub.positions), index=index)
  mask = (jnp.arange(t)[None] < lengths[:, None]).astype(jnp.int32)
  _, sub = model.extend(ids, mask, sub)
  sub = KVCache(k=tuple(k[..., :width] for k in sub.k), v=tuple(v[:, :, :width] for v in sub.v),
                slot_mask=sub.slot_mask[:, :width], positions=sub.positions, index=index + lengths)
  return jax.tree.map(lambda whole, part: whole.at[rows].set(part), cache, sub)


def _keep_paused(before: KVCache, after: KVCache, running: Bool[Array, "S"]) -> KVCache:
  """``after`` with the rows not ``running`` at their write index, position and slot mask of
  ``before``: a decode step wrote a slot of theirs, which stays masked and is written again
  before anything reads it."""
  return after.replace(index=jnp.where(running, after.index, before.index),
                       positions=jnp.where(running, after.positions, before.positions),
                       slot_mask=jnp.where(running[:, None], after.slot_mask, before.slot_mask))


class Chunk(flax.struct.PyTreeNode):
  """A :func:`decode` call's draws: ``tokens`` and ``logprobs`` ``[S, steps]`` (row ``s``'s
  first ``drawn[s]`` columns are its new tokens), and ``drawn`` ``[S]``."""

  tokens: Int[Array, "S N"]
  logprobs: Float[Array, "S N"]
  drawn: Int[Array, "S"]


def _decode(graphdef: nnx.GraphDef, model_state: DecodeModel, state: TurnState,
            temperature: Float[Array, ""], top_k: Int[Array, ""], top_p: Float[Array, ""],
            active: Bool[Array, "S"], pages: Int[Array, "S W"] | None = None, *,
            steps: int, spec: TurnSpec, mesh: Mesh | None, rules: Rules
            ) -> tuple[TurnState, Chunk]:
  """Up to ``steps`` decode steps of the running rows that are ``active`` (see the module
  docstring; the host pauses a paged row it takes the pages of); ``pages``: a paged pool's block
  tables, each running row's pages for its next ``steps`` tokens allocated."""
  config = nnx.merge(graphdef, model_state.state).config
  decoder = Decoder(graphdef, model_state.state, backend_for(config, spec, mesh, spec.slots),
                    mesh=mesh)  # the weights are decode_state's already: no copy
  decoder.decode_weights(model_state.weights)
  paged = spec.kv_pages is not None
  state = state.replace(running=state.running & active)
  if paged:
    state = state.replace(cache=state.cache.replace(pages=pages))
  axes = None if paged else state.cache.logical_axes()
  s = spec.slots
  keys = jax.random.wrap_key_data(state.keys)

  def body(carry):
    i, st, chunk = carry
    if paged:  # the rows not running write nothing, their lengths kept
      (logits, cache, _), vocab_axis = decoder.paged_step(st.last_tokens, st.cache, st.running)
    else:
      (logits, cache, _), vocab_axis = decoder.step(st.last_tokens, st.cache, st.running)
      cache = constrain(_keep_paused(st.cache, cache, st.running), axes, mesh, rules)
    u = jax.vmap(lambda k, t: jax.random.uniform(jax.random.fold_in(k, t), (), jnp.float32))(
        keys, st.counts)
    tokens, logp = spec.strategy(logits, u, temperature, top_k, top_p, vocab_axis=vocab_axis)
    run = st.running
    chunk = Chunk(tokens=chunk.tokens.at[:, i].set(jnp.where(run, tokens, 0)),
                  logprobs=chunk.logprobs.at[:, i].set(jnp.where(run, logp, 0.0)),
                  drawn=chunk.drawn + run)
    ended = spec.is_stop(tokens) | (st.budget <= 1)
    st = st.replace(cache=cache, last_tokens=jnp.where(run, tokens, st.last_tokens),
                    counts=st.counts + run, budget=st.budget - run, running=run & ~ended)
    return i + 1, st, chunk

  chunk = Chunk(tokens=jnp.zeros((s, steps), jnp.int32), logprobs=jnp.zeros((s, steps), jnp.float32),
                drawn=jnp.zeros((s,), jnp.int32))
  _, state, chunk = jax.lax.while_loop(
      lambda c: (c[0] < steps) & jnp.any(c[1].running), body, (jnp.zeros((), jnp.int32), state, chunk))
  return state, chunk


_DECODE_STATIC = ("graphdef", "steps", "spec", "mesh", "rules")
feed = jax.jit(_feed, static_argnames=("graphdef", "spec"), donate_argnames=("state",))
decode = jax.jit(_decode, static_argnames=_DECODE_STATIC, donate_argnames=("state",))
decode_cpu = jax.jit(_decode, static_argnames=_DECODE_STATIC, donate_argnames=("state",),
                     compiler_options=CPU_COMPILER_OPTIONS)


def decode_for(mesh: Mesh | None):
  """The compiled :func:`decode` for the devices of ``mesh``: :data:`decode_cpu` on CPU."""
  return decode_cpu if on_cpu(mesh) else decode
