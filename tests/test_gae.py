"""GAE, whitening, clipped value loss and outcome rewards against verl 0.9.1 on identical tensors.

``verl_*`` below transcribe, line for line in torch, verl 0.9.1 (Apache-2.0;
``pip download --no-deps verl==0.9.1``):
``verl/utils/torch_functional.py`` ``clip_by_value``, ``masked_var``, ``masked_whiten``
(``masked_sum``, ``masked_mean`` and ``agg_loss``'s token-mean: ``tests/verl_reference.py``); ``verl/trainer/ppo/core_algos.py``
``compute_gae_advantage_return``, ``compute_value_loss`` and the ``token-mean`` branch of
``agg_loss`` (dp_size=1, batch_num_tokens=None); ``verl/workers/reward_manager/naive.py``
``NaiveRewardManager.__call__``'s reward placement. ``np_gae`` is an independent loop written
from Schulman et al. 2016's recursion over the valid positions of each row.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from verl_reference import verl_agg_loss_token_mean, verl_masked_mean

from rft_jax.rl.advantages.gae import clipped_value_loss, gae_advantages, masked_whiten, outcome_token_rewards
from rft_jax.rl.losses import aggregate_loss, loss_normaliser


# ----------------------------------------------------------------------------- verl transcription
def verl_clip_by_value(x, tensor_min, tensor_max):
  clipped = torch.max(torch.min(x, tensor_max), tensor_min)
  return clipped


def verl_masked_var(values, mask, unbiased=True):
  mean = verl_masked_mean(values, mask)
  centered_values = values - mean
  variance = verl_masked_mean(centered_values**2, mask)
  if unbiased:
    mask_sum = mask.sum()
    if mask_sum == 0:
      raise ValueError("At least one element in the mask has to be 1.")
    if mask_sum == 1:
      raise ValueError("The sum of the mask is one, which can cause a division by zero.")
    bessel_correction = mask_sum / (mask_sum - 1)
    variance = variance * bessel_correction
  return variance


def verl_masked_whiten(values, mask, shift_mean=True):
  mean, var = verl_masked_mean(values, mask), verl_masked_var(values, mask)
  whitened = (values - mean) * torch.rsqrt(var + 1e-8)
  if not shift_mean:
    whitened += mean
  return whitened


def verl_compute_gae_advantage_return(token_level_rewards, values, response_mask, gamma, lam):
  with torch.no_grad():
    nextvalues = 0
    lastgaelam = 0
    advantages_reversed = []
    gen_len = token_level_rewards.shape[-1]

    for t in reversed(range(gen_len)):
      delta = token_level_rewards[:, t] + gamma * nextvalues - values[:, t]
      lastgaelam_ = delta + gamma * lam * lastgaelam

      # skip values and TD-error on observation tokens
      nextvalues = values[:, t] * response_mask[:, t] + (1 - response_mask[:, t]) * nextvalues
      lastgaelam = lastgaelam_ * response_mask[:, t] + (1 - response_mask[:, t]) * lastgaelam

      advantages_reversed.append(lastgaelam)
    advantages = torch.stack(advantages_reversed[::-1], dim=1)

    returns = advantages + values
    advantages = verl_masked_whiten(advantages, response_mask)
  return advantages, returns


def verl_compute_value_loss(vpreds, returns, values, response_mask, cliprange_value):
  vpredclipped = verl_clip_by_value(vpreds, values - cliprange_value, values + cliprange_value)
  vf_losses1 = (vpreds - returns) ** 2
  vf_losses2 = (vpredclipped - returns) ** 2
  clipped_vf_losses = torch.max(vf_losses1, vf_losses2)
  vf_loss = 0.5 * verl_agg_loss_token_mean(loss_mat=clipped_vf_losses, loss_mask=response_mask)
  vf_clipfrac = verl_masked_mean(torch.gt(vf_losses2, vf_losses1).float(), response_mask)
  return vf_loss, vf_clipfrac


def verl_naive_reward_placement(scores, attention_mask_response):
  """NaiveRewardManager: reward_tensor[i, valid_response_length - 1] = reward."""
  reward_tensor = torch.zeros(attention_mask_response.shape, dtype=torch.float32)
  for i in range(len(scores)):
    valid_response_length = attention_mask_response[i].sum()
    reward = scores[i]
    reward_tensor[i, valid_response_length - 1] = reward
  return reward_tensor


# ----------------------------------------------------------------------------- helpers
def np_gae(rewards, values, mask, gamma, lam):
  """Schulman et al. 2016 over each row's valid positions (V and A are 0 past the last one)."""
  B, T = rewards.shape
  adv = np.zeros((B, T), np.float64)
  for b in range(B):
    idx = [t for t in range(T) if mask[b, t]]
    next_v, next_a = 0.0, 0.0
    for t in reversed(idx):
      delta = rewards[b, t] + gamma * next_v - values[b, t]
      next_a = delta + gamma * lam * next_a
      next_v = values[b, t]
      adv[b, t] = next_a
  return adv


def right_padded_mask(rng, B, T, min_len=1):
  lengths = rng.integers(min_len, T + 1, size=B)
  lengths[0] = T  # one full row
  return (np.arange(T)[None, :] < lengths[:, None]).astype(np.int64)


def holey_mask(rng, B, T):
  """Right padding plus zeros in the middle of rows (observation tokens)."""
  m = right_padded_mask(rng, B, T, min_len=3)
  holes = rng.random((B, T)) < 0.25
  holes[:, 0] = False
  m = np.where(holes, 0, m)
  return m


def data(seed, B=6, T=13, holes=False):
  rng = np.random.default_rng(seed)
  mask = holey_mask(rng, B, T) if holes else right_padded_mask(rng, B, T)
  rewards = rng.normal(size=(B, T)).astype(np.float32)
  values = rng.normal(size=(B, T)).astype(np.float32)
  return rewards, values, mask


GAMMA_LAM = [(1.0, 1.0), (0.99, 0.95)]

# gamma and lam traced: one compilation per shape, not per (gamma, lam) (keeps the file fast)
gae_jit = jax.jit(gae_advantages, static_argnames=("whiten",))


# ----------------------------------------------------------------------------- GAE
@pytest.mark.parametrize("gamma,lam", GAMMA_LAM)
@pytest.mark.parametrize("holes", [False, True])
@pytest.mark.parametrize("seed", [0, 1])
def test_gae_matches_verl_everywhere(gamma, lam, holes, seed):
  rewards, values, mask = data(seed, holes=holes)
  ref_adv, ref_ret = verl_compute_gae_advantage_return(
      torch.tensor(rewards), torch.tensor(values), torch.tensor(mask), gamma, lam
  )
  adv, ret = gae_jit(jnp.asarray(rewards), jnp.asarray(values), jnp.asarray(mask), gamma=gamma, lam=lam)
  # every position, padded ones included: the masking semantics are verl's
  np.testing.assert_allclose(np.asarray(ret), ref_ret.numpy(), rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(np.asarray(adv), ref_adv.numpy(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("gamma,lam", GAMMA_LAM)
@pytest.mark.parametrize("holes", [False, True])
def test_gae_matches_numpy_loop_on_valid_positions(gamma, lam, holes):
  rewards, values, mask = data(7, B=5, T=17, holes=holes)
  adv, ret = gae_jit(jnp.asarray(rewards), jnp.asarray(values), jnp.asarray(mask), gamma=gamma, lam=lam, whiten=False)
  ref = np_gae(rewards.astype(np.float64), values.astype(np.float64), mask, gamma, lam)
  valid = mask.astype(bool)
  np.testing.assert_allclose(np.asarray(adv)[valid], ref[valid], rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(np.asarray(ret)[valid], (ref + values)[valid], rtol=1e-5, atol=1e-5)
  # right padding carries a zero advantage
  trailing = np.cumsum(mask[:, ::-1], axis=1)[:, ::-1] == 0
  assert np.all(np.asarray(adv)[trailing] == 0)


def test_gae_gamma_lam_one_is_reward_to_go_minus_value():
  """With gamma = lam = 1, A_t = sum_{s >= t} r_s - V_t over the valid positions."""
  rewards, values, mask = data(3)
  adv, _ = gae_jit(jnp.asarray(rewards), jnp.asarray(values), jnp.asarray(mask), whiten=False)
  r = rewards * mask
  to_go = np.cumsum(r[:, ::-1], axis=1)[:, ::-1]
  valid = mask.astype(bool)
  np.testing.assert_allclose(np.asarray(adv)[valid], (to_go - values)[valid], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("holes", [False, True])
def test_gae_padded_entries_do_not_reach_valid_positions(holes):
  rewards, values, mask = data(11, holes=holes)
  pad = mask == 0
  assert pad.any()
  base = gae_jit(jnp.asarray(rewards), jnp.asarray(values), jnp.asarray(mask), gamma=0.99, lam=0.95)
  rng = np.random.default_rng(5)
  r2 = np.where(pad, rng.normal(size=rewards.shape) * 100, rewards).astype(np.float32)
  v2 = np.where(pad, np.nan, values).astype(np.float32)
  adv2, ret2 = gae_jit(jnp.asarray(r2), jnp.asarray(v2), jnp.asarray(mask), gamma=0.99, lam=0.95)
  valid = ~pad
  np.testing.assert_array_equal(np.asarray(adv2)[valid], np.asarray(base[0])[valid])
  np.testing.assert_array_equal(np.asarray(ret2)[valid], np.asarray(base[1])[valid])


def test_gae_jit_matches_eager():
  rewards, values, mask = data(4, holes=True)
  args = (jnp.asarray(rewards), jnp.asarray(values), jnp.asarray(mask))
  eager = gae_advantages(*args, gamma=0.99, lam=0.95)
  jitted = jax.jit(lambda r, v, m: gae_advantages(r, v, m, gamma=0.99, lam=0.95))(*args)
  for a, b in zip(eager, jitted):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-6)


def test_gae_whitened_valid_advantages_are_standardised():
  rewards, values, mask = data(8)
  adv, _ = gae_jit(jnp.asarray(rewards), jnp.asarray(values), jnp.asarray(mask), gamma=0.99, lam=0.95)
  a = np.asarray(adv)[mask.astype(bool)]
  assert abs(a.mean()) < 1e-5
  assert abs(a.std(ddof=1) - 1.0) < 1e-4


# ----------------------------------------------------------------------------- whitening
@pytest.mark.parametrize("shift_mean", [True, False])
@pytest.mark.parametrize("holes", [False, True])
def test_masked_whiten_matches_verl(shift_mean, holes):
  x, _, mask = data(21, B=7, T=11, holes=holes)
  x = x * 3.0 + 1.5
  ref = verl_masked_whiten(torch.tensor(x), torch.tensor(mask), shift_mean=shift_mean)
  out = masked_whiten(jnp.asarray(x), jnp.asarray(mask), shift_mean=shift_mean)
  np.testing.assert_allclose(np.asarray(out), ref.numpy(), rtol=1e-5, atol=1e-5)


def test_masked_whiten_uses_unbiased_variance():
  x = np.array([[1.0, 2.0, 4.0, 99.0]], np.float32)
  mask = np.array([[1, 1, 1, 0]])
  out = np.asarray(masked_whiten(jnp.asarray(x), jnp.asarray(mask)))
  v = np.array([1.0, 2.0, 4.0])
  expected = (v - v.mean()) / np.sqrt(v.var(ddof=1) + 1e-8)
  np.testing.assert_allclose(out[0, :3], expected, rtol=1e-6)
  biased = (v - v.mean()) / np.sqrt(v.var(ddof=0) + 1e-8)
  assert not np.allclose(out[0, :3], biased, rtol=1e-3)


def test_masked_whiten_single_valid_entry_is_finite():
  """verl raises for one valid token; under jit the Bessel factor is dropped instead."""
  out = np.asarray(masked_whiten(jnp.asarray([[3.0, 5.0]]), jnp.asarray([[1, 0]])))
  assert out[0, 0] == 0.0 and np.all(np.isfinite(out))
  with pytest.raises(ValueError):
    verl_masked_whiten(torch.tensor([[3.0, 5.0]]), torch.tensor([[1, 0]]))


# ----------------------------------------------------------------------------- value loss
@pytest.mark.parametrize("clip_range", [0.2, 0.5])
@pytest.mark.parametrize("seed", [0, 1])
def test_value_loss_matches_verl(clip_range, seed):
  rng = np.random.default_rng(100 + seed)
  B, T = 6, 15
  mask = holey_mask(rng, B, T) if seed else right_padded_mask(rng, B, T)
  v_old = rng.normal(size=(B, T)).astype(np.float32)
  v_new = (v_old + rng.normal(size=(B, T)) * 0.6).astype(np.float32)
  ret = rng.normal(size=(B, T)).astype(np.float32)
  ref_loss, ref_frac = verl_compute_value_loss(
      torch.tensor(v_new), torch.tensor(ret), torch.tensor(v_old), torch.tensor(mask), clip_range
  )
  terms = clipped_value_loss(
      jnp.asarray(v_new), jnp.asarray(v_old), jnp.asarray(ret), jnp.asarray(mask), clip_range=clip_range
  )
  m = jnp.asarray(mask)
  loss = aggregate_loss(terms.loss, m, "token-mean", loss_normaliser(m))
  np.testing.assert_allclose(float(loss), ref_loss.item(), rtol=1e-5)
  frac = float(jnp.sum(terms.clipped)) / mask.sum()
  np.testing.assert_allclose(frac, ref_frac.item(), rtol=1e-6)
  assert 0.0 < frac < 1.0  # both branches exercised
  # per token: 0.5 * max of the two squared errors, written out independently
  clipped_v = np.clip(v_new, v_old - clip_range, v_old + clip_range)
  per_tok = 0.5 * np.maximum((v_new - ret) ** 2, (clipped_v - ret) ** 2)
  valid = mask.astype(bool)
  np.testing.assert_allclose(np.asarray(terms.loss)[valid], per_tok[valid], rtol=1e-6)
  assert np.all(np.asarray(terms.loss)[~valid] == 0) and not np.any(np.asarray(terms.clipped)[~valid])


def test_value_loss_inside_clip_is_plain_half_squared_error():
  v_old = jnp.zeros((1, 3))
  v_new = jnp.array([[0.1, -0.2, 0.05]])
  ret = jnp.array([[1.0, 2.0, -3.0]])
  terms = clipped_value_loss(v_new, v_old, ret, jnp.ones((1, 3)), clip_range=0.5)
  np.testing.assert_allclose(np.asarray(terms.loss), 0.5 * np.asarray(v_new - ret) ** 2, rtol=1e-6)
  assert not np.any(np.asarray(terms.clipped))


# ----------------------------------------------------------------------------- outcome rewards
def test_outcome_rewards_match_verl_placement():
  rng = np.random.default_rng(9)
  mask = right_padded_mask(rng, 8, 10)
  scores = rng.normal(size=8).astype(np.float32)
  ref = verl_naive_reward_placement(torch.tensor(scores), torch.tensor(mask))
  out = outcome_token_rewards(jnp.asarray(scores), jnp.asarray(mask))
  np.testing.assert_array_equal(np.asarray(out), ref.numpy())


def test_outcome_rewards_last_valid_token_and_empty_row():
  mask = np.array([[1, 1, 0, 1, 0], [0, 0, 0, 0, 0], [1, 1, 1, 1, 1]])
  out = np.asarray(outcome_token_rewards(jnp.array([2.0, 3.0, -1.0]), jnp.asarray(mask)))
  expected = np.zeros((3, 5), np.float32)
  expected[0, 3] = 2.0
  expected[2, 4] = -1.0
  np.testing.assert_array_equal(out, expected)


def test_outcome_rewards_through_gae_lambda_one():
  """Outcome reward r at the last token with gamma = lam = 1: A_t = r - V_t on valid tokens."""
  rng = np.random.default_rng(12)
  mask = right_padded_mask(rng, 4, 9)
  scores = rng.normal(size=4).astype(np.float32)
  values = rng.normal(size=(4, 9)).astype(np.float32)
  tok = outcome_token_rewards(jnp.asarray(scores), jnp.asarray(mask))
  adv, ret = gae_jit(tok, jnp.asarray(values), jnp.asarray(mask), whiten=False)
  valid = mask.astype(bool)
  expected = np.broadcast_to(scores[:, None], values.shape) - values
  np.testing.assert_allclose(np.asarray(adv)[valid], expected[valid], rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(np.asarray(ret)[valid], np.broadcast_to(scores[:, None], values.shape)[valid], rtol=1e-5, atol=1e-6)
