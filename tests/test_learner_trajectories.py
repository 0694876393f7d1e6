"""The learner on multi-turn trajectories: the environment's tokens (response mask 0 inside the
completion, attention 1) are read but take no part in anything the learner computes over the
model's tokens.

* The update and every metric are the same whatever the sampler's log-probabilities say at the
  environment's tokens (with the rollout correction's importance weights, rejection, Clip_B and a
  KL penalty on, each of which would read them if it did not skip those tokens), and whatever
  advantage a per-token algorithm gives them.
* The per-completion entropy and S_* are the means over the model's tokens of a forward pass.
* Token-budget micro-batches (packing) give the update of row micro-batches.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rft_jax.entropy import token_stats
from rft_jax.rl.config import EntropyMaskConfig, RolloutCorrectionConfig
from rft_jax.rl.learner import Learner
from test_learner import COMPLETION, PROMPT, config, synthetic_batch, tiny_model

B = 16


def trajectory_batch(model, seed=0):
  """``synthetic_batch``'s rollouts with columns 3-5 and 7 of the completion of every other row
  turned into an environment's tokens (fixed ids, response mask 0)."""
  batch, _ = synthetic_batch(model, b=B, seed=seed)
  env = np.zeros(batch.input_ids.shape, bool)
  env[::2, PROMPT + 3:PROMPT + 6] = True
  env[::2, PROMPT + 7] = True
  ids = np.where(env, 7, np.asarray(batch.input_ids))
  response = np.asarray(batch.response_mask) * ~env
  # the model's own log-probs of its tokens after the environment's (on-policy where it drew)
  logp = jax.nn.log_softmax(model(jnp.asarray(ids)), -1)
  taken = np.take_along_axis(np.asarray(logp[:, :-1]), ids[:, 1:, None], -1)[..., 0]
  sampler = np.concatenate([np.zeros((B, 1)), taken], 1) * response
  return batch.replace(input_ids=jnp.asarray(ids), response_mask=jnp.asarray(response),
                       sampler_logp=jnp.asarray(sampler, jnp.float32)), env


def learner_config(**kw):
  return config(micro_batch_size=4, max_grad_norm=None, lr=1e-2, forecast_every=1,
                entropy_mask=EntropyMaskConfig(kind="clip_b", mu_low=0.5, samples="all"),
                rollout_correction=RolloutCorrectionConfig(
                    importance_sampling="token", rejection="token_k1", rejection_bounds="0.5_2.0"),
                kl_coef=0.1, **kw)


def step(batch, **kw):
  """One learner step from a fresh copy of the model (the step donates its state)."""
  model = tiny_model()
  learner = Learner(model, learner_config(**kw))
  state, metrics, rows = learner.step(learner.init(model), batch, rows=True)
  return learner.model(state), metrics, rows


def assert_same(a, b, atol=0.0):
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=atol, rtol=0)


@pytest.fixture(scope="module")
def model():
  return tiny_model()


def test_nothing_reads_the_environment_tokens_sampler_log_probs(model):
  batch, env = trajectory_batch(model)
  garbage = batch.replace(sampler_logp=jnp.where(jnp.asarray(env), -30.0, batch.sampler_logp))
  new_a, metrics_a, rows_a = step(batch)
  new_b, metrics_b, rows_b = step(garbage)
  assert_same(jax.tree.leaves(new_a), jax.tree.leaves(new_b))
  assert metrics_a == metrics_b
  assert_same(rows_a, rows_b)
  assert metrics_a["response_tokens"] == float(np.sum(batch.response_mask))


def test_nothing_reads_the_environment_tokens_advantages(model):
  batch, env = trajectory_batch(model)
  per_token = jnp.broadcast_to(batch.advantages[:, None], batch.input_ids.shape)
  garbage = jnp.where(jnp.asarray(env), 50.0, per_token)
  new_a, metrics_a, _ = step(batch.replace(advantages=per_token))
  new_b, metrics_b, _ = step(batch.replace(advantages=garbage))
  assert_same(jax.tree.leaves(new_a), jax.tree.leaves(new_b))
  assert metrics_a == metrics_b


def test_row_statistics_are_means_over_the_model_tokens(model):
  batch, env = trajectory_batch(model)
  _, _, rows = step(batch)
  logits = model(batch.input_ids)[:, PROMPT - 1:-1]
  targets = batch.input_ids[:, PROMPT:]
  stats = token_stats(logits, targets)
  mask = np.asarray(batch.response_mask[:, PROMPT:]) > 0
  for name, values in (("entropy_mean", stats.entropy), ("s_star_mean", stats.s_star)):
    want = np.sum(np.where(mask, values, 0), 1) / mask.sum(1)
    np.testing.assert_allclose(rows[name], want, atol=2e-5)
  aligned = rows["token_entropy"][:, PROMPT:]  # [B, L], aligned with input_ids
  np.testing.assert_allclose(aligned, np.where(mask, stats.entropy, 0.0), atol=2e-5)
  with_env = np.sum(np.asarray(stats.entropy), 1) / COMPLETION
  assert not np.allclose(rows["entropy_mean"][::2], with_env[::2], atol=1e-4)


def test_packed_token_micro_batches_give_the_row_micro_batches_update(model):
  batch, _ = trajectory_batch(model)
  rows_update, _, _ = step(batch)
  packed, _, _ = step(batch, micro_batch_tokens=4 * (PROMPT + COMPLETION))
  assert_same(jax.tree.leaves(rows_update), jax.tree.leaves(packed), atol=2e-5)  # lr 1e-2: rounding
