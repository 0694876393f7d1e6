r"""Multi-turn decoding: rows that leave the decode loop when their turn ends and come back with
an environment's tokens appended to their own KV cache.

An agent's trajectory alternates the model's turns and an environment's replies (a tool's
output, a user's feedback). Its environment runs on the host, in Python, for as long as it takes;
so here the host drives the decoding, chunk by chunk, with three compiled programs on a pool of
``S`` rows (each a dense cache row of ``W`` slots with its own write index), the state kept on
the devices between them (:class:`TurnState`):

* :func:`reset_rows`: empties rows for new trajectories;
* :func:`feed`: appends tokens to rows' caches (a prompt for a new trajectory, an environment's
  reply for a waiting one), all rows of a call at once with :meth:`~rft_jax.models.Qwen.extend`,
  and sets the token each row's next decode step feeds; the rows' earlier slots are kept as they
  are (no re-prefill of the history);
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
history every turn (``keep_cache=False`` in :mod:`rft_jax.rollout.multi_turn`) samples the same
trajectories (log-probabilities to float32 rounding).

The decode step is the single-turn programs' (:meth:`rft_jax.sampling.decoder.Decoder.step`):
feature-major on CPU, the fused kernels on one GPU. A paused row still takes part in the weight
products (the step's shapes are the pool's) but not in attention, and its write index, position
and slot mask are kept (:func:`_keep_paused`), so the slot its step wrote is overwritten before
anything reads it.
"""

from __future__ import annotations

import dataclasses

import flax.struct
import numpy as np
import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh
from jaxtyping import Array, Bool, Float, Int, UInt32

from rft_jax.models.decode import feature_major
from rft_jax.models.kv_cache import KVCache
from rft_jax.parallel import Rules
from rft_jax.sampling.decoder import (CPU_COMPILER_OPTIONS, Decoder, backend_for, decode_state,
                                      on_cpu)
from rft_jax.sampling.loop import SLOT_MULTIPLE, constrain
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
    stop_token_ids: tokens that end a turn.
    strategy: greedy or not, truncation or not.
    cache_dtype: the KV cache's dtype (None: the model's compute dtype).
  """

  slots: int
  width: int
  stop_token_ids: tuple[int, ...]
  strategy: Strategy
  cache_dtype: jnp.dtype | None = None

  @classmethod
  def of(cls, params: SamplingParams, slots: int, width: int, cache_dtype=None) -> TurnSpec:
    return cls(slots=slots, width=-(-width // SLOT_MULTIPLE) * SLOT_MULTIPLE,
               stop_token_ids=params.stop_token_ids, strategy=Strategy.of(params),
               cache_dtype=None if cache_dtype is None else jnp.dtype(cache_dtype))

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
  k, h, layers = config.num_key_value_heads, config.head_dim, config.num_hidden_layers
  cache = KVCache(
      k=tuple(jnp.zeros((s, k, h, spec.width), dtype) for _ in range(layers)),
      v=tuple(jnp.zeros((s, k, spec.width, h), dtype) for _ in range(layers)),
      slot_mask=jnp.zeros((s, spec.width), bool), positions=jnp.zeros((s,), jnp.int32),
      index=jnp.zeros((s,), jnp.int32))
  zeros = lambda: jnp.zeros((s,), jnp.int32)  # noqa: E731  distinct buffers: the state is donated
  return TurnState(cache=cache, last_tokens=zeros(), keys=jnp.zeros((s, 2), jnp.uint32),
                   counts=zeros(), budget=zeros(), running=jnp.zeros((s,), bool))


def _feed(graphdef: nnx.GraphDef, model_state: DecodeModel, state: TurnState,
          rows: Int[Array, "F"], restart: Bool[Array, "F"], keys: UInt32[Array, "F 2"],
          counts: Int[Array, "F"], ids: Int[Array, "F T"], lengths: Int[Array, "F"],
          last: Int[Array, "F"], budget: Int[Array, "F"], *, spec: TurnSpec) -> TurnState:
  """Feeds ``F`` rows: row ``rows[f]`` (emptied first where ``restart[f]``: a new trajectory,
  its ``keys[f]`` and ``counts[f]`` set) gets ``ids[f, :lengths[f]]`` appended to its cache, then
  runs with ``last[f]`` as its next decode input and ``budget[f]`` draws left. Only these rows are
  computed (gathered, extended, written back); ``rows`` may repeat a row with the same inputs
  (padding ``F`` to a bucket), which writes the same values twice."""
  model = nnx.merge(graphdef, model_state.state)
  t = ids.shape[1]
  take = lambda x: x[rows]  # noqa: E731
  sub = jax.tree.map(take, state.cache)
  index = jnp.where(restart, 0, sub.index)
  # T spare slots while extending: the write of T slots from a row's index never clamps (its
  # real tokens end within W; the padding's slots are cut off again below).
  pad = lambda x, axis: jnp.pad(x, [(0, t) if a == axis else (0, 0) for a in range(x.ndim)])  # noqa: E731
  sub = KVCache(k=tuple(pad(k, 3) for k in sub.k), v=tuple(pad(v, 2) for v in sub.v),
                slot_mask=pad(sub.slot_mask & ~restart[:, None], 1),
                positions=jnp.where(restart, 0, sub.positions), index=index)
  mask = (jnp.arange(t)[None] < lengths[:, None]).astype(jnp.int32)
  _, sub = model.extend(ids, mask, sub)
  w = spec.width
  sub = KVCache(k=tuple(k[..., :w] for k in sub.k), v=tuple(v[:, :, :w] for v in sub.v),
                slot_mask=sub.slot_mask[:, :w], positions=sub.positions, index=index + lengths)
  put = lambda whole, part: whole.at[rows].set(part)  # noqa: E731
  return TurnState(
      cache=jax.tree.map(put, state.cache, sub),
      last_tokens=put(state.last_tokens, last),
      keys=put(state.keys, jnp.where(restart[:, None], keys, state.keys[rows])),
      counts=put(state.counts, jnp.where(restart, counts, state.counts[rows])),
      budget=put(state.budget, budget),
      running=put(state.running, jnp.ones_like(restart)))


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
            temperature: Float[Array, ""], top_k: Int[Array, ""], top_p: Float[Array, ""], *,
            steps: int, spec: TurnSpec, mesh: Mesh | None, rules: Rules
            ) -> tuple[TurnState, Chunk]:
  """Up to ``steps`` decode steps of the running rows (see the module docstring)."""
  config = nnx.merge(graphdef, model_state.state).config
  decoder = Decoder(graphdef, model_state.state, backend_for(config, spec, mesh, spec.slots),
                    mesh=mesh)  # the weights are decode_state's already: no copy
  decoder.decode_weights(model_state.weights)
  axes = state.cache.logical_axes()
  s = spec.slots
  keys = jax.random.wrap_key_data(state.keys)

  def body(carry):
    i, st, chunk = carry
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


class TurnPool:
  """The host's handle on a pool of ``S`` rows: queue feeds, run decode chunks, read the turns.

  ::

    pool = TurnPool(model, params, slots=64, width=4096)
    pool.start(row, prompt_ids, key, budget)    # a new trajectory in a free row
    turns = pool.decode(32)                      # {row: (tokens, logprobs, ended)} of the chunk
    pool.resume(row, reply_ids, budget)          # an environment's reply, then the model again

  Feeds queue on the host and go to the devices in one :func:`feed` call before the next chunk.
  """

  def __init__(self, model, params: SamplingParams, *, slots: int, width: int,
               mesh: Mesh | None = None, rules: Rules = (), cache_dtype=None):
    self.graphdef, state = nnx.split(model)
    self.config = model.config
    self.spec = TurnSpec.of(params, slots, width, cache_dtype)
    self.params, self.mesh, self.rules = params, mesh, rules
    self.model_state = decode_model(self.graphdef, state, mesh=mesh)
    self.state = empty_state(self.config, self.spec)
    self._feeds: dict[int, tuple[list[int], object, int, int]] = {}  # tokens, key, budget, drawn
    self._last: dict[int, int] = {}  # each paused row's last drawn token, not yet in its cache
    self.running: set[int] = set()

  @property
  def width(self) -> int:
    return self.spec.width

  def start(self, row: int, prompt: list[int], key_data, budget: int, drawn: int = 0) -> None:
    """Row ``row`` starts a trajectory: ``prompt`` (at least one token) goes into its emptied
    cache, ``key_data`` (``[2]`` uint32) is its key, ``budget`` the tokens it may draw.
    ``drawn``: the trajectory's draws so far, when its history is fed again (the next draw's
    random number is its ``drawn``-th)."""
    self._queue(row, list(prompt), key_data, budget, drawn)

  def resume(self, row: int, tokens: list[int], budget: int) -> None:
    """Paused row ``row`` goes on: its turn's last token and ``tokens`` (an environment's reply,
    at least one) appended to its cache, then the model draws again, ``budget`` tokens at most."""
    if row not in self._last:
      raise ValueError(f"TurnPool: row {row} has no ended turn to resume")
    self._queue(row, [self._last.pop(row)] + list(tokens), None, budget, 0)

  @property
  def queued(self) -> bool:
    """Feeds wait for the next :meth:`decode`."""
    return bool(self._feeds)

  def _queue(self, row: int, tokens: list[int], key_data, budget: int, drawn: int) -> None:
    if not tokens:
      raise ValueError(f"TurnPool: row {row} fed no tokens")
    if row in self.running or row in self._feeds or (key_data is not None and row in self._last):
      raise ValueError(f"TurnPool: row {row} is not paused or free")
    self._feeds[row] = (tokens, key_data, budget, drawn)

  def decode(self, steps: int) -> dict[int, tuple[list[int], list[float], bool]]:
    """Sends the queued feeds, then up to ``steps`` decode steps; returns, for every row that
    ran, its new tokens, their log-probabilities and whether its turn ended (the row paused)."""
    self._send_feeds()
    if not self.running:
      return {}
    program = decode_for(self.mesh)
    self.state, chunk = program(self.graphdef, self.model_state, self.state,
                                jnp.float32(self.params.temperature or 1.0),
                                jnp.int32(self.params.top_k), jnp.float32(self.params.top_p),
                                steps=steps, spec=self.spec, mesh=self.mesh, rules=self.rules)
    tokens, logprobs, drawn, running = jax.device_get(
        (chunk.tokens, chunk.logprobs, chunk.drawn, self.state.running))
    out = {}
    for row in sorted(self.running):
      k = int(drawn[row])
      out[row] = (tokens[row, :k].tolist(), logprobs[row, :k].tolist(), not bool(running[row]))
      if not running[row]:  # a row that ran draws at least once
        self.running.discard(row)
        self._last[row] = int(tokens[row, k - 1])
    return out

  def free(self, row: int) -> None:
    """Row ``row``'s trajectory is over: the row may start another."""
    self._last.pop(row, None)

  def _send_feeds(self) -> None:
    if not self._feeds:
      return
    fed = list(self._feeds.items())
    f = min(1 << (len(fed) - 1).bit_length(), self.spec.slots)  # a power of two, or all rows
    fed += [fed[0]] * (f - len(fed))  # the first row again: the same values written twice
    ids = np.zeros((f, feed_width(max(max(len(x[0]) - 1 for _, x in fed), 1))), np.int32)
    rows, lengths, last, budget, counts = (np.zeros((f,), np.int32) for _ in range(5))
    restart, keys = np.zeros((f,), bool), np.zeros((f, 2), np.uint32)
    for i, (row, (tokens, key_data, left, drawn)) in enumerate(fed):
      ids[i, :len(tokens) - 1] = tokens[:-1]  # the last one is the next decode step's input
      rows[i], lengths[i], last[i], budget[i] = row, len(tokens) - 1, tokens[-1], left
      if key_data is not None:  # a new trajectory, or a history fed again
        restart[i], keys[i], counts[i] = True, np.asarray(key_data, np.uint32), drawn
    self.state = feed(self.graphdef, self.model_state, self.state, rows, restart, keys, counts,
                      ids, lengths, last, budget, spec=self.spec)
    self.running.update(self._feeds)
    self._feeds.clear()
