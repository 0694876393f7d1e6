"""The compiled sampling program: prefill once per prompt, then ``jax.lax.while_loop`` decoding.

One call of :func:`sample_loop`, for ``B`` (bucketed) prompts of (bucketed) length ``P``,
``n`` samples each (``R = B * n`` rows) and ``M = max_new_tokens``:

1. prefill the ``B`` prompts into a ``P``-slot cache and draw every row's first token from the
   last prompt position's logits (``n`` rows per prompt: the prompt's cache rows and logits are
   repeated, never recomputed);
2. for each segment ``j`` with end ``E_j`` (:func:`segment_ends`: doubling, the last is ``M``):
   copy the cache so far into an ``R``-row cache of ``cache_slots(P, E_j)`` slots, then
   ``while step < E_j and not all(done)``: feed each row's last token, draw the next. A decode
   step reads every slot of its cache (on one CPU device, its attention kernel only the live
   ones), so growing caches keep a step's reads within about twice the live context; once every
   row is done, the remaining segments run no step.

Every segment's cache is made inside the program by padding the previous one, layer by layer
(:func:`_grow`): a growth holds the new cache and about one layer of the old one, where writing
into a preallocated (donated) final cache held all of the old one beside it, well above the
final cache at the last growth (``memory_analysis`` figures:
``docs/results/cpu.md#the-caches-layout``). No cache outlives the call.

A row is *done* once it has emitted a stop token (which it keeps) or is a dummy row padding the
batch bucket. Tokens drawn by done rows are not recorded: their slots hold token 0 and log-prob 0.
"""

from __future__ import annotations

import dataclasses

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh
from jaxtyping import Array, Bool, Float, Int, UInt32

from rft_jax.models.kv_cache import KVCache
from rft_jax.parallel import Rules, tree_shardings
from rft_jax.sampling import routing_record
from rft_jax.sampling.decoder import CPU_COMPILER_OPTIONS, Decoder, on_cpu
from rft_jax.sampling.keys import completion_keys, step_uniforms
from rft_jax.sampling.params import SamplingParams
from rft_jax.sampling.strategies import Strategy


@flax.struct.dataclass
class LoopState:
  """The ``while_loop`` carry.

  Attributes:
    step: tokens drawn so far (the column the next token is written to).
    last_tokens: ``[R]`` each row's latest token, the next decode input.
    done: ``[R]`` the row has stopped (or is a dummy).
    lengths: ``[R]`` tokens recorded per row.
    tokens: ``[R, M]`` recorded tokens, 0 after the end.
    logprobs: ``[R, M]`` their log-probabilities, 0 after the end.
    cache: the decode cache.
    expert_ids: an MoE model's ``[R, M, L, k]`` recorded routing of the fed tokens
      (:mod:`~rft_jax.sampling.routing_record`); None for a dense model.
    prompt_expert_ids: ``[B, P, L, k]`` the prompts' routing in the prefill; None when dense.
  """

  step: Int[Array, ""]
  last_tokens: Int[Array, "R"]
  done: Bool[Array, "R"]
  lengths: Int[Array, "R"]
  tokens: Int[Array, "R M"]
  logprobs: Float[Array, "R M"]
  cache: KVCache
  expert_ids: Array | None = None
  prompt_expert_ids: Array | None = None


def constrain(tree, axes, mesh: Mesh | None, rules: Rules):
  """``with_sharding_constraint`` from logical axis names (a no-op without a mesh)."""
  if mesh is None:
    return tree
  return jax.lax.with_sharding_constraint(tree, tree_shardings(tree, axes, mesh, rules))


def _record(state: LoopState, tokens: Int[Array, "R"], logp: Float[Array, "R"],
            stopped: Bool[Array, "R"], fed_ids: Int[Array, "L R k"] | None = None) -> LoopState:
  """Writes the tokens of the rows still running at column ``step`` and advances (``stopped``:
  the tokens that end their rows; ``fed_ids``: the experts of the tokens the step fed, those of
  column ``step - 1``)."""
  active = ~state.done
  if fed_ids is not None:
    rows = jnp.arange(active.shape[0])
    state = state.replace(expert_ids=routing_record.write_fed(
        state.expert_ids, rows, jnp.full_like(rows, state.step - 1), fed_ids, active))
  return state.replace(
      step=state.step + 1,
      last_tokens=tokens,
      done=state.done | (active & stopped),
      lengths=state.lengths + active.astype(jnp.int32),
      tokens=state.tokens.at[:, state.step].set(jnp.where(active, tokens, 0)),
      logprobs=state.logprobs.at[:, state.step].set(jnp.where(active, logp, 0.0)),
  )


SLOT_MULTIPLE = 16


def cache_slots(prompt_length: int, new_tokens: int) -> int:
  """Slots of a cache for ``new_tokens`` decode steps after a ``prompt_length``-slot prompt:
  ``P + E - 1`` (the last drawn token is never fed back) rounded up to a multiple of
  :data:`SLOT_MULTIPLE`. The spare slots stay masked; whole vector widths along the slot axis
  make the score product over ``[B, K, H, S]`` keys faster on CPU
  (``docs/results/cpu.md#the-caches-layout``)."""
  return -(-(prompt_length + new_tokens - 1) // SLOT_MULTIPLE) * SLOT_MULTIPLE


def segment_ends(max_new_tokens: int, segments: int,
                 min_tokens: int = SamplingParams.min_segment_tokens) -> tuple[int, ...]:
  """Token counts at which decode segments end: ``M, M/2, M/4, ...`` (at most ``segments``, none
  below ``min_tokens``), increasing; e.g. ``(896, 1792, 3584, 7168)`` for 7,168 and 4,
  ``(64, 128)`` for 128 and 4, ``(16, 32, 64, 128)`` for 128, 4 and 16."""
  ends = [max_new_tokens]
  while len(ends) < segments and ends[-1] // 2 >= min_tokens:
    ends.append(ends[-1] // 2)
  return tuple(reversed(ends))


@dataclasses.dataclass(frozen=True)
class DecodeSpec:
  """What shapes a compiled sampling program besides array shapes (hashable, a static argument).

  Attributes:
    n: samples per prompt.
    max_new_tokens: M.
    stop_token_ids: tokens that end a row.
    strategy: greedy or not, truncation or not.
    cache_dtype: the KV cache's dtype (None: the model's compute dtype).
    record_routing: an MoE model's program records its routing (``SamplingParams``).
  """

  n: int
  max_new_tokens: int
  stop_token_ids: tuple[int, ...]
  strategy: Strategy
  cache_dtype: jnp.dtype | None = None
  record_routing: bool = True

  @staticmethod
  def fields_of(params: SamplingParams, cache_dtype=None) -> dict:
    """The fields above, from the sampler parameters."""
    return dict(n=params.n, max_new_tokens=params.max_new_tokens,
                stop_token_ids=params.stop_token_ids, strategy=Strategy.of(params),
                cache_dtype=None if cache_dtype is None else jnp.dtype(cache_dtype),
                record_routing=params.record_routing)

  def is_stop(self, tokens: Int[Array, "..."]) -> Bool[Array, "..."]:
    """Whether each token ends its row."""
    if not self.stop_token_ids:
      return jnp.zeros(tokens.shape, bool)
    return jnp.isin(tokens, jnp.asarray(self.stop_token_ids, jnp.int32))


@dataclasses.dataclass(frozen=True)
class LoopSpec(DecodeSpec):
  """The static program's :class:`DecodeSpec`, and ``segment_ends``: :func:`segment_ends` of M."""

  segment_ends: tuple[int, ...] = ()

  @classmethod
  def of(cls, params: SamplingParams, cache_dtype=None) -> LoopSpec:
    return cls(segment_ends=segment_ends(params.max_new_tokens, params.cache_segments,
                                         params.min_segment_tokens),
               **DecodeSpec.fields_of(params, cache_dtype))


def _sample_loop(graphdef: nnx.GraphDef, state: nnx.State,
                 prompt_ids: Int[Array, "B P"], prompt_mask: Int[Array, "B P"],
                 fingerprints: UInt32[Array, "B 3"], live: Bool[Array, "B"],
                 seed: UInt32[Array, ""], temperature: Float[Array, ""],
                 top_k: Int[Array, ""], top_p: Float[Array, ""],
                 layer_ids: tuple[Int[Array, ""], ...] | None = None, *, spec: LoopSpec,
                 mesh: Mesh | None, rules: Rules) -> LoopState:
  """Samples ``spec.n`` completions of every prompt (see the module docstring).

  Args:
    graphdef, state: ``nnx.split(model)``; the parameter arrays are used where they are.
    prompt_ids, prompt_mask: left-padded prompts; dummy rows have an all-zero mask.
    fingerprints: per-prompt key material (:func:`~rft_jax.sampling.keys.prompt_fingerprints`).
    live: False on dummy prompts.
    seed: the call's seed.
    temperature, top_k, top_p: scalars (traced: changing them does not recompile).
    layer_ids: :func:`layer_indices` of the model, where the CPU program's prefill and decode
      weights slice each layer (:meth:`~rft_jax.models.Qwen.unstacked_layers`: as arguments,
      XLA:CPU compiles one set of per-layer kernels for every layer); None slices at constant
      offsets, which compiles those kernels once per layer. Accelerators slice at constant
      offsets either way: on TPU indexed slices cost memory and save no compile time
      (``docs/results/plans.md#the-papers-six-configs-dense-cache-v5p``).
    spec, mesh, rules: static; with a mesh, rows are laid out over its ``data`` axis.

  Returns:
    The final :class:`LoopState` without its cache (row ``b * n + j`` is sample ``j`` of prompt
    ``b``).
  """
  b, p = prompt_ids.shape
  n, m = spec.n, spec.max_new_tokens
  rows = ("batch", None)
  decoder = Decoder.of(graphdef, state, spec, mesh=mesh, rows=b * n, layer_ids=layer_ids)
  model = decoder.model

  prompt_cache = model.init_cache(b, p, dtype=spec.cache_dtype)
  axes = prompt_cache.logical_axes()
  prompt_cache = constrain(prompt_cache, axes, mesh, rules)
  logits, prompt_cache, prompt_routing = decoder.prefill(prompt_ids, prompt_mask, prompt_cache)
  routed = decoder.routed

  def repeat(x):
    return jnp.repeat(x, n, axis=0, total_repeat_length=x.shape[0] * n)

  logits = repeat(logits)
  uniforms = step_uniforms(completion_keys(seed, fingerprints, n), m)  # [R, M]
  uniforms = constrain(uniforms, rows, mesh, rules)

  r = b * n
  loop = LoopState(
      step=jnp.zeros((), jnp.int32),
      last_tokens=jnp.zeros((r,), jnp.int32),
      done=~repeat(live),
      lengths=jnp.zeros((r,), jnp.int32),
      tokens=constrain(jnp.zeros((r, m), jnp.int32), rows, mesh, rules),
      logprobs=constrain(jnp.zeros((r, m), jnp.float32), rows, mesh, rules),
      cache=None,
      expert_ids=routing_record.constrain_rows(
          routing_record.empty_record(model.config, r, m) if routed else None,
          lambda x, axes: constrain(x, axes, mesh, rules)),
  )
  tokens, logp = spec.strategy(logits, uniforms[:, 0], temperature, top_k, top_p)
  loop = _record(loop, tokens, logp, spec.is_stop(tokens))

  def body(s: LoopState) -> LoopState:
    # done rows skip attention
    (logits, cache, fed_ids), vocab_axis = decoder.step(s.last_tokens, s.cache, ~s.done)
    u = jax.lax.dynamic_index_in_dim(uniforms, s.step, axis=1, keepdims=False)
    tokens, logp = spec.strategy(logits, u, temperature, top_k, top_p, vocab_axis=vocab_axis)
    s = s.replace(cache=constrain(cache, axes, mesh, rules))
    return _record(s, tokens, logp, spec.is_stop(tokens), fed_ids)

  previous, repeats = prompt_cache, n
  for end in spec.segment_ends:
    grown = _grow(previous, cache_slots(p, end), repeats)
    loop = loop.replace(cache=constrain(grown, axes, mesh, rules))
    loop = jax.lax.while_loop(lambda s, end=end: (s.step < end) & ~jnp.all(s.done), body, loop)
    previous, repeats = loop.cache, 1
  return loop.replace(cache=None, prompt_expert_ids=prompt_routing)


_STATIC = ("graphdef", "spec", "mesh", "rules")
sample_loop = jax.jit(_sample_loop, static_argnames=_STATIC)

sample_loop_cpu = jax.jit(_sample_loop, static_argnames=_STATIC,
                          compiler_options=CPU_COMPILER_OPTIONS)


def layer_indices(num_layers: int) -> tuple[np.int32, ...]:
  """The ``layer_ids`` argument of :func:`sample_loop`: ``0 .. L-1``, one int32 scalar each."""
  return tuple(np.int32(i) for i in range(num_layers))


def loop_for(mesh: Mesh | None):
  """The compiled :func:`sample_loop` for the devices of ``mesh`` (the default devices without
  one): :data:`sample_loop_cpu` on CPU, else :data:`sample_loop`."""
  return sample_loop_cpu if on_cpu(mesh) else sample_loop


def _grow(cache: KVCache, slots: int, repeats: int) -> KVCache:
  """``cache`` with ``slots`` slots, the new ones empty, each row repeated ``repeats`` times (the
  prompt cache) or once (a previous segment's).

  Each layer's array is padded on its own: one pass that reads the old array and writes the new
  one, after which the old one is dead, so the peak holds the new cache and about one layer of
  the old (XLA frees each layer's old array after its last use); writing into a preallocated
  full cache would hold all of the old one beside all of the new.
  """
  def grow(x, axis):
    if repeats > 1:
      x = jnp.repeat(x, repeats, axis=0, total_repeat_length=x.shape[0] * repeats)
    if axis is None:
      return x
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, slots - x.shape[axis])
    return jnp.pad(x, pad)

  return KVCache(
      k=tuple(grow(k, 3) for k in cache.k),
      v=tuple(grow(v, 2) for v in cache.v),
      slot_mask=grow(cache.slot_mask, 1),
      positions=grow(cache.positions, None),
      index=cache.index,
  )
