"""Advantages, the clipped surrogate, KL estimators and loss aggregation vs numpy."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rft_jax.rl.advantages import group as adv_lib
from rft_jax.rl import losses


def test_grpo_advantages_unbiased_std_and_variants():
  rng = np.random.default_rng(0)
  rewards = rng.integers(0, 2, size=(6, 4)).astype(np.float32)
  rewards[0] = 1.0  # zero-variance group -> advantages 0, no NaN
  got = adv_lib.compute_advantages(jnp.asarray(rewards.reshape(-1)), 4, "grpo").reshape(6, 4)
  want = (rewards - rewards.mean(1, keepdims=True)) / (rewards.std(1, ddof=1, keepdims=True) + 1e-6)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
  assert np.all(np.asarray(got[0]) == 0)
  biased = adv_lib.compute_advantages(jnp.asarray(rewards.reshape(-1)), 4, "grpo", ddof=0).reshape(6, 4)
  np.testing.assert_allclose(biased, (rewards - rewards.mean(1, keepdims=True)) / (rewards.std(1, keepdims=True) + 1e-6), rtol=1e-5, atol=1e-6)
  dr = adv_lib.compute_advantages(jnp.asarray(rewards.reshape(-1)), 4, "drgrpo").reshape(6, 4)
  np.testing.assert_allclose(dr, rewards - rewards.mean(1, keepdims=True), atol=1e-6)
  rloo = adv_lib.compute_advantages(jnp.asarray(rewards.reshape(-1)), 4, "rloo").reshape(6, 4)
  loo = np.stack([rewards[:, i] - np.delete(rewards, i, axis=1).mean(1) for i in range(4)], axis=1)
  np.testing.assert_allclose(rloo, loo, atol=1e-6)


def test_advantage_errors_name_the_problem():
  with pytest.raises(ValueError, match="unknown advantage estimator 'gae'"):
    adv_lib.compute_advantages(jnp.zeros(8), 4, "gae")
  with pytest.raises(ValueError, match="do not split into groups of 3"):
    adv_lib.compute_advantages(jnp.zeros(8), 3)
  with pytest.raises(ValueError, match="more than 1 completions"):
    adv_lib.compute_advantages(jnp.zeros(8), 1)


def numpy_ppo(logp, old, a, eps_low, eps_high, dual):
  r = np.exp(np.clip(logp - old, -20, 20))
  j = np.minimum(r * a, np.clip(r, 1 - eps_low, 1 + eps_high) * a)
  if dual is not None:
    j = np.where(a < 0, np.maximum(j, dual * a), j)
  return -j, r


def random_rollout(seed, b=8, t=12):
  rng = np.random.default_rng(seed)
  old = rng.normal(-2, 1, size=(b, t)).astype(np.float32)
  logp = (old + rng.normal(0, 0.4, size=(b, t))).astype(np.float32)
  a = np.repeat(rng.normal(size=(b, 1)), t, 1).astype(np.float32)
  lengths = rng.integers(0, t + 1, size=b)
  lengths[0] = t
  mask = (np.arange(t)[None] < lengths[:, None]).astype(np.float32)
  return logp, old, a, mask


@pytest.mark.parametrize("dual", [None, 3.0])
def test_ppo_clipped_loss_matches_numpy(dual):
  logp, old, a, mask = random_rollout(1)
  terms = jax.jit(lambda *x: losses.ppo_clipped_loss(*x, eps_low=0.2, eps_high=0.28, dual_clip=dual))(logp, old, a)
  want, r = numpy_ppo(logp, old, a, 0.2, 0.28, dual)
  np.testing.assert_allclose(terms.loss, want, rtol=1e-5, atol=1e-6)
  np.testing.assert_array_equal(terms.clipped_low, (a < 0) & (r < 0.8))
  np.testing.assert_array_equal(terms.clipped_high, (a > 0) & (r > 1.28))
  assert terms.clipped_low.any() and terms.clipped_high.any()
  if dual is not None:
    np.testing.assert_array_equal(terms.clipped_dual, (a < 0) & (r > dual))


def test_on_policy_ratio_is_one_and_nothing_is_clipped():
  logp, _, a, _ = random_rollout(2)
  terms = losses.ppo_clipped_loss(logp, logp, a, eps_low=0.2, eps_high=0.2)
  np.testing.assert_array_equal(terms.ratio, 1.0)
  assert not terms.clipped_low.any() and not terms.clipped_high.any()


def test_log_ratio_is_clamped_before_exp():
  terms = losses.ppo_clipped_loss(jnp.array([[500.0]]), jnp.array([[0.0]]), jnp.array([[1.0]]))
  assert np.isfinite(terms.ratio).all() and float(terms.ratio[0, 0]) == pytest.approx(np.exp(20.0), rel=1e-5)


def numpy_aggregate(loss, mask, mode, max_len):
  token_sum = (loss * mask).sum(-1)
  n_seq = max((mask.sum(-1) > 0).sum(), 1)
  if mode == "token-mean":
    return token_sum.sum() / mask.sum()
  if mode == "seq-mean-token-mean":
    return (token_sum / np.maximum(mask.sum(-1), 1)).sum() / n_seq
  if mode == "seq-mean-token-sum":
    return token_sum.sum() / n_seq
  return token_sum.sum() / (n_seq * max_len)


@pytest.mark.parametrize("mode", losses.AGGREGATIONS)
def test_aggregation_matches_numpy_and_micro_batches_sum_to_the_batch(mode):
  logp, old, a, mask = random_rollout(3, b=16)
  norm = losses.loss_normaliser(mask, max_len=20)

  def batch_loss(logp, old, a, mask):
    return losses.aggregate_loss(losses.ppo_clipped_loss(logp, old, a).loss, mask, mode, norm)

  want = numpy_aggregate(numpy_ppo(logp, old, a, 0.2, 0.2, None)[0], mask, mode, 20)
  assert float(batch_loss(logp, old, a, mask)) == pytest.approx(want, rel=1e-5)

  grad = jax.jit(jax.grad(batch_loss))
  full = grad(logp, old, a, mask)
  micro = jnp.concatenate([grad(*(x[i:i + 4] for x in (logp, old, a, mask))) for i in range(0, 16, 4)])
  np.testing.assert_allclose(micro, full, rtol=1e-6, atol=1e-9)
  # normalising per micro-batch (the bug) gives a different gradient
  per_micro = jnp.concatenate([
      jax.grad(lambda l, o, a_, m: losses.aggregate_loss(losses.ppo_clipped_loss(l, o, a_).loss, m, mode,
                                                         losses.loss_normaliser(m, max_len=20)))(
          *(x[i:i + 4] for x in (logp, old, a, mask))) for i in range(0, 16, 4)])
  assert not np.allclose(per_micro, full, rtol=1e-3)


def test_unknown_aggregation_and_kl_estimator():
  norm = losses.loss_normaliser(jnp.ones((1, 2)))
  with pytest.raises(ValueError, match="unknown loss aggregation 'token_mean'"):
    losses.aggregate_loss(jnp.ones((1, 2)), jnp.ones((1, 2)), "token_mean", norm)
  with pytest.raises(ValueError, match="unknown KL estimator 'k4'"):
    losses.kl_penalty(jnp.zeros(2), jnp.zeros(2), "k4")
  with pytest.raises(ValueError, match="dual_clip must be > 1"):
    losses.ppo_clipped_loss(jnp.zeros(2), jnp.zeros(2), jnp.zeros(2), dual_clip=0.5)


def test_kl_estimators_match_numpy_and_are_unbiased():
  rng = np.random.default_rng(4)
  logp, ref = rng.normal(-2, 1, 100).astype(np.float32), rng.normal(-2, 1, 100).astype(np.float32)
  lr = ref - logp
  for name, want in {"k1": -lr, "k2": 0.5 * lr**2, "k3": np.exp(lr) - 1 - lr}.items():
    np.testing.assert_allclose(losses.kl_penalty(jnp.asarray(logp), jnp.asarray(ref), name), want, rtol=1e-5, atol=1e-6)
  # Monte Carlo: k1 and k3 estimate KL(p || q) without bias for samples of p.
  p = np.array([0.5, 0.3, 0.2]); q = np.array([0.2, 0.5, 0.3])
  samples = rng.choice(3, size=400_000, p=p)
  exact = float(np.sum(p * np.log(p / q)))
  for name in ("k1", "k3"):
    est = losses.kl_penalty(jnp.log(jnp.asarray(p))[samples], jnp.log(jnp.asarray(q))[samples], name)
    assert float(jnp.mean(est)) == pytest.approx(exact, abs=3e-3)
  assert float(jnp.min(losses.kl_penalty(jnp.asarray(logp), jnp.asarray(ref), "k3"))) >= 0
