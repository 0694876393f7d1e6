"""The compiled sampling program: prefill once per prompt, then one ``jax.lax.while_loop``.

One call of :func:`sample_loop`, for ``B`` (bucketed) prompts of (bucketed) length ``P``,
``n`` samples each (``R = B * n`` rows) and ``M = max_new_tokens``:

1. prefill the ``B`` prompts into a ``P``-slot cache and draw every row's first token from the
   last prompt position's logits (``n`` rows per prompt: the prompt's cache rows and logits are
   repeated, never recomputed);
2. copy the repeated prompt keys/values into the donated ``R``-row cache of ``P + M - 1`` slots;
3. ``while step < M and not all(done)``: feed each row's last token, draw the next.

A row is *done* once it has emitted a stop token (which it keeps) or is a dummy row padding the
batch bucket. Tokens drawn by done rows are not recorded: their slots hold token 0 and log-prob 0.
"""

from __future__ import annotations

import dataclasses
import functools

import flax.struct
import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh
from jaxtyping import Array, Bool, Float, Int, UInt32

from rft_jax.models.kv_cache import KVCache
from rft_jax.parallel import Rules, tree_shardings
from rft_jax.sampling.keys import completion_keys, step_keys
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
  """

  step: Int[Array, ""]
  last_tokens: Int[Array, "R"]
  done: Bool[Array, "R"]
  lengths: Int[Array, "R"]
  tokens: Int[Array, "R M"]
  logprobs: Float[Array, "R M"]
  cache: KVCache


def _constrain(tree, axes, mesh: Mesh | None, rules: Rules):
  """``with_sharding_constraint`` from logical axis names (a no-op without a mesh)."""
  if mesh is None:
    return tree
  return jax.lax.with_sharding_constraint(tree, tree_shardings(tree, axes, mesh, rules))


def _record(state: LoopState, tokens: Int[Array, "R"], logp: Float[Array, "R"],
            stop_token_ids: tuple[int, ...]) -> LoopState:
  """Writes the tokens of the rows still running at column ``step`` and advances."""
  active = ~state.done
  stopped = (jnp.isin(tokens, jnp.asarray(stop_token_ids, jnp.int32)) if stop_token_ids
             else jnp.zeros_like(active))
  return state.replace(
      step=state.step + 1,
      last_tokens=tokens,
      done=state.done | (active & stopped),
      lengths=state.lengths + active.astype(jnp.int32),
      tokens=state.tokens.at[:, state.step].set(jnp.where(active, tokens, 0)),
      logprobs=state.logprobs.at[:, state.step].set(jnp.where(active, logp, 0.0)),
  )


@dataclasses.dataclass(frozen=True)
class LoopSpec:
  """What shapes the compiled program besides array shapes (hashable, a static argument).

  Attributes:
    n: samples per prompt.
    max_new_tokens: M.
    stop_token_ids: tokens that end a row.
    strategy: greedy or not, truncation or not.
  """

  n: int
  max_new_tokens: int
  stop_token_ids: tuple[int, ...]
  strategy: Strategy

  @classmethod
  def of(cls, params: SamplingParams) -> LoopSpec:
    return cls(params.n, params.max_new_tokens, params.stop_token_ids, Strategy.of(params))


@functools.partial(jax.jit, static_argnames=("graphdef", "spec", "mesh", "rules"),
                   donate_argnames=("cache",))
def sample_loop(graphdef: nnx.GraphDef, state: nnx.State, cache: KVCache,
                prompt_ids: Int[Array, "B P"], prompt_mask: Int[Array, "B P"],
                fingerprints: UInt32[Array, "B 3"], live: Bool[Array, "B"],
                seed: UInt32[Array, ""], temperature: Float[Array, ""],
                top_k: Int[Array, ""], top_p: Float[Array, ""], *, spec: LoopSpec,
                mesh: Mesh | None, rules: Rules) -> tuple[LoopState, KVCache]:
  """Samples ``spec.n`` completions of every prompt (see the module docstring).

  Args:
    graphdef, state: ``nnx.split(model)``; the parameter arrays are used where they are.
    cache: an empty cache of ``B * n`` rows and ``P + M - 1`` slots, donated.
    prompt_ids, prompt_mask: left-padded prompts; dummy rows have an all-zero mask.
    fingerprints: per-prompt key material (:func:`~rft_jax.sampling.keys.prompt_fingerprints`).
    live: False on dummy prompts.
    seed: the call's seed.
    temperature, top_k, top_p: scalars (traced: changing them does not recompile).
    spec, mesh, rules: static; with a mesh, rows are laid out over its ``data`` axis.

  Returns:
    The final :class:`LoopState` without its cache (row ``b * n + j`` is sample ``j`` of prompt
    ``b``), and the cache (returned so that the donated buffer is reused in place).
  """
  model = nnx.merge(graphdef, state)
  b, p = prompt_ids.shape
  n, m = spec.n, spec.max_new_tokens
  axes = KVCache.logical_axes()
  rows = ("batch", None)

  prompt_cache = _constrain(model.init_cache(b, p, dtype=cache.k.dtype), axes, mesh, rules)
  logits, prompt_cache = model.prefill(prompt_ids, prompt_mask, prompt_cache)

  def repeat(x, axis):
    return jnp.repeat(x, n, axis=axis, total_repeat_length=x.shape[axis] * n)

  cache = KVCache(
      k=cache.k.at[:, :, :p].set(repeat(prompt_cache.k, 1)),
      v=cache.v.at[:, :, :p].set(repeat(prompt_cache.v, 1)),
      slot_mask=jnp.zeros_like(cache.slot_mask).at[:, :p].set(repeat(prompt_cache.slot_mask, 0)),
      positions=repeat(prompt_cache.positions, 0),
      index=jnp.asarray(p, jnp.int32),
  )
  cache = _constrain(cache, axes, mesh, rules)
  logits = repeat(logits, 0)
  keys = completion_keys(seed, fingerprints, n)

  r = b * n
  init = LoopState(
      step=jnp.zeros((), jnp.int32),
      last_tokens=jnp.zeros((r,), jnp.int32),
      done=~repeat(live, 0),
      lengths=jnp.zeros((r,), jnp.int32),
      tokens=_constrain(jnp.zeros((r, m), jnp.int32), rows, mesh, rules),
      logprobs=_constrain(jnp.zeros((r, m), jnp.float32), rows, mesh, rules),
      cache=cache,
  )
  tokens, logp = spec.strategy(logits, step_keys(keys, init.step), temperature, top_k, top_p)
  init = _record(init, tokens, logp, spec.stop_token_ids)

  def cond(s: LoopState):
    return (s.step < m) & ~jnp.all(s.done)

  def body(s: LoopState) -> LoopState:
    logits, cache = model.decode_step(s.last_tokens, s.cache)
    tokens, logp = spec.strategy(logits, step_keys(keys, s.step), temperature, top_k, top_p)
    s = s.replace(cache=_constrain(cache, axes, mesh, rules))
    return _record(s, tokens, logp, spec.stop_token_ids)

  final = jax.lax.while_loop(cond, body, init)
  return final.replace(cache=None), final.cache
