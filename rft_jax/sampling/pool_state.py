"""The state of continuous batching's decode pool, and what a decode step records in it."""

from __future__ import annotations

import flax.struct
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from rft_jax.models.kv_cache import KVCache
from rft_jax.models.decode.paged_kv import PagedKVCache
from rft_jax.sampling.routing_record import write_fed


@flax.struct.dataclass
class PoolState:
  """The ``while_loop`` carry of continuous batching (``S`` slots, ``R`` samples, ``M`` tokens).

  Attributes:
    admitted: queued samples that have entered a slot so far.
    sample: ``[S]`` the sample each slot decodes (``R`` when the slot is free).
    steps: ``[S]`` tokens its sample has drawn (the column its next token is written to).
    last_tokens: ``[S]`` each slot's latest token, the next decode input.
    running: ``[S]`` the slot holds a sample that has not ended.
    cache: the pool's decode cache: a :class:`KVCache` with one write index per slot, or a
      :class:`PagedKVCache`.
    tokens: ``[R, M]`` every sample's tokens, 0 after its end.
    logprobs: ``[R, M]`` their log-probabilities, 0 after the end.
    lengths: ``[R]`` tokens per sample.
    done: ``[R]`` the sample ended with a stop token (or is a dummy row).
    expert_ids: an MoE model's ``[R, M, L, k]`` recorded routing of the fed tokens
      (:mod:`~rft_jax.sampling.routing_record`); None for a dense model.
    prompt_expert_ids: ``[B, P, L, k]`` the prompts' routing in the prefill (set at the end).
  """

  admitted: Int[Array, ""]
  sample: Int[Array, "S"]
  steps: Int[Array, "S"]
  last_tokens: Int[Array, "S"]
  running: Bool[Array, "S"]
  cache: KVCache | PagedKVCache | None
  tokens: Int[Array, "R M"]
  logprobs: Float[Array, "R M"]
  lengths: Int[Array, "R"]
  done: Bool[Array, "R"]
  expert_ids: Array | None = None
  prompt_expert_ids: Array | None = None

  def record(self, tokens: Int[Array, "S"], logp: Float[Array, "S"], stop: Bool[Array, "S"],
             fed_ids: Int[Array, "L S k"] | None = None) -> PoolState:
    """The state after a decode step drew ``tokens`` (``logp``; ``stop``: they are stop
    tokens) in every slot: the running slots' samples get them at their next column, and a
    slot stops running at a stop token or at ``M`` tokens. ``fed_ids``: the experts of the
    tokens the step fed (each running sample's previous column)."""
    r, m = self.tokens.shape
    column = jnp.minimum(self.steps, m - 1)
    target = jnp.where(self.running, self.sample, r)  # out of range: dropped
    if fed_ids is not None:
      self = self.replace(expert_ids=write_fed(self.expert_ids, self.sample, self.steps - 1, fed_ids,
                                               self.running))
    return self.replace(
        steps=self.steps + 1,
        last_tokens=tokens,
        running=self.running & ~stop & (self.steps + 1 < m),
        tokens=self.tokens.at[target, column].set(tokens, mode="drop"),
        logprobs=self.logprobs.at[target, column].set(logp, mode="drop"),
        lengths=self.lengths.at[target].set(self.steps + 1, mode="drop"),
        done=self.done.at[target].set(stop, mode="drop"),
    )

  def slot_uniforms(self, uniforms: Float[Array, "R M"]) -> Float[Array, "S"]:
    """Each slot's uniform number for its next token (by sample and column, not by slot)."""
    r, m = self.tokens.shape
    return uniforms[jnp.minimum(self.sample, r - 1), jnp.minimum(self.steps, m - 1)]
