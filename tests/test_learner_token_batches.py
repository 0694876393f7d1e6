"""Learner micro-batches by tokens (``learner.micro_batch_tokens``, ``rft_jax.rl.token_batches``):
the plan, the packed forward, and the step equal to row micro-batches on a long-tailed batch."""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rft_jax.models import Qwen, QwenConfig
from rft_jax.rl.learner import LearnerBatch
from rft_jax.rl.losses import AGGREGATIONS, aggregate_loss, aggregation_weights, loss_normaliser
from rft_jax.rl.token_batches import gather_tokens, packed_rows, row_spans, scatter_tokens, token_plan

VOCAB, PROMPT, COMPLETION, ROWS = 64, 8, 40, 32


def tiny_model(seed=0):
  config = QwenConfig(model_type="qwen3", vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=8, tie_word_embeddings=True)
  return Qwen(config, rngs=nnx.Rngs(seed))


def longtail_batch(rows=ROWS, seed=0) -> LearnerBatch:
  """Prompts of 2..8 tokens left-padded, completions mostly short (geometric, mean 6) and a few
  at the maximum, right-padded; advantages of both signs in groups of 4."""
  rng = np.random.default_rng(seed)
  prompt_len = rng.integers(2, PROMPT + 1, rows)
  completion_len = np.minimum(rng.geometric(1 / 6, rows), COMPLETION)
  completion_len[[0, 5, 11]] = COMPLETION
  column = np.arange(PROMPT + COMPLETION)[None]
  prompt_mask = (column >= PROMPT - prompt_len[:, None]) & (column < PROMPT)
  response_mask = (column >= PROMPT) & (column < PROMPT + completion_len[:, None])
  attention = prompt_mask | response_mask
  ids = np.where(attention, rng.integers(1, VOCAB, attention.shape), 0)
  rewards = rng.random(rows).reshape(-1, 4)
  advantages = ((rewards - rewards.mean(1, keepdims=True)) / rewards.std(1, keepdims=True)).reshape(-1)
  return LearnerBatch(input_ids=jnp.asarray(ids, jnp.int32), attention_mask=jnp.asarray(attention, jnp.int32),
                      response_mask=jnp.asarray(response_mask, jnp.float32),
                      advantages=jnp.asarray(advantages, jnp.float32),
                      sampler_logp=jnp.asarray(np.where(response_mask, -rng.exponential(2.0, attention.shape), 0.0),
                                               jnp.float32))


# ------------------------------------------------------------------------------------------
# The plan and the packed rows.


def test_token_plan_packs_every_real_token_once_within_its_mini_batch():
  batch = longtail_batch()
  mask = np.asarray(batch.attention_mask)
  rows, width = mask.shape
  index = token_plan(mask, micro_batch_tokens=3 * width, mini_batches=2, row_multiple=2)
  m, n, r, w = index.shape
  assert (m, r, w) == (2, 4, width) and n >= 1
  real = index[index < rows * width]
  np.testing.assert_array_equal(np.sort(real), np.flatnonzero(mask.reshape(-1)))  # each once
  for part in range(2):
    assert np.all(index[part][index[part] < rows * width] // width % 2 == part)
  # Long-tailed: far fewer packed rows than rows.
  used_rows = np.sum(np.any(index < rows * width, axis=-1))
  assert used_rows < rows / 2
  first, end = row_spans(mask)
  assert np.all(end - first == mask.sum(1))


def test_packed_forward_and_statistics_equal_the_rows():
  model = tiny_model()
  batch = longtail_batch()
  first_position = PROMPT - 1
  width = PROMPT + COMPLETION
  index = jnp.asarray(token_plan(np.asarray(batch.attention_mask), micro_batch_tokens=4 * width)).reshape(-1, width)
  packed = packed_rows(index, batch.input_ids, batch.attention_mask, first_position)
  assert int(jnp.max(packed.segment_ids)) > 0
  # Several sequences share a packed row.
  assert max(len(set(np.asarray(row).tolist()) - {0}) for row in packed.segment_ids) > 2
  hidden_rows = model(batch.input_ids, batch.attention_mask, return_hidden=True)
  hidden_packed = model(packed.input_ids, positions=packed.positions, segment_ids=packed.segment_ids,
                        return_hidden=True)
  # Every real token's hidden state equals its row's.
  rows_at = hidden_rows.reshape(-1, hidden_rows.shape[-1])
  real = np.asarray(index) < batch.input_ids.size
  tokens = np.asarray(index)[real]
  np.testing.assert_allclose(np.asarray(hidden_packed)[real], np.asarray(rows_at)[tokens], rtol=1e-5, atol=1e-5)
  # Without segment ids (one causal sequence per packed row) they differ: the ids do the work.
  leaky = model(packed.input_ids, positions=packed.positions, segment_ids=(packed.segment_ids > 0).astype(jnp.int32),
                return_hidden=True)
  assert float(jnp.max(jnp.abs(jnp.asarray(np.asarray(leaky)[real]) - rows_at[tokens]))) > 1e-2
  # Statistic slots go back to [B, T] and forth.
  stats_width = batch.input_ids.shape[1] - 1 - first_position
  response = batch.response_mask[:, first_position + 1:]
  back = scatter_tokens(gather_tokens(response, packed.stat_index), packed.stat_index, response.shape)
  np.testing.assert_array_equal(np.asarray(back), np.asarray(response))
  assert response.shape[1] == stats_width


@pytest.mark.parametrize("mode", AGGREGATIONS)
def test_aggregation_weights_equal_aggregate_loss(mode):
  rng = np.random.default_rng(1)
  mask = jnp.asarray(rng.random((6, 9)) < 0.6, jnp.float32).at[2].set(0.0)
  x = jnp.asarray(rng.standard_normal((6, 9)), jnp.float32)
  normaliser = loss_normaliser(mask, 12)
  expected = aggregate_loss(x, mask, mode, normaliser)
  assert float(jnp.sum(x * aggregation_weights(mask, mode, normaliser))) == pytest.approx(float(expected), rel=1e-6)
  # A normaliser of part of the batch (per micro-batch) would be caught.
  part = loss_normaliser(mask[:3], 12)
  assert abs(float(jnp.sum(x * aggregation_weights(mask, mode, part))) - float(expected)) > 1e-3 * abs(float(expected))
