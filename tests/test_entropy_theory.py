"""Theorems 1-2 and Corollaries 1-4 of arXiv 2602.03392, checked exactly in float64.

Every function under test is wrapped in ``jax.jit``; hypothesis draws moderate and
extreme logits (spreads up to 1e4, entries at -inf). Shapes come from a small fixed
set so that compilation stays cheap.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from rft_jax import entropy as E
from rft_jax.entropy.identities import discriminator_scale

VOCABS = (2, 5, 33)


@pytest.fixture(autouse=True)
def float64():
  with jax.enable_x64(True):
    yield


@st.composite
def logits_and_token(draw, extreme=True):
  """A row of logits (moderate, spread up to 1e4, or partly -inf) and a token id."""
  v = draw(st.sampled_from(VOCABS))
  kind = draw(st.sampled_from(["moderate", "spread", "masked"] if extreme else ["moderate"]))
  scale = {"moderate": 4.0, "spread": 1e4, "masked": 50.0}[kind]
  z = draw(st.lists(st.floats(-scale, scale), min_size=v, max_size=v))
  z = np.array(z, np.float64)
  if kind == "masked":
    drop = np.array(draw(st.lists(st.booleans(), min_size=v, max_size=v)))
    drop[int(np.argmax(z))] = False  # at least one finite logit
    z = np.where(drop, -np.inf, z)
  k = draw(st.integers(0, v - 1))
  return jnp.asarray(z), k


def close(a, b, z, rtol=1e-12):
  """|a - b| <= rtol * scale, relative to the magnitude of the terms of S at z."""
  return float(jnp.max(jnp.abs(a - b))) <= rtol * float(discriminator_scale(z))


entropy_jvp = jax.jit(E.entropy_jvp)
discriminator = jax.jit(E.discriminator)
expected_discriminator = jax.jit(E.expected_discriminator)
entropy = jax.jit(E.entropy)
softmax_jacobian = jax.jit(jax.jacobian(jax.nn.softmax))
first_order_prob_update = jax.jit(E.first_order_prob_update)


@given(logits_and_token())
def test_theorem1_single_logit_update_is_minus_s_star(case):
  z, k = case
  s = discriminator(z)
  e_k = jax.nn.one_hot(k, z.shape[-1], dtype=z.dtype)
  exact = entropy_jvp(z, e_k)
  predicted = jax.jit(E.first_order_logit_update)(z, jnp.array(k), 1.0)
  assert close(exact, predicted, z)
  assert float(predicted) == pytest.approx(-float(s[k]), rel=1e-12, abs=1e-15)  # last bit on GPU


@given(logits_and_token())
def test_theorem2_grpo_step_is_minus_centred_score(case):
  z, k = case
  s = discriminator(z)
  p = jax.nn.softmax(z)
  e_k = jax.nn.one_hot(k, z.shape[-1], dtype=z.dtype)
  exact = entropy_jvp(z, e_k - p)
  predicted = jax.jit(E.first_order_grpo_update)(z, jnp.array(k), 1.0)
  assert close(exact, predicted, z)
  assert close(predicted, -(s[k] - expected_discriminator(z)), z)


@given(logits_and_token(), st.floats(-3, 3))
def test_lemma1_first_order_prob_update_is_the_softmax_jacobian(case, scale):
  z, _ = case
  dz = scale * jnp.cos(jnp.arange(z.shape[-1], dtype=z.dtype) * 1.7)
  jacobian = softmax_jacobian(z)
  got = first_order_prob_update(z, dz)
  assert float(jnp.max(jnp.abs(got - jacobian @ dz))) <= 1e-14 * max(1.0, abs(scale))
  assert float(jnp.abs(jnp.sum(got))) <= 1e-14 * max(1.0, abs(scale))  # mass is conserved


@jax.jit
def curvature_and_forecast_errors(z, d):
  """d^2H along d, and the first-order forecast's error at eps = 1e-4 and 5e-5."""
  curvature = jax.jvp(lambda y: E.entropy_jvp(y, d), (z,), (d,))[1]
  slope = E.entropy_jvp(z, d)
  errors = [E.entropy(z + eps * d) - E.entropy(z) - eps * slope for eps in (1e-4, 5e-5)]
  return curvature, *errors


@given(logits_and_token(extreme=False), st.sampled_from(["logit", "grpo"]))
def test_first_order_error_is_second_order(case, update):
  """Halving the step divides the forecast's error by ~4 (O(eps^2) remainder)."""
  z, k = case
  e_k = jax.nn.one_hot(k, z.shape[-1], dtype=z.dtype)
  d = e_k if update == "logit" else e_k - jax.nn.softmax(z)
  curvature, error, half_step_error = map(float, curvature_and_forecast_errors(z, d))
  assume(abs(curvature) > 1e-2)
  assert 3.8 < error / half_step_error < 4.2
  assert error == pytest.approx(0.5e-8 * curvature, rel=0.05)  # eps^2 / 2 * d^2H


@given(logits_and_token())
def test_corollary1_centred_score_has_zero_mean_under_p(case):
  z, _ = case
  s = discriminator(z)
  p = jax.nn.softmax(z)
  centered = s - expected_discriminator(z)
  assert close(jnp.sum(p * centered), 0.0, z)
  assert close(jnp.sum(s), 0.0, z, rtol=1e-13)  # sum_i S_i = 0


@given(logits_and_token(), st.lists(st.floats(-3, 3), min_size=33, max_size=33))
def test_corollary1_1_off_policy_with_importance_ratio(case, behaviour):
  """Sampling from p' and weighting by r = p / p' keeps the expectation at zero."""
  z, _ = case
  v = z.shape[-1]
  p_behaviour = jax.nn.softmax(jnp.asarray(behaviour[:v]))
  s = discriminator(z)
  p = jax.nn.softmax(z)
  r = p / p_behaviour
  centered = s - expected_discriminator(z)
  assert close(jnp.sum(p_behaviour * r * centered), 0.0, z)


def test_corollary2_batch_mean_of_sampled_centred_scores_vanishes():
  """Tokens sampled from p at many positions: the batch mean of S_* - E_p[S] is 0
  up to Monte-Carlo error, and is not 0 when tokens come from another distribution."""
  key_z, key_k, key_q = jax.random.split(jax.random.key(0), 3)
  z = 2.0 * jax.random.normal(key_z, (200_000, 8), jnp.float64)
  k = jax.random.categorical(key_k, z)
  centered = jax.jit(E.centered_token_discriminator)(z, k)
  standard_error = float(jnp.std(centered)) / np.sqrt(z.shape[0])
  assert abs(float(jnp.mean(centered))) < 4 * standard_error
  greedy = jnp.argmax(z, axis=-1)  # a biased "sampler": the mean is far from 0
  assert float(jnp.mean(E.centered_token_discriminator(z, greedy))) > 50 * standard_error
  del key_q


@given(logits_and_token(), st.lists(st.floats(-2, 2), min_size=33, max_size=33), st.floats(1e-3, 1))
def test_corollary3_expected_change_is_minus_lr_covariance(case, advantage, lr):
  z, _ = case
  v = z.shape[-1]
  a = jnp.asarray(advantage[:v])
  p = jax.nn.softmax(z)
  s = discriminator(z)
  centered = s - expected_discriminator(z)
  # E_{k~p}[Delta H] from summing Theorem 2 (alpha_k = lr * A_k) over the vocabulary.
  per_token = jax.jit(E.first_order_grpo_update)(jnp.broadcast_to(z, (v, v)), jnp.arange(v), lr * a)
  expected_change = jnp.sum(p * per_token)
  mean_a = jnp.sum(p * a)
  covariance = jnp.sum(p * (a - mean_a) * centered)  # Cov_{k~p}(A, S_k - E_p[S])
  assert close(expected_change / lr, -covariance, z)


def test_corollary4_batch_forecast_matches_tabular_grpo_step():
  """A GRPO step on a batch of independent positions (tabular logits): the mean
  entropy change equals -lr * Cov_B(A, r S_c) to O(lr^2) when A has zero batch mean,
  and batch_entropy_change is exactly that covariance over the valid tokens."""
  key = jax.random.key(1)
  kz, kk, ka, kr, km = jax.random.split(key, 5)
  n, v, lr = 4096, 16, 1e-4
  z = 2.0 * jax.random.normal(kz, (n, v), jnp.float64)
  k = jax.random.categorical(kk, z)
  mask = jax.random.bernoulli(km, 0.8, (n,))
  raw = jax.random.normal(ka, (n,), jnp.float64) + 0.5 * E.token_discriminator(z, k)
  a = raw - E.masked_mean(raw, mask)  # zero mean over valid tokens
  ratio = jnp.exp(0.1 * jax.random.normal(kr, (n,), jnp.float64))
  centered = E.centered_token_discriminator(z, k)

  forecast = jax.jit(E.batch_entropy_change)(a, centered, mask, lr, ratio)
  p = jax.nn.softmax(z)
  step = lr * (ratio * a)[:, None] * (jax.nn.one_hot(k, v, dtype=z.dtype) - p)
  measured = E.masked_mean(E.entropy(z + step) - E.entropy(z), mask)
  assert float(forecast) == pytest.approx(float(measured), rel=1e-3)

  valid = np.asarray(mask)
  reference = -lr * np.cov(np.asarray(a)[valid], np.asarray(ratio * centered)[valid], bias=True)[0, 1]
  assert float(forecast) == pytest.approx(reference, rel=1e-10)
  # on-policy (ratio None) is ratio 1
  assert float(E.batch_entropy_change(a, centered, mask, lr)) == pytest.approx(
      float(E.batch_entropy_change(a, centered, mask, lr, jnp.ones(n))), rel=1e-12
  )


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float64])
def test_extreme_logits_give_finite_statistics(dtype):
  big = 1e4 if dtype == jnp.float64 else 3e4
  z = jnp.array(
      [[big, -big, 0.0, 1.0], [0.0, -jnp.inf, -jnp.inf, 2.0], [-big, -big, -big, big],
       [1.0, 1.0, 1.0, 1.0]],
      dtype,
  )
  k = jnp.array([1, 1, 3, 0])
  out = [
      jax.jit(E.entropy)(z), jax.jit(E.discriminator)(z), jax.jit(E.expected_discriminator)(z),
      jax.jit(E.token_discriminator)(z, k), jax.jit(E.entropy_jvp)(z, jax.nn.one_hot(k, 4, dtype=z.dtype)),
      jax.jit(jax.grad(lambda z: E.entropy(z).sum()))(z),
  ]
  for x in out:
    assert bool(jnp.all(jnp.isfinite(x))), x
  for x in out[:-1]:  # statistics in >= float32; the gradient has the input's dtype
    assert x.dtype == jnp.promote_types(dtype, jnp.float32)
  h = out[0]
  assert float(h[0]) == 0.0 and float(h[2]) == 0.0  # one-hot rows
  assert float(h[3]) == pytest.approx(np.log(4.0), rel=1e-6)  # uniform row


def test_near_one_hot_discriminator_keeps_top_log_prob():
  """log p_top must not round to 0 when the tail mass is below float32 epsilon:
  S_top = p_top (H + log p_top) sits below H by about the tail mass."""
  z = jnp.array([0.0, -20.0, -21.0, -25.0], jnp.float32)  # tail mass ~3e-9 < eps32
  tail = float(np.sum(np.exp(np.asarray(z[1:], np.float64))))
  exact = E.token_discriminator(z.astype(jnp.float64), jnp.array(0))
  got = E.token_discriminator(z, jnp.array(0))
  assert got.dtype == jnp.float32
  assert float(got) == pytest.approx(float(exact), rel=1e-5)
  assert float(got) < float(E.entropy(z)) - 0.5 * tail  # log p_top < 0 survived


def test_vectorised_over_leading_axes():
  z = jax.random.normal(jax.random.key(2), (3, 4, 11), jnp.float64)
  k = jax.random.randint(jax.random.key(3), (3, 4), 0, 11)
  assert E.entropy(z).shape == (3, 4)
  assert E.discriminator(z).shape == (3, 4, 11)
  assert E.token_discriminator(z, k).shape == (3, 4)
  assert E.expected_discriminator(z).shape == (3, 4)
  assert E.entropy_jvp(z, z).shape == (3, 4)
  flat = E.token_discriminator(z.reshape(12, 11), k.reshape(12))
  # GPU reductions may be ordered differently for the two shapes: equal to the last few bits
  np.testing.assert_allclose(np.asarray(flat).reshape(3, 4), np.asarray(E.token_discriminator(z, k)),
                             rtol=1e-12, atol=1e-15)
