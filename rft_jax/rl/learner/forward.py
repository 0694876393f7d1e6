"""The learner's forward passes (:class:`ForwardPasses`, a part of
:class:`~rft_jax.rl.learner.Learner`): the per-token statistics of a micro-batch of rows or of
packed rows, and of a whole batch micro-batch by micro-batch, each with its router counts on a
mixture-of-experts policy (``routing.py``; ``{}`` on a dense one, whose program is unchanged)."""

from __future__ import annotations

import jax

from rft_jax.entropy import token_stats
from rft_jax.rl.batching import first_stats_position, merge_rows, split_rows
from rft_jax.rl.learner import routing
from rft_jax.rl.learner.batch import LearnerBatch
from rft_jax.rl.token_batches import PackedRows, gather_slots, packed_rows, scatter_tokens


class ForwardPasses:
  """The forward passes of a :class:`~rft_jax.rl.model_trainer.ModelTrainer` with a learner's
  ``config``, step ``plan`` and ``router`` (:class:`routing.RouterTerms` or None)."""

  def _token_stats(self, params, input_ids, attention_mask, entropy_grad=False, first_position=0, routed=None):
    """Stats of the next-token positions ``first_position .. L-2``, ``[b, L-1-first_position]``
    (position t predicts token t+1), and the forward's router counts (``routing.forward``;
    ``routed``: the sampler's expert ids). The decoder runs over all ``L`` tokens; only the hidden
    states of those positions go through the unembedding."""
    model = self.merge(params)
    hidden, counts = routing.forward(model, self.router, routed, attention_mask, input_ids, attention_mask,
                                     mesh=self.mesh)
    return token_stats(hidden[:, first_position:-1], input_ids[:, first_position + 1:],
                       unembedding=model.unembedding(), product_dtype=model.config.dtype,
                       temperature=self.config.sampling_temperature, chunk_size=self.config.stats_chunk_size,
                       entropy_grad=entropy_grad), counts

  def _packed_token_stats(self, params, packed: PackedRows, entropy_grad=False, routed=None):
    """``token_stats`` ``[r, W]`` of packed rows (``rft_jax.rl.token_batches``): every slot, the
    statistic of predicting ``packed.targets`` (meaningful where ``packed.stat_index`` maps); and
    the router counts (``routed``: in the packed layout)."""
    model = self.merge(params)
    hidden, counts = routing.forward(model, self.router, routed, packed.segment_ids > 0, packed.input_ids,
                                     positions=packed.positions, segment_ids=packed.segment_ids, mesh=self.mesh)
    return token_stats(hidden, packed.targets, unembedding=model.unembedding(), product_dtype=model.config.dtype,
                       temperature=self.config.sampling_temperature, chunk_size=self.config.stats_chunk_size,
                       entropy_grad=entropy_grad), counts

  def batch_stats(self, params, batch: LearnerBatch, stats_from_column: int = 0, entropy_grad: bool = False,
                  token_index: jax.Array | None = None):
    """The statistics of :meth:`batch_stats_and_router` (same arguments)."""
    return self.batch_stats_and_router(params, batch, stats_from_column, entropy_grad, token_index)[0]

  def batch_stats_and_router(self, params, batch: LearnerBatch, stats_from_column: int = 0,
                             entropy_grad: bool = False, token_index: jax.Array | None = None):
    """``token_stats`` of ``batch``'s next-token positions predicting the tokens of columns
    ``max(stats_from_column, 1) ..`` (``[B, L-1-p]``, ``p = first_stats_position(stats_from_column)``;
    ``[B, L-1]`` by default), micro-batch by micro-batch; ``entropy_grad``: the entropy carries
    derivatives (``token_stats``). ``token_index``: the ``[M, n, r, L]`` plan of
    :meth:`token_plan`: packed micro-batches (0 where a position predicts no real token).
    Returns ``(stats, counts)``: the router counts summed over the micro-batches ({} dense)."""
    routed = routing.routed_inputs(batch)
    if token_index is not None:
      rows, width = batch.input_ids.shape
      first_position = first_stats_position(stats_from_column)
      parts = token_index.reshape(-1, *token_index.shape[2:])  # [M * n, r, L]
      packed = PackedRows(*(self.constrain_micro_batches(x) for x in packed_rows(
          parts, batch.input_ids, batch.attention_mask, first_position)))
      routed = {k: self.constrain_micro_batches(gather_slots(parts, v)) for k, v in routed.items()}
      stats, counts = jax.lax.map(lambda xs: self._packed_token_stats(params, xs[0], entropy_grad, xs[1]),
                                  (packed, routed))
      shape = (rows, width - 1 - first_position)
      return jax.tree.map(lambda x: scatter_tokens(x, packed.stat_index, shape), stats), routing.summed(counts)
    n = self.plan.micro_batches(batch.input_ids.shape[0])
    ids, attn = (self.constrain_micro_batches(split_rows(x, n)) for x in (batch.input_ids, batch.attention_mask))
    routed = {k: self.constrain_micro_batches(split_rows(v, n)) for k, v in routed.items()}
    first_position = first_stats_position(stats_from_column)
    stats, counts = jax.lax.map(lambda xs: self._token_stats(params, xs[0], xs[1], entropy_grad, first_position,
                                                             routed=xs[2]), (ids, attn, routed))
    return jax.tree.map(merge_rows, stats), routing.summed(counts)
