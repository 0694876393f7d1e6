"""What a sampler records of a mixture-of-experts model's routing, for rollout routing replay.

An MoE sampler records, for every token it runs through the decoder, the experts each layer sent
it to: the prompt tokens' from the prefill (``[B, P, L, k]``) and each completion token's from
the decode step that fed it (``[R, M, L, k]``; a completion's last token is drawn, never fed: 0
there, as on padding). They are stored compactly
(:func:`~rft_jax.sampling.rollouts.compact_expert_ids`: uint8 up to 256 experts) and become
:attr:`~rft_jax.sampling.rollouts.Rollouts.prompt_expert_ids` and ``completion_expert_ids``; the
learner replays them (``learner.routing_replay``) and measures its routing against them.
A dense model records nothing: its programs are unchanged.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Int

from rft_jax.sampling.rollouts import compact_expert_ids


def records_routing(model, spec) -> bool:
  """Whether the sampler records ``model``'s routing: an MoE model's, unless ``spec`` (a
  ``DecodeSpec``) says not to (``SamplingParams.record_routing``)."""
  return bool(getattr(model.config, "is_moe", False)) and spec.record_routing


def empty_record(config, rows: int, columns: int) -> Array:
  """``[rows, columns, L, k]`` zeros in the compact dtype, to record into."""
  shape = (rows, columns, config.num_hidden_layers, config.num_experts_per_tok)
  return jnp.zeros(shape, compact_expert_ids(np.zeros(0), config.num_experts).dtype)


def prefill(model, prompt_ids, prompt_mask, cache, *, mesh, layers, routed: bool):
  """``model.prefill``: ``(logits, cache, prompt routing [B, P, L, k] or None)``."""
  if not routed:
    return (*model.prefill(prompt_ids, prompt_mask, cache, mesh=mesh, layers=layers), None)
  logits, cache, expert_ids = model.prefill(prompt_ids, prompt_mask, cache, mesh=mesh, layers=layers,
                                            return_routing=True)  # [L, B, P, k]
  return logits, cache, compact_expert_ids(jnp.moveaxis(expert_ids, 0, 2), model.config.num_experts)


def asked(routed: bool) -> dict:
  """The keyword arguments that ask a decode step for its routing (none for a dense model)."""
  return {"return_routing": True} if routed else {}


def split_step(out: tuple, routed: bool):
  """A decode step's ``(logits, cache[, expert ids [L, S, k]])`` as ``(logits, cache, ids or None)``."""
  return (out[0], out[1], out[2]) if routed else (out[0], out[1], None)


def write_fed(record: Array, rows: Int[Array, "S"], columns: Int[Array, "S"], fed_ids: Int[Array, "L S k"],
              keep: Bool[Array, "S"]) -> Array:
  """``record`` (``[R, M, L, k]``) with the experts of the tokens a decode step fed: slot ``s``'s
  at ``(rows[s], columns[s])`` where ``keep[s]`` (elsewhere nothing is written)."""
  r = record.shape[0]
  ids = jnp.swapaxes(fed_ids, 0, 1).astype(record.dtype)  # [S, L, k]
  target = jnp.where(keep, rows, r)  # out of range: dropped
  return record.at[target, jnp.clip(columns, 0, record.shape[1] - 1)].set(ids, mode="drop")


def constrain_rows(x: Array | None, constrain) -> Array | None:
  """``x`` (``[R, ...]`` or None) with its rows laid out by ``constrain(x, axes)``."""
  return None if x is None else constrain(x, ("batch",) + (None,) * (x.ndim - 1))
