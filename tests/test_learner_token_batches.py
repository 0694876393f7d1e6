"""Learner micro-batches by tokens (``learner.micro_batch_tokens``, ``rft_jax.rl.token_batches``):
the plan, the packed forward, and the step equal to row micro-batches on a long-tailed batch."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rft_jax.models import Qwen, QwenConfig
from rft_jax.parallel import make_mesh, shard_model
from rft_jax.rl.config import EntropyMaskConfig, LearnerConfig
from rft_jax.rl.learner import Learner, LearnerBatch
from rft_jax.rl.losses import AGGREGATIONS, aggregate_loss, aggregation_weights, loss_normaliser
from rft_jax.rl.token_batches import gather_tokens, packed_rows, row_spans, scatter_tokens, token_plan
from test_learner import nested_optim

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


def config(**kw):
  # adam_eps = 1: Adam's first update is lr * g / (|g| + 1), about linear in the gradient, so equal
  # updated parameters mean equal gradients (with a small epsilon it is lr * sign(g)).
  base = dict(lr=0.1, adam_eps=1.0, micro_batch_size=8, max_grad_norm=None, forecast_every=0)
  base.update(kw)
  return LearnerConfig(**nested_optim(base))


def run_step(cfg, batch, mesh=None):
  """``(metrics, rows, [updated - initial parameter leaves] / lr)`` of one step."""
  model = tiny_model()
  start = [np.asarray(x) for x in jax.tree.leaves(nnx.state(model, nnx.Param))]
  if mesh is not None:
    model = shard_model(model, mesh)
  learner = Learner(model, cfg, mesh=mesh)
  state, metrics, rows = learner.step(learner.init(model), batch, rows=True)
  moves = [(np.asarray(b) - a) / cfg.optim.lr for a, b in zip(start, jax.tree.leaves(state.params))]
  return metrics, rows, moves


def assert_same_step(rows_step, tokens_step, masked=False):
  (m1, r1, g1), (m2, r2, g2) = rows_step, tokens_step
  assert set(m1) == set(m2)
  for key in m1:
    assert m2[key] == pytest.approx(m1[key], rel=2e-5, abs=1e-6), key
  for key in r1:
    np.testing.assert_allclose(r2[key], r1[key], rtol=2e-5, atol=1e-6, err_msg=key)
  scale = max(float(np.max(np.abs(g))) for g in g1)
  assert scale > 1e-3  # the parameters moved: the comparison below is not of zeros
  for a, b in zip(g1, g2):
    np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-5 * scale)
  assert m1["grad_norm"] > 1e-3 and m1["entropy"] > 0 and m1["response_tokens"] > 0
  if masked:
    assert 0 < m1["mask_frac"] < 1 and r1["masked_tokens"].sum() > 0


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


# ------------------------------------------------------------------------------------------
# The step: row micro-batches against token micro-batches.

CASES = {
    "token-mean": dict(forecast_every=1),  # and the measured entropy change and its forecasts
    "seq-mean-token-mean": dict(loss_agg="seq-mean-token-mean"),
    "clip_v": dict(entropy_mask=EntropyMaskConfig(kind="clip_v", mu_low=1.0, max_frac=0.05)),
    # Clip_B's statistics over the whole batch, across mini-batches and epochs (one mini-batch
    # and one epoch is the same path with fewer iterations).
    "clip_b-mini-batches": dict(entropy_mask=EntropyMaskConfig(kind="clip_b", mu_low=0.5),
                                mini_batches=2, ppo_epochs=2),
    # GSPO's sequence ratio: over each row's tokens, and over each packed segment's; after the
    # first update the ratios move, and the clip (0.05) binds on some sequences.
    "gspo-clip_b-mini-batches": dict(objective="gspo", eps_low=0.05, eps_high=0.05,
                                     entropy_mask=EntropyMaskConfig(kind="clip_b", mu_low=0.5),
                                     mini_batches=2, ppo_epochs=2),
}


@pytest.mark.parametrize("case", list(CASES))
def test_token_micro_batches_equal_row_micro_batches(case):
  batch = longtail_batch()
  kw = CASES[case]
  rows_step = run_step(config(**kw), batch)
  tokens_step = run_step(config(micro_batch_tokens=2 * (PROMPT + COMPLETION), **kw), batch)
  assert_same_step(rows_step, tokens_step, masked="entropy_mask" in kw)
  if kw.get("objective") == "gspo":  # the sequence ratios left 1 and met the clip
    assert rows_step[0]["clip_frac_low"] + rows_step[0]["clip_frac_high"] > 0


def test_token_micro_batches_on_the_data_parallel_mesh():
  batch = longtail_batch(rows=64)
  mesh = make_mesh(data=4, model=2)
  kw = dict(entropy_mask=EntropyMaskConfig(kind="clip_b", mu_low=0.5), mini_batches=2)
  rows_step = run_step(config(**kw), batch)
  cfg = config(micro_batch_tokens=PROMPT + COMPLETION, **kw)  # one packed row, rounded up to 4
  learner = Learner(shard_model(tiny_model(), mesh), cfg, mesh=mesh)
  plan = learner.token_plan(batch)
  assert plan.shape[2] == 4 and plan.sharding.spec[2] == "data"  # packed rows over the 4 data devices
  assert plan.shape[1] >= 2  # several micro-batches per mini-batch
  assert_same_step(rows_step, run_step(cfg, batch, mesh), masked=True)


def test_a_wrong_aggregation_would_be_caught():
  """The comparison's tolerance is far below what a normalisation mistake changes."""
  batch = longtail_batch()
  token_mean = run_step(config(micro_batch_tokens=2 * (PROMPT + COMPLETION)), batch)
  seq_mean = run_step(config(loss_agg="seq-mean-token-mean"), batch)
  with pytest.raises(AssertionError):
    assert_same_step(seq_mean, token_mean)


def test_micro_batch_tokens_is_validated():
  with pytest.raises(ValueError, match="learner.micro_batch_tokens must be a positive integer or null, got 0"):
    LearnerConfig(micro_batch_tokens=0)
  with pytest.raises(ValueError, match="learner.micro_batch_tokens"):
    LearnerConfig(micro_batch_tokens=2.5)


def test_lower_step_takes_the_largest_token_plan():
  """``rft-jax plan`` compiles the step without data: the plan is abstract, as if every row were full."""
  model = tiny_model()
  batch = longtail_batch()
  learner = Learner(model, config(micro_batch_tokens=2 * (PROMPT + COMPLETION), mini_batches=2))
  plan = learner.abstract_token_plan(batch)
  assert plan.shape == (2, 8, 2, PROMPT + COMPLETION)  # 16 rows per mini-batch, 2 per micro-batch
  compiled = learner.lower_step(learner.init(model), batch).compile()
  assert compiled.memory_analysis() is not None


def test_a_run_config_with_token_micro_batches_needs_only_mini_batches_to_divide_the_rollouts():
  from rft_jax.train.config import ConfigError, load_config

  required = ["model.path=/m", "data.train_path=/d.jsonl"]
  # 7 rows per micro-batch does not divide the rollouts; with token micro-batches it is unused.
  cfg = load_config(None, required + ["learner.micro_batch_size=7", "learner.micro_batch_tokens=4096"])
  assert cfg.learner.micro_batch_tokens == 4096
  rollouts = cfg.data.prompts_per_step * cfg.sampling.n
  with pytest.raises(ConfigError, match="learner.mini_batches"):
    load_config(None, required + [f"learner.mini_batches={rollouts + 1}", "learner.micro_batch_tokens=4096"])
  with pytest.raises(ConfigError, match="learner.micro_batch_tokens must be a positive integer or null, got -1"):
    load_config(None, required + ["learner.micro_batch_tokens=-1"])
