"""Unlikeliness reward (He, Fried, Welleck 2025, arXiv 2506.02355) against the authors' code.

``authors_rank_penalty`` transcribes, line for line in torch, the rank-penalty part of
``RayPPOTrainer._compute_advantages`` in ``verl/trainer/ppo/ray_lean_trainer.py`` of
github.com/AndreHe02/rewarding-unlikely-release (commit ca1cff0, Apache-2.0), up to
``modified_scores``; its ``masked_mean`` is verl's (``verl/utils/torch_functional.py``).
``np_unlikeliness`` is written directly from the formula
``r_i * (1 - beta * rank_i / G)``, rank 0 = lowest mean token log-prob, for correct samples.
"""

from collections import defaultdict

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from rft_jax.rl.advantages.unlikeliness import likelihood_ranks, mean_token_logp, unlikeliness_rewards


def verl_masked_mean(values, mask, axis=None):
  valid_values = torch.where(mask.bool(), values, 0.0)
  s = (valid_values * mask).sum(axis=axis)
  return s / (mask.sum(axis=axis) + 1e-8)


def authors_rank_penalty(scores, index, old_log_probs, eos_mask, rank_penalty):
  old_log_probs = verl_masked_mean(old_log_probs, eos_mask, axis=-1)
  modified_scores = scores.clone()
  with torch.no_grad():
    bsz = scores.shape[0]
    id_to_indices = defaultdict(list)
    for i in range(bsz):
      id_to_indices[index[i]].append(i)
    for idx, indices in id_to_indices.items():
      group_indices = torch.tensor(indices, device=scores.device)
      group_scores = scores[group_indices]
      group_old_log_probs = old_log_probs[group_indices]
      group_ranks = torch.argsort(torch.argsort(group_old_log_probs))
      group_ranks = group_ranks / len(group_indices)
      group_scores = group_scores * (1 - group_ranks * rank_penalty)
      modified_scores[group_indices] = group_scores
  return modified_scores


def np_unlikeliness(rewards, correct, seq_logp, beta):
  out = rewards.astype(np.float64).copy()
  G, n = rewards.shape
  for g in range(G):
    for i in range(n):
      if correct[g, i]:
        rank = sum(seq_logp[g, j] < seq_logp[g, i] for j in range(n))
        out[g, i] = rewards[g, i] * (1.0 - beta * rank / n)
  return out


def binary_batch(seed, G=5, n=8, T=12):
  rng = np.random.default_rng(seed)
  correct = rng.random((G, n)) < 0.5
  rewards = correct.astype(np.float32)
  token_logp = -rng.gamma(2.0, 0.5, size=(G * n, T)).astype(np.float32)
  lengths = rng.integers(1, T + 1, size=G * n)
  mask = (np.arange(T)[None, :] < lengths[:, None]).astype(np.int64)
  return rewards, correct, token_logp, mask


@pytest.mark.parametrize("beta", [0.25, 1.0])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_matches_authors_code_on_binary_rewards(beta, seed):
  rewards, correct, token_logp, mask = binary_batch(seed)
  G, n = rewards.shape
  index = np.repeat(np.arange(G), n)
  ref = authors_rank_penalty(
      torch.tensor(rewards.reshape(-1)), index, torch.tensor(token_logp), torch.tensor(mask), beta
  )
  seq_logp = mean_token_logp(jnp.asarray(token_logp), jnp.asarray(mask)).reshape(G, n)
  out = unlikeliness_rewards(jnp.asarray(rewards), jnp.asarray(correct), seq_logp, beta_rank=beta)
  np.testing.assert_allclose(np.asarray(out).reshape(-1), ref.numpy(), rtol=1e-6, atol=1e-7)
  assert not np.allclose(np.asarray(out), rewards)  # the penalty did act


def test_mean_token_logp_matches_verl_masked_mean():
  _, _, token_logp, mask = binary_batch(3)
  ref = verl_masked_mean(torch.tensor(token_logp), torch.tensor(mask), axis=-1)
  out = mean_token_logp(jnp.asarray(token_logp), jnp.asarray(mask))
  np.testing.assert_allclose(np.asarray(out), ref.numpy(), rtol=1e-6)


@pytest.mark.parametrize("beta", [0.1, 0.25, 0.9])
def test_matches_numpy_formula_with_graded_rewards(beta):
  rng = np.random.default_rng(4)
  G, n = 6, 7
  correct = rng.random((G, n)) < 0.6
  rewards = np.where(correct, rng.uniform(0.5, 2.0, (G, n)), rng.uniform(-1.0, 0.3, (G, n))).astype(np.float32)
  seq_logp = rng.normal(size=(G, n)).astype(np.float32)
  out = unlikeliness_rewards(jnp.asarray(rewards), jnp.asarray(correct), jnp.asarray(seq_logp), beta_rank=beta)
  np.testing.assert_allclose(np.asarray(out), np_unlikeliness(rewards, correct, seq_logp, beta), rtol=1e-6)


def test_incorrect_samples_unchanged_and_beta_zero_is_identity():
  rng = np.random.default_rng(5)
  rewards = rng.normal(size=(4, 6)).astype(np.float32)
  correct = rng.random((4, 6)) < 0.5
  seq_logp = rng.normal(size=(4, 6)).astype(np.float32)
  out = np.asarray(unlikeliness_rewards(jnp.asarray(rewards), jnp.asarray(correct), jnp.asarray(seq_logp), beta_rank=0.5))
  np.testing.assert_array_equal(out[~correct], rewards[~correct])
  assert not np.allclose(out[correct], rewards[correct])
  out0 = np.asarray(unlikeliness_rewards(jnp.asarray(rewards), jnp.asarray(correct), jnp.asarray(seq_logp), beta_rank=0.0))
  np.testing.assert_array_equal(out0, rewards)


def test_least_likely_keeps_full_reward_and_order_follows_likelihood():
  rng = np.random.default_rng(6)
  G, n, beta = 8, 8, 0.5
  rewards = np.ones((G, n), np.float32)
  correct = np.ones((G, n), bool)
  correct[:, 1::3] = False
  seq_logp = rng.normal(size=(G, n)).astype(np.float32)
  out = np.asarray(unlikeliness_rewards(jnp.asarray(rewards), jnp.asarray(correct), jnp.asarray(seq_logp), beta_rank=beta))
  for g in range(G):
    c = np.flatnonzero(correct[g])
    least = c[np.argmin(seq_logp[g, c])]
    if np.argmin(seq_logp[g]) == least:  # least likely of the whole group: full reward
      assert out[g, least] == 1.0
    else:  # an incorrect sample is less likely: its rank still counts (authors' code)
      assert out[g, least] < 1.0
    # among correct samples, a more likely sample gets a strictly smaller reward
    by_logp = c[np.argsort(seq_logp[g, c])]
    assert np.all(np.diff(out[g, by_logp]) < 0)
    most = np.argmax(seq_logp[g])
    if correct[g, most]:
      np.testing.assert_allclose(out[g, most], 1 - beta * (n - 1) / n, rtol=1e-6)


def test_least_likely_correct_sample_below_an_incorrect_one():
  """All samples are ranked: with one less likely incorrect sample, rank 1 -> factor 1 - beta/G."""
  rewards = jnp.array([[1.0, 0.0, 1.0, 1.0]])
  correct = jnp.array([[True, False, True, True]])
  seq_logp = jnp.array([[-0.5, -3.0, -1.0, -0.1]])
  out = np.asarray(unlikeliness_rewards(rewards, correct, seq_logp, beta_rank=0.4))
  np.testing.assert_allclose(out, [[1 - 0.4 * 2 / 4, 0.0, 1 - 0.4 * 1 / 4, 1 - 0.4 * 3 / 4]], rtol=1e-6)


def test_ties_are_broken_by_position():
  seq_logp = jnp.array([[-1.0, -2.0, -1.0, -1.0, -2.0]])
  np.testing.assert_array_equal(np.asarray(likelihood_ranks(seq_logp)), [[2, 0, 3, 4, 1]])
  out = np.asarray(unlikeliness_rewards(jnp.ones((1, 5)), jnp.ones((1, 5), bool), seq_logp, beta_rank=0.5))
  np.testing.assert_allclose(out, [[1 - 0.5 * r / 5 for r in (2, 0, 3, 4, 1)]], rtol=1e-6)


def test_jit_matches_eager():
  rewards, correct, token_logp, mask = binary_batch(8)
  seq_logp = mean_token_logp(jnp.asarray(token_logp), jnp.asarray(mask)).reshape(rewards.shape)
  args = (jnp.asarray(rewards), jnp.asarray(correct), seq_logp)
  eager = unlikeliness_rewards(*args, beta_rank=0.25)
  jitted = jax.jit(lambda r, c, s: unlikeliness_rewards(r, c, s, beta_rank=0.25))(*args)
  np.testing.assert_array_equal(np.asarray(eager), np.asarray(jitted))
